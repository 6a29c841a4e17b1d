"""One verdict on every rank: problems collected per phase, agreed in one collective, raised everywhere.

A restore runs in phases (open and plan; read and check). Each phase runs under `Problems.guard`,
which turns *any* exception on this rank into a problem that names the rank and the exception type,
so that a rank never leaves the protocol early and its peers never wait in a collective for it.
At the end of a phase `agree` makes one fixed-size ``all_reduce`` (a problem flag plus the plan's
coverage digest and the buffer fingerprint); only when something is wrong do the ranks exchange
their problem lists (``all_gather_object``), so every rank raises the same `RestoreError` text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .buffers import FINGERPRINT_MODULUS
from .check import DIGEST_PRIME, coverage_digest
from .errors import RestoreError

_LABELS = {
    "error": "errors", "missing": "missing from the checkpoint", "unexpected": "unexpected in the checkpoint",
    "shape": "shape mismatches", "dtype": "dtype mismatches", "unrestored": "not restored (still NaN / not covered)",
    "unsupported": "unsupported layouts", "buffers": "non-persistent buffers (held by no checkpoint) that are wrong",
    "coverage": "plan: the ranks' reads do not cover these tensors exactly (a planner bug)",
}
_HINTS = {
    "missing": "check prefix= (the subtree holding the weights) or pass strict=False to restore the keys that match",
    "unexpected": "check prefix= (the subtree holding the weights) or pass strict=False to restore the keys that match",
    "buffers": "the model was probably built on the meta device and materialized with to_empty(): call"
               " fsdp_restore.init_non_persistent_buffers(model) (Hugging Face rotary embeddings, modules with"
               " reset_buffers()), re-run your own buffer initialisation, or build these modules on the real"
               " device; pass check_buffers=False if they are meant to differ",
}
_PER_RANK = ("error", "unrestored", "buffers")  # kinds whose items may differ between ranks


@dataclass
class Problems:
    """This rank's problems in one phase, by kind."""

    items: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, texts: Sequence[str]) -> None:
        if texts:
            self.items.setdefault(kind, []).extend(texts)

    def update(self, problems: dict[str, list[str]]) -> None:
        for kind, texts in problems.items():
            self.add(kind, texts)

    def __bool__(self) -> bool:
        return any(self.items.values())

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Any exception inside becomes an "error" problem naming its type (not KeyboardInterrupt)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every failure must reach the verdict, whatever it is
            text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip() or "(no message)"
            self.add("error", [f"{type(e).__name__}: {text}"])


def _rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def new_problems() -> Problems:
    return Problems()


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, group=group)
    return t.cpu().tolist()


def agree(problems: Problems, what: str, group: dist.ProcessGroup | None = None, *,
          coverage: dict[str, tuple[int, int]] | None = None,
          buffer_prints: list[tuple[str, int]] | None = None) -> None:
    """Raise the same `RestoreError` on every rank if any rank has a problem, the ranks' plans do not
    cover every tensor exactly (``coverage``: `check.coverage_terms`), or a non-persistent buffer
    differs between ranks (``buffer_prints``). Every rank calls it at the same point of the protocol."""
    _, world = _rank(group)
    d1, d2 = coverage_digest(coverage or {})
    fp = sum(_print_weight(i) * v for i, (_, v) in enumerate(sorted(buffer_prints or []))) % FINGERPRINT_MODULUS
    values = [int(bool(problems)), d1, d2, fp, fp * fp]
    flag, s1, s2, f1, f2 = _all_reduce(values, group) if world > 1 else values
    if flag:
        _raise(_gather(problems, group) if world > 1 else dict(problems.items), what)
    if s1 % DIGEST_PRIME or s2 % DIGEST_PRIME:
        _raise({"coverage": _uncovered_names(coverage or {}, group, world)}, what)
    if world * f2 != f1 * f1:  # equal iff every rank's fingerprint is the same (Cauchy-Schwarz)
        _raise({"buffers": _differing_buffers(buffer_prints or [], group, world)}, what)


def _print_weight(i: int) -> int:
    return (2654435761 * (i + 1)) % FINGERPRINT_MODULUS or 1


def _all_gathered(obj: object, group: dist.ProcessGroup | None, world: int) -> list:
    """Every rank's ``obj`` (only on the failure path: its size grows with the world size)."""
    if world == 1:
        return [obj]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _uncovered_names(coverage: dict[str, tuple[int, int]], group: dist.ProcessGroup | None, world: int) -> list[str]:
    """The tensors whose coverage terms do not sum to zero over the ranks."""
    totals: dict[str, list[int]] = {}
    for terms in _all_gathered(coverage, group, world):
        for name, (a, b) in terms.items():
            t = totals.setdefault(name, [0, 0])
            t[0] += a
            t[1] += b
    return sorted(n for n, (a, b) in totals.items() if a or b) or ["(the digest differs, no single tensor does)"]


def _differing_buffers(prints: list[tuple[str, int]], group: dist.ProcessGroup | None, world: int) -> list[str]:
    values: dict[str, set[int]] = {}
    for rank_prints in _all_gathered(prints, group, world):
        for name, v in rank_prints:
            values.setdefault(name, set()).add(v)
    return [f"{n} differs between ranks" for n, vs in sorted(values.items()) if len(vs) > 1] or [
        "(the ranks hold different sets of buffers)"]


def _gather(problems: Problems, group: dist.ProcessGroup | None) -> dict[str, list[str]]:
    """Every rank's problems merged, in rank order; per-rank kinds are tagged with the ranks that saw them."""
    gathered = _all_gathered(problems.items, group, dist.get_world_size(group))
    by_text: dict[str, dict[str, list[int]]] = {}
    for rank, items in enumerate(gathered):
        for kind, texts in (items or {}).items():
            bucket = by_text.setdefault(kind, {})
            for text in texts:
                ranks = bucket.setdefault(text, [])
                if rank not in ranks:
                    ranks.append(rank)
    world = len(gathered)
    merged: dict[str, list[str]] = {}
    for kind, texts in by_text.items():
        merged[kind] = [f"{text} [{_ranks_text(ranks, world)}]" if kind in _PER_RANK else text
                        for text, ranks in texts.items()]
    return merged


def _ranks_text(ranks: list[int], world: int) -> str:
    if len(ranks) == world and world > 1:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _raise(problems: dict[str, list[str]], what: str, limit: int = 20) -> None:
    """Raise one `RestoreError` listing every kind of problem (first ``limit`` of each)."""
    problems = {k: v for k, v in problems.items() if v}
    if not problems:
        return
    lines = [f"{what} failed:"]
    hints = []
    for kind, items in problems.items():
        shown = ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
        lines.append(f"  {_LABELS.get(kind, kind)} ({len(items)}): {shown}")
        hint = _HINTS.get(kind)
        if hint and hint not in hints:
            hints.append(hint)
    lines.extend(f"  hint: {h}" for h in hints)
    raise RestoreError("\n".join(lines), problems)
