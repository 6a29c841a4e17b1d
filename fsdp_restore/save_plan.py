"""The write plan of `save_sharded`: the checkpoint's header from the sharded model, and this rank's bytes.

The mirror of plan.py. Every rank builds the object a conversion of the gathered checkpoint would hold
(``{"model": state dict, "optim": Optimizer.state_dict(), **extra}``, or the bare state dict in weights-only
mode) with stand-in tensors that carry only the global shape and dtype (`write.stand_in`), flattens it
with the conversion's own `flatten`, and lays the file(s) out with the writer's own `file_layout` and
`file_header`: the header is the conversion's, byte for byte, and no rank holds any tensor but its own.

Then each stored tensor gets this rank's `WriteItem` s, from the restore's layout (`shards.local_targets`):
an FSDP2 ``Shard(0)`` block is one range, an FSDP1 flat-parameter segment one range (padding is in no
piece), a ``Shard(1)`` column block one item of rows at a stride. A piece that several ranks hold alike
(DDP, plain modules, ``Replicate`` mesh dims, HSDP and FSDP1 hybrid replicas) is written by exactly one
of them: a large piece is cut into one part per replica, a small one goes whole to one replica chosen by
its name (so the work spreads); a buffer, whose replicas may differ (BatchNorm statistics under DDP), is
written whole by the first replica. Optimizer state laid out like its parameter follows the parameter's
pieces; every other value (step counters, param-group tensors, ``extra``) is written by rank 0 (a step
counter, where ranks hold state for different parameters, by the lowest rank holding elements of its parameter:
one holding none never steps it, `merge_schemas`).

Coverage is proven like the restore's (`check.coverage_terms`, summed over ranks in the verdict's one
all-reduce): plus a count term per tensor, so that the ranks together write every element exactly once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from torch import nn

from .buffers import fingerprint
from .check import coverage_terms, name_weight
from .errors import FsdpRestoreError
from .flatten import flatten, iter_tensor_nodes
from .format import META_SET_ID
from .jobs import plan_jobs
from .shards import (EXTRA_STATE, Piece, Target, _fsdp1_units, _is_dtensor, _join, clean_name, ddp_prefix,
                     frozen_parameter_names, local_targets, local_tensor, state_dict_code)
from .write import HeldInPieces, OutputFile, TensorJob, file_header, file_layout, stand_in

from .optim_plan import live_groups

SPLIT_MIN_BYTES = 4 * 1024 * 1024  # a replicated piece below this is written whole by one replica


@dataclass
class WriteItem:
    """Write ``data`` (contiguous 1-D local memory) into stored tensor ``key`` at global flat element
    ``global_start``; with ``rows > 1``, ``data`` holds ``rows`` runs of equal length that lie ``stride``
    elements apart in the stored tensor (a column block). ``name`` is what the coverage proof calls it."""

    key: str
    data: torch.Tensor
    global_start: int
    global_numel: int
    rows: int = 1
    stride: int = 0

    @property
    def name(self) -> str:
        return self.key

    @property
    def dest(self) -> torch.Tensor:  # the attribute `check.coverage_terms` counts elements of
        return self.data

    @property
    def run(self) -> int:
        return self.data.numel() // self.rows if self.rows else 0


@dataclass
class FilePlan:
    """One output file: its name in the set ("" for a single file), its header and each key's offset."""

    name: str
    header: bytes
    offsets: dict[str, int]
    jobs: list[TensorJob]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def size(self) -> int:
        return self.data_start + sum(j.nbytes for j in self.jobs)


@dataclass
class WritePlan:
    structure_json: str
    files: list[FilePlan]
    items: list[WriteItem] = field(default_factory=list)
    where: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (file index, absolute offset)
    jobs: dict[str, TensorJob] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)  # extra metadata of every file (and the index)
    # (name, fingerprint) of each parameter every rank holds whole with nothing keeping the copies equal (no DDP):
    # the ranks compare them before writing, as the file takes each from whichever replica writes it
    replica_prints: list[tuple[str, int]] = field(default_factory=list)

    def coverage(self, rank: int) -> dict[str, tuple[int, int]]:
        """The restore's moment terms of this rank's items, plus per tensor a count term (the elements this
        rank writes, minus the tensor's size on rank 0): all sum to zero over the ranks exactly when every
        element of every stored tensor is written once."""
        terms = coverage_terms(self.items)
        counts: dict[str, int] = {}
        for item in self.items:
            counts[item.key] = counts.get(item.key, 0) + item.data.numel()
        if rank == 0:
            for key, job in self.jobs.items():
                counts[key] = counts.get(key, 0) - prod(job.source.shape)
        for key, c in counts.items():
            if c:
                terms[f"{key} (elements written)"] = (c, 0)
        return terms

    def output_files(self) -> list[OutputFile]:
        return [OutputFile(f.name, f.jobs, f.metadata) for f in self.files]


# ---- who holds what, and which replica writes it --------------------------------------------------------


def state_dict_names(model: nn.Module, extra_states: Collection[str] = ()) -> list[str]:
    """The model's state-dict names (clean, tied names included) in ``state_dict()`` order, from the module
    tree: no state dict is built (FSDP1's would gather). FSDP1 flat parameters are expanded in place of the
    modules that registered the original parameters; ``extra_states``: the modules' extra-state entries
    (`shards.extra_state_modules`), each after its module's buffers."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    top = ddp_prefix(model)
    flat_params: dict[int, list[str]] = {}  # id(original module) -> its parameter names held by a flat param
    for _, handle in _fsdp1_units(model):
        flat = handle.flat_param
        for info in flat._param_infos:
            flat_params.setdefault(id(info.module), []).append(info.param_name)
        for info in flat._shared_param_infos:
            flat_params.setdefault(id(info.module), []).append(info.param_name)
    names: list[str] = []
    seen: set[str] = set()

    def add(name: str) -> None:
        name = clean_name(name.removeprefix(top))
        if name not in seen:
            seen.add(name)
            names.append(name)

    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module._parameters.items():
            if p is not None and not isinstance(p, FlatParameter):
                add(_join(mod_name, p_name))
        for p_name in flat_params.get(id(module), ()):
            add(_join(mod_name, p_name))
        for b_name, b in module._buffers.items():
            if b is not None and b_name not in module._non_persistent_buffers_set:
                add(_join(mod_name, b_name))
        if (extra_states and type(module).get_extra_state is not nn.Module.get_extra_state
                and clean_name(_join(mod_name, EXTRA_STATE).removeprefix(top)) in extra_states):
            add(_join(mod_name, EXTRA_STATE))  # the module's own, not a wrapper's of the same clean name
    return names


def _fsdp1_buffer_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """``{clean buffer name: dtype}`` of the buffers an FSDP1 unit with mixed precision for buffers holds in
    ``buffer_dtype`` (cast so at the first forward): their dtype before that, which FSDP1's state dict casts them
    back to (the outermost unit's record, taken at its construction)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return {}
    top = ddp_prefix(model)
    out: dict[str, torch.dtype] = {}
    for mod_name, module in model.named_modules():
        if not isinstance(module, FSDP) or getattr(getattr(module, "mixed_precision", None), "buffer_dtype",
                                                    None) is None:
            continue
        prefix = clean_name(mod_name.removeprefix(top))
        for buf_name, dtype in getattr(module, "_buffer_name_to_orig_dtype", {}).items():
            out.setdefault(_join(prefix, clean_name(buf_name)), dtype)
    return out


def _replicas(model: nn.Module, targets: Sequence[Target], rank: int, world: int) -> dict[str, tuple[int, int]]:
    """``{target name: (replicas, this rank's replica index)}``: how many ranks hold the same pieces."""
    by_name: dict[str, torch.Tensor] = {}
    top = ddp_prefix(model)
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        by_name.setdefault(clean_name(name.removeprefix(top)), t)
    fsdp1: dict[str, tuple[int, int]] = {}
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        FSDP = None  # noqa: N806
    if FSDP is not None:
        import torch.distributed as dist

        for mod_name, module in model.named_modules():
            handle = getattr(module, "_handle", None) if isinstance(module, FSDP) else None
            if handle is None:
                continue
            shard_ranks = handle.world_size if handle.uses_sharded_strategy else 1
            replicas = max(1, world // max(1, shard_ranks))
            inter = getattr(module, "_inter_node_pg", None)
            if replicas > 1 and inter is not None and shard_ranks > 1:
                index = dist.get_rank(inter)
            else:
                index = rank // shard_ranks if shard_ranks > 1 else rank
            prefix = clean_name(mod_name)
            for fqn in handle.flat_param._fqns:
                fsdp1[_join(prefix, clean_name(fqn))] = (replicas, index)
    out: dict[str, tuple[int, int]] = {}
    for target in targets:
        if target.layout == "fsdp1":
            out[target.name] = fsdp1.get(target.name, (1, 0))
        elif target.layout == "dtensor":
            dt = by_name[target.name]
            mesh = dt.device_mesh
            coord = mesh.get_coordinate()
            replicas, index = 1, 0
            if mesh.size() != world:  # a sub-mesh (FSDP over "dp" of a dp x tp mesh): the other dims replicate it
                replicas, index = _sub_mesh_replica(target.name, mesh, world)
            for d, placement in enumerate(dt.placements):
                if placement.is_replicate():
                    index = index * mesh.size(d) + coord[d]
                    replicas *= mesh.size(d)
            out[target.name] = (replicas, index)
        else:
            out[target.name] = (world, rank)
    return out


def _sub_mesh_replica(name: str, mesh: Any, world: int) -> tuple[int, int]:
    """(replicas, this rank's replica index) of a tensor whose device mesh is a sub-mesh of a root mesh of all
    ``world`` ranks: the root's dimensions along which the sub-mesh's ranks do not vary hold its other copies.
    Told from the ranks themselves, not the dimensions' names, so that a flattened sub-mesh (torchtitan's
    ``dp_shard_cp``, FSDP over data x context parallel beside tensor parallel) is one too."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else None
    if root is None or root.size() != world or root.get_coordinate() is None:
        raise FsdpRestoreError(f"{name}: its device mesh spans {mesh.size()} of the {world} ranks and is not part of"
                               " a device mesh of all of them, so nothing says who else holds it; save with a"
                               " process group of the mesh's ranks")
    ranks = root.mesh
    own = root.get_coordinate()
    members = set(mesh.mesh.flatten().tolist())
    varying, fixed = [], []
    for d in range(ranks.dim()):
        along = [int(ranks[(*own[:d], i, *own[d + 1:])]) for i in range(ranks.size(d))]
        inside = [r in members for r in along]
        if all(inside) and ranks.size(d) > 1:
            varying.append(d)
        elif sum(inside) == 1:
            fixed.append(d)
        else:
            varying = None  # the sub-mesh takes some, not all, of this dimension's ranks: no slice of the root
            break
    if varying is None or prod(ranks.size(d) for d in varying) != mesh.size():
        raise FsdpRestoreError(f"{name}: its device mesh (ranks {sorted(members)}) is not a slice of the root mesh of"
                               f" all {world} ranks (shape {tuple(ranks.shape)}), so nothing says who else holds"
                               " it; save with a process group of the mesh's ranks")
    replicas, index = 1, 0
    for d in fixed:
        index = index * ranks.size(d) + own[d]
        replicas *= ranks.size(d)
    return replicas, index


def _unsynced_replica_prints(model: nn.Module, targets: Sequence[Target], replicas: dict[str, tuple[int, int]],
                             world: int) -> list[tuple[str, int]]:
    """`WritePlan.replica_prints`: plain (neither DTensor nor FSDP1) parameters held whole by every rank of a model
    that DistributedDataParallel does not wrap. FSDP, tensor parallel and DDP keep their replicas equal; such a
    parameter is kept equal by nothing (a module outside ``fully_shard``), and its replicas may have drifted."""
    if world <= 1 or ddp_prefix(model):
        return []
    return [(t.name, fingerprint(t.pieces[0].dest) if t.pieces else 0) for t in targets
            if t.kind == "param" and t.layout not in ("dtensor", "fsdp1") and replicas[t.name][0] > 1]


def _my_part(key: str, data: torch.Tensor, start: int, rows: int, stride: int, replicas: int,
             index: int) -> list[tuple[torch.Tensor, int, int, int]]:
    """This replica's share of a piece that ``replicas`` ranks hold alike: (data, start, rows, stride)."""
    if replicas <= 1:
        return [(data, start, rows, stride)] if data.numel() else []
    if data.numel() * data.element_size() < SPLIT_MIN_BYTES:
        owner = name_weight(f"{key}@{start}", b"owner") % replicas
        return [(data, start, rows, stride)] if owner == index and data.numel() else []
    if rows <= 1:
        n = data.numel()
        lo, hi = n * index // replicas, n * (index + 1) // replicas
        return [(data[lo:hi], start + lo, 1, 0)] if hi > lo else []
    run = data.numel() // rows
    lo, hi = rows * index // replicas, rows * (index + 1) // replicas
    if hi <= lo:
        return []
    return [(data[lo * run:hi * run], start + lo * stride, hi - lo, stride if hi - lo > 1 else 0)]


# ---- the object, with stand-ins --------------------------------------------------------------------------


@dataclass
class _Shaped:
    """A stored tensor this rank writes parts of: its pieces of local memory and how many ranks hold them."""

    pieces: list[tuple[torch.Tensor, Piece]]  # (local 1-D data, the piece it follows)
    replicas: tuple[int, int]
    # a buffer: written whole by the first replica. Replicas of a parameter are equal (DDP all-reduces the
    # gradients), but a buffer's may differ (BatchNorm's running statistics, from each rank's own batch): the
    # file holds one rank's, rank 0's where it holds them, as a gather to rank 0 would, never a mix
    first_replica_only: bool = False


@dataclass
class _Whole:
    """A stored tensor written whole by one rank (``owner``) from its own memory."""

    value: torch.Tensor | None  # None on ranks that are not its owner and do not hold it
    owner: int = 0


def _never(first: int, count: int) -> torch.Tensor:  # stand-ins are never read: each rank writes its pieces
    raise AssertionError("save_sharded stand-ins are not read")


def build_write_plan(model: nn.Module, *, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None,
                     weights_only: bool, rank: int, world: int, max_shard_size: int | None,
                     remote_state: dict[str, tuple[int, list[tuple]]] | None = None,
                     set_id: str | None = None, on_unsupported: str = "error",
                     extra_states: dict[str, Any] | None = None, ignore_frozen_params: bool = False) -> WritePlan:
    """This rank's write plan (see the module docstring). ``remote_state``: `merge_schemas` of every rank's
    `state_schema`, for optimizers whose ranks hold state only for parameters they hold elements of (FSDP1
    with ``use_orig_params``). Raises `FsdpRestoreError` for a layout or state that cannot be saved this way;
    the caller turns it into the verdict. ``set_id``: the id every shard of a sharded set carries (rank 0's).
    ``extra_states``: ``{entry name: value}`` of the modules' extra states (rank 0's ``get_extra_state()``), stored
    in the model's state dict where ``state_dict()`` puts them. ``ignore_frozen_params``: the model's state dict
    without the parameters that do not require grad (`frozen_parameter_names`)."""
    import json

    _refuse_state_dict_hooks(model)
    targets, aliases = local_targets(model)
    bad = [f"{t.name}: {t.unsupported}" for t in targets if t.unsupported]
    if bad:
        raise FsdpRestoreError("cannot save these layouts: " + "; ".join(bad[:5]))
    on_meta = [t.name for t in targets if any(p.dest.is_meta for p in t.pieces)]
    if on_meta:
        raise FsdpRestoreError(f"parameters on the meta device ({', '.join(on_meta[:5])}): nothing to save")
    by_name = {t.name: t for t in targets}
    replicas = _replicas(model, targets, rank, world)
    held: HeldInPieces = {}
    sources: dict[int, _Shaped | _Whole] = {}  # stand-in data_ptr -> what this rank writes of it

    def shaped(shape: tuple[int, ...], dtype: torch.dtype, pieces: list[tuple[torch.Tensor, Piece]],
               rep: tuple[int, int], first_replica_only: bool = False) -> torch.Tensor:
        t = stand_in(held, shape, dtype, _never)
        sources[t.data_ptr()] = _Shaped(pieces, rep, first_replica_only)
        return t

    def whole(value: torch.Tensor | None, where: str, owner: int = 0, shape: tuple[int, ...] = (),
              dtype: torch.dtype | None = None) -> torch.Tensor:
        if value is not None and _is_dtensor(value):
            raise FsdpRestoreError(f"{where}: a DTensor not laid out like its parameter cannot be saved")
        if value is not None:
            shape, dtype = tuple(value.shape), value.dtype
        t = stand_in(held, shape, dtype, _never)
        sources[t.data_ptr()] = _Whole(value, owner)
        return t

    # the model: state-dict order, one stand-in per tensor (a tied name refers to its tensor's stand-in)
    extra_states = extra_states or {}
    names = state_dict_names(model, extra_states)
    known = set(by_name) | set(aliases) | set(extra_states)
    if set(names) != known:
        diff = sorted(set(names) ^ known)
        raise FsdpRestoreError(f"the model's state-dict names and its tensors differ: {', '.join(diff[:8])}")
    if ignore_frozen_params:
        frozen = frozen_parameter_names(model)
        params = {n for n in names if n not in extra_states and by_name[aliases.get(n, n)].kind == "param"}
        if params and params <= frozen:
            raise FsdpRestoreError("ignore_frozen_params=True, and no parameter of the model requires grad: there is"
                                   " nothing trained to save; save without it, or unfreeze what is trained first")
        names = [name for name in names if name not in frozen]
    model_stand_ins: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    buffer_dtypes = _fsdp1_buffer_dtypes(model)
    for name in names:
        if name in extra_states:  # rank 0's value, sent to every rank: its tensors written by rank 0 (below)
            state[name] = extra_states[name]
            continue
        canonical = aliases.get(name, name)
        if canonical not in model_stand_ins:
            target = by_name[canonical]
            dtype, pieces = target.dtype, [(p.dest, p) for p in target.pieces]
            if target.kind == "buffer" and buffer_dtypes.get(canonical, dtype) != dtype:
                # as FSDP1's state dict gives it: in its dtype before mixed precision cast it (an exact cast back)
                dtype = buffer_dtypes[canonical]
                pieces = [(data.to(dtype), p) for data, p in pieces]
            model_stand_ins[canonical] = shaped(target.global_shape, dtype, pieces, replicas[canonical],
                                                first_replica_only=target.kind == "buffer")
        state[name] = model_stand_ins[canonical]

    if weights_only:
        obj: Any = state
    else:
        obj = {"model": state}
        if optimizer is not None:
            obj["optim"] = _optimizer_object(model, optimizer, targets, aliases, replicas, shaped, whole,
                                             remote_state)
        for k, v in (extra or {}).items():
            if k in obj:
                raise FsdpRestoreError(f"extra has the key '{k}', which the checkpoint uses for the"
                                       f" {'model' if k == 'model' else 'optimizer'}; rename it")
            obj[k] = v
    tensors, structure = flatten(obj, on_unsupported=on_unsupported)  # type: ignore[arg-type]
    structure_json = json.dumps(structure, separators=(",", ":"))
    kinds: dict[str, _Shaped | _Whole] = {}
    for key, t in tensors.items():
        ptr = t.data_ptr()
        if t.numel() == 1 and ptr in held:
            tensors[key] = held[ptr][0]
            kinds[key] = sources[ptr]
        else:  # a tensor of extra itself (rank 0's, sent to every rank): rank 0 writes it
            kinds[key] = _Whole(t)
    jobs = plan_jobs(tensors, structure, None)
    metadata: dict[str, str] = {}
    if weights_only:  # {dropped name: kept name} of tied tensors, as safetensors.torch.save_model records them
        metadata = {path: node["key"] for path, node in iter_tensor_nodes(structure["root"])
                    if path != node["key"] and "view" not in node}
    if max_shard_size is not None and set_id is not None:
        metadata[META_SET_ID] = set_id
    plan = WritePlan(structure_json, [], metadata=metadata,
                     replica_prints=_unsynced_replica_prints(model, targets, replicas, world))
    for f in file_layout(jobs, structure_json=structure_json, max_shard_size=max_shard_size, metadata=metadata):
        header, offsets = file_header(f.jobs, f.metadata)
        plan.files.append(FilePlan(f.name, header, offsets, f.jobs, f.metadata))
        for job in f.jobs:
            plan.where[job.key] = (len(plan.files) - 1, len(header) + offsets[job.key])
            plan.jobs[job.key] = job
    for job in jobs:
        kind, numel = kinds[job.key], prod(job.source.shape)
        if isinstance(kind, _Whole):
            if rank == kind.owner and numel:
                if kind.value is None:
                    raise FsdpRestoreError(f"{job.key}: this rank was to write it but does not hold it (a bug)")
                value = kind.value.detach()
                if value.device.type != "cpu" or not value.is_contiguous():
                    value = value.to("cpu").contiguous()  # small values: step counters, extra
                plan.items.append(WriteItem(job.key, value.reshape(-1), 0, numel))
            continue
        for data, piece in kind.pieces:
            if kind.first_replica_only:
                parts = [(data, piece.start, piece.rows, piece.stride)] if kind.replicas[1] == 0 and data.numel() \
                    else []
            else:
                parts = _my_part(job.key, data, piece.start, piece.rows, piece.stride, *kind.replicas)
            for part, start, rows, stride in parts:
                plan.items.append(WriteItem(job.key, part, start, numel, rows, stride))
    return plan


def _optimizer_object(model: nn.Module, optimizer: torch.optim.Optimizer, targets: Sequence[Target],
                      aliases: dict[str, str], replicas: dict[str, tuple[int, int]], shaped: Any,
                      whole: Any, remote_state: dict[str, tuple[int, list[tuple]]] | None = None) -> dict[str, Any]:
    """``Optimizer.state_dict()`` of the unsharded model, with stand-ins: integer ids numbered group by group
    in the order an unsharded optimizer over the same parameters holds them (an FSDP1 flat parameter expands
    to its original parameters, in the model's order, as the restore maps them), state in the order torch's
    holds it (below), every
    group with ``param_names`` (where the group has it, else just before ``params``, which comes last)."""
    by_name = {t.name: t for t in targets}
    groups, ordered = live_groups(model, optimizer, targets, aliases)  # names in the order torch numbers them
    id_of: dict[str, int] = {}
    packed_groups = []
    for g, (group, slots, names) in enumerate(zip(optimizer.param_groups, groups, ordered)):
        for slot in slots:
            if slot.unsupported:
                raise FsdpRestoreError("optimizer state of " + "; ".join(slot.unsupported[:3]))
        for name in names:
            id_of[name] = len(id_of)
        packed: dict[str, Any] = {}
        for k, v in group.items():
            if k == "param_names":
                packed[k] = list(names)
            elif k != "params":
                packed[k] = _group_value(v, f"optim.param_groups.{g}.{k}", whole)
        packed.setdefault("param_names", list(names))
        packed["params"] = [id_of[n] for n in names]
        packed_groups.append(packed)
    slot_of = {id(s.param): s for slots in groups for s in slots}
    if any(id(p) not in slot_of for p in optimizer.state):
        raise FsdpRestoreError("the optimizer holds state for a parameter that is in none of its groups")
    entries: list[tuple[int, dict[str, Any]]] = []
    for slot in (s for slots in groups for s in slots):
        param_state = optimizer.state.get(slot.param)
        sharded = any(by_name[t].layout != "full" for t in slot.global_shapes)  # its state: each rank's own part
        for name in slot.names:
            pid = id_of[name]
            fields: dict[str, Any] = {}
            owner = remote_state[name][0] if remote_state and name in remote_state else 0
            if param_state:
                for fld, value in param_state.items():
                    where = f"optim.state.{pid}.{fld} ({name})"
                    if isinstance(value, torch.Tensor) and _like_param(value, slot):
                        flat = local_tensor(value).reshape(-1)
                        pieces = [(flat[off:off + piece.dest.numel()], piece)
                                  for target, off, piece in slot.pieces if target.name == name]
                        fields[fld] = shaped(tuple(slot.global_shapes[name]), value.dtype, pieces, replicas[name])
                    elif isinstance(value, torch.Tensor):
                        if value.dim() > 0 and sharded:
                            _refuse_own_state(value, where, slot)
                        fields[fld] = whole(value, where, owner)
                    else:
                        if sharded:
                            _refuse_nested_state(value, f"optim.state.{pid}.{fld}", name, slot)
                        fields[fld] = _group_value(value, where, whole)
            elif remote_state and name in remote_state:
                # another rank holds this parameter's state: this rank holds none of its elements (FSDP1 with
                # use_orig_params keeps no state for an empty local view), so it only needs the layout
                if any(piece.dest.numel() for target, _, piece in slot.pieces if target.name == name):
                    raise FsdpRestoreError(f"{name}: this rank holds elements of it but no optimizer state, another"
                                           " rank holds state: the optimizer's state differs between ranks")
                for fld, kind, *info in remote_state[name][1]:
                    if kind == "shaped":
                        fields[fld] = shaped(tuple(slot.global_shapes[name]), _dtype(info[0]), [], replicas[name])
                    elif kind == "whole":
                        fields[fld] = whole(None, name, owner, tuple(info[0]), _dtype(info[1]))
                    else:
                        fields[fld] = info[0]
            else:
                continue
            entries.append((pid, fields))
    # as an unsharded optimizer holds it: in the order its parameters first got state (a parameter without a
    # gradient on the first step comes later), where each rank's optimizer holds one parameter per name and state
    # for all of them (the same steps: the same order on every rank); else in id order (FSDP1's flat parameters, and
    # FSDP1 with use_orig_params where a rank holds no state for the parameters it holds no elements of)
    position = {id(p): i for i, p in enumerate(optimizer.state)}
    first_state = {id_of[name]: position.get(id(slot.param), len(position)) for slots in groups for slot in slots
                   for name in slot.names}
    if remote_state is None and all(len(slot.names) == 1 for slots in groups for slot in slots):
        state = dict(sorted(entries, key=lambda e: (first_state[e[0]], e[0])))
    else:
        state = dict(sorted(entries, key=lambda e: e[0]))
    return {"state": state, "param_groups": packed_groups}


def _refuse_state_dict_hooks(model: nn.Module) -> None:
    """Modules whose ``state_dict()`` is not their parameters and buffers as they hold them (`state_dict_code`): the
    save writes what the modules hold under their names, so the file would not be the state dict it stands for."""
    offenders = state_dict_code(list(model.named_modules()), loading=False)
    if offenders:
        raise FsdpRestoreError(
            f"modules whose state_dict() is not what they hold ({len(offenders)}): {'; '.join(offenders[:10])}"
            f"{' ...' if len(offenders) > 10 else ''}; save_sharded writes the parameters and buffers as they are,"
            " which would not be the state dict the file stands for: remove the hook, or save this model with"
            " torch.distributed.checkpoint (get_model_state_dict)")


def _refuse_own_state(value: torch.Tensor, where: str, slot: Any) -> None:
    """A state tensor of a sharded parameter not laid out like it is each rank's own (Adafactor's row and column
    factors, a Shampoo-like preconditioner): rank 0's copy would be written as the whole model's."""
    local = tuple(local_tensor(slot.param).shape)
    if not _is_dtensor(value) and _is_dtensor(slot.param) and tuple(value.shape) == local:
        how = (f"a plain tensor shaped like this rank's shard ({list(local)}) of a DTensor parameter; the state of"
               " one must be a DTensor laid out like it (torch.zeros_like(param), as torch's optimizers make it)")
    else:
        how = (f"state of shape {list(value.shape)}, not laid out like its sharded parameter, is each rank's own: it"
               " cannot be saved as the unsharded model's (save this optimizer with torch.distributed.checkpoint)")
    raise FsdpRestoreError(f"{where}: {how}")


def _refuse_nested_state(value: Any, path: str, name: str, slot: Any) -> None:
    """`_refuse_own_state` for the tensors that a sharded parameter's state (``path``, of parameter ``name``) holds
    in a dict, list or tuple (a preconditioner's factors): none is laid out so that the ranks' parts make one
    tensor; only 0-dim values (the same on every rank, as a step count) are written, as rank 0's."""
    if _is_dtensor(value):
        raise FsdpRestoreError(f"{path} ({name}): a DTensor within a parameter's optimizer state (not at its top"
                               " level) cannot be saved as the unsharded model's (keep it at the top level of the"
                               " state, or save this optimizer with torch.distributed.checkpoint)")
    if isinstance(value, torch.Tensor):
        if value.dim() > 0:
            _refuse_own_state(value, f"{path} ({name})", slot)
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_nested_state(item, f"{path}.{key}", name, slot)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _refuse_nested_state(item, f"{path}.{i}", name, slot)


def _like_param(value: torch.Tensor, slot: Any) -> bool:
    """State laid out like its parameter's local shard (exp_avg, ...); 0-dim values (step) never are."""
    if value.dim() == 0 or _is_dtensor(value) != _is_dtensor(slot.param):
        return False
    if _is_dtensor(value) and (value.device_mesh != slot.param.device_mesh
                               or value.placements != slot.param.placements):
        return False
    local = local_tensor(value)
    return tuple(local.shape) == tuple(slot.local.shape) and local.is_contiguous()


def _group_value(value: Any, where: str, whole: Any) -> Any:
    """A hyperparameter or scalar state value: tensors (a tensor lr) written whole by rank 0."""
    if isinstance(value, torch.Tensor):
        return whole(value, where)
    return value


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def needs_state_schema(model: nn.Module) -> bool:
    """Whether ranks may hold optimizer state for different parameters: FSDP1 with ``use_orig_params`` keeps
    none for a parameter of which a rank holds no element."""
    return any(getattr(handle, "_use_orig_params", False) for _, handle in _fsdp1_units(model))


def state_schema(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[bool, list[tuple]]]:
    """``{name: (holds elements, [(field, "shaped", dtype) | (field, "whole", shape, dtype) | (field, "value",
    value)])}`` of the optimizer state this rank holds, for ranks that hold none of some parameter's
    (`merge_schemas`), and whether this rank holds any element of that parameter."""
    from .format import torch_dtype_name

    targets, aliases = local_targets(model)
    groups, _ = live_groups(model, optimizer, targets, aliases)
    out: dict[str, tuple[bool, list[tuple]]] = {}
    for slot in (s for slots in groups for s in slots):
        param_state = optimizer.state.get(slot.param)
        if not param_state:
            continue
        fields: list[tuple] = []
        for fld, value in param_state.items():
            if isinstance(value, torch.Tensor) and _like_param(value, slot):
                fields.append((fld, "shaped", torch_dtype_name(value.dtype)))
            elif isinstance(value, torch.Tensor):
                fields.append((fld, "whole", tuple(value.shape), torch_dtype_name(value.dtype)))
            else:
                fields.append((fld, "value", value))
        for name in slot.names:
            out[name] = (slot.local.numel() > 0, fields)
    return out


def merge_schemas(schemas: Sequence[dict[str, tuple[bool, list[tuple]]] | None]
                  ) -> dict[str, tuple[int, list[tuple]]]:
    """Every rank's `state_schema` (in rank order) -> ``{name: (rank, fields)}``: the rank that writes its whole
    values (step), the lowest holding elements of the parameter, else the lowest holding its state. A rank that
    holds none of its elements and yet has state (Adagrad makes state for every parameter; a restore or torch's
    get_state_dict can make it) never steps it: its step counter stays where it was."""
    merged: dict[str, tuple[int, list[tuple]]] = {}
    with_elements: set[str] = set()
    for rank, schema in enumerate(schemas):
        for name, (holds, fields) in (schema or {}).items():
            if name not in merged or (holds and name not in with_elements):
                merged[name] = (rank, fields)
            if holds:
                with_elements.add(name)
    return merged
