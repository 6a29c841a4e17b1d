"""The seed's FSDP1 route as an executor of the same read plan: ``FSDP.apply()`` summons each unit's
full parameters and whole tensors are copied in. Kept for parity with OLMo PR #388 and as a
cross-check; it is not the default because every rank reads every tensor in full (N x the checkpoint
across N ranks) and each unit's full parameters are materialized during the copy. The default
executor (execute.py) reads 1/N per rank. Items outside FSDP1 units (plain buffers, DTensors) are read
by the default executor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from .execute import DEFAULT_READ_THREADS, execute_reads, overflow_message
from .plan import ReadItem, Source, tensor_sources
from .read import Checkpoint
from .shards import _fsdp1_units, _join, clean_name
from .write import cast_overflow


def _full_tensor(ckpt: Checkpoint, src: Source) -> torch.Tensor:
    full = ckpt.get_tensor(src.key)
    if src.start or tuple(full.shape) != tuple(src.shape):
        full = full.reshape(-1)[src.start:src.start + src.numel].view(src.shape)
    ckpt.bytes_read += src.numel * full.element_size()  # every element is touched by the copy
    return full


def execute_by_apply(model: nn.Module, ckpt: Checkpoint, items: Sequence[ReadItem], *, prefix: str,
                     threads: int = DEFAULT_READ_THREADS) -> None:
    """Restore the planned FSDP1 parameters through ``model.apply`` (whole tensors into summoned
    units), the other items by positional reads."""
    sources, _ = tensor_sources(ckpt, prefix, [item.name for item in items])  # named as the plan names them
    per_module: dict[int, list[tuple[str, str]]] = {}
    fsdp1_names: set[str] = set()
    for unit_prefix, handle in _fsdp1_units(model):
        flat = handle.flat_param
        for info, fqn in zip(flat._param_infos, flat._fqns):
            name = _join(unit_prefix, clean_name(fqn))
            fsdp1_names.add(name)
            if name in sources:
                per_module.setdefault(id(info.module), []).append((info.param_name, name))

    overflowed: Counter[str] = Counter()

    def copy_full(module: nn.Module) -> None:
        # Runs inside FSDP.apply: this module's unit is summoned, so the attributes are unsharded views.
        for attr, name in per_module.get(id(module), []):
            dest, full = getattr(module, attr), _full_tensor(ckpt, sources[name])
            dest.copy_(full)
            if n := cast_overflow(full.dtype, dest, lambda: full):
                overflowed[sources[name].key] += n

    with torch.no_grad():
        model.apply(copy_full)
    if overflowed:
        raise ValueError(overflow_message(overflowed))
    rest = [item for item in items if item.name not in fsdp1_names]
    execute_reads(ckpt, rest, threads)
    for item in items:
        if item.name in fsdp1_names:
            item.done = True  # written through the summoned unit; the check verifies every element for real
