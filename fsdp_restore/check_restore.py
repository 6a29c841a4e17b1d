"""``fsdp-restore check-restore``: prove that a checkpoint restores into *your* sharded model.

Spawns N local ranks, builds the model with the user's factory (``module:function`` or
``path/to/file.py:function``), shards it with FSDP2 (on the meta device, then ``to_empty``) or FSDP1,
restores with the NaN-fill check, then compares a crc32 of every restored local piece with a crc32 of
the same elements read back from the file (cast to the model's dtype). The verdict is the exit code.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Group
from rich.table import Table
from torch import nn

from .errors import FsdpRestoreError
from .launch import RankFailure, pick_backend, run_ranks
from .read import Checkpoint
from .restore import default_prefix, plan_model_reads, restore_model, tensor_sources
from .shards import local_targets
from .write import tensor_bytes


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """Import ``module:function`` (module on sys.path or the current directory) or ``file.py:function``."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like module:function or path/to/file.py:function, not '{spec}'")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ValueError(f"--model: no file {module_name}")
        loader_spec = importlib.util.spec_from_file_location(f"_fsdp_restore_user_{abs(hash(module_name))}", module_name)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        loader_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"--model: cannot import {module_name}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model: {module_name} has no function {attr}")
    return factory


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to wrap separately: members of every ModuleList."""
    return [m for mod in model.modules() if isinstance(mod, nn.ModuleList) for m in mod]


def shard_model(factory: Callable[[], nn.Module], fsdp: str, device: torch.device) -> nn.Module:
    if fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = factory()
        for block in _blocks(model):
            fully_shard(block)
        fully_shard(model)
        return model.to_empty(device=device)
    if fsdp == "fsdp1":
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        model = factory()
        # Wrap exactly the blocks (as for FSDP2), not every module of their types: a tied head that is
        # an nn.Linear must stay in the root unit with its embedding.
        block_ids = {id(b) for b in _blocks(model)}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in block_ids)
        return FSDP(model, device_id=device, use_orig_params=True, auto_wrap_policy=policy if block_ids else None)
    raise ValueError(f"--fsdp must be fsdp2 or fsdp1, not '{fsdp}'")


def compare_with_file(model: nn.Module, ckpt: Checkpoint, prefix: str) -> tuple[int, list[str]]:
    """crc32 of every restored local piece vs the same elements read from the file; (pieces, mismatches)."""
    targets, aliases = local_targets(model)
    sources, _ = tensor_sources(ckpt, prefix)
    tasks, _, _ = plan_model_reads(targets, aliases, sources, ckpt, strict=False)
    bad: set[str] = set()
    for task in tasks:
        dest = task.piece.dest
        stored = torch.empty(dest.numel(), dtype=ckpt.entries[task.key].dtype)
        ckpt.read_range(task.key, task.src_start, stored)
        expected = stored.to(dest.dtype)
        if zlib.crc32(tensor_bytes(expected)) != zlib.crc32(tensor_bytes(dest.detach().cpu().contiguous())):
            bad.add(task.target.name)
    return len(tasks), sorted(bad)


def _worker(rank: int, world_size: int, path: str, factory_spec: str, fsdp: str, prefix: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    try:
        model = shard_model(load_factory(factory_spec), fsdp, device)
        with Checkpoint(path) as ckpt:
            prefix = default_prefix(ckpt) if prefix is None else prefix
            report = restore_model(model, ckpt, prefix=prefix, check=True)
            pieces, mismatches = compare_with_file(model, ckpt, prefix)
        return {"tensors": report.tensors, "elements": report.elements, "bytes_read": report.bytes_read,
                "seconds": report.seconds, "pieces": pieces, "mismatches": mismatches,
                "nan_in_checkpoint": report.nan_in_checkpoint, "error": None}
    except (FsdpRestoreError, ValueError, OSError) as e:
        return {"error": str(e)}


@dataclass
class CheckRestoreReport:
    path: str
    nproc: int
    fsdp: str
    backend: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> Group:
        table = Table(title=f"check-restore {self.path}: {self.nproc} ranks, {self.fsdp}, {self.backend}")
        for col in ("rank", "tensors", "elements", "bytes read", "seconds", "pieces checked", "verdict"):
            table.add_column(col, justify="right")
        for rank, r in enumerate(self.ranks):
            if r.get("error"):
                table.add_row(str(rank), "", "", "", "", "", "[red]error[/]")
                continue
            table.add_row(str(rank), str(r["tensors"]), str(r["elements"]), f"{r['bytes_read'] / 1e6:.2f} MB",
                          f"{r['seconds']:.2f}", str(r["pieces"]), "[green]OK[/]" if not r["mismatches"] else "[red]FAIL[/]")
        lines = [f"[red]FAIL[/] {p}" for p in self.problems] or ["[green]restore check passed[/]: every element"
                                                                 " restored (NaN-fill check) and equal to the file"]
        return Group(table, *lines)


def run_check_restore(path: str, factory: str, *, nproc: int = 2, fsdp: str = "fsdp2",
                      prefix: str | None = None, timeout: float = 600) -> CheckRestoreReport:
    """Run the check on ``nproc`` local ranks; never raises for a failed check (see ``report.ok``)."""
    Checkpoint(path).close()  # a bad file fails here with a FormatError, before spawning anything
    load_factory(factory)  # likewise an import error in the factory
    backend = pick_backend(nproc)
    report = CheckRestoreReport(path=str(path), nproc=nproc, fsdp=fsdp, backend=backend)
    try:
        report.ranks = run_ranks(_worker, nproc, str(path), factory, fsdp, prefix, timeout=timeout, backend=backend)
    except RankFailure as e:
        report.problems = [f"rank {r}: {msg.splitlines()[0]}" for r, msg in sorted(e.errors.items())]
        return report
    errors = {r.get("error") for r in report.ranks if r.get("error")}
    report.problems.extend(sorted(errors))
    mismatched = sorted({m for r in report.ranks for m in r.get("mismatches", [])})
    if mismatched:
        report.problems.append(f"restored values differ from the file: {', '.join(mismatched)}")
    return report
