"""The test suite's multi-rank runner: the library's launcher, with transformers preloaded, failures as AssertionError."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdp_restore import launch

launch.PRELOAD.append("transformers")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on real gloo ranks; AssertionError with every failing rank's traceback."""
    try:
        return launch.run_ranks(fn, world_size, *args, timeout=timeout, backend="gloo")
    except launch.RankFailure as e:
        raise AssertionError(str(e)) from None
