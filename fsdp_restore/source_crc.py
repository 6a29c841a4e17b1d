"""The crc32s ``torch.save`` recorded in its zip archive, checked against what a conversion read.

``torch.save`` writes a crc32 of every record of its archive (the pickle, each storage's bytes), and
``torch.load`` does not check them: a bit flipped on a disk or in a copy since the save loads as a changed
value, and a conversion would then stamp its own checksums on the damaged bytes, blessing them for good.

So the conversion checks the source's records before its output is put in place. Most cost nothing: a
storage record whose bytes the output holds unchanged, tiled exactly by the tensors written from it (the usual
case: a tensor is its whole storage; tied tensors share one), has a crc32 that follows from the tensors' own
checksums (`checksum.combine_segments`). The rest the conversion drew from (records of tensors it cast, of views
that cover part of their storage, the pickle and the small records beside it) are read again and checksummed.
"""

from __future__ import annotations

import os
import zlib
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from typing import Any, NamedTuple

from .checksum import combine_segments
from .errors import FormatError
from .plain_pt import NotPlain, _Archive

READ_BYTES = 16 * 1024 * 1024  # a record read again in pieces of this size: bounded memory per thread


class Record(NamedTuple):
    """One record of the archive: its name, the crc32 its central directory lists, and where its bytes lie."""

    name: str
    crc: int
    data_at: int
    size: int


def archive_records(fd: int, known: Mapping[str, int] | None = None) -> list[Record] | None:
    """Every record of the ``torch.save`` archive open as ``fd``; ``known``: ``{record name: where its data
    starts}`` where the caller found it already (the rest cost a ``pread`` of their local header each). None
    where the archive is not laid out as ``torch.save`` lays it out (compressed records, another writer): its
    records are then not checked."""
    known = known or {}
    try:
        archive = _Archive(fd)
        return [Record(m.filename, m.CRC, known[m.filename] if m.filename in known else archive.data_at(m),
                       m.file_size) for m in archive.members]
    except (NotPlain, OSError):
        return None


@dataclass
class SourceCheck:
    """What the conversion checks of its source's records, and (once called) what it found.

    ``tiled``: a record and the ``(key, nbytes)`` of the written tensors that tile its bytes, in order (checked
    from their checksums); ``reread``: the records read again. Records saved without crc32s
    (``torch.serialization.set_crc32_options(False)`` writes zeros) are counted in ``unrecorded``."""

    src: str
    fd: int
    threads: int
    tiled: list[tuple[Record, list[tuple[str, int]]]] = field(default_factory=list)
    reread: list[Record] = field(default_factory=list)
    unrecorded: int = 0

    @property
    def records(self) -> int:
        """How many records are checked."""
        return len(self.tiled) + len(self.reread)

    @property
    def reread_bytes(self) -> int:
        return sum(r.size for r in self.reread)

    def __call__(self, checksums: Mapping[str, str]) -> None:
        """Raise `FormatError` naming every record whose bytes are not those its crc32 was taken of, given the
        written tensors' ``checksums`` (before the output is put in place)."""
        bad: list[tuple[Record, int, Sequence[str]]] = []
        for record, tiles in self.tiled:
            if len(tiles) == 1:  # a tensor that is its whole storage: its crc32 is the record's
                got = int(checksums[tiles[0][0]], 16)
            else:
                got = combine_segments((int(checksums[key], 16), nbytes) for key, nbytes in tiles)
            if got != record.crc:
                bad.append((record, got, [key for key, _ in tiles]))
        if self.reread:
            with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(self.reread)))) as pool:
                for record, got in zip(self.reread, pool.map(self._crc_of, self.reread)):
                    if got != record.crc:
                        bad.append((record, got, ()))
        if bad:
            raise FormatError(self.src, damaged_records(bad))

    def _crc_of(self, record: Record) -> int:
        crc, at, end = 0, record.data_at, record.data_at + record.size
        while at < end:
            data = os.pread(self.fd, min(READ_BYTES, end - at), at)
            if not data:
                break  # shorter than its record: the crc says so
            crc, at = zlib.crc32(data, crc), at + len(data)
        return crc


def damaged_records(bad: Sequence[tuple[Record, int, Sequence[str]]]) -> str:
    """The message for records whose bytes differ from what the archive's crc32s were taken of: every one."""
    shown = [f"'{record.name}' (recorded {record.crc:08x}, now {got:08x}"
             + (f"; tensors {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})" if keys else ")")
             for record, got, keys in bad[:10]]
    more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
    return (f"{len(bad)} record(s) of the archive differ from the crc32 torch.save recorded for them: "
            f"{'; '.join(shown)}{more}. The file changed after it was saved (a damaged copy or disk); torch.load does"
            " not check this and would load the changed values. Copy the checkpoint again from where it was saved;"
            " nothing was written")


def plan_source_check(src: str | os.PathLike[str], fd: int, records: Iterable[Record],
                      spans: Mapping[str, tuple[int, int, bool]], *, threads: int) -> SourceCheck:
    """The check of the records a conversion draws from. ``spans``: per converted tensor, ``(first byte in the
    file, bytes, written unchanged)``, where unchanged means its bytes, contiguous, are written as they are (no
    cast). A storage record is checked from its tensors' checksums where the unchanged ones tile it exactly,
    read again where the conversion drew on it otherwise, and left alone where it drew nothing from it
    (``select``); every other record (the pickle, the version) is read again."""
    check = SourceCheck(str(src), fd, threads)
    records = sorted(records, key=lambda r: r.data_at)
    starts = [r.data_at for r in records]
    at_start = {r.data_at: i for i, r in enumerate(records)}
    inside: dict[int, list[tuple[int, int, str, bool]]] = {}
    for key, (first, nbytes, unchanged) in spans.items():
        i = at_start.get(first)  # (most tensors start their record: no search; thousands of small ones add up)
        if i is None or first + nbytes > records[i].data_at + records[i].size:
            i = bisect_right(starts, first) - 1
            if i < 0 or first + nbytes > records[i].data_at + records[i].size:
                continue
        parts = inside.get(i)
        if parts is None:
            inside[i] = [(first, nbytes, key, unchanged)]
        else:
            parts.append((first, nbytes, key, unchanged))
    for i, record in enumerate(records):
        if not record.crc:
            check.unrecorded += 1
            continue
        parts = inside.get(i)
        if parts is None:
            if "/data/" not in record.name:
                check.reread.append(record)  # the pickle and the small records: the conversion read them all
            continue  # a storage the conversion drew nothing from (``select``)
        if len(parts) == 1:  # a tensor that is its whole storage: no sort
            first, nbytes, key, unchanged = parts[0]
            tiles = [(key, nbytes)] if unchanged and nbytes == record.size else None
        else:
            tiles = _tiles(record, parts)
        if tiles is None:
            check.reread.append(record)
        else:
            check.tiled.append((record, tiles))
    return check


def _tiles(record: Record, parts: list[tuple[int, int, str, bool]]) -> list[tuple[str, int]] | None:
    """The unchanged parts that tile ``record``'s bytes exactly, in order (a range written twice, as by tied
    tensors, taken once), or None."""
    if not all(unchanged for *_, unchanged in parts):
        return None
    at, tiles = record.data_at, []
    for first, nbytes, key, _ in sorted(parts, key=lambda p: (p[0], -p[1])):
        if first == at - nbytes and tiles and tiles[-1][1] == nbytes:
            continue  # the same range as the last (a tied tensor)
        if first != at:
            return None
        tiles.append((key, nbytes))
        at += nbytes
    return tiles if at == record.data_at + record.size else None


def spans_of(jobs: Iterable[Any], fd: int) -> dict[str, tuple[int, int, bool]]:
    """`plan_source_check`'s spans of the conversion's ``jobs`` (`write.TensorJob`) whose bytes lie in the file open
    as ``fd`` (a tensor held in pieces, or read from elsewhere, has none)."""
    out: dict[str, tuple[int, int, bool]] = {}
    for job in jobs:
        location = job.location
        if job.reader is not None or location is None or len(location) != 2 or location[0] != fd:
            continue
        source = job.source
        itemsize = source.dtype.itemsize
        nbytes = prod(source.shape) * itemsize
        out[job.key] = (location[1], nbytes, job.dtype == source.dtype and source.is_contiguous())
    return out


def describe(check: SourceCheck | None) -> str:
    """One line for the conversion's report."""
    if check is None:
        return "not checked (an archive not laid out as torch.save's)"
    if not check.records and check.unrecorded:
        return "none recorded (saved with torch.serialization.set_crc32_options(False))"
    reread = check.reread_bytes
    return f"{check.records} records" + (f" ({reread / 1e6:.1f} MB read again)" if reread >= 1e5 else "")
