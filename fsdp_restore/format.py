"""The on-disk format: safetensors files plus our metadata keys (see FORMAT.md).

This module owns the dtype table, the metadata key names and a strict header parser. The parser is
ours rather than `safe_open` because the restore path needs exact byte offsets for positional
reads, and because every malformed header must become a `FormatError` naming the file.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from .errors import FormatError, not_a_file

# 2: headers and indexes carry their own crc32 (META_HEADER_CRC); shards of a set carry its id (META_SET_ID).
# Version-1 files (and files of other tools) have neither and still read.
FORMAT_VERSION = "2"
PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")  # torch.save files by their usual names
SEALED_SINCE_VERSION = 2  # every header and index of this format version and later carries its crc32

# Metadata keys in the safetensors header (``__metadata__``, str -> str) and in the index json.
META_FORMAT = "format"  # "pt", as Hugging Face writes it
META_VERSION = "fsdp_restore.format_version"
META_STRUCTURE = "fsdp_restore.structure"  # JSON of the nested object, see flatten.py
META_CHECKSUMS = "fsdp_restore.checksums"  # JSON {key: 8 hex digits of crc32}
META_CAST = "fsdp_restore.cast"  # JSON {key: original dtype name} for tensors cast on conversion
META_SOURCE = "fsdp_restore.source"  # JSON {name, size, mtime_ns, fingerprint} of the converted .pt (provenance.py)
META_HEADER_CRC = "fsdp_restore.header_crc32"  # 8 hex digits: crc32 of the header itself (see `seal`)
META_SET_ID = "fsdp_restore.set_id"  # 32 hex digits shared by a sharded set's index and shards, new per write

# A sealed header (index) starts with exactly these bytes, then the 8 digits of its crc32: a fixed place, so a
# reader finds the value without re-serialising anything, and any rewrite of the header (even one that
# keeps its meaning) moves or changes it.
_SEAL_DIGITS = 8
HEADER_SEAL_PREFIX = b'{"__metadata__":{"' + META_HEADER_CRC.encode() + b'":"'
INDEX_SEAL_PREFIX = b'{\n  "metadata": {\n    "' + META_HEADER_CRC.encode() + b'": "'

INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_INDEX_NAME = "model.safetensors.index.json"

# safetensors refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# torch's dtype attribute name -> the safetensors name (the float8 and unsigned ones where this torch has them)
_TORCH_NAMES = [("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"), ("int64", "I64"),
                ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"), ("bool", "BOOL"),
                ("complex64", "C64"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("uint16", "U16"),
                ("uint32", "U32"), ("uint64", "U64")]
_TABLES: list[dict[Any, Any]] = []


def _torch_tables() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype]]:
    """``(DTYPE_TO_NAME, NAME_TO_DTYPE)``, built on first use: a conversion that never meets a torch tensor (see
    `fsdp_restore.plain_pt`) must not import torch for them."""
    if not _TABLES:
        import torch

        to_name = {getattr(torch, attr): name for attr, name in _TORCH_NAMES if hasattr(torch, attr)}
        _TABLES[:] = [to_name, {v: k for k, v in to_name.items()}]
    return _TABLES[0], _TABLES[1]  # type: ignore[return-value]


def __getattr__(name: str) -> Any:  # PEP 562: DTYPE_TO_NAME and NAME_TO_DTYPE import torch when first asked for
    if name == "DTYPE_TO_NAME":
        return _torch_tables()[0]
    if name == "NAME_TO_DTYPE":
        return _torch_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``), or of a dtype described without
    torch (anything with a ``safetensors_name``, as `fsdp_restore.plain_pt` gives)."""
    plain = getattr(dtype, "safetensors_name", None)
    if plain is not None:
        return plain
    try:
        return _torch_tables()[0][dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors") from None


def as_torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of ``dtype``: itself, or the one a dtype described without torch (anything with a
    ``safetensors_name``, as `fsdp_restore.plain_pt` gives) stands for (imports torch: only a cast asks)."""
    plain = getattr(dtype, "safetensors_name", None)
    return dtype if plain is None else _torch_tables()[1][plain]


class StoredDtype:
    """A tensor dtype described without torch: its torch name, its safetensors name and its item size. One instance
    per dtype (`STORED_DTYPES`; compared by identity, as torch's dtypes are). The torch-free readers
    (`fsdp_restore.plain_pt`) give their tensors these, and a cast between them needs no torch (`plain_cast`)."""

    def __init__(self, name: str, safetensors_name: str, itemsize: int, floating: bool) -> None:
        self.name, self.safetensors_name, self.itemsize, self.floating = name, safetensors_name, itemsize, floating

    def __str__(self) -> str:
        return f"torch.{self.name}"  # as str(torch.float32) reads

    __repr__ = __str__


# by torch's name: the dtypes a torch-free reader meets (those of torch's typed storages)
STORED_DTYPES = {name: StoredDtype(name, st_name, size, floating) for name, st_name, size, floating in [
    ("float32", "F32", 4, True), ("float64", "F64", 8, True), ("float16", "F16", 2, True),
    ("bfloat16", "BF16", 2, True), ("int64", "I64", 8, False), ("int32", "I32", 4, False),
    ("int16", "I16", 2, False), ("int8", "I8", 1, False), ("uint8", "U8", 1, False), ("bool", "BOOL", 1, False)]}
_BY_SAFETENSORS_NAME = {d.safetensors_name: d for d in STORED_DTYPES.values()}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}


def _spellings(text: str) -> tuple[str, str]:
    """A dtype's name as given (``"BF16"``, ``"torch.bfloat16"``: without torch's prefix) and as torch's attribute
    name where it is an alias (``"bf16"`` -> ``"bfloat16"``), else lowercased: the two ways a name is looked up."""
    key = text.strip().removeprefix("torch.")
    return key, _DTYPE_ALIASES.get(key.lower(), key.lower())


def stored_dtype(dtype: Any) -> StoredDtype | None:
    """The `StoredDtype` of ``dtype`` without importing torch: one itself (the table's own instance: dtypes are
    compared by identity), a torch dtype, or a name as `torch_dtype_from_string` reads it (``"bf16"``,
    ``"torch.bfloat16"``, ``"BF16"``); None for any other (complex, float8, unsigned above 8 bits: torch's alone)."""
    if isinstance(dtype, StoredDtype):
        return STORED_DTYPES.get(dtype.name)
    if not isinstance(dtype, str):  # a torch dtype prints as torch.<name>
        return STORED_DTYPES.get(str(dtype).removeprefix("torch.")) if type(dtype).__module__ == "torch" else None
    key, name = _spellings(dtype)
    return STORED_DTYPES.get(key) or _BY_SAFETENSORS_NAME.get(key) or STORED_DTYPES.get(name)


def torch_dtype_from_string(text: str) -> torch.dtype:
    """Parse ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``"BF16"`` into a torch dtype."""
    import torch

    key, name = _spellings(text)
    name_to_dtype = _torch_tables()[1]
    if key in name_to_dtype:
        return name_to_dtype[key]
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype '{text}' (try bf16, fp16, fp32 or fp64)")
    return dtype


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name used inside our JSON)."""
    return str(dtype).removeprefix("torch.")


class TensorEntry(NamedTuple):
    """Where one tensor's bytes live: ``file`` bytes ``[offset, offset + nbytes)``, row-major. (A named tuple:
    one is made per tensor each time a file is opened, several times cheaper than a frozen dataclass.)"""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute offset of the first byte in the file
    nbytes: int
    # fields, not properties computed from the shape: the read path asks for them per chunk of every tensor
    numel: int
    itemsize: int


@dataclass
class FileHeader:
    """A parsed and validated safetensors header."""

    path: Path
    data_start: int
    file_size: int
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)


TRUNCATED_FIX = "copy the file again, or convert or save it again from its source"  # what a file cut short needs


def open_file(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A descriptor of the checkpoint file ``path`` for reading, refused (`not_a_file`) unless it is a regular file.
    The open is non-blocking, so that a FIFO in the file's place opens at once instead of waiting for a writer;
    the descriptor is then made blocking again, since some file systems read O_NONBLOCK on each read as "do not
    wait for a lock" (Lustre). An open that would wait for a lease to be broken (an SMB oplock, an NFS
    delegation) is made again blocking, as a plain open waits for it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK, dir_fd=dir_fd)
    except BlockingIOError:
        fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_a_file(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(path: str | os.PathLike[str], fd: int | None = None) -> FileHeader:
    """Parse and validate the header of one safetensors file.

    Checks everything that can be checked without reading tensor bytes: header length, JSON, dtypes,
    shapes, that every tensor's byte count matches its shape, that offsets lie inside the file and
    neither overlap nor leave holes, and the header's own crc32 when it has one. Raises `FormatError`
    naming the file and the problem. With ``fd`` (open on ``path``; left open) the header is read through
    it, so that a reader that keeps ``fd`` for the data reads header and data from one file even if
    ``path`` is replaced meanwhile.
    """
    path = Path(path)
    own = fd is None
    try:
        if own:
            fd = open_file(path)
    except OSError as e:
        raise FormatError(path, f"cannot read: {e.strerror or e}") from None
    assert fd is not None
    try:
        if hasattr(os, "posix_fadvise"):
            # No readahead: a buffered read of the header would also pull in the first tensors' bytes,
            # which on a sharded restore belong to another rank (measured: +16 MB per file).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        file_size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise FormatError(path, f"file is {file_size} bytes, too short for a safetensors header"
                              " (truncated or not a safetensors file)")
        (n,) = struct.unpack("<Q", head)
        if head[:1] == b"\x80" and 2 <= head[1] <= 5 and n > file_size:  # pickle's PROTO opcode, then its version
            raise FormatError(path, "a plain pickle, not a safetensors file (its first bytes are pickle's), and nothing"
                              " here reads one (unpickling runs code): where you trust it, load it and write what it"
                              " holds with fsdp_restore.save (or torch.save, then fsdp-restore convert)")
        if n > MAX_HEADER_BYTES:
            raise FormatError(path, f"header length {n} exceeds the {MAX_HEADER_BYTES} byte limit"
                              " (corrupt or not a safetensors file)")
        if 8 + n > file_size:
            raise FormatError(path, f"header length {n} runs past the end of the {file_size} byte file"
                              f" (truncated?): {TRUNCATED_FIX}")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise FormatError(path, f"cannot read: {e.strerror or e}") from None
    finally:
        if own:
            os.close(fd)
    header = parse_json(raw, path, "header")
    if not isinstance(header, dict):
        raise FormatError(path, "header is not a JSON object")
    result = _validate_header(path, header, 8 + n, file_size)
    check_seal(head, raw, HEADER_SEAL_PREFIX, result.metadata.get(META_HEADER_CRC), path, "header",
               version=result.metadata.get(META_VERSION), source=result.metadata.get(META_SOURCE))
    return result


def _recorded_name(source: str | None) -> str | None:
    """The file name a recorded source identity (`provenance.source_identity`'s JSON) gives, if it parses."""
    try:
        name = json.loads(source).get("name") if source else None
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def _sealed_crc(head: bytes, body: bytes | memoryview, at: int) -> int:
    """crc32 of ``head + body`` with the 8 digits at ``body[at:at + 8]`` taken as ``"00000000"``."""
    view = memoryview(body)
    crc = zlib.crc32(head)
    crc = zlib.crc32(view[:at], crc)
    crc = zlib.crc32(b"0" * _SEAL_DIGITS, crc)
    return zlib.crc32(view[at + _SEAL_DIGITS:], crc)


def seal(head: bytes, body: bytes, prefix: bytes) -> bytes:
    """``body`` (a header's JSON text starting with ``prefix`` and 8 placeholder digits) with the digits set
    to its crc32, computed over ``head + body`` with the digits as ``"00000000"`` (FORMAT.md). ``head`` is
    the 8-byte length of a safetensors header, or ``b""`` for an index file."""
    assert body.startswith(prefix), "a sealed header starts with its crc32 field"
    at = len(prefix)
    digits = f"{_sealed_crc(head, body, at):08x}".encode()
    return body[:at] + digits + body[at + _SEAL_DIGITS:]


def check_seal(head: bytes, body: bytes, prefix: bytes, recorded: str | None, path: object, what: str, *,
               version: str | None = None, source: str | None = None, destination: object = None) -> None:
    """Refuse a header (or index) whose crc32 field does not match its bytes: it was edited (or damaged)
    after it was written. A header without the field passes only if it does not say it is of a format version
    that has one (a version-1 file, another tool's file): a sealed file whose field is gone was edited too.
    ``version``: the format version its metadata records; ``source``: the source identity it records (JSON),
    whose name the fix then gives; ``destination``: what to convert into (default ``path``)."""
    named = _recorded_name(source)
    sharded = destination is not None  # an index: a set of shards, which only --max-shard-size makes again
    fix = (f"it can change values (a learning rate, a step, a shape) without touching any tensor, so it is not"
           f" used; convert {f'its source ({named}, as it records)' if named else 'the source'} again with the"
           f" options of its first conversion (fsdp-restore convert {named or 'SRC'} {destination or path}"
           f"{' --max-shard-size SIZE' if sharded else ''} --force, plus --select or --dtype if it was converted"
           f" with them)")
    if recorded is None and not body.startswith(prefix):
        if version is None or not (version.isascii() and version.isdigit()) or int(version) < SEALED_SINCE_VERSION:
            return
        raise FormatError(path, f"{what} was modified after it was written (it says it is of format version"
                          f" {version}, which is sealed, but its '{META_HEADER_CRC}' field is gone); {fix}")
    if not body.startswith(prefix):
        raise FormatError(path, f"{what} was modified after it was written (it was rewritten: its"
                          f" '{META_HEADER_CRC}' field is no longer where the writer put it); {fix}")
    at = len(prefix)
    stored = bytes(body[at:at + _SEAL_DIGITS]).decode("ascii", "replace")
    actual = f"{_sealed_crc(head, body, at):08x}"
    if stored != actual or recorded != stored:
        raise FormatError(path, f"{what} was modified after it was written, or is corrupt (its crc32 is {actual},"
                          f" the recorded one {recorded if recorded is not None else stored}); {fix}")


def parse_json(raw: bytes | str, path: object, what: str) -> Any:
    """``json.loads`` whose every failure is a `FormatError`: invalid UTF-8 or JSON, nesting deep enough
    to exhaust the parser's recursion, integers of more digits than Python converts."""
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(path, f"{what} is not valid JSON ({e})") from None
    except RecursionError:
        raise FormatError(path, f"{what} is nested too deeply to be a checkpoint") from None
    except ValueError as e:  # e.g. an integer literal longer than sys.get_int_max_str_digits()
        raise FormatError(path, f"{what} is not usable JSON ({e})") from None


_new_entry = tuple.__new__  # `TensorEntry`'s fields as one tuple: half the cost of its keyword-checking __new__


def _bad_shape(path: Path, key: str, shape: object) -> NoReturn:
    raise FormatError(path, f"tensor '{key}': shape {str(shape)[:80]} is not a list of non-negative integers")


def _validate_header(path: Path, header: dict[str, Any], data_start: int, file_size: int) -> FileHeader:
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError(path, "__metadata__ must map strings to strings")
    data_size = file_size - data_start
    result = FileHeader(path=path, data_start=data_start, file_size=file_size, metadata=metadata)
    spans: list[tuple[int, int, str]] = []
    entries = result.entries
    name_to_dtype = _torch_tables()[1]
    for key, info in header.items():  # once per tensor each time a file is opened: kept to plain type tests
        if type(info) is not dict:
            raise FormatError(path, f"tensor '{key}': entry is not a JSON object")
        name = info.get("dtype")
        dtype = name_to_dtype.get(name) if type(name) is str else None
        if dtype is None:
            if len(key) == len("__metadata__") and sum(a != b for a, b in zip(key, "__metadata__")) <= 2:
                raise FormatError(path, f"the header is damaged: it holds '{key}' where safetensors writes"
                                  " '__metadata__' (a flipped bit in a copy or on a disk); copy the file again from"
                                  " where it was written")
            raise FormatError(path, f"tensor '{key}': unknown dtype {str(name)[:40]!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if type(shape) is not list:
            _bad_shape(path, key, shape)
        for dim in shape:  # (int exactly: bool, an int subclass, is not a size)
            if type(dim) is not int or dim < 0:
                _bad_shape(path, key, shape)
        if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
                or type(offsets[1]) is not int or offsets[0] < 0 or offsets[1] < 0):
            raise FormatError(path, f"tensor '{key}': data_offsets {str(offsets)[:80]} is not [begin, end]")
        begin, end = offsets
        numel, itemsize = prod(shape), dtype.itemsize
        expected = numel * itemsize
        if end - begin != expected:
            raise FormatError(path, f"tensor '{key}': holds {end - begin} bytes but dtype {info['dtype']} and shape"
                              f" {shape} need {expected}")
        if end > data_size:
            raise FormatError(path, f"tensor '{key}': data_offsets end {end} is past the data section"
                              f" ({data_size} bytes; file truncated?): {TRUNCATED_FIX}")
        spans.append((begin, end, key))
        entries[key] = _new_entry(TensorEntry, (key, path, dtype, tuple(shape), data_start + begin, end - begin, numel,
                                                itemsize))
    spans.sort()
    cursor = 0
    for begin, end, key in spans:
        if begin < cursor:
            raise FormatError(path, f"tensor '{key}': bytes [{begin}, {end}) overlap another tensor")
        if begin > cursor:
            raise FormatError(path, f"tensor '{key}': hole of {begin - cursor} bytes before it")
        cursor = end
    if cursor != data_size:
        raise FormatError(path, f"data section is {data_size} bytes but tensors cover {cursor}"
                          " (truncated, or trailing bytes)")
    return result


# The data section starts on a page boundary (the format allows the header to be padded with spaces). The
# kernel copies file bytes into memory at a speed that depends on where the two lie relative to each other
# within a page: several times slower in the 4K-aliasing band, slower whenever not 32-byte aligned
# (BENCHMARKS.md, "Where the memory lies"). Tensors whose sizes are multiples of 64 bytes, as in most models,
# then all lie at offsets aligned like the memory torch allocates for them.
DATA_ALIGNMENT = 4096


def build_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str], *, sealed: bool = True) -> tuple[bytes, dict[str, int]]:
    """Lay out tensors and serialise the header (8-byte length + JSON padded with spaces so that the data
    section starts on a `DATA_ALIGNMENT` boundary).

    Tensors are placed in order of decreasing itemsize (stable within a size) so that every
    tensor's offset is a multiple of its itemsize, as safetensors' own writer does; the format
    forbids padding holes. With ``sealed`` (the default) the header's own crc32 goes first in its
    metadata (`seal`); its length does not depend on any value's digits, so a writer can build the header
    with placeholder checksums, then again with the real ones, and patch it in place. Returns the header
    bytes and each key's offset inside the data section.
    """
    if any(key == "__metadata__" for key, _, _ in entries):  # the header's own field: the file would be unreadable
        raise ValueError("a tensor named '__metadata__' cannot be stored in safetensors (the header's metadata"
                         " field has that name): rename it")
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)
    if sealed:
        metadata = {META_HEADER_CRC: "0" * _SEAL_DIGITS, **{k: v for k, v in metadata.items() if k != META_HEADER_CRC}}
    body: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offsets: dict[str, int] = {}
    cursor = 0
    for i in order:
        key, dtype, shape = entries[i]
        nbytes = prod(shape) * dtype.itemsize
        body[key] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        offsets[key] = cursor
        cursor += nbytes
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % DATA_ALIGNMENT)
    head = struct.pack("<Q", len(text))
    return head + (seal(head, text, HEADER_SEAL_PREFIX) if sealed else text), offsets


def build_index(metadata: dict[str, str | int], weight_map: dict[str, str]) -> bytes:
    """The bytes of a sharded checkpoint's index json (Hugging Face's layout, indented as it writes it),
    sealed with its own crc32 first in its metadata (`seal`)."""
    body = {"metadata": {META_HEADER_CRC: "0" * _SEAL_DIGITS,
                         **{k: v for k, v in metadata.items() if k != META_HEADER_CRC}},
            "weight_map": weight_map}
    return seal(b"", json.dumps(body, indent=2).encode("utf-8"), INDEX_SEAL_PREFIX)


def read_index(path: Path, raw: bytes | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Read a Hugging Face style index json (its bytes ``raw`` when the caller read them already, through
    the descriptor it reads the shards' directory with); returns (metadata, key -> shard path).

    Shard names must stay inside the index's directory (no absolute paths, no ``..``). An index we wrote
    carries its own crc32, checked last (so that a broken index is reported for what is broken in it).
    """
    if raw is None:
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise FormatError(path, f"cannot read index: {e.strerror or e}") from None
    index = parse_json(raw, path, "index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise FormatError(path, "index has no 'weight_map' object")
    metadata = index.get("metadata", {})
    if not isinstance(metadata, dict):
        raise FormatError(path, "index 'metadata' is not an object")
    for key in (META_STRUCTURE, META_VERSION, META_SOURCE, META_HEADER_CRC, META_SET_ID):
        if key in metadata and not isinstance(metadata[key], str):
            raise FormatError(path, f"index metadata '{key}' is not a string")
    root = path.parent.resolve()
    weight_map: dict[str, Path] = {}
    for key, name in index["weight_map"].items():
        if not isinstance(name, str) or not name or Path(name).is_absolute():
            raise FormatError(path, f"key '{key}': shard name {name!r} is not a relative file name")
        shard = (root / name).resolve()
        if shard.parent != root and root not in shard.parents:
            raise FormatError(path, f"key '{key}': shard {name!r} points outside the index's directory")
        weight_map[key] = shard
    check_seal(b"", raw, INDEX_SEAL_PREFIX, metadata.get(META_HEADER_CRC), path, "index (the header of a sharded"
               " checkpoint)", version=metadata.get(META_VERSION), source=metadata.get(META_SOURCE),
               destination=Path(path).parent)
    return metadata, weight_map


# ---- what a path holds, by content (never by its name) ---------------------------------------------------------

SAFETENSORS = "safetensors"
TORCH_ZIP = "torch.save zip"
TORCH_LEGACY = "torch.save legacy pickle"
JSON_TEXT = "json"
DIRECTORY = "directory"
MISSING = "missing"
UNKNOWN = "unknown"


_LEGACY_MAGIC = b"\x8a\x0a" + 0x1950A86A20F9469CFC6C.to_bytes(10, "little")  # LONG1 of torch's MAGIC_NUMBER
_LEGACY_TEXT_MAGIC = b"L%dL\n" % 0x1950A86A20F9469CFC6C  # the same, by protocols 0 and 1
SNIFF_BYTES = 32  # what `sniff` reads of a file


def is_legacy_torch_save(head: bytes) -> bool:
    """Whether ``head`` (a file's first `SNIFF_BYTES`) starts a legacy (pre-zip) ``torch.save`` file: a pickle
    whose first object is torch's magic number, as torch writes it first (protocols 0 and 1 as text, 2-5 after
    PROTO and, for 4 and 5, a FRAME). Any other pickle, or garbage that starts with PROTO, is not one."""
    if head.startswith(_LEGACY_TEXT_MAGIC):
        return True
    if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    body = head[2:]
    if body[:1] == b"\x95":  # FRAME and its 8-byte length (protocols 4 and 5)
        body = body[9:]
    return body[:len(_LEGACY_MAGIC)] == _LEGACY_MAGIC


def sniff(head: bytes, file_size: int) -> str:
    """What a file is from its first `SNIFF_BYTES` bytes (and its size): a safetensors file (8-byte little-endian
    header length that fits in the file, then ``{``), a ``torch.save`` file (a zip since torch 1.6; a pickle
    before, `is_legacy_torch_save`), JSON text (an index), or `UNKNOWN`."""
    if len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= file_size - 8:
        return SAFETENSORS
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return TORCH_ZIP
    if is_legacy_torch_save(head):
        return TORCH_LEGACY
    if head.lstrip()[:1] == b"{":
        return JSON_TEXT
    return UNKNOWN


def detect(path: str | os.PathLike[str]) -> str:
    """What ``path`` holds, by content: `DIRECTORY`, `MISSING`, or what `sniff` says of a file. The one
    detection every entry point uses (load, open_checkpoint and so inspect, verify and restore)."""
    path = Path(path)
    if path.is_dir():
        return DIRECTORY
    try:
        fd = open_file(path)
    except FileNotFoundError:
        return MISSING
    except (OSError, FormatError):
        return UNKNOWN  # unreadable, or a pipe or a device: the reader that opens it says why
    try:
        return sniff(os.pread(fd, SNIFF_BYTES, 0), os.fstat(fd).st_size)
    except OSError:
        return UNKNOWN
    finally:
        os.close(fd)
