"""Real DeepSpeed ZeRO checkpoints for the tests, and DeepSpeed's own view of them as the oracle.

A tiny model with every hard case: odd sizes (partitions pad), a tied embedding/head, a frozen layer, a
persistent and a non-persistent buffer. Each rank trains two AdamW steps with DeepSpeed on CPU (gloo),
saves a checkpoint, records through DeepSpeed's public API the full fp32 master weights and optimizer
state (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``) and the module's frozen weights,
then trains two more steps and records their losses: what a resumed run must reproduce.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

STEPS_BEFORE, STEPS_AFTER = 2, 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(13, 6)
        self.frozen = torch.nn.Linear(6, 7)
        self.body = torch.nn.Linear(6, 5)
        self.out = torch.nn.Linear(5, 6)
        self.head = torch.nn.Linear(6, 13, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = (self.embed(ids) * self.scale).to(self.body.weight.dtype)
        x = x + self.frozen(x)[..., :6]
        return self.head(self.out(torch.relu(self.body(x))))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(1000 * rank + step))


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).float().pow(2).mean()


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.05)


def decay_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """nanoGPT's two groups: weight decay for matrices, none for vectors (trainable parameters only)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0}]


def _generate(rank: int, world_size: int, root: str, combos: list[tuple[int, str]],
              sub_group_size: int | None = None) -> str:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    for stage, dtype in combos:
        out = Path(root) / f"z{stage}-{dtype}-ws{world_size}{f'-sub{sub_group_size}' if sub_group_size else ''}"
        torch.manual_seed(0)
        model = Net()
        zero: dict[str, Any] = {"stage": stage}
        if sub_group_size:  # stage 3 splits each param group into flat sub-groups of at most this many elements
            zero["sub_group_size"] = sub_group_size
        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
                               "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        params = decay_groups(model) if sub_group_size else [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=make_optimizer(params))
        for step in range(STEPS_BEFORE):
            engine.backward(loss_of(engine, batch(rank, step)))
            engine.step()
        engine.save_checkpoint(str(out), client_state={"epoch": 3})
        oracle: dict[str, Any] = {"weights": {}, "optim": {}, "frozen": {}, "losses": []}
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                oracle["weights"][name] = safe_get_full_fp32_param(p).clone()
                oracle["optim"][name] = {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}
            elif stage == 3:
                with deepspeed.zero.GatheredParameters([p]):
                    oracle["frozen"][name] = p.data.clone()
            else:
                oracle["frozen"][name] = p.data.clone()
        oracle["scale"] = engine.module.scale.clone()
        for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            loss = loss_of(engine, batch(rank, step))
            oracle["losses"].append(float(loss))
            engine.backward(loss)
            engine.step()
        torch.save(oracle, out / f"oracle-rank{rank}.pt")
        del engine, model
    return "ok"


def generate(root: Path, world_size: int, combos: list[tuple[int, str]], sub_group_size: int | None = None) -> None:
    """Checkpoints ``z{stage}-{dtype}-ws{world_size}`` under ``root``; with ``sub_group_size``, ``...-sub{N}``
    made with `decay_groups` (two param groups, split by stage 3 into sub-groups of at most N elements)."""
    from dist import run_ranks

    run_ranks(_generate, world_size, str(root), combos, sub_group_size, timeout=600)


WIDE = (512, 4)  # features, layers: ~1M parameters, each rank's fp32 partition and moments ~2 MB (many pages)


def _generate_wide(rank: int, world_size: int, root: str, stages: list[int]) -> str:
    """bf16 checkpoints of a model whose partitions span many pages (for what a conversion reads of them)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    features, layers = WIDE
    for stage in stages:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(features, features) for _ in range(layers)])
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
               "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
        engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=make_optimizer(model.parameters()))
        x = torch.randn(1, features, generator=torch.Generator().manual_seed(rank), dtype=torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        engine.save_checkpoint(str(Path(root) / f"wide-z{stage}"))
        del engine, model
    return "ok"


def generate_wide(root: Path, world_size: int, stages: list[int]) -> None:
    from dist import run_ranks

    run_ranks(_generate_wide, world_size, str(root), stages, timeout=600)
