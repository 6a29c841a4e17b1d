"""The seed's FSDP1 route: ``FSDP.apply()`` summons each unit's full parameters and whole tensors are
copied in. Kept for parity with OLMo PR #388 and as a cross-check; it is not the default because
every rank reads every tensor in full (N x the checkpoint across N ranks) and each unit's full
parameters are materialized during the copy. The default ``method="read"`` reads 1/N per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .check import ReadTask
from .read import Checkpoint
from .restore import Source, execute_reads, tensor_sources
from .shards import _fsdp1_units, _join, clean_name


def _full_tensor(ckpt: Checkpoint, src: Source) -> torch.Tensor:
    full = ckpt.get_tensor(src.key)
    numel = 1
    for n in src.shape:
        numel *= n
    if src.start or tuple(full.shape) != tuple(src.shape):
        full = full.reshape(-1)[src.start:src.start + numel].view(src.shape)
    ckpt.bytes_read += numel * full.element_size()  # every element is touched by the copy
    return full


def restore_by_apply(model: nn.Module, ckpt: Checkpoint, tasks: Sequence[ReadTask], *, prefix: str,
                     threads: int = 4) -> None:
    sources, _ = tensor_sources(ckpt, prefix)
    per_module: dict[int, list[tuple[str, str]]] = {}
    for unit_prefix, handle in _fsdp1_units(model):
        flat = handle.flat_param
        for info, fqn in zip(flat._param_infos, flat._fqns):
            per_module.setdefault(id(info.module), []).append((info.param_name, _join(unit_prefix, clean_name(fqn))))

    def copy_full(module: nn.Module) -> None:
        # Runs inside FSDP.apply: this module's unit is summoned, so the attributes are unsharded views.
        for attr, name in per_module.get(id(module), []):
            if name in sources:
                getattr(module, attr).copy_(_full_tensor(ckpt, sources[name]))

    with torch.no_grad():
        model.apply(copy_full)
    for task in tasks:
        if task.target.layout == "fsdp1":
            task.done = True  # the NaN check verifies these elements for real
    execute_reads(ckpt, [t for t in tasks if t.target.layout != "fsdp1"], threads)
