"""What a conversion writes, whatever it reads: the cast policy, the jobs, the report.

Shared by every source of a conversion (a ``torch.save`` file, a DeepSpeed ZeRO directory, a DCP
directory): each turns its input into ``(tensors, structure)`` (and, for tensors assembled from
pieces of several files, a reader per key), and `write_converted` casts, writes and reports.
"""

from __future__ import annotations

import fnmatch
import json
import numbers
import operator
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .flatten import holds_model_subtree, is_optimizer_state_dict, iter_nodes_with_keys
from .format import StoredDtype, as_torch_dtype, stored_dtype, torch_dtype_from_string, torch_dtype_name
from .share import Share
from .source_crc import Archive, ArchiveFile, SourceCrcs, plan_runs_check, plan_source_check
from .write import Location, Reader, TensorJob, write_safetensors

if TYPE_CHECKING:
    import torch

_GLOB = re.compile(r"[*?\[]")


_CASTABLE = ("float64", "float32", "float16", "bfloat16")  # the floating dtypes a conversion casts to and from


def cast_target(dtype: torch.dtype | StoredDtype | str | None) -> StoredDtype | None:
    """The ``--dtype`` of a conversion, described without torch (`format.StoredDtype`: a cast between two dtypes a
    torch-free reader gives needs no torch, `plain_cast`): floating targets only. A cast to an integer type turns
    weights into zeros and wraps counters (301 -> 45 in int8); nothing in a checkpoint is meant to be stored that
    way."""
    if dtype is None:
        return None
    described = stored_dtype(dtype)
    if described is None and isinstance(dtype, str):  # not one of ours: torch's name for it, or its error
        dtype = torch_dtype_from_string(dtype)
    if described is None or described.name not in _CASTABLE:
        name = described.name if described is not None else str(dtype).removeprefix("torch.")
        why = ("a float8 type holds too few values and too small a range for weights and optimizer state: every"
               " value would round, and large ones overflow" if name.startswith("float8") else
               "casting to an integer, bool or complex type would silently change values")
        raise ValueError(f"dtype {name} is not a target --dtype takes: bf16, fp16, fp32 or fp64 ({why})")
    return described


def default_cast_scope(structure: dict[str, Any]) -> list[str]:
    """What a ``--dtype`` cast applies to by default: the model's weights. That is the ``model`` subtree of a
    training checkpoint (``{"model": ..., "optim": ...}``), and everything else in other files but the tensors of an
    optimizer's state (`optimizer_state_keys`). Optimizer state keeps its precision: Adam's moments and step counter
    in bf16 change the run."""
    return ["model.*"] if holds_model_subtree(structure) else ["*"]


def optimizer_state_keys(structure: dict[str, Any]) -> set[str]:
    """The stored keys of the tensors held by an optimizer's state dict alone (`flatten.is_optimizer_state_dict`)
    wherever it lies: the file itself (an ``optimizer.pt``
    saved alone, as the Hugging Face Trainer does), or a subtree (Lightning's ``optimizer_states``, a run's own
    layout). A default ``--dtype`` cast leaves them as they are. A tensor the weights hold too (stored once, under
    one of its names) is not among them: it is a weight."""
    # a walk of its own, not flatten.iter_nodes (which joins every node's dotted path): a quarter of the time on a
    # checkpoint of 20,000 tensors, and no path is needed here
    inside: set[str] = set()
    outside: set[str] = set()
    stack = [(structure.get("root"), False)]
    while stack:
        node, in_optimizer = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind == "tensor" and "key" in node:
            (inside if in_optimizer else outside).add(node["key"])
        elif kind in ("dict", "OrderedDict", "Namespace"):
            in_optimizer = in_optimizer or is_optimizer_state_dict(node)
            stack.extend((v, in_optimizer) for _, v in node.get("items", ()))
        elif kind in ("list", "tuple", "set", "frozenset"):
            stack.extend((v, in_optimizer) for v in node.get("items", ()))
    return inside - outside


def parse_size(text: str | int | None) -> int | None:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912; ints pass through."""
    if text is None:
        return None
    if isinstance(text, bool):  # (True would be 1 byte)
        raise TypeError(f"a size must be a number of bytes or a string such as '5GB', not {text!r}")
    if isinstance(text, numbers.Integral):  # an int, numpy's ints
        return operator.index(text)
    if isinstance(text, float) and text.is_integer():  # 5e9
        return int(text)
    if not isinstance(text, str):
        raise TypeError(f"a size must be a number of bytes or a string such as '5GB', not {text!r}")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?)(I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"cannot parse size '{text}' (examples: 5GB, 512MiB, 1000000)")
    base = 1024 if m.group(3) == "IB" else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def shard_size_argument(max_shard_size: str | int | None) -> int | None:
    """The ``max_shard_size=`` of a public entry point, checked at the door: None (one file) or a size
    `parse_size` reads that is at least one byte, else a `ValueError` naming it (a `TypeError` for a value that is
    no size at all, such as True)."""
    size = parse_size(max_shard_size)
    if size is not None and size <= 0:
        raise ValueError(f"max_shard_size must be positive, not {max_shard_size!r}")
    return size


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
    # what was checked of the source archive's own crc32s (`source_crc`); None for a directory of several files
    source_crcs: SourceCrcs | None = field(default=None, repr=False)

    @property
    def throughput(self) -> float:
        return self.nbytes / self.seconds if self.seconds else 0.0


@dataclass
class SourceRecords:
    """A ``torch.save`` file a conversion reads (for `write_converted`): its ``archive`` as parsed once (None where
    it is not one laid out as torch.save's; ``unchecked`` then says why), where each converted tensor's storage
    record starts (``storage_at``; ``every_storage`` where that could not be told: all are checked), and how many
    small records were checked already (`source_crc.check_small_records`)."""

    src: str | os.PathLike[str]
    archive: Archive | None
    storage_at: dict[str, int] = field(default_factory=dict)
    every_storage: bool = False
    small_checked: int = 0
    unchecked: SourceCrcs | None = None


@dataclass
class SourceFiles:
    """The ``torch.save`` files of a checkpoint directory a conversion reads in runs of bytes (for
    `write_converted`: a ZeRO checkpoint's, each tensor runs of several files), named ``label`` in errors."""

    label: str
    files: list[ArchiveFile]


def plan_jobs(tensors: dict[str, torch.Tensor], structure: dict[str, Any], dtype: torch.dtype | StoredDtype | None,
              cast_include: Sequence[str] | None = None, cast_exclude: Sequence[str] = ()) -> list[TensorJob]:
    """One job per stored tensor, with the output dtype chosen by the cast policy.

    Only floating tensors of tensor nodes are cast (never numpy arrays or bytes, which must come back as
    they were), only when their key matches an include pattern (default: `default_cast_scope`) and no
    exclude pattern, and a 0-dim tensor (a step counter, a scalar) only when a pattern names it exactly.
    """
    dtype = cast_target(dtype)
    # Said, not refused: one config serves checkpoints that hold an optimizer's state and weights files that do not
    if dtype is None and (cast_include is not None or cast_exclude):
        warnings.warn("cast_include / cast_exclude choose what a dtype cast (--dtype) applies to; without a dtype they"
                      " change nothing", stacklevel=3)
    # every name a stored tensor has in the checkpoint: its key, and the path of each tied alias stored as it (a
    # pattern may name the tensor by any of them, as the user sees it in their state dict)
    tensor_keys: set[str] = set()
    aliases: dict[str, list[str]] = {}
    if dtype is not None:
        for path, node in iter_nodes_with_keys(structure["root"]):
            if node["type"] == "tensor":
                tensor_keys.add(node["key"])
                if path != node["key"]:
                    aliases.setdefault(node["key"], []).append(path)
        given = [("cast_include", p) for p in cast_include or ()] + [("cast_exclude", p) for p in cast_exclude]
        every_name = [*tensors, *(path for paths in aliases.values() for path in paths)]
        # a typo, or a key named another way (--select drops the subtree's prefix)
        unmatched = [f"{name} '{p}'" for name, p in given if not any(fnmatch.fnmatchcase(k, p) for k in every_name)]
        if unmatched:
            shown = ", ".join(list(tensors)[:5]) + (", ..." if len(tensors) > 5 else "")
            warnings.warn(f"{', '.join(unmatched)} matches no stored tensor, so it changes nothing; the stored keys"
                          f" look like: {shown or '(none)'}", stacklevel=3)
    if dtype is None:  # nothing is cast: each tensor keeps its dtype (without a walk of the structure)
        return [TensorJob(key, t, t.dtype) for key, t in tensors.items()]
    include = list(cast_include) if cast_include is not None else default_cast_scope(structure)
    kept = optimizer_state_keys(structure) if cast_include is None else set()  # (named by cast_include: cast)

    def out_dtype(key: str, t: torch.Tensor) -> torch.dtype | StoredDtype:
        source = stored_dtype(t.dtype)  # a torch-free reader's dtype, or torch's described alike
        if source is None or source is dtype or source.name not in _CASTABLE or key not in tensor_keys:
            return t.dtype
        names = [key, *aliases.get(key, ())]  # excluded under any of its names: kept (one tensor, one dtype)
        if key in kept or any(fnmatch.fnmatchcase(n, p) for p in cast_exclude for n in names):
            return t.dtype
        named = [p for p in include if any(fnmatch.fnmatchcase(n, p) for n in names)]
        if not named or (t.dim() == 0 and not any(p in names and not _GLOB.search(p) for p in named)):
            return t.dtype
        # described without torch: so is its target; a torch tensor's, as torch's (importing it: only for such one)
        return dtype if t.dtype is source else as_torch_dtype(dtype)

    jobs = [TensorJob(key, t, out_dtype(key, t)) for key, t in tensors.items()]
    kept_floating = [key for key in kept if key in tensors and getattr(stored_dtype(tensors[key].dtype), "floating",
                                                                         False)]
    if kept_floating and all(job.dtype is job.source.dtype for job in jobs):
        shown = sorted(kept_floating)[0]
        warnings.warn(f"--dtype {dtype.name}: nothing was cast; {len(kept_floating)} floating tensor(s) are an"
                      f" optimizer's state (e.g. '{shown}'), which keeps its precision by default; to cast it,"
                      f" name it: cast_include=['{shown.split('.', 1)[0]}.*']", stacklevel=3)
    return jobs


def cast_groups(casts: dict[str, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """``{key: (from, to)}`` grouped by the key's top-level name: ``{group: {"tensors": n, "casts": {"f -> t": n}}}``."""
    groups: dict[str, dict[str, Any]] = {}
    for key, (before, after) in casts.items():
        g = groups.setdefault(key.split(".", 1)[0], {"tensors": 0, "casts": {}})
        g["tensors"] += 1
        label = f"{before} -> {after}"
        g["casts"][label] = g["casts"].get(label, 0) + 1
    return groups


def write_converted(tensors: dict[str, torch.Tensor], structure: dict[str, Any], dst: str | os.PathLike[str], *,
                    readers: dict[str, Reader] | None = None, dtype: torch.dtype | str | None = None,
                    cast_include: Sequence[str] | None = None, cast_exclude: Sequence[str] = (),
                    max_shard_size: int | str | None = None, threads: int, force: bool = False,
                    progress: Callable[[int, int], None] | None = None,
                    metadata: dict[str, str] | None = None,
                    locations: dict[str, Location] | None = None,
                    share: Share | None = None,
                    source: SourceRecords | SourceFiles | None = None, verify_checksums: bool = False,
                    before_write: Callable[[], None] | None = None
                    ) -> tuple[Any, dict[str, tuple[str, str]], SourceCrcs | None]:
    """Cast (policy above) and write ``tensors`` with ``structure``; ``readers[key]`` supplies the
    elements of a tensor held in pieces (its ``tensors`` entry then only gives shape and dtype); ``locations[key]``
    says where a tensor's bytes lie in open files (`write.TensorJob.location`), read there when it is not cast.
    ``source``: the ``torch.save`` archive the tensors come from, whose storages' recorded crc32s are checked before
    the output is put in place (`source_crc`), or the files of a directory they are read from in runs;
    ``verify_checksums``: also those that cost a pass (casts, partial views, runs; given on every rank of a shared
    write: each takes the crc32s of what its casts read); ``before_write``: `write.write_safetensors`'s. Returns the
    writer's result, ``{key: (dtype before, dtype after)}`` of every cast, and what was checked of the source."""
    jobs = plan_jobs(tensors, structure, dtype, cast_include, cast_exclude)
    for job in jobs:
        job.reader = (readers or {}).get(job.key)
        job.location = (locations or {}).get(job.key)
    total = sum(j.nbytes for j in jobs) // (share.world if share else 1)  # this rank's share of it
    casts = {j.key: (torch_dtype_name(j.source.dtype), torch_dtype_name(j.dtype)) for j in jobs
             if j.dtype != j.source.dtype}
    done = [0]

    def on_bytes(n: int) -> None:
        done[0] += n  # approximate under threads; only drives a progress bar
        if progress:
            progress(done[0], total)

    check: Any = None
    if isinstance(source, SourceFiles):
        check = plan_runs_check(source.label, source.files, jobs, threads=threads, full=verify_checksums)
    elif source is not None and source.archive is not None:
        check = plan_source_check(source.src, source.archive, jobs, source.storage_at, threads=threads,
                                  small_checked=source.small_checked, every_storage=source.every_storage,
                                  full=verify_checksums)
    result = write_safetensors(dst, jobs, structure_json=json.dumps(structure, separators=(",", ":")),
                               max_shard_size=parse_size(max_shard_size), threads=threads, force=force,
                               progress=on_bytes, metadata=metadata, share=share, check_source=check,
                               record_sources=verify_checksums, before_write=before_write)
    if check is not None:
        return result, casts, check.summary()
    return result, casts, source.unchecked if isinstance(source, SourceRecords) else None
