"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) in: read without DeepSpeed and without running pickle.

A ZeRO checkpoint directory holds, per tag (``global_stepN``): the model states (one file for stages 1
and 2, one per rank for stage 3: buffers, parameter shapes, frozen parameters, tied names, the rest of
the run's state) and one optimizer file per rank with that rank's flat partition of the fp32 master
weights and of the optimizer state. Their pickles name three DeepSpeed classes; they are rebuilt here
from stand-ins with ``torch.load(weights_only=True)``, so nothing in the files is executed and
DeepSpeed need not be installed.

`read_zero` returns the consolidated checkpoint as ``(object, readers, layout)``: the object is the nested
training checkpoint (``model``: fp32 master weights, frozen parameters, buffers, tied names as one
tensor; ``optim``: per-parameter ``exp_avg``/``exp_avg_sq``/``step`` with ``param_names``, which
`fsdp_restore.restore` resumes into an FSDP optimizer; everything else as it was), in which every
tensor held in pieces across the ranks' partitions is a placeholder, and ``readers`` assembles any
range of its elements from exactly those bytes of the partitions. The writer then streams each tensor
on several threads; no rank's partition is ever loaded whole.

Reading: the files are memory-mapped to unpickle them (torch reads the pickle and each record's zip header,
not the tensors' bytes). A tensor held in pieces is read with ``pread`` at its offset in its file (found by
`fsdp_restore.mapped.MappedFile`), on a descriptor advised ``POSIX_FADV_RANDOM``: the kernel reads the
ranges asked for and, within the same part, the readahead `_File.read_into` asks for. So a conversion reads
from disk what it writes (``--select model``: the fp32 masters, a third of each optimizer file) and the
pickles. Copying the pieces out of the mapping instead faulted their pages in with the kernel's
read-around, a readahead window (``read_ahead_kb``: 8 MB on some virtual disks) centred on each fault; the
masters follow Adam's ``exp_avg_sq`` in the file, so a weights-only conversion also read the moments' last
megabytes (up to 8 MB per rank file: up to 1.35x the masters' bytes at 12M parameters, 1.06x at 80M). The
few tensors stored whole (buffers, frozen parameters of stages 1/2) are still copied from the mapping.

Layouts: `fsdp_restore.zero_layout` (shared with `fsdp_restore.zero_plain`, which reads them without torch).
"""

from __future__ import annotations

import math
import os
import pickle
import threading
import types
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import FormatError, first_line, refused_global
from .format import SNIFF_BYTES, is_legacy_torch_save
from .mapped import MappedFile, pread_exactly
from .write import HeldInPieces, Reader, scratch, stand_in
from .zero_layout import (INTERNAL, SKIP, group_optimizer_state, model_dict, optim_tree,
                          param_groups_of_sub_groups, stage_1_2_field, stage_1_2_offsets, stage_3_field,
                          stage_3_spans)
from .zero_files import MP_RANK, STAGE_1_2_MASTERS, STAGE_3_MASTERS, is_zero_checkpoint, optim_files, resolve_tag

__all__ = ["ZeroLayout", "is_zero_checkpoint", "read_zero", "resolve_tag"]


# ---- stand-ins for the classes DeepSpeed's pickles name ------------------------------------------------


class _State:
    """Restores a pickled object's attributes, nothing else."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class LossScaler(_State):
    pass


class DynamicLossScaler(_State):  # an fp16 run's (DeepSpeed's fp16 default: loss_scale 0)
    pass


class fragment_address(_State):  # noqa: N801 - the name the pickles use
    pass


class ZeroStageEnum(int):
    pass


LossScaler.__module__ = DynamicLossScaler.__module__ = "deepspeed.runtime.fp16.loss_scaler"
fragment_address.__module__ = "deepspeed.utils.tensor_fragment"
ZeroStageEnum.__module__ = "deepspeed.runtime.zero.config"
STAND_INS = [LossScaler, DynamicLossScaler, fragment_address, ZeroStageEnum]

AHEAD_BYTES = 4 * 1024 * 1024  # what a thread asks the kernel to read beyond its read, inside the same part


class _File:
    """A loaded file opened once more for positional reads of its tensors' bytes (see the module's doc); the
    descriptor is closed with the last reader that holds it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)  # first: the mappings found are this file's, whatever is renamed over it
        self.mapped = MappedFile(path, self.fd)  # after torch.load mapped it
        self.advise = hasattr(os, "posix_fadvise")
        if self.advise:  # the kernel reads exactly what is asked (below), no readahead past or around it
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._asked = threading.local()  # per thread: {end of a part: (first, last) byte asked for in it}

    def location(self, t: torch.Tensor) -> int | None:
        """The file offset of ``t``'s bytes, when ``t`` is a contiguous slice of this file's mapping."""
        return self.mapped.offset_of(t)

    def read_into(self, out: torch.Tensor, offset: int, end: int) -> None:
        """Fill the contiguous tensor ``out`` with the file's bytes at ``offset``, in a part of the file that
        ends at ``end`` (a partition, or a moment's).

        The kernel is asked (``POSIX_FADV_WILLNEED``) for these bytes and up to `AHEAD_BYTES` after them in
        the same part whenever this thread's reads come within half of that of the end of what it asked for
        last: the readahead of a sequential reader, never past the part. Without it each small tensor, read
        one after the other, waited for a disk request of its own (a model of 1,200 tensors of 256 KB
        converted 10-20% slower)."""
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        stop = offset + len(view)
        if self.advise and stop > offset:
            asked = self._asked.__dict__.setdefault("parts", {})
            lo, hi = asked.get(end, (0, 0))
            if not (lo <= offset and min(end, stop + AHEAD_BYTES // 2) <= hi):
                # what was asked for already is not asked again; last > first (a length of 0 would mean "to
                # the end of the file")
                first = hi if lo <= offset < hi else offset
                last = max(stop, min(end, stop + AHEAD_BYTES))
                os.posix_fadvise(self.fd, first, last - first, os.POSIX_FADV_WILLNEED)
                asked[end] = (lo if lo <= offset < hi else offset, last)
        try:
            pread_exactly(self.fd, view, offset)
        except EOFError as e:
            raise FormatError(self.path, str(e).removeprefix("the file ")) from None

    def __del__(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)


class _TrustedUnpickler(pickle.Unpickler):
    """Python's unpickler (``trust_pickle``: the file's pickle runs), with the stand-ins for DeepSpeed's classes,
    so that DeepSpeed need not be installed then either."""

    def find_class(self, module: str, name: str) -> Any:
        for cls in STAND_INS:
            if cls.__module__ == module and cls.__name__ == name:
                return cls
        return super().find_class(module, name)


_TRUSTED_PICKLE = types.SimpleNamespace(__name__="pickle", Unpickler=_TrustedUnpickler, load=pickle.load)


def _load(path: Path, safe_globals: Sequence[Any] = (), trust_pickle: bool = False) -> dict[str, Any]:
    """A DeepSpeed file, memory-mapped, with the safe unpickler and the stand-ins (and ``safe_globals``: the
    classes a ``.pt`` conversion may build too), or, with ``trust_pickle``, running its pickle."""
    try:
        if trust_pickle:
            obj = torch.load(path, weights_only=False, mmap=True, map_location="cpu", pickle_module=_TRUSTED_PICKLE)
        else:
            with torch.serialization.safe_globals(STAND_INS + list(safe_globals)):
                obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file, whatever torch raises for it
        refused = refused_global(f"{path}: its pickle", e)  # a run's own state (client_state) naming its classes
        if refused is not None:
            raise refused from None
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                legacy = is_legacy_torch_save(f.read(SNIFF_BYTES))
            raise FormatError(path, "a legacy (non-zip) torch.save file, which cannot be memory-mapped: load it with"
                              " torch.load and save it again with a current torch's torch.save" if legacy else
                              "not a whole torch.save archive (truncated or corrupt: no zip directory at its end);"
                              " copy it again from where the run saved it") from None
        raise FormatError(path, "cannot read as a DeepSpeed checkpoint file without executing its pickle"
                          f" ({first_line(e)})") from None
    if not isinstance(obj, dict):
        raise FormatError(path, "not a DeepSpeed checkpoint file (no dict at the top)")
    return obj


# ---- flat vectors held in pieces -----------------------------------------------------------------------


class _Pieces:
    """One rank's flat vector as the concatenation of several tensors (stage 3's flat groups), slices of
    ``file``'s mapping: read from the file at their offsets where `_File.location` finds them, else copied
    from the mapping."""

    def __init__(self, parts: list[torch.Tensor], file: _File | None = None) -> None:
        self.parts = [p.detach().reshape(-1) for p in parts]  # DeepSpeed saves its fp32 partitions as parameters
        self.spans: list[tuple[_File, int, int] | None] = []  # each part's file and byte range there, if known
        for p in self.parts:
            offset = file.location(p) if file is not None else None
            self.spans.append(None if offset is None else (file, offset, offset + p.numel() * p.element_size()))
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + p.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def read(self, first: int, count: int, out: list[_Segment]) -> None:
        """Append elements ``[first, first + count)`` to ``out``: each as a view of the mapping (not touched
        here) and, where the file offset is known, the file, the offset of the view's first byte and the
        offset where its part ends."""
        end = first + count
        for part, span, lo, hi in zip(self.parts, self.spans, self.starts, self.starts[1:]):
            if hi <= first or lo >= end:
                continue
            skip = max(first, lo) - lo
            view = part[skip:min(end, hi) - lo]
            out.append((view, None if span is None else (span[0], span[1] + skip * part.element_size(), span[2])))


_Segment = tuple[torch.Tensor, "tuple[_File, int, int] | None"]  # a view; its file, offset and part's end there


def _gather(segments: list[_Segment], count: int, dtype: torch.dtype) -> torch.Tensor:
    """The segments' elements one after the other: read from their files into this thread's scratch buffer
    (a view of the mapping is returned as it is only when there is no file to read it from)."""
    if sum(v.numel() for v, _ in segments) != count:
        raise FormatError("<optimizer files>", f"assembled {sum(v.numel() for v, _ in segments)} elements, expected"
                          f" {count} (a partition shorter than its layout)")
    if len(segments) == 1 and segments[0][1] is None:
        return segments[0][0]
    out = scratch(dtype, count)  # (no segment at all for a parameter of no elements)
    at = 0
    for view, where in segments:
        n = view.numel()
        if where is None:
            out[at:at + n].copy_(view)
        else:
            where[0].read_into(out[at:at + n], where[1], where[2])
        at += n
    return out


def _one_dtype(ranks: list[_Pieces]) -> torch.dtype:
    """The dtype of the ranks' parts of one flat vector, which must agree: their bytes are read as that dtype."""
    dtypes = {p.dtype for r in ranks for p in r.parts}
    if len(dtypes) > 1:
        raise FormatError("<optimizer files>", "the ranks' files hold the parts of one flat vector in several dtypes"
                          f" ({', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}): files of two runs,"
                          " or rewritten by hand? Each rank's partition must be of the same dtype")
    return dtypes.pop()


def _contiguous_reader(ranks: list[_Pieces], base: int) -> tuple[torch.dtype, Reader]:
    """Stages 1/2: the group's flat vector is the ranks' partitions one after the other; a tensor starts
    at ``base`` in it. Returns the vector's dtype (`_one_dtype`) and the reader."""
    dtype = _one_dtype(ranks)
    starts = [0]
    for r in ranks:
        starts.append(starts[-1] + r.numel)

    def read(first: int, count: int) -> torch.Tensor:
        lo, hi = base + first, base + first + count
        views: list[_Segment] = []
        for r, (a, b) in enumerate(zip(starts, starts[1:])):
            if b > lo and a < hi:
                ranks[r].read(max(lo, a) - a, min(hi, b) - max(lo, a), views)
        return _gather(views, count, dtype)

    return dtype, read


def _striped_reader(ranks: list[_Pieces], offset: int, per_rank: int) -> tuple[torch.dtype, Reader]:
    """Stage 3: a tensor's elements ``[r * per_rank, (r + 1) * per_rank)`` are at ``offset`` in rank r. Returns
    the ranks' dtype (`_one_dtype`) and the reader."""
    dtype = _one_dtype(ranks)

    def read(first: int, count: int) -> torch.Tensor:
        views: list[_Segment] = []
        at, end = first, first + count
        while at < end:
            r, i = divmod(at, per_rank)
            n = min(end - at, per_rank - i)
            ranks[r].read(offset + i, n, views)
            at += n
        return _gather(views, count, dtype)

    return dtype, read


# ---- the consolidated checkpoint -----------------------------------------------------------------------


@dataclass
class ZeroLayout:
    """What `read_zero` found (for reports and errors)."""

    tag_dir: Path
    stage: int
    world_size: int
    dtype: str  # the training dtype of the files ("bf16", "fp16" or "fp32")
    trainable: int
    frozen: int


def read_zero(path: str | os.PathLike[str], *, tag: str | None = None, safe_globals: Sequence[Any] = (),
              trust_pickle: bool = False) -> tuple[dict[str, Any], HeldInPieces, ZeroLayout]:
    """The consolidated checkpoint of a ZeRO directory (see the module's doc): ``(object, readers, layout)``,
    where ``readers`` maps a placeholder's ``data_ptr()`` to ``(meta tensor of the real shape and dtype,
    reader)``. ``safe_globals``: classes the files' pickles may build beyond DeepSpeed's (a run's own state
    holds numpy RNG states, argparse Namespaces); ``trust_pickle``: run the pickles instead."""
    tag_dir = resolve_tag(path, tag)
    model_parallel = sorted(p.name for p in tag_dir.iterdir()
                            if (m := MP_RANK.search(p.name)) is not None and int(m.group(1)) != 0)
    if model_parallel:
        raise FormatError(tag_dir, f"holds files of model-parallel ranks other than 0 ({', '.join(model_parallel[:3])}"
                          f"{', ...' if len(model_parallel) > 3 else ''}): a tensor- or pipeline-parallel ZeRO"
                          " checkpoint, whose model-parallel slices this reader does not join; consolidate it with"
                          " DeepSpeed's universal checkpoint (ds_to_universal.py) first")
    files = optim_files(tag_dir)
    optims = [_load(f, safe_globals, trust_pickle).get("optimizer_state_dict") for f in files]
    for f, o in zip(files, optims):
        if not isinstance(o, dict) or "zero_stage" not in o:
            raise FormatError(f, "no 'optimizer_state_dict' with a 'zero_stage': not a ZeRO optimizer file")
    stage = int(optims[0]["zero_stage"])
    world = len(optims)
    for f, o in zip(files, optims):  # every file: one left over from a run of another size reads as wrong values
        counts = o.get("partition_count")
        declared = max(counts) if isinstance(counts, (list, tuple)) and counts else counts
        if not (declared is None or isinstance(declared, int) and not isinstance(declared, bool)):
            raise FormatError(f, f"partition_count {str(counts)[:40]} is not a number of ranks: not a ZeRO optimizer"
                              " file")
        if declared is not None and declared != world:
            raise FormatError(f, f"this optimizer file says {declared} ranks but {world} files are here (a rank's"
                              " file missing, or left over from a run on another number of ranks)")
        if int(o["zero_stage"]) != stage:
            raise FormatError(f, f"this optimizer file is of ZeRO stage {int(o['zero_stage'])}, {files[0].name} of"
                              f" stage {stage}: files of two runs in one tag directory")
    if stage <= 2:
        model_files = [tag_dir / "mp_rank_00_model_states.pt"]
    else:
        model_files = [tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    for f in model_files:
        if not f.is_file():
            raise FormatError(f, "missing: every ZeRO checkpoint has its model states")
    models = [_load(f, safe_globals, trust_pickle) for f in model_files]
    optim_sources, model_sources = [_File(f) for f in files], [_File(f) for f in model_files]
    head = models[0]
    for key in ("module", "param_shapes", "buffer_names"):
        if key not in head:
            raise FormatError(model_files[0], f"no '{key}': not a DeepSpeed model states file")
    dtype = "bf16" if files[0].name.startswith("bf16_") else "fp32"
    if stage <= 2:
        obj, readers, trainable = _stages_1_2(head, optims, optim_sources)
    else:
        obj, readers, trainable = _stage_3(head, optims, optim_sources)
    model, frozen = _model_dict(head, models, model_sources, trainable, stage, readers)
    obj = {"model": model, "optim": obj, **{k: v for k, v in head.items() if k not in INTERNAL}}
    return obj, readers, ZeroLayout(tag_dir, stage, world, dtype, len(trainable), frozen)


def _stages_1_2(head: dict[str, Any], optims: list[dict[str, Any]], files: list[_File]
                ) -> tuple[dict[str, Any], dict[int, Any], dict]:
    readers: dict[int, Any] = {}
    trainable: dict[str, torch.Tensor] = {}
    names: list[list[str]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    offsets: dict[tuple[int, str], int] = {}
    weights = [[_Pieces([t], f) for t in o[STAGE_1_2_MASTERS]] for o, f in zip(optims, files)]
    paddings = optims[0].get("param_alignment_paddings")
    for g, (entries, at) in enumerate(stage_1_2_offsets(head["param_shapes"], paddings)):
        group_names = []
        ranks = [w[g] for w in weights]
        for name, shape, first in entries:
            shapes[name], offsets[(g, name)] = shape, first
            trainable[name] = stand_in(readers, shape, *_contiguous_reader(ranks, first))
            group_names.append(name)
        total = sum(r.numel for r in ranks)
        if at > total:
            raise FormatError("<optimizer files>", f"param group {g}: the parameters need {at} elements but the ranks'"
                              f" partitions hold {total}")
        names.append(group_names)
    bases = [group_optimizer_state(o, 1) for o in optims]
    starts_from_weights = {g: [w[g].numel for w in weights] for g in range(len(names))}

    state_ranks: dict[tuple[int, str], list[_Pieces] | None] = {}  # one per group and field, for every parameter

    def state_reader(g: int, name: str, field: str) -> tuple[torch.dtype, Reader] | None:
        if (g, field) not in state_ranks:
            parts = stage_1_2_field(bases, g, field)
            state_ranks[(g, field)] = None if parts is None else [
                _Pieces([p[:n]], f) for p, n, f in zip(parts, starts_from_weights[g], files)]
        ranks = state_ranks[(g, field)]
        return None if ranks is None else _contiguous_reader(ranks, offsets[(g, name)])

    return optim_tree(names, bases[0], _state_values(shapes, state_reader, readers)), readers, trainable


def _stage_3(head: dict[str, Any], optims: list[dict[str, Any]], files: list[_File]
             ) -> tuple[dict[str, Any], dict[int, Any], dict]:
    readers: dict[int, Any] = {}
    world = len(optims)
    weights = [_Pieces(list(o[STAGE_3_MASTERS]), f) for o, f in zip(optims, files)]
    trainable: dict[str, torch.Tensor] = {}
    names: list[list[str]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    spans: dict[str, tuple[int, int]] = {}  # name -> (offset in every rank's flat vector, elements per rank)
    groups, at = stage_3_spans(head["param_shapes"], world)
    for entries in groups:
        group_names = []
        for name, shape, first, per_rank in entries:
            shapes[name], spans[name] = shape, (first, per_rank)
            trainable[name] = stand_in(readers, shape, *_striped_reader(weights, first, per_rank))
            group_names.append(name)
        names.append(group_names)
    if at > weights[0].numel:
        raise FormatError("<optimizer files>", f"the parameters need {at} elements per rank, the flat groups hold"
                          f" {weights[0].numel}")
    bases = [group_optimizer_state(o, 3) for o in optims]

    state_ranks: dict[str, list[_Pieces] | None] = {}  # one per field, for every parameter

    def state_reader(g: int, name: str, field: str) -> tuple[torch.dtype, Reader] | None:
        if field not in state_ranks:
            per_rank = [_Pieces(parts, f) for parts, f in zip(stage_3_field(bases, field), files)]
            state_ranks[field] = None if any(p.numel != w.numel for p, w in zip(per_rank, weights)) else per_rank
        per_rank = state_ranks[field]
        if per_rank is None:
            return None
        offset, n = spans[name]
        return _striped_reader(per_rank, offset, n)

    group_names, merged = param_groups_of_sub_groups(names, bases[0])
    return optim_tree(group_names, merged, _state_values(shapes, state_reader, readers)), readers, trainable


def _state_values(shapes: dict[str, tuple[int, ...]],
                  state_readers: Callable[[int, str, str], tuple[torch.dtype, Reader] | None],
                  readers: dict[int, Any]) -> Callable[[int, str, str, Any], Any]:
    """`zero_layout.optim_tree`'s per-parameter value of a field of the flat state: a 0-dim tensor (the step) a copy
    of its own (optimizers add to it in place), a flat tensor the parameter's elements of it (a placeholder read by
    its reader; `SKIP` where the field's partitions do not match the weights'), anything else as it is."""

    def value(g: int, name: str, field: str, flat: Any) -> Any:
        if isinstance(flat, torch.Tensor) and flat.dim() == 0:
            return flat.clone()
        if isinstance(flat, torch.Tensor):
            found = state_readers(g, name, field)  # (the ranks' dtype: rank 0's ``flat``'s, checked against the others')
            return SKIP if found is None else stand_in(readers, shapes[name], *found)
        return flat

    return value


def _model_dict(head: dict[str, Any], models: list[dict[str, Any]], files: list[_File],
                trainable: dict[str, torch.Tensor], stage: int, readers: dict[int, Any]) -> tuple[dict[str, Any], int]:
    """`zero_layout.model_dict`, stage 3's frozen parameters read from every rank's fragment."""

    def striped_frozen(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        per_rank = math.ceil(math.prod(shape) / len(models))
        ranks = [_Pieces([m["frozen_param_fragments"][name]], f) for m, f in zip(models, files)]
        return stand_in(readers, shape, *_striped_reader(ranks, 0, per_rank))

    return model_dict(head, trainable, stage, striped_frozen)
