"""``.pt`` -> safetensors, streaming: mmap the input, never hold the model in memory, no pickle out.

Also home of `load_pt`, the safe way to open a ``torch.save`` file: ``weights_only=True`` plus an
explicit allowlist (numpy arrays and scalars, argparse.Namespace, pathlib paths). Anything else in
the pickle is refused *before* unpickling, unless the caller opts in with ``trust_pickle``.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import os
import pathlib
import re
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import FormatError, UnsafePickleError
from .flatten import flatten, iter_nodes_with_keys
from .format import META_SOURCE, torch_dtype_from_string, torch_dtype_name
from .measure import PeakAnonMemory, Stopwatch
from .provenance import source_identity
from .write import ProgressFn, TensorJob, default_threads, write_safetensors

_CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_GLOB = re.compile(r"[*?\[]")


def cast_target(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The ``--dtype`` of a conversion: floating targets only. A cast to an integer type turns weights into
    zeros and wraps counters (301 -> 45 in int8); nothing in a checkpoint is meant to be stored that way."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        dtype = torch_dtype_from_string(dtype)
    if dtype not in _CASTABLE:
        raise ValueError(f"dtype {str(dtype).removeprefix('torch.')} is not a floating target: --dtype takes bf16,"
                         " fp16, fp32 or fp64 (casting to an integer or bool type would silently change values)")
    return dtype


def default_cast_scope(structure: dict[str, Any]) -> list[str]:
    """What a ``--dtype`` cast applies to by default: the model's weights. That is the ``model`` subtree of a
    training checkpoint (``{"model": ..., "optim": ...}``), and everything in a plain weights file.
    Optimizer state keeps its precision: Adam's moments and step counter in bf16 change the run."""
    root = structure.get("root")
    if isinstance(root, dict) and root.get("type") in ("dict", "OrderedDict") and any(
            k == "model" and isinstance(v, dict) and v.get("type") != "tensor" for k, v in root["items"]):
        return ["model.*"]
    return ["*"]


def _allowlist() -> list[Any]:
    """Globals a weights_only unpickler may resolve in a checkpoint: data types, never callables
    with side effects."""
    core = getattr(np, "_core", None) or np.core
    allowed: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype,
                          argparse.Namespace, pathlib.PosixPath, pathlib.WindowsPath,
                          pathlib.PurePosixPath, pathlib.PureWindowsPath]
    dtypes_mod = getattr(np, "dtypes", None)
    if dtypes_mod is not None:
        allowed += [getattr(dtypes_mod, n) for n in dir(dtypes_mod) if n.endswith("DType")]
    return allowed


def _global_name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _import_global(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import allowed global '{name}': {e}") from None


def load_pt(path: str | os.PathLike[str], *, trust_pickle: bool = False, allow_globals: Sequence[str] = (),
            mmap: bool = True) -> Any:
    """Load a ``torch.save`` file without executing untrusted code.

    Zip-format files are memory-mapped (tensor bytes are read lazily). Globals outside the
    allowlist (plus ``allow_globals``, given as ``"module.Name"``) raise `UnsafePickleError` before
    anything is unpickled. ``trust_pickle=True`` runs the pickle as plain ``torch.load`` would: only
    for files you trust. Legacy (non-zip) files cannot be memory-mapped and load fully, with a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise FormatError(path, "no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    is_zip = zipfile.is_zipfile(path)
    if magic == b"PK\x03\x04" and not is_zip:
        raise FormatError(path, "zip archive is truncated or corrupt (no central directory); re-copy the file")
    extra = [_import_global(n) for n in allow_globals]
    if not trust_pickle:
        if is_zip:
            try:
                needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
            except Exception as e:  # a corrupt zip or pickle stream
                raise FormatError(path, f"cannot read the torch.save archive ({type(e).__name__}: {e})") from None
            allowed = {_global_name(o) for o in _allowlist() + extra}
            # numpy moved numpy.core to numpy._core; pickles name either.
            refused = [g for g in needed if g not in allowed and g.replace("numpy.core.", "numpy._core.") not in allowed]
            if refused:
                raise UnsafePickleError(
                    f"{path}: the pickle references {', '.join(sorted(refused))}, which loading would import and"
                    " may call (arbitrary code execution). If you trust this file, pass --trust-pickle"
                    " (trust_pickle=True), or allow data-only classes with --allow-global MODULE.NAME")
    else:
        warnings.warn(f"{path}: trust_pickle=True executes the file's pickle; only do this for files you trust",
                      stacklevel=2)
    if not is_zip:
        warnings.warn(f"{path} is a legacy (non-zip) torch.save file: it cannot be memory-mapped and is loaded"
                      " fully into memory; re-save it with a current torch for streaming", stacklevel=2)
    kwargs: dict[str, Any] = {"map_location": "cpu", "mmap": mmap and is_zip}
    try:
        if trust_pickle:
            return torch.load(path, weights_only=False, **kwargs)
        with torch.serialization.safe_globals(_allowlist() + extra):
            return torch.load(path, weights_only=True, **kwargs)
    except (UnsafePickleError, FormatError):
        raise
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Unsupported global" in str(e) or "weights_only" in str(e):
            raise UnsafePickleError(f"{path}: refused by the safe unpickler ({text}); pass --trust-pickle if you"
                                    " trust this file") from None
        raise FormatError(path, f"cannot load ({type(e).__name__}: {text}); truncated or corrupt?") from None


def select_subtree(obj: Any, select: str | None) -> Any:
    """The value at dotted path ``select`` inside ``obj`` (dict keys, list indices, attributes)."""
    if not select:
        return obj
    node = obj
    for i, part in enumerate(select.split(".")):
        if isinstance(node, dict):
            key = part if part in node else int(part) if part.lstrip("-").isdigit() and int(part) in node else None
            if key is None:
                raise KeyError(f"select='{select}': no key '{part}' at '{'.'.join(select.split('.')[:i]) or '<root>'}'"
                               f" (keys there: {', '.join(map(str, list(node)[:10]))})")
            node = node[key]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, argparse.Namespace) and hasattr(node, part):
            node = getattr(node, part)
        else:
            raise KeyError(f"select='{select}': cannot descend into {type(node).__name__} with '{part}'")
    return node


def parse_size(text: str | int | None) -> int | None:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912; ints pass through."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise ValueError(f"cannot parse size '{text}' (examples: 5GB, 512MiB, 1000000)")
    base = 1024 if m.group(3) == "IB" else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


@dataclass
class ConvertReport:
    """What `convert` did and what it cost."""

    src: str
    dst: str
    files: list[str]
    tensors: int
    nbytes: int
    cast_tensors: int
    seconds: float
    peak_anon_bytes: int
    threads: int
    checksums: dict[str, str] = field(default_factory=dict, repr=False)
    cast: dict[str, dict[str, Any]] = field(default_factory=dict)  # by group, see `cast_groups`

    @property
    def throughput(self) -> float:
        return self.nbytes / self.seconds if self.seconds else 0.0


def plan_jobs(tensors: dict[str, torch.Tensor], structure: dict[str, Any], dtype: torch.dtype | None,
              cast_include: Sequence[str] | None = None, cast_exclude: Sequence[str] = ()) -> list[TensorJob]:
    """One job per stored tensor, with the output dtype chosen by the cast policy.

    Only floating tensors of tensor nodes are cast (never numpy arrays or bytes, which must come back as
    they were), only when their key matches an include pattern (default: `default_cast_scope`) and no
    exclude pattern, and a 0-dim tensor (a step counter, a scalar) only when a pattern names it exactly.
    """
    dtype = cast_target(dtype)
    tensor_keys = {node["key"] for _, node in iter_nodes_with_keys(structure["root"]) if node["type"] == "tensor"}
    include = list(cast_include) if cast_include is not None else default_cast_scope(structure)

    def out_dtype(key: str, t: torch.Tensor) -> torch.dtype:
        if dtype is None or t.dtype not in _CASTABLE or key not in tensor_keys:
            return t.dtype
        if any(fnmatch.fnmatchcase(key, p) for p in cast_exclude):
            return t.dtype
        named = [p for p in include if fnmatch.fnmatchcase(key, p)]
        if not named or (t.dim() == 0 and not any(p == key and not _GLOB.search(p) for p in named)):
            return t.dtype
        return dtype

    return [TensorJob(key, t, out_dtype(key, t)) for key, t in tensors.items()]


def cast_groups(casts: dict[str, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """``{key: (from, to)}`` grouped by the key's top-level name: ``{group: {"tensors": n, "casts": {"f -> t": n}}}``."""
    groups: dict[str, dict[str, Any]] = {}
    for key, (before, after) in casts.items():
        g = groups.setdefault(key.split(".", 1)[0], {"tensors": 0, "casts": {}})
        g["tensors"] += 1
        label = f"{before} -> {after}"
        g["casts"][label] = g["casts"].get(label, 0) + 1
    return groups


def save(obj: Any, path: str | os.PathLike[str], *, max_shard_size: int | str | None = None,
         dtype: torch.dtype | None = None, threads: int | None = None, force: bool = True,
         on_unsupported: str = "error", progress: ProgressFn | None = None) -> list[Path]:
    """Write any supported nested object (see `flatten`) to ``path``; returns the files written."""
    tensors, structure = flatten(obj, on_unsupported=on_unsupported)  # type: ignore[arg-type]
    jobs = plan_jobs(tensors, structure, dtype)
    return write_safetensors(path, jobs, structure_json=json.dumps(structure, separators=(",", ":")),
                             max_shard_size=parse_size(max_shard_size), threads=threads, force=force,
                             progress=progress).paths


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
            cast_include: Sequence[str] | None = None, cast_exclude: Sequence[str] = (),
            max_shard_size: int | str | None = None, select: str | None = None, threads: int | None = None,
            force: bool = False, trust_pickle: bool = False, allow_globals: Sequence[str] = (),
            on_unsupported: str = "error", progress: Callable[[int, int], None] | None = None) -> ConvertReport:
    """Stream a ``torch.save`` file into our safetensors format and report what it cost.

    The input is memory-mapped (``torch.load(mmap=True, weights_only=True)``); tensor bytes go
    from the mapping to the output file in 16 MB chunks on ``threads`` threads, so anonymous memory
    stays near ``threads x 32 MB``. ``select`` keeps one subtree (``"model"`` writes the weights
    with plain keys a ``load_state_dict`` accepts). ``progress(done_bytes, total_bytes)`` is
    called as data is written.

    ``dtype`` (bf16, fp16, fp32, fp64) casts the model's floating weights (`default_cast_scope`); optimizer
    state and 0-dim values keep their dtype unless ``cast_include`` patterns name them (a 0-dim tensor
    only by its exact key). ``report.cast`` lists what was cast, by group.
    """
    dtype = cast_target(dtype)
    if not Path(src).is_file():
        raise FormatError(src, "no such file")
    if Path(dst).exists() and not force:
        raise FileExistsError(f"{dst} already exists; pass force=True (CLI: --force) to replace it")
    threads = threads or default_threads()
    with PeakAnonMemory() as mem, Stopwatch() as clock:
        identity = source_identity(src)  # before reading: a source rewritten meanwhile will not match it
        obj = select_subtree(load_pt(src, trust_pickle=trust_pickle, allow_globals=allow_globals), select)
        tensors, structure = flatten(obj, on_unsupported=on_unsupported)  # type: ignore[arg-type]
        jobs = plan_jobs(tensors, structure, dtype, cast_include, cast_exclude)
        total = sum(j.nbytes for j in jobs)
        casts = {j.key: (torch_dtype_name(j.source.dtype), torch_dtype_name(j.dtype)) for j in jobs
                 if j.dtype != j.source.dtype}
        done = [0]

        def on_bytes(n: int) -> None:
            done[0] += n  # approximate under threads; only drives a progress bar
            if progress:
                progress(done[0], total)

        result = write_safetensors(dst, jobs, structure_json=json.dumps(structure, separators=(",", ":")),
                                   max_shard_size=parse_size(max_shard_size), threads=threads, force=force,
                                   progress=on_bytes, metadata={META_SOURCE: json.dumps(identity)})
        del obj, tensors, jobs
    return ConvertReport(src=str(src), dst=str(dst), files=[str(p) for p in result.paths],
                         tensors=len(result.checksums), nbytes=result.nbytes,
                         cast_tensors=len(casts), cast=cast_groups(casts),
                         seconds=clock.seconds, peak_anon_bytes=mem.peak, threads=threads,
                         checksums=result.checksums)
