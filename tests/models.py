"""Small real models and the ways tests wrap them (FSDP2, HSDP, FSDP1 strategies, DDP, plain)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn


class MLP(nn.Module):
    """Odd sizes on purpose: shards of 7 or 5 rows are uneven at world sizes 2, 3 and 4."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(5)
        self.blocks = nn.ModuleList([nn.Linear(5, 5) for _ in range(2)])
        self.out = nn.Linear(5, 3, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))
        self.register_buffer("counter", torch.arange(4, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.inp(x)) * self.scale
        for block in self.blocks:
            x = torch.relu(block(x)) + x
        return self.out(x)


class TiedNet(nn.Module):
    """A tied head that is an nn.Linear: wrapping every Linear puts it in another FSDP1 unit than its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 6)
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.embed.weight


def build(name: str, seed: int = 0, device: str = "cpu") -> nn.Module:
    from helpers import tiny_gpt2, tiny_llama

    with torch.device(device):
        if name == "mlp":
            torch.manual_seed(seed)
            return MLP()
        if name == "tied":
            torch.manual_seed(seed)
            return TiedNet()
        if name == "gpt2":
            return tiny_gpt2(seed)
        if name == "llama":
            return tiny_llama(seed)
    raise ValueError(name)


def _blocks(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, MLP):
        return [model.inp, *model.blocks]
    if isinstance(model, TiedNet):
        return list(model.blocks)
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return list(model.model.layers)


def wrap(model: nn.Module, how: str, world_size: int) -> nn.Module:
    """how: plain | ddp | fsdp2 | hsdp | fsdp1-<STRATEGY>-<orig|flat>"""
    if how == "plain":
        return model
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if how in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if how == "hsdp":
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if how.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        _, strategy, params = how.split("-")
        kwargs = {}
        if strategy == "HYBRID_SHARD":
            from torch.distributed.device_mesh import init_device_mesh

            kwargs["device_mesh"] = init_device_mesh("cpu", (2, world_size // 2))
        block_types = {type(b) for b in _blocks(model)}
        return FSDP(model, sharding_strategy=ShardingStrategy[strategy], use_orig_params=params == "orig",
                    auto_wrap_policy=ModuleWrapPolicy(block_types), device_id=torch.device("cpu"), **kwargs)
    raise ValueError(how)


def full_state(model: nn.Module, how: str) -> dict[str, torch.Tensor]:
    """Every rank gets the full, unsharded state dict (clean names) to compare with the source."""
    if how.startswith("fsdp1"):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # offload_to_cpu=False: torch 2.13 on CPU segfaults gathering with offload at world size 3.
        cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            return {k: v.clone() for k, v in model.state_dict().items()}
    state = model.module.state_dict() if how == "ddp" else model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}
