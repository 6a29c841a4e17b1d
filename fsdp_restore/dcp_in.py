"""PyTorch Distributed Checkpoint (DCP) directories in: ``.metadata`` + ``*.distcp``, read safely.

``dcp.save`` writes each rank's chunks of every tensor into ``*.distcp`` files (each chunk a small
``torch.save`` archive at a byte range that the metadata records) and every other value as pickled
bytes. `read_dcp` rebuilds the nested object as ``dcp.save`` was given it (the planner's own path of
every value; a path component that is an integer is a list index, as DCP unflattens it), with each
tensor a placeholder whose reader assembles any range of elements from the chunks that hold them.

Nothing is unpickled beyond data: the ``.metadata`` pickle is read by an unpickler that knows only
DCP's metadata classes, ``torch.Size``, dtypes and paths; the chunks and values through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import pickle
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .errors import FormatError, first_line, refused_global
from .write import HeldInPieces, scratch, stand_in

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                               "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                               "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}

_LAST_CHUNK = threading.local()


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata objects and nothing else (no callable can be reached from the file)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def _metadata(path: Path) -> Any:
    try:
        with open(path / ".metadata", "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file, or a refused global
        raise FormatError(path / ".metadata", f"cannot read DCP metadata without executing its pickle ({e})") from None
    if not hasattr(md, "state_dict_metadata") or not hasattr(md, "storage_data"):
        raise FormatError(path / ".metadata", "not DCP metadata")
    return md


class _Chunks:
    """The chunks of one stored tensor, each loaded when first needed (one chunk cached per thread)."""

    def __init__(self, root: Path, fqn: str, meta: Any, storage: dict[tuple[str, tuple[int, ...]], Any]) -> None:
        self.root, self.fqn = root, fqn
        self.shape = tuple(meta.size)
        self.dtype = meta.properties.dtype
        self.strides = [math.prod(self.shape[d + 1:]) for d in range(len(self.shape))]
        self.chunks = []
        for index, chunk in enumerate(meta.chunks):
            info = storage.get((fqn, tuple(chunk.offsets)))
            if info is None:
                raise FormatError(root / ".metadata", f"tensor '{fqn}': no stored bytes for its chunk at"
                                  f" {list(chunk.offsets)}")
            self.chunks.append((tuple(chunk.offsets), tuple(chunk.sizes), info))

    def _load(self, i: int) -> torch.Tensor:
        # one chunk per thread, whichever tensor it belongs to: a writer thread reads a tensor's elements in
        # order, so consecutive ranges hit the same chunk; memory stays at threads x one chunk
        cached = getattr(_LAST_CHUNK, "entry", None)
        if cached is not None and cached[0] is self and cached[1] == i:  # (this object, not its id: a later
            return cached[2]  # reader may take a freed one's address, and would get its chunk)
        _LAST_CHUNK.entry = None
        info = self.chunks[i][2]
        path = self.root / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            tensor = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001
            raise FormatError(path, f"tensor '{self.fqn}': cannot read the chunk at byte {info.offset} ({e})") from None
        tensor = tensor.reshape(self.chunks[i][1]).contiguous()
        _LAST_CHUNK.entry = (self, i, tensor)
        return tensor

    def read(self, first: int, count: int) -> torch.Tensor:
        out = scratch(self.dtype, count)
        end = first + count
        filled = 0
        for i, (offsets, sizes, _) in enumerate(self.chunks):
            filled += self._copy_chunk(i, offsets, sizes, first, end, out)
        if filled != count:
            raise FormatError(self.root, f"tensor '{self.fqn}': its chunks cover {filled} of the {count} elements"
                              f" [{first}, {end})")
        return out

    def _copy_chunk(self, i: int, offsets: tuple[int, ...], sizes: tuple[int, ...], first: int, end: int,
                    out: torch.Tensor) -> int:
        """Copy the part of chunk ``i`` that falls in global flat range [first, end) into ``out``."""
        ndim = len(self.shape)
        if ndim == 0:
            if first == 0 and end >= 1:
                out[0] = self._load(i).reshape(())
                return 1
            return 0
        # rows: the chunk's runs of whole trailing dimensions are contiguous in the full tensor
        k = 0
        for d in range(ndim - 1, -1, -1):
            if sizes[d] != self.shape[d] or offsets[d] != 0:
                k = d
                break
        run = math.prod(sizes[k:])
        lead = [range(offsets[d], offsets[d] + sizes[d]) for d in range(k)]
        base = offsets[k] * self.strides[k]
        copied = 0
        starts = [sum(j * self.strides[d] for d, j in enumerate(idx)) + base for idx in _product(lead)]
        flat = None
        for r, start in enumerate(starts):
            lo, hi = max(start, first), min(start + run, end)
            if lo >= hi:
                continue
            flat = self._load(i).reshape(-1) if flat is None else flat
            out[lo - first:hi - first] = flat[r * run + lo - start:r * run + hi - start]
            copied += hi - lo
        return copied


def _product(ranges: list[range]):
    from itertools import product

    return product(*ranges) if ranges else [()]


def read_dcp(path: str | os.PathLike[str], *, safe_globals: Sequence[Any] = (), trust_pickle: bool = False
             ) -> tuple[Any, HeldInPieces]:
    """The object ``dcp.save`` was given, with placeholders for its tensors (see the module's doc), and
    ``{placeholder.data_ptr(): (meta tensor, reader)}``. ``safe_globals``: classes the values' pickles may build
    beyond torch's own (numpy arrays and RNG states, argparse Namespaces); ``trust_pickle``: run them instead."""
    root = Path(path)
    md = _metadata(root)
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    storage = {(k.fqn, tuple(k.offset) if k.offset is not None else ()): v for k, v in md.storage_data.items()}
    readers: HeldInPieces = {}
    values: list[tuple[tuple[Any, ...], Any]] = []
    for fqn, meta in md.state_dict_metadata.items():
        where = tuple(paths.get(fqn, (fqn,)))
        if type(meta).__name__ == "TensorStorageMetadata":
            chunks = _Chunks(root, fqn, meta, storage)
            values.append((where, stand_in(readers, chunks.shape, chunks.dtype, chunks.read)))
        else:
            info = next((v for (name, _), v in storage.items() if name == fqn), None)
            if info is None:
                raise FormatError(root / ".metadata", f"value '{fqn}' has no stored bytes")
            try:
                with open(root / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    blob = f.read(info.length)
            except OSError as e:
                raise FormatError(root / info.relative_path, f"cannot be read ({e.strerror or e}), and the checkpoint's"
                                  f" .metadata says it holds the value '{fqn}': copy the whole checkpoint directory"
                                  ) from None
            values.append((where, _value(root / info.relative_path, fqn, blob, safe_globals, trust_pickle)))
    return _unflatten(values), readers


def _value(path: Path, fqn: str, blob: bytes, safe_globals: Sequence[Any], trust_pickle: bool) -> Any:
    """A value DCP pickled (not a tensor), loaded without running code unless ``trust_pickle``."""
    try:
        if trust_pickle:
            return torch.load(io.BytesIO(blob), weights_only=False)
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:  # noqa: BLE001
        refused = refused_global(f"{path}: the value '{fqn}'", e)
        if refused is not None:
            raise refused from None
        raise FormatError(path, f"value '{fqn}' cannot be read safely ({first_line(e)})") from None


def _unflatten(values: list[tuple[tuple[Any, ...], Any]]) -> Any:
    """Nested containers from (path, value) pairs; integer path components are list indices (DCP's rule)."""
    root: dict[Any, Any] = {}
    for where, value in values:
        node = root
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = value

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
            return [build(node[i]) for i in range(len(node))]
        return {k: build(v) for k, v in node.items()}

    return build(root)
