"""Load a zip-format ``torch.save`` file whose records are stored uncompressed, returning what
``torch.load(path, mmap=True, weights_only=True, map_location="cpu")`` returns, without its cost per tensor.

Why: torch.load finds each storage with a lookup of its own (a read of the record's local zip header through its
C++ stream, and Python around it: fake-mode checks, the location restore), a cost per tensor that dominates a
checkpoint of many small tensors (BENCHMARKS.md, "Convert at the disk's speed"). Here the archive is opened once
with torch's own reader (so the record names, the format-version check and the pickle's bytes are torch's), the
data offset of each storage record is taken from its local header as the pickle asks for it, and every storage
is a slice of one mapping of the whole file, as with torch.load(mmap=True).

Safety stays torch's: the pickle is run by torch's restricted unpickler
(``torch._weights_only_unpickler.Unpickler``) with the caller's allowlist added as torch's ``safe_globals``; only
its ``persistent_load`` is ours, and it only builds storages. That unpickler never imports anything: a global is
looked up in torch's table of allowed objects or refused (``pickle.UnpicklingError``), so no global outside
torch's defaults and the allowlist is ever imported or called.

Whatever this module does not reproduce exactly raises `NotHandled`, and the caller loads the file with
torch.load instead: big-endian data or a load byte order set by the user, compressed or encrypted records,
TorchScript archives, pickle protocols other than 2 and 3, fake tensor mode or ``skip_data``, a torch without
the private pieces used here. All of it is found before the pickle runs, but for a compressed storage record,
found when the pickle asks for it (the unpickler has then called allowed globals only; its result is dropped).
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch._weights_only_unpickler import Unpickler as _TorchUnpickler

from .errors import FormatError
from .plain_pt import builds_storages_from_records, default_byte_order_little

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header: 30 bytes, then name and extra field
_LOCAL_SIGNATURE = b"PK\x03\x04"
_STORED = 0  # zip method: no compression
_ENCRYPTED = 0x1  # general purpose flag bit 0
_PICKLE = "data.pkl"


class NotHandled(Exception):
    """This file is not one this module loads exactly as torch.load would; load it with torch.load."""


def load(path: str | os.PathLike[str], safe_globals: Sequence[Any]) -> Any:
    """The object ``torch.load(path, mmap=True, weights_only=True, map_location="cpu")`` returns inside
    ``torch.serialization.safe_globals(safe_globals)`` (this runs the pickle in that context): the same tensors
    (dtype, shape, stride, storage offset), storages shared as torch shares them, each a slice of one mapping.

    Raises `NotHandled` for a file torch.load should read instead; `FormatError` naming the file for an archive
    whose records contradict themselves or the pickle; and what torch's weights-only unpickler raises while it
    runs the pickle (``pickle.UnpicklingError`` for a refused global or opcode).
    """
    path = Path(path)
    reader_type = getattr(torch._C, "PyTorchFileReader", None)
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if reader_type is None or tls is None or not all(
            hasattr(reader_type, call) for call in ("get_record_header_offset", "get_record_size")):
        raise NotHandled("this torch lacks the zip reader calls this loader uses")
    if not builds_storages_from_records():
        raise NotHandled("big-endian host, skip_data or fake tensor mode: torch.load builds those storages")
    try:
        reader = reader_type(os.fspath(path))  # torch's own checks: a torch archive, a format version it reads
    except Exception as e:
        raise NotHandled(f"torch's zip reader refuses it ({e})") from None
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        names = set(reader.get_all_records())
        if "constants.pkl" in names or _PICKLE not in names:
            raise NotHandled("a TorchScript archive, or no data.pkl")
        records = _Records(path, reader, fd, names, size)
        for name in names:  # the few records that are not storages: NotHandled if any is compressed
            if not name.startswith("data/"):
                records.find(name)
        _check_byte_order(reader, names)
        data = reader.get_record(_PICKLE)
        if len(data) < 2 or data[0] != 0x80 or data[1] not in (2, 3):  # PROTO 2 or 3: what torch's unpickler reads
            raise NotHandled("pickle protocol other than 2 or 3")
        # torch.load(mmap=True) maps the whole file once, privately unless the user chose MAP_SHARED
        shared = torch.serialization.get_default_mmap_options() == getattr(mmap, "MAP_SHARED", None)
        whole = torch.UntypedStorage.from_file(os.fspath(path), shared, size)
        unpickler = _Unpickler(data, _storage_builder(path, whole, records))
        tls.map_location = "cpu"  # as torch.load sets it: read by torch's rebuild functions (numpy-backed tensors)
        try:
            with torch.serialization.safe_globals(list(safe_globals)):
                result = unpickler.load()
        except BaseException:
            torch._utils._sparse_tensors_to_validate.clear()  # a failed load's are not validated by the next load
            raise
        finally:
            tls.map_location = None
    finally:
        os.close(fd)
        del reader
    torch._utils._validate_loaded_sparse_tensors()  # as torch.load does after unpickling
    return result


def bytes_as_loaded(path: str | os.PathLike[str]) -> bool:
    """Whether the storage records of the zip-format ``torch.save`` file ``path`` hold their tensors' bytes as
    torch.load puts them in memory: little-endian records on a little-endian host, as the file says or as the
    load's byte order assumes. Where not (a file saved on a big-endian host), torch.load byte-swaps each storage
    in its own copy, so the file's bytes at a mapped tensor's offset are not the tensor's; False too for what
    torch's zip reader does not open."""
    if sys.byteorder != "little":
        return False
    try:
        reader = torch._C.PyTorchFileReader(os.fspath(path))
        _check_byte_order(reader, {"byteorder"} if reader.has_record("byteorder") else set())
    except Exception:  # noqa: BLE001 - NotHandled, or not an archive torch reads: never take its bytes as they lie
        return False
    return True


def _check_byte_order(reader: Any, names: Collection[str]) -> None:
    """Little-endian data only, as the file says or, without a ``byteorder`` record, as torch.load assumes by
    default; anything else (byteswapped storages) is torch.load's."""
    if "byteorder" in names:
        if reader.get_record("byteorder") != b"little":
            raise NotHandled("the byteorder record is not 'little'")
        return
    if not default_byte_order_little():
        raise NotHandled("a load endianness other than little is set")



class _LocalHeader(NamedTuple):
    """What a record's local zip header says: its flags and method, its name, and where its data starts."""

    flags: int
    method: int
    name: str
    data_at: int


class _Records:
    """Where each record's data lies in the file: the header offset and size of the record from the central
    directory (torch's reader), then the record's local header, read here when the record is first asked for (its
    name and extra field, whose length holds torch's alignment padding, are not the central directory's).

    Read as the pickle asks for them, the local headers of a file still being read from disk (the CLI has asked
    the kernel to read it while torch was imported) are waited for while the unpickler runs, not before it."""

    def __init__(self, path: Path, reader: Any, fd: int, names: set[str], size: int) -> None:
        self.path, self.reader, self.fd, self.names, self.size = path, reader, fd, names, size
        self.prefix = ""  # the archive's folder, which prefixes every record's name in the zip: from data.pkl's
        local_name = self._local(_PICKLE).name
        if not local_name.endswith("/" + _PICKLE):
            raise FormatError(path, f"zip record '{_PICKLE}': its local header names '{local_name}'; corrupt?")
        self.prefix = local_name[:-len(_PICKLE)]

    def find(self, name: str) -> tuple[int, int]:
        """``(offset of the record's data in the file, its size)``; `NotHandled` if the record is compressed or
        encrypted, `FormatError` if the archive does not hold it or contradicts itself about it."""
        if name not in self.names:
            raise FormatError(self.path, f"the pickle refers to storage record '{name}', which the archive does"
                              " not hold")
        nbytes = self.reader.get_record_size(name)
        local = self._local(name)
        if local.method != _STORED or local.flags & _ENCRYPTED:
            raise NotHandled(f"record '{name}' is compressed or encrypted")
        if local.name != self.prefix + name:
            raise FormatError(self.path, f"zip record '{name}': its local header names '{local.name}'; corrupt?")
        if local.data_at + nbytes > self.size:
            raise FormatError(self.path, f"zip record '{name}' ends at byte {local.data_at + nbytes}, past the end"
                              f" of the file ({self.size} bytes); truncated?")
        return local.data_at, nbytes

    def _local(self, name: str) -> _LocalHeader:
        at = self.reader.get_record_header_offset(name)
        head = os.pread(self.fd, _LOCAL_HEADER.size + len(self.prefix) + len(name), at)
        if len(head) < _LOCAL_HEADER.size:
            raise FormatError(self.path, f"the zip local header at byte {at} is past the end of the file; truncated?")
        signature, _, flags, method, _, _, _, _, _, name_len, extra_len = _LOCAL_HEADER.unpack_from(head)
        if signature != _LOCAL_SIGNATURE:
            raise FormatError(self.path, f"no zip local header at byte {at}, where the central directory puts one;"
                              " corrupt?")
        if len(head) < _LOCAL_HEADER.size + name_len:
            head = os.pread(self.fd, _LOCAL_HEADER.size + name_len, at)
        local_name = head[_LOCAL_HEADER.size:_LOCAL_HEADER.size + name_len].decode("utf-8", "replace")
        # the data follows the name and the extra field (torch's alignment padding, any zip64 sizes)
        return _LocalHeader(flags, method, local_name, at + _LOCAL_HEADER.size + name_len + extra_len)


def _storage_builder(path: Path, whole: torch.UntypedStorage,
                     records: _Records) -> Callable[[Any], torch.storage.TypedStorage]:
    """torch.load's ``persistent_load`` for a mapped file (serialization.py, ``_load``), with the record's offset
    from `_Records` instead of torch's lookup: a storage seen before is returned again (so views share it),
    except empty ones, which torch.load builds anew each time."""
    loaded: dict[Any, torch.storage.TypedStorage] = {}
    decode = torch.serialization._maybe_decode_ascii
    element_size = torch._utils._element_size

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        # torch's unpickler lets a tuple starting with "storage" or an int through; torch.load takes only the tuple
        if not isinstance(saved_id, tuple) or decode(saved_id[0]) != "storage" or len(saved_id) != 5:
            raise FormatError(path, f"the pickle asks for persistent id {saved_id!r}, not a storage; corrupt?")
        storage_type, key, _location, numel = saved_id[1:]  # map_location="cpu": the saved location is not used
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        typed = loaded.get(key)
        if typed is not None:
            return typed
        name = f"data/{key}"
        start, held = records.find(name)
        if type(numel) is not int or numel < 0 or not isinstance(dtype, torch.dtype):
            raise FormatError(path, f"storage record '{name}': bad element count or type in the pickle; corrupt?")
        nbytes = numel * element_size(dtype)
        if nbytes > held:
            raise FormatError(path, f"storage record '{name}' holds {held} bytes, the pickle says {nbytes}; corrupt?")
        typed = torch.storage.TypedStorage(wrap_storage=whole[start:start + nbytes], dtype=dtype, _internal=True)
        if typed._data_ptr() != 0:
            loaded[key] = typed
        return typed

    return persistent_load


class _Unpickler(_TorchUnpickler):
    """torch's weights-only unpickler, unchanged but for where storages come from."""

    def __init__(self, data: bytes, persistent_load: Callable[[Any], torch.storage.TypedStorage]) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")  # torch.load's default encoding
        self._persistent_load = persistent_load

    def persistent_load(self, pid: Any) -> torch.storage.TypedStorage:
        return self._persistent_load(pid)
