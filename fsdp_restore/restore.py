"""Restore model weights into a sharded (or plain) model on every rank, reading only this rank's bytes.

Planning and reading are separate, as in ``torch.distributed.checkpoint``: `plan_model_reads`
matches this rank's `Target` pieces (see shards.py) to stored tensors, then `execute_reads` runs
positional reads on a few threads straight into parameter memory (through a bounded staging
buffer when the destination is on a GPU or of another dtype). Then the NaN-fill check runs and all
ranks agree on one verdict.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .check import ReadTask, agree, fill_nan, find_unrestored, floating, may_hold_nan, raise_if_problems
from .errors import FsdpRestoreError
from .flatten import iter_tensor_nodes
from .read import Checkpoint, open_checkpoint
from .shards import Target, local_targets

STAGING_BYTES = 64 * 1024 * 1024  # bounded staging buffer for device or dtype-converting copies
DEFAULT_READ_THREADS = 4
READ_CHUNK_BYTES = 16 * 1024 * 1024  # pieces above this are split so that several threads share them


@dataclass(frozen=True)
class Source:
    """Where a named tensor's elements start inside a stored tensor (views of a stored buffer too)."""

    key: str
    start: int
    shape: tuple[int, ...]


@dataclass
class RestoreReport:
    """What a restore did on this rank."""

    tensors: int = 0
    elements: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    cast: list[str] = field(default_factory=list)  # "name: stored dtype -> model dtype"
    nan_in_checkpoint: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # only when strict=False
    unexpected: list[str] = field(default_factory=list)  # only when strict=False
    prefix: str = ""
    method: str = "read"


def tensor_sources(ckpt: Checkpoint, prefix: str) -> tuple[dict[str, Source], list[str]]:
    """``{name: Source}`` for every tensor under dotted ``prefix``, plus names we cannot range-read."""
    sources: dict[str, Source] = {}
    unsupported: list[str] = []
    lead = prefix + "." if prefix else ""
    for path, node in iter_tensor_nodes(ckpt.structure["root"]):
        if not path.startswith(lead):
            continue
        name = path[len(lead):]
        entry = ckpt.entries[node["key"]]
        view = node.get("view")
        if view is None:
            sources[name] = Source(node["key"], 0, entry.shape)
            continue
        shape = tuple(view["shape"])
        contiguous = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            contiguous[d] = contiguous[d + 1] * shape[d + 1]
        if all(s == c for s, c, n in zip(view["stride"], contiguous, shape) if n > 1):
            sources[name] = Source(node["key"], view["offset"], shape)
        else:
            unsupported.append(f"{name} (a strided view of '{node['key']}')")
    return sources, unsupported


def default_prefix(ckpt: Checkpoint) -> str:
    """``"model"`` when the top level holds a ``"model"`` subtree (a training checkpoint saved as
    ``{"model": ..., "optim": ...}``); ``""`` for plain weight files (Hugging Face files, ``--select``
    outputs, a converted ``torch.save(model.state_dict())``). Only the exact top-level key counts:
    Hugging Face state dicts have flat keys that themselves start with ``model.`` (``LlamaForCausalLM``)."""
    root = ckpt.structure["root"] if ckpt.has_structure else None
    if not (isinstance(root, dict) and root.get("type") in ("dict", "OrderedDict")):
        return ""
    return "model" if any(k == "model" and isinstance(v, dict) and v.get("type") != "tensor"
                          for k, v in root["items"]) else ""


def plan_model_reads(targets: Sequence[Target], aliases: dict[str, str], sources: dict[str, Source],
                     ckpt: Checkpoint, *, strict: bool, dtype_policy: str = "cast"
                     ) -> tuple[list[ReadTask], dict[str, list[str]], RestoreReport]:
    """Match targets to stored tensors; problems are collected, never raised here.

    ``dtype_policy``: ``"cast"`` converts a stored dtype to the model's (and reports it), ``"error"``
    makes any dtype difference a problem."""
    if dtype_policy not in ("cast", "error"):
        raise ValueError(f"dtype_policy must be 'cast' or 'error', not {dtype_policy!r}")
    problems: dict[str, list[str]] = {"missing": [], "unexpected": [], "shape": [], "dtype": []}
    report = RestoreReport()
    tasks: list[ReadTask] = []
    for target in targets:
        src = sources.get(target.name)
        if src is None:
            (problems["missing"] if strict else report.missing).append(target.name)
            continue
        if tuple(src.shape) != tuple(target.global_shape):
            problems["shape"].append(f"{target.name}: checkpoint {list(src.shape)} vs model {list(target.global_shape)}")
            continue
        stored = ckpt.entries[src.key].dtype
        if stored != target.dtype:
            if dtype_policy == "error":
                problems["dtype"].append(f"{target.name}: checkpoint {stored} vs model {target.dtype}")
                continue
            report.cast.append(f"{target.name}: {stored} -> {target.dtype}")
        report.tensors += 1
        for piece in target.pieces:
            tasks.append(ReadTask(src.key, src.start + piece.start, piece, target))
    known = {t.name for t in targets} | set(aliases)
    unexpected = sorted(set(sources) - known)
    (problems["unexpected"] if strict else report.unexpected).extend(unexpected)
    return tasks, {k: v for k, v in problems.items() if v}, report


def read_piece(ckpt: Checkpoint, key: str, src_start: int, dest: torch.Tensor) -> None:
    """Read into ``dest`` (1-D, contiguous): directly when it is CPU memory of the stored dtype, else
    through a bounded staging buffer (pinned when the destination is on a GPU) with ``copy_``
    doing the dtype cast and the host-to-device copy."""
    entry = ckpt.entries[key]
    if dest.device.type == "cpu" and dest.dtype == entry.dtype:
        ckpt.read_range(key, src_start, dest)
        return
    n = dest.numel()
    step = max(1, STAGING_BYTES // entry.itemsize)
    pin = dest.device.type == "cuda"
    staging = torch.empty(min(step, n), dtype=entry.dtype, pin_memory=pin)
    with torch.no_grad():
        for s in range(0, n, step):
            m = min(step, n - s)
            ckpt.read_range(key, src_start + s, staging[:m])
            dest[s:s + m].copy_(staging[:m])


def execute_reads(ckpt: Checkpoint, tasks: Sequence[ReadTask], threads: int, *, check: bool = False) -> None:
    """Run every read task on ``threads`` threads; positional reads release the GIL, so reads overlap
    each other, the copies into device memory and the checks.

    Pieces are split into chunks of at most ``READ_CHUNK_BYTES`` so that one large tensor (an
    embedding) is read by all threads at once rather than by one. With ``check``, each chunk is
    NaN-filled, read and screened for NaN by one worker in a row: the fill (which is also what first
    touches freshly allocated memory, page faults included) overlaps the other workers' reads
    instead of delaying every read, and the screen runs while the chunk is still in cache, so that
    the check afterwards only re-examines the pieces that need it."""
    chunks: list[tuple[ReadTask, int, int]] = []  # (task, first element, element count)

    def file_position(task: ReadTask) -> tuple[str, int]:
        entry = ckpt.entries[task.key]
        return str(entry.file), entry.offset + task.src_start * entry.itemsize

    # In file order: the threads move through each file together, so the disk sees near-sequential
    # reads and small slices (biases) are read next to their neighbours, not in a second sweep.
    for task in sorted(tasks, key=file_position):
        n = task.piece.dest.numel()
        step = max(1, READ_CHUNK_BYTES // max(1, ckpt.entries[task.key].itemsize))
        chunks.extend((task, s, min(step, n - s)) for s in range(0, n, step))
        task.may_hold_nan = False if check else None

    def read(chunk: tuple[ReadTask, int, int]) -> None:
        task, start, count = chunk
        dest = task.piece.dest[start:start + count]
        if check and floating(dest.dtype):
            dest.fill_(float("nan"))  # an element the read below fails to write stays NaN
        read_piece(ckpt, task.key, task.src_start + start, dest)
        if check and may_hold_nan(dest):
            task.may_hold_nan = True  # only ever set to True, by any thread: no lock needed

    with torch.no_grad():
        if threads <= 1 or len(chunks) <= 1:
            for chunk in chunks:
                read(chunk)
        else:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                for f in [pool.submit(read, c) for c in chunks]:
                    f.result()
    for task in tasks:  # reached only when every chunk was read (a failed read raised above)
        task.done = True


def checked_reads(ckpt: Checkpoint, tasks: Sequence[ReadTask], report: RestoreReport, *, check: bool,
                  read: Callable[[], None], prefill: bool = False) -> dict[str, list[str]]:
    """Run ``read()`` then (with ``check``) look for planned elements left unrestored; with
    ``prefill``, NaN-fill them all first (for readers that do not fill as they go, unlike
    `execute_reads`). Returns this rank's problems instead of raising, so that every rank still
    reaches the verdict collective."""
    problems: dict[str, list[str]] = {}
    try:
        with torch.no_grad():
            if check and prefill:
                fill_nan(tasks)
            read()
        if check:
            result = find_unrestored(tasks, ckpt)
            if result.unrestored:
                problems["unrestored"] = result.unrestored
            report.nan_in_checkpoint = result.nan_in_checkpoint
    except (FsdpRestoreError, ValueError, OSError) as e:
        problems["error"] = [str(e)]
    return problems


def _check_materialized(targets: Sequence[Target]) -> list[str]:
    return [t.name for t in targets if any(p.dest.is_meta for p in t.pieces)]


def restore_model(model: nn.Module, checkpoint: str | os.PathLike[str] | Checkpoint, *, prefix: str | None = None,
                  strict: bool = True, check: bool = True, method: str = "read", threads: int | None = None,
                  dtype_policy: str = "cast", group: dist.ProcessGroup | None = None) -> RestoreReport:
    """Restore a model's weights from a checkpoint; call on every rank after sharding the model.

    ``checkpoint``: a path (file, sharded directory, or ``.pt`` with a ``.safetensors`` sibling) or
    an opened `Checkpoint`. ``prefix``: the dotted subtree holding the weights; default ``"model"``
    for our full-checkpoint files and ``""`` for plain weight files. Works for FSDP2
    (``fully_shard``, any DTensor layout), FSDP1 (every sharding strategy, ``use_orig_params``
    either way), DDP and plain modules; a model built on the meta device must be materialized
    (``to_empty``) first. Each rank reads only the bytes of its own shard. ``method="apply"``
    uses the seed's FSDP1 route instead (``FSDP.apply`` summons each unit's full parameters and
    copies whole tensors in; every rank reads everything). With ``check`` the restored elements
    are NaN-filled first and verified after; every rank raises the same `RestoreError` when
    anything is missing, unexpected (``strict``), mis-shaped or unrestored; ``dtype_policy="error"``
    adds dtype differences to that list (default ``"cast"``: convert and report in ``report.cast``).
    """
    t0 = time.perf_counter()
    own = not isinstance(checkpoint, Checkpoint)
    ckpt: Checkpoint | None = None
    problems: dict[str, list[str]] = {}
    tasks: list[ReadTask] = []
    report = RestoreReport(method=method)
    try:
        ckpt = open_checkpoint(checkpoint)
        prefix = default_prefix(ckpt) if prefix is None else prefix
        targets, aliases = local_targets(model)
        unmaterialized = _check_materialized(targets)
        if unmaterialized:
            raise FsdpRestoreError(f"parameters on the meta device ({', '.join(unmaterialized[:5])}...): materialize"
                                   " the model with model.to_empty(device=...) before restoring")
        sources, unsupported = tensor_sources(ckpt, prefix)
        if not sources and prefix:
            raise FsdpRestoreError(f"the checkpoint has no tensors under prefix '{prefix}'; pass prefix='' for a"
                                   " plain weights file, or the subtree that holds the model")
        tasks, problems, report = plan_model_reads(targets, aliases, sources, ckpt, strict=strict,
                                                   dtype_policy=dtype_policy)
        report.method, report.prefix = method, prefix
        if unsupported:
            problems["unsupported"] = unsupported
    except (FsdpRestoreError, ValueError, OSError) as e:
        problems = {"error": [str(e)]}
    try:
        raise_if_problems(agree(problems, group), "restore")  # nothing has been modified yet
        assert ckpt is not None
        before = ckpt.bytes_read

        def read() -> None:
            if method == "apply":
                from .apply import restore_by_apply

                restore_by_apply(model, ckpt, tasks, prefix=prefix)
            elif method == "read":
                execute_reads(ckpt, tasks, threads or DEFAULT_READ_THREADS, check=check)
            else:
                raise ValueError(f"unknown method '{method}' (use 'read' or 'apply')")

        problems = checked_reads(ckpt, tasks, report, check=check, read=read, prefill=method == "apply")
        raise_if_problems(agree(problems, group), "restore check")
        report.bytes_read = ckpt.bytes_read - before
        report.elements = sum(t.piece.dest.numel() for t in tasks)
        report.seconds = time.perf_counter() - t0
        return report
    finally:
        if own and ckpt is not None:
            ckpt.close()
