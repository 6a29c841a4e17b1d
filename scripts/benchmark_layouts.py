"""Shard(0) vs Shard(1): a column block restored as fast as a row block (issue 16).

    python scripts/benchmark_layouts.py                     # [32000, 512] fp32 embedding, 2 ranks, 5 warm runs
    python scripts/benchmark_layouts.py --rows 32000 --cols 4096 --world-size 2 --repeat 3 --out x.json

One stored tensor; every rank holds it as a DTensor with ``Shard(0)`` (a block of rows: one range) or
``Shard(1)`` (a block of columns: one run per row), restored with `restore_model` (the NaN check on, as by
default), side by side in one run on 2 gloo ranks. Per rank: the median wall time of the warm runs (page
cache warm), one cold run when the cache can be dropped (root), the bytes we read (our counter) and the
disk bytes the process read (/proc/self/io, cold run, after the warm ones). Baseline: the same column block read by a bare
Python loop of one ``os.preadv`` per row (the floor of "one read per row").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import console, drop_caches  # noqa: E402

from fsdp_restore import launch  # noqa: E402
from fsdp_restore.measure import disk_read_bytes  # noqa: E402


def _rank(rank: int, world_size: int, path: str, rows: int, cols: int, placement: str, repeat: int, cold: bool):
    import ctypes

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fsdp_restore
    import fsdp_restore.shards  # used by name below (the package imports its modules on first use)

    mesh = init_device_mesh("cpu", (world_size,))
    module = torch.nn.Embedding(rows, cols)
    if placement == "bare-preadv":  # the column block by one positional read per row, nothing else
        from fsdp_restore.read import Checkpoint

        ckpt = Checkpoint(path)
        entry = ckpt.entries["weight"]
        width = -(-cols // world_size)
        c0, c1 = rank * width, min(cols, (rank + 1) * width)
        out = torch.empty(rows, c1 - c0)
        view = memoryview((ctypes.c_char * (out.numel() * 4)).from_address(out.data_ptr())).cast("B")
        fd = os.open(entry.file, os.O_RDONLY)
        step = (c1 - c0) * 4
        times = []
        for _ in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            for r in range(rows):
                os.preadv(fd, [view[r * step:(r + 1) * step]], entry.offset + (r * cols + c0) * 4)
            times.append(time.perf_counter() - t0)
        return {"warm_s": statistics.median(times), "bytes_read": out.numel() * 4}
    dim = 0 if placement == "Shard(0)" else 1
    module.weight = torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(dim)]))
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        report = fsdp_restore.restore_model(module, path, model_prefix="")
        times.append(time.perf_counter() - t0)
    result = {}
    if cold:  # after the warm runs: every code path is loaded, so the disk reads are the checkpoint's
        dist.barrier()
        if rank == 0:
            drop_caches()
        dist.barrier()
        before = disk_read_bytes()
        t0 = time.perf_counter()
        fsdp_restore.restore_model(module, path, model_prefix="")
        result["cold_s"] = time.perf_counter() - t0
        result["cold_disk_bytes"] = disk_read_bytes() - before
    result.update(warm_s=statistics.median(times), bytes_read=report.bytes_read,
                  pieces=len(fsdp_restore.shards.local_targets(module)[0][0].pieces))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32000)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workdir", default="/tmp/fsdp_restore_layouts")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    from safetensors.torch import save_file

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"embedding-{args.rows}x{args.cols}.safetensors"
    torch.manual_seed(0)
    save_file({"weight": torch.randn(args.rows, args.cols)}, path)
    cold = drop_caches()
    share = args.rows * args.cols * 4 / args.world_size
    results = {}
    for placement in ("Shard(0)", "Shard(1)", "bare-preadv"):
        per_rank = launch.run_ranks(_rank, args.world_size, str(path), args.rows, args.cols, placement, args.repeat,
                                    cold and placement != "bare-preadv", backend="gloo", timeout=1800)
        results[placement] = per_rank
    from rich.table import Table

    table = Table(title=f"[{args.rows}, {args.cols}] fp32 on {args.world_size} ranks (median of {args.repeat} warm runs)")
    for col in ("layout", "pieces/rank", "warm s (max rank)", "vs Shard(0)", "cold s", "bytes read / share",
                "disk bytes (cold, mean rank) / share"):
        table.add_column(col)
    base = max(r["warm_s"] for r in results["Shard(0)"])
    for placement, per_rank in results.items():
        warm = max(r["warm_s"] for r in per_rank)
        cold_s = max((r.get("cold_s", 0) for r in per_rank), default=0)
        disk = sum(r.get("cold_disk_bytes", 0) for r in per_rank) / len(per_rank)
        table.add_row(placement, str(per_rank[0].get("pieces", "-")), f"{warm:.4f}", f"{warm / base:.2f}x",
                      f"{cold_s:.3f}" if cold_s else "-", f"{max(r['bytes_read'] for r in per_rank) / share:.3f}",
                      f"{disk / share:.2f}" if disk else "-")
    console.print(table)
    record = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, "rows": args.rows, "cols": args.cols,
              "world_size": args.world_size, "repeat": args.repeat, "cold": cold, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
