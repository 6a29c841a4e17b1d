"""The test suite's multi-rank runner: the library's launcher, with transformers preloaded, failures as
AssertionError, parametrized over backends.

Backends: ``gloo`` (CPU tensors, everywhere); ``nccl`` (one GPU per rank; skipped unless the machine has
that many); ``gloo-cuda`` (gloo collectives, every rank's model on a GPU, ranks sharing GPUs when there
are fewer than ranks: the device path of a multi-rank restore on a one-GPU machine; skipped without a
GPU). Inside a rank, `models.DEVICE` is that rank's device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fsdp_restore import launch

launch.PRELOAD.append("transformers")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


ALL = ("gloo", "nccl", "gloo-cuda")
GLOO = ("gloo",)
GPU = ("nccl", "gloo-cuda")
NCCL = ("nccl",)


def _skip(backend: str, world_size: int) -> list[Any]:
    if backend == "nccl":
        return [pytest.mark.skipif(gpu_count() < world_size, reason=f"NCCL needs {world_size} GPU(s)")]
    if backend == "gloo-cuda":
        return [pytest.mark.skipif(gpu_count() == 0, reason="no GPU")]
    return []


def backends(world_size: int, only: tuple[str, ...] = ALL) -> list[Any]:
    """``pytest.param``s of the backends ``only``, the ones this machine cannot run marked to be skipped."""
    return [pytest.param(b, id=b, marks=_skip(b, world_size)) for b in only]


def cases(world_size: int, *values: Any, only: tuple[str, ...] = ALL) -> list[Any]:
    """``pytest.param(*values, world_size, backend)`` for each backend of ``only`` (for "...,world_size,backend")."""
    return [pytest.param(*values, world_size, b, id="-".join([*map(str, values), str(world_size), b]),
                         marks=_skip(b, world_size)) for b in only]


def slow(params: list[Any]) -> list[Any]:
    """The same ``pytest.param``s, marked ``slow`` (run by ``scripts/test.sh -m slow``): the default suite keeps to
    its time budget on 2 cores with one case of a kind, the slow suite runs the rest."""
    return [pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow]) for p in params]


def _on_device(rank: int, world_size: int, fn: Callable[..., Any], backend: str, *args: Any) -> Any:
    import models

    if backend == "gloo":
        models.DEVICE = torch.device("cpu")
    else:
        models.DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(models.DEVICE)
    return fn(rank, world_size, *args)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 180,
              pg_timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on real ranks of ``backend``; AssertionError with every failing
    rank's traceback."""
    try:
        return launch.run_ranks(_on_device, world_size, fn, backend, *args, timeout=timeout,
                                backend="nccl" if backend == "nccl" else "gloo", pg_timeout=pg_timeout)
    except launch.RankFailure as e:
        raise AssertionError(str(e)) from None
