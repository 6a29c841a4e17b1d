"""Where a converted checkpoint came from: the identity of its source file, recorded at conversion
(metadata ``fsdp_restore.source``) and checked when ``x.pt`` is opened through its ``x.safetensors``
sibling, so that a sibling converted from an older ``x.pt`` is never used silently.

The identity is the file's size, its modification time (ns) and a fingerprint: the crc32 of its zip
directory (every member's name, crc32 and size: a few KB read, yet any change of content changes it),
or for a legacy non-zip file the crc32 of its first and last MB. Size and time decide quickly; the
fingerprint settles a copy that changed the time but not the bytes.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import FormatError

_EDGE = 1024 * 1024


def fingerprint(path: str | os.PathLike[str]) -> str:
    """8 hex digits: crc32 of the zip directory (names, crc32s, sizes), or of the first and last MB."""
    path = Path(path)
    try:
        infos = None
        if zipfile.is_zipfile(path):  # which raises, rather than saying no, on some damaged end records
            with zipfile.ZipFile(path) as z:
                infos = z.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise FormatError(path, f"zip archive is truncated or corrupt ({e}); re-copy the file") from None
    if infos is not None:
        return members_fingerprint(infos)
    size = path.stat().st_size
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(_EDGE))
        f.seek(max(0, size - _EDGE))
        crc = zlib.crc32(f.read(_EDGE), crc)
    return f"{crc:08x}"


def members_fingerprint(infos: Iterable[Any]) -> str:
    """`fingerprint` of a zip archive from its members (as ``zipfile.ZipFile.infolist()`` gives them, or anything
    with their ``filename``, ``CRC`` and ``file_size``)."""
    crc = 0
    for info in infos:
        crc = zlib.crc32(f"{info.filename}:{info.CRC:08x}:{info.file_size}\n".encode(), crc)
    return f"{crc:08x}"


def source_identity(path: str | os.PathLike[str], *, members: Iterable[Any] | None = None,
                    stat: os.stat_result | None = None, select: str | None = None) -> dict[str, Any]:
    """What the conversion records about its source (``members``: its zip members, when the caller has read them
    already, for the fingerprint; ``stat``: the ``fstat`` of the descriptor it reads, where it has one;
    ``select``: the subtree converted, when not the whole)."""
    st = stat if stat is not None else os.stat(path)
    digest = members_fingerprint(members) if members is not None else fingerprint(path)
    identity = {"name": Path(path).name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "fingerprint": digest}
    if select:
        identity["select"] = select
    return identity


def mismatch(recorded: dict[str, Any] | None, source: str | os.PathLike[str], converted: str | os.PathLike[str], *,
             cast: Mapping[str, str] | None = None, skipped: Sequence[str] = ()) -> str | None:
    """Why ``converted`` (whose recorded source identity is ``recorded``, whose tensors cast on conversion
    are ``cast``: ``{key: original dtype}``, and whose structure has None for the values at ``skipped``:
    `flatten.skipped_values`) is not a conversion of all of ``source`` as it is now, or None when it
    is. Without a record (written by another tool, by `save`, or by an older version) nothing says it holds
    ``source``'s values, so it is not taken for them, whatever its age; a conversion of one subtree
    (``--select``), with casts (``--dtype``) or without the values it could not store (``on_unsupported=skip``)
    holds other values than ``source``, so it is not taken either."""
    st = os.stat(source)
    if not recorded:
        return (f"{Path(converted).name} records no source: written by another tool or by save(), it may hold other"
                f" values than {Path(source).name}")
    if recorded.get("select"):
        return (f"{Path(converted).name} holds only '{recorded['select']}' of {Path(source).name} (converted with"
                f" --select {recorded['select']})")
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        return (f"{Path(converted).name} holds None for {len(skipped)} value(s) of {Path(source).name} it could not"
                f" store ({shown}; converted with on_unsupported=skip)")
    if cast:
        key, dtype = next(iter(cast.items()))
        return (f"{Path(converted).name} holds {Path(source).name}'s values cast to other dtypes (converted with"
                f" --dtype: '{key}' was {dtype}, {len(cast)} tensor(s) in all)")
    other_name = recorded.get("name") not in (None, Path(source).name)  # renamed with it, or another file's
    if recorded.get("size") != st.st_size:
        if other_name:
            return (f"{Path(converted).name} was converted from another file, {recorded.get('name')} of"
                    f" {recorded.get('size')} bytes; {Path(source).name} has {st.st_size}")
        return f"{Path(source).name} is {st.st_size} bytes now, {recorded.get('size')} when converted"
    if recorded.get("mtime_ns") == st.st_mtime_ns:
        return None
    if recorded.get("fingerprint") != fingerprint(source):
        if other_name:
            return (f"{Path(converted).name} was converted from another file, {recorded.get('name')}, of the same"
                    f" size as {Path(source).name} but other content")
        return f"{Path(source).name} changed since it was converted (same size, other content)"
    return None
