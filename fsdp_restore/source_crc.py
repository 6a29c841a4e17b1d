"""The crc32s ``torch.save`` recorded in its zip archive, checked against what a conversion read.

``torch.save`` writes a crc32 of every record of its archive (the pickle, each storage's bytes), and
``torch.load`` does not check them: a bit flipped on a disk or in a copy since the save loads as a changed
value, and a conversion would then stamp its own checksums on the damaged bytes, blessing them for good.

So the conversion checks the source's records. The small ones (the pickle, the version, the byte order) first,
before the pickle is read: damage there is named as damage, not as whatever the damaged pickle then looks like
(a bad opcode, a class to allow). The storages before the output is put in place: a storage whose bytes the
output holds unchanged, tiled exactly by the tensors written from it (the usual case: a tensor is its whole
storage; tied tensors share one), has a crc32 that follows from the tensors' own checksums
(`checksum.combine_segments`), at no cost. The rest cost a pass of crc32 over their bytes, made only with
``verify_checksums``: a cast tensor's from the bytes its cast read (`write._record_source`), the others a
converted tensor draws on (views of part of a storage, strided tensors) read again.
"""

from __future__ import annotations

import os
import stat
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from typing import Any

from .checksum import combine_segments, crc32
from .errors import FormatError
from .plain_pt import NotPlain, ZipMember, _Archive

READ_BYTES = 16 * 1024 * 1024  # a record read again in pieces of this size: bounded memory per thread
# the crc32s of the source bytes a conversion's reads and casts recorded, per tensor: {key: {first byte: (crc32,
# length)}} (`write._FileWriter.source_segments`)
Segments = Mapping[str, Mapping[int, tuple[int, int]]]


@dataclass(frozen=True)
class SourceCrcs:
    """What a conversion checked of its source's recorded crc32s (`ConvertReport.source_crcs`)."""

    checked: int  # records whose bytes matched their crc32
    records: int  # records in the archive
    reread_bytes: int = 0  # bytes read a second time to check them (the rest followed from the written tensors)
    unrecorded: int = 0  # records saved without a crc32 (``torch.serialization.set_crc32_options(False)``)
    skipped: int = 0  # records of tensors cast or partly viewed, left unchecked without ``verify_checksums``
    note: str = ""  # why nothing was checked, where nothing was
    skipped_what: str = "of tensors cast or partly viewed"  # what the skipped records are, as the report says it


class DamagedRecords(FormatError):
    """Records of a ``torch.save`` archive whose bytes differ from the crc32s it recorded for them."""


def describe(crcs: SourceCrcs | None) -> str:
    """A few words for the conversion's report table (what was checked), `describe_rest` for what was not."""
    if crcs is None:
        return "not checked"
    if crcs.note or (not crcs.checked and crcs.unrecorded):
        return "none"
    return f"{crcs.checked} of {crcs.records} records"


def describe_rest(crcs: SourceCrcs | None) -> str | None:
    """The line under the report's table that says what was not checked, and why; None where all was."""
    if crcs is None:
        return None
    if crcs.note:
        return f"source crc32s: none checked ({crcs.note})"
    if not crcs.checked and crcs.unrecorded:
        return "source crc32s: none recorded (saved with torch.serialization.set_crc32_options(False))"
    reread = f"; {crcs.reread_bytes / 1e6:.1f} MB read again to check them" if crcs.reread_bytes >= 1e5 else ""
    if crcs.skipped:
        return (f"source crc32s: {crcs.skipped} record(s) {crcs.skipped_what} not checked (a pass over their"
                f" bytes): --verify-checksums checks them{reread}")
    if crcs.checked + crcs.unrecorded < crcs.records:
        return f"source crc32s: the records not converted were not checked{reread}"
    return f"source crc32s: {reread[2:]}" if reread else None


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
        try:
            at = archive.data_at(member)
        except NotPlain:  # its local header is not torch.save's: the readers say what is wrong (not checked here)
            continue
        got = _crc_of(archive.fd, at, member.file_size)
        if got != member.CRC:
            bad.append((member, got, ()))
        checked += 1
    if bad:
        raise DamagedRecords(src, damaged_records(bad))
    return checked


# a part of a record: (its first byte in the file, bytes, key, how its crc32 is known): WRITTEN, the written tensor's
# checksum (its bytes unchanged); CAST, the crc32 of the source bytes its cast read (`write._record_source`)
WRITTEN, CAST = "written", "cast"


@dataclass
class SourceCheck:
    """The check of the storages a conversion draws from (`plan_source_check`), called by the writer with the
    crc32s of the source bytes its casts read (``sources``): with ``checksums`` None before it raises another error
    (a cast's: what damage would also make it say), with every written tensor's checksum before the output is put
    in place. A record whose parts' crc32s are not all known is read again."""

    src: str
    fd: int
    threads: int
    records: int  # in the archive
    small_checked: int  # `check_small_records`'
    unrecorded: int
    # (record, where its data starts, its parts in order: (key, bytes, how its crc32 is known))
    tiled: list[tuple[ZipMember, int, list[tuple[str, int, str]]]] = field(default_factory=list)
    reread: list[tuple[ZipMember, int]] = field(default_factory=list)  # (record, where its data starts)
    skipped: int = 0  # records that would cost a pass over their bytes, without verify_checksums
    # by record name, once checked: None where it matched, else (record, crc32 found, its tensors)
    _done: dict[str, tuple[ZipMember, int, Sequence[str]] | None] = field(default_factory=dict)

    def summary(self) -> SourceCrcs:
        return SourceCrcs(checked=self.small_checked + len(self._done), records=self.records,
                          reread_bytes=sum(m.file_size for m, _ in self.reread), unrecorded=self.unrecorded,
                          skipped=self.skipped)

    def __call__(self, checksums: Mapping[str, str] | None, sources: Segments) -> None:
        """Raise `FormatError` naming every storage whose bytes are not those its crc32 was taken of."""
        done = self._done
        for member, at, tiles in self.tiled:
            if member.filename in done:
                continue
            cast = {key: whole_crc(sources.get(key), nbytes) for key, nbytes, how in tiles if how == CAST}
            if None in cast.values():
                self.reread.append((member, at))  # a cast that read its bytes otherwise (torch's, in pieces)
                continue
            if checksums is None and any(how == WRITTEN for _, _, how in tiles):
                continue  # (known once the output's are)
            crcs = [(cast[key] if how == CAST else int(checksums[key], 16), nbytes)  # type: ignore[index]
                    for key, nbytes, how in tiles]
            got = crcs[0][0] if len(crcs) == 1 else combine_segments(crcs)
            done[member.filename] = (member, got, [key for key, _, _ in tiles]) if got != member.CRC else None
        rereads = [r for r in self.reread if r[0].filename not in done]
        if rereads:
            with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(rereads)))) as pool:
                crcs = pool.map(lambda r: _crc_of(self.fd, r[1], r[0].file_size), rereads)
                for (member, _), got in zip(rereads, crcs):
                    done[member.filename] = (member, got, ()) if got != member.CRC else None
        bad = [found for found in done.values() if found is not None]
        if bad:
            raise DamagedRecords(self.src, damaged_records(bad))


def whole_crc(segments: Mapping[int, tuple[int, int]] | None, nbytes: int) -> int | None:
    """The crc32 of a source's first ``nbytes`` bytes from its recorded ``segments`` (``{first byte: (crc32,
    length)}``), where they cover them exactly once in order; else None (a gap, or a piece cut inside another)."""
    if not segments:
        return None
    at, ordered = 0, []
    for first in sorted(segments):
        crc, length = segments[first]
        if first != at:
            return None
        ordered.append((crc, length))
        at += length
    if at != nbytes:
        return None
    return ordered[0][0] if len(ordered) == 1 else combine_segments(ordered)


def _crc_of(fd: int, at: int, size: int) -> int:
    crc, end = 0, at + size
    while at < end:
        data = os.pread(fd, min(READ_BYTES, end - at), at)
        if not data:
            break  # shorter than its record: the crc says so
        crc, at = crc32(data, crc), at + len(data)
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


def plan_source_check(src: str | os.PathLike[str], archive: Archive, jobs: Iterable[Any],
                      storage_at: Mapping[str, int], *, threads: int, small_checked: int,
                      every_storage: bool = False, full: bool = False) -> SourceCheck:
    """The check of the storage records the conversion's ``jobs`` (`write.TensorJob`) draw from, given where each
    one's storage record starts (``storage_at``; a key absent: not a storage's, such as a numpy array's). A record
    is checked from crc32s the conversion takes anyway where its tensors (contiguous, one run in this file) tile it
    exactly: the written tensor's checksum where it is written unchanged, else the crc32 of the source bytes its
    cast read; otherwise it is read again. A record no converted tensor draws from (``select``) is left alone,
    unless ``every_storage`` (where the tensors' storages could not be placed: all are read). Only with ``full``
    (``verify_checksums``) are the records that cost a pass over their bytes checked (casts, records read again);
    without it they are counted in ``skipped``. One pass, in plain tuples: a checkpoint of tens of thousands of small
    tensors pays it per tensor."""
    storages = sorted((m for m in archive.members if "/data/" in m.filename), key=lambda m: m.header_offset)
    # (an empty record's crc32 is 0, as an unrecorded one's: nothing to check, and not counted)
    check = SourceCheck(str(src), archive.fd, threads, records=sum(1 for m in archive.members if m.file_size),
                        small_checked=small_checked,
                        unrecorded=sum(1 for m in archive.members if not m.CRC and m.file_size))
    headers = [m.header_offset for m in storages]
    last = len(headers) - 1
    fd = archive.fd
    parts: dict[int, list[tuple[int, int, str, str | None]]] = {}
    data_at: dict[int, int] = {}
    unplaced = every_storage
    for job in jobs:
        key = job.key
        at = storage_at.get(key)
        if at is None:
            continue
        i = bisect_right(headers, at) - 1
        if i < 0 or (i < last and at >= headers[i + 1]):
            unplaced = True  # (not a storage of this archive as far as can be told: check them all)
            continue
        location, source = job.location, job.source
        how = None  # (read again)
        if (type(location) is tuple and len(location) == 2 and location[0] == fd and job.reader is None
                and source.is_contiguous()):
            how = WRITTEN if job.dtype == source.dtype else CAST
        part = (location[1] if how else -1, prod(source.shape) * source.dtype.itemsize, key, how)
        data_at[i] = at
        if i in parts:
            parts[i].append(part)
        else:
            parts[i] = [part]
    for i, member in enumerate(storages):
        if not member.CRC or not member.file_size or (i not in parts and not unplaced):
            continue
        at = data_at.get(i)
        tiles = None
        if at is not None:
            here = parts[i]
            if len(here) == 1:  # a tensor that is its whole storage (inline: tens of thousands of them)
                first, nbytes, key, how = here[0]
                if how and first == at and nbytes == member.file_size:
                    tiles = [(key, nbytes, how)]
            else:
                tiles = _tiles(at, member.file_size, here)
        if not full and (tiles is None or any(how == CAST for _, _, how in tiles)):
            check.skipped += 1  # (a pass over its bytes: verify_checksums=True)
        elif tiles is not None:
            check.tiled.append((member, at, tiles))  # type: ignore[arg-type]
        elif at is not None:
            check.reread.append((member, at))
        else:  # (its start from its local header: one not torch.save's was not read either, so not checked)
            try:
                check.reread.append((member, archive.data_at(member)))
            except NotPlain:
                check.skipped += 1
    return check


def _tiles(data_at: int, size: int, parts: list[tuple[int, int, str, str | None]]
           ) -> list[tuple[str, int, str]] | None:
    """The parts whose crc32 will be known that tile ``size`` bytes from ``data_at`` exactly, in order (a range two
    tensors share, as tied ones do, taken once), or None."""
    if not all(how for *_, how in parts):
        return None
    at, tiles = data_at, []
    for first, nbytes, key, how in sorted(parts, key=lambda p: (p[0], -p[1])):
        if first == at - nbytes and tiles and tiles[-1][1] == nbytes:
            continue  # the same range as the last (a tied tensor)
        if first != at:
            return None
        tiles.append((key, nbytes, how))
        at += nbytes
    return tiles if at == data_at + size else None  # type: ignore[return-value]


@dataclass(frozen=True)
class ArchiveFile:
    """One ``torch.save`` file of a checkpoint directory (a ZeRO checkpoint's) that a conversion reads in runs, with
    its archive and how many of its small records `check_small_records` checked."""

    path: str
    archive: Archive
    small_checked: int


@dataclass
class RunsCheck:
    """The check of the storages of a directory's files that a conversion reads in runs of bytes (`plan_runs_check`):
    a ZeRO checkpoint's weights and moments are parts of its files' flat partitions, each tensor runs of several
    files. Each record read from is checked from the crc32s of its parts as the conversion read them
    (`write._read_location`, with ``record_sources``), in order, with the bytes no tensor reads (a partition's
    padding; a record read otherwise, such as a 0-dim step's) read again. Called as `SourceCheck` is."""

    label: str
    threads: int
    records: int
    small_checked: int
    unrecorded: int
    # (file, record, where its data starts) of each record a converted tensor reads from
    used: list[tuple[ArchiveFile, ZipMember, int]] = field(default_factory=list)
    # per key: (first byte of the tensor, file descriptor, offset, bytes) of each of its runs, in order
    runs: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    # (file, record, key) of each record that one tensor written unchanged is exactly: checked from its checksum
    written: list[tuple[ArchiveFile, ZipMember, str]] = field(default_factory=list)
    skipped: int = 0
    reread_bytes: int = 0
    _done: dict[tuple[int, str], tuple[ZipMember, int, Sequence[str]] | None] = field(default_factory=dict)

    def summary(self) -> SourceCrcs:
        return SourceCrcs(checked=self.small_checked + len(self._done), records=self.records,
                          reread_bytes=self.reread_bytes, unrecorded=self.unrecorded, skipped=self.skipped,
                          skipped_what="of partitions read in runs")

    def __call__(self, checksums: Mapping[str, str] | None, sources: Segments) -> None:
        """Raise `FormatError` naming every record read from whose bytes are not those its crc32 was taken of."""
        for f, member, key in self.written if checksums is not None else ():
            got = int(checksums[key], 16)
            self._done[(f.archive.fd, member.filename)] = (None if got == member.CRC else
                                                           (_in_file(f.path, member), got, (key,)))
        read: dict[int, list[tuple[int, int, int]]] = {}  # per file: (offset, bytes, crc32) of each part read
        for key, runs in self.runs.items():
            starts = [run[0] for run in runs]
            for first, (crc, nbytes) in (sources.get(key) or {}).items():
                i = bisect_right(starts, first) - 1
                start, fd, offset, length = runs[i]
                if first + nbytes <= start + length:  # (a part is one run's: `_read_location` records them so)
                    read.setdefault(fd, []).append((offset + first - start, nbytes, crc))
        for fd, parts in read.items():  # (the same bytes read twice, for two tensors of one run, taken once)
            read[fd] = sorted(set(parts))
        todo = [(f, m, at) for f, m, at in self.used if (f.archive.fd, m.filename) not in self._done]
        if not todo:
            return self._raise_damaged()
        with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(todo)))) as pool:
            for (f, member, _), (got, reread) in zip(todo, pool.map(
                    lambda u: self._crc_of_record(u[0].archive.fd, u[2], u[1].file_size,
                                                  read.get(u[0].archive.fd, [])), todo)):
                self.reread_bytes += reread
                self._done[(f.archive.fd, member.filename)] = (None if got == member.CRC else
                                                               (_in_file(f.path, member), got, ()))
        self._raise_damaged()

    def _raise_damaged(self) -> None:
        bad = [found for found in self._done.values() if found is not None]
        if bad:
            raise DamagedRecords(self.label, damaged_records(bad))

    @staticmethod
    def _crc_of_record(fd: int, at: int, size: int, parts: list[tuple[int, int, int]]) -> tuple[int, int]:
        """The crc32 of the record of ``size`` bytes at ``at``, from the ``parts`` read of it (sorted) and the bytes
        between them read again; returns it and how many bytes were read again. A part that overlaps another
        (exact repeats taken once already) or runs past the record's end: the whole record read again."""
        lo = bisect_right(parts, (at, -1, -1))
        pos, segments, reread, end = at, [], 0, at + size
        for offset, nbytes, crc in parts[lo:]:
            if offset >= end:
                break
            if offset < pos or offset + nbytes > end:
                return _crc_of(fd, at, size), size
            if offset > pos:
                segments.append((_crc_of(fd, pos, offset - pos), offset - pos))
                reread += offset - pos
            segments.append((crc, nbytes))
            pos = offset + nbytes
        if pos < end:
            segments.append((_crc_of(fd, pos, end - pos), end - pos))
            reread += end - pos
        return (segments[0][0] if len(segments) == 1 else combine_segments(segments)), reread


def plan_runs_check(label: str, files: Sequence[ArchiveFile], jobs: Iterable[Any], *, threads: int,
                    full: bool = False) -> RunsCheck:
    """The check of the storage records of ``files`` the conversion's ``jobs`` read from (their ``location``: one
    run, ``(fd, offset)``, or runs of several files, ``[(fd, offset, bytes), ...]``; jobs of other files are left
    alone). Only with ``full`` (``verify_checksums``: a pass of crc32 over the bytes read, and the padding read
    again); without it the records are counted in ``skipped``."""
    check = RunsCheck(label, threads, records=sum(1 for f in files for m in f.archive.members if m.file_size),
                      small_checked=sum(f.small_checked for f in files),
                      unrecorded=sum(1 for f in files for m in f.archive.members if not m.CRC and m.file_size))
    by_fd = {f.archive.fd: f for f in files}
    starts: dict[int, tuple[list[int], list[ZipMember]]] = {}  # per file: its storages by where their data starts
    for f in files:
        storages = [m for m in f.archive.members if _is_storage(m) and m.file_size]
        at = [f.archive.data_at(m) for m in storages]
        order = sorted(range(len(storages)), key=at.__getitem__)
        starts[f.archive.fd] = ([at[i] for i in order], [storages[i] for i in order])
    used: dict[tuple[int, str], tuple[ArchiveFile, ZipMember, int]] = {}

    def touch(fd: int, offset: int) -> tuple[ZipMember, int] | None:
        """The record (and where its data starts) of file ``fd`` whose data holds byte ``offset``, noted as used."""
        if fd not in starts:
            return None
        data_at, members = starts[fd]
        i = bisect_right(data_at, offset) - 1
        if i < 0 or offset >= data_at[i] + members[i].file_size:
            return None
        used.setdefault((fd, members[i].filename), (by_fd[fd], members[i], data_at[i]))
        return members[i], data_at[i]

    whole: dict[tuple[int, str], str] = {}  # records a tensor written unchanged is exactly: key of that tensor
    for job in jobs:
        location = job.location
        if type(location) is tuple:
            found = touch(location[0], location[1])
            if (found is not None and found[1] == location[1] and job.dtype == job.source.dtype and job.reader is None
                    and job.nbytes == found[0].file_size):
                whole.setdefault((location[0], found[0].filename), job.key)
        elif type(location) is list:
            runs, first = [], 0
            for fd, offset, nbytes in location:
                touch(fd, offset)
                if nbytes > 1:
                    touch(fd, offset + nbytes - 1)  # (a run that crossed into the next record: both are read)
                runs.append((first, fd, offset, nbytes))
                first += nbytes
            if any(fd in starts for _, fd, _, _ in runs):
                check.runs[job.key] = runs
    checked = [u for u in used.values() if u[1].CRC]
    # a record written unchanged as one tensor: its crc32 is that tensor's checksum, at no cost (as for a .pt)
    check.written = [(f, m, whole[(f.archive.fd, m.filename)]) for f, m, _ in checked
                     if (f.archive.fd, m.filename) in whole]
    rest = [u for u in checked if (u[0].archive.fd, u[1].filename) not in whole]
    if full:
        check.used = rest
    else:
        check.skipped = len(rest)
    return check


def _in_file(path: str | os.PathLike[str], member: ZipMember) -> ZipMember:
    """``member`` named with its file, for an error about the records of several files: ``file.pt:archive/data/3``."""
    return member._replace(filename=f"{os.path.basename(path)}:{member.filename}")


def check_files(label: str, paths: Sequence[str | os.PathLike[str]], *, threads: int, full: bool) -> SourceCrcs:
    """The records of a directory's ``torch.save`` files read through torch (a ZeRO checkpoint converted through
    torch's unpickler): every file's pickle and small records, and with ``full`` (``verify_checksums``) every storage
    record read again whole (a pass over the checkpoint: where the bytes were read is torch's business);
    `DamagedRecords` naming each damaged one."""
    checked = records = unrecorded = skipped = reread = 0
    bad: list[tuple[ZipMember, int, Sequence[str]]] = []
    notes = []
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in a file's place opens at once (torch's path says it)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            os.set_blocking(fd, True)
            archive = Archive.open(fd)
            if archive is None:
                notes.append(os.path.basename(path))
                continue
            members = [m for m in archive.members if m.file_size]
            records += len(members)
            unrecorded += sum(1 for m in members if not m.CRC)
            checked += check_small_records(path, archive)
            storages = [m for m in members if _is_storage(m) and m.CRC]
            if not full:
                skipped += len(storages)
                continue
            starts = [archive.data_at(m) for m in storages]
            with ThreadPoolExecutor(max_workers=max(1, min(threads, len(storages) or 1))) as pool:
                for member, got in zip(storages, pool.map(lambda a: _crc_of(fd, a[0], a[1].file_size),
                                                          zip(starts, storages))):
                    checked += 1
                    reread += member.file_size
                    if got != member.CRC:
                        bad.append((_in_file(path, member), got, ()))
        finally:
            os.close(fd)
    if bad:
        raise DamagedRecords(label, damaged_records(bad))
    return SourceCrcs(checked=checked, records=records, reread_bytes=reread, unrecorded=unrecorded, skipped=skipped,
                      skipped_what="of the rank files (read through torch)",
                      note=f"not laid out as torch.save lays it out: {', '.join(notes)}" if notes and not checked
                      else "")
