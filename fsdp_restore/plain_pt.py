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

import functools
import os
import struct
import sys
from collections import OrderedDict
from math import prod
from typing import Any, NamedTuple

from .format import STORED_DTYPES, StoredDtype

MAX_PICKLE_BYTES = 64 * 2**20  # a checkpoint's pickle is kilobytes to a few megabytes
_INT64 = 2**63  # torch's sizes, strides, offsets and element counts are int64: anything past it, torch refuses
MAX_DIRECTORY_BYTES = 256 * 2**20  # a zip central directory of millions of records (such a pickle is past its cap)
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # zip local file header: 30 bytes, then the name and extra field
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # zip central directory entry: 46 bytes, then name, extra, comment
_END = struct.Struct("<4sHHHHIIH")  # zip end of central directory record (torch.save writes no comment)
_ZIP64_LOCATOR = struct.Struct("<4sIQI")  # zip64 end of central directory locator, just before the end record
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory record, just before its locator
_FLAGS = {0, 0x8, 0x800, 0x808}  # general purpose bits torch.save's writer may set: a data descriptor, UTF-8 names
_SATURATED = 0xFFFFFFFF  # a 32-bit zip field whose value is in the zip64 extra field
_KNOWN_RECORDS = {  # the records other than data.pkl and storages that torch.save writes, with their only values
    "version": {b"3\n", b"3"}, ".format_version": {b"1"}, ".storage_alignment": {b"64"}, "byteorder": {b"little"}}


def builds_storages_from_records() -> bool:
    """Whether torch.load in this process builds each storage of a zip-format file from its record's bytes as they
    lie, as this module (and `fsdp_restore.torch_zip`) takes them: on a little-endian host, and, where torch is
    imported, without ``skip_data`` or a fake tensor mode (under which it builds other storages, or none). The byte
    order of a file that does not say its own: `default_byte_order_little`."""
    torch = sys.modules.get("torch")
    if torch is None or sys.byteorder != "little":
        return sys.byteorder == "little"
    tls = getattr(torch.serialization, "_serialization_tls", None)
    return not getattr(tls, "skip_data", False) and torch._guards.detect_fake_mode(None) is None


def default_byte_order_little() -> bool:
    """Whether torch.load reads a file that does not say its byte order (no ``byteorder`` record) as little-endian:
    unless the user set another load endianness (where torch is imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    return torch.serialization.get_default_load_endianness() in (None, torch.serialization.LoadEndianness.LITTLE)


class NotPlain(Exception):
    """This file is not one this module reads exactly as torch's weights-only loader would: load it with torch."""


_DTYPES = {storage: STORED_DTYPES[name] for storage, name in [
    ("FloatStorage", "float32"), ("DoubleStorage", "float64"), ("HalfStorage", "float16"),
    ("BFloat16Storage", "bfloat16"), ("LongStorage", "int64"), ("IntStorage", "int32"), ("ShortStorage", "int16"),
    ("CharStorage", "int8"), ("ByteStorage", "uint8"), ("BoolStorage", "bool")]}


class StoredStorage:
    """One storage record of the archive: ``numel`` elements of ``dtype`` at byte ``data_at`` of the file open as
    ``fd``; or, with ``extents``, a storage held in pieces (`zero_plain`): its bytes are those runs, in turn."""

    def __init__(self, key: str, dtype: StoredDtype, numel: int, data_at: int, fd: int = -1,
                 extents: list[tuple[int, int, int]] | None = None) -> None:
        self.key, self.dtype, self.numel, self.data_at = key, dtype, numel, data_at
        self.fd, self.extents = fd, extents


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
        return _row_major(self.shape, self.strides)

    @property
    def file_offset(self) -> int:
        """Where the tensor's first byte lies in the file."""
        return self.storage.data_at + self.offset * self.dtype.itemsize


@functools.lru_cache(maxsize=4096)
def _row_major(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """`StoredTensor.is_contiguous` (cached: a checkpoint's tensors come in a few shapes, and it is asked of each)."""
    if 0 in shape:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


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


class StandIn:
    """An object of one of the classes DeepSpeed's pickles name (`zero.STAND_INS`), as the conversion's torch path
    builds it: its class name and the attributes its pickle set, nothing run."""

    def __init__(self, name: str) -> None:
        self.name, self.state = name, {}


class StoredSize(tuple):
    """A ``torch.Size`` as the pickle gives it: its sizes, of a type of its own (nothing takes it for a tuple)."""


class StoredZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum`` as the torch path's stand-in builds it: the stage, an int of a type of its own."""


class _StandInClass(_Global):
    """A DeepSpeed class the torch path takes as a stand-in whose instances only restore their attributes."""


_SIZE, _TENSOR, _REBUILD_FROM_TYPE, _ZERO_STAGE = (_Global("torch.Size"), _Global("torch.Tensor"),
                                                   _Global("torch._tensor._rebuild_from_type_v2"),
                                                   _Global("deepspeed.runtime.zero.config.ZeroStageEnum"))
# what the conversion's torch path adds to torch's defaults for a ZeRO directory's files (`zero.STAND_INS`), and the
# defaults those files use beyond a plain checkpoint's
_DEEPSPEED_GLOBALS: dict[tuple[str, str], Any] = {
    **_GLOBALS, ("torch", "Size"): _SIZE, ("torch", "Tensor"): _TENSOR,
    ("torch._tensor", "_rebuild_from_type_v2"): _REBUILD_FROM_TYPE,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _ZERO_STAGE,
    **{(module, name): _StandInClass(f"{module}.{name}") for module, name in [
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.utils.tensor_fragment", "fragment_address")]},
    # a dtype as a value (an fp16 run's DynamicLossScaler holds torch.float16): inert, of no use as a storage's type
    # (persistent_load takes storage types only), and nothing a conversion's output may hold (`convert._lane_values`)
    **{("torch", name): _Global(f"torch.{name}") for name in STORED_DTYPES}}


def load_plain(path: str | os.PathLike[str]) -> Any:
    """What ``torch.load(path, weights_only=True, map_location="cpu")`` returns for a plain checkpoint, tensors as
    `StoredTensor`s; `NotPlain` for any file it does not read exactly as torch would (load that one with torch)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return load_plain_archive(fd)[0]
    finally:
        os.close(fd)


def load_plain_archive(fd: int, *, deepspeed: bool = False, archive: _Archive | None = None,
                       assume_layout: bool = False) -> tuple[Any, list[ZipMember]]:
    """`load_plain` of the file open as ``fd`` (read with ``pread`` only: the caller reads the tensors' bytes
    through the same descriptor, so from the same file, whatever its path names meanwhile), and the archive's
    members as its central directory lists them (for its fingerprint, `provenance.members_fingerprint`).

    ``deepspeed``: a file of a DeepSpeed ZeRO checkpoint, read as the conversion's torch path reads one (`zero`):
    also ``torch.Size`` (`StoredSize`), tensors rebuilt through ``_rebuild_from_type_v2`` as plain tensors (with
    no attribute but DeepSpeed's ``ds_id``), ``ZeroStageEnum`` (`StoredZeroStage`) and DeepSpeed's loss scalers
    and fragment addresses (`StandIn`s). ``archive``: the `_Archive` of ``fd`` where the caller parsed it already.
    ``assume_layout``: the storages' data taken to start where torch's writer puts it, without reading their local
    headers (`_Archive.assumed_data_at`): the caller calls ``archive.prove_assumed()`` before it makes anything of
    the bytes it read there."""
    if sys.byteorder != "little":
        raise NotPlain("a big-endian host")
    archive = archive if archive is not None else _Archive(fd)
    members = archive.members
    names = [m.filename for m in members]
    # names as torch's zip reader (miniz) sees them: told apart without case; the archive at the start of the file
    if len({n.lower() for n in names}) != len(names) or min(m.header_offset for m in members) != 0:
        raise NotPlain("record names or a layout torch's zip reader may read otherwise")
    pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise NotPlain("not one data.pkl at the top of one archive folder")
    prefix = pickles[0][:-len("data.pkl")]
    if not all(n.startswith(prefix) for n in names):
        raise NotPlain("records outside the archive's folder")
    records = {n[len(prefix):]: m for n, m in zip(names, members)}
    for name, member in records.items():
        if name == "data.pkl" or name.startswith("data/"):
            continue  # read as the pickle asks for them
        if name == ".data/serialization_id":
            try:  # torch.load reads it as a str: where it lies must be sound, and it UTF-8, whatever its value
                archive.read(member, 64).decode("utf-8")
            except UnicodeDecodeError:
                raise NotPlain("a serialization id torch.load cannot decode") from None
            continue
        if name not in _KNOWN_RECORDS or archive.read(member) not in _KNOWN_RECORDS[name]:
            raise NotPlain(f"record '{name}' is not one torch.save writes with that value")
    if "version" not in records:
        raise NotPlain("no version record")
    data = archive.read(records["data.pkl"], MAX_PICKLE_BYTES)
    if data[:2] != b"\x80\x02":
        raise NotPlain("a pickle protocol other than 2")

    def storage(key: str, dtype: StoredDtype, numel: int) -> StoredStorage:
        member = records.get(f"data/{key}")
        if member is None:
            raise NotPlain(f"no record for storage '{key}'")
        if numel * dtype.itemsize > member.file_size:
            raise NotPlain(f"storage '{key}' is shorter than the pickle says")
        return StoredStorage(key, dtype, numel,
                             archive.assumed_data_at(member) if assume_layout else archive.data_at(member), fd)

    try:
        return _Unpickler(data, storage, _DEEPSPEED_GLOBALS if deepspeed else _GLOBALS).load(), members
    except NotPlain:
        raise
    except Exception as e:  # noqa: BLE001 - whatever torch's unpickler would say of it, it says it
        raise NotPlain(f"{type(e).__name__}: {e}") from None


ZIP_TAIL_BYTES = _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size  # how torch.save's archive ends: zip64's records


def end_records(tail: bytes) -> tuple[tuple[Any, ...], tuple[tuple[Any, ...], tuple[Any, ...]] | None] | None:
    """The fields of the end record a file's last bytes ``tail`` (its last `ZIP_TAIL_BYTES`, or all of a shorter
    file) end with, and of zip64's locator and end record where they precede it (a locator's signature there);
    None where ``tail`` is too short for an end record. Unchecked: `_Archive` checks every field, the read-ahead
    (`prefetch`) only asks where the directory lies."""
    if len(tail) < _END.size:
        return None
    end = _END.unpack_from(tail, len(tail) - _END.size)
    if len(tail) == ZIP_TAIL_BYTES and tail[_ZIP64_END.size:_ZIP64_END.size + 4] == b"PK\x06\x07":
        return end, (_ZIP64_LOCATOR.unpack_from(tail, _ZIP64_END.size), _ZIP64_END.unpack_from(tail))
    return end, None


class ZipMember(NamedTuple):
    """One record of the archive as its central directory lists it (the names `zipfile.ZipInfo` gives them)."""

    filename: str
    CRC: int
    file_size: int
    header_offset: int


class _Archive:
    """The zip archive ``torch.save`` writes, read only where it is exactly as torch's writer (miniz) lays it out.

    Why not `zipfile`: Python's reader accepts archives torch's refuses (flag bits, sizes that differ, disk
    numbers, end-record counts, directory entries, a version it does not know) and reads some otherwise; a
    conversion of a file torch calls corrupt must not succeed. Every field a zip reader may act on is checked
    against the one value torch writes (the version, time, date and crc32 fields, which neither reader acts on,
    are not), and anything else is `NotPlain`, so torch's path decides."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        size = os.fstat(fd).st_size
        tail = os.pread(fd, ZIP_TAIL_BYTES, max(0, size - ZIP_TAIL_BYTES))
        ends = end_records(tail)
        if ends is None:
            raise NotPlain("too short for a zip archive")
        (signature, disk, directory_disk, here, total, directory_size, directory_at, comment), zip64 = ends
        if signature != b"PK\x05\x06" or disk or directory_disk or here != total or comment:
            raise NotPlain("a zip end record (at the file's last 22 bytes) other than torch.save's")
        directory_end = size - _END.size
        if zip64 is not None:
            (_, end_disk, end_at, disks), (end_signature, end_size, _, _, disk64, directory_disk64, here64, total64,
                                           directory_size64, directory_at64) = zip64
            # miniz takes the zip64 record's values; the 16- and 32-bit ones must be the same, saturated
            if (end_disk or disks != 1 or end_at != size - ZIP_TAIL_BYTES or end_signature != b"PK\x06\x06"
                    or end_size != _ZIP64_END.size - 12 or disk64 or directory_disk64 or here64 != total64
                    or (total, directory_size, directory_at) != (min(total64, 0xFFFF),
                                                                 min(directory_size64, _SATURATED),
                                                                 min(directory_at64, _SATURATED))):
                raise NotPlain("zip64 end records other than torch.save's")
            total, directory_size, directory_at, directory_end = total64, directory_size64, directory_at64, end_at
        elif _SATURATED in (directory_size, directory_at) or total == 0xFFFF:
            raise NotPlain("a saturated zip end record without its zip64 record")
        if (directory_at + directory_size != directory_end or not 0 < total * _CENTRAL.size <= directory_size
                or directory_size > MAX_DIRECTORY_BYTES):
            raise NotPlain("a zip central directory that is not where, or the size, its end record says")
        directory = os.pread(fd, directory_size, directory_at)
        if len(directory) != directory_size:
            raise NotPlain("a truncated zip central directory")
        self.directory_at = directory_at
        self.members = _central_directory(directory, total, directory_at)
        self.assumed: list[tuple[ZipMember, int]] = []  # (record, where its data was taken to start): `prove_assumed`

    def assumed_data_at(self, member: ZipMember) -> int:
        """Where a record's data starts if its local header is as torch's writer lays one out (its alignment
        padding, and zip64's field where a size or offset needs it, in the extra field: the data at the next
        multiple of 64), without reading it; noted, to be proven by `prove_assumed` before anything is made of
        the bytes read there. Why: each local header is a read of its own, spread over the file (a record every
        64 KB for a checkpoint of thousands of small tensors) that waits for the disk to reach it: a conversion
        whose pickle waited for each would lay its output out only once the source was read, with the disk idle
        meanwhile; proven instead just before the first write, by when the read-ahead has read them
        (BENCHMARKS.md, session 31)."""
        start = member.header_offset + _LOCAL.size + len(member.filename) + 4  # (the padding field's id and size)
        if member.file_size >= _SATURATED or member.header_offset >= _SATURATED:
            start += 4 + 16 * (member.file_size >= _SATURATED) + 8 * (member.header_offset >= _SATURATED)
        data_at = -(-start // 64) * 64
        if data_at + member.file_size > self.directory_at:
            raise NotPlain(f"record '{member.filename}' runs into the central directory")
        self.assumed.append((member, data_at))
        return data_at

    def prove_assumed(self) -> None:
        """Read the local header of every record `assumed_data_at` placed, and raise `NotPlain` naming the first
        whose data does not start there (or whose header is not torch.save's); forgets them once proven."""
        for member, at in self.assumed:
            try:
                found = self.data_at(member)
            except OSError as e:  # (as an error of the parse's own reads would: the torch path reads it and says)
                raise NotPlain(f"record '{member.filename}': its local header could not be read ({e})") from None
            if found != at:
                raise NotPlain(f"record '{member.filename}': its data does not start where torch's writer puts it")
        self.assumed.clear()

    def data_at(self, member: ZipMember) -> int:
        """Where a record's data starts (after its local header's name and extra field, which holds torch's
        alignment padding): one ``pread`` of the header and the name (a buffered file would read 8 KB per
        record)."""
        name = member.filename.encode("ascii")
        head = os.pread(self.fd, _LOCAL.size + len(name), member.header_offset)
        if len(head) < _LOCAL.size + len(name):
            raise NotPlain("a truncated local header")
        signature, _, flags, method, *_, name_len, extra_len = _LOCAL.unpack_from(head)
        if (signature != b"PK\x03\x04" or flags not in _FLAGS or method or name_len != len(name)
                or head[_LOCAL.size:] != name):
            raise NotPlain(f"record '{member.filename}': its local header is not the central directory's")
        data_at = member.header_offset + _LOCAL.size + name_len + extra_len
        if data_at + member.file_size > self.directory_at:
            raise NotPlain(f"record '{member.filename}' runs into the central directory")
        return data_at

    def read(self, member: ZipMember, most: int = 1024) -> bytes:
        """A small record's bytes (at most ``most``)."""
        if member.file_size > most:
            raise NotPlain(f"record '{member.filename}' is larger than expected")
        data = os.pread(self.fd, member.file_size, self.data_at(member))
        if len(data) != member.file_size:
            raise NotPlain(f"record '{member.filename}' is truncated")
        return data


def _central_directory(directory: bytes, total: int, directory_at: int) -> list[ZipMember]:
    """The ``total`` entries of a central directory that holds exactly those, each as torch.save writes it:
    stored (method 0), flag bits for a data descriptor and UTF-8 names only, no comment, disk 0, no attributes
    (miniz takes an attribute bit for a directory, read as empty), compressed size = size, a name of 1 to 511
    bytes (miniz cuts longer ones) of ASCII without NUL or a trailing slash, and no extra field but the zip64
    one holding exactly the fields saturated to 0xFFFFFFFF (sizes, then the offset)."""
    members: list[ZipMember] = []
    at = 0
    while at < len(directory):
        if at + _CENTRAL.size > len(directory):
            raise NotPlain("a truncated zip central directory entry")
        (signature, _, _, flags, method, _, _, crc, packed, size, name_len, extra_len, comment_len, disk, _,
         attributes, header_offset) = _CENTRAL.unpack_from(directory, at)
        name = directory[at + _CENTRAL.size:at + _CENTRAL.size + name_len]
        extra = directory[at + _CENTRAL.size + name_len:at + _CENTRAL.size + name_len + extra_len]
        at += _CENTRAL.size + name_len + extra_len + comment_len
        if method or flags & 0x1:
            raise NotPlain(f"record '{name.decode('utf-8', 'replace')}' is compressed or encrypted")
        if (signature != b"PK\x01\x02" or flags not in _FLAGS or comment_len or disk or attributes
                or packed != size or not 0 < name_len < 512 or at > len(directory) or not name.isascii()
                or b"\0" in name or name.endswith(b"/")):
            raise NotPlain(f"zip central directory entry {len(members)} is not one torch.save writes")
        saturated = [size == _SATURATED, size == _SATURATED, header_offset == _SATURATED]
        if any(saturated):
            count = sum(saturated)
            if len(extra) != 4 + 8 * count or extra[:4] != struct.pack("<HH", 1, 8 * count):
                raise NotPlain(f"zip central directory entry {len(members)}: not torch.save's zip64 field")
            values = struct.unpack_from(f"<{count}Q", extra, 4)
            if size == _SATURATED:
                size, packed = values[:2]
            if header_offset == _SATURATED:
                header_offset = values[-1]
            if packed != size or not all(_SATURATED <= value < _INT64 for value in values):
                raise NotPlain(f"zip central directory entry {len(members)}: zip64 values torch.save would not write")
        elif extra:
            raise NotPlain(f"zip central directory entry {len(members)}: an extra field torch.save does not write")
        if header_offset + _LOCAL.size + size > directory_at:
            raise NotPlain(f"zip central directory entry {len(members)}: its record runs past the directory")
        members.append(ZipMember(name.decode("ascii"), crc, size, header_offset))
    if len(members) != total:
        raise NotPlain("a zip central directory holding other than the entries its end record counts")
    return members


class _Unpickler:
    """The opcodes ``torch.save`` writes for a plain checkpoint, each as torch's weights-only unpickler runs it
    (torch/_weights_only_unpickler.py), on `StoredTensor`s; every other opcode is `NotPlain`."""

    def __init__(self, data: bytes, storage: Any, known: dict[tuple[str, str], Any]) -> None:
        self.data = data
        self.storage = storage
        self.known = known
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
                found = self.known.get((module, name))
                if found is None:
                    raise NotPlain(f"global {module}.{name}")
                stack.append(found)
            elif op == 0x62:  # BUILD: torch's rule for an OrderedDict (a state_dict's _metadata): attributes only
                state = stack.pop()
                if type(state) is not dict or not all(type(k) is str for k in state):
                    raise NotPlain("BUILD with other than a dict of attributes")
                if type(stack[-1]) is OrderedDict:
                    stack[-1].__dict__.update(state)
                elif type(stack[-1]) is StandIn:  # the stand-in's __setstate__: its attributes, nothing run
                    stack[-1].state.update(state)
                else:
                    raise NotPlain("BUILD of anything but an OrderedDict's or a stand-in's attributes")
            elif op == 0x81:  # NEWOBJ: a stand-in class's object, made without arguments (what DeepSpeed pickles)
                args, cls = stack.pop(), stack.pop()
                if type(cls) is not _StandInClass or args != ():
                    raise NotPlain("NEWOBJ of anything but a stand-in class, without arguments")
                stack.append(StandIn(cls.name))
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
        if func is _SIZE and len(args) == 1 and type(args[0]) is tuple and all(map(_index, args[0])):
            return StoredSize(args[0])
        if func is _ZERO_STAGE and len(args) == 1 and type(args[0]) is int:
            return StoredZeroStage(args[0])
        if func is _REBUILD_FROM_TYPE and len(args) == 4:
            rebuild, new_type, rebuild_args, state = args
            # a plain tensor (no subclass), with at most DeepSpeed's id as an attribute (torch sets it on the tensor)
            if (rebuild is not _REBUILD_TENSOR or new_type is not _TENSOR or type(rebuild_args) is not tuple
                    or type(state) is not dict or not set(state) <= {"ds_id"}):
                raise NotPlain("a tensor rebuilt as a subclass, or with attributes")
            return self.reduce(_REBUILD_TENSOR, rebuild_args)
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
