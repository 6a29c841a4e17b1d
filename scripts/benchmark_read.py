"""The restore's read path against a bare read loop of the same bytes, warm, on the CPU, side by side in one run.

    python scripts/benchmark_read.py                       # 2.1 GB stack of 1022 tensors, world sizes 1 and 2
    python scripts/benchmark_read.py --mb 512 --world-sizes 1 --repeat 3
    python scripts/benchmark_read.py --layers 16           # the same bytes in 32 tensors (64 MB weights)
    python scripts/benchmark_read.py --thread-counts 1 2 4 # the restore at each read thread count, side by side
    python scripts/benchmark_read.py --cold --repeat 3     # from disk: the page cache dropped before each run (root)

In every rank's process (gloo, FSDP2 ``fully_shard`` of a stack of ``Linear`` layers on the CPU), from the page
cache (a warm-up run of each method first): ``bare``: a loop of 16 MB ``os.preadv`` calls on ``threads``
threads, reading a stretch of the file as long as the rank's share into one preallocated buffer (the floor: no
plan, no placement, no check); ``bare-pieces``: the rank's own bytes with the same reads as ``bare-model`` (at
world size 2, half of each tensor: pieces spread over the file) into that buffer back to back (the bare loop of
the same bytes, without the model's memory); ``bare-model``: the same loop reading the rank's own tensor bytes straight into the
model's memory, as the restore's plan places them (precomputed once: no plan, no check; it shows what the
placement of the model's memory against the file costs, see scripts/benchmark_alignment.py);
``ours-nocheck``: `restore_model(check=False)`; ``ours``: `restore_model` with the NaN check; with
``--verify-checksums`` also ``ours+sums``: the NaN check and ``verify_checksums=True`` (the restored memory's crc32s
joined over the ranks and compared with the file's).
The methods alternate run by run (``repeat`` rounds) and the medians are reported, with the restore's own phase
timings (plan / read / check / agree) and the plan time per tensor, and the median of each round's ratio to
``bare-pieces`` (paired: a round's methods share that round's disk and neighbours). ``--thread-counts``: the
restore's methods at each of these ``thread_count``s (named ``ours@2``...; the bare loops stay at ``--threads``);
``default`` among them: the restore's own default. ``--cold``: rank 0 drops the page cache (``sync; echo 3 >
/proc/sys/vm/drop_caches``) before each run, between barriers, and there is no warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_restore.launch import run_ranks  # noqa: E402

console = Console()
METHODS = ("bare", "bare-pieces", "bare-model", "ours-nocheck", "ours")
STEP = 16 * 2**20


class Stack(torch.nn.Module):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))


def _shape(mb: float, layers: int = 511) -> tuple[int, int]:
    dim = max(8, int((mb * 1e6 / 4 / layers) ** 0.5))
    return layers, dim


def drop_page_cache() -> None:
    """Write back and drop the page cache (root only): the next read of every file comes from disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _ours_threads(method: str, threads: int) -> int | None:
    """The thread_count of a restore method: ``ours@N`` -> N, ``ours@default`` -> None (the restore's default),
    a plain name -> ``threads``."""
    count = method.partition("@")[2]
    return None if count == "default" else int(count) if count else threads


def worker(rank: int, world_size: int, path: str, mb: float, repeat: int, threads: int,
           methods: tuple[str, ...] = METHODS, layers: int = 511, cold: bool = False) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    import fsdp_restore

    torch.manual_seed(0)
    model = Stack(*_shape(mb, layers))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    size = os.path.getsize(path)
    buf = torch.empty(local, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    start = (size - local) // world_size * rank  # a stretch of the file as long as this rank's share
    fd = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(threads)

    def bare() -> dict[str, float]:
        def one(off: int) -> None:
            os.preadv(fd, [view[off:off + STEP]], start + off)
        list(pool.map(one, range(0, local, STEP)))
        return {}

    iovecs = _model_reads(model, path)
    pieces, at = [], 0  # the same reads (the rank's own bytes, where they lie), into one buffer, back to back
    for offset, views in iovecs:
        n = sum(v.nbytes for v in views)
        pieces.append((offset, view[at:at + n]))
        at += n
    assert at == local

    def bare_model() -> dict[str, float]:
        list(pool.map(lambda read: os.preadv(fd, read[1], read[0]), iovecs))
        return {}

    def bare_pieces() -> dict[str, float]:
        list(pool.map(lambda read: os.preadv(fd, [read[1]], read[0]), pieces))
        return {}

    def ours(method: str) -> dict[str, float]:
        name = method.partition("@")[0]
        return fsdp_restore.restore_model(model, path, check=name != "ours-nocheck",
                                          thread_count=_ours_threads(method, threads),
                                          verify_checksums=name == "ours+sums").timings

    run = {"bare": bare, "bare-pieces": bare_pieces, "bare-model": bare_model}
    if not cold:
        for method in methods:  # warm-up: the page cache, first-time code paths, allocator pools
            run[method]() if method in run else ours(method)
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    timings: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for _ in range(repeat):
        for method in methods:
            torch.distributed.barrier()
            if cold:
                if rank == 0:
                    drop_page_cache()
                torch.distributed.barrier()
            t0 = time.perf_counter()
            timings[method].append(run[method]() if method in run else ours(method))
            seconds[method].append(time.perf_counter() - t0)
    os.close(fd)
    pool.shutdown()
    package = Path(fsdp_restore.__file__).parent
    if (package / "screened_read.py").exists():
        from fsdp_restore.screened_read import native
    else:  # a tree from before the check's native read (not imported: an editable install would find the other's)
        def native() -> bool:
            return False
    # which tree the ranks ran: the ranks' forkserver puts its working directory first on the path, so an A/B of
    # two trees runs each from its own directory
    return {"rank": rank, "bytes": local, "tensors": len(list(model.parameters())), "seconds": seconds,
            "timings": timings, "package": str(package), "native": native()}


def _model_reads(model: torch.nn.Module, path: str) -> list[tuple[int, list[memoryview]]]:
    """(file offset, destination views) of 16 MB reads of the rank's tensor bytes into the model's memory, where
    the restore's plan puts them (a benchmark's shortcut, not an oracle: the plan and grouping are ours)."""
    from fsdp_restore.execute import chunked, grouped
    from fsdp_restore.plan import build_plan
    from fsdp_restore.read import _writable_bytes, open_checkpoint

    reads = []
    with open_checkpoint(path) as ckpt:
        plan = build_plan(model, ckpt, prefix="")
        for group in grouped(chunked(plan.items, ckpt)):
            entry = ckpt.entries[group[0].item.key]
            views = [_writable_bytes(c.item.dest[c.first:c.first + c.count]) for c in group]
            reads.append((entry.offset + group[0].src_start * entry.itemsize, views))
    return reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fsdp_restore_bench_read"))
    parser.add_argument("--mb", type=float, default=2100.0)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=511,
                        help="Linear layers of the stack (2 tensors each); fewer: bigger tensors, as in real models")
    parser.add_argument("--verify-checksums", action="store_true", help="also time verify_checksums=True")
    parser.add_argument("--thread-counts", nargs="+", metavar="N",
                        help="time the restore at each of these thread_counts ('default': its own default)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each run (needs root)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ours_methods = ("ours-nocheck", "ours") + (("ours+sums",) if args.verify_checksums else ())
    if args.thread_counts:
        for count in args.thread_counts:
            if count != "default" and not (count.isdigit() and int(count) >= 1):
                parser.error(f"--thread-counts takes positive ints or 'default', not {count!r}")
        ours_methods = tuple(f"{m}@{count}" for count in args.thread_counts for m in ours_methods)
    methods = METHODS[:3] + ours_methods
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / (f"stack-{args.mb:g}.safetensors" if args.layers == 511 else
                        f"stack-{args.mb:g}-{args.layers}.safetensors")
    if not path.exists():
        from fsdp_restore.convert import save

        torch.manual_seed(0)
        save(Stack(*_shape(args.mb, args.layers)).state_dict(), path)
    results: dict[str, Any] = {"file_bytes": path.stat().st_size, "threads": args.threads, "layers": args.layers,
                               "cold": args.cold, "world_sizes": {}}
    table = Table(title=f"restore vs bare preadv loop, {'cold' if args.cold else 'warm'}, "
                        f"{path.stat().st_size / 1e9:.2f} GB, bare loops on {args.threads} threads (medians of "
                        f"{args.repeat})")
    for col in ("ws", "method", "s / rank", "GB/s / rank", "x bare", "x bare-pieces", "paired x bare-pieces",
                "plan s", "plan us/tensor", "read s", "check s", "checksums s"):
        table.add_column(col)
    for ws in args.world_sizes:
        per_rank = run_ranks(worker, ws, str(path), args.mb, args.repeat, args.threads, methods, args.layers,
                             args.cold, timeout=1200, backend="gloo")
        results["world_sizes"][ws] = per_rank
        rounds = {m: [max(r["seconds"][m][i] for r in per_rank) for i in range(args.repeat)] for m in methods}
        slowest = {m: statistics.median(rounds[m]) for m in methods}
        paired = {m: statistics.median(b / o for b, o in zip(rounds["bare-pieces"], rounds[m])) for m in methods}
        rank0 = per_rank[0]
        for m in methods:
            phase = {k: statistics.median(t.get(k, 0.0) for t in rank0["timings"][m])
                     for k in ("plan", "read", "check", "checksums")}
            table.add_row(str(ws), m, f"{slowest[m]:.3f}", f"{rank0['bytes'] / slowest[m] / 1e9:.2f}",
                          f"{slowest['bare'] / slowest[m]:.2f}", f"{slowest['bare-pieces'] / slowest[m]:.2f}",
                          f"{paired[m]:.2f}", *(["", "", "", "", ""] if m.startswith("bare") else
                            [f"{phase['plan']:.3f}", f"{phase['plan'] / rank0['tensors'] * 1e6:.0f}",
                             f"{phase['read']:.3f}", f"{phase['check']:.3f}", f"{phase['checksums']:.3f}"]))
    console.print(table)
    ran = {(r["package"], r["native"]) for per_rank in results["world_sizes"].values() for r in per_rank}
    console.print("the ranks ran " + "; ".join(f"{package} (the check's native read: {'on' if on else 'off'})"
                                               for package, on in sorted(ran)))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
