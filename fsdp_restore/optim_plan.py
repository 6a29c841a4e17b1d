"""The optimizer half of the read plan: which saved state belongs to which live parameter, and its reads.

Saved parameters are matched to the live optimizer's exactly as ``Optimizer.load_state_dict`` matches them:
saved group ``g`` zips live group ``g``, and within a group torch's integer ids map by position, because
``Optimizer.state_dict()`` numbers parameters in the optimizer's own order, group by group (not in the
model's order). When the saver recorded names (``param_names``, or state keyed by names), they decide
instead, group by group, so a group listed in another order still maps each name to its own state. The
live side is this rank's optimizer: each of its parameters expands to the model name it holds, so the
mapping is the same for FSDP2, DDP, tensor parallel, FSDP1 with ``use_orig_params=True`` and plain models.
An FSDP1 flat parameter holds several original parameters at once; the unsharded optimizer that saved
such a run listed them in the model's order (``model.parameters()``), so a group of flat parameters
expands to its names in the model's order. Only a true mismatch is refused (group counts, group sizes, names, state not shaped like its
parameter), naming the group, the id and the names; problems are collected, never raised, so that the
weights' problems found before are reported with them (plan.py).

The NaN check cannot see a permutation of whole parameters' state (every element is written once), so this
mapping is what stands between a resumed run and silently exchanged AdamW moments.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import FsdpRestoreError
from .flatten import unflatten
from .read import Checkpoint
from .readplan import ReadItem, ReadPlan
from .shards import Piece, Target, _fsdp1_units, _is_dtensor, _join, clean_name, ddp_prefix, local_tensor
from .stored import (GROUP_MEMBERSHIP, StoredOptimizer, is_tensor_node, node_shape, node_source,
                     stored_optimizer)

# State fields that torch's optimizers keep shaped like their parameter (AdamW, Adam, SGD, Adagrad,
# RMSprop, Adadelta, Adamax, Rprop, ASGD, NAdam, RAdam): one of these of another shape means the saved state
# belongs to another parameter. Other fields (Adafactor-style factors) may legitimately differ.
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg",
                           "acc_delta", "sum", "exp_inf", "prev", "step_size", "ax"})


@dataclass
class ParamSlot:
    """One live optimizer parameter: the model names it holds and where each name's elements lie in its
    local tensor."""

    param: torch.Tensor
    local: torch.Tensor  # the local tensor whose layout the state tensors copy
    names: list[str]
    pieces: list[tuple[Target, int, Piece]]  # (target, offset of the piece in the local tensor, piece)
    global_shapes: dict[str, tuple[int, ...]]
    unsupported: list[str]  # "name: why" for names whose layout cannot be restored from a file


def live_groups(model: nn.Module, optimizer: torch.optim.Optimizer, targets: Sequence[Target],
                aliases: dict[str, str]) -> tuple[list[list[ParamSlot]], list[list[str]]]:
    """Per optimizer group, each parameter's names and pieces (found by memory overlap with the model's
    targets, so FSDP1 flat parameters, DTensors and plain tensors all work alike), and the group's model
    names in the order an unsharded optimizer over the same parameters numbers them. Raises for a
    parameter the model does not hold: nothing about the optimizer can be planned then."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    top = ddp_prefix(model)
    # Tied parameters: whichever name a wrapper reports first, use the canonical (first stored) one.
    name_of = {id(p): aliases.get(c, c) for n, p in model.named_parameters()
               for c in [clean_name(n.removeprefix(top))]}
    flat_names: dict[int, list[str]] = {}
    for unit_prefix, handle in _fsdp1_units(model):
        flat_names[id(handle.flat_param)] = [_join(unit_prefix, clean_name(f)) for f in handle.flat_param._fqns]
    by_name = {t.name: t for t in targets}
    groups, ordered = [], []
    module_order = {clean_name(n.removeprefix(top)): i for i, (n, _) in enumerate(model.named_modules())}
    for g, group in enumerate(optimizer.param_groups):
        slots = []
        for p in group["params"]:
            names = flat_names.get(id(p)) if isinstance(p, FlatParameter) else [name_of.get(id(p), "")]
            if not names or not all(names):
                raise FsdpRestoreError(f"param group {g} of the optimizer holds a parameter that is not in the model;"
                                       " build the optimizer from the sharded model's parameters")
            local = local_tensor(p)
            base, itemsize = local.data_ptr(), local.element_size()
            end = base + local.numel() * itemsize
            pieces = []
            for name in names:
                for piece in by_name[name].pieces if name in by_name else []:
                    ptr = piece.dest.data_ptr()
                    if local.numel() and base <= ptr < end:
                        pieces.append((by_name[name], (ptr - base) // itemsize, piece))
            shapes = {n: by_name[n].global_shape for n in names if n in by_name}
            unsupported = [f"{n}: {by_name[n].unsupported}" for n in names if n in by_name and by_name[n].unsupported]
            slots.append(ParamSlot(p, local, names, pieces, shapes, unsupported))
        names = [n for slot in slots for n in slot.names]
        if any(isinstance(p, FlatParameter) for p in group["params"]):
            # model.parameters() order: modules depth first, each module's parameters in the order registered
            # (which a flat parameter's names keep: the sort is stable)
            names.sort(key=lambda n: module_order.get(n.rpartition(".")[0], -1))
        groups.append(slots)
        ordered.append(names)
    return groups, ordered


def match_saved(saved: StoredOptimizer, live: list[list[str]], problems: list[str], unheld: Sequence[str] = (),
                *, strict: bool = True, unrestored: list[str] | None = None) -> dict[str, str]:
    """``{live model name: saved state key}``, matched as ``Optimizer.load_state_dict`` matches
    (by position within each group) or, where the saver recorded names, by name. Mismatches go to
    ``problems`` (``unheld``: the model's parameters no group holds, named when sizes differ); a group with
    a problem maps nothing. ``strict=False``: a named group may hold a part of the saved group's parameters (a
    pipeline stage of the saved run's model), as torch's ``set_optimizer_state_dict(strict=False)`` allows; the
    saved names it does not hold go to ``unrestored``."""
    if len(saved.groups) != len(live):
        problems.append(f"the checkpoint's optimizer has {len(saved.groups)} param groups, the optimizer"
                        f" {len(live)}: build the optimizer's groups as the saved run did")
        return {}
    mapping: dict[str, str] = {}
    for g, (stored, names) in enumerate(zip(saved.groups, live)):
        if stored.names is None:  # torch's integer ids: by position in the group, exactly as load_state_dict
            if len(stored.ids) != len(names):
                outside = f"; the model's parameters in no group: {_few(list(unheld))}" if unheld else ""
                problems.append(
                    f"param group {g}: the checkpoint's group has {len(stored.ids)} parameters, the optimizer's"
                    f" {len(names)} ({_few(names)}){outside}; torch.save(opt.state_dict()) numbers parameters in"
                    " the optimizer's order, group by group: build the optimizer's groups as the saved run did")
                continue
            mapping.update(zip(names, stored.ids))
            continue
        if sorted(stored.names) != sorted(names):
            extra = sorted(set(stored.names) - set(names))
            lacking = sorted(set(names) - set(stored.names))
            if not strict and not lacking and len(set(names)) == len(names):
                if unrestored is not None:
                    unrestored.extend(extra)
                mapping.update(zip(stored.names, stored.ids))
                continue
            detail = "; ".join(x for x in (f"only in the checkpoint: {_few(extra)}" if extra else "",
                                           f"only in the optimizer: {_few(lacking)}" if lacking else "") if x)
            part = ("; an optimizer over a part of the saved run's model (a pipeline stage) restores with"
                    " strict=False" if extra and not lacking else "")
            problems.append(f"param group {g}: the optimizer's parameters differ from the checkpoint's"
                            f" ({detail or 'same names, different count'}){part}")
            continue
        mapping.update(zip(stored.names, stored.ids))
    return mapping


def _few(names: Sequence[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def plan_optimizer(plan: ReadPlan, model: nn.Module, targets: Sequence[Target], aliases: dict[str, str],
                   ckpt: Checkpoint, prefix: str, stored_as: dict[str, str], *, strict: bool = True) -> None:
    """Plan the optimizer's state into ``plan``: per-parameter tensors read slice by slice into tensors laid
    out like each parameter's local shard (DTensors for FSDP2); scalar state (``step``) and param-group
    hyperparameters copied whole. Every problem goes to ``plan.problems``."""
    optim = plan.optim
    assert optim is not None and plan.optim_report is not None
    try:
        slots, live_names = live_groups(model, optim.optimizer, targets, aliases)
        # (a flattened state dict holds no groups: it is grouped as the optimizer's, by the checkpoint's names)
        saved = stored_optimizer(ckpt, prefix, [t.name for t in targets],
                                 [[stored_as.get(n, n) for n in names] for names in live_names])
    except FsdpRestoreError as e:
        plan.add_problem("optimizer", str(e))
        return
    # the checkpoint names its parameters its own way (key_map): saved names back to the model's names
    model_name_of = {key: name for name, key in stored_as.items()}
    saved = saved.renamed(lambda n: aliases.get(model_name_of.get(n, n), model_name_of.get(n, n)))
    problems: list[str] = []
    held = {n for names in live_names for n in names}
    unheld = [t.name for t in targets if t.kind == "param" and t.name not in held]
    unrestored: list[str] = []
    mapping = match_saved(saved, live_names, problems, unheld, strict=strict, unrestored=unrestored)
    plan.optim_report.unexpected.extend(unrestored)
    for text in problems:
        plan.add_problem("optimizer", text)
    if problems:
        return
    for g, stored in enumerate(saved.groups):
        lacking = _hyperparameters_lacking(optim.optimizer, stored.hyper) if stored.hyper else []
        # and options of another torch optimizer in their place: an older torch's group of the same type lacks
        # options added since (SparseAdam has no __setstate__ to add them) but holds none of another type's
        foreign = sorted((set(stored.hyper) - set(optim.optimizer.defaults)) & _torch_optimizer_options())
        if lacking and foreign:
            name = type(optim.optimizer).__name__
            plan.add_problem("optimizer", f"param group {g} of the checkpoint lacks {', '.join(lacking)}, which {name}'s"
                             f" groups need, and holds {', '.join(foreign[:6])} instead: the state was saved from another"
                             f" optimizer type; restore it into the type it was saved from (the optimizer's own"
                             f" load_state_dict would take it, and its first step would fail)")
            return
    optim.groups.extend(dict(stored.hyper) for stored in saved.groups)
    lazy = ckpt.tensors(exact=True)  # small values (step): no mmap readahead
    misfits: list[str] = []
    position = {key: i for i, key in enumerate(saved.state)}  # the file's order: torch's, that of first state
    for g, (group_slots, group) in enumerate(zip(slots, saved.groups)):
        for slot in group_slots:
            keys = {n: mapping.get(n, stored_as.get(n, n)) for n in slot.names}
            state = _plan_param_state(plan, slot, g, keys, saved, ckpt, lazy,
                                      optim.optimizer.state.get(slot.param, {}), group.hyper, misfits)
            if state:
                optim.state[slot.param] = state
                optim.order[slot.param] = min(position.get(k, len(position)) for k in keys.values())
    for text in misfits:
        plan.add_problem("optimizer", text)
    if len(misfits) > 1:  # (one alone is no other order: an order moves two at least; the line says what differs)
        plan.add_problem("optimizer", "the saved state above belongs to other parameters: torch.save(opt.state_dict())"
                         " numbers parameters in the optimizer's order, group by group; list each group's parameters"
                         " in the order the saved run did (or save with param_names: build the optimizer from"
                         " model.named_parameters())")


@functools.cache
def _torch_optimizer_options() -> frozenset[str]:
    """Every option torch's own optimizers take (their constructors' keyword names): a saved group's key among them
    that this optimizer lacks is another type's hyperparameter, not a user's or a scheduler's key."""
    names: set[str] = set()
    for cls in vars(torch.optim).values():
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
            names.update(p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params"))
    return frozenset(names)


def _hyperparameters_lacking(optimizer: torch.optim.Optimizer, hyper: Mapping[str, Any]) -> list[str]:
    """The hyperparameters of ``optimizer``'s type (its ``defaults``) that a saved group lacks even after the
    type's own ``__setstate__``, which supplies those added in later torch versions (``foreach``, ``maximize``...),
    as ``load_state_dict`` ends with it: what is still missing was never this type's (an AdamW group restored
    into SGD lacks ``momentum``). Extra keys (a scheduler's ``initial_lr``, a user's own) are not a sign. Empty
    where it cannot tell (an optimizer whose ``__setstate__`` needs more than a state dict)."""
    probe = object.__new__(type(optimizer))  # the type's __setstate__ on a blank object: the optimizer is untouched
    group = {k: v for k, v in hyper.items() if k not in GROUP_MEMBERSHIP}
    try:
        type(optimizer).__setstate__(probe, {"defaults": dict(optimizer.defaults), "state": {},
                                             "param_groups": [{**group, "params": []}]})
        supplied = set(probe.param_groups[0])
    except Exception:  # noqa: BLE001 - a wrapper's or a custom type's setstate: no verdict, as before
        return []
    return sorted(set(optimizer.defaults) - supplied)


def _reusable(existing: Any, slot: ParamSlot) -> torch.Tensor | None:
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


def _as_the_optimizer_holds(value: torch.Tensor, param: torch.Tensor, key: str, group: Mapping[str, Any]) -> torch.Tensor:
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


_ONE_FLAT_STATE = ("an FSDP1 flat parameter (use_orig_params=False) keeps one optimizer state for all of them; wrap"
                   " the model with use_orig_params=True (per-parameter state) or with FSDP2 to restore it")


def _same_value(a: Any, b: Any) -> bool:
    """The same scalar state: equal tensors of one dtype and shape, or equal values of one type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    return type(a) is type(b) and a == b


def _shown(value: Any) -> str:
    return repr(value.item()) if isinstance(value, torch.Tensor) and value.numel() == 1 else repr(value)[:40]


def _plan_param_state(plan: ReadPlan, slot: ParamSlot, g: int, keys: dict[str, str], saved: StoredOptimizer,
                      ckpt: Checkpoint, lazy: Any, existing: dict[str, Any], group: Mapping[str, Any],
                      misfits: list[str]) -> dict[str, Any]:
    """State tensors for one parameter, with read items for their local slices: the optimizer's own
    tensors when it already has state of that layout (restored in place), else new ones. Every dtype
    change is reported; state placed as the optimizer's own ``load_state_dict`` would place it. Saved
    state of another shape than its parameter (it belongs to another one) goes to ``misfits``."""
    report, optim = plan.optim_report, plan.optim
    assert report is not None and optim is not None
    per_name = {n: saved.state.get(keys[n]) for n in slot.names}
    present = {n: s for n, s in per_name.items() if s is not None}
    if not present:
        return {}
    first_name = slot.names[0]
    if slot.unsupported:
        plan.add_problem("optimizer", "; ".join(f"optimizer state of {text}" for text in slot.unsupported))
        return {}
    if len(present) != len(per_name):
        plan.add_problem("optimizer", f"optimizer state exists for {sorted(present)} but not for "
                                      f"{sorted(set(per_name) - set(present))}, which share one flat parameter")
        return {}
    wrong = {f"param group {g}, id {keys[n]} -> {n} {list(slot.global_shapes[n])}: saved '{fld}' has shape"
             f" {list(node_shape(ckpt, node))}": None for n, st in present.items() for fld, node in st.items()
             if fld in _PARAM_SHAPED and is_tensor_node(node) and n in slot.global_shapes
             and tuple(node_shape(ckpt, node)) != tuple(slot.global_shapes[n])}
    if wrong:
        misfits.append(next(iter(wrong)))  # one line per parameter: its first misfit field
        return {}
    fields = {n: sorted(st) for n, st in present.items()}
    if len({tuple(f) for f in fields.values()}) > 1:
        plan.add_problem("optimizer", f"the saved optimizer state of {sorted(present)}, which share one flat parameter,"
                                      f" has different fields ({fields}): {_ONE_FLAT_STATE}")
        return {}
    state: dict[str, Any] = {}
    for fld in present[first_name]:
        field_nodes = {n: s.get(fld) for n, s in present.items()}
        node = field_nodes[first_name]
        sources = {n: node_source(ckpt, fn) if is_tensor_node(fn) else None for n, fn in field_nodes.items()}
        shaped = all(src is not None and tuple(src.shape) == tuple(slot.global_shapes.get(n, ()))
                     for n, src in sources.items())
        if not shaped:
            # scalar state (step) or anything not laid out like the parameter: small, copied whole
            value = unflatten(lazy, {"version": 1, "root": node})
            if len(field_nodes) > 1:  # one flat parameter holds one value for all its parameters, as torch requires
                values = {n: value if n == first_name else unflatten(lazy, {"version": 1, "root": fn})
                          for n, fn in field_nodes.items()}
                if not all(_same_value(v, value) for v in values.values()):
                    shown = ", ".join(f"{n}: {_shown(v)}" for n, v in values.items())
                    plan.add_problem("optimizer", f"saved '{fld}' differs between parameters that share one flat"
                                                  f" parameter ({shown}): {_ONE_FLAT_STATE}")
                    return {}
            if isinstance(value, torch.Tensor):
                if value.dim() > 0 and _is_dtensor(slot.param):
                    plan.add_problem("optimizer",
                        f"optimizer state '{fld}' of {first_name} has shape {list(value.shape)}, unlike the parameter's"
                        f" {list(slot.param.shape)}, and cannot be restored into a sharded (DTensor) parameter: how the"
                        " optimizer shards it is its own (Adafactor's row/column factors); restore this optimizer"
                        " from torch.distributed.checkpoint's optimizer state dict instead")
                    return {}
                placed = _as_the_optimizer_holds(value, slot.param, fld, group)
                if placed.dtype != value.dtype:
                    report.cast.append(f"optim:{first_name}.{fld}: {value.dtype} -> {placed.dtype}")
                value = placed.clone() if placed is value else placed
                report.tensors += 1
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
        zero_uncovered(flat_local, [(offset, piece.dest.numel()) for _, offset, piece in slot.pieces])
        for target, offset, piece in slot.pieces:
            src = sources[target.name]
            assert src is not None
            plan.items.append(ReadItem(src.key, src.start + piece.start, flat_local[offset:offset + piece.dest.numel()],
                                       f"optim:{target.name}.{fld}", piece.start, src.numel, piece.rows, piece.stride))
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


def zero_uncovered(flat: torch.Tensor, covered: list[tuple[int, int]]) -> None:
    """Zero the elements of ``flat`` outside the (offset, count) ranges, e.g. FSDP1 flat-parameter padding."""
    at = 0
    with torch.no_grad():
        for offset, count in sorted(covered):
            if offset > at:
                flat[at:offset].zero_()
            at = max(at, offset + count)
        if at < flat.numel():
            flat[at:].zero_()
