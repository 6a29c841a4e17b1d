"""Streaming safetensors writer: header first, then each tensor's bytes, several threads at once
(a big tensor is cut into segments that different threads write and checksum).

`safetensors.torch.save_file` needs every tensor in memory at once (the header needs all metadata
first). We know every shape and dtype before reading any data, so we write the header, then
stream each tensor in bounded chunks (cast on the fly when asked) with ``os.pwrite`` at its final
offset. Anonymous memory stays at ``threads x chunk`` whatever the model size. Checksums are not
known until the data is written, so the header holds fixed-width placeholders that are patched in
place at the end (crc32 hex is always 8 characters, so the header length never changes); the header's
own crc32 (`format.seal`) is patched with them.

Replacing a checkpoint is atomic for readers and for a kill: the new version is written under a temporary
name and put in place with one rename (a file over a file) or one exchange of the two names
(``renameat2(RENAME_EXCHANGE)``, when a directory is involved); the old version then lies under the temporary
name and is removed, by this run or, if it is killed first, by the next one (`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import functools
import glob
import json
import math
import mmap
import os
import re
import shutil
import stat
import threading
import uuid
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checksum import combine_segments, crc32
from .format import (DEFAULT_INDEX_NAME, FORMAT_VERSION, HEADER_SEAL_PREFIX, META_CAST, META_CHECKSUMS, META_FORMAT,
                     META_SET_ID, META_STRUCTURE, META_VERSION, StoredDtype, as_torch_dtype,
                     build_header, build_index, seal, torch_dtype_name)
from .errors import ConvertError
from .mapped import IOV_MAX, pread_exactly, preadv_exactly
from .share import DIED_NOTE, Share

CHUNK_BYTES = 16 * 1024 * 1024  # per-thread working set when casting or copying non-contiguous data
CAST_STAGING_BYTES = 4 * 1024 * 1024  # source bytes per step of a cast (`_copy_piece_into`): it stays in cache
_PLACEHOLDER = "0" * 8

ProgressFn = Callable[[int], None]


if TYPE_CHECKING:  # torch is imported by the functions that make or cast tensors: a plain copy never needs it
    import torch

    from .plain_cast import Cast

Reader = Callable[[int, int], "torch.Tensor"]  # (first flat element, count) -> those elements
HeldInPieces = dict[int, tuple[Any, Reader]]  # stand-in's data_ptr -> (meta tensor, reader)


def stand_in(held: HeldInPieces, shape: tuple[int, ...], dtype: torch.dtype, reader: Reader) -> torch.Tensor:
    """A one-element tensor of its own storage standing, in a nested object about to be flattened, for a
    tensor held in pieces; ``held`` records its real shape and dtype and its reader. flatten keys tensors by
    storage, so a tied name that refers to the same stand-in is stored once."""
    import torch

    t = torch.zeros(1, dtype=dtype)
    held[t.data_ptr()] = (torch.empty(shape, dtype=dtype, device="meta"), reader)
    return t


Location = tuple[int, int] | list[tuple[int, int, int]]  # `TensorJob.location`


@dataclass
class TensorJob:
    """One tensor to write: ``source`` (any CPU tensor, typically memory-mapped, or one a torch-free reader described:
    `plain_pt.StoredTensor`, whose dtype is a `format.StoredDtype`) stored as ``dtype``.
    With a ``reader``, the elements come from it instead (a tensor held in pieces by several files, as
    in a ZeRO or DCP checkpoint), and ``source`` only gives the shape and dtype (a meta tensor)."""

    key: str
    source: torch.Tensor
    dtype: torch.dtype | StoredDtype  # a `StoredDtype` where ``source`` is described (`_described`)
    reader: Reader | None = None
    # where ``source``'s bytes lie: (open file, offset), or the (open file, offset, length) runs that hold them in
    # turn (a tensor held in pieces by several files: `zero_plain`)
    location: Location | None = None

    @functools.cached_property
    def nbytes(self) -> int:  # asked for several times per tensor while a file is laid out
        return prod(self.source.shape) * self.dtype.itemsize

    @functools.cached_property
    def source_dtype(self) -> torch.dtype:
        """``source``'s dtype as torch's (a torch-free reader's stands for one; asked only where a cast is made)."""
        return as_torch_dtype(self.source.dtype)

    @functools.cached_property
    def target_dtype(self) -> torch.dtype:
        """``dtype`` as torch's (asked only where torch casts)."""
        return as_torch_dtype(self.dtype)


@dataclass
class WriteResult:
    """What was written: the final paths, each key's crc32 and the total tensor bytes."""

    paths: list[Path]
    checksums: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0


_SCRATCH = threading.local()


def scratch(dtype: torch.dtype, count: int) -> torch.Tensor:
    """This thread's reusable buffer of ``count`` elements, for a `Reader` that assembles a range from
    pieces: valid until the thread's next call. Allocating a fresh 16 MB tensor per range instead let
    glibc's per-thread arenas keep freed blocks (its mmap threshold rises to the block size), so
    resident memory grew with the number of threads and ranges."""
    import torch

    nbytes = count * dtype.itemsize
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _SCRATCH.buf = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8)
    return buf[:nbytes].view(dtype)


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view (numpy uint8) of a contiguous CPU tensor, for crc32 and pwrite."""
    import torch

    return t.reshape(-1).view(torch.uint8).numpy()


def file_header(jobs: Sequence[TensorJob], metadata: dict[str, str],
                checksums: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The header of one output file holding ``jobs`` (8-byte length + JSON) and each key's offset in its
    data section: ``metadata`` plus the checksums (8-hex-digit placeholders until ``checksums`` is given;
    the header's length is the same either way) and the cast record. Shared by the writer and by
    `fsdp_restore.save_sharded`, whose ranks must lay the file out exactly as a conversion does."""
    meta = dict(metadata)
    meta[META_CHECKSUMS] = json.dumps({j.key: (checksums or {}).get(j.key, _PLACEHOLDER) for j in jobs},
                                      separators=(",", ":"))
    cast = {j.key: torch_dtype_name(j.source.dtype) for j in jobs if j.source.dtype != j.dtype}
    if cast:
        meta[META_CAST] = json.dumps(cast, separators=(",", ":"))
    return build_header([(j.key, j.dtype, tuple(j.source.shape)) for j in jobs], meta)


def with_checksums(header: bytes, jobs: Sequence[TensorJob], checksums: dict[str, str]) -> bytes:
    """The bytes of ``file_header(jobs, metadata, checksums)``, made from ``header``, which is ``file_header(jobs,
    metadata)`` (the placeholders): the checksums' digits are the only difference and keep their length, so
    they are put in place and the header's own crc32 computed again, instead of laying out and serialising every
    entry a second time (a cost per tensor: BENCHMARKS.md)."""
    def field(sums: dict[str, str]) -> bytes:  # the checksum field's value as it stands in the header's JSON
        text = json.dumps({j.key: sums.get(j.key, _PLACEHOLDER) for j in jobs}, separators=(",", ":"))
        return json.dumps(text, ensure_ascii=False).encode("utf-8")

    name = json.dumps(META_CHECKSUMS).encode()
    old, new = name + b":" + field({}), name + b":" + field(checksums)
    head, body = header[:8], header[8:]
    at = body.find(old)
    if len(old) != len(new) or at < 0 or body.find(old, at + 1) >= 0:
        raise AssertionError("the checksum field is not where the placeholder header has it (a bug)")
    return head + seal(head, body[:at] + new + body[at + len(old):], HEADER_SEAL_PREFIX)


BLOCK_BYTES = 32 * 1024 * 1024  # one thread's piece of an output file per task (and its buffer)
DIRECT_ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses are multiples of the device's block size


def default_io_threads() -> int:
    """Threads of a conversion: at least 4 whatever the core count, since they mostly wait on the disk (a
    direct write holds its thread until the device has the data); more where there are cores to checksum."""
    return min(16, max(4, default_threads()))


def _round_up(n: int, to: int = DIRECT_ALIGN) -> int:
    return -(-n // to) * to


def flat_range(t: torch.Tensor, first: int, stop: int) -> list[torch.Tensor]:
    """Elements ``[first, stop)`` of ``t`` in row-major order, as a few strided views, without copying the
    whole tensor (a non-contiguous tensor's ``reshape(-1)`` would): at most two partial rows per dimension
    and one run of whole rows between them."""
    if first >= stop:
        return []
    if t.dim() == 0 or t.is_contiguous():
        return [t.reshape(-1)[first:stop]]
    row = prod(t.shape[1:])
    r0, r1 = first // row, (stop - 1) // row
    if r0 == r1:
        return flat_range(t[r0], first - r0 * row, stop - r0 * row)
    whole_from = r0 if first == r0 * row else r0 + 1
    whole_to = r1 + 1 if stop == (r1 + 1) * row else r1
    parts = flat_range(t[r0], first - r0 * row, row) if whole_from > r0 else []
    if whole_to > whole_from:
        parts.append(t[whole_from:whole_to])
    if whole_to == r1:
        parts += flat_range(t[r1], 0, stop - r1 * row)
    return parts


class _SourceCrcs(threading.local):
    """This thread's record of the crc32s of the source bytes a cast read, as ``(key, first source byte, crc32,
    length)``, for the check of the source's own crc32s (`source_crc`): taken where the bytes are, in the cast's
    staging buffer, so that the check need not read them again. None outside a block's fill."""

    sink: list[tuple[str, int, int, int]] | None = None


_SOURCE_CRCS = _SourceCrcs()


def _record_source(job: TensorJob, first_byte: int, data: Any) -> None:
    """Record the crc32 of ``data``, bytes ``first_byte`` on of ``job``'s source as they lie in one run of its
    file (a cast's read); nothing for a source read otherwise (a reader's pieces; runs of several files record
    theirs in `_read_location`)."""
    sink = _SOURCE_CRCS.sink
    if sink is not None and type(job.location) is tuple:
        view = memoryview(data).cast("B")
        sink.append((job.key, first_byte, crc32(view), len(view)))


def _source_elements(job: TensorJob, first: int, stop: int) -> list[torch.Tensor]:
    """The source's elements ``[first, stop)`` of one job (its own dtype), as a few tensors in order."""
    if job.reader is not None:
        return [job.reader(first, stop - first).reshape(-1)]
    if job.location is not None and _described(job):  # read where they lie: there is no tensor to view
        import torch

        data = bytearray((stop - first) * job.source_dtype.itemsize)
        _read_location(job.location, memoryview(data), first * job.source_dtype.itemsize, job.key)
        return [torch.frombuffer(data, dtype=job.source_dtype) if data else torch.empty(0, dtype=job.source_dtype)]
    return flat_range(job.source, first, stop)


def _described(job: TensorJob) -> bool:
    """Whether ``job.source`` is described rather than a tensor (by a torch-free reader: `plain_pt`, `zero_plain`)."""
    return hasattr(job.source.dtype, "safetensors_name")


def _copy_elements(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Copy ``parts`` one after the other into the flat tensor ``dst`` (of the output dtype: a cast on the way)."""
    at = 0
    for part in parts:
        n = part.numel()
        dst[at:at + n].view(part.shape).copy_(part)
        at += n


@dataclass(frozen=True)
class _Piece:
    """Bytes ``[first, first + nbytes)`` of one tensor's output bytes, at byte ``at`` of a block."""

    job: TensorJob
    first: int
    nbytes: int
    at: int


@dataclass
class _Block:
    """Bytes ``[offset, offset + nbytes)`` of one output file: what one task fills and writes."""

    writer: _FileWriter
    offset: int
    nbytes: int
    pieces: list[_Piece]


class _BlockBuffer(threading.local):
    """This thread's page-aligned block buffer (anonymous memory, as an O_DIRECT write needs)."""

    def get(self) -> tuple[mmap.mmap, memoryview]:
        if getattr(self, "memory", None) is None:
            self.memory = mmap.mmap(-1, BLOCK_BYTES)
            self.view = memoryview(self.memory)
            self.tensor = None
        return self.memory, self.view

    def as_tensor(self, memory: mmap.mmap) -> torch.Tensor:
        """``memory`` as a uint8 tensor: for this thread's buffer made once per thread (only a cast needs torch)."""
        import torch

        if memory is not getattr(self, "memory", None):
            return torch.frombuffer(memory, dtype=torch.uint8)
        if self.tensor is None:
            self.tensor = torch.frombuffer(memory, dtype=torch.uint8)
        return self.tensor


_BUFFERS = _BlockBuffer()


class _FileWriter:
    """One output safetensors file being written under a temporary name, block by block.

    The file is cut into `BLOCK_BYTES` blocks at fixed offsets; a task fills one block in its thread's
    buffer (the header's part, then each tensor's part, cast on the way) and writes it with one ``pwrite``.
    The file is opened with ``O_DIRECT`` where the file system takes it: the data goes from the buffer to the
    device, with no copy into the page cache and no writeback of dirty pages by the kernel, which on a busy
    machine cost more system time than the copy itself and made a conversion's time vary several-fold
    (BENCHMARKS.md). Where ``O_DIRECT`` is refused (tmpfs, some network file systems) the same writes go
    through the page cache. The header's checksums are known only at the end: the page where the header
    ends is kept and written again, patched, before the fsync."""

    def __init__(self, path: Path, jobs: list[TensorJob], metadata: dict[str, str], *, create: bool = True,
                 record_sources: bool = False) -> None:
        self.path, self.jobs = path, jobs
        self.metadata = dict(metadata)
        self.header, self.offsets = file_header(jobs, self.metadata)
        self.data_start = len(self.header)  # the header length never changes (see the checksum patch)
        self.size = self.data_start + sum(j.nbytes for j in jobs)
        self.fd, self.direct = -1, False
        # create: this process makes the file; else another rank of the write made it (`share.Share`)
        flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0)
        if hasattr(os, "O_DIRECT"):
            try:
                self.fd, self.direct = os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)
        self._lock = threading.Lock()
        self._retired: list[int] = []  # descriptors left by `_stop_direct`
        self._head_tail = b""  # direct only: the data bytes in the page where the header ends
        self.checksums: dict[str, str] = {}
        self.overflowed: Counter[str] = Counter()  # per key: finite values a narrowing cast made inf or NaN
        self.rounded: set[str] = set()  # keys a cast may have changed as verify fails it (`changed_by_cast`)
        self._segment_crcs: dict[str, dict[int, tuple[int, int]]] = {j.key: {} for j in jobs}
        # per cast tensor: the crc32s of the source bytes its cast read, {first source byte: (crc, length)}, where
        # asked (a pass of crc32 over the source: `write_safetensors`' record_sources)
        self.record_sources = record_sources
        self._source_segments: dict[str, dict[int, tuple[int, int]]] = {}

    def blocks(self) -> list[_Block]:
        """This file cut into blocks, each with the tensor pieces it holds."""
        blocks = [_Block(self, offset, min(BLOCK_BYTES, self.size - offset), [])
                  for offset in range(0, self.size, BLOCK_BYTES)]
        for job in self.jobs:
            begin = self.data_start + self.offsets[job.key]
            end = begin + job.nbytes
            for block in blocks[begin // BLOCK_BYTES:-(-end // BLOCK_BYTES)]:
                lo, hi = max(begin, block.offset), min(end, block.offset + block.nbytes)
                block.pieces.append(_Piece(job, lo - begin, hi - lo, lo - block.offset))
        return blocks

    def fill(self, block: _Block, memory: mmap.mmap, data: memoryview, progress: ProgressFn | None) -> None:
        """Put ``block``'s bytes in ``data`` (the header's part, then each piece); record each piece's crc32."""
        if block.offset < self.data_start:
            part = self.header[block.offset:block.offset + block.nbytes]
            data[:len(part)] = part
        pieces = block.pieces
        crcs: list[tuple[str, int, int, int]] = []  # (key, first byte, crc32, length): recorded under one lock
        sources: list[tuple[str, int, int, int]] = []  # the same of the source bytes the casts read
        _SOURCE_CRCS.sink = sources if self.record_sources else None
        i = 0
        while i < len(pieces):
            piece = pieces[i]
            job = piece.job
            if job.location is not None and job.dtype == job.source.dtype:
                done = _read_run(pieces, i, data)
            else:
                done, cast = _cast_run(pieces, i, memory)
                for piece in () if cast else pieces[i:done]:
                    overflowed, rounded = _copy_piece(piece, memory)
                    if overflowed or rounded:
                        with self._lock:
                            self.overflowed[piece.job.key] += overflowed
                            if rounded:
                                self.rounded.add(piece.job.key)
            for piece in pieces[i:done]:
                crcs.append((piece.job.key, piece.first, crc32(data[piece.at:piece.at + piece.nbytes]),
                             piece.nbytes))
            i = done
        _SOURCE_CRCS.sink = None
        with self._lock:
            segment_crcs = self._segment_crcs
            for key, first, crc, nbytes in crcs:
                segment_crcs[key][first] = (crc, nbytes)
            for key, first, crc, nbytes in sources:
                self._source_segments.setdefault(key, {})[first] = (crc, nbytes)
        if progress:
            progress(sum(piece.nbytes for piece in pieces))
        if self.direct and block.offset <= self.data_start < block.offset + block.nbytes:
            self._head_tail = bytes(data[self.data_start - block.offset:_round_up(self.data_start) - block.offset])

    def write(self, block: _Block, memory: mmap.mmap) -> None:
        """Write the filled block: whole pages when direct (the file is cut to its size in `finish`)."""
        direct = self.direct
        nbytes = _round_up(block.nbytes) if direct else block.nbytes
        view, offset = memoryview(memory)[:nbytes], block.offset
        while view:  # pwrite may write less than asked
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                self._stop_direct()  # the open took O_DIRECT but the writes need another alignment
                self.write(block, memory)
                return
            view, offset = view[n:], offset + n

    def _stop_direct(self) -> None:
        """Go on through the page cache: reopen the file without ``O_DIRECT`` (blocks already written stay)."""
        with self._lock:
            if self.direct:
                self._retired.append(self.fd)  # closed in `close`: another thread may be writing through it
                self.fd, self.direct = os.open(self.path, os.O_WRONLY), False

    def segments(self) -> tuple[dict[str, dict[int, tuple[int, int]]], bytes, dict[str, dict[int, tuple[int, int]]]]:
        """What this process wrote that `finish` needs: the crc32 of each piece (``{key: {first byte: (crc,
        length)}}``), if it wrote the block where the header ends, that page's data bytes, and the crc32s of the
        source bytes its reads and casts recorded (`source_segments`)."""
        return ({key: dict(pieces) for key, pieces in self._segment_crcs.items() if pieces}, self._head_tail,
                {key: dict(pieces) for key, pieces in self._source_segments.items()})

    def add_segments(self, segments: tuple[dict[str, dict[int, tuple[int, int]]], bytes,
                                           dict[str, dict[int, tuple[int, int]]]]) -> None:
        """What another rank of the write wrote (its `segments`), for `finish`."""
        crcs, head_tail, sources = segments
        for key, pieces in crcs.items():
            self._segment_crcs[key].update(pieces)
        self._head_tail = self._head_tail or head_tail
        for key, pieces in sources.items():
            self._source_segments.setdefault(key, {}).update(pieces)

    def source_segments(self) -> dict[str, dict[int, tuple[int, int]]]:
        """The crc32s of the source bytes this file's tensors were read or cast from where they were recorded
        (``record_sources``): ``{key: {first source byte: (crc32, length)}}``, for `source_crc`'s checks."""
        return self._source_segments

    def finish(self) -> None:
        """Join each tensor's segment checksums, patch them into the header, fsync and close."""
        for key, segments in self._segment_crcs.items():
            if len(segments) == 1:  # the common case, a tensor in one block: its crc as it is
                ((crc, _),) = segments.values()
            else:
                crc = combine_segments(segments[s] for s in sorted(segments))
            self.checksums[key] = f"{crc:08x}"
        header = with_checksums(self.header, self.jobs, self.checksums)
        if self.direct:  # whole pages from an aligned buffer: the patched header, then the data that shared its page
            page = mmap.mmap(-1, _round_up(len(header)))
            page[:] = (header + self._head_tail).ljust(len(page), b"\0")  # past the file's end: cut below
            os.pwrite(self.fd, page, 0)
            page.close()
        else:
            os.pwrite(self.fd, header, 0)
        os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)
        self.close()

    def close(self) -> None:
        for fd in self._retired:
            os.close(fd)
        self._retired = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_location(location: Location, out: memoryview, first: int, key: str | None = None) -> None:
    """Fill ``out`` with the bytes from ``first`` on of a tensor that lies at ``location`` (`TensorJob.location`).
    Of a tensor in runs of several files (a ZeRO checkpoint's), the crc32 of each run's part read is recorded as
    ``key``'s (`_SOURCE_CRCS`, where the source's records are to be checked: `source_crc.RunsCheck`)."""
    if type(location) is tuple:  # one run
        pread_exactly(location[0], out, location[1] + first)
        return
    if not out:
        return
    sink = _SOURCE_CRCS.sink if key is not None else None
    at, skipped = 0, 0
    for fd, offset, nbytes in location:  # type: ignore[misc]
        if first >= nbytes:
            first -= nbytes
            skipped += nbytes
            continue
        n = min(nbytes - first, len(out) - at)
        part = out[at:at + n]
        pread_exactly(fd, part, offset + first)
        if sink is not None:
            sink.append((key, skipped + first, crc32(part), n))  # type: ignore[arg-type]
        skipped += first + n
        at, first = at + n, 0
        if at == len(out):
            return
    raise EOFError(f"the tensor's runs hold {at} of the {len(out)} bytes asked for")


# Pieces that lie at most this far apart in their file are read with one ``preadv`` (the bytes between them into
# `_GAP`): torch.save's archive puts a local header of a few dozen bytes between two records, and a checkpoint of
# thousands of small tensors otherwise costs a system call and the Python around it per tensor (BENCHMARKS.md).
_GAP_BYTES = 4096
# what lies between such pieces, read and dropped: shared by the threads, whose writes to it no one reads
_GAP = memoryview(bytearray(_GAP_BYTES))


def _next_in_file(piece: _Piece, fd: int, end: int) -> int | None:
    """Where in file ``fd`` ``piece``'s source bytes start, if that is at most `_GAP_BYTES` after byte ``end`` and
    they lie in one run there; else None."""
    location = piece.job.location
    if type(location) is not tuple or location[0] != fd:
        return None
    start = location[1] + piece.first
    return start if 0 <= start - end <= _GAP_BYTES else None


def _read_run(pieces: list[_Piece], i: int, data: memoryview) -> int:
    """Read ``pieces[i]`` (a tensor copied from where it lies, without a cast) into the block's ``data``, and with it,
    in one ``preadv``, the pieces after it that are also such copies and lie next in the same file; returns the
    index after the last piece read."""
    piece = pieces[i]
    location = piece.job.location
    if type(location) is not tuple:
        _read_location(location, data[piece.at:piece.at + piece.nbytes], piece.first,  # type: ignore[arg-type]
                       piece.job.key)
        return i + 1
    fd, start = location[0], location[1] + piece.first
    views, end, j = [data[piece.at:piece.at + piece.nbytes]], start + piece.nbytes, i + 1
    while j < len(pieces) and len(views) < IOV_MAX - 1:
        piece = pieces[j]
        job = piece.job
        # (an empty piece ends the run: the bytes before it are no one's to read, and the file may end there)
        if not piece.nbytes or job.dtype != job.source.dtype or (at := _next_in_file(piece, fd, end)) is None:
            break
        if at > end:
            views.append(_GAP[:at - end])
        views.append(data[piece.at:piece.at + piece.nbytes])
        end, j = at + piece.nbytes, j + 1
    preadv_exactly(fd, views, start)
    return j


def _free_cast(job: TensorJob) -> Cast | None:
    """The cast of ``job``'s tensor made without torch (`plain_cast`), where its source is described without torch
    (`_described`, read from where it lies) and the pair of dtypes is one `plain_cast` makes; else None."""
    source, target = job.source.dtype, job.dtype
    if source is target or job.reader is not None or job.location is None:
        return None
    from .plain_cast import torch_free_cast

    # (a torch dtype has no name: no cast then)
    return torch_free_cast(getattr(source, "name", ""), getattr(target, "name", ""))


def _cast_run(pieces: list[_Piece], i: int, memory: mmap.mmap) -> tuple[int, bool]:
    """Cast ``pieces[i]`` and the pieces after it without torch as one (`_cast_without_torch`'s cast, one call for
    them all), where they are whole tensors of at least one dimension, cast between the same two dtypes, that lie
    next to each other in the block and in their file, at most `CAST_STAGING_BYTES` of source in all, and every
    value is finite after the cast and no whole number may have been rounded (what the pieces one by one would
    give, with nothing to record). Returns the index after the last piece of the run and whether they were cast:
    not where fewer than two pieces qualify (the run is then ``pieces[i]`` alone: so is a tensor of more than half
    a step, whose own cast's calls cost little beside its bytes) or the cast declined; the caller then casts them
    piece by piece."""
    piece = pieces[i]
    cast = _free_cast(piece.job)
    if cast is None:
        return i + 1, False
    size, source_size = piece.job.dtype.itemsize, piece.job.source.dtype.itemsize

    def castable(piece: _Piece) -> bool:
        job = piece.job
        return (_free_cast(job) is cast and type(job.location) is tuple and piece.first == 0
                and piece.nbytes == job.nbytes > 0 and job.source.dim() > 0)

    def source_nbytes(piece: _Piece) -> int:
        return piece.nbytes // size * source_size

    if not castable(piece) or piece.at % size or source_nbytes(piece) > CAST_STAGING_BYTES // 2:
        return i + 1, False
    fd, start = piece.job.location  # type: ignore[misc]
    staging = _CAST_STAGING.get()
    # (where a single tensor's read goes)
    shift = _placement(piece.job.location, 0, source_size)  # type: ignore[arg-type]
    nbytes = source_nbytes(piece)
    views = [_CAST_STAGING.view[shift:shift + nbytes]]
    at, end, source_bytes, j = piece.at + piece.nbytes, start + nbytes, nbytes, i + 1
    while j < len(pieces) and len(views) < IOV_MAX - 1:
        piece = pieces[j]
        if (piece.at != at or not castable(piece)
                or source_bytes + (nbytes := source_nbytes(piece)) > CAST_STAGING_BYTES
                or (begin := _next_in_file(piece, fd, end)) is None):
            break
        if begin > end:
            views.append(_GAP[:begin - end])
        views.append(_CAST_STAGING.view[shift + source_bytes:shift + source_bytes + nbytes])
        at, end, source_bytes, j = at + piece.nbytes, begin + nbytes, source_bytes + nbytes, j + 1
    if j - i < 2:
        return i + 1, False
    import numpy as np

    preadv_exactly(fd, views, start)
    at = shift
    for piece in pieces[i:j]:
        nbytes = source_nbytes(piece)
        _record_source(piece.job, 0, _CAST_STAGING.view[at:at + nbytes])
        at += nbytes
    n = source_bytes // source_size
    source = np.frombuffer(staging, dtype=cast.source_bits, count=n, offset=shift)
    out = np.frombuffer(memory, dtype=cast.target_bits, count=n, offset=pieces[i].at)
    return j, cast(source, out, _CAST_STAGING.work()) is False


def _copy_piece(piece: _Piece, memory: mmap.mmap) -> tuple[int, bool]:
    """Copy (and cast) one piece of a tensor that is not read from a file at its offset into the block buffer
    (``memory``); returns how many finite source values a narrowing cast made infinite or NaN (`narrowing`), and
    whether the cast may have changed the tensor as `changed_by_cast` says (decided over the whole tensor
    afterwards). A cast of a described tensor between dtypes `plain_cast` casts is made without torch where every
    value is finite before and after it (`_cast_without_torch`), else by torch."""
    done = _cast_without_torch(piece, memory)
    if done is not None:
        return done
    import torch

    with torch.no_grad():
        return _copy_piece_into(piece, _BUFFERS.as_tensor(memory))


class _CastStaging(threading.local):
    """This thread's page-aligned buffer for the source bytes of a cast (`_stage`), as memory, and as a uint8 tensor
    or with a numpy scratch array for the cast that uses each (made on first use: only a cast needs them)."""

    def get(self) -> mmap.mmap:
        if getattr(self, "memory", None) is None:
            self.memory = mmap.mmap(-1, CAST_STAGING_BYTES + mmap.PAGESIZE)
            self.view = memoryview(self.memory)
        return self.memory

    def tensor(self) -> torch.Tensor:
        if getattr(self, "as_tensor", None) is None:
            import torch

            self.as_tensor = torch.frombuffer(self.get(), dtype=torch.uint8)
        return self.as_tensor

    def work(self) -> Any:
        """numpy's scratch for `plain_cast`: 4 bytes per source element of a step (and as many as the source's own),
        for sources of 2 bytes and more."""
        if getattr(self, "scratch", None) is None:
            import numpy as np

            self.scratch = np.empty(2 * CAST_STAGING_BYTES, dtype=np.uint8)
        return self.scratch


_CAST_STAGING = _CastStaging()


def _stage(job: TensorJob, first: int, count: int, itemsize: int) -> int:
    """Read elements ``[first, first + count)`` (of ``itemsize`` bytes; at most `CAST_STAGING_BYTES` of them) of a
    tensor a torch-free reader described (`_described`) with ``pread`` from where they lie (``job.location``) into
    this thread's staging buffer, placed as the bytes lie in their page (the kernel's copy is fastest so); returns
    where in the buffer they start: valid until the thread's next call."""
    _CAST_STAGING.get()
    shift = _placement(job.location, first * itemsize, itemsize)  # type: ignore[arg-type]
    nbytes = count * itemsize
    _read_location(job.location, _CAST_STAGING.view[shift:shift + nbytes], first * itemsize,  # type: ignore[arg-type]
                   job.key)
    return shift


def _staged(job: TensorJob, first: int, stop: int) -> torch.Tensor:
    """Elements ``[first, stop)`` of a tensor a torch-free reader described, as a tensor of its dtype in this thread's
    staging buffer (`_stage`): valid until the thread's next call."""
    itemsize = job.source_dtype.itemsize
    shift = _stage(job, first, stop - first, itemsize)
    return _CAST_STAGING.tensor()[shift:shift + (stop - first) * itemsize].view(job.source_dtype)


def _cast_without_torch(piece: _Piece, memory: mmap.mmap) -> tuple[int, bool] | None:
    """`_copy_piece` of a tensor described without torch (`_described`, read from where it lies) cast with numpy
    (`plain_cast`, `_free_cast`), in steps of `CAST_STAGING_BYTES` of source as the torch path takes them; None where
    it does not apply (a pair of dtypes `plain_cast` leaves to torch, a piece not on whole elements) or a step holds
    a value that is not finite after the cast: the torch path then makes the whole piece."""
    job = piece.job
    cast = _free_cast(job)
    size = job.dtype.itemsize
    if cast is None or piece.first % size or piece.nbytes % size or piece.at % size:
        return None
    import numpy as np

    staging, work = _CAST_STAGING.get(), _CAST_STAGING.work()
    source_size = job.source.dtype.itemsize
    first, stop = piece.first // size, (piece.first + piece.nbytes) // size
    step = CAST_STAGING_BYTES // source_size
    rounded = False
    for lo in range(first, stop, step):
        n = min(stop, lo + step) - lo
        shift = _stage(job, lo, n, source_size)
        _record_source(job, lo * source_size, _CAST_STAGING.view[shift:shift + n * source_size])
        source = np.frombuffer(staging, dtype=cast.source_bits, count=n, offset=shift)
        out = np.frombuffer(memory, dtype=cast.target_bits, count=n, offset=piece.at + (lo - first) * size)
        step_rounded = cast(source, out, work)
        if step_rounded is None:
            return None
        rounded = rounded or step_rounded
    # a 0-dim value is judged whole by the torch path (`changed_by_cast`), unless the cast is exact (widening)
    return 0, rounded or (job.source.dim() == 0 and not cast.exact)


def _placement(location: Location, first: int, itemsize: int) -> int:
    """Where in a page-aligned buffer to read a tensor's bytes from ``first`` on: at the file offset's place in its
    page (where the kernel's copy runs at full speed), rounded down to a multiple of the dtype's size."""
    if type(location) is tuple:
        offset = location[1] + first
    else:  # the run that holds byte ``first``
        for _, start, nbytes in location:  # type: ignore[misc]
            if first < nbytes:
                break
            first -= nbytes
        offset = start + first
    return offset % mmap.PAGESIZE // itemsize * itemsize


def _copy_piece_into(piece: _Piece, buffer: torch.Tensor) -> tuple[int, bool]:
    """`_copy_piece`, into ``buffer``, the block buffer as a uint8 tensor, in steps of `CAST_STAGING_BYTES` of source
    whatever the source (torch's cast kernel writes a NaN one way or another by its place within a call: a tensor
    read through torch and the same tensor read without it are cast alike). A described source is read step by step
    into the staging buffer (`_staged`)."""
    import torch

    job, size = piece.job, piece.job.dtype.itemsize
    source_dtype = job.source_dtype
    first, stop = piece.first // size, -(-(piece.first + piece.nbytes) // size)
    aligned = piece.first % size == 0 and piece.nbytes % size == 0 and piece.at % size == 0
    # else the tensor does not start at a multiple of its element size (after an odd-length one): cast aside
    whole = (buffer[piece.at:piece.at + piece.nbytes].view(job.target_dtype) if aligned
             else torch.empty(stop - first, dtype=job.target_dtype))
    step = CAST_STAGING_BYTES // source_dtype.itemsize
    # a reader is asked once per piece (one of a DCP tensor split by columns reloads every chunk per call)
    read = _source_elements(job, first, stop)[0] if job.reader is not None else None
    described = job.location is not None and _described(job)
    overflowed, large = 0, False
    for lo in range(first, stop, step):
        hi = min(stop, lo + step)
        if read is not None:
            parts = [read[lo - first:hi - first]]
        else:
            parts = [_staged(job, lo, hi)] if described else _source_elements(job, lo, hi)
            if described or (len(parts) == 1 and job.source.is_contiguous()):  # its bytes as they lie in the file
                _record_source(job, lo * source_dtype.itemsize, tensor_bytes(parts[0]))
        out = whole[lo - first:hi - first]
        _copy_elements(out, parts)
        step_overflowed, step_large = cast_screen(source_dtype, out, lambda: torch.cat([p.reshape(-1) for p in parts]))
        overflowed, large = overflowed + step_overflowed, large or step_large
    if not aligned:
        skip = piece.first - first * size
        buffer[piece.at:piece.at + piece.nbytes].copy_(whole.view(torch.uint8)[skip:skip + piece.nbytes])
    rounded = job.target_dtype != source_dtype and (job.source.dim() == 0 or (large and rounds_whole_numbers(
        source_dtype, job.target_dtype)))
    return overflowed, rounded


def cast_overflow(source_dtype: torch.dtype, out: torch.Tensor, source: Callable[[], torch.Tensor]) -> int:
    """How many finite values of ``source()`` (of ``source_dtype``; called only when needed) the copy into
    ``out`` made inf or NaN: 0 unless the copy was a `narrowing` cast (`cast_screen`)."""
    return cast_screen(source_dtype, out, source)[0] if narrowing(source_dtype, out.dtype) else 0


def cast_screen(source_dtype: torch.dtype, out: torch.Tensor, source: Callable[[], torch.Tensor]) -> tuple[int, bool]:
    """What a cast of ``source()`` (of ``source_dtype``; called only when needed) into ``out`` may have done:
    how many finite values it made inf or NaN (0 unless `narrowing`), and whether ``out`` holds a value at or
    beyond the magnitude up to which ``out``'s dtype holds every whole number (`exact_whole_numbers`; or a NaN).
    The smallest and largest values tell both in one cheap pass (isfinite() is several times the cast itself; a
    sum accumulated in fp32 as slow, one in fp16 passes 65504); the exact count only where they are not finite."""
    import torch

    if source_dtype == out.dtype or out.numel() == 0 or not (
            narrowing(source_dtype, out.dtype) or rounds_whole_numbers(source_dtype, out.dtype)):
        return 0, False
    values = out.float() if out.dtype.itemsize == 1 else out  # float8: torch has no aminmax or isfinite for these
    low, high = (float(v) for v in torch.aminmax(values))  # NaN propagates (a NaN or inf bound fails the comparisons
    limit = exact_whole_numbers(out.dtype)  # below); no sum that could itself pass fp16's 65504
    large = not (-limit < low and high < limit)
    if not narrowing(source_dtype, out.dtype):
        return 0, large
    if out.dtype.itemsize != 1 and math.isfinite(low) and math.isfinite(high):
        return 0, large
    return int(overflow_count(source(), out)), large


def overflow_count(source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """How many finite values of ``source`` its cast into ``out`` (same shape) made inf or NaN, or, in a float8
    dtype without inf, saturated from beyond its range: a 0-dim tensor on ``out``'s device, so that a caller on a
    GPU stream can collect it without waiting for the device (`execute`'s staging turns it into a number once
    its stream is done)."""
    flat = source.reshape(-1)
    flat = flat.float() if flat.element_size() == 1 else flat  # a float8 source: no isfinite or abs of its own
    values = out.reshape(-1)
    if out.dtype.itemsize == 1:  # float8_e4m3fn has no inf: a value beyond its range saturates to +-448, finite
        edge, tie_fits = rounds_past_largest(out.dtype)
        magnitude = flat.abs()
        beyond = flat.isfinite() & ((magnitude > edge) if tie_fits else (magnitude >= edge))
        changed = beyond | (flat.isfinite() & ~values.float().isfinite())
        if not holds_infinity(out.dtype):  # a stored inf becomes +-448 (e4m3fn) or NaN (the fnuz types)
            changed |= flat.isinf()
        return changed.sum()
    return (flat.isfinite() & ~values.isfinite()).sum()


@functools.lru_cache(maxsize=None)
def holds_infinity(dtype: torch.dtype) -> bool:
    """Whether a floating ``dtype`` has an infinity (torch's own cast of one tells: the float8 types other than
    e5m2 have none)."""
    import torch

    return bool(torch.tensor([float("inf")]).to(dtype).float().isinf().all())


@functools.lru_cache(maxsize=None)
def rounds_past_largest(dtype: torch.dtype) -> tuple[float, bool]:
    """Where a value stops rounding to a one-byte floating ``dtype``'s largest finite value: half its last step
    above it (what a cast then makes inf or NaN, or, in a dtype without inf, saturates), and whether that tie
    itself still rounds down to it (to even: float8_e4m3fn's 448 is even, e5m2's 57344 is not). Found among the
    dtype's 256 values and by torch's own cast (torch's finfo gives some float8 types an eps their top step lacks)."""
    import torch

    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    top = values[values.isfinite() & (values > 0)].unique().sort().values
    edge = float(top[-1] + (top[-1] - top[-2]) / 2)
    return edge, float(torch.tensor([edge]).to(dtype).float()[0]) == float(top[-1])


def exact_whole_numbers(dtype: torch.dtype) -> float:
    """The magnitude below which floating ``dtype`` holds every whole number exactly: 2 ** (its mantissa's bits
    + 1), 256 for bf16, 2048 for fp16. A whole number cast to ``dtype`` that stays under it in magnitude is
    unchanged."""
    import torch

    return 2.0 / torch.finfo(dtype).eps


def rounds_whole_numbers(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting floating ``source`` to floating ``target`` can round a whole number (``target`` has fewer
    mantissa bits: fp32 -> bf16 or fp16, fp16 -> bf16, fp64 -> fp32)."""
    import torch

    return (source.is_floating_point and target.is_floating_point
            and torch.finfo(target).eps > torch.finfo(source).eps)


def changed_by_cast(job: TensorJob, chunk: int = 1 << 22) -> float | None:
    """Whether casting ``job``'s source to ``job.dtype`` changes what `verify --against` fails a file for (its rule,
    computed here on its own): a 0-dim value, or a tensor whose finite values are all whole numbers (a counter, an
    index). None if not; else the largest change. Reads the source again, ``chunk`` elements at a time: it runs only
    for the few tensors whose cast screen said a change was possible (`cast_screen`)."""
    import torch

    n = job.source.numel()
    changed, largest = False, 0.0
    first, stop = 0, min(n, 4096)  # a small first look: where a value is not whole it is usually among the first
    while first < n:
        parts = _source_elements(job, first, stop)
        first, stop = stop, min(n, stop + chunk)
        flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
        finite = flat[flat.isfinite()]
        if job.source.dim() and not bool((finite == finite.trunc()).all()):
            return None  # not a tensor of whole numbers: weights, whose cast is the point
        back = flat.to(job.target_dtype).to(flat.dtype)
        differs = (back != flat) & ~(back.isnan() & flat.isnan())
        if bool(differs.any()):
            changed = True
            both = differs & flat.isfinite() & back.isfinite()  # values made inf: `cast_screen`'s count says so
            if bool(both.any()):
                largest = max(largest, float((back[both].double() - flat[both].double()).abs().max()))
    return largest if changed else None


def narrowing(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` to floating ``target`` can make a finite value inf or NaN (``target``'s largest
    finite value is smaller: fp32 -> fp16, -> bf16 at the very top of fp32's range, and an integer past the
    target's range, int32 -> fp16)."""
    import torch

    if not target.is_floating_point or not (source.is_floating_point or _integer(source)):  # (bool: no iinfo)
        return False
    largest = torch.finfo(source).max if source.is_floating_point else torch.iinfo(source).max
    return torch.finfo(target).max < largest


def _integer(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a plain integer type (torch's iinfo knows it; not complex, not quantized)."""
    import torch

    try:
        torch.iinfo(dtype)
    except TypeError:
        return False
    return True


def overflow_listing(overflowed: Mapping[str, int], *, quoted: bool = False) -> str:
    """``key (N values), ...`` of the tensors a cast made infinite or NaN, the first 20 of them (``quoted``:
    ``'key'``)."""
    keys = sorted(overflowed)
    return ", ".join(f"'{k}' ({overflowed[k]} values)" if quoted else f"{k} ({overflowed[k]} values)"
                     for k in keys[:20]) + (
        f", ... ({len(keys) - 20} more)" if len(keys) > 20 else "")


def exclude_patterns(keys: Sequence[str], cast_keys: Sequence[str]) -> list[str]:
    """``cast_exclude`` patterns that keep exactly ``keys`` out of a cast of ``cast_keys``: one pattern for keys
    that differ only in their numbers (one buffer per layer: ``model.layers.*.pos_ids``) where it matches no
    other cast key, else each key itself (escaped: a key may hold fnmatch's brackets)."""
    def general(key: str) -> str:
        return re.sub(r"\d+", "*", glob.escape(key))

    offenders = set(keys)
    same_form: dict[str, set[str]] = {}  # each cast key under its numbers-as-`*` form
    for key in cast_keys:
        same_form.setdefault(general(key), set()).add(key)
    patterns, covered, refused_forms = [], set(), set()
    for key in sorted(offenders):
        if key in covered:
            continue
        form = general(key)
        # a form that also names a tensor the cast keeps is out at once; else one scan, as `*` spans more than numbers
        group = same_form.get(form, set())
        if (form not in refused_forms and len(group) > 1 and group <= offenders
                and set(fnmatch.filter(cast_keys, form)) <= offenders):
            patterns.append(form)
            covered |= group
        else:
            refused_forms.add(form)
            patterns.append(glob.escape(key))
            covered.add(key)
    return patterns


def cast_error(overflowed: Mapping[str, int], changed: Mapping[str, float], jobs: Sequence[TensorJob]) -> ConvertError:
    """The error for casts that made finite values of these keys inf or NaN (``overflowed``: how many), or changed
    a tensor of whole numbers or a 0-dim value (``changed``: by up to how much; `changed_by_cast`), listing every
    one and the fix."""
    import torch

    keys = sorted(set(overflowed) | set(changed))
    by_key = {j.key: j for j in jobs}
    target = by_key[keys[0]].target_dtype
    name = str(target).removeprefix("torch.")
    said = []
    if overflowed:
        said.append(f"would make finite values infinite or NaN (beyond its range, +-{torch.finfo(target).max:g}) in"
                    f" {len(overflowed)} tensor(s): {overflow_listing(overflowed)}")
    if changed:
        listed = sorted(changed)
        said.append(f"would change {len(listed)} tensor(s) of whole numbers (a counter or an index?) or 0-dim"
                    " value(s), which `fsdp-restore verify --against` then fails: " + ", ".join(
                        f"{k} ({'0-dim' if by_key[k].source.dim() == 0 else 'whole numbers'}, by up to {changed[k]:g})"
                        for k in listed[:20]) + (
                        f", ... ({len(listed) - 20} more)" if len(listed) > 20 else ""))
    wider = (f" or cast to bf16 (its range reaches +-{torch.finfo(torch.bfloat16).max:.3g}, but it keeps fewer"
             " digits: whole numbers past 256 change, which is refused too);" if overflowed and not changed
             and target == torch.float16 and all(by_key[k].source_dtype in (torch.float32, torch.bfloat16)
                                                 for k in keys) else "")
    advice = exclude_patterns(keys, [j.key for j in jobs if j.dtype != j.source.dtype])
    return ConvertError(f"the cast to {name} {'; and '.join(said)}; nothing was written. Keep them in their dtype"
                        f" (convert: cast_exclude={advice!r}, added to any patterns given before; save: cast the"
                        " other tensors yourself and pass no dtype)"
                        + (f";{wider} or bring those values into range first" if overflowed else ""))


def _write_block(block: _Block, progress: ProgressFn | None) -> None:
    """One task: fill this thread's buffer with ``block`` and write it."""
    memory, data = _BUFFERS.get()
    block.writer.fill(block, memory, data, progress)
    block.writer.write(block, memory)


def split_into_shards(jobs: Sequence[TensorJob], max_shard_size: int) -> list[list[TensorJob]]:
    """Greedy, in key order, like Hugging Face: a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorJob]] = [[]]
    size = 0
    for job in jobs:
        if shards[-1] and size + job.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += job.nbytes
    return shards


@dataclass
class OutputFile:
    """One file of an output: its name inside a sharded set (``model-0000k-of-0000n.safetensors``; the
    destination itself for a single file), the tensors it holds and its header metadata."""

    name: str
    jobs: list[TensorJob]
    metadata: dict[str, str]


def file_layout(jobs: Sequence[TensorJob], *, structure_json: str | None, max_shard_size: int | None = None,
                metadata: dict[str, str] | None = None) -> list[OutputFile]:
    """Which tensors go in which output file, with each file's metadata: one file (holding the structure),
    or with ``max_shard_size`` the shards of a set (the structure then lives in the index, `index_bytes`).

    A set id in ``metadata`` (``fsdp_restore.set_id``) goes into every shard (and `index_bytes` copies it into
    the index), so that a reader can tell one write's set from a mix of two; `write_safetensors` draws a new
    one per write (writers on several ranks must agree on one: broadcast it and pass it here)."""
    meta = {META_FORMAT: "pt", META_VERSION: FORMAT_VERSION, **(metadata or {})}
    if max_shard_size is None:
        meta.pop(META_SET_ID, None)  # one file is one version by itself
        return [OutputFile("", list(jobs),
                           dict(meta, **({META_STRUCTURE: structure_json} if structure_json is not None else {})))]
    groups = split_into_shards(jobs, max_shard_size)
    n = len(groups)
    return [OutputFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", group, dict(meta))
            for i, group in enumerate(groups)]


def index_bytes(files: Sequence[OutputFile], *, structure_json: str | None,
                metadata: dict[str, str] | None = None) -> bytes:
    """The ``model.safetensors.index.json`` of a sharded set laid out by `file_layout`: its set id, and its
    own crc32 first in its metadata (`format.build_index`)."""
    meta = {META_FORMAT: "pt", META_VERSION: FORMAT_VERSION, **(metadata or {})}
    if files and META_SET_ID in files[0].metadata:
        meta[META_SET_ID] = files[0].metadata[META_SET_ID]
    return build_index(dict(meta, total_size=sum(j.nbytes for f in files for j in f.jobs),
                            **({META_STRUCTURE: structure_json} if structure_json is not None else {})),
                       {j.key: f.name for f in files for j in f.jobs})


def write_safetensors(dst: str | os.PathLike[str], jobs: Sequence[TensorJob], *, structure_json: str | None,
                      max_shard_size: int | None = None, threads: int | None = None, force: bool = False,
                      progress: ProgressFn | None = None, metadata: dict[str, str] | None = None,
                      share: Share | None = None,
                      check_source: Callable[[dict[str, str] | None, dict[str, dict[int, tuple[int, int]]]], None]
                      | None = None,
                      record_sources: bool = False,
                      before_write: Callable[[], None] | None = None) -> WriteResult:
    """Write ``jobs`` to ``dst`` atomically: one file, or (with ``max_shard_size``) a directory of
    ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.

    Everything is written under a temporary name next to ``dst``, fsynced, then put in place in one step
    (`_replace`); on any error the temporaries are removed and ``dst`` is untouched. An existing ``dst`` is
    replaced only with ``force=True``. ``metadata`` goes into every file's header (and the index); the
    shards of a set and its index also share a set id (`file_layout`).

    ``share``: this process's part of a write made by several (`share.Share`; every rank calls this with the
    same ``jobs``): rank 0 creates the temporary, every rank writes its share of the blocks, rank 0 joins the
    checksums and renames; a failure on any rank is the same `ConvertError` on every rank.

    ``check_source``: rank 0's check of the source (`source_crc.SourceCheck`: its own crc32s), called with every
    key's checksum before the output is put in place, and with None before a cast's error is raised (damage may be
    what made the cast overflow), and each time with the crc32s of the source bytes the casts read
    (`_FileWriter.source_segments`, taken with ``record_sources``, on every rank); what it raises is the write's
    error, on every rank.

    ``before_write``: called once the output is laid out, before its first block is written (a proof that what the
    blocks will read is where it was taken to be: `plain_pt._Archive.prove_assumed`); what it raises is the write's
    error, with nothing left under any name. A write made by one process only (other ranks would not wait for it)."""
    dst_given, dst = dst, Path(dst)
    one = share or Share(0, 1)
    lead = one.rank == 0
    if before_write is not None and one.world > 1:
        raise ValueError("before_write is for a write made by one process: the other ranks would not wait for it")

    def prepare() -> None:
        if lead:
            check_destination(dst_given, force=force, one_file=max_shard_size is None)
            make_parent(dst)
            remove_stale_temporaries(dst)

    one.step("destination", prepare)
    if one.world > 1 and len(names_given := set(one.gather(dst.name, "destination"))) > 1:
        raise ConvertError(f"the ranks were given different destinations ({', '.join(sorted(names_given))}): give every"
                           " rank the same one (a path every rank sees)")  # rank 0's name would be written alone
    tmp_name, set_id = one.first((temporary_name(dst), uuid.uuid4().hex),
                                 "the temporary's name")
    tmp = dst.parent / tmp_name
    sharded = max_shard_size is not None
    if sharded:  # a new id per write, in every shard and the index (`file_layout`)
        metadata = {**(metadata or {}), META_SET_ID: set_id}
    files = file_layout(jobs, structure_json=structure_json, max_shard_size=max_shard_size, metadata=metadata)
    groups, file_meta = [f.jobs for f in files], [f.metadata for f in files]
    names = [f.name for f in files] if sharded else [tmp.name]
    root = tmp if sharded else dst.parent
    writers: list[_FileWriter] = []

    def open_files(create: bool) -> None:
        try:
            if create and sharded:
                tmp.mkdir()
            for group, name, fmeta in zip(groups, names, file_meta):
                writers.append(_FileWriter(root / name, group, fmeta, create=create, record_sources=record_sources))
        except OSError as e:
            if not create:
                raise
            raise said_of_the_directory(e, dst) from None

    try:
        one.step("create", lambda: open_files(True) if lead else None)
        one.step("open", lambda: None if lead else open_files(False))
        if one.world > 1 and len(set(one.gather(zlib.crc32(b"".join(w.header for w in writers)), "layout"))) > 1:
            raise ConvertError("the ranks laid the output out differently: each rank must convert the same source"
                               " with the same options")  # (the same files, byte for byte, on every rank)
        blocks = one.mine([block for w in writers for block in w.blocks()])

        def write_blocks() -> None:
            if before_write is not None:
                before_write()
            with ThreadPoolExecutor(max_workers=threads or default_io_threads()) as pool:
                try:
                    for f in [pool.submit(_write_block, block, progress) for block in blocks]:
                        f.result()
                except OSError as e:
                    raise said_of_space(e, dst, sum(w.size for w in writers)) from None
            if one.world > 1:  # on the device before rank 0 commits (a single process fsyncs in `finish`)
                for w in writers:
                    os.fsync(w.fd)
            for w in writers:  # the few tensors the cast screen could not clear, judged whole
                for job in w.jobs:
                    if job.key in w.rounded and (change := changed_by_cast(job)) is not None:
                        rounded[job.key] = change

        rounded: dict[str, float] = {}
        one.step("write", write_blocks)
        # in one exchange: every rank's casts that overflowed or changed whole numbers, and its crc32 pieces (and
        # header pages) for rank 0's `finish` (a single process needs no pieces)
        pieces = [w.segments() for w in writers] if one.world > 1 else []
        counts = sum((w.overflowed for w in writers), Counter())
        gathered = one.gather((counts, rounded, pieces), "checksums")
        overflowed = sum((rank_counts for rank_counts, _, _ in gathered), Counter())
        changed = {key: change for _, rank_changed, _ in gathered for key, change in rank_changed.items()
                   if key not in overflowed}  # values made infinite: said once, as such
        if lead:  # every rank's pieces, for the checksums (and the source check) below
            for _, _, rank_segments in gathered[1:]:
                for w, segments in zip(writers, rank_segments):
                    w.add_segments(segments)

        def source_sums() -> dict[str, dict[int, tuple[int, int]]]:
            return {key: segments for w in writers for key, segments in w.source_segments().items()}

        if overflowed or changed:  # every offender at once, from every rank's blocks, before the output is in place
            if check_source is not None or one.world > 1:  # a damaged source is what to say first, if it is damaged
                one.step("check the source",
                         lambda: check_source(None, source_sums()) if check_source is not None else None)
            raise cast_error(overflowed, changed, jobs)
        result = WriteResult(paths=[], nbytes=sum(j.nbytes for j in jobs))
        renamed: list[bool] = []  # set by rank 0's commit once the output is in place

        def commit() -> None:
            if not lead:
                return
            for w in writers:
                try:
                    w.finish()  # (a network file system may say the space ran out only at the fsync)
                except OSError as e:
                    raise said_of_space(e, dst, sum(w.size for w in writers)) from None
                result.checksums.update(w.checksums)
            if check_source is not None:
                check_source(result.checksums, source_sums())
            if sharded:
                _write_small_file(tmp / DEFAULT_INDEX_NAME, index_bytes(files, structure_json=structure_json,
                                                                        metadata=metadata))
                _fsync_dir(tmp)
            refuse_foreign_directory(dst, one_file=not sharded)
            carry_kept_files(dst, tmp)
            _replace(tmp, dst)
            renamed.append(True)

        try:
            one.step("commit", commit)
            result.checksums = one.first(result.checksums, "commit")
        except ConvertError as e:  # a rank that died now may have died after rank 0's rename: say so
            if DIED_NOTE not in str(e) or (lead and not renamed):
                raise
            raise ConvertError(str(e).replace(DIED_NOTE, (
                f"the output is in place and whole at {dst} (this rank renamed it only once every rank had written"
                " and fsynced its blocks)" if renamed else
                f"rank 0 may have put the output in place just before (it is then whole): fsdp-restore verify {dst}"
                " shows whether it is there"))) from None
        for w in writers:  # rank 0's are closed by `finish`; the other ranks' here
            w.close()
        result.paths = [dst / name for name in names] if sharded else [dst]
        return result
    except BaseException:
        for w in writers:
            w.close()
        if lead:  # the temporary is rank 0's; after its rename nothing is left under that name
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:  # (a read-only file system refuses even the unlink of a name it never made: the error is above)
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
        raise


_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # `file_layout`'s names, and Hugging Face's


def through_link(path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """Where a write to ``path`` goes: where a symbolic link there points (as ``torch.save`` writes through one),
    else ``path`` itself. The link stays: replaced by the checkpoint, it would leave its target stale (`latest`
    pointing at a step's file) or, for a model directory, the new shards without that directory's other files."""
    text = os.fspath(path)
    bare = text.rstrip("/" if isinstance(text, str) else b"/") or text  # "link/" is the directory, not the link
    if not os.path.islink(bare):
        return path
    target = os.path.realpath(bare)
    return target + os.sep if isinstance(text, str) and text != bare else target


def check_destination(dst: str | os.PathLike[str], *, force: bool, sources: Sequence[str | os.PathLike[str]] = (),
                      one_file: bool = False) -> None:
    """Refuse, before anything is read or written, a destination whose replacement would lose what it is not:
    a ``dst`` that is one of ``sources`` or a directory holding one, or lies inside a source directory, and a
    directory holding anything but a sharded checkpoint (shards and their index), since replacing a directory
    removes all of it (``force`` or not: forcing would not help); then any existing ``dst`` without ``force``.
    `FileExistsError` naming the path and what to do. ``one_file``: the write makes one file, so a ``dst`` written
    as a directory (ending with a separator) is a `ValueError` (it would become a file of that name); else it makes
    a directory of shards, so a ``dst`` named as a file (``.safetensors``) is one."""
    if one_file and str(os.fspath(dst)).endswith(("/", os.sep)):
        raise ValueError(f"{os.fspath(dst)} names a directory (it ends with a separator), but this writes one file:"
                         " give the file's name (e.g. model.safetensors inside it), or max_shard_size= (CLI:"
                         " --max-shard-size) for a directory of shards")
    dst = Path(dst)
    if not one_file and dst.suffix == ".safetensors":  # a directory under a file's name: what no loader opens
        raise ValueError(f"{os.fspath(dst)} names a file, but this writes a directory of shards (max_shard_size, CLI:"
                         f" --max-shard-size: model-0000k-of-0000n.safetensors and {DEFAULT_INDEX_NAME}): give the"
                         f" directory's name (e.g. {dst.with_suffix('')}), or drop max_shard_size for one file")
    _refuse_long_name(dst)
    if not (dst.exists() or dst.is_symlink()):
        return
    special = _special_file_kind(os.lstat(dst).st_mode)
    if special:  # (the rename would put a checkpoint in place of /dev/null, as root)
        raise FileExistsError(f"{dst} is a {special}, not a file or a directory: a checkpoint written there would"
                              " replace it; give the path of a file")
    target = dst.resolve()
    for src in sources:
        where = Path(src).resolve()
        if not one_file and target in where.parents:  # shards go in beside other files
            raise FileExistsError(f"{dst} holds the source {src}: a set of shards written beside it would leave two"
                                  " checkpoints' weights in one directory (a loader reads one of them), and"
                                  " replacing the directory would delete the source; write the shards to another"
                                  f" directory (e.g. {dst.name}-safetensors) and copy the config files over")
        if where == target or target in where.parents:
            what = "is the source" if where == target else f"is a directory holding the source {src}"
            raise FileExistsError(f"{dst} {what}: replacing it would delete the source; write to another path")
        if where.is_dir() and where in target.parents:  # a file of a ZeRO or DCP source, perhaps
            raise FileExistsError(f"{dst} lies inside the source directory {src}: replacing it could delete part of"
                                  " the source; write to a path outside it")
    refuse_foreign_directory(dst, one_file=one_file)  # before the advice to force it: forcing would not help
    if not force:
        raise FileExistsError(f"{dst} already exists; pass force=True (CLI: --force) to replace it")


# what the temporaries' names add to the destination's: "." + name + ".tmp-<pid>-<node>-old-<8 hex digits>"
_TEMPORARY_NAME_EXTRA = len(".") + len(".tmp-") + 7 + len("-") + 8 + len("-old-") + 8


@functools.cache
def _node() -> str:
    """Eight hex digits naming this machine in a temporary's name: a pid says whether its writer is alive only on
    the machine that wrote it (a shared file system shows the temporaries of every node's writers)."""
    import socket
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def temporary_name(dst: Path, *, old: bool = False) -> str:
    """The name a write of ``dst`` works under (``old``: where a replacement moves the old version aside): the
    writer's pid and machine, then a random part, so that a later run can tell a dead writer's leftovers."""
    return f".{dst.name}.tmp-{os.getpid()}-{_node()}-{'old-' if old else ''}{uuid.uuid4().hex[:8]}"


def _writer_of(tmp: Path, dst: Path) -> tuple[str, str | None, bool] | None:
    """From a temporary's name: its writer's pid, its machine (None in names made before machines were named) and
    whether it holds a moved-aside old version; None where the name is no temporary of ``dst`` (the glob also finds
    those of another destination whose name starts with this one's, such as ``ck.tmp-5`` beside ``ck``)."""
    found = re.fullmatch(rf"\.{re.escape(dst.name)}\.tmp-(\d+)(?:-([0-9a-f]{{8}}))?-(old-)?[0-9a-f]{{8}}", tmp.name)
    return (found[1], found[2], found[3] is not None) if found else None


def _refuse_long_name(dst: Path) -> None:
    """A name the file system takes, but not with what the temporary's adds: refused at the door, not as a raw
    ENAMETOOLONG from the temporary the user never named."""
    limit = 255  # NAME_MAX of Linux file systems
    with contextlib.suppress(OSError, ValueError):
        limit = os.pathconf(next(p for p in [dst.parent, *dst.parent.parents] if p.exists()), "PC_NAME_MAX")
    size = len(os.fsencode(dst.name))
    if size + _TEMPORARY_NAME_EXTRA > limit:
        raise ValueError(f"{dst}: its name is {size} bytes long; a checkpoint is first written under a temporary name"
                         f" {_TEMPORARY_NAME_EXTRA} bytes longer, and names here hold at most {limit} bytes: give a"
                         f" name of at most {limit - _TEMPORARY_NAME_EXTRA} bytes")


def _special_file_kind(mode: int) -> str | None:
    for test, kind in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return None


# what a file's name says it holds: the weights of some checkpoint, which a new set of shards beside them would
# leave to shadow or contradict it (a loader may take model.safetensors before the index)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".msgpack", ".h5", ".gguf", ".distcp")


def _ours(p: Path) -> bool:
    return p.is_file() and (p.name == DEFAULT_INDEX_NAME or _SHARD_NAME.fullmatch(p.name) is not None)


def _kept(p: Path) -> bool:
    """A file of a checkpoint directory that a new set of shards keeps beside it (a Hugging Face model directory's
    config.json, tokenizer and README): a plain file that is neither ours nor weights nor an index."""
    return (p.is_file() and not p.is_symlink() and not _ours(p) and not p.name.lower().endswith(_WEIGHT_SUFFIXES)
            and not p.name.endswith(".index.json"))


def refuse_foreign_directory(dst: Path, *, one_file: bool = True) -> None:
    """`FileExistsError` if ``dst`` is a directory holding what the write would lose: for one file (which takes the
    directory's place), anything but a sharded checkpoint (its shards and index); for a set of shards, anything it
    does not keep beside them (`_kept`: directories, links, weights of another checkpoint). Checked at the door
    and again just before the new version replaces ``dst``, since a long write leaves time for someone to put a
    file there."""
    if dst.is_dir() and not dst.is_symlink():
        others = sorted(p.name for p in dst.iterdir() if not (_ours(p) or (not one_file and _kept(p))))
        if others:
            listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            if one_file:
                raise FileExistsError(f"{dst} is a directory holding more than a sharded checkpoint ({listed});"
                                      " replacing it would delete them: write to a new path, or move them out first")
            raise FileExistsError(f"{dst} holds {listed}, which a new set of shards would delete (directories, links)"
                                  " or leave beside it to be read instead (another checkpoint's weights): write to a"
                                  " new path, or move them out first (other files, such as a config, are kept)")


def carry_kept_files(dst: Path, tmp: Path) -> None:
    """Into the new set's directory ``tmp``, just before it replaces ``dst``: the files of ``dst`` a set of shards
    keeps (`_kept`), hard-linked (else copied), then the directory's own mode, group and extended attributes
    (ACLs), so that the replacement leaves them as they were."""
    if not (dst.is_dir() and not dst.is_symlink() and tmp.is_dir()):
        return
    for p in dst.iterdir():
        if _kept(p) and not (tmp / p.name).exists():
            try:
                os.link(p, tmp / p.name)
            except OSError:  # another file system's rules (no hard links)
                shutil.copy2(p, tmp / p.name)
    with contextlib.suppress(OSError):  # a group this user is not in: the directory keeps the user's own
        os.chown(tmp, -1, dst.stat().st_gid)
    shutil.copystat(dst, tmp)  # last: the mode (setgid included) may forbid the links above; extended attributes
    _fsync_dir(tmp)


def remove_stale_temporaries(dst: Path) -> list[Path]:
    """Delete temporaries of ``dst`` left by writers that died (killed, power loss): their pid is gone.

    They are a half-written new version, or an old version that a replacement moved aside and had not
    removed yet. Should ``dst`` itself be missing (a writer died between the two renames of the fallback
    in `_replace`), the old version it moved aside is put back instead of removed. Names of writers that
    predate this scheme (``.NAME.old-*``) are handled the same way. A temporary written on another machine
    (a shared file system) is kept, with a warning: whether its writer lives cannot be told from here.
    """
    removed, elsewhere = [], []
    candidates = [(tmp, *writer) for tmp in dst.parent.glob(f".{glob.escape(dst.name)}.tmp-*")
                  if (writer := _writer_of(tmp, dst)) is not None]
    candidates += [(old, "", None, True) for old in dst.parent.glob(f".{glob.escape(dst.name)}.old-*")  # no pid
                   if re.fullmatch(rf"\.{re.escape(dst.name)}\.old-[0-9a-f]{{8}}", old.name)]
    for tmp, pid, node, old in sorted(candidates, key=lambda c: not c[3]):  # moved-aside old versions first
        if node is not None and node != _node():
            elsewhere.append(tmp.name)
            continue
        if pid.isdigit() and (int(pid) == os.getpid() or _pid_alive(int(pid))):
            continue
        if pid and not old or dst.exists() or dst.is_symlink():
            _remove(tmp)
            removed.append(tmp)
        else:  # the only copy of the old version: back under its name
            os.rename(tmp, dst)
    if elsewhere:
        them = "them" if len(elsewhere) > 1 else "it"
        warnings.warn(f"{dst.parent}: kept {', '.join(sorted(elsewhere))}: written for {dst.name} on another machine,"
                      f" whose write may still be running; delete {them} if no write to this path runs anywhere",
                      stacklevel=2)
    return removed


def make_parent(dst: Path) -> None:
    """Create the directories on ``dst``'s path that are missing (as DCP's writer and ``save_pretrained`` do: a
    save into ``run/step1000/`` needs no ``mkdir`` first); a refusal is said of the directory the user named."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTDIR, errno.ELOOP):
            in_the_way = next((d for d in [dst.parent, *dst.parent.parents] if os.path.lexists(d)), dst.parent)
            what = ("a symbolic link that leads nowhere (broken, or a loop)" if os.path.islink(in_the_way)
                    and not os.path.exists(in_the_way) else "a file, not a directory")
            raise type(e)(e.errno, f"cannot create the directory {dst.parent}: {in_the_way} is {what}; give a"
                          " destination in a directory") from None
        # (a permission, a read-only or special file system such as /proc, a full disk: said of their directory)
        raise type(e)(e.errno, f"cannot create the directory {dst.parent} ({e.strerror}): give a destination in a"
                      " directory you can write to") from None


def said_of_space(e: OSError, dst: Path, needed: int) -> OSError:
    """A full disk or quota said of the destination, with what the checkpoint needs (it was "[Errno 28] No space
    left on device", no path); any other error as it is."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return e
    # (not what is free now: the failed write's own temporary holds some of it until it is removed)
    size = f"{needed / 1e9:.2f} GB" if needed >= 1e9 else f"{needed / 1e6:.1f} MB"
    return type(e)(e.errno, f"no space left for {dst.name} in {dst.parent} ({e.strerror}): the checkpoint needs"
                            f" {size} there; free some, or give a destination on another disk")


def said_of_the_directory(e: OSError, dst: Path) -> OSError:
    """A refusal to create the temporary beside ``dst`` (permissions, a read-only filesystem), said of the directory
    the user named, not of a temporary they never heard of; any other error as it is. (/proc says ENOENT of a name
    in a directory that exists: a refusal too.)"""
    if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) and not (e.errno == errno.ENOENT
                                                                        and dst.parent.is_dir()):
        return e
    return type(e)(e.errno, f"cannot create files in {dst.parent} ({e.strerror}): the checkpoint is written there"
                   f" under a temporary name, then renamed to {dst.name}; give a destination in a directory you can"
                   " write to")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_small_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


def _exchange(a: Path, b: Path) -> None:
    """Swap the names ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); an `OSError`
    with ENOSYS, EINVAL or EOPNOTSUPP where the system or file system cannot."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def _replace(tmp: Path, dst: Path) -> None:
    """Put the finished temporary ``tmp`` in place of ``dst`` in one step, then remove the old version.

    A reader looking up ``dst`` finds the old version or the new one, never none, and a kill at any point
    leaves one of them under ``dst``: a file replaces a file with one ``rename``; where a directory is
    involved (``rename`` cannot replace a non-empty one) the two names are exchanged, and the old version,
    now under the temporary name, is removed after (by the next run if this one is killed first). A
    reader that opened the old version keeps reading it until it closes it (read.py opens each file once
    and a set's shards through one directory descriptor). Where the exchange is not supported (not
    Linux, some network file systems) the old version is first moved aside under a temporary name: for a
    moment ``dst`` is missing (readers get "no such file"), and a kill then leaves it for the next run to
    put back."""
    directory = tmp.is_dir() or (dst.is_dir() and not dst.is_symlink())
    if not (dst.exists() or dst.is_symlink()) or not directory:
        os.replace(tmp, dst)  # atomic; over nothing, a file or a symlink
        _sync_replaced(dst)
        return
    try:
        _exchange(tmp, dst)
        old = tmp
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        old = dst.parent / temporary_name(dst, old=True)
        os.rename(dst, old)
        os.rename(tmp, dst)
    try:
        _sync_replaced(dst)
    finally:
        _remove(old)


class ReplacedError(OSError):
    """The new version is in place under its name, but a step after the rename failed: no error may say the old
    version is still there."""


def _sync_replaced(dst: Path) -> None:
    try:
        _fsync_dir(dst.parent)
    except OSError as e:
        raise ReplacedError(e.errno, f"{dst}: the new version is in place, but syncing its directory to disk failed"
                                     f" ({e.strerror}): a crash before the system writes it back may bring the old"
                                     " version back") from None


def _remove(path: Path) -> None:
    """Delete a file, a symlink or a directory tree (a checkpoint version or a temporary)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink(missing_ok=True)
        except NotADirectoryError:  # a path through a file (a failed save's temporary, never made): nothing there
            pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
