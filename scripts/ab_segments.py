"""A/B: convert and verify a checkpoint dominated by one huge tensor, with the tensor cut into segments
across threads (the default) and written by one thread (segments disabled).

    python scripts/ab_segments.py --cache cold --repeat 3     # cold needs root (drops the page cache)

Each run is a fresh process; A and B alternate so that drift on a shared disk hits both alike. Since the
converter writes fixed 32 MB blocks of the output (any tensor spreads over the threads by blocks), the
segments setting changes only ``verify``; the convert times of A and B measure the same code.
Results are in BENCHMARKS.md ("What made it fast").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CHILD = r"""
import json, os, sys, time
from fsdp_restore import checksum, convert, verify
mode, src, dst, dtype, cache, threads = sys.argv[1:7]
if mode == "one-thread":
    checksum.SEGMENT_MIN_BYTES = 1 << 62  # no tensor is ever split
t = time.perf_counter()
convert(src, dst, thread_count=int(threads), force=True, dtype=None if dtype == "fp32" else dtype)
c = time.perf_counter() - t
if cache == "cold":
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
t = time.perf_counter()
assert verify(dst, thread_count=int(threads)).ok
print(json.dumps({"convert": c, "verify": time.perf_counter() - t}))
"""


def make_checkpoint(path: Path, big_gb: float, rest_gb: float) -> None:
    torch.manual_seed(0)
    model = {"embed": torch.randn(int(big_gb * 1e9 / 4))}
    for i in range(8):
        model[f"layer{i}.weight"] = torch.randn(int(rest_gb * 1e9 / 4 / 8))
    torch.save({"model": model, "step": 1}, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-gb", type=float, default=1.5, help="the huge tensor")
    parser.add_argument("--rest-gb", type=float, default=0.5, help="eight other tensors, in all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp_restore_ab_") as tmp:
        src, dst = Path(tmp) / "ckpt.pt", Path(tmp) / "out.safetensors"
        make_checkpoint(src, args.big_gb, args.rest_gb)
        results: dict[str, list[dict[str, float]]] = {}
        for dtype in args.dtypes:
            for _ in range(args.repeat):
                for mode in ("one-thread", "segments"):
                    if args.cache == "cold":
                        os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
                    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(src), str(dst), dtype, args.cache,
                                          str(args.threads)], capture_output=True, text=True, check=True).stdout
                    results.setdefault(f"{dtype} {mode}", []).append(json.loads(out))
        for name, runs in results.items():
            conv = statistics.median(r["convert"] for r in runs)
            ver = statistics.median(r["verify"] for r in runs)
            print(f"{args.cache} {name:>16}: convert {conv:.2f} s {[round(r['convert'], 2) for r in runs]},"
                  f" verify {ver:.2f} s {[round(r['verify'], 2) for r in runs]}")


if __name__ == "__main__":
    main()
