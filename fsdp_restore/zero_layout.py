"""Where a DeepSpeed ZeRO checkpoint keeps each parameter, as arithmetic on its model states: shared by the reader
that loads the files with torch (`fsdp_restore.zero`) and the one that does not (`fsdp_restore.zero_plain`), so
that both assemble every tensor from the same elements. Imports nothing heavy.

Layouts (DeepSpeed 0.19): stages 1/2 concatenate each parameter group's parameters (in ``param_shapes`` order,
plus ``param_alignment_paddings``) into one flat vector, cut into one contiguous partition per rank; stage 3 gives
each parameter ceil(numel / world) elements on every rank (zero padded), one after the other in each rank's flat
groups, and stores its frozen parameters the same way, each from element 0 of its own fragment.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .errors import FormatError

Shape = tuple[int, ...]

# the model states' entries the consolidated checkpoint puts under ``model`` (or drops), not beside it
INTERNAL = {"module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params",
            "buffer_names"}


def shape_of(value: Any) -> Shape:
    """A ``param_shapes`` entry (a ``torch.Size``, or its sizes) as a tuple of ints."""
    return tuple(int(d) for d in value)


def stage_1_2_offsets(param_shapes: list[dict[str, Any]], paddings: list[list[int]] | None
                      ) -> list[tuple[list[tuple[str, Shape, int]], int]]:
    """Per parameter group: each parameter's name, shape and first element in the group's flat vector (the
    ranks' partitions one after the other), and the elements the group needs."""
    groups = []
    for g, group_shapes in enumerate(param_shapes):
        entries, at = [], 0
        for i, (name, shape) in enumerate(group_shapes.items()):
            shape = shape_of(shape)
            entries.append((name, shape, at))
            at += math.prod(shape) + (int(paddings[g][i]) if paddings else 0)
        groups.append((entries, at))
    return groups


def stage_3_spans(param_shapes: list[dict[str, Any]], world: int) -> tuple[list[list[tuple[str, Shape, int, int]]], int]:
    """Per flat sub-group: each parameter's name, shape, first element in every rank's flat vector and elements per
    rank; and the elements per rank they need."""
    groups, at = [], 0
    for group_shapes in param_shapes:
        entries = []
        for name, shape in group_shapes.items():
            shape = shape_of(shape)
            per_rank = math.ceil(math.prod(shape) / world)
            entries.append((name, shape, at, per_rank))
            at += per_rank
        groups.append(entries)
    return groups, at


def model_dict(head: dict[str, Any], trainable: dict[str, Any], stage: int,
               striped_frozen: Callable[[str, Shape], Any]) -> tuple[dict[str, Any], int]:
    """The model's state dict in the module's own order: trainable parameters (``trainable``: the fp32 masters),
    frozen ones (from the module, or their fragments: ``striped_frozen(name, shape)`` assembles stage 3's from every
    rank's), buffers, and tied names as the very same object; and how many parameters are frozen."""
    module = head["module"]
    buffers = set(head.get("buffer_names") or [])
    shared = head.get("shared_params") or {}
    frozen_shapes = head.get("frozen_param_shapes") or {}
    out: dict[str, Any] = {}
    frozen = 0
    for name, value in module.items():
        if name in shared:
            continue
        if name in trainable:
            out[name] = trainable[name]
        elif name in buffers:
            out[name] = value
        elif name in frozen_shapes and stage == 3:
            out[name] = striped_frozen(name, shape_of(frozen_shapes[name]))
            frozen += 1
        elif name in frozen_shapes:
            out[name] = head["frozen_param_fragments"][name]
            frozen += 1
        else:  # stage 1 records no frozen parameters: their values are the module's own
            out[name] = value
            frozen += 1
    for alias, owner in shared.items():
        if owner in out:
            out[alias] = out[owner]
    return {k: out[k] for k in module if k in out}, frozen


SKIP = object()  # `optim_tree`: this field is left out of the parameter's state


def group_optimizer_state(optim: dict[str, Any], stage: int) -> dict[str, Any]:
    """An optimizer file's base optimizer state (``state`` and ``param_groups``, over flat groups)."""
    key = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    state = optim.get(key)
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise FormatError("<optimizer file>", f"no '{key}' with the optimizer's state and param groups")
    return state


def group_state(state: dict[Any, Any], g: int) -> dict[str, Any]:
    """Flat group ``g``'s entry of a base optimizer state (its key an int, or the same as a string), or none."""
    return state.get(g, state.get(str(g), {}))


def stage_1_2_field(bases: list[dict[str, Any]], g: int, field: str) -> list[Any] | None:
    """Each rank's part of flat group ``g``'s ``field`` (cut by the caller to the rank's weights' length: each
    rank's state partition is as long as its weight partition, plus its share of the padding); None where a rank
    lacks it (the field is then left out)."""
    parts = [group_state(b["state"], g).get(field) for b in bases]
    return None if any(p is None for p in parts) else parts


def stage_3_field(bases: list[dict[str, Any]], field: str) -> list[list[Any]]:
    """Each rank's parts of ``field``, one per flat sub-group that has it, in the sub-groups' order: concatenated,
    they have the weights' layout (the caller leaves the field out where a rank's are not as long as its weights)."""
    return [[b["state"][s][field] for s in sorted(b["state"], key=int) if field in b["state"][s]] for b in bases]


def optim_tree(names: list[list[str]], base: dict[str, Any], value: Callable[[int, str, str, Any], Any]
               ) -> dict[str, Any]:
    """The per-parameter optimizer state dict (ids in parameter order, ``param_names`` in every group) of a base
    optimizer state over flat groups (``names``: each group's parameters): ``value(group, name, field, flat)`` is
    the parameter's value of the field whose flat value is ``flat`` (`SKIP`: none)."""
    state: dict[int, dict[str, Any]] = {}
    groups = []
    pid = 0
    saved_groups = base["param_groups"]
    for g, group_names in enumerate(names):
        flat_state = group_state(base["state"], g) if g < len(saved_groups) else {}
        hyper = {k: v for k, v in saved_groups[min(g, len(saved_groups) - 1)].items() if k != "params"}
        ids = []
        for name in group_names:
            per: dict[str, Any] = {}
            for field, flat in flat_state.items():
                v = value(g, name, field, flat)
                if v is not SKIP:
                    per[field] = v
            if per:
                state[pid] = per
            ids.append(pid)
            pid += 1
        groups.append({**hyper, "params": ids, "param_names": list(group_names)})
    return {"state": state, "param_groups": groups}


def param_groups_of_sub_groups(sub_groups: list[list[str]], base: dict[str, Any]
                               ) -> tuple[list[list[str]], dict[str, Any]]:
    """Stage 3 splits each param group into flat sub-groups of at most ``sub_group_size`` elements (1e9 by
    default: one per group below that) and keeps one state entry per sub-group: the base optimizer's param
    group ``i`` lists its sub-groups (``params``), whose parameters (``param_shapes``, one dict per sub-group)
    follow one another. Returns each param group's parameter names and the state per param group (the fields,
    and the step counter, of its first sub-group; the tensors themselves are read per parameter)."""
    saved = base["param_groups"]
    state = base["state"]
    listed = [[int(i) for i in group.get("params", [])] for group in saved]
    if sorted(i for ids in listed for i in ids) != list(range(len(sub_groups))):
        raise FormatError("<optimizer files>", f"the optimizer's param groups list the sub-groups {listed}, but the"
                          f" model states hold {len(sub_groups)} (one per 'param_shapes' entry): not a ZeRO-3"
                          " checkpoint this reader understands")
    names = [[n for i in ids for n in sub_groups[i]] for ids in listed]
    fields = {g: {k: v for i in reversed(ids) for k, v in group_state(state, i).items()}
              for g, ids in enumerate(listed)}
    return names, {"state": fields, "param_groups": saved}
