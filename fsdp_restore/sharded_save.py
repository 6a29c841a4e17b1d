"""Save from the sharded model: every rank writes its own bytes of one unsharded checkpoint, no gather.

The mirror of restore.py; this module only orchestrates, in phases with one verdict each (verdict.py), so
that a failure anywhere becomes the same `SaveError` on every rank and nobody waits in a collective for a
rank that has given up:

0. rank 0 sends ``extra`` and the temporary's name to every rank (a broadcast: each rank holds it once, at any
   world size); then one ``all_gather_object`` of each rank's arguments (ranks called differently are told
   which argument differs) and of the layout of its optimizer state where ranks may hold state for different
   parameters (FSDP1 with ``use_orig_params`` keeps none for a parameter of which a rank holds no element).
1. plan (save_plan.py): the header from the model on every rank, this rank's write items. Rank 0 creates
   the temporary next to the destination and preallocates it. Agree: no rank failed, every rank computed
   the same header (a digest), and the items of all ranks write every element of every tensor once
   (the restore's moment digest plus counts), in one all-reduce. Nothing is written before this.
2. every rank opens the temporary by name: a rank that does not see it is on another filesystem, which
   is refused (before a byte is written) with the fix. Agree.
3. every rank ``pwrite`` s its items (threads; GPU memory staged through pinned buffers in chunks) and
   fsyncs. Agree. With ``verify_checksums=True``, once every rank's writes are in the file, every rank reads
   back from the storage what it wrote (`_read_back`) and compares each chunk's rows with the crc32s taken of the
   bytes it wrote (a GPU shard's host copy). Agree.
4. the checksums: each rank's crc32 of its pieces folded per tensor (`_Crc`) and joined over the ranks
   in one all-reduce; rank 0 patches them into the header(s), fsyncs (``verify_checksums=True``: reads each
   header back from the storage), writes the index of a sharded set, renames the temporary over the
   destination and fsyncs the directory. Agree.

On any failure the temporary is removed; a checkpoint already under the final name is untouched (a reader
sees the old file or the new one: a single file is replaced with one ``rename``).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import hashlib
import io
import os
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import save_plan
from .checksum import crc32, strided_placed_crc, zeros_crc
from .errors import (FsdpRestoreError, RestoreError, SaveError, flag_argument, objects_argument,
                     on_unsupported_argument, process_group_argument, thread_count_argument)
from .execute import parts
from .format import DEFAULT_INDEX_NAME
from .jobs import shard_size_argument
from .mapped import preadv_exactly
from .restore import _no_cyclic_gc, _refuse_unsharded_fsdp1, _reshard_fsdp2
from .save_plan import WriteItem, WritePlan
from .shards import extra_state_modules
from .verdict import _HINTS, _LABELS, _collective, _device, _rank, agree, new_problems, problem_line
from .write import (CHUNK_BYTES, ReplacedError, _fsync_dir, _remove, _replace, _write_small_file, carry_kept_files,
                    check_destination, index_bytes, make_parent, refuse_foreign_directory, remove_stale_temporaries,
                    said_of_space, said_of_the_directory, temporary_name, tensor_bytes, through_link, with_checksums)

__all__ = ["SaveReport", "save_sharded"]


@dataclass
class SaveReport:
    """What `save_sharded` did on this rank."""

    path: str
    files: list[str]
    tensors: int
    nbytes: int  # tensor bytes of the whole checkpoint
    bytes_written: int  # tensor bytes this rank wrote
    items: int  # this rank's write items
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)  # plan, open, write, (verify,) commit
    checksums: dict[str, str] = field(default_factory=dict, repr=False)


# ---- crc32 of a tensor written in pieces by many ranks ---------------------------------------------------

class _Crc:
    """Per tensor, the XOR of its pieces' *linear parts*: crc32 is affine, ``crc(M) = L(M) ^ crc(0^|M|)``
    with ``L`` linear, and a piece ``s`` at byte ``o`` of an ``N``-byte tensor contributes
    ``L(0^o s 0^t) = L(s) x^(8t)`` (``t = N - o - |s|``; leading zeros add nothing). The pieces of all ranks
    tile the tensor, so its crc32 is the XOR of every rank's fold ``^ crc(0^N)``: each rank folds its own
    pieces in any order (threads), and the ranks join theirs with one all-reduce. Rows at a stride fold
    by Horner's rule (`checksum.strided_placed_crc`: past a few hundred rows, a table lookup each)."""

    def __init__(self) -> None:
        self.folds: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, key: str, row_crcs: Sequence[int], row_bytes: int, stride_bytes: int, trailing: int) -> None:
        """Rows of ``row_bytes`` each (crc32s ``row_crcs``), ``stride_bytes`` apart; ``trailing`` bytes of
        the tensor follow the last row."""
        acc = strided_placed_crc(row_crcs, row_bytes, stride_bytes, trailing)  # the restore's fold (tables
        # past a few hundred rows: a column block's thousands of rows cost a lookup each, not a multiplication)
        with self._lock:
            self.folds[key] = self.folds.get(key, 0) ^ acc


def _join_crcs(plan: WritePlan, crc: _Crc, group: dist.ProcessGroup | None, world: int) -> dict[str, str]:
    """Every tensor's crc32 on every rank: the ranks' folds XOR-ed by one all-reduce of their bits (a sum,
    taken mod 2: NCCL has no bitwise reduction)."""
    keys = list(plan.jobs)
    if world > 1:
        shifts = torch.arange(32, dtype=torch.int64)
        own = torch.tensor([crc.folds.get(k, 0) for k in keys] or [0], dtype=torch.int64)
        bits = ((own.unsqueeze(1) >> shifts) & 1).to(torch.int32)  # one row of 32 bits per tensor
        t = bits.to(_device(group))
        dist.all_reduce(t, group=group)
        parity = t.cpu().to(torch.int64) % 2
        folds = (parity << shifts).sum(dim=1).tolist()
    else:
        folds = [crc.folds.get(k, 0) for k in keys]
    return {k: f"{fold ^ zeros_crc(plan.jobs[k].nbytes):08x}" for k, fold in zip(keys, folds)}


# ---- writing -----------------------------------------------------------------------------------------------


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data)
    while view:  # pwrite may write less than asked
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a just-written range to disk now, asynchronously, and let its pages go once written
    (Linux's POSIX_FADV_DONTNEED starts writeback of dirty pages, then drops the clean ones), so that the
    writeback overlaps the copying instead of all waiting for the commit's fsync."""
    if hasattr(os, "posix_fadvise") and nbytes:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


class _Staging(threading.local):
    """Per thread: a pinned host buffer and a CUDA stream, reused for every chunk of GPU memory."""

    buf: torch.Tensor | None = None
    stream: Any = None


@dataclass(frozen=True)
class _Written:
    """One chunk this rank wrote, for `_read_back`: ``rows`` rows of ``row_bytes`` each, ``stride_bytes`` apart from
    byte ``offset`` of file ``file_index``, and a digest of their crc32s in order (`_rows_digest`)."""

    key: str
    file_index: int
    offset: int
    rows: int
    row_bytes: int
    stride_bytes: int
    digest: int


def _rows_digest(crcs: Sequence[int]) -> int:
    """The crc32 of a chunk's rows' crc32s, in order: four bytes a row, whatever the rows' size."""
    return zlib.crc32(array.array("I", crcs).tobytes())


def _write_items(plan: WritePlan, fds: list[int], threads: int, crc: _Crc,
                 written: list[_Written] | None = None) -> int:
    """Write this rank's items in chunks of at most `CHUNK_BYTES` on ``threads`` threads; fold the crc32
    of every chunk as it is written (and, given ``written``, record each chunk there for `_read_back`).
    Returns the bytes written."""
    tasks = []
    for item in plan.items:
        step = max(1, CHUNK_BYTES // item.data.element_size())
        for first, count, start, rows in parts(item.global_start, item.data.numel(), item.rows, item.stride, step):
            tasks.append((item, first, count, start, rows))
    tasks.sort(key=lambda t: plan.where[t[0].key][1] + t[3] * t[0].data.element_size())  # file order
    ready = None
    if any(i.data.device.type == "cuda" for i in plan.items):
        ready = {d: torch.cuda.current_stream(d).record_event()
                 for d in {i.data.device for i in plan.items if i.data.device.type == "cuda"}}
    staging = _Staging()

    def host(src: torch.Tensor) -> torch.Tensor:
        if src.device.type == "cpu":
            return src
        if src.device.type != "cuda":
            return src.to("cpu")
        nbytes = src.numel() * src.element_size()
        if staging.buf is None or staging.buf.numel() < nbytes:
            staging.buf = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8, pin_memory=True)
            staging.stream = torch.cuda.Stream(src.device)
        out = staging.buf[:nbytes].view(src.dtype)
        with torch.cuda.stream(staging.stream):
            staging.stream.wait_event(ready[src.device])  # the caller's kernels that wrote the shard
            out.copy_(src, non_blocking=True)
        staging.stream.synchronize()
        return out

    def write(task: tuple[WriteItem, int, int, int, int]) -> int:
        item, first, count, start, rows = task
        file_index, base = plan.where[item.key]
        fd, size = fds[file_index], item.data.element_size()
        data = memoryview(tensor_bytes(host(item.data[first:first + count])))  # (slices cheaper than numpy's)
        run_bytes = count * size // rows
        crcs = []
        offset, stride_bytes = base + start * size, item.stride * size
        for at in range(0, rows * run_bytes, run_bytes):  # a column block: a row each (kept lean, thousands of them)
            row = data[at:at + run_bytes]
            crcs.append(crc32(row))
            _pwrite_all(fd, row, offset)
            offset += stride_bytes
        last = (start + (rows - 1) * item.stride) * size + run_bytes
        crc.add(item.key, crcs, run_bytes, item.stride * size, plan.jobs[item.key].nbytes - last)
        first_byte = base + start * size
        if written is not None:  # (a list's append holds the GIL: the threads may share it)
            written.append(_Written(item.key, file_index, first_byte, rows, run_bytes, item.stride * size,
                                    _rows_digest(crcs)))
        start_writeback(fd, first_byte, last - start * size)
        return count * size

    if threads <= 1 or len(tasks) <= 1:
        return sum(write(t) for t in tasks)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(write, tasks))


def _read_back(paths: Sequence[Path], written: Sequence[_Written], threads: int) -> list[str]:
    """The tensors of which a chunk this rank wrote (and fsynced) does not read back from ``paths`` as the bytes it
    wrote: its rows' crc32s, taken again from the file, against those taken in memory before the write. The
    files' cached pages are dropped first (``POSIX_FADV_DONTNEED``: clean pages only, so another rank's unsynced
    writes stay) so that the bytes come from the storage where the kernel allows, not from this node's copy of
    what was written: a disk or file system that lost, misplaced or damaged a write shows, as does a bug in where
    the writer put a row."""
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(os.open(path, os.O_RDONLY))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_DONTNEED)
        buffers = threading.local()

        def damaged(chunk: _Written) -> str | None:
            if getattr(buffers, "data", None) is None or len(buffers.data) < chunk.row_bytes:
                buffers.data = bytearray(max(chunk.row_bytes, CHUNK_BYTES))
            row = memoryview(buffers.data)[:chunk.row_bytes]
            fd, crcs = fds[chunk.file_index], []
            for r in range(chunk.rows):
                try:
                    preadv_exactly(fd, [row], chunk.offset + r * chunk.stride_bytes)
                except EOFError:
                    return chunk.key  # the file lost its end
                crcs.append(crc32(row))
            return chunk.key if _rows_digest(crcs) != chunk.digest else None

        if threads <= 1 or len(written) <= 1:
            found = [damaged(chunk) for chunk in written]
        else:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                found = list(pool.map(damaged, written))
    finally:
        for fd in fds:
            os.close(fd)
    return sorted({key for key in found if key is not None})


def _stored_start(path: Path, nbytes: int) -> tuple[bytes | None, int]:
    """A file's first ``nbytes`` as the storage holds them (its cached pages dropped first, where the kernel
    allows; None where the file is shorter), and the file's size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        data = bytearray(nbytes)
        try:
            preadv_exactly(fd, [memoryview(data)], 0)
        except EOFError:
            return None, os.fstat(fd).st_size
        return bytes(data), os.fstat(fd).st_size
    finally:
        os.close(fd)


# ---- the temporary -------------------------------------------------------------------------------------------


def _temp_path(dst: Path, name: str) -> Path:
    return dst.parent / name


_fallocate = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


def preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes for the file (ENOSPC now, not mid-write) with Linux ``fallocate``; where the
    filesystem cannot (EOPNOTSUPP: some network filesystems) just set the size. Not ``posix_fallocate``:
    glibc emulates it there by writing a byte into every block, one system call per 4 KiB."""
    if _fallocate is not None and size:
        if _fallocate(fd, 0, 0, size) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code))
    os.ftruncate(fd, size)


def _create_temp(dst: Path, tmp: Path, plan: WritePlan, sharded: bool) -> None:
    """Rank 0: the temporary (a file, or a directory of shard files), every file preallocated to its final
    size (ENOSPC now, not mid-write) with its header, checksums still placeholders."""
    make_parent(dst)
    remove_stale_temporaries(dst)
    try:
        if sharded:
            tmp.mkdir()
    except OSError as e:
        raise said_of_the_directory(e, dst) from None
    for f in plan.files:
        try:
            fd = os.open(tmp / f.name if sharded else tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise said_of_the_directory(e, dst) from None
        try:
            preallocate(fd, f.size)
            _pwrite_all(fd, f.header, 0)
        except OSError as e:
            raise said_of_space(e, dst, sum(f.size for f in plan.files)) from None
        finally:
            os.close(fd)


VISIBLE_WITHIN_S = 5.0  # how long a rank waits for rank 0's new file to appear (network filesystems' caches)


def _open_when_seen(path: Path) -> int:
    """``open(path, O_WRONLY)``, retried for `VISIBLE_WITHIN_S` seconds: a network filesystem client may cache
    the directory's old listing for a moment (NFS attribute caching); listing the directory refreshes it."""
    deadline, pause = time.monotonic() + VISIBLE_WITHIN_S, 0.05
    while True:
        try:
            return os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            with contextlib.suppress(OSError):
                os.listdir(path.parent)
            time.sleep(pause)
            pause = min(1.0, pause * 2)


def _open_temp(tmp: Path, plan: WritePlan, sharded: bool, rank: int) -> list[int]:
    """Every rank: open each file of the temporary rank 0 created; a rank that does not see it does not
    share rank 0's filesystem."""
    fds: list[int] = []
    try:
        for f in plan.files:
            path = tmp / f.name if sharded else tmp
            try:
                fd = _open_when_seen(path)
            except FileNotFoundError:
                raise FsdpRestoreError(
                    f"rank {rank} does not see {path}, which rank 0 has just created: the ranks do not share one"
                    f" filesystem at {tmp.parent} (a node-local disk?), or it was given another directory than rank"
                    f" 0's. Every rank writes its own bytes into the"
                    " one file, so save to a path every rank sees (NFS, Lustre, GPFS, a cloud file store mounted"
                    " on every node)") from None
            fds.append(fd)
            size = os.fstat(fd).st_size
            if size != f.size:
                raise FsdpRestoreError(f"rank {rank} sees {path} with {size} bytes, rank 0 created it with {f.size}:"
                                       " the ranks do not share one filesystem")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _commit(dst: Path, tmp: Path, plan: WritePlan, sharded: bool, checksums: dict[str, str],
            fds: list[int], verify: bool = False) -> None:
    """Rank 0, once every rank has written and fsynced: the real checksums into the header(s), fsync, the index of a
    sharded set (``verify``: each header and the index read back from the storage), then the temporary in place of
    the destination."""
    for f, fd in zip(plan.files, fds):
        header = with_checksums(f.header, f.jobs, checksums)
        _pwrite_all(fd, header, 0)
        os.fsync(fd)
        if verify:
            path = tmp / f.name if sharded else tmp
            if _stored_start(path, len(header))[0] != header:
                shown = dst / f.name if sharded else dst  # (the temporary's name means nothing to the caller)
                raise FsdpRestoreError(f"{shown}: its header read back from the storage is not the one written"
                                       f" (verify_checksums=True): {_HINTS['written']}")
    if sharded:
        index = index_bytes(plan.output_files(), structure_json=plan.structure_json, metadata=plan.metadata)
        _write_small_file(tmp / DEFAULT_INDEX_NAME, index)
        _fsync_dir(tmp)
        if verify and _stored_start(tmp / DEFAULT_INDEX_NAME, len(index)) != (index, len(index)):
            raise FsdpRestoreError(f"{dst / DEFAULT_INDEX_NAME}: read back from the storage, it is not the index"
                                   f" written (verify_checksums=True): {_HINTS['written']}")
    refuse_foreign_directory(dst, one_file=not sharded)  # again: a file put there meanwhile is not ours to delete
    carry_kept_files(dst, tmp)
    _replace(tmp, dst)  # the writer's: one step, a reader finds the old version or the new one


# ---- the verdicts ----------------------------------------------------------------------------------------------


_DIFFERENT_DESTINATIONS = ("the ranks were given different destinations (a name computed on each rank, such as a"
                           " time stamp?): give every rank the same path, one every rank sees; nothing was written")
_DIFFERENT_HEADERS = ("the ranks computed different checkpoint headers (their models' shapes, dtypes, optimizer"
                      " state, its order or param groups differ, or they were called with different arguments, such"
                      " as max_shard_size or on_unsupported); nothing was written")


def _header_digest(plan: WritePlan) -> str:
    """What every rank must have computed alike: the structure and every file's name and header."""
    h = hashlib.blake2b(digest_size=8)
    h.update(plan.structure_json.encode())
    for f in plan.files:
        h.update(f.name.encode() + b"\0" + f.header)
    return h.hexdigest()


def _save_error(e: RestoreError, what: str, died_hint: str | None = None) -> SaveError:
    """The verdict's error in a save's words (the same text on every rank: the problems are agreed);
    ``died_hint``: what to say where a rank died (default: the final name is untouched)."""
    lines = [f"{what} failed:"]
    for kind, items in e.problems.items():
        if kind == "coverage":
            counts = [n.removesuffix(" (elements written)") for n in items if n.endswith(" (elements written)")]
            moments = [n for n in items if not n.endswith(" (elements written)")]
            if counts:
                lines.append("  " + problem_line("the ranks together do not write every element of these tensors"
                                                 " exactly once", counts))
            if moments:
                lines.append("  " + problem_line("the ranks' writes do not cover these tensors exactly (a piece"
                                                 " shifted, lost or doubled)", moments))
        else:
            lines.append("  " + problem_line(_LABELS.get(kind, kind), items, e.counts.get(kind)))
    if any(text.startswith("a rank died") for text in e.problems.get("error", [])):
        lines.append(f"  hint: {died_hint or _DIED_HINT}")
    for kind in ("replicas", "written"):
        if kind in e.problems:
            lines.append(f"  hint: {_HINTS[kind]}")
    return SaveError("\n".join(lines), e.problems, e.counts)


_DIED_HINT = ("every rank of the process group must call save_sharded (not only rank 0: a rank that waits elsewhere,"
              " in a barrier or another collective, leaves the others waiting here until the timeout); otherwise find"
              " the rank that died in its own log and exit status (killed, out of memory, a crash) or the broken"
              " connection, fix that and save again; the checkpoint under the final name is untouched (a temporary"
              " left by a rank 0 that died is removed by the next save or convert to that path on its machine)")
_DIED_AT_COMMIT_HINT = ("find the rank that died in its own log and exit status (killed, out of memory, a crash) or the"
                        " broken connection; rank 0 may have put the new checkpoint in place just before (it is"
                        " then whole: rank 0 renames only once every rank has written and fsynced its bytes):"
                        " fsdp-restore verify PATH shows which version is there")
_COMMITTED_HINT = ("the new checkpoint is in place and whole (this rank renamed it only once every rank had written"
                   " and fsynced its bytes); a rank died or lost its connection after that: find it in its own log")


@contextlib.contextmanager
def _exchange(what: str, step: str) -> Iterator[None]:
    """A collective outside the verdicts (rank 0's extra, the checksums): a peer that died makes it fail, and
    that failure is the same `SaveError` as the verdicts raise."""
    try:
        with _collective(what, step):
            yield
    except RestoreError as e:
        raise _save_error(e, what) from None


def _agree(problems: Any, what: str, group: dist.ProcessGroup | None,
           coverage: dict[str, tuple[int, int]] | None = None, header: str | None = None,
           died_hint: str | None = None, destination: str | None = None,
           replica_prints: list[tuple[str, int]] | None = None) -> None:
    # fixed slots, None where this rank has no value (it failed before it had one); the destination is the file's
    # name alone: a directory may be mounted under other paths on other nodes
    same = [(header, _DIFFERENT_HEADERS), (destination, _DIFFERENT_DESTINATIONS)]
    try:
        agree(problems, what, group, coverage=coverage, same=same, buffer_prints=replica_prints,
              prints_kind="replicas")
    except RestoreError as e:
        raise _save_error(e, what, died_hint) from None


# ---- the entry point ---------------------------------------------------------------------------------------------


DEFAULT_SAVE_THREADS = 4  # write threads per rank when save_sharded is given no thread_count


def _call_arguments(optimizer: Any, size: int | None, verify_checksums: bool,
                    on_unsupported: str, ignore_frozen_params: bool = False) -> dict[str, Any]:
    """The arguments of a save that every rank must give alike (``extra`` is rank 0's; ``thread_count`` is each
    rank's own)."""
    return {"optimizer": "given" if optimizer is not None else "None", "max_shard_size": size,
            "verify_checksums": verify_checksums, "on_unsupported": on_unsupported,
            "ignore_frozen_params": ignore_frozen_params}


def _differing_arguments(called_with: Sequence[dict[str, Any] | None]) -> str:
    """What the ranks gave differently (each argument, with its value per rank), or "" where they agree (a rank
    whose arguments were refused at the door, None here, is reported by its own error)."""
    given = [(rank, args) for rank, args in enumerate(called_with) if args is not None]
    if not given:
        return ""
    lines = []
    for name in given[0][1]:
        by_value: dict[str, list[int]] = {}
        for rank, args in given:
            by_value.setdefault(str(args[name]), []).append(rank)
        if len(by_value) > 1:
            each = [f"{value} on {_ranks_text(ranks)}" for value, ranks in by_value.items()]
            lines.append(f"{name}: " + "; ".join(each))
    if not lines:
        return ""
    return ("save_sharded was called with different arguments on different ranks (" + "; ".join(lines) + "): call it"
            " with the same ones on every rank (extra may differ: rank 0's is saved)")


def _ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _to_bytes(value: Any) -> bytes:
    """Rank 0's ``extra`` (and the write's names) for the other ranks, as ``torch.save`` writes it: tensors that share
    memory keep sharing it, and every dtype travels (Python's own pickle loses both). A value it cannot write (a
    lambda, a local class) is named by its key."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as e:  # noqa: BLE001 - whatever pickling raised: find the keys of extra that cause it
        extra = value[0] if isinstance(value, tuple) and isinstance(value[0], dict) else {}
        states = value[3] if isinstance(value, tuple) and len(value) > 3 and isinstance(value[3], dict) else {}
        bad = []
        for label, values in (("extra[{!r}]", extra), ("{} (a module's get_extra_state())", states)):
            for key, item in values.items():
                try:
                    torch.save(item, io.BytesIO())
                except Exception:  # noqa: BLE001
                    bad.append(label.format(key))
        raise FsdpRestoreError(f"{', '.join(bad) or 'extra'} cannot be saved ({type(e).__name__}: {e}): give values a"
                               " checkpoint can hold (tensors, numbers, strings, containers of those) in their"
                               " place") from None
    return buffer.getvalue()


def _from_bytes(payload: bytes) -> Any:
    """`_to_bytes`'s value, on another rank of the same job (its own peer's bytes: the user's objects, unpickled as
    the process that holds them would)."""
    return torch.load(io.BytesIO(payload), weights_only=False)


def _check_arguments(model: Any, path: Any, optimizer: Any, extra: Any, process_group: Any, max_shard_size: Any,
                     thread_count: Any, on_unsupported: Any, verify_checksums: Any = False,
                     ignore_frozen_params: Any = False) -> tuple[int | None, str | os.PathLike[str]]:
    """The shard size, and the path the save writes to (where a symbolic link at ``path`` points)."""
    objects_argument("save_sharded(model, path, optimizer=optimizer)", model, optimizer, optional=True)
    flag_argument("verify_checksums", verify_checksums)
    flag_argument("ignore_frozen_params", ignore_frozen_params)
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    path = through_link(path)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict (step, scheduler state, RNG states...) or None, not"
                        f" {type(extra).__name__}")
    on_unsupported_argument(on_unsupported)
    thread_count_argument(thread_count)  # the checks every entry point shares
    if isinstance(max_shard_size, bool):
        raise TypeError("max_shard_size must be a size (int bytes or a string such as '5GB') or None")
    size = shard_size_argument(max_shard_size)
    # an existing checkpoint is replaced, never a directory of other files
    check_destination(path, force=True, one_file=max_shard_size is None)
    return size, path


def save_sharded(model: nn.Module, path: str | os.PathLike[str], *, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None, process_group: dist.ProcessGroup | None = None,
                 max_shard_size: int | str | None = None, thread_count: int | None = None,
                 on_unsupported: str = "error", verify_checksums: bool = False,
                 ignore_frozen_params: bool = False) -> SaveReport:
    """Save a sharded model (and optimizer) into one unsharded checkpoint; call on every rank.

    Every rank writes its own bytes straight into the final file (no gather): the file is byte for byte
    what `convert` writes for ``torch.save({"model": full state dict, "optim": Optimizer.state_dict() of
    the unsharded model, **extra})``, so `restore`, `load`, `verify` and the CLI read it as any other.
    With ``optimizer=None`` and ``extra=None`` it is a plain weights file instead (keys without ``model.``,
    tied weights stored once), loadable by ``safetensors.torch.load_file`` and ``from_pretrained``.
    ``extra`` (step, ``scheduler.state_dict()``, RNG states, config) is taken from rank 0. ``max_shard_size``
    writes a directory of shards with a Hugging Face index instead of one file. ``ignore_frozen_params=True``
    leaves out the parameters that do not require grad, as torch's ``get_model_state_dict`` does with that option
    (buffers stay): a LoRA run's adapters, or a fine-tune's trained part, without the frozen base it started from
    (restore such a file with ``strict=False``).

    Works for FSDP2 (any DTensor layout: Shard(0), TP column blocks, 2-D meshes, HSDP), FSDP1
    (``use_orig_params`` either way, hybrid sharding), DDP and plain modules; a byte held by several ranks is
    written by one of them (a buffer by rank 0's replica: DDP ranks' BatchNorm statistics differ). The header
    is computed on every rank and agreed, and the ranks' writes are proven to cover every element exactly once
    before a byte is written; the file is written under a temporary name
    in the destination's directory (which every rank must see: a shared filesystem), fsynced by every rank,
    and only then renamed over ``path``. Any failure on any rank raises the same `SaveError` on every rank,
    removes the temporary and leaves an existing checkpoint at ``path`` untouched. ``thread_count``: write
    threads per rank (default 4). ``on_unsupported="skip"`` stores a value of ``extra`` that the format cannot
    hold as None, with a warning, as `convert` does.

    ``verify_checksums=True``: before the rename, once every rank has written and fsynced, every rank reads back
    from the storage what it wrote (its pages dropped from this node's cache first, where the kernel allows) and
    compares every row with the crc32 taken of the bytes it wrote (of a GPU shard: its host copy), and rank 0 reads
    back the header (and a set's index) it writes last, so that a disk or file system that lost, misplaced or
    damaged a write fails the save, naming each tensor (or file), instead of replacing a good checkpoint. It costs a
    read of the checkpoint (each rank its share).
    """
    t0 = time.perf_counter()
    process_group_argument(process_group)  # before the group is asked for this rank's place in it
    rank, world = _rank(process_group)
    group = process_group
    timings: dict[str, float] = {}
    plan: WritePlan | None = None
    tmp: Path | None = None
    fds: list[int] = []
    created = False
    with _no_cyclic_gc():
        try:
            # -- phase 0: arguments; rank 0's extra and the temporary's name reach every rank --------------------
            problems = new_problems()
            payload: bytes | None = None
            size: int | None = None
            schema: dict[str, list[tuple]] | None = None
            remote_state = None
            with problems.guard():
                size, path = _check_arguments(model, path, optimizer, extra, process_group, max_shard_size,
                                              thread_count, on_unsupported, verify_checksums, ignore_frozen_params)
                if rank == 0:
                    dst0 = Path(path)
                    # the modules' extra states are rank 0's, as the state dict a gather to rank 0 makes holds them
                    states = {name: module.get_extra_state()
                              for name, module in extra_state_modules(model, "get_extra_state").items()}
                    payload = _to_bytes((extra, temporary_name(dst0),
                                         uuid.uuid4().hex, states))  # the temporary's name, a sharded set's id
                if optimizer is not None and world > 1 and save_plan.needs_state_schema(model):
                    schema = save_plan.state_schema(model, optimizer)
            called_with = None if problems else _call_arguments(optimizer, size, verify_checksums, on_unsupported,
                                                                ignore_frozen_params)
            differing = ""
            if world > 1:  # whatever happened above: rank 0's payload to all (a broadcast: each rank holds it once,
                # at any world size), then every rank's state schema (if any) and arguments to all (small)
                box = [payload]
                sent: list[Any] = [None] * world
                with _exchange("save_sharded (start)", "sending rank 0's extra"):
                    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                               group=group)
                    dist.all_gather_object(sent, (schema, called_with), group=group)
                payload = box[0]
                if any(s is not None for s, _ in sent):
                    remote_state = save_plan.merge_schemas([s for s, _ in sent])
                differing = _differing_arguments([a for _, a in sent])
            # -- phase 1: plan, agree on the header and on the coverage --------------------------------------------
            coverage: dict[str, tuple[int, int]] = {}
            header: str | None = None
            with problems.guard():
                if differing:  # every rank has every rank's arguments: the same error on all of them
                    raise FsdpRestoreError(differing)
                if payload is None:
                    if not problems:  # rank 0's own problem (bad arguments) is reported already
                        raise FsdpRestoreError("rank 0 could not send extra (see its error)" if rank else
                                               "extra could not be pickled")
                else:
                    sent_extra, tmp_name, set_id, sent_states = _from_bytes(payload)
                    dst = Path(path)
                    tmp = _temp_path(dst, tmp_name)
                    # every rank, rank 0 too, plans from the copy that travelled: a set rebuilt by unpickling may
                    # iterate in another order than the caller's own
                    weights_only = optimizer is None and sent_extra is None
                    _reshard_fsdp2(model)
                    _refuse_unsharded_fsdp1(model)
                    plan = save_plan.build_write_plan(model, optimizer=optimizer,
                                                      extra=sent_extra,
                                                      weights_only=weights_only, rank=rank, world=world,
                                                      max_shard_size=size, remote_state=remote_state, set_id=set_id,
                                                      on_unsupported=on_unsupported, extra_states=sent_states,
                                                      ignore_frozen_params=ignore_frozen_params)
                    coverage = plan.coverage(rank)
                    header = _header_digest(plan)
                    if rank == 0:
                        created = True
                        _create_temp(dst, tmp, plan, size is not None)
            _agree(problems, "save_sharded (plan)", group, coverage, header,
                   destination=Path(path).name if isinstance(path, (str, os.PathLike)) else None,
                   replica_prints=plan.replica_prints if plan is not None else [])
            assert plan is not None and tmp is not None
            timings["plan"] = time.perf_counter() - t0
            sharded = size is not None

            # -- phase 2: every rank sees the one temporary ------------------------------------------------------
            t1 = time.perf_counter()
            problems = new_problems()
            with problems.guard():
                fds = _open_temp(tmp, plan, sharded, rank)
            _agree(problems, "save_sharded (open)", group)
            timings["open"] = time.perf_counter() - t1

            # -- phase 3: write and fsync ------------------------------------------------------------------------------
            t2 = time.perf_counter()
            problems = new_problems()
            crc = _Crc()
            written = 0
            chunks: list[_Written] | None = [] if verify_checksums else None
            threads = thread_count or DEFAULT_SAVE_THREADS
            with problems.guard():
                try:
                    written = _write_items(plan, fds, threads, crc, chunks)
                    for fd in fds:
                        os.fsync(fd)
                except OSError as e:  # (a file system that does not preallocate: the space runs out here)
                    raise said_of_space(e, dst, sum(f.size for f in plan.files)) from None
            _agree(problems, "save_sharded (write)", group)
            timings["write"] = time.perf_counter() - t2
            if chunks is not None:  # only now: every rank has written and fsynced, so a write one rank put in
                t_back = time.perf_counter()  # another's place is in the file when that one reads back
                problems = new_problems()
                with problems.guard():
                    paths = [tmp / f.name for f in plan.files] if sharded else [tmp]
                    problems.add("written", _read_back(paths, chunks, threads))
                _agree(problems, "save_sharded (read back)", group)
                timings["verify"] = time.perf_counter() - t_back

            # -- phase 4: checksums, rename --------------------------------------------------------------------------
            t3 = time.perf_counter()
            problems = new_problems()
            with _exchange("save_sharded (commit)", "joining the ranks' checksums"):
                checksums = _join_crcs(plan, crc, group, world)
            committed = False
            with problems.guard():
                if rank == 0:
                    try:
                        _commit(dst, tmp, plan, sharded, checksums, fds, verify=verify_checksums)
                    except ReplacedError:  # after the rename: its error says the new version is in place
                        created, committed = False, True
                        raise
                    created, committed = False, True
            # a rank that dies now may die after rank 0's rename: the error must not say the old file is there
            _agree(problems, "save_sharded (commit)", group,
                   died_hint=_COMMITTED_HINT if committed else _DIED_AT_COMMIT_HINT)
            timings["commit"] = time.perf_counter() - t3
        except BaseException:
            # Rank 0 removes the temporary it created; the others too once they know its name (it is this save's
            # own, and every rank fails together), so that one is removed when rank 0 itself was killed. After
            # rank 0's rename there is nothing under that name left to remove.
            if tmp is not None and (created or rank != 0):
                with contextlib.suppress(OSError):  # the error that brought us here is the one to raise
                    _remove(tmp)
            raise
        finally:
            for fd in fds:
                os.close(fd)
    files = [str(dst / f.name) for f in plan.files] if sharded else [str(dst)]
    return SaveReport(path=str(dst), files=files, tensors=len(plan.jobs),
                      nbytes=sum(j.nbytes for j in plan.jobs.values()),
                      bytes_written=written, items=len(plan.items), seconds=time.perf_counter() - t0,
                      timings=timings, checksums=checksums)
