"""The NaN-fill check and the all-ranks verdict.

Before reading, every element that is about to be restored is set to NaN (floating tensors); after,
any NaN left is either "never restored" or "the checkpoint itself holds NaN there" - we tell them
apart by re-reading only the source elements of pieces that still hold NaN. Integer and bool
tensors cannot hold NaN, so their coverage is tracked instead (each piece marks itself done).
Padding (FSDP1 flat-parameter padding, FSDP2 uneven shards) belongs to no piece, so it is never
filled and never flagged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import RestoreError
from .read import Checkpoint
from .shards import Piece, Target


@dataclass
class ReadTask:
    """Read ``piece.dest.numel()`` elements of stored tensor ``key`` from element ``src_start``."""

    key: str
    src_start: int
    piece: Piece
    target: Target
    done: bool = False
    # None: not screened yet; False: screened clean after the read (no NaN anywhere in ``dest``)
    may_hold_nan: bool | None = None


@dataclass
class CheckResult:
    unrestored: list[str] = field(default_factory=list)  # names with elements never written
    nan_in_checkpoint: list[str] = field(default_factory=list)  # restored NaN that the file holds


def floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def may_hold_nan(t: torch.Tensor) -> bool:
    """Cheap screen: False proves ``t`` holds no NaN. A sum is one vectorized pass with no temporary,
    ~8x faster than ``isnan(t).any()`` on CPU (measured), and any NaN makes it NaN (so does inf - inf,
    a false alarm that the exact check then clears)."""
    if not floating(t.dtype) or t.numel() == 0:
        return False
    return bool(torch.isnan(t.sum()))


def fill_nan(tasks: Sequence[ReadTask]) -> None:
    """Poison every element that the plan is about to restore."""
    with torch.no_grad():
        for task in tasks:
            if floating(task.piece.dest.dtype):
                task.piece.dest.fill_(float("nan"))


def find_unrestored(tasks: Sequence[ReadTask], ckpt: Checkpoint) -> CheckResult:
    """Names whose planned elements were not all restored; NaN that the checkpoint holds is reported apart."""
    result = CheckResult()
    bad: dict[str, int] = {}
    source_nan: set[str] = set()
    for task in tasks:
        name = task.target.name
        if not task.done:
            bad[name] = bad.get(name, 0) + task.piece.dest.numel()
            continue
        dest = task.piece.dest
        if task.may_hold_nan is False or not may_hold_nan(dest):
            continue
        left = torch.isnan(dest)
        if not bool(left.any()):
            continue
        entry = ckpt.entries[task.key]
        stored = torch.empty(dest.numel(), dtype=entry.dtype)
        ckpt.read_range(task.key, task.src_start, stored)
        stored_nan = torch.isnan(stored.to(dest.device)) if floating(entry.dtype) else torch.zeros_like(left)
        missing = int((left & ~stored_nan).sum())
        if missing:
            bad[name] = bad.get(name, 0) + missing
        else:
            source_nan.add(name)
    result.unrestored = [f"{n} ({c} elements)" for n, c in sorted(bad.items())]
    result.nan_in_checkpoint = sorted(source_nan)
    return result


def agree(problems: dict[str, list[str]], group: dist.ProcessGroup | None = None) -> dict[str, list[str]]:
    """Merge every rank's problems (one all-gather), so that all ranks reach the same verdict."""
    if not (dist.is_available() and dist.is_initialized()):
        return problems
    gathered: list[dict[str, list[str]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problems, group=group)
    merged: dict[str, list[str]] = {}
    multi = len(gathered) > 1
    for rank, rank_problems in enumerate(gathered):
        for kind, items in (rank_problems or {}).items():
            bucket = merged.setdefault(kind, [])
            for item in items:
                text = f"{item} [rank {rank}]" if multi and kind == "unrestored" else item
                if text not in bucket:
                    bucket.append(text)
    return {k: v for k, v in merged.items() if v}


_LABELS = {
    "error": "errors", "missing": "missing from the checkpoint", "unexpected": "unexpected in the checkpoint",
    "shape": "shape mismatches", "dtype": "dtype mismatches", "unrestored": "not restored (still NaN / not covered)",
    "unsupported": "unsupported layouts",
}


def raise_if_problems(problems: dict[str, list[str]], what: str, limit: int = 20) -> None:
    """Raise one `RestoreError` listing every kind of problem (first ``limit`` of each)."""
    if not problems:
        return
    lines = [f"{what} failed:"]
    for kind, items in problems.items():
        shown = ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
        lines.append(f"  {_LABELS.get(kind, kind)} ({len(items)}): {shown}")
    if "missing" in problems or "unexpected" in problems:
        lines.append("  hint: check prefix= (the subtree holding the weights) or pass strict=False to restore the"
                     " keys that match")
    raise RestoreError("\n".join(lines), problems)
