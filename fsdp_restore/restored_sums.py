"""The restored values proven to be the bytes the file was written with (``verify_checksums=True``).

Why: the NaN-fill check proves that every element was written; it cannot see a wrong value: a byte damaged on
disk after the file was written, a copy that differs from the original, a read from the wrong offset. The file
records each tensor's crc32, but a rank holds only its slice of a tensor, and a slice's bytes have no crc32 of
their own to compare with.

crc32 is affine: the crc32 of a tensor is the XOR of its parts' *placed* crcs (each part's bytes at their offset,
zeros elsewhere: `checksum.placed_crc`) and the crc32 of as many zero bytes. So after the reads each rank reads
back the memory it restored (the model's and the optimizer's, not the reader's buffers), folds its parts of
every stored tensor into one 32-bit value, and one all-reduce of those values' bit counts joins the ranks' parts.
Replicas (DDP, HSDP) hold the same parts: a tensor covered ``m`` times gives bit counts that are ``m`` times one
copy's, and their quotient's parity is the XOR of one copy. Each rank then compares every tensor's joined crc32
with the one the file records: the same sums, the same verdict on every rank. Nothing here shares code with the
reader or the executor; the expected value is the header's.

A tensor is not proven, and is listed with the reason instead, where its restored bytes are not the file's (a
cast into the model's dtype), where the file records no crc32 for it (another tool's file), or where the ranks'
reads of it are not one uniform cover (a view read in overlapping parts: its bit counts cannot be divided).
Values the plan reads whole and copies (an optimizer's step counters, hyperparameters) are not read in slices and
are not part of the proof.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .check import DIGEST_PRIME, index_moments
from .checksum import placed_crc, strided_placed_crc, zeros_crc
from .plan import ReadItem
from .read import Checkpoint, _writable_bytes
from .verdict import _all_reduce, _collective

_BITS = 32
_ELEMENTS, _NOT_THE_FILES, _MOMENT1, _MOMENT2, _OVERLAPPING = _BITS, _BITS + 1, _BITS + 2, _BITS + 3, _BITS + 4
_COLUMNS = _BITS + 5
HOST_PIECE_BYTES = 64 * 1024 * 1024  # device memory is checksummed through host copies of at most this size


@dataclass
class ChecksumVerdict:
    """What the ranks' joined crc32s say, the same on every rank: ``damaged``: one line per stored tensor whose
    restored values are not the bytes the file records a crc32 of; ``proven``: the stored tensors whose are;
    ``unproven``: ``"key: reason"`` for each restored tensor that could not be compared."""

    damaged: list[str] = field(default_factory=list)
    proven: list[str] = field(default_factory=list)
    unproven: list[str] = field(default_factory=list)


def local_sums(items: Sequence[ReadItem], ckpt: Checkpoint, threads: int) -> tuple[dict[str, list[int]], list[str]]:
    """Per stored key this rank restored: ``[placed crc of its parts, elements, 1 if its bytes are not the file's,
    first moment term, second moment term, 1 if the rank read parts of it that overlap]`` (the terms as
    `check.coverage_terms`'s, over the stored tensor's flat indices, modulo `check.DIGEST_PRIME`), and the lines of
    what this rank alone can tell is wrong. Reads the restored memory, on ``threads`` threads.

    One range read twice (a tied tensor restored into two untied parameters) counts once: its two copies must hold
    the same bytes. Parts that overlap otherwise make the rank's share of the tensor two copies cut differently,
    which the join cannot divide: such a tensor is not proven (`_OVERLAPPING`)."""
    sums: dict[str, list[int]] = {}
    parts: dict[str, dict[tuple[int, int, int, int], list[ReadItem]]] = {}
    for item in items:
        if item.dest.numel():
            parts.setdefault(item.key, {}).setdefault((item.src_start, item.run, item.rows, item.stride), []).append(item)
    readable: list[ReadItem] = []
    for key, by_range in parts.items():
        entry = ckpt.entries[key]
        numel = entry.numel
        row = sums[key] = [0, 0, 0, 0, 0, int(_overlapping(list(by_range)))]
        for (start, run, rows, stride), same in by_range.items():
            count = same[0].dest.numel()
            s1, s2 = index_moments(start, run, rows, stride)
            row[1] += count
            row[3] = (row[3] + 2 * s1 - count * (numel - 1)) % DIGEST_PRIME
            row[4] = (row[4] + 6 * s2 - count * (numel - 1) * (2 * numel - 1)) % DIGEST_PRIME
            if any(i.dest.dtype != entry.dtype for i in same):
                row[2] = 1
            else:
                readable.extend(same)
    placed: dict[int, int] = {}
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for item, crc in zip(readable, pool.map(lambda i: _placed(i, ckpt), readable)):
            placed[id(item)] = crc
    damaged: list[str] = []
    for key, by_range in parts.items():
        for same in by_range.values():
            crcs = {placed[id(i)] for i in same if id(i) in placed}
            if len(crcs) > 1:
                names = ", ".join(sorted({i.name for i in same}))
                damaged.append(f"{key}: one stored range read into {names} holds different bytes in each")
            if crcs:
                sums[key][0] ^= crcs.pop()
    return sums, damaged


def _overlapping(ranges: list[tuple[int, int, int, int]]) -> bool:
    """Whether distinct parts ``(start, run, rows, stride)`` of one stored tensor share an element."""
    if len(ranges) < 2:
        return False
    if any(rows > 1 for _, _, rows, _ in ranges):
        return True  # column blocks of one tensor twice on one rank: only aliases do that; not divided
    spans = sorted((start, start + run) for start, run, _, _ in ranges)
    return any(nxt[0] < prev[1] for prev, nxt in zip(spans, spans[1:]))


def _placed(item: ReadItem, ckpt: Checkpoint) -> int:
    """The placed crc of the bytes ``item`` restored, at their place in the stored tensor."""
    entry = ckpt.entries[item.key]
    size = entry.itemsize
    first = item.src_start * size
    if item.rows <= 1:
        nbytes = item.dest.numel() * size
        return placed_crc(_crc(item.dest), nbytes, entry.nbytes - first - nbytes)
    run, stride = item.run, item.stride
    data = _host_bytes(item.dest)  # once: a device's block in one copy, not one per row
    step = run * size
    rows = [zlib.crc32(data[i * step:(i + 1) * step]) for i in range(item.rows)]
    last_end = first + ((item.rows - 1) * stride + run) * size
    return strided_placed_crc(rows, run * size, stride * size, entry.nbytes - last_end)


def _host_bytes(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-D tensor in host memory: a view of CPU memory, a copy of a device's."""
    if flat.device.type == "cpu":
        return _writable_bytes(flat)
    return memoryview(flat.view(torch.uint8).cpu().numpy()).cast("B")


def _crc(flat: torch.Tensor) -> int:
    """crc32 of a contiguous 1-D tensor's bytes, wherever it lies (device memory through host copies)."""
    if flat.device.type == "cpu":
        return zlib.crc32(_writable_bytes(flat))
    raw, crc = flat.view(torch.uint8), 0
    for start in range(0, raw.numel(), HOST_PIECE_BYTES):
        crc = zlib.crc32(raw[start:start + HOST_PIECE_BYTES].cpu().numpy(), crc)
    return crc


def joined_verdict(sums: dict[str, list[int]], ckpt: Checkpoint, what: str,
                   group: dist.ProcessGroup | None) -> ChecksumVerdict:
    """Join every rank's `local_sums` (one all-reduce over the checkpoint's keys, in one order on every rank) and
    compare each restored tensor's crc32 with the file's. Every rank of ``group`` calls it at the same point."""
    keys = sorted(ckpt.entries)
    table = [[0] * _COLUMNS for _ in keys]
    for i, key in enumerate(keys):
        row = sums.get(key)
        if row is None:
            continue
        placed, elements, not_the_files, m1, m2, overlapping = row
        table[i][:_BITS] = [(placed >> bit) & 1 for bit in range(_BITS)]
        table[i][_ELEMENTS:] = [elements, not_the_files, m1, m2, overlapping]
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if several and keys:
        with _collective(what, "joining the ranks' checksums"):
            flat = _all_reduce([x for row in table for x in row], group)
        table = [flat[i * _COLUMNS:(i + 1) * _COLUMNS] for i in range(len(keys))]
    verdict = ChecksumVerdict()
    for key, row in zip(keys, table):
        elements = row[_ELEMENTS]
        if elements == 0:
            continue  # not restored by this call (another subtree, strict=False, a key map's choice)
        entry = ckpt.entries[key]
        recorded = ckpt.checksums.get(key)
        if recorded is None:
            verdict.unproven.append(f"{key}: the file records no checksum for it (written by another tool)")
        elif row[_NOT_THE_FILES]:
            verdict.unproven.append(f"{key}: cast into the model's dtype on reading, so its bytes are not the file's")
        elif row[_OVERLAPPING]:
            verdict.unproven.append(f"{key}: read on one rank in parts that overlap (a tied tensor restored into"
                                    " parameters sharded otherwise)")
        elif elements % entry.numel or row[_MOMENT1] % DIGEST_PRIME or row[_MOMENT2] % DIGEST_PRIME:
            verdict.unproven.append(f"{key}: read in parts that do not cover it uniformly (views of it?)")
        elif any(count % (elements // entry.numel) for count in row[:_BITS]):
            verdict.damaged.append(f"{key}: the ranks that hold copies of it restored different bytes (their copies"
                                   " of the file differ?)")
        else:
            copies = elements // entry.numel
            placed = sum(((count // copies) & 1) << bit for bit, count in enumerate(row[:_BITS]))
            crc = placed ^ zeros_crc(entry.nbytes)
            if crc != int(recorded, 16):
                verdict.damaged.append(f"{key}: crc32 of the restored values {crc:08x}, the file records {recorded}")
            else:
                verdict.proven.append(key)
    return verdict
