"""A DeepSpeed ZeRO checkpoint read without torch: what `zero.read_zero` puts under ``model`` (the fp32 master
weights, frozen parameters and buffers, tied names as one object; ``--select model``), and, for the full conversion,
the optimizer's state per parameter and the rest of the run's state beside it, with every tensor a
`plain_pt.StoredTensor`. A tensor held in pieces by several ranks' files is one whose storage lists its
``extents``: the (descriptor, offset, length) runs of the files whose bytes, one after the other, are its bytes.

Why: a ZeRO checkpoint's weights and moments are byte ranges of its optimizer files; importing torch to find them
takes longer than copying them (BENCHMARKS.md, "ZeRO `--select model` without torch", "ZeRO's full conversion
without torch").

Each file is read by `plain_pt` as the torch path's loader reads it (torch's weights-only unpickler with
`zero.STAND_INS`), and the layout is `zero_layout`'s, shared with `zero`. Anything this reader does not take
exactly as that path would (another global, a tensor that is not one run of its file, parts of two dtypes, a
partition shorter than its layout, files of several model-parallel ranks or of two runs) raises `NotPlain`
before anything is written, and the caller converts through torch, which reads or refuses it as it always did.
The optimizer's state is assembled by `zero_layout.optim_tree`, as the torch path assembles it; ``--select model``
reads none of it, so a checkpoint whose weights are whole converts even where that state is malformed, which the
torch path, building it, refuses.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .plain_pt import NotPlain, StoredStorage, StoredTensor, StoredZeroStage, load_plain_archive
from .source_crc import Archive, ArchiveFile, check_small_records
from .zero_files import MP_RANK, STAGE_1_2_MASTERS, STAGE_3_MASTERS, optim_files, resolve_tag
from .zero_layout import (INTERNAL, SKIP, group_optimizer_state, model_dict, optim_tree,
                          param_groups_of_sub_groups, stage_1_2_field, stage_1_2_offsets, stage_3_field,
                          stage_3_spans)

Extent = tuple[int, int, int]  # (open file, byte offset, bytes)
Run = tuple[int, int, int, Any]  # a tensor of a file as one run of its bytes: (open file, offset, bytes, dtype)


class ZeroModel:
    """A ZeRO checkpoint read by `read_model`: its ``model`` entry (and, when asked, the whole consolidated object,
    ``obj``), and its files, open until `close`."""

    def __init__(self) -> None:
        self.model: dict[str, Any] = {}
        self.obj: dict[str, Any] = {}  # with ``optimizer``: all that `zero.read_zero` consolidates
        self.tag_dir: Path | None = None
        self.fds: list[int] = []
        self.files: list[ArchiveFile] = []  # each file read, for the check of its records' crc32s (`source_crc`)

    def load(self, path: Path) -> dict[str, Any]:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in a file's place opens at once (and is declined)
        self.fds.append(fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotPlain(f"{path.name}: not a regular file")
        os.set_blocking(fd, True)  # (Lustre reads O_NONBLOCK on each read as "do not wait for a lock")
        archive = Archive.open(fd)
        if archive is None:
            raise NotPlain(f"{path.name}: not laid out as torch.save lays out its archive")
        # its pickle and small records against their crc32s first: damage said as damage (`FormatError`), not as
        # whatever the damaged pickle then looks like
        self.files.append(ArchiveFile(str(path), archive, check_small_records(path, archive)))
        obj, _ = load_plain_archive(fd, deepspeed=True, archive=archive.parsed)
        if type(obj) is not dict:
            raise NotPlain(f"{path.name}: no dict at the top")
        return obj

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def read_model(path: str | os.PathLike[str], tag: str | None = None, *, optimizer: bool = False) -> ZeroModel:
    """The ``model`` entry `zero.read_zero` consolidates from the ZeRO checkpoint ``path`` (``tag``: as there),
    every tensor a `StoredTensor` (see the module's doc); with ``optimizer``, also the whole object it consolidates
    (``obj``: the model, the per-parameter optimizer state, the rest of the run's state); `NotPlain` where torch's
    path should read it."""
    read = ZeroModel()
    try:
        read.tag_dir = tag_dir = resolve_tag(path, tag)
        if any(MP_RANK.search(p.name) and int(MP_RANK.search(p.name).group(1)) != 0  # type: ignore[union-attr]
               for p in tag_dir.iterdir()):
            raise NotPlain("files of several model-parallel ranks")
        optims = [read.load(f).get("optimizer_state_dict") for f in optim_files(tag_dir)]
        if not all(type(o) is dict and type(o.get("zero_stage")) in (int, StoredZeroStage) for o in optims):
            raise NotPlain("an optimizer file without its ZeRO stage")
        stage, world = int(optims[0]["zero_stage"]), len(optims)
        for o in optims:
            counts = o.get("partition_count")
            declared = max(counts) if type(counts) in (list, tuple) and counts else counts
            if o["zero_stage"] != stage or (declared is not None and (type(declared) is not int or declared != world)):
                raise NotPlain("optimizer files of two runs, or of another number of ranks")
        names = (["mp_rank_00_model_states.pt"] if stage <= 2 else
                 [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)])
        models = [read.load(tag_dir / name) for name in names]
        head = models[0]
        if not all(key in head for key in ("module", "param_shapes", "buffer_names")):
            raise NotPlain("model states without their module, shapes or buffer names")
        trainable, optim = (_stages_1_2 if stage <= 2 else _stage_3)(head, optims, optimizer)

        def striped_frozen(name: str, shape: tuple[int, ...]) -> StoredTensor:
            per_rank = math.ceil(math.prod(shape) / len(models))
            fragments = [[_run(m["frozen_param_fragments"][name])] for m in models]
            return _pieced(name, shape, [run for rank in fragments for run in rank],
                           _striped(fragments, 0, per_rank, math.prod(shape)))

        read.model = model_dict(head, trainable, stage, striped_frozen)[0]
        if optimizer:
            read.obj = {"model": read.model, "optim": optim, **{k: v for k, v in head.items() if k not in INTERNAL}}
    except BaseException:
        read.close()
        raise
    return read


def _stages_1_2(head: dict[str, Any], optims: list[dict[str, Any]], optimizer: bool
                ) -> tuple[dict[str, StoredTensor], dict[str, Any] | None]:
    """Stages 1/2: a parameter group's flat vector is the ranks' partitions one after the other; so is each field of
    the optimizer's state, each rank's part as long as its weights' (``optimizer``: that state per parameter, as
    `zero.read_zero` builds it)."""
    # every rank's partitions, each a tensor of its file, as the torch path takes every one of them
    partitions = [[_run(t) for t in _list(o[STAGE_1_2_MASTERS])] for o in optims]
    trainable = {}
    names: list[list[str]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    offsets: dict[tuple[int, str], int] = {}
    for g, (entries, needed) in enumerate(stage_1_2_offsets(head["param_shapes"],
                                                            optims[0].get("param_alignment_paddings"))):
        runs = [p[g] for p in partitions]  # the group's flat vector: each rank's partition in turn
        if needed > sum(run[2] for run in runs) // runs[0][3].itemsize:
            raise NotPlain(f"param group {g}: partitions shorter than the parameters")
        for name, shape, first in entries:
            trainable[name] = _pieced(name, shape, runs, _extents(runs, first, math.prod(shape)))
            shapes[name], offsets[(g, name)] = shape, first
        names.append([name for name, _, _ in entries])
    if not optimizer:
        return trainable, None
    bases = [_base_state(o, 1) for o in optims]
    field_runs: dict[tuple[int, str], list[Run] | None] = {}

    def state_extents(g: int, name: str, field: str) -> tuple[list[Run], list[Extent]] | None:
        if (g, field) not in field_runs:  # each rank's part, cut to its weights' length, as the torch path cuts it
            parts = stage_1_2_field(bases, g, field)
            field_runs[(g, field)] = None if parts is None else [
                _cut(_flat_run(p), _numel(w[g])) for p, w in zip(parts, partitions)]
        runs = field_runs[(g, field)]
        return None if runs is None else (runs, _extents(runs, offsets[(g, name)], math.prod(shapes[name])))

    return trainable, optim_tree(names, bases[0], _state_values(shapes, state_extents))


def _stage_3(head: dict[str, Any], optims: list[dict[str, Any]], optimizer: bool
             ) -> tuple[dict[str, StoredTensor], dict[str, Any] | None]:
    """Stage 3: a parameter's elements ``[r * per_rank, (r + 1) * per_rank)`` are at its offset in rank r, in the
    rank's flat groups one after the other, and so in each field of the optimizer's state over them
    (``optimizer``: that state per parameter, as `zero.read_zero` builds it)."""
    ranks = [[_run(t) for t in _list(o[STAGE_3_MASTERS])] for o in optims]
    groups, needed = stage_3_spans(head["param_shapes"], len(optims))
    if not ranks[0] or needed > sum(run[2] for run in ranks[0]) // ranks[0][0][3].itemsize:
        raise NotPlain("flat groups shorter than the parameters")
    every_run = [run for rank in ranks for run in rank]
    trainable = {}
    shapes: dict[str, tuple[int, ...]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for entries in groups:
        for name, shape, first, per_rank in entries:
            trainable[name] = _pieced(name, shape, every_run, _striped(ranks, first, per_rank, math.prod(shape)))
            shapes[name], spans[name] = shape, (first, per_rank)
    if not optimizer:
        return trainable, None
    bases = [_base_state(o, 3) for o in optims]
    field_runs: dict[str, list[list[Run]] | None] = {}

    def state_extents(g: int, name: str, field: str) -> tuple[list[Run], list[Extent]] | None:
        if field not in field_runs:  # over the flat groups as the weights are (else the torch path leaves it out)
            per_rank = [[_flat_run(part) for part in parts] for parts in stage_3_field(bases, field)]
            field_runs[field] = None if any(sum(map(_numel, state)) != sum(map(_numel, weights))
                                            for state, weights in zip(per_rank, ranks)) else per_rank
        runs = field_runs[field]
        if runs is None:
            return None
        first, per_rank = spans[name]
        return [run for rank in runs for run in rank], _striped(runs, first, per_rank, math.prod(shapes[name]))

    names, merged = param_groups_of_sub_groups([[name for name, *_ in entries] for entries in groups], bases[0])
    return trainable, optim_tree(names, merged, _state_values(shapes, state_extents))


def _base_state(optim: dict[str, Any], stage: int) -> dict[str, Any]:
    """`zero_layout.group_optimizer_state`, its state's groups a dict of dicts as the torch path indexes them."""
    base = group_optimizer_state(optim, stage)
    if type(base["state"]) is not dict or not all(type(v) is dict for v in base["state"].values()):
        raise NotPlain("an optimizer state that is not a dict of dicts")
    if type(base["param_groups"]) is not list or not all(type(g) is dict for g in base["param_groups"]):
        raise NotPlain("param groups that are not a list of dicts")
    return base


def _state_values(shapes: dict[str, tuple[int, ...]],
                  state_extents: Callable[[int, str, str], tuple[list[Run], list[Extent]] | None]
                  ) -> Callable[[int, str, str, Any], Any]:
    """`zero_layout.optim_tree`'s per-parameter value of a field of the flat state, as `zero` makes it: a 0-dim
    tensor (the step) a copy of its own, a flat tensor the parameter's elements of it (`SKIP` where the field's
    partitions do not match the weights'), anything else as it is."""

    def value(g: int, name: str, field: str, flat: Any) -> Any:
        if type(flat) is StoredTensor and flat.dim() == 0:
            fd, offset, _, dtype = _run(flat)  # (a copy keeps requires_grad, as torch's clone() does)
            return StoredTensor(StoredStorage(f"zero:{name}.{field}", dtype, 1, offset, fd), 0, (), (),
                                flat.requires_grad)
        if type(flat) is StoredTensor:
            found = state_extents(g, name, field)
            return SKIP if found is None else _pieced(f"{name}.{field}", shapes[name], *found)
        return flat

    return value


def _flat_run(t: Any) -> Run:
    """A flat (1-D) state tensor as one run of its file (the torch path cuts stages 1/2's along its first dim)."""
    if type(t) is not StoredTensor or t.dim() != 1:
        raise NotPlain("an optimizer state field that is not a flat tensor")
    return _run(t)


def _numel(run: Run) -> int:
    return run[2] // run[3].itemsize


def _cut(run: Run, count: int) -> Run:
    """``run``'s first ``count`` elements (the torch path's ``part[:count]``, of a flat part at least that long)."""
    fd, offset, nbytes, dtype = run
    if count * dtype.itemsize > nbytes:
        raise NotPlain("a state partition shorter than its weights'")
    return fd, offset, count * dtype.itemsize, dtype


def _list(value: Any) -> list[Any]:
    if type(value) is not list:
        raise NotPlain("flat partitions that are not a list")
    return value


def _run(t: Any) -> Run:
    """A tensor of a file as one run of its bytes: (descriptor, offset, bytes, dtype)."""
    if type(t) is not StoredTensor or not t.is_contiguous():
        raise NotPlain("a tensor that is not one run of its file")
    return t.storage.fd, t.file_offset, t.numel() * t.dtype.itemsize, t.dtype


def _extents(runs: list[Run], first: int, count: int) -> list[Extent]:
    """The byte runs of elements ``[first, first + count)`` of the runs one after the other."""
    itemsize = runs[0][3].itemsize
    lo, hi, at, out = first * itemsize, (first + count) * itemsize, 0, []
    for fd, offset, nbytes, _ in runs:
        if at < hi and at + nbytes > lo:
            start = max(lo, at)
            out.append((fd, offset + start - at, min(hi, at + nbytes) - start))
        at += nbytes
    if sum(extent[2] for extent in out) != hi - lo:
        raise NotPlain("a partition shorter than its layout")
    return out


def _striped(ranks: list[list[Run]], first: int, per_rank: int, numel: int) -> list[Extent]:
    """Stage 3's elements: ``per_rank`` of them from ``first`` in each rank in turn, ``numel`` in all."""
    out: list[Extent] = []
    for r, runs in enumerate(ranks):
        count = min(per_rank, numel - r * per_rank)
        if count <= 0:
            break
        out += _extents(runs, first, count)
    if sum(extent[2] for extent in out) != numel * ranks[0][0][3].itemsize:
        raise NotPlain("fewer ranks than the layout needs")
    return out


def _pieced(name: str, shape: tuple[int, ...], runs: list[Run], extents: list[Extent]) -> StoredTensor:
    """A tensor of ``shape`` whose bytes are ``extents``, parts of ``runs`` (all of one dtype: torch's path would
    cast the others to the first's)."""
    dtypes = {run[3] for run in runs}
    if len(dtypes) != 1:
        raise NotPlain("parts of several dtypes")
    if math.prod(shape) == 0:
        raise NotPlain("an empty parameter held in pieces (the torch path cannot assemble one)")
    (dtype,) = dtypes
    storage = StoredStorage(f"zero:{name}", dtype, math.prod(shape), -1, extents=extents)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return StoredTensor(storage, 0, shape, tuple(reversed(strides)), False)
