"""GPU restore benchmark: how fast each rank's bytes reach its GPU shards, side by side in one run.

    python scripts/benchmark_gpu.py                          # 4 GB Linear stack, warm and cold, NCCL
    python scripts/benchmark_gpu.py --restore-mb 1024 --model llama --cache warm --out gpu.json

Per rank (world size = the GPUs present, NCCL): the rank's share of the model in GB/s for
- h2d: a raw pinned ``cudaMemcpyAsync`` of the same number of bytes, already in pinned host memory (the
  link's ceiling);
- read: positional reads of the same bytes into pinned memory, 16 MB each on ``--threads`` threads, no copy
  (the host side's ceiling); read-direct: the same with ``O_DIRECT`` (page-aligned, past the page cache: cold);
- ours / ours-nocheck: `restore_model` into an FSDP2 model on the GPU, with and without the NaN check;
  ours-profile: ours, with the read threads' time summed per kind of work (`_profile_read_threads`);
  ``--chunk-mb N``: ours with another read size (one row each);
- dcp: ``dcp.load`` with ``HuggingFaceStorageReader``; broadcast: ``set_model_state_dict`` with
  ``broadcast_from_rank0`` from a memory-mapped load on rank 0.
Warm: from the page cache (the warm-up run left it there). Cold: the cache is dropped before the
measured run (root), and ``dd``'s sequential rate on the same file is printed beside. Also the peak host
memory above the process's baseline (VmRSS: pinned buffers included) and the peak GPU memory above the
sharded model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmark import build_model, console, describe_model, drop_caches, wrap_units  # noqa: E402

METHODS = ["h2d", "read", "read-direct", "ours", "ours-nocheck", "ours-profile", "dcp", "broadcast"]


def _sharded_model(kind: str, mb: float) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from fsdp_restore import init_non_persistent_buffers

    with torch.device("meta"):
        model = build_model(kind, mb)
    for unit in wrap_units(model):
        fully_shard(unit)
    fully_shard(model)
    model.to_empty(device="cuda")
    init_non_persistent_buffers(model)
    return model


def _rank_bytes(model: torch.nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in model.state_dict().values())


def worker(rank: int, world_size: int, method: str, kind: str, mb: float, path: str, cold: bool,
           threads: int, repeat: int = 1, chunk_mb: int = 0) -> list[dict[str, Any]]:
    import torch.distributed as dist

    import fsdp_restore
    from fsdp_restore import execute
    from fsdp_restore.measure import PeakAnonMemory

    if chunk_mb:  # this rank process only
        execute.READ_CHUNK_BYTES = chunk_mb * 2**20

    model = _sharded_model(kind, mb)
    nbytes = _rank_bytes(model)
    ckpt_bytes = os.path.getsize(path)
    state: dict[str, Any] = {}

    def run() -> None:
        if method == "h2d":
            if "src" not in state:
                state["src"] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
                state["dst"] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            state["dst"].copy_(state["src"], non_blocking=True)
            torch.cuda.synchronize()
        elif method in ("read", "read-direct"):
            from concurrent.futures import ThreadPoolExecutor

            page = 4096
            if "buf" not in state:  # pinned memory starts on a page: O_DIRECT's alignment
                state["buf"] = torch.empty(-(-nbytes // page) * page, dtype=torch.uint8, pin_memory=True)
            direct = method == "read-direct"
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            step = 16 * 2**20
            start = (ckpt_bytes - nbytes) // max(1, world_size) * rank  # this rank's stretch of the file
            if direct:
                start -= start % page
            view = memoryview(state["buf"].numpy())

            def one(off: int) -> None:
                os.preadv(fd, [view[off:off + step]], start + off)

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(0, nbytes, step)))
            os.close(fd)
        elif method in ("ours", "ours-nocheck", "ours-profile"):
            if method == "ours-profile" and "profile" not in state:
                state["profile"] = _profile_read_threads()
            totals = state.get("profile")
            if totals is not None:
                totals.clear()
            report = fsdp_restore.restore_model(model, path, check=method != "ours-nocheck", thread_count=threads)
            torch.cuda.synchronize()
            state["timings"] = {k: round(v, 4) for k, v in report.timings.items()}
            if totals is not None:  # seconds summed over the read threads, and counts
                state["timings"].update({k: round(v, 4) for k, v in totals.items()})
        elif method == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import HuggingFaceStorageReader

            sd = model.state_dict()
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(path=os.path.dirname(path)))
            torch.cuda.synchronize()
        elif method == "broadcast":
            from safetensors import safe_open
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full: dict[str, torch.Tensor] = {}
            if rank == 0:
                with safe_open(path, "pt") as f:
                    full = {k: f.get_tensor(k) for k in f.keys()}
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            torch.cuda.synchronize()
        else:
            raise ValueError(method)

    run()  # warm-up: CUDA context, kernels, allocator pools, the page cache (warm runs)
    torch.cuda.synchronize()
    results = []
    for _ in range(repeat):  # measured runs in this process: one process start per method, not per run
        if hasattr(torch._C, "_host_emptyCache") and method not in ("h2d", "read"):
            torch._C._host_emptyCache()  # pinned buffers are allocated again in the measured run: counted
        dist.barrier()
        if rank == 0 and cold:
            drop_caches()
        dist.barrier()
        base_gpu = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with PeakAnonMemory(interval=0.002, field="VmRSS") as host:
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
        dist.barrier()
        results.append({"method": method, "threads": threads, "chunk_mb": chunk_mb or 16,
                        "timings": state.get("timings"), "seconds": seconds,
                        "bytes": nbytes, "gbps": nbytes / seconds / 1e9, "host_peak": host.peak - host.start,
                        "gpu_extra": torch.cuda.max_memory_allocated() - base_gpu})
    return results


def _profile_read_threads() -> dict[str, float]:
    """Time what the read threads do (summed over threads): positional reads (``io``), getting a staging
    buffer (``wait``: waiting for one whose upload is still in flight, or pinning a new one), the rest of a
    staged read (copies launched, events: ``staged - io - wait``); and count reads and groups. Wraps the
    executor's methods in this process only."""
    import threading

    from fsdp_restore import execute, read

    totals: dict[str, float] = {}
    lock = threading.Lock()

    def timed(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                with lock:
                    totals[label] = totals.get(label, 0.0) + seconds
                    totals[label + "_n"] = totals.get(label + "_n", 0) + 1

        setattr(owner, name, wrapper)

    timed(read.Checkpoint, "read_rows", "io")
    timed(read.Checkpoint, "read_contiguous", "io_group")
    timed(execute._Worker, "_slot", "wait")
    timed(execute._Worker, "_staged", "staged")
    timed(execute._Worker, "read_group", "group")
    timed(execute._Worker, "finish", "finish")
    return totals


def dd_rate(path: str) -> float:
    """Sequential cold read rate of the file, GB/s (dd, 16 MB blocks, page cache dropped first)."""
    if not drop_caches():
        return float("nan")
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], capture_output=True, check=True)
    return os.path.getsize(path) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restore-mb", type=float, default=4096)
    parser.add_argument("--model", choices=["linear", "llama"], default="linear")
    parser.add_argument("--cache", choices=["warm", "cold"], nargs="+", default=["warm", "cold"])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--threads", type=int, nargs="+", default=[4], help="read threads (ours: one row each)")
    parser.add_argument("--repeat", type=int, default=3, help="measured runs per method (>= 1)")
    parser.add_argument("--chunk-mb", type=int, nargs="+", default=[0], help="ours: read size in MB (0: the default)")
    parser.add_argument("--workdir")
    parser.add_argument("--out")
    args = parser.parse_args()
    from fsdp_restore import convert
    from fsdp_restore.launch import RankFailure, run_ranks

    gpus = torch.cuda.device_count()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fsdp_restore_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    path = work / "model.safetensors"
    if not path.exists():
        torch.manual_seed(0)
        full = build_model(args.model, args.restore_mb)
        console.print(f"model: {describe_model(full)}")
        torch.save(full.state_dict(), work / "model.pt")
        del full
        convert(work / "model.pt", path, force=True)
        (work / "model.pt").unlink()
    info = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
            "cuda": torch.version.cuda, "driver": _driver(), "checkpoint_bytes": path.stat().st_size,
            "model": args.model, "threads": args.threads}
    console.print(info)
    rows: list[dict[str, Any]] = []
    for cache in args.cache:
        if cache == "cold":
            info["dd_cold_gbps"] = dd_rate(str(path))
            console.print(f"dd, cold: {info['dd_cold_gbps']:.2f} GB/s")
        cases = [(m, t, ch) for m in args.methods
                 for t in (args.threads if m.startswith(("ours", "read")) else args.threads[:1])
                 for ch in (args.chunk_mb if m.startswith("ours") else [0])]
        for method, threads, chunk_mb in cases:
            try:
                per_rank = run_ranks(worker, gpus, method, args.model, args.restore_mb, str(path), cache == "cold",
                                     threads, args.repeat, chunk_mb, backend="nccl", timeout=600)
            except RankFailure as e:
                console.print(f"[red]{method} {cache} failed[/]: {str(e)[:2000]}")
                continue
            # each run's slowest rank
            runs = [min((r[i] for r in per_rank), key=lambda r: r["gbps"]) for i in range(args.repeat)]
            row = sorted(runs, key=lambda r: r["gbps"])[(len(runs) - 1) // 2]  # the median; of two, the slower
            row = {**row, "cache": cache, "runs_gbps": sorted(round(r["gbps"], 2) for r in runs),
                   "runs_timings": [r["timings"] for r in runs]}
            rows.append(row)
            if args.out:  # after every row: a run cut short still leaves what it measured
                Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=2))
            console.print(f"  {cache} {method} t={threads} {chunk_mb or 16} MB: {row['runs_gbps']} GB/s per rank,"
                          f" {row['seconds']:.3f} s,"
                          f" host +{row['host_peak'] / 1e6:.0f} MB, GPU +{row['gpu_extra'] / 1e6:.0f} MB"
                          f"{', phases ' + str(row['timings']) if row.get('timings') else ''}")
    lines = ["| cache | method | threads | read size | GB/s per rank | x h2d | seconds | host peak above baseline |"
             " GPU peak above model |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h2d = next((x for x in rows if x["method"] == "h2d" and x["cache"] == r["cache"]), None)
        h2d = h2d or next((x for x in rows if x["method"] == "h2d"), None)
        ratio = f"{r['gbps'] / h2d['gbps']:.2f}" if h2d else "-"
        lines.append(f"| {r['cache']} | {r['method']} | {r['threads']} | {r['chunk_mb']} MB | {r['gbps']:.2f} | {ratio} |"
                     f" {r['seconds']:.3f} |"
                     f" {r['host_peak'] / 1e6:.0f} MB | {r['gpu_extra'] / 1e6:.0f} MB |")
    console.print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows, "markdown": "\n".join(lines)}, indent=2))


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
