"""Small real models and the ways tests wrap them (FSDP2, HSDP, FSDP1 strategies, DDP, plain).

`DEVICE` is where a rank's models live (set per rank by dist.run_ranks: the CPU under gloo, a GPU under
nccl and gloo-cuda). Models are initialised on the CPU, so that a seed gives the same values everywhere.
"""

from __future__ import annotations

import torch
from torch import nn

DEVICE = torch.device("cpu")


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


class TitanLlama(nn.Module):
    """The tiny Llama's tensors under torchtitan's names (tok_embeddings, layers.N.attention.wq, ...,
    feed_forward.w1/w2/w3, output): a renamed model for key_map. No forward: only names and shapes matter."""

    def __init__(self, vocab: int = 101, dim: int = 30, hidden: int = 46, kv_dim: int = 10, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.attention = nn.Module()
            for name, (out, inp) in {"wq": (dim, dim), "wk": (kv_dim, dim), "wv": (kv_dim, dim), "wo": (dim, dim)}.items():
                setattr(block.attention, name, nn.Linear(inp, out, bias=False))
            block.feed_forward = nn.Module()
            for name, (out, inp) in {"w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}.items():
                setattr(block.feed_forward, name, nn.Linear(inp, out, bias=False))
            block.attention_norm = nn.RMSNorm(dim)
            block.ffn_norm = nn.RMSNorm(dim)
            self.layers.append(block)
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


def build(name: str, seed: int = 0, device: str | torch.device | None = None) -> nn.Module:
    """The named model with seed-determined values, on ``device`` (default: `DEVICE`; "meta": no values)."""
    if device is None or str(device) != "meta":
        with torch.device("cpu"):
            return _build(name, seed, "cpu").to(device or DEVICE)
    return _build(name, seed, "meta")


def converted(root, name: str, **options):
    """``{"model": state dict}`` of the named model (seed 0), saved and converted into ``root``; the path."""
    import fsdp_restore

    torch.save({"model": build(name).state_dict()}, root / f"{name}.pt")
    fsdp_restore.convert(root / f"{name}.pt", root / f"{name}.safetensors", **options)
    return root / f"{name}.safetensors"


def _build(name: str, seed: int, device: str) -> nn.Module:
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
        if name == "llama-tied":
            return tiny_llama(seed, tie_word_embeddings=True)
        if name == "titan":
            torch.manual_seed(seed)
            return TitanLlama()
    raise ValueError(name)


def _blocks(model: nn.Module) -> list[nn.Module]:
    if isinstance(model, MLP):
        return [model.inp, *model.blocks]
    if isinstance(model, TiedNet):
        return list(model.blocks)
    if isinstance(model, TitanLlama):
        return list(model.layers)
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return list(model.model.layers)


def wrap(model: nn.Module, how: str, world_size: int) -> nn.Module:
    """how: plain | ddp | fsdp2 | hsdp | fsdp1-<STRATEGY>-<orig|flat> | tp | fsdp2+tp | fsdp2cp+tp"""
    if how == "plain":
        return model
    if how in ("tp", "fsdp2+tp", "fsdp2cp+tp"):
        return _tensor_parallel(model, how, world_size)
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[DEVICE] if DEVICE.type == "cuda" else None)
    if how in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # an explicit mesh: left to itself, FSDP2 picks the GPU whenever the machine has one
        mesh = init_device_mesh(DEVICE.type, (world_size,))
        if how == "hsdp":
            mesh = init_device_mesh(DEVICE.type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
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

            kwargs["device_mesh"] = init_device_mesh(DEVICE.type, (2, world_size // 2))
        block_types = {type(b) for b in _blocks(model)}
        return FSDP(model, sharding_strategy=ShardingStrategy[strategy], use_orig_params=params == "orig",
                    auto_wrap_policy=ModuleWrapPolicy(block_types), device_id=DEVICE, **kwargs)
    raise ValueError(how)


def _tp_plan(model: nn.Module) -> dict:
    """torchtitan's Llama plan: column-split projections, row-split outputs (Shard(1)), a column-split
    embedding (Shard(1)) and head, sequence-parallel norms (Replicate parameters)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {"model.embed_tokens": ColwiseParallel(), "lm_head": ColwiseParallel(), "model.norm": SequenceParallel()}
    for i, _ in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        plan[f"model.layers.{i}.input_layernorm"] = SequenceParallel()
    return plan


def _tensor_parallel(model: nn.Module, how: str, world_size: int) -> nn.Module:
    """how: tp (1-D mesh) | fsdp2+tp (dp x tp = 2 x world_size/2, FSDP2 over TP) | fsdp2cp+tp (torchtitan's
    dp_shard x cp x tp = 1 x 2 x world_size/2, FSDP2 over the flattened dp_shard_cp sub-mesh); a Llama."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if how == "tp":
        return parallelize_module(model, init_device_mesh(DEVICE.type, (world_size,)), _tp_plan(model))
    if how == "fsdp2cp+tp":
        mesh = init_device_mesh(DEVICE.type, (1, 2, world_size // 2), mesh_dim_names=("dp_shard", "cp", "tp"))
        dp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    else:
        mesh = init_device_mesh(DEVICE.type, (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
    parallelize_module(model, mesh["tp"], _tp_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def full_state(model: nn.Module, how: str) -> dict[str, torch.Tensor]:
    """Every rank gets the full, unsharded state dict (clean names) to compare with the source."""
    if how.startswith("fsdp1"):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # offload_to_cpu=False: torch 2.13 on CPU segfaults gathering with offload at world size 3.
        cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            return {k: v.cpu().clone() for k, v in model.state_dict().items()}
    state = model.module.state_dict() if how == "ddp" else model.state_dict()
    return {k: _full_tensor(v) for k, v in state.items()}


def _full_tensor(v: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU. DTensors are gathered with ``full_tensor()``, except on GPU memory
    under gloo, whose CUDA all-gather of uneven shards crashes (seen: torch 2.11): there every rank's
    local block goes through ``all_gather_object`` and is placed by torch's own layout arithmetic."""
    import torch.distributed as dist

    if not hasattr(v, "full_tensor"):
        return v.detach().cpu().clone()
    if v.device.type == "cpu" or dist.get_backend() == "nccl":
        return v.full_tensor().cpu().clone()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
    blocks: list = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, (tuple(shape), tuple(offset), v.to_local().detach().cpu()))
    full = torch.empty(v.shape, dtype=v.dtype)
    for block_shape, block_offset, local in blocks:
        full[tuple(slice(o, o + n) for o, n in zip(block_offset, block_shape))] = local
    return full
