"""The crc32s ``torch.save`` recorded in its zip archive, checked against what a conversion read.

``torch.save`` writes a crc32 of every record of its archive (the pickle, each storage's bytes), and
``torch.load`` does not check them: a bit flipped on a disk or in a copy since the save loads as a changed
value, and a conversion would then stamp its own checksums on the damaged bytes, blessing them for good.

So the conversion checks the source's records. The small ones (the pickle, the version, the byte order) first,
before the pickle is read: damage there is named as damage, not as whatever the damaged pickle then looks like
(a bad opcode, a class to allow). The storages before the output is put in place: most cost nothing, a storage
whose bytes the output holds unchanged, tiled exactly by the tensors written from it (the usual case: a tensor
is its whole storage; tied tensors share one), has a crc32 that follows from the tensors' own checksums
(`checksum.combine_segments`); the rest a converted tensor draws on (casts, views of part of a storage, strided
tensors) are read again and checksummed.
"""

from __future__ import annotations

import os
import zlib
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from typing import Any

from .checksum import combine_segments
from .errors import FormatError
from .plain_pt import NotPlain, ZipMember, _Archive

READ_BYTES = 16 * 1024 * 1024  # a record read again in pieces of this size: bounded memory per thread


@dataclass(frozen=True)
class SourceCrcs:
    """What a conversion checked of its source's recorded crc32s (`ConvertReport.source_crcs`)."""

    checked: int  # records whose bytes matched their crc32
    records: int  # records in the archive
    reread_bytes: int = 0  # bytes read a second time to check them (the rest followed from the written tensors)
    unrecorded: int = 0  # records saved without a crc32 (``torch.serialization.set_crc32_options(False)``)
    note: str = ""  # why nothing was checked, where nothing was


def describe(crcs: SourceCrcs | None) -> str:
    """One line for the conversion's report."""
    if crcs is None:
        return "not checked"
    if crcs.note:
        return f"none ({crcs.note})"
    if not crcs.checked and crcs.unrecorded:
        return "none recorded (saved with torch.serialization.set_crc32_options(False))"
    text = f"{crcs.checked} of {crcs.records} records"
    if crcs.checked + crcs.unrecorded < crcs.records:
        text += " (the rest not converted)"
    return text + (f", {crcs.reread_bytes / 1e6:.1f} MB read again" if crcs.reread_bytes >= 1e5 else "")


class Archive:
    """A ``torch.save`` archive's records as its central directory lists them (parsed once per conversion)."""

    def __init__(self, fd: int) -> None:
        self.parsed = _Archive(fd)  # NotPlain: not laid out as torch.save lays it out
        self.fd = fd
        self.members: list[ZipMember] = self.parsed.members

    @staticmethod
    def open(fd: int) -> Archive | None:
        """The archive open as ``fd``, or None where it is not one laid out as ``torch.save``'s (a legacy file,
        compressed records, another writer): its records are then not checked."""
        try:
            return Archive(fd)
        except (NotPlain, OSError):
            return None

    def data_at(self, member: ZipMember) -> int:
        return self.parsed.data_at(member)


def _is_storage(member: ZipMember) -> bool:
    return "/data/" in member.filename


def check_small_records(src: str | os.PathLike[str], archive: Archive) -> int:
    """Check every record but the storages (the pickle, the version, the byte order ...: a few, small) against its
    crc32, before the pickle is read; `FormatError` naming each damaged one. Returns how many were checked."""
    bad, checked = [], 0
    for member in archive.members:
        if _is_storage(member) or not member.CRC:
            continue
        got = _crc_of(archive.fd, archive.data_at(member), member.file_size)
        if got != member.CRC:
            bad.append((member, got, ()))
        checked += 1
    if bad:
        raise FormatError(src, damaged_records(bad))
    return checked


@dataclass
class SourceCheck:
    """The check of the storages a conversion draws from (`plan_source_check`), called by the writer: with None
    before it raises another error (a cast's: what damage would also make it say), with every written tensor's
    checksum before the output is put in place."""

    src: str
    fd: int
    threads: int
    records: int  # in the archive
    small_checked: int  # `check_small_records`'
    unrecorded: int
    tiled: list[tuple[ZipMember, list[tuple[str, int]]]] = field(default_factory=list)
    reread: list[tuple[ZipMember, int]] = field(default_factory=list)  # (record, where its data starts)
    _reread_bad: list[tuple[ZipMember, int, Sequence[str]]] | None = None

    def summary(self) -> SourceCrcs:
        return SourceCrcs(checked=self.small_checked + len(self.tiled) + len(self.reread), records=self.records,
                          reread_bytes=sum(m.file_size for m, _ in self.reread), unrecorded=self.unrecorded)

    def __call__(self, checksums: Mapping[str, str] | None) -> None:
        """Raise `FormatError` naming every storage whose bytes are not those its crc32 was taken of: those read
        again, and given the written tensors' ``checksums``, those they tile."""
        if self._reread_bad is None:
            self._reread_bad = []
            if self.reread:
                with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(self.reread)))) as pool:
                    crcs = pool.map(lambda r: _crc_of(self.fd, r[1], r[0].file_size), self.reread)
                    self._reread_bad = [(m, got, ()) for (m, _), got in zip(self.reread, crcs) if got != m.CRC]
        bad = list(self._reread_bad)
        if checksums is not None:
            for member, tiles in self.tiled:
                if len(tiles) == 1:  # a tensor that is its whole storage: its crc32 is the record's
                    got = int(checksums[tiles[0][0]], 16)
                else:
                    got = combine_segments((int(checksums[key], 16), nbytes) for key, nbytes in tiles)
                if got != member.CRC:
                    bad.append((member, got, [key for key, _ in tiles]))
        if bad:
            raise FormatError(self.src, damaged_records(bad))


def _crc_of(fd: int, at: int, size: int) -> int:
    crc, end = 0, at + size
    while at < end:
        data = os.pread(fd, min(READ_BYTES, end - at), at)
        if not data:
            break  # shorter than its record: the crc says so
        crc, at = zlib.crc32(data, crc), at + len(data)
    return crc


def damaged_records(bad: Sequence[tuple[ZipMember, int, Sequence[str]]]) -> str:
    """The message for records whose bytes differ from what the archive's crc32s were taken of: every one."""
    shown = [f"'{member.filename}' (recorded {member.CRC:08x}, now {got:08x}"
             + (f"; tensors {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})" if keys else ")")
             for member, got, keys in bad[:10]]
    more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
    return (f"{len(bad)} record(s) of the archive differ from the crc32 torch.save recorded for them: "
            f"{'; '.join(shown)}{more}. The file changed after it was saved (a damaged copy or disk); torch.load does"
            " not check this and would load the changed values. Copy the checkpoint again from where it was saved;"
            " nothing was written")


@dataclass(frozen=True)
class Drawn:
    """A converted tensor's bytes in the source file: ``storage_at``, where its storage's record data starts;
    ``first``/``nbytes``, its own bytes, contiguous from ``first`` where it is one run (else ``first`` is -1); and
    whether the output holds them unchanged (no cast, contiguous)."""

    storage_at: int
    first: int
    nbytes: int
    unchanged: bool


def plan_source_check(src: str | os.PathLike[str], archive: Archive, drawn: Mapping[str, Drawn], *,
                      threads: int, small_checked: int, every_storage: bool = False) -> SourceCheck:
    """The check of the storage records the conversion draws from (``drawn``: per converted tensor whose storage
    was found). A record is checked from its tensors' checksums where the unchanged ones tile it exactly, else read
    again; a record no converted tensor draws from (``select``) is left alone, unless ``every_storage`` (where
    the tensors' storages could not be placed: all are read)."""
    storages = sorted((m for m in archive.members if _is_storage(m)), key=lambda m: m.header_offset)
    check = SourceCheck(str(src), archive.fd, threads, records=len(archive.members), small_checked=small_checked,
                        unrecorded=sum(1 for m in archive.members if not m.CRC))
    headers = [m.header_offset for m in storages]
    parts: dict[int, list[tuple[int, int, str, bool]]] = {}
    data_at: dict[int, int] = {}
    unplaced = every_storage
    for key, d in drawn.items():
        i = bisect_right(headers, d.storage_at) - 1
        if i < 0 or (i + 1 < len(headers) and d.storage_at >= headers[i + 1]):
            unplaced = True  # (not a storage of this archive as far as can be told: check them all)
            continue
        data_at[i] = d.storage_at
        parts.setdefault(i, []).append((d.first, d.nbytes, key, d.unchanged))
    for i, member in enumerate(storages):
        if not member.CRC or (i not in parts and not unplaced):
            continue
        at = data_at.get(i)
        tiles = _tiles(at, member.file_size, parts[i]) if i in parts else None
        if tiles is not None:
            check.tiled.append((member, tiles))
        else:
            check.reread.append((member, at if at is not None else archive.data_at(member)))
    return check


def _tiles(data_at: int, size: int, parts: list[tuple[int, int, str, bool]]) -> list[tuple[str, int]] | None:
    """The unchanged parts that tile ``size`` bytes from ``data_at`` exactly, in order (a range written twice, as
    by tied tensors, taken once), or None."""
    if len(parts) == 1:  # a tensor that is its whole storage: no sort
        first, nbytes, key, unchanged = parts[0]
        return [(key, nbytes)] if unchanged and first == data_at and nbytes == size else None
    if not all(unchanged for *_, unchanged in parts):
        return None
    at, tiles = data_at, []
    for first, nbytes, key, _ in sorted(parts, key=lambda p: (p[0], -p[1])):
        if first == at - nbytes and tiles and tiles[-1][1] == nbytes:
            continue  # the same range as the last (a tied tensor)
        if first != at:
            return None
        tiles.append((key, nbytes))
        at += nbytes
    return tiles if at == data_at + size else None


def drawn_from(jobs: Iterable[Any], fd: int, storage_at: Mapping[str, int]) -> dict[str, Drawn]:
    """`plan_source_check`'s ``drawn`` of the conversion's ``jobs`` (`write.TensorJob`), given where each one's
    storage's record starts (``storage_at``; a key absent: not a storage's, such as a numpy array's)."""
    out: dict[str, Drawn] = {}
    for job in jobs:
        if job.key not in storage_at:
            continue
        location, source = job.location, job.source
        nbytes = prod(source.shape) * source.dtype.itemsize
        one_run = location is not None and type(location) is tuple and len(location) == 2 and location[0] == fd
        first = location[1] if one_run else -1
        unchanged = one_run and job.reader is None and job.dtype == source.dtype and source.is_contiguous()
        out[job.key] = Drawn(storage_at[job.key], first, nbytes, unchanged)
    return out
