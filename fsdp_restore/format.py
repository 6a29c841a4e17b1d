"""The on-disk format: safetensors files plus our metadata keys (see FORMAT.md).

This module owns the dtype table, the metadata key names and a strict header parser. The parser is
ours rather than `safe_open` because the restore path needs exact byte offsets for positional
reads, and because every malformed header must become a `FormatError` naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import torch

from .errors import FormatError

FORMAT_VERSION = "1"

# Metadata keys in the safetensors header (``__metadata__``, str -> str) and in the index json.
META_FORMAT = "format"  # "pt", as Hugging Face writes it
META_VERSION = "fsdp_restore.format_version"
META_STRUCTURE = "fsdp_restore.structure"  # JSON of the nested object, see flatten.py
META_CHECKSUMS = "fsdp_restore.checksums"  # JSON {key: 8 hex digits of crc32}
META_CAST = "fsdp_restore.cast"  # JSON {key: original dtype name} for tensors cast on conversion
META_SOURCE = "fsdp_restore.source"  # JSON {name, size, mtime_ns, fingerprint} of the converted .pt (provenance.py)

INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_INDEX_NAME = "model.safetensors.index.json"

# safetensors refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _attr, _name in [
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
]:
    if hasattr(torch, _attr):
        DTYPE_TO_NAME[getattr(torch, _attr)] = _name
NAME_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors") from None


def torch_dtype_from_string(text: str) -> torch.dtype:
    """Parse ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``"BF16"`` into a torch dtype."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32", "fp64": "float64", "double": "float64"}
    key = text.strip().removeprefix("torch.")
    if key in NAME_TO_DTYPE:
        return NAME_TO_DTYPE[key]
    key = aliases.get(key.lower(), key.lower())
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype '{text}' (try bf16, fp16 or fp32)")
    return dtype


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name used inside our JSON)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: ``file`` bytes ``[offset, offset + nbytes)``, row-major."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute offset of the first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass
class FileHeader:
    """A parsed and validated safetensors header."""

    path: Path
    data_start: int
    file_size: int
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Parse and validate the header of one safetensors file.

    Checks everything that can be checked without reading tensor bytes: header length, JSON, dtypes,
    shapes, that every tensor's byte count matches its shape, and that offsets lie inside the file
    and neither overlap nor leave holes. Raises `FormatError` naming the file and the problem.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise FormatError(path, f"cannot read: {e.strerror or e}") from None
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
        if n > MAX_HEADER_BYTES:
            raise FormatError(path, f"header length {n} exceeds the {MAX_HEADER_BYTES} byte limit"
                              " (corrupt or not a safetensors file)")
        if 8 + n > file_size:
            raise FormatError(path, f"header length {n} runs past the end of the {file_size} byte file"
                              " (truncated?)")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise FormatError(path, f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    header = parse_json(raw, path, "header")
    if not isinstance(header, dict):
        raise FormatError(path, "header is not a JSON object")
    return _validate_header(path, header, 8 + n, file_size)


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


def _is_int(x: Any) -> bool:
    return type(x) is int  # bool is an int subclass: true/false are not sizes


def _validate_header(path: Path, header: dict[str, Any], data_start: int, file_size: int) -> FileHeader:
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError(path, "__metadata__ must map strings to strings")
    data_size = file_size - data_start
    result = FileHeader(path=path, data_start=data_start, file_size=file_size, metadata=metadata)
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        where = f"tensor '{key}'"
        if not isinstance(info, dict):
            raise FormatError(path, f"{where}: entry is not a JSON object")
        name = info.get("dtype")
        dtype = NAME_TO_DTYPE.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise FormatError(path, f"{where}: unknown dtype {str(name)[:40]!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise FormatError(path, f"{where}: shape {str(shape)[:80]} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_int(o) and o >= 0 for o in offsets)):
            raise FormatError(path, f"{where}: data_offsets {str(offsets)[:80]} is not [begin, end]")
        begin, end = offsets
        expected = prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise FormatError(path, f"{where}: holds {end - begin} bytes but dtype {info['dtype']} and shape"
                              f" {shape} need {expected}")
        if end > data_size:
            raise FormatError(path, f"{where}: data_offsets end {end} is past the data section"
                              f" ({data_size} bytes; file truncated?)")
        spans.append((begin, end, key))
        result.entries[key] = TensorEntry(key, path, dtype, tuple(shape), data_start + begin, end - begin)
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


def build_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """Lay out tensors and serialise the header (8-byte length + JSON padded to 8 bytes).

    Tensors are placed in order of decreasing itemsize (stable within a size) so that every
    tensor's offset is a multiple of its itemsize, as safetensors' own writer does; the format
    forbids padding holes. Returns the header bytes and each key's offset inside the data section.
    """
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)
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
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def read_index(path: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """Read a Hugging Face style index json; returns (metadata, key -> shard path).

    Shard names must stay inside the index's directory (no absolute paths, no ``..``).
    """
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
    for key in (META_STRUCTURE, META_VERSION, META_SOURCE):
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
    return metadata, weight_map
