"""``fsdp-restore convert`` as a user runs it, against the physical floor: ``cp`` + ``sync`` of the same file.

    python scripts/benchmark_convert.py                   # 4 GB of big tensors, 1 GB of small ones, a mix; 5 pairs
    python scripts/benchmark_convert.py --cases big --pairs 3 --gb 1

Each case is a ``torch.save`` training checkpoint on the same disk as the outputs. For each case and variant
(same dtype; ``--dtype bf16``; ``--max-shard-size 1GB``; ``bf16-verify``: ``--dtype bf16 --verify-checksums``) the two commands run in interleaved pairs (ours, then
``sh -c 'cp SRC DST && sync'``), each a whole fresh process, so that a drift in the machine's speed hits both
sides of a pair alike; the ratio is taken pair by pair and the median reported. Before every run the source's
pages are dropped from the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``; ``--evict all``: ``drop_caches``) and the last destination is deleted. Per run: wall seconds, the child's user and system CPU seconds
(``wait4``), the bytes it read from and wrote to the disk (the change in this process's ``/proc/self/io``, which
takes in a reaped child's counts) and its peak anonymous memory (RssAnon sampled every 10 ms). Apart from the
conversions: the whole-process time of ``fsdp-restore --version`` and of importing what a conversion imports,
the fixed cost every command pays before it reads a byte. The commands run from compiled bytecode, as an installed
package does (`CHILD_ENV`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from math import prod
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_sharded import _peak_anon  # noqa: E402  (RssAnon of a child, sampled every 10 ms)

CLI = [sys.executable, "-m", "fsdp_restore"]
# The commands run as an installed package runs: from compiled bytecode (pip compiles it at install; an editable
# install writes it on its first run). Where the environment forbids writing it (PYTHONDONTWRITEBYTECODE), every run
# would compile the package's modules again, ~0.1 s that no user pays (BENCHMARKS.md, "Session 22").
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
console = Console()


def make_case(path: Path, case: str, gb: float) -> None:
    """``big``: a training checkpoint of ~110 MB fp32 tensors (weights + AdamW moments); ``small``: thousands of
    64 KB tensors; ``mix``: 256 MB tensors and 2000 small ones; ``weights``: fp32 weights only (~110 MB tensors,
    as a model file: `--dtype bf16` then casts every tensor and writes half); ``small-weights``: 64 KB fp32 weights
    only (thousands of small tensors that `--dtype bf16` all casts)."""
    g = torch.Generator().manual_seed(0)
    if case in ("weights", "small-weights"):
        shape = (5500, 5000) if case == "weights" else (128, 128)
        n = max(1, round(gb * 1e9 / (prod(shape) * 4)))
        torch.save({f"layers.{i}.weight": torch.rand(shape, generator=g) for i in range(n)}, path)
        return
    if case == "big":
        n = max(1, round(gb * 1e9 / 3 / (27_500_000 * 4)))
        shapes = [(5500, 5000)] * n
    elif case == "small":
        shapes = [(128, 128)] * max(1, round(gb * 1e9 / 3 / (128 * 128 * 4)))
    else:
        n = max(1, round(gb * 0.95e9 / 3 / (256 * 2**20)))
        shapes = [(16384, 4096)] * n + [(128, 128)] * (2000 // 3)
    model = {f"layers.{i}.weight": torch.rand(s, generator=g) for i, s in enumerate(shapes)}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.rand(s, generator=g),
                 "exp_avg_sq": torch.rand(s, generator=g)} for i, s in enumerate(shapes)}
    torch.save({"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-4, "params": list(state)}]},
                "step": 10, "config": {"case": case}}, path)


def evict(path: Path, how: str) -> None:
    """Drop ``path``'s pages from the page cache (``source``: ``fsync`` + ``POSIX_FADV_DONTNEED``, so that the
    Python environment stays cached as on a machine that just ran something) or every clean page (``all``:
    ``drop_caches``, root; torch's libraries are then read from disk too)."""
    os.sync()
    if how == "all":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def run(cmd: list[str]) -> dict[str, Any]:
    """One whole process: wall, CPU, disk bytes and peak anonymous memory."""
    before = _io()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=CHILD_ENV)
    stop, peak = threading.Event(), [0]
    watcher = threading.Thread(target=_peak_anon, args=(proc.pid, stop, peak), daemon=True)
    watcher.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    watcher.join()
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    after = _io()
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime, "peak_anon": peak[0],
            "read_bytes": after["read_bytes"] - before["read_bytes"],
            "write_bytes": after["write_bytes"] - before["write_bytes"]}


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def pairs(src: Path, work: Path, extra: list[str], n: int, how: str, direct: bool = False) -> dict[str, Any]:
    # (a set of shards is a directory: `convert` refuses a file's name for one)
    ours_dst = work / ("out" if "--max-shard-size" in extra else "out.safetensors")
    copy_dst = work / "out.copy"
    ours_cmd = CLI + ["convert", str(src), str(ours_dst), "--force", *extra]
    copy_cmd = ["sh", "-c", f"cp '{src}' '{copy_dst}' && sync"]
    commands = [("ours", ours_cmd, ours_dst), ("cp+sync", copy_cmd, copy_dst)]
    if direct:  # the same copy with the page cache bypassed on the write side, as ours writes (O_DIRECT), then fsync
        commands.append(("dd direct", ["dd", f"if={src}", f"of={copy_dst}", "bs=16M", "oflag=direct", "conv=fsync",
                                       "status=none"], copy_dst))
    rows = []
    for _ in range(n):
        pair = {}
        for name, cmd, dst in commands:
            _remove(dst)
            evict(src, how)
            pair[name] = run(cmd)
        _remove(copy_dst)
        pair["ratio"] = pair["ours"]["wall"] / pair["cp+sync"]["wall"]
        if direct:
            pair["ratio_dd"] = pair["ours"]["wall"] / pair["dd direct"]["wall"]
        rows.append(pair)
        dd = (f"  dd direct {pair['dd direct']['wall']:.2f} s (sys {pair['dd direct']['sys']:.1f})  ratio to it "
              f"{pair['ratio_dd']:.2f}" if direct else "")
        console.print(f"  ours {pair['ours']['wall']:.2f} s (user {pair['ours']['user']:.1f} sys "
                      f"{pair['ours']['sys']:.1f})  cp+sync {pair['cp+sync']['wall']:.2f} s (sys "
                      f"{pair['cp+sync']['sys']:.1f})  ratio {pair['ratio']:.2f}{dd}")
    _remove(ours_dst)
    return {"pairs": rows, "median_ratio": statistics.median(p["ratio"] for p in rows),
            **({"median_ratio_dd": statistics.median(p["ratio_dd"] for p in rows),
                "median_dd": statistics.median(p["dd direct"]["wall"] for p in rows)} if direct else {}),
            "median_ours": statistics.median(p["ours"]["wall"] for p in rows),
            "median_copy": statistics.median(p["cp+sync"]["wall"] for p in rows),
            "peak_anon_max": max(p["ours"]["peak_anon"] for p in rows),
            "read_bytes_median": statistics.median(p["ours"]["read_bytes"] for p in rows),
            "write_bytes_median": statistics.median(p["ours"]["write_bytes"] for p in rows)}


def fixed_costs(n: int) -> dict[str, float]:
    """Whole-process seconds (median of ``n``, page cache warm) of what runs before any conversion reads."""
    out = {}
    for name, cmd in (("--version", CLI + ["--version"]),
                      ("import for convert", [sys.executable, "-c", "import fsdp_restore.convert"]),
                      ("python -c pass", [sys.executable, "-c", "pass"])):
        out[name] = statistics.median(run(cmd)["wall"] for _ in range(n))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fsdp_restore_bench_convert"))
    parser.add_argument("--cases", nargs="+", default=["big", "small", "mix"], choices=["big", "small", "mix", "weights", "small-weights"])
    parser.add_argument("--gb", type=float, default=4.0, help="size of the 'big' case (small and small-weights: a quarter, mix: this)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["same", "bf16", "shards"],
                        choices=["same", "bf16", "shards", "bf16-verify"])
    parser.add_argument("--evict", choices=["source", "all"], default="source",
                        help="before each run drop the source's pages (default) or the whole page cache (root)")
    parser.add_argument("--direct", action="store_true",
                        help="also time `dd bs=16M oflag=direct conv=fsync` of the same file in each round: the copy"
                             " with the page cache bypassed on the write side, as ours writes (where `cp`'s writes"
                             " through the page cache cost more system time than the disk's own time)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, " + os.uname().release, "evict": args.evict,
                               "bytecode": "compiled, as an installed package runs (the children's environment"
                                           " without PYTHONDONTWRITEBYTECODE)",
                               "cases": {},
                               "fixed_costs_s": fixed_costs(5)}
    console.print(f"fixed costs (whole process, warm): {results['fixed_costs_s']}")
    variants = {"same": [], "bf16": ["--dtype", "bf16"], "shards": ["--max-shard-size", "1GB"],
                "bf16-verify": ["--dtype", "bf16", "--verify-checksums"]}  # the cast's source crc32s checked too
    for case in args.cases:
        src = args.work / f"{case}.pt"
        gb = args.gb / 4 if case.startswith("small") else args.gb
        console.print(f"[bold]{case}[/]: making a {gb:.1f} GB checkpoint ...")
        make_case(src, case, gb)
        for variant in args.variants:
            console.print(f"[bold]{case} / {variant}[/] ({src.stat().st_size / 1e9:.2f} GB)")
            res = pairs(src, args.work, variants[variant], args.pairs, args.evict, args.direct)
            res["source_bytes"] = src.stat().st_size
            results["cases"][f"{case}/{variant}"] = res
        src.unlink()
    table = Table(title=f"convert vs cp + sync (whole process, evicted: {args.evict}, interleaved pairs)")
    for col in ("case", "source GB", "ours s (median)", "cp+sync s (median)", "ratio (median of pairs)",
                "ratio range", *(("dd direct s (median)", "x dd direct (median)") if args.direct else ()),
                "read / source", "peak anon MB"):
        table.add_column(col)
    for name, r in results["cases"].items():
        ratios = [p["ratio"] for p in r["pairs"]]
        dd = (f"{r['median_dd']:.2f}", f"{r['median_ratio_dd']:.2f}x") if args.direct else ()
        table.add_row(name, f"{r['source_bytes'] / 1e9:.2f}", f"{r['median_ours']:.2f}", f"{r['median_copy']:.2f}",
                      f"{r['median_ratio']:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}", *dd,
                      f"{r['read_bytes_median'] / r['source_bytes']:.2f}", f"{r['peak_anon_max'] / 1e6:.0f}")
    console.print(table)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
