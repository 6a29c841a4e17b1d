"""The checked restore's read size: the same restore with chunks of several sizes against a bare read loop,
warm, on the CPU, side by side in one run.

    python scripts/benchmark_read_chunks.py                          # 2.1 GB stack of 1022 tensors, ws 1 and 2
    python scripts/benchmark_read_chunks.py --layers 31 --dim 4096 --world-sizes 1   # 31 tensors of 64 MB

With the check on host memory, each read thread fills a chunk's destinations with NaN, reads into them and sums
them (the ledger, check.py). In every rank's process (gloo, FSDP2 ``fully_shard`` of a stack of ``Linear``
layers), after a warm-up of each: ``bare`` (16 MB ``os.preadv`` calls on 4 threads into one buffer, the rank's
share of bytes) and `restore_model` with the check, its reads cut at each ``--sizes`` MB (``cache_chunk_bytes``
replaced for the run) and at the size the restore picks itself (``auto``). The variants alternate round by round;
medians of the slowest rank. Results: BENCHMARKS.md ("Cache-sized reads for the checked restore").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_read import STEP, Stack, _shape  # noqa: E402

from fsdp_restore.launch import run_ranks  # noqa: E402


def worker(rank: int, world_size: int, path: str, layers: int, dim: int, sizes: list[int], rounds: int,
           threads: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fsdp_restore

    restore_module = importlib.import_module("fsdp_restore.restore")
    auto = restore_module.cache_chunk_bytes
    torch.manual_seed(0)
    model = Stack(layers, dim)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    start = (os.path.getsize(path) - local) // world_size * rank
    buf = torch.empty(local, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(threads)

    def bare() -> None:
        list(pool.map(lambda off: os.preadv(fd, [view[off:off + STEP]], start + off), range(0, local, STEP)))

    def checked(chunk: Any) -> None:
        restore_module.cache_chunk_bytes = chunk
        try:
            fsdp_restore.restore_model(model, path, check=True, thread_count=threads)
        finally:
            restore_module.cache_chunk_bytes = auto

    variants = {"bare": bare, f"checked, auto ({auto(threads) >> 20} MB)": lambda: checked(auto)}
    for mb in sizes:
        variants[f"checked, {mb} MB"] = lambda mb=mb: checked(lambda _threads: mb << 20)
    for run in variants.values():
        run()  # warm-up: the page cache, first-time code paths, allocator pools
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - t0)
    os.close(fd)
    pool.shutdown()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fsdp_restore_bench_read"))
    parser.add_argument("--layers", type=int, help="default: the 2.1 GB stack of benchmark_read.py")
    parser.add_argument("--dim", type=int)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 8, 4, 2], help="chunk sizes in MB")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    layers, dim = (args.layers, args.dim) if args.layers and args.dim else _shape(2100.0)
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / f"stack-{layers}x{dim}.safetensors"
    if not path.exists():
        from fsdp_restore.convert import save

        torch.manual_seed(0)
        save(Stack(layers, dim).state_dict(), path)
    results: dict[str, Any] = {"file_bytes": path.stat().st_size, "layers": layers, "dim": dim, "world_sizes": {}}
    for ws in args.world_sizes:
        per_rank = run_ranks(worker, ws, str(path), layers, dim, args.sizes, args.rounds, args.threads, timeout=1200,
                             backend="gloo")
        slowest = {k: [max(r[k][i] for r in per_rank) for i in range(args.rounds)] for k in per_rank[0]}
        results["world_sizes"][ws] = slowest
        bare = statistics.median(slowest["bare"])
        for name, runs in slowest.items():
            median = statistics.median(runs)
            print(f"ws {ws}  {name:24s} {median * 1e3:7.1f} ms  {bare / median:.2f}x bare")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
