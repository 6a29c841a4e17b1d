"""The read plan: which stored elements go into which local memory, for the model and its optimizer.

`build_plan` computes this rank's layout once (`shards.local_targets`), walks the checkpoint's
structure once, and returns a `ReadPlan`: one `ReadItem` per contiguous run ("read ``dest.numel()``
elements of stored tensor ``key`` from ``src_start`` into ``dest``"), the optimizer state tensors the
items fill (not installed yet), and every problem found (missing, unexpected, shape, dtype...).
Nothing is read and nothing of the model or optimizer is modified here; planning problems are
collected, never raised, so that every rank still reaches the verdict (see verdict.py). The plan is
checked against the model's own storage before any byte is read (`check.validate_plan`), as
``torch.distributed.checkpoint`` validates its global plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import key_map as key_maps
from .errors import FsdpRestoreError
from .flatten import iter_tensor_nodes, subtree, unflatten
from .key_map import KeyMap
from .read import Checkpoint
from .shards import Piece, Target, _fsdp1_units, _is_dtensor, _join, clean_name, local_targets, local_tensor

_GROUP_SKIP = ("params", "param_names")


@dataclass(frozen=True)
class Source:
    """Where a named tensor's elements start inside a stored tensor (views of a stored buffer too)."""

    key: str
    start: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ReadItem:
    """Read ``dest.numel()`` elements of stored tensor ``key`` from flat element ``src_start`` into
    ``dest`` (a contiguous 1-D view of local memory). ``name`` is the model tensor (``optim:NAME.FIELD``
    for optimizer state) and ``global_start`` the flat index in that tensor where ``dest`` begins.

    With ``rows > 1`` the elements are ``rows`` runs of ``dest.numel() // rows``, ``stride`` elements
    apart both in the stored tensor and in the model tensor (a column block: one item, not one per row)."""

    key: str
    src_start: int
    dest: torch.Tensor
    name: str
    global_start: int
    global_numel: int
    rows: int = 1
    stride: int = 0
    done: bool = False

    @property
    def run(self) -> int:
        return self.dest.numel() // self.rows if self.rows else 0

    @property
    def span(self) -> int:
        """Elements from the first to the last one read, gaps between runs included."""
        if self.rows <= 1:
            return self.dest.numel()
        return (self.rows - 1) * self.stride + self.run if self.dest.numel() else 0


@dataclass
class RestoreReport:
    """What a restore did on this rank (model weights, or optimizer state)."""

    tensors: int = 0
    elements: int = 0  # elements read into local memory
    checked_elements: int = 0  # local elements NaN-filled and screened by the check
    bytes_read: int = 0
    seconds: float = 0.0
    cast: list[str] = field(default_factory=list)  # "name: stored dtype -> model dtype"
    nan_in_checkpoint: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # only when strict=False
    unexpected: list[str] = field(default_factory=list)  # only when strict=False
    prefix: str = ""
    method: str = "read"
    # seconds per phase of the whole restore call: "plan" (open, plan, validate, agree), "read" (with the
    # ledger's fill and screen on the read threads), "check" (the verdict of the check), "agree"
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class OptimizerPlan:
    """Optimizer state to install once every read has been checked (`install`)."""

    optimizer: torch.optim.Optimizer
    state: dict[torch.Tensor, dict[str, Any]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    # (param, field) of every state tensor laid out like its parameter's local shard: the check covers them
    shaped: list[tuple[torch.Tensor, str]] = field(default_factory=list)

    def install(self) -> None:
        for current, saved in zip(self.optimizer.param_groups, self.groups):
            current.update(saved)
        self.optimizer.state.clear()
        for param, state in self.state.items():
            self.optimizer.state[param] = state


@dataclass
class ReadPlan:
    items: list[ReadItem] = field(default_factory=list)
    problems: dict[str, list[str]] = field(default_factory=dict)
    model_report: RestoreReport | None = None
    optim_report: RestoreReport | None = None
    optim: OptimizerPlan | None = None
    # names the caller accepted as missing (strict=False): the check leaves their memory untouched
    skipped: set[str] = field(default_factory=set)
    # names not planned because of a problem already reported (missing, shape, dtype)
    refused: set[str] = field(default_factory=set)
    targets: list[Target] = field(default_factory=list)

    def add_problem(self, kind: str, text: str) -> None:
        self.problems.setdefault(kind, []).append(text)


# ---- where each named tensor lives in the checkpoint ------------------------------------------------


def tensor_sources(ckpt: Checkpoint, prefix: str) -> tuple[dict[str, Source], list[str]]:
    """``{name: Source}`` for every tensor under dotted ``prefix``, plus names we cannot range-read.

    Names that a plain safetensors file dropped as duplicates of a tied tensor
    (``safetensors.torch.save_model`` records ``{dropped: kept}`` in its metadata) resolve to the kept one."""
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
    if not ckpt.has_structure:
        for dropped, kept in ckpt.tied_aliases().items():
            name, kept_name = dropped[len(lead):], kept[len(lead):]
            if dropped.startswith(lead) and kept.startswith(lead) and kept_name in sources:
                sources.setdefault(name, sources[kept_name])
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


# ---- the plan ------------------------------------------------------------------------------------


def build_plan(model: nn.Module, ckpt: Checkpoint, *, prefix: str | None, strict: bool = True,
               dtype_policy: str = "cast", weights: bool = True, optimizer: torch.optim.Optimizer | None = None,
               optim_prefix: str = "optim", key_map: KeyMap | None = None) -> ReadPlan:
    """Plan the reads of the model's weights (``weights``) and/or ``optimizer``'s state on this rank.

    ``prefix`` is the subtree holding the weights (None: `default_prefix`). ``key_map``: the
    checkpoint's name of each model name (key_map.py). ``dtype_policy``:
    ``"cast"`` converts a stored dtype to the model's (and reports it), ``"error"`` makes any dtype
    difference a problem. Raises only for errors that leave nothing to plan (bad arguments, a model
    on the meta device); everything else lands in ``plan.problems``."""
    if dtype_policy not in ("cast", "error"):
        raise ValueError(f"dtype_policy must be 'cast' or 'error', not {dtype_policy!r}")
    prefix = default_prefix(ckpt) if prefix is None else prefix
    plan = ReadPlan()
    targets, aliases = local_targets(model)
    plan.targets = targets
    on_meta = [t.name for t in targets if any(p.dest.is_meta for p in t.pieces)]
    if on_meta:
        raise FsdpRestoreError(f"parameters on the meta device ({', '.join(on_meta[:5])}...): materialize the model"
                               " with model.to_empty(device=...) before restoring (then fsdp_restore."
                               "init_non_persistent_buffers(model) for buffers that no checkpoint holds)")
    stored_as, map_problems = key_maps.apply(key_map, [t.name for t in targets] + list(aliases), same=aliases)
    for text in map_problems:
        plan.add_problem("key_map", text)
    if weights:
        plan.model_report = RestoreReport(prefix=prefix)
        _plan_weights(plan, targets, aliases, ckpt, prefix, stored_as, strict=strict, dtype_policy=dtype_policy)
    if optimizer is not None:
        plan.optim_report = RestoreReport(prefix=optim_prefix, method="optimizer")
        plan.optim = OptimizerPlan(optimizer)
        _plan_optimizer(plan, model, targets, aliases, ckpt, optim_prefix, prefix, stored_as)
    return plan


def _plan_weights(plan: ReadPlan, targets: Sequence[Target], aliases: dict[str, str], ckpt: Checkpoint, prefix: str,
                  stored_as: dict[str, str], *, strict: bool, dtype_policy: str) -> None:
    report = plan.model_report
    assert report is not None
    sources, unsupported = tensor_sources(ckpt, prefix)
    if not sources and prefix:
        plan.add_problem("error", f"the checkpoint has no tensors under prefix '{prefix}'; pass prefix='' for a"
                                  " plain weights file, or the subtree that holds the model")
        return
    for text in unsupported:
        plan.add_problem("unsupported", text)
    tied_names: dict[str, list[str]] = {}
    for alias, name in aliases.items():
        tied_names.setdefault(name, []).append(alias)
    for target in targets:
        if target.unsupported:
            plan.add_problem("unsupported", f"{target.name}: {target.unsupported}")
            plan.refused.add(target.name)
            continue
        if target.name not in stored_as:  # the key map failed for it: reported already
            plan.refused.add(target.name)
            continue
        # a tied tensor may be stored under any of its names (save_model keeps only one)
        src = sources.get(stored_as[target.name])
        for alias in tied_names.get(target.name, ()) if src is None else ():
            src = sources.get(stored_as.get(alias, ""))
            if src is not None:
                break
        if src is None:
            if strict:
                key = stored_as[target.name]
                plan.add_problem("missing", target.name if key == target.name else f"{target.name} (as '{key}')")
                plan.refused.add(target.name)
            else:
                report.missing.append(target.name)
                plan.skipped.add(target.name)
            continue
        if tuple(src.shape) != tuple(target.global_shape):
            plan.add_problem("shape", f"{target.name}: checkpoint {list(src.shape)} vs model {list(target.global_shape)}")
            plan.refused.add(target.name)
            continue
        stored = ckpt.entries[src.key].dtype
        if stored != target.dtype:
            if dtype_policy == "error":
                plan.add_problem("dtype", f"{target.name}: checkpoint {stored} vs model {target.dtype}")
                plan.refused.add(target.name)
                continue
            report.cast.append(f"{target.name}: {stored} -> {target.dtype}")
        report.tensors += 1
        numel = src.numel
        for piece in target.pieces:
            plan.items.append(ReadItem(src.key, src.start + piece.start, piece.dest, target.name, piece.start, numel,
                                       piece.rows, piece.stride))
    known = {stored_as.get(n, n) for n in [t.name for t in targets] + list(aliases)}
    unexpected = sorted(set(sources) - known)
    if strict:
        for name in unexpected:
            plan.add_problem("unexpected", name)
    else:
        report.unexpected.extend(unexpected)


# ---- optimizer state -----------------------------------------------------------------------------


@dataclass
class _ParamSlot:
    """One optimizer parameter: its names and where each name's elements lie in its local tensor."""

    param: torch.Tensor
    local: torch.Tensor  # the local tensor whose layout the state tensors copy
    names: list[str]
    pieces: list[tuple[Target, int, Piece]]  # (target, offset of the piece in the local tensor, piece)
    global_shapes: dict[str, tuple[int, ...]]


def _param_slots(model: nn.Module, optimizer: torch.optim.Optimizer, targets: Sequence[Target],
                 aliases: dict[str, str]) -> list[list[_ParamSlot]]:
    """Per optimizer group, each parameter's names and pieces (found by memory overlap with the
    model's targets, so FSDP1 flat parameters, DTensors and plain tensors all work alike)."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    top = "module." if isinstance(model, nn.parallel.DistributedDataParallel) else ""
    # Tied parameters: whichever name a wrapper reports first, use the canonical (first stored) one.
    name_of = {id(p): aliases.get(c, c) for n, p in model.named_parameters()
               for c in [clean_name(n.removeprefix(top))]}
    flat_names: dict[int, list[str]] = {}
    for unit_prefix, handle in _fsdp1_units(model):
        flat_names[id(handle.flat_param)] = [_join(unit_prefix, clean_name(f)) for f in handle.flat_param._fqns]
    by_name = {t.name: t for t in targets}
    groups = []
    for group in optimizer.param_groups:
        slots = []
        for p in group["params"]:
            names = flat_names.get(id(p)) if isinstance(p, FlatParameter) else [name_of.get(id(p), "")]
            if not names or not all(names):
                raise FsdpRestoreError("the optimizer holds a parameter that is not in the model; build the"
                                       " optimizer from the sharded model's parameters")
            local = local_tensor(p)
            base, itemsize = local.data_ptr(), local.element_size()
            end = base + local.numel() * itemsize
            pieces = []
            for name in names:
                for piece in by_name[name].pieces if name in by_name else []:
                    ptr = piece.dest.data_ptr()
                    if local.numel() and base <= ptr < end:
                        pieces.append((by_name[name], (ptr - base) // itemsize, piece))
            for name in names:
                if name in by_name and by_name[name].unsupported:
                    raise FsdpRestoreError(f"optimizer state of {name}: {by_name[name].unsupported}")
            shapes = {n: by_name[n].global_shape for n in names if n in by_name}
            slots.append(_ParamSlot(p, local, names, pieces, shapes))
        groups.append(slots)
    return groups


def _saved_param_names(ckpt: Checkpoint, groups: list[dict[str, Any]], model_prefix: str,
                       param_names: set[str]) -> list[list[str]]:
    """Names of the parameters in each saved param group."""
    out = []
    ordered: list[str] | None = None
    for g in groups:
        params = g.get("params", [])
        if g.get("param_names") is not None:
            out.append([clean_name(n) for n in g["param_names"]])
        elif all(isinstance(p, str) for p in params):
            out.append([clean_name(p) for p in params])
        else:
            if ordered is None:  # parameters in model.parameters() order: the model state dict's order
                seen: set[str] = set()
                ordered = []
                for name, node in iter_tensor_nodes(subtree(ckpt.structure, model_prefix) if model_prefix else
                                                    ckpt.structure["root"]):
                    if name in param_names and node["key"] not in seen:
                        seen.add(node["key"])
                        ordered.append(name)
            total = sum(len(x.get("params", [])) for x in groups)
            if total != len(ordered) or not all(isinstance(p, int) and 0 <= p < len(ordered) for p in params):
                raise FsdpRestoreError(
                    f"the saved optimizer state has {total} parameters with integer ids but the checkpoint's model"
                    f" has {len(ordered)} parameters, so ids cannot be mapped to names; save the optimizer with"
                    " param_names (torch.optim.Optimizer(model.named_parameters(), ...)) or FQN-keyed")
            out.append([ordered[p] for p in params])
    return out


def _child(node: Any, name: str, prefix: str) -> Any:
    for k, v in node.get("items", []) if isinstance(node, dict) else []:
        if k == name:
            return v
    raise FsdpRestoreError(f"'{prefix}' in the checkpoint is not an optimizer state dict (no '{name}')")


def _key_text(k: Any) -> str:
    return str(k) if not isinstance(k, dict) else str(k.get("value"))


def _plan_optimizer(plan: ReadPlan, model: nn.Module, targets: Sequence[Target], aliases: dict[str, str],
                    ckpt: Checkpoint, prefix: str, model_prefix: str, stored_as: dict[str, str]) -> None:
    """Plan the optimizer's state: per-parameter tensors read slice by slice into tensors laid out like
    each parameter's local shard (DTensors for FSDP2); scalar state (``step``) and param-group
    hyperparameters copied whole."""
    optim = plan.optim
    assert optim is not None and plan.optim_report is not None
    try:
        optim_node = subtree(ckpt.structure, prefix)
    except KeyError:
        raise FsdpRestoreError(f"the checkpoint has no optimizer state under '{prefix}' (pass optim_key=...)") from None
    lazy = ckpt.tensors(exact=True)  # small values (step, group tensors): no mmap readahead
    saved_groups = unflatten(lazy, {"version": 1, "root": _child(optim_node, "param_groups", prefix)})
    state_node = _child(optim_node, "state", prefix)
    slots = _param_slots(model, optim.optimizer, targets, aliases)
    # the checkpoint names its parameters its own way (key_map): back to the model's names
    model_name_of = {key: name for name, key in stored_as.items()}
    param_keys = {stored_as.get(t.name, t.name) for t in targets if t.kind == "param"}
    saved_names = [[aliases.get(m, m) for n in names for m in [model_name_of.get(n, n)]] for names in
                   _saved_param_names(ckpt, saved_groups, model_prefix, param_keys)]
    if len(saved_names) != len(slots):
        raise FsdpRestoreError(f"the checkpoint has {len(saved_names)} optimizer param groups, the optimizer"
                               f" {len(slots)}")
    saved_state = {_key_text(k): v for k, v in state_node["items"]} if state_node.get("items") else {}
    name_to_saved_key: dict[str, str] = {}
    for g, (saved, slot_group, saved_group) in enumerate(zip(saved_names, slots, saved_groups)):
        current = [n for s in slot_group for n in s.names]
        if sorted(current) != sorted(saved):
            diff = sorted(set(current) ^ set(saved))
            raise FsdpRestoreError(f"param group {g}: the optimizer's parameters differ from the checkpoint's"
                                   f" ({', '.join(diff[:8]) or 'same names, different count'})")
        for name, pid in zip(saved, saved_group.get("params", [])):
            name_to_saved_key[name] = _key_text(pid)
        optim.groups.append({k: v for k, v in saved_group.items() if k not in _GROUP_SKIP})
    for name, key in stored_as.items():
        name_to_saved_key.setdefault(name, key)  # state keyed by name, not listed in a param group
    for slot, saved_group in ((s, g) for group_slots, g in zip(slots, saved_groups) for s in group_slots):
        state = _plan_param_state(plan, slot, saved_state, name_to_saved_key, ckpt, lazy,
                                  optim.optimizer.state.get(slot.param, {}), saved_group)
        if state:
            optim.state[slot.param] = state


def _reusable(existing: Any, slot: _ParamSlot) -> torch.Tensor | None:
    """The local tensor of an existing state tensor laid out exactly like ``slot``'s parameter, else None."""
    if not isinstance(existing, torch.Tensor) or _is_dtensor(existing) != _is_dtensor(slot.param):
        return None
    if _is_dtensor(existing) and (existing.device_mesh != slot.param.device_mesh
                                  or existing.placements != slot.param.placements):
        return None
    local = local_tensor(existing)
    same = (local.shape == slot.local.shape and local.dtype == slot.local.dtype and local.device == slot.local.device
            and local.is_contiguous())
    return local if same else None


def _node_shape(ckpt: Checkpoint, node: dict[str, Any]) -> tuple[int, ...]:
    view = node.get("view")
    return tuple(view["shape"]) if view else ckpt.entries[node["key"]].shape


def _as_the_optimizer_holds(value: torch.Tensor, param: torch.Tensor, key: str, group: dict[str, Any]) -> torch.Tensor:
    """A state value placed as ``Optimizer.load_state_dict`` places it (torch's policy, see
    ``Optimizer._process_value_according_to_param_policy``): ``step`` stays as saved, or becomes float32
    on the parameter's device for ``fused`` / ``capturable`` optimizers; other floating state takes the
    parameter's dtype and device."""
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def _plan_param_state(plan: ReadPlan, slot: _ParamSlot, saved_state: dict[str, Any], name_to_key: dict[str, str],
                      ckpt: Checkpoint, lazy: Any, existing: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    """State tensors for one parameter, with read items for their local slices: the optimizer's own
    tensors when it already has state of that layout (restored in place), else new ones. Every dtype
    change is reported; state placed as the optimizer's own ``load_state_dict`` would place it."""
    report, optim = plan.optim_report, plan.optim
    assert report is not None and optim is not None
    per_name = {n: saved_state.get(name_to_key.get(n, n)) for n in slot.names}
    present = {n: s for n, s in per_name.items() if s is not None}
    if not present:
        return {}
    if len(present) != len(per_name):
        raise FsdpRestoreError(f"optimizer state exists for {sorted(present)} but not for "
                               f"{sorted(set(per_name) - set(present))}, which share one flat parameter")
    first_name = slot.names[0]
    fields = [k for k, _ in present[first_name]["items"]]
    state: dict[str, Any] = {}
    for fld in fields:
        field_nodes = {n: dict((k, v) for k, v in s["items"])[fld] for n, s in present.items()}
        node = field_nodes[first_name]
        is_tensor = isinstance(node, dict) and node.get("type") == "tensor"
        shaped = is_tensor and all(
            isinstance(fn, dict) and "key" in fn and tuple(_node_shape(ckpt, fn)) == tuple(slot.global_shapes.get(n, ()))
            for n, fn in field_nodes.items())
        if not shaped:
            # scalar state (step) or anything not laid out like the parameter: small, copied whole
            value = unflatten(lazy, {"version": 1, "root": node})
            if isinstance(value, torch.Tensor):
                if value.dim() > 0 and _is_dtensor(slot.param):
                    raise FsdpRestoreError(
                        f"optimizer state '{fld}' of {first_name} has shape {list(value.shape)}, unlike the parameter's"
                        f" {list(slot.param.shape)}, and cannot be restored into a sharded (DTensor) parameter: how the"
                        " optimizer shards it is its own (Adafactor's row/column factors); restore this optimizer"
                        " from torch.distributed.checkpoint's optimizer state dict instead")
                placed = _as_the_optimizer_holds(value, slot.param, fld, group)
                if placed.dtype != value.dtype:
                    report.cast.append(f"optim:{first_name}.{fld}: {value.dtype} -> {placed.dtype}")
                value = placed.clone() if placed is value else placed
            state[fld] = value
            continue
        # Existing state of the same layout is overwritten in place: a new tensor would hold the optimizer
        # state twice until the swap (the peak) and pay fresh page faults (measured: BENCHMARKS.md).
        # Only the padding that no piece covers is zeroed here (FSDP1 flat-parameter padding).
        reused = _reusable(existing.get(fld), slot)
        local = reused if reused is not None else torch.empty_like(slot.local)
        stored = ckpt.entries[node["key"]].dtype
        if stored != local.dtype:  # as load_state_dict: state takes the parameter's dtype (reported)
            report.cast.append(f"optim:{first_name}.{fld}: {stored} -> {local.dtype}")
        flat_local = local.view(-1)
        _zero_uncovered(flat_local, [(offset, piece.dest.numel()) for _, offset, piece in slot.pieces])
        for target, offset, piece in slot.pieces:
            src_node = field_nodes[target.name]
            base = src_node.get("view", {}).get("offset", 0)
            total = 1
            for d in target.global_shape:
                total *= d
            plan.items.append(ReadItem(src_node["key"], base + piece.start, flat_local[offset:offset + piece.dest.numel()],
                                       f"optim:{target.name}.{fld}", piece.start, total, piece.rows, piece.stride))
        report.tensors += 1
        optim.shaped.append((slot.param, fld))
        if reused is not None:
            state[fld] = existing[fld]
        elif _is_dtensor(slot.param):
            from torch.distributed.tensor import DTensor

            state[fld] = DTensor.from_local(local, slot.param.device_mesh, slot.param.placements, run_check=False,
                                            shape=slot.param.shape, stride=slot.param.stride())
        else:
            state[fld] = local
    return state


def _zero_uncovered(flat: torch.Tensor, covered: list[tuple[int, int]]) -> None:
    """Zero the elements of ``flat`` outside the (offset, count) ranges, e.g. FSDP1 flat-parameter padding."""
    at = 0
    with torch.no_grad():
        for offset, count in sorted(covered):
            if offset > at:
                flat[at:offset].zero_()
            at = max(at, offset + count)
        if at < flat.numel():
            flat[at:].zero_()
