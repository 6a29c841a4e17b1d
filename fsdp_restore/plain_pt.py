"""A plain ``torch.save`` checkpoint read without torch: nested dicts, lists and tuples of tensors and Python
scalars, as `convert` needs it to copy the tensors' bytes. Returns what ``torch.load(weights_only=True)`` would,
with each tensor a `StoredTensor` (its storage record, dtype, shape, stride and offset) instead of a torch tensor.

Why: importing torch takes about a second before a conversion can read anything, and torch's unpickler builds a
tensor per entry; for a checkpoint of many small tensors those are most of a conversion's time, while a copy of
the file's bytes needs neither (BENCHMARKS.md, "the floor of a conversion that never imports torch").

What may be unpickled stays torch's rule, by construction: this reader takes only a subset of what torch's
weights-only unpickler takes, and builds from it what that unpickler would build. The opcodes are the ones
``torch.save`` writes for such a checkpoint (protocol 2), each with the meaning torch's unpickler gives it; the
globals are torch's tensor and parameter rebuilds, its typed storages and ``collections.OrderedDict``, each
checked as torch would use it. Anything else, anywhere (another global or opcode, a tensor torch would refuse or
build otherwise, a compressed or unexpected record, an archive of another format version), raises `NotPlain`
before anything is written, and the caller loads the file with torch as before, which then accepts or refuses it
as it always did. Nothing the pickle names is ever imported or called; the memo is a dict and the stacks are
lists, so a hostile pickle costs at most its own size in memory.
"""

from __future__ import annotations

import os
import struct
import sys
import zipfile
from collections import OrderedDict
from math import prod
from pathlib import Path
from typing import Any

MAX_PICKLE_BYTES = 64 * 2**20  # a checkpoint's pickle is kilobytes to a few megabytes
_INT64 = 2**63  # torch's sizes, strides, offsets and element counts are int64: anything past it, torch refuses
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header: 30 bytes, then the name and extra field
_KNOWN_RECORDS = {  # the records other than data.pkl and storages that torch.save writes, with their only values
    "version": {b"3\n", b"3"}, ".format_version": {b"1"}, ".storage_alignment": {b"64"}, "byteorder": {b"little"}}


class NotPlain(Exception):
    """This file is not one this module reads exactly as torch's weights-only loader would: load it with torch."""


class StoredDtype:
    """A tensor dtype described without torch: its torch name, its safetensors name and its item size. One instance
    per dtype (compared by identity, as torch's dtypes are)."""

    def __init__(self, name: str, safetensors_name: str, itemsize: int, floating: bool) -> None:
        self.name, self.safetensors_name, self.itemsize, self.floating = name, safetensors_name, itemsize, floating

    def __str__(self) -> str:
        return f"torch.{self.name}"  # as str(torch.float32) reads

    __repr__ = __str__


_DTYPES = {storage: StoredDtype(name, st_name, size, floating) for storage, name, st_name, size, floating in [
    ("FloatStorage", "float32", "F32", 4, True), ("DoubleStorage", "float64", "F64", 8, True),
    ("HalfStorage", "float16", "F16", 2, True), ("BFloat16Storage", "bfloat16", "BF16", 2, True),
    ("LongStorage", "int64", "I64", 8, False), ("IntStorage", "int32", "I32", 4, False),
    ("ShortStorage", "int16", "I16", 2, False), ("CharStorage", "int8", "I8", 1, False),
    ("ByteStorage", "uint8", "U8", 1, False), ("BoolStorage", "bool", "BOOL", 1, False)]}


class StoredStorage:
    """One storage record of the archive: ``numel`` elements of ``dtype`` at byte ``data_at`` of the file."""

    def __init__(self, key: str, dtype: StoredDtype, numel: int, data_at: int) -> None:
        self.key, self.dtype, self.numel, self.data_at = key, dtype, numel, data_at


class StoredTensor:
    """A tensor of a plain checkpoint, as torch's rebuild would make it from its storage record, described rather
    than loaded: the questions `flatten` and the writer ask of a torch tensor, answered from the pickle."""

    def __init__(self, storage: StoredStorage, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 requires_grad: bool, param: bool = False) -> None:
        self.storage, self.offset, self.shape, self.strides = storage, offset, shape, strides
        self.requires_grad, self.param = requires_grad, param

    @property
    def dtype(self) -> StoredDtype:
        return self.storage.dtype

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def storage_offset(self) -> int:
        return self.offset

    def numel(self) -> int:
        return prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        """torch's rule: row-major strides, a dimension of size 1 taking any stride; an empty tensor always is."""
        if 0 in self.shape:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def file_offset(self) -> int:
        """Where the tensor's first byte lies in the file."""
        return self.storage.data_at + self.offset * self.dtype.itemsize


class _Global:
    """A global the pickle names that this reader understands (never the object itself)."""

    def __init__(self, name: str) -> None:
        self.name = name


_REBUILD_TENSOR, _REBUILD_PARAMETER, _ORDERED_DICT = (_Global("torch._utils._rebuild_tensor_v2"),
                                                      _Global("torch._utils._rebuild_parameter"),
                                                      _Global("collections.OrderedDict"))
_GLOBALS: dict[tuple[str, str], Any] = {("torch._utils", "_rebuild_tensor_v2"): _REBUILD_TENSOR,
                                        ("torch._utils", "_rebuild_parameter"): _REBUILD_PARAMETER,
                                        ("collections", "OrderedDict"): _ORDERED_DICT}
_GLOBALS.update({("torch", storage): dtype for storage, dtype in _DTYPES.items()})


def load_plain(path: str | os.PathLike[str]) -> Any:
    """What ``torch.load(path, weights_only=True, map_location="cpu")`` returns for a plain checkpoint, tensors as
    `StoredTensor`s; `NotPlain` for any file it does not read exactly as torch would (load that one with torch)."""
    return load_plain_archive(path)[0]


def load_plain_archive(path: str | os.PathLike[str]) -> tuple[Any, list[zipfile.ZipInfo]]:
    """`load_plain`, and the archive's members as read from its central directory (for its fingerprint,
    `provenance.members_fingerprint`, without reading the directory again)."""
    if sys.byteorder != "little":
        raise NotPlain("a big-endian host")
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise NotPlain(f"not a zip archive this reader opens ({e})") from None
    with archive, open(path, "rb") as f:
        infos = archive.infolist()
        names = [i.filename for i in infos]
        # names as torch's zip reader (miniz) sees them: whole (Python cuts one at a NUL), ASCII, told apart
        # without case; the archive at the start of the file (Python's reader also takes one after other bytes)
        if (any(i.orig_filename != i.filename or not i.filename.isascii() for i in infos)
                or len({n.lower() for n in names}) != len(names) or not infos
                or min(i.header_offset for i in infos) != 0 or f.read(4) != b"PK\x03\x04"):
            raise NotPlain("record names or a layout torch's zip reader may read otherwise")
        pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise NotPlain("not one data.pkl at the top of one archive folder")
        prefix = pickles[0][:-len("data.pkl")]
        if not all(n.startswith(prefix) for n in names):
            raise NotPlain("records outside the archive's folder")
        records = {n[len(prefix):]: i for n, i in zip(names, infos)}
        for name, info in records.items():
            if name == "data.pkl" or name.startswith("data/") or name == ".data/serialization_id":
                continue
            if name not in _KNOWN_RECORDS or _read(f, info) not in _KNOWN_RECORDS[name]:
                raise NotPlain(f"record '{name}' is not one torch.save writes with that value")
        if "version" not in records:
            raise NotPlain("no version record")
        data = _read(f, records["data.pkl"], MAX_PICKLE_BYTES)
        if data[:2] != b"\x80\x02":
            raise NotPlain("a pickle protocol other than 2")

        def storage(key: str, dtype: StoredDtype, numel: int) -> StoredStorage:
            info = records.get(f"data/{key}")
            if info is None:
                raise NotPlain(f"no record for storage '{key}'")
            data_at = _data_at(f, info)
            if numel * dtype.itemsize > info.file_size:
                raise NotPlain(f"storage '{key}' is shorter than the pickle says")
            return StoredStorage(key, dtype, numel, data_at)

        try:
            return _Unpickler(data, storage).load(), infos
        except NotPlain:
            raise
        except Exception as e:  # noqa: BLE001 - whatever torch's unpickler would say of it, it says it
            raise NotPlain(f"{type(e).__name__}: {e}") from None


def _data_at(f: Any, info: zipfile.ZipInfo) -> int:
    """Where a stored, unencrypted record's data starts (after its local header's name and extra field). One
    ``pread`` of the header and the name (a buffered file would read 8 KB per record)."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
        raise NotPlain(f"record '{info.filename}' is compressed or encrypted")
    name = info.filename.encode("utf-8")
    head = os.pread(f.fileno(), _LOCAL_HEADER.size + len(name), info.header_offset)
    if len(head) < _LOCAL_HEADER.size + len(name):
        raise NotPlain("a truncated local header")
    signature, *_, name_len, extra_len = _LOCAL_HEADER.unpack_from(head)
    if signature != b"PK\x03\x04" or name_len != len(name) or head[_LOCAL_HEADER.size:] != name:
        raise NotPlain(f"record '{info.filename}': its local header does not match")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def _read(f: Any, info: zipfile.ZipInfo, most: int = 1024) -> bytes:
    if info.file_size > most:
        raise NotPlain(f"record '{info.filename}' is larger than expected")
    data = os.pread(f.fileno(), info.file_size, _data_at(f, info))
    if len(data) != info.file_size:
        raise NotPlain(f"record '{info.filename}' is truncated")
    return data


class _Unpickler:
    """The opcodes ``torch.save`` writes for a plain checkpoint, each as torch's weights-only unpickler runs it
    (torch/_weights_only_unpickler.py), on `StoredTensor`s; every other opcode is `NotPlain`."""

    def __init__(self, data: bytes, storage: Any) -> None:
        self.data = data
        self.storage = storage
        self.storages: dict[str, StoredStorage] = {}
        self.memo: dict[int, Any] = {}

    def load(self) -> Any:
        """Run the pickle. The opcodes are tested in the order of how often torch.save writes them, on the bytes
        themselves (a position, not a file object: a call less per opcode), and any read past the end fails."""
        data, memo = self.data, self.memo
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        u32, i32, u16, f64 = (struct.Struct(f).unpack_from for f in ("<I", "<i", "<H", ">d"))
        pos, end = 0, len(data)
        while True:
            if pos >= end:
                raise NotPlain("the pickle ends before STOP")
            op = data[pos]
            pos += 1
            if op == 0x71:  # BINPUT
                memo[data[pos]] = stack[-1]
                pos += 1
            elif op == 0x68:  # BINGET
                stack.append(memo[data[pos]])
                pos += 1
            elif op == 0x4B:  # BININT1
                stack.append(data[pos])
                pos += 1
            elif op == 0x58:  # BINUNICODE
                n = u32(data, pos)[0]
                pos += 4
                if pos + n > end:
                    raise NotPlain("a truncated string")
                stack.append(str(data[pos:pos + n], "utf-8", "surrogatepass"))
                pos += n
            elif op == 0x28:  # MARK
                metastack.append(stack)
                stack = []
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                stack[-1] = self.reduce(stack[-1], args)
            elif op == 0x74:  # TUPLE
                items = stack
                stack = metastack.pop()
                stack.append(tuple(items))
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x51:  # BINPERSID
                stack.append(self.persistent_load(stack.pop()))
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = metastack.pop()
                target = _mapping(stack[-1])
                for i in range(0, len(items), 2):
                    target[items[i]] = items[i + 1]
            elif op == 0x72:  # LONG_BINPUT
                memo[u32(data, pos)[0]] = stack[-1]
                pos += 4
            elif op == 0x6A:  # LONG_BINGET
                stack.append(memo[u32(data, pos)[0]])
                pos += 4
            elif op == 0x86:  # TUPLE2
                stack[-2:] = [(stack[-2], stack[-1])]
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
            elif op == 0x4A:  # BININT
                stack.append(i32(data, pos)[0])
                pos += 4
            elif op == 0x4D:  # BININT2
                stack.append(u16(data, pos)[0])
                pos += 2
            elif op == 0x8A:  # LONG1
                n = data[pos]
                if pos + 1 + n > end:
                    raise NotPlain("a truncated integer")
                stack.append(int.from_bytes(data[pos + 1:pos + 1 + n], "little", signed=True))
                pos += 1 + n
            elif op == 0x47:  # BINFLOAT
                stack.append(f64(data, pos)[0])
                pos += 8
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x73:  # SETITEM
                value, k = stack.pop(), stack.pop()
                _mapping(stack[-1])[k] = value
            elif op == 0x61:  # APPEND
                item = stack.pop()
                _list(stack[-1]).append(item)
            elif op == 0x65:  # APPENDS
                items = stack
                stack = metastack.pop()
                _list(stack[-1]).extend(items)
            elif op == 0x63:  # GLOBAL: two lines, module then name
                first = data.find(b"\n", pos)
                second = data.find(b"\n", first + 1) if first >= 0 else -1
                if second < 0:
                    raise NotPlain("a truncated GLOBAL")
                module, name = data[pos:first].decode("utf-8"), data[first + 1:second].decode("utf-8")
                pos = second + 1
                found = _GLOBALS.get((module, name))
                if found is None:
                    raise NotPlain(f"global {module}.{name}")
                stack.append(found)
            elif op == 0x62:  # BUILD: torch's rule for an OrderedDict (a state_dict's _metadata): attributes only
                state = stack.pop()
                if type(stack[-1]) is not OrderedDict or type(state) is not dict:
                    raise NotPlain("BUILD of anything but an OrderedDict's attributes")
                stack[-1].__dict__.update(state)
            elif op == 0x80:  # PROTO
                pos += 1
            elif op == 0x2E:  # STOP
                return stack.pop()
            else:
                raise NotPlain(f"opcode {bytes([op])!r}")

    def persistent_load(self, pid: Any) -> StoredStorage:
        """torch.load's storage for ``('storage', type, key, location, numel)`` (the location is not used: the
        conversion's map_location is the CPU): one per key; a key named again otherwise is not read here."""
        if (type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage" or type(pid[1]) is not StoredDtype
                or type(pid[2]) is not str or type(pid[3]) is not str or not _index(pid[4])):
            raise NotPlain(f"persistent id {pid!r:.80}")
        _, dtype, key, _location, numel = pid
        known = self.storages.get(key)
        if known is not None:
            if known.dtype is not dtype or known.numel != numel:
                raise NotPlain(f"storage '{key}' named with two dtypes or sizes")
            return known
        stored = self.storages[key] = self.storage(key, dtype, numel)
        return stored

    def reduce(self, func: Any, args: Any) -> Any:
        if type(args) is not tuple:
            raise NotPlain("REDUCE without a tuple of arguments")
        if func is _ORDERED_DICT and args == ():
            return OrderedDict()
        if func is _REBUILD_TENSOR and len(args) in (6, 7):
            storage, offset, size, stride, requires_grad, hooks = args[:6]
            metadata = args[6] if len(args) == 7 else None
            if (type(storage) is not StoredStorage or not _index(offset) or type(size) is not tuple
                    or type(stride) is not tuple or len(size) != len(stride) or not all(map(_index, size))
                    or not all(map(_index, stride)) or type(requires_grad) is not bool
                    or type(hooks) is not OrderedDict or hooks or metadata):
                raise NotPlain("a tensor rebuilt with arguments torch.save does not write for a plain tensor")
            if requires_grad and not storage.dtype.floating:
                raise NotPlain("requires_grad on a tensor that is not floating (torch refuses it)")
            tensor = StoredTensor(storage, offset, size, stride, requires_grad)
            numel = tensor.numel()
            if numel >= _INT64 or (numel and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.numel):
                raise NotPlain("a tensor past the end of its storage, or too large (torch refuses it)")
            return tensor
        if func is _REBUILD_PARAMETER and len(args) == 3:
            data, requires_grad, hooks = args
            if (type(data) is not StoredTensor or data.param or type(requires_grad) is not bool
                    or type(hooks) is not OrderedDict or hooks):
                raise NotPlain("a parameter rebuilt with arguments torch.save does not write for a plain parameter")
            if requires_grad and not data.dtype.floating:
                raise NotPlain("requires_grad on a parameter that is not floating (torch refuses it)")
            return StoredTensor(data.storage, data.offset, data.shape, data.strides, requires_grad, param=True)
        raise NotPlain("a call torch.save does not write for a plain checkpoint")


def _index(x: Any) -> bool:
    """A size, stride, offset or count as torch takes one: a non-negative int64."""
    return type(x) is int and 0 <= x < _INT64


def _mapping(target: Any) -> dict[Any, Any]:
    if type(target) is not dict and type(target) is not OrderedDict:
        raise NotPlain("SETITEM(S) on anything but a dict")
    return target


def _list(target: Any) -> list[Any]:
    if type(target) is not list:
        raise NotPlain("APPEND(S) on anything but a list")
    return target
