"""What a zip-format ``torch.save`` file holds and where its storages' bytes lie, read without torch and without
running anything the pickle names.

Why: to start reading a source's bytes from disk while torch is still being imported (`fsdp_restore.prefetch`),
the CLI needs to know which bytes a conversion will read, before anything that could load them exists. Here the
pickle is run by Python's own C unpickler with every global replaced by an inert stand-in (`Call`) that only
records the arguments it was given; no global is ever imported, looked up or called, whatever the file names, so
this is safe on any file. The result is a sketch: the pickle's dicts, lists and tuples as they are, a `Call` where
it would have called a global (a tensor's rebuild, an ``OrderedDict``), a `StorageRef` where it names a storage
record. It is only used to choose what to read ahead; the conversion loads the file itself, with its own checks.

Limits, since the files are untrusted: only a stored (uncompressed) pickle record of at most `MAX_PICKLE_BYTES`
is read (no zip bomb); at most `MAX_GLOBALS` distinct global names; the pickle's extension codes (EXT opcodes,
which the C unpickler resolves through ``copyreg``'s process-wide registry and cache, around ``find_class``)
are refused unless that registry is empty, as it is unless a program registers codes. A pickle that crashes the
interpreter itself (a nesting deep enough to exhaust C's stack when hashed) crashes it here as it would in
torch's own loader.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header: 30 bytes, then the name and extra field
MAX_PICKLE_BYTES = 64 * 2**20  # a checkpoint's pickle is kilobytes to a few megabytes
MAX_GLOBALS = 10_000  # distinct global names: a checkpoint names a few dozen


class StorageRef(NamedTuple):
    """A storage record the pickle refers to (torch's persistent id: ``('storage', type, key, location, numel)``)."""

    key: str


class Call:
    """An inert stand-in for a call the pickle would make (``name(*args)``, then its state and items set)."""

    name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Call:
        self = super().__new__(cls)
        self.args, self.state, self.items = args + tuple(kwargs.values()), None, []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    def append(self, value: Any) -> None:
        self.items.append(value)

    def extend(self, values: Any) -> None:
        self.items.extend(values)


class _InertUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._stand_ins: dict[str, type[Call]] = {}

    def find_class(self, module: str, name: str) -> Any:
        """One stand-in class per global name (a class: NEWOBJ needs one), never the global itself."""
        key = f"{module}.{name}"
        cls = self._stand_ins.get(key)
        if cls is None:
            if len(self._stand_ins) >= MAX_GLOBALS:
                raise pickle.UnpicklingError(f"more than {MAX_GLOBALS} distinct globals: not a checkpoint's pickle")
            cls = self._stand_ins[key] = type("Call", (Call,), {"name": key})
        return cls

    def persistent_load(self, pid: Any) -> StorageRef:
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[2], str):
            return StorageRef(pid[2])
        raise pickle.UnpicklingError(f"unexpected persistent id (a {type(pid).__name__}): not torch's")


class Sketch(NamedTuple):
    """A file's pickle as a sketch (module doc) and its zip records (name -> ``ZipInfo``)."""

    path: Path
    root: Any
    records: dict[str, zipfile.ZipInfo]
    prefix: str  # the archive's top folder: records are ``prefix/data.pkl``, ``prefix/data/KEY``


def sketch(path: str | os.PathLike[str]) -> Sketch:
    """The sketch of a zip-format ``torch.save`` file; `ValueError`, `zipfile.BadZipFile`, `pickle.UnpicklingError`
    or `OSError` where it is not one."""
    path = Path(path)
    if copyreg._inverted_registry:  # type: ignore[attr-defined]  # EXT codes would bypass find_class (module doc)
        raise ValueError("pickle extension codes are registered in this process (copyreg.add_extension)")
    with open(path, "rb") as f:
        if hasattr(os, "posix_fadvise"):  # no readahead past the directory and the pickle: into the tensors' bytes
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        with zipfile.ZipFile(f) as z:
            records = {info.filename: info for info in z.infolist()}
            pickles = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise ValueError(f"{path}: not a torch.save archive (no single */data.pkl record)")
            info = records[pickles[0]]
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > MAX_PICKLE_BYTES:
                raise ValueError(f"{path}: its pickle record is compressed or over {MAX_PICKLE_BYTES} bytes")
            data = z.read(info)
    root = _InertUnpickler(data).load()
    return Sketch(path, root, records, pickles[0].rsplit("/", 1)[0])


def storage_refs(node: Any) -> Iterator[StorageRef]:
    """Every storage ``node`` refers to, through containers and calls, each once, in the pickle's order."""
    seen_nodes: set[int] = set()
    seen_keys: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, StorageRef):
            if item.key not in seen_keys:
                seen_keys.add(item.key)
                yield item
            continue
        if id(item) in seen_nodes:  # a pickle can hold cycles (memo references)
            continue
        seen_nodes.add(id(item))
        if isinstance(item, dict):
            children: list[Any] = [v for kv in item.items() for v in kv]
        elif isinstance(item, (list, tuple)):
            children = list(item)
        elif isinstance(item, Call):
            children = [*item.args, item.state, *item.items]
        else:
            continue
        stack.extend(reversed(children))


def storage_range(s: Sketch, ref: StorageRef) -> tuple[int, int]:
    """``(offset, nbytes)`` of a stored storage record's bytes in the file (its local header read for the offset);
    `ValueError` where there is no such record or it is compressed."""
    info = s.records.get(f"{s.prefix}/data/{ref.key}")
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{s.path}: no stored record for storage {ref.key}")
    with open(s.path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise ValueError(f"{s.path}: bad local header for storage {ref.key}")
    fields = _LOCAL_HEADER.unpack(head)
    return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10], info.file_size
