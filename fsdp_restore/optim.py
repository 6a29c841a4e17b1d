"""Restore optimizer state into a sharded optimizer, each rank reading only its slice of every
per-parameter tensor, and hand back the rest of the checkpoint.

The saved state may be keyed by integer ids (``optimizer.state_dict()`` of an unsharded model, with
or without ``param_names``) or by parameter names (FSDP1 full optim state dict,
``get_optimizer_state_dict(..., full_state_dict=True)``). Ids are mapped to names through
``param_names`` when saved, else through the order of the model's parameters in the checkpoint's
model state dict (the order ``model.parameters()`` gave the optimizer).

State is written into ``optimizer.state`` directly, like ``load_state_dict`` does, and never by
calling ``optimizer.step()`` (which would apply weight decay to the restored weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .check import ReadTask, agree, raise_if_problems
from .errors import FsdpRestoreError
from .flatten import iter_tensor_nodes, subtree, unflatten
from .read import Checkpoint, open_checkpoint
from .restore import (DEFAULT_READ_THREADS, RestoreReport, checked_reads, default_prefix, execute_reads,
                      restore_model, tensor_sources)
from .shards import Piece, Target, _fsdp1_units, _is_dtensor, _join, clean_name, local_targets

_GROUP_SKIP = ("params", "param_names")


@dataclass
class _ParamSlot:
    """One optimizer parameter: its names and where each name's elements lie in its local tensor."""

    param: torch.Tensor
    local: torch.Tensor  # the local tensor whose layout the state tensors copy
    names: list[str]
    pieces: list[tuple[Target, int, int, int]]  # (target, local offset, numel, global start)
    global_shapes: dict[str, tuple[int, ...]]


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if _is_dtensor(param) else param.data


def _param_slots(model: nn.Module, optimizer: torch.optim.Optimizer, targets: list[Target],
                 aliases: dict[str, str]) -> list[list[_ParamSlot]]:
    """Per optimizer group, each parameter's names and pieces (found by memory overlap with the
    model's targets, so FSDP1 flat parameters, DTensors and plain tensors all work alike)."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    top = "module." if isinstance(model, nn.parallel.DistributedDataParallel) else ""
    # Tied parameters: whichever name a wrapper reports first, use the canonical (first stored) one.
    name_of = {id(p): aliases.get(c, c) for n, p in model.named_parameters()
               for c in [clean_name(n.removeprefix(top))]}
    flat_names: dict[int, list[str]] = {}
    for prefix, handle in _fsdp1_units(model):
        flat_names[id(handle.flat_param)] = [_join(prefix, clean_name(f)) for f in handle.flat_param._fqns]
    by_name = {t.name: t for t in targets}
    groups = []
    for group in optimizer.param_groups:
        slots = []
        for p in group["params"]:
            names = flat_names.get(id(p)) if isinstance(p, FlatParameter) else [name_of.get(id(p), "")]
            if not names or not all(names):
                raise FsdpRestoreError("the optimizer holds a parameter that is not in the model; build the"
                                       " optimizer from the sharded model's parameters")
            local = _local(p)
            base, itemsize = local.data_ptr(), local.element_size()
            end = base + local.numel() * itemsize
            pieces = []
            for name in names:
                for piece in by_name[name].pieces if name in by_name else []:
                    ptr = piece.dest.data_ptr()
                    if local.numel() and base <= ptr < end:
                        pieces.append((by_name[name], (ptr - base) // itemsize, piece.dest.numel(), piece.start))
            shapes = {n: by_name[n].global_shape for n in names if n in by_name}
            slots.append(_ParamSlot(p, local, names, pieces, shapes))
        groups.append(slots)
    return groups


def _saved_param_names(ckpt: Checkpoint, optim_node: Any, groups: list[dict[str, Any]], model_prefix: str,
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


def restore_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, checkpoint: str | os.PathLike[str] | Checkpoint,
                      *, prefix: str = "optim", model_prefix: str | None = None, check: bool = True,
                      threads: int | None = None, group: dist.ProcessGroup | None = None) -> RestoreReport:
    """Restore ``optimizer`` (built over the sharded ``model``) from the checkpoint subtree ``prefix``.

    Per-parameter state tensors are read slice by slice into tensors laid out like each
    parameter's local shard (DTensors for FSDP2): the optimizer's existing state tensors when they
    have that layout (overwritten in place, no second copy of the state), else new ones. Scalar
    state (``step``) is copied whole; param-group hyperparameters (lr, betas, weight_decay...) are
    restored. Every rank raises the same `RestoreError` when the optimizer's parameters do not match
    the checkpoint (before anything is modified) or when the read or its check fails (then existing
    state tensors may be partly overwritten, like the model's weights: restore again before training).
    """
    own = not isinstance(checkpoint, Checkpoint)
    ckpt = open_checkpoint(checkpoint)
    report = RestoreReport(prefix=prefix, method="optimizer")
    problems: dict[str, list[str]] = {}
    tasks: list[ReadTask] = []
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    new_groups: list[dict[str, Any]] = []
    try:
        try:
            model_prefix = default_prefix(ckpt) if model_prefix is None else model_prefix
            optim_node = subtree(ckpt.structure, prefix)
            lazy = ckpt.tensors(exact=True)  # small values (step, group tensors): no mmap readahead
            saved_groups = unflatten(lazy, {"version": 1, "root": _child(optim_node, "param_groups", prefix)})
            state_node = _child(optim_node, "state", prefix)
            targets, aliases = local_targets(model)
            slots = _param_slots(model, optimizer, targets, aliases)
            param_names = {t.name for t in targets if t.kind == "param"}
            saved_names = [[aliases.get(n, n) for n in names] for names in
                           _saved_param_names(ckpt, optim_node, saved_groups, model_prefix, param_names)]
            if len(saved_names) != len(slots):
                raise FsdpRestoreError(f"the checkpoint has {len(saved_names)} optimizer param groups, the optimizer"
                                       f" {len(slots)}")
            saved_state = {(_key_text(k)): v for k, v in state_node["items"]} if state_node.get("items") else {}
            name_to_saved_key: dict[str, str] = {}
            for g, (saved, slot_group, saved_group) in enumerate(zip(saved_names, slots, saved_groups)):
                current = [n for s in slot_group for n in s.names]
                if sorted(current) != sorted(saved):
                    diff = sorted(set(current) ^ set(saved))
                    raise FsdpRestoreError(f"param group {g}: the optimizer's parameters differ from the checkpoint's"
                                           f" ({', '.join(diff[:8]) or 'same names, different count'})")
                ids = saved_group.get("params", [])
                for name, pid in zip(saved, ids):
                    name_to_saved_key[name] = _key_text(pid)
                new_groups.append({k: v for k, v in saved_group.items() if k not in _GROUP_SKIP})
            for slot in (s for group_slots in slots for s in group_slots):
                state = _plan_param_state(slot, saved_state, name_to_saved_key, ckpt, lazy, tasks, report,
                                          optimizer.state.get(slot.param, {}))
                if state:
                    new_state[slot.param] = state
        except (FsdpRestoreError, KeyError, ValueError, OSError) as e:
            problems = {"error": [str(e).strip("'\"")]}
        raise_if_problems(agree(problems, group), "optimizer restore")
        before = ckpt.bytes_read
        problems = checked_reads(ckpt, tasks, report, check=check,
                                 read=lambda: execute_reads(ckpt, tasks, threads or DEFAULT_READ_THREADS,
                                                           check=check))
        raise_if_problems(agree(problems, group), "optimizer restore check")
        for current, saved in zip(optimizer.param_groups, new_groups):
            current.update(saved)
        optimizer.state.clear()
        for param, state in new_state.items():
            optimizer.state[param] = state
        report.bytes_read = ckpt.bytes_read - before
        report.elements = sum(t.piece.dest.numel() for t in tasks)
        return report
    finally:
        if own:
            ckpt.close()


def _key_text(k: Any) -> str:
    return str(k) if not isinstance(k, dict) else str(k.get("value"))


def _child(node: Any, name: str, prefix: str) -> Any:
    for k, v in node.get("items", []) if isinstance(node, dict) else []:
        if k == name:
            return v
    raise FsdpRestoreError(f"'{prefix}' in the checkpoint is not an optimizer state dict (no '{name}')")


def _reusable(existing: Any, slot: _ParamSlot) -> torch.Tensor | None:
    """The local tensor of an existing state tensor laid out exactly like ``slot``'s parameter, else None."""
    if not isinstance(existing, torch.Tensor) or _is_dtensor(existing) != _is_dtensor(slot.param):
        return None
    if _is_dtensor(existing) and (existing.device_mesh != slot.param.device_mesh
                                  or existing.placements != slot.param.placements):
        return None
    local = _local(existing)
    same = (local.shape == slot.local.shape and local.dtype == slot.local.dtype and local.device == slot.local.device
            and local.is_contiguous())
    return local if same else None


def _plan_param_state(slot: _ParamSlot, saved_state: dict[str, Any], name_to_key: dict[str, str], ckpt: Checkpoint,
                      lazy: Any, tasks: list[ReadTask], report: RestoreReport,
                      existing: dict[str, Any]) -> dict[str, Any]:
    """State tensors for one parameter, with read tasks for their local slices: the optimizer's own
    tensors when it already has state of that layout (restored in place), else new ones."""
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
    for field in fields:
        field_nodes = {n: dict((k, v) for k, v in s["items"])[field] for n, s in present.items()}
        node = field_nodes[first_name]
        is_tensor = isinstance(node, dict) and node.get("type") == "tensor"
        shaped = is_tensor and all(
            isinstance(fn, dict) and "key" in fn and tuple(_node_shape(ckpt, fn)) == tuple(_global_shape(slot, n))
            for n, fn in field_nodes.items())
        if not shaped:
            # scalar state (step) or anything not laid out like the parameter: small, copied whole
            value = unflatten(lazy, {"version": 1, "root": node})
            state[field] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        # Existing state of the same layout is overwritten in place: a new tensor would hold the optimizer
        # state twice until the swap (the peak) and pay fresh page faults (measured: BENCHMARKS.md).
        # Fresh memory is first touched by the reads (on the read threads); only the padding the pieces
        # do not cover is zeroed here. zeros_like cost 0.68 s per GB, mostly page faults on one thread.
        reused = _reusable(existing.get(field), slot)
        local = reused if reused is not None else torch.empty_like(slot.local)
        flat_local = local.view(-1)
        _zero_uncovered(flat_local, [(offset, numel) for _, offset, numel, _ in slot.pieces])
        for target, offset, numel, start in slot.pieces:
            src_node = field_nodes[target.name]
            base = src_node.get("view", {}).get("offset", 0)
            tasks.append(ReadTask(src_node["key"], base + start, Piece(flat_local[offset:offset + numel], start),
                                  Target(f"optim:{target.name}.{field}", target.global_shape, local.dtype, "state")))
        report.tensors += 1
        if reused is not None:
            state[field] = existing[field]
        elif _is_dtensor(slot.param):
            from torch.distributed.tensor import DTensor

            state[field] = DTensor.from_local(local, slot.param.device_mesh, slot.param.placements, run_check=False,
                                              shape=slot.param.shape, stride=slot.param.stride())
        else:
            state[field] = local
    return state


def _zero_uncovered(flat: torch.Tensor, covered: list[tuple[int, int]]) -> None:
    """Zero the elements of ``flat`` outside the (offset, count) ranges, e.g. FSDP1 flat-parameter padding."""
    at = 0
    for offset, count in sorted(covered):
        if offset > at:
            flat[at:offset].zero_()
        at = max(at, offset + count)
    if at < flat.numel():
        flat[at:].zero_()


def _node_shape(ckpt: Checkpoint, node: dict[str, Any]) -> tuple[int, ...]:
    view = node.get("view")
    return tuple(view["shape"]) if view else ckpt.entries[node["key"]].shape


def _global_shape(slot: _ParamSlot, name: str) -> tuple[int, ...] | None:
    return slot.global_shapes.get(name)


def restore(model: nn.Module, checkpoint: str | os.PathLike[str] | Checkpoint,
            optimizer: torch.optim.Optimizer | None = None, *, model_key: str = "model", optim_key: str = "optim",
            check: bool = True, strict: bool = True, threads: int | None = None,
            group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Restore model (and optimizer) state on every rank and return the rest of the checkpoint.

    The returned dict holds every other top-level entry (step, scheduler, RNG states, config...)
    as ordinary Python objects; tensors in it are read into memory with exact positional reads
    (no mapping is left open on the file).
    """
    ckpt = open_checkpoint(checkpoint)
    try:
        restore_model(model, ckpt, prefix=model_key, strict=strict, check=check, threads=threads, group=group)
        if optimizer is not None:
            restore_optimizer(optimizer, model, ckpt, prefix=optim_key, model_prefix=model_key, check=check,
                              threads=threads, group=group)
        root = ckpt.structure["root"]
        if not (isinstance(root, dict) and root.get("type") in ("dict", "OrderedDict")):
            return {}
        rest = {"type": "dict", "items": [[k, v] for k, v in root["items"] if k not in (model_key, optim_key)]}
        return unflatten(ckpt.tensors(exact=True), {"version": 1, "root": rest})
    finally:
        if not isinstance(checkpoint, Checkpoint):
            ckpt.close()
