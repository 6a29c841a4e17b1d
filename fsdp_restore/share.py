"""One write made by several processes: each writes its share of the output's blocks into the one file.

`convert(..., process_group=...)` runs on every rank of a process group (``torchrun``: one process per node,
or several per node); every rank parses the source and lays out the same output, then writes every
``world``-th block of it (`Share.mine`), reading only those blocks' source bytes. Rank 0 creates the
temporary file (or directory of shards) and, once every rank has written and fsynced its blocks, joins the
ranks' checksums, patches the header, and renames the temporary over the destination, as a single process
does (`write.write_safetensors`).

Each step runs on every rank under `Share.step`: an exception on any rank becomes the same `ConvertError` on
every rank at the end of that step, so that no rank waits in a collective for a rank that has given up, and
rank 0 removes the temporary. A conversion has a few ranks (nodes), so a step's agreement is one
``all_gather_object`` of each rank's ``(failed, message)``; the restore's verdicts (verdict.py) use
fixed-size all-reduces instead because a restore runs on thousands of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import ConvertError, process_group_argument

if TYPE_CHECKING:  # imported where a share of several processes uses it: a conversion alone never does
    import torch.distributed as dist

T = TypeVar("T")


@dataclass
class Share:
    """This rank's part in a write made by ``world`` processes of ``group``."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Share:
        """The share of the calling process in ``group`` (None: the default group, which must exist)."""
        import torch.distributed as dist

        process_group_argument(group)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group: torch.distributed is not initialized; call init_process_group first"
                             " (torchrun does it for the CLI), or pass no process_group to convert in one process")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def mine(self, items: list[T]) -> list[T]:
        """Every ``world``-th item, starting at this rank's index: item 0 (a file's header block) is rank 0's."""
        return items[self.rank::self.world]

    def first(self, value: T, what: str = "exchange") -> T:
        """Rank 0's ``value`` on every rank (a small picklable object); a peer that died is a `ConvertError`."""
        box = [value]
        if self.world > 1:
            import torch.distributed as dist

            with _collective(what):
                dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def gather(self, value: T, what: str = "exchange") -> list[T]:
        """Every rank's ``value`` (small, picklable), in rank order, on every rank; a peer that died is a
        `ConvertError`."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        with _collective(what):
            dist.all_gather_object(out, value, group=self.group)
        return out

    def step(self, what: str, fn: Callable[[], T]) -> T | None:
        """Run ``fn`` on this rank, then agree: if it raised on any rank, raise one `ConvertError` on every rank,
        naming the step, the failing ranks and the first failure's message. Returns ``fn``'s result. In a share
        of one process there is nobody to agree with: ``fn``'s own exception propagates."""
        if self.world == 1:
            return fn()
        result: T | None = None
        failure = ""
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every failure must reach the agreement below, on every rank
            failure = f"{type(e).__name__}: {e}"
        reports = self.gather(failure, what)
        failed = [r for r, text in enumerate(reports) if text]
        if failed:
            ranks = ", ".join(map(str, failed[:8])) + (" ..." if len(failed) > 8 else "")
            raise ConvertError(f"convert ({what}) failed on rank(s) {ranks} of {self.world}: {reports[failed[0]]}")
        return result

    def _global(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)


DIED_NOTE = "nothing was put at the destination"


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """A collective that fails (a peer died or lost its connection) as a `ConvertError` naming the step, not
    torch's RuntimeError about sockets. Callers past the point where the output may be in place say so instead
    of `DIED_NOTE` (`write.write_safetensors`)."""
    try:
        yield
    except RuntimeError as e:  # DistBackendError, DistNetworkError and gloo's errors all derive from it
        text = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
        raise ConvertError(f"convert ({what}): a rank died or lost its connection, or did not make this call"
                           f" ({type(e).__name__}: {text}); {DIED_NOTE} (every rank of the process group must"
                           " run the conversion)") from None
