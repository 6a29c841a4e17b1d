"""save_sharded of a tensor-parallel column block (``Shard(1)``: RowwiseParallel's weight) against its ``Shard(0)``
twin (ColwiseParallel's), side by side in one run: every rank writes its column block one row per ``pwrite``
(the other ranks' columns lie between), and folds each row's crc32 into the tensor's.

    python scripts/benchmark_save_columns.py                     # a [32000, 512] fp32 weight, 2 ranks, 5 rounds
    python scripts/benchmark_save_columns.py --rows 8000 --cols 4096 --world-size 2

The two layouts alternate round by round (gloo, CPU, a tmpfs-free directory under --dir); medians of each rank's
whole ``save_sharded`` call and its write phase are reported, and the slowest rank's median is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_restore.launch import run_ranks  # noqa: E402

LAYOUTS = ("Shard(0)", "Shard(1)")


def worker(rank: int, world_size: int, root: str, rows: int, cols: int, rounds: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fsdp_restore

    mesh = init_device_mesh("cpu", (world_size,))
    models = {}
    for layout in LAYOUTS:
        model = torch.nn.Sequential(torch.nn.Linear(cols, rows, bias=False))  # weight [rows, cols]
        style = RowwiseParallel() if layout == "Shard(1)" else ColwiseParallel()
        models[layout] = parallelize_module(model, mesh, {"0": style})
    seconds: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    writes: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for i in range(rounds + 1):  # round 0: a warm-up
        for layout in LAYOUTS:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            report = fsdp_restore.save_sharded(models[layout], os.path.join(root, f"w-{layout[-2]}.safetensors"))
            if i:
                seconds[layout].append(time.perf_counter() - t0)
                writes[layout].append(report.timings["write"])
    return {layout: {"seconds": statistics.median(seconds[layout]), "write": statistics.median(writes[layout]),
                     "runs": seconds[layout]} for layout in LAYOUTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32000)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        results = run_ranks(worker, args.world_size, root, args.rows, args.cols, args.rounds, timeout=1800)
    summary = {layout: {"seconds": max(r[layout]["seconds"] for r in results),
                        "write": max(r[layout]["write"] for r in results)} for layout in LAYOUTS}
    ratio = summary["Shard(1)"]["seconds"] / summary["Shard(0)"]["seconds"]
    for layout in LAYOUTS:
        print(f"{layout}: save {summary[layout]['seconds']:.3f} s, write phase {summary[layout]['write']:.3f} s")
    print(f"Shard(1) / Shard(0): {ratio:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": args.rows, "cols": args.cols, "world_size": args.world_size,
                                              "rounds": args.rounds, "summary": summary, "ratio": ratio,
                                              "ranks": results}, indent=1))


if __name__ == "__main__":
    main()
