"""Benchmark saving from a sharded model, side by side in one run, durable (fsynced) end to end.

    python scripts/benchmark_save.py                          # 512 MB Linear stack + AdamW, ws 2 and 4
    python scripts/benchmark_save.py --model llama --world-sizes 2 --out save.json

Every method starts from the same sharded model (FSDP2 or FSDP1, gloo on CPU) with real AdamW state and
writes to the same disk; the clock runs from the call to the last rank's return (every method's output
fsynced: ours and DCP fsync their files, the gather path is fsynced explicitly):

- ``ours``: ``fsdp_restore.save_sharded(model, path, optimizer=opt, extra=...)``: one unsharded file, each
  rank writing its own bytes; ``ours+verify``: the same with ``verify_checksums=True`` (each rank reads back
  from the storage what it wrote before the rename); ``ours-model``: the same, weights only (the HF layout);
- ``gather``: ``get_state_dict(full_state_dict=True, cpu_offload=True)`` + ``torch.save`` on rank 0 (FSDP1:
  ``cpu_offload=False``, which torch 2.13 needs on the CPU);
- ``dcp``: ``dcp.save`` of the sharded state dicts (per-rank files: not one unsharded checkpoint);
- ``dcp+hf``: ``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``,
  weights only (per-rank files, then a consolidation pass into unsharded safetensors);
- ``floor``: the same ranks ``pwrite`` their share of the same number of bytes into one preallocated file
  and fsync it, nothing else (the physical floor for one file written by every rank), in 16 MB chunks on 4
  threads per rank as ours writes.
- ``floor+writeback``: the same, with the writeback hint ours gives each 16 MB it writes
  (``POSIX_FADV_DONTNEED``, which starts writeback now instead of at the final fsync).

Per rank: wall time, bytes written (/proc/self/io write_bytes around the save), peak anonymous memory above
the sharded model and its optimizer state.

``--rank-mbps N`` caps each rank's disk reads and writes at N MB/s during the measured run (a cgroup-v1 blkio
group per rank, root; `benchmark.limit_read_bandwidth`), as if each rank wrote over a link or to a disk of its
own, as on separate nodes: the rank-0 gather then writes everything through one rank's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import (_build, _median_row, build_model, console, drop_caches, leave_read_limit,  # noqa: E402
                       limit_read_bandwidth)

from fsdp_restore.measure import PeakAnonMemory, disk_write_bytes  # noqa: E402
from fsdp_restore.write import CHUNK_BYTES  # noqa: E402

FLOOR_THREADS = 4  # save_sharded's default thread_count
METHODS = ("floor", "floor+writeback", "ours", "ours+verify", "ours-model", "gather", "dcp", "dcp+hf")


def _with_state(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Real AdamW state (exp_avg / exp_avg_sq of every parameter's shard): one step on unit gradients."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.ones_like(p) * 0.01)  # defined values: the model came from the meta device
            p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()
    opt.zero_grad()
    return opt


def _fsync_tree(path: Path) -> None:
    for p in [path] if path.is_file() else sorted(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def save_worker(rank: int, world_size: int, method: str, fsdp: str, kind: str, mb: float, out: str,
                nbytes: int, rank_mbps: float | None = None) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    import warnings

    import fsdp_restore

    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1's ShardedTensor deprecation, per tensor
    model = _build(fsdp, kind, mb)
    opt = _with_state(model)
    target = Path(out)

    def run(dst: Path) -> None:
        if method == "ours":
            fsdp_restore.save_sharded(model, dst, optimizer=opt, extra={"step": 1})
        elif method == "ours+verify":
            fsdp_restore.save_sharded(model, dst, optimizer=opt, extra={"step": 1}, verify_checksums=True)
        elif method == "ours-model":
            fsdp_restore.save_sharded(model, dst)
        elif method == "gather":
            # FSDP1 on the CPU: torch 2.13 segfaults gathering with cpu_offload=True (seen at ws 2), so there every
            # rank gathers the full state (the same bytes move; rank 0's memory is the same)
            offload = fsdp != "fsdp1"
            msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
            if rank == 0:
                torch.save({"model": msd, "optim": osd, "step": 1}, dst)
                _fsync_tree(dst)
            del msd, osd
        elif method == "dcp":
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(dst))
        elif method == "dcp+hf":
            writer = HuggingFaceStorageWriter(path=str(dst), save_distributed=True, enable_consolidation=True)
            dcp.save(get_model_state_dict(model), storage_writer=writer)
            if rank == 0:
                _fsync_tree(dst)
        elif method in ("floor", "floor+writeback"):
            if rank == 0:
                with open(dst, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, nbytes)
            dist.barrier()
            share = -(-nbytes // world_size)
            start, stop = rank * share, min(nbytes, (rank + 1) * share)
            chunk = memoryview(bytearray(CHUNK_BYTES))
            fd = os.open(dst, os.O_WRONLY)

            def write(at: int) -> None:  # one 16 MB chunk, as ours cuts its writes
                n = min(CHUNK_BYTES, stop - at)
                done = 0
                while done < n:
                    done += os.pwrite(fd, chunk[done:n], at + done)
                if method == "floor+writeback":  # the writeback hint ours gives each chunk, nothing else
                    os.posix_fadvise(fd, at, n, os.POSIX_FADV_DONTNEED)

            try:
                with ThreadPoolExecutor(FLOOR_THREADS) as pool:  # ours' default thread count
                    list(pool.map(write, range(start, stop, CHUNK_BYTES)))
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            raise ValueError(method)
        dist.barrier()

    # A first, untimed run warms the code paths (imports); its output is removed. Peak memory is taken over
    # both runs from before the first: memory the first run freed stays with the allocator, not the OS, so a
    # peak measured from the second run's start would hide it.
    with PeakAnonMemory(interval=0.01) as mem:
        warm = target.with_name(target.name + ".warm")
        run(warm)
        if rank == 0:
            shutil.rmtree(warm, ignore_errors=True) if warm.is_dir() else warm.unlink(missing_ok=True)
            drop_caches()  # the page cache holds no dirty pages of ours: every write counted is this run's
        group = limit_read_bandwidth(str(target.parent), rank, rank_mbps, writes=True) if rank_mbps else None
        dist.barrier()
        written0 = disk_write_bytes()
        t0 = time.perf_counter()
        try:
            run(target)
        finally:
            if group:
                leave_read_limit(group)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_anon": mem.peak - mem.start, "written": disk_write_bytes() - written0}


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench_save(work: Path, mb: float, world_sizes: list[int], *, kind: str = "linear", repeat: int = 3,
               only: list[str] | None = None, rank_mbps: float | None = None) -> list[dict[str, Any]]:
    from fsdp_restore.launch import RankFailure, run_ranks

    model = build_model(kind, mb)
    model_bytes = sum(t.numel() * 4 for t in model.state_dict().values())
    del model
    console.print(f"[bold]save[/]: {kind} model {model_bytes / 1e6:.0f} MB + AdamW state, durable, ws {world_sizes}")
    rows: list[dict[str, Any]] = []
    for ws in world_sizes:
        for fsdp in ("fsdp2", "fsdp1"):
            # the floor writes as many bytes as our full checkpoint: measured first, then the floor
            full_bytes = 0
            for method in ("ours", *[m for m in METHODS if m != "ours"]):
                if only and method not in only and f"{fsdp}:{method}" not in only:
                    continue
                runs = []
                for _ in range(repeat):
                    out = work / f"out-{method}-{fsdp}-{ws}"
                    shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
                    nbytes = full_bytes or 3 * model_bytes
                    try:
                        per_rank = run_ranks(save_worker, ws, method, fsdp, kind, mb, str(out), nbytes, rank_mbps,
                                             timeout=900, backend="gloo")
                    except RankFailure as e:
                        console.print(f"[red]{fsdp} {method} ws={ws} failed[/]: {str(e).splitlines()[1][:300]}")
                        break
                    size = _size(out)
                    if method == "ours":
                        full_bytes = size
                    runs.append({"fsdp": fsdp, "method": method, "world_size": ws, "model_bytes": model_bytes,
                                 "output_bytes": size, "seconds": max(r["seconds"] for r in per_rank),
                                 "rank_mbps": rank_mbps,
                                 "written_per_rank": [r["written"] for r in per_rank],
                                 "peak_anon_per_rank": [r["peak_anon"] for r in per_rank]})
                    shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
                if not runs:
                    continue
                row = _median_row(runs)
                row["model"] = kind
                rows.append(row)
                console.print(f"  ws={ws} {fsdp} {method}: {row['runs_seconds']} s, output {size / 1e6:.0f} MB,"
                              f" written per rank {[round(w / 1e6) for w in row['written_per_rank']]} MB,"
                              f" peak anon per rank {[round(a / 1e6) for a in row['peak_anon_per_rank']]} MB")
    return rows


def report_save(rows: list[dict[str, Any]]) -> str:
    """A rich table and its Markdown twin: time against the floor and against ours, bytes written and peak
    anonymous memory per rank (max over ranks)."""
    from rich.table import Table

    t = Table(title="save (gloo, CPU, durable; max over ranks)")
    head = ["ws", "fsdp", "method", "seconds", "x floor", "x ours", "written/rank / share", "peak anon/rank"]
    for c in head:
        t.add_column(c, justify="right")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        def same(method: str) -> dict[str, Any] | None:
            return next((o for o in rows if o["method"] == method and o["fsdp"] == r["fsdp"]
                         and o["world_size"] == r["world_size"]), None)

        floor = same("floor") or same("floor+writeback")
        ours = same("ours-model" if r["method"] in ("ours-model", "dcp+hf") else "ours")
        share = r["output_bytes"] / r["world_size"]
        cells = [str(r["world_size"]), r["fsdp"], r["method"], f"{r['seconds']:.2f}",
                 f"{r['seconds'] / floor['seconds']:.2f}" if floor else "-",
                 f"{r['seconds'] / ours['seconds']:.2f}" if ours else "-",
                 f"{max(r['written_per_rank']) / share:.2f}", f"{max(r['peak_anon_per_rank']) / 1e6:,.0f} MB"]
        t.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    console.print(t)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=512, help="model size (fp32 weights), MB")
    parser.add_argument("--model", choices=["linear", "llama"], default="linear")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--methods", nargs="+", help=f"subset of {METHODS} (or fsdp2:ours ...)")
    parser.add_argument("--rank-mbps", type=float,
                        help="cap each rank's disk reads and writes at this many MB/s in the measured run (cgroup v1"
                             " blkio, root): a disk or link per rank, as on separate nodes")
    parser.add_argument("--workdir", help="where to write (default: a temporary directory)")
    parser.add_argument("--out", help="also write the raw results as JSON here")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fsdp_restore_save_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = bench_save(work, args.mb, args.world_sizes, kind=args.model, repeat=args.repeat, only=args.methods,
                      rank_mbps=args.rank_mbps)
    markdown = report_save(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"save": rows, "markdown": markdown}, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
