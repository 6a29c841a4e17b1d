"""Two versions of ``fsdp-restore convert`` side by side, with ``cp`` + ``sync`` of the same file, rounds alternating.

    git archive COMMIT fsdp_restore | tar -x -C /tmp/old
    python scripts/ab_convert.py --against /tmp/old                       # --dtype bf16; small (1 GB) and big (4 GB)
    python scripts/ab_convert.py --against /tmp/old --cases small --args=  # same dtype

Each run is a whole process (``python -m fsdp_restore convert SRC DST ARGS`` with the tree as its working
directory, so that ``-m`` finds that tree's package first), the source evicted from the page cache before it
(``fsync`` + ``POSIX_FADV_DONTNEED``, as `benchmark_convert.py` does). Per round: both trees, in an order that
alternates round by round, then the copy. The cases are `benchmark_convert.make_case`'s. Medians and every run
are printed and, with ``--out``, written as JSON. Results are in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_convert import CHILD_ENV, evict, make_case  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="a directory holding another fsdp_restore package")
    parser.add_argument("--cases", nargs="+", default=["small", "big"], choices=["small", "big", "mix", "weights", "small-weights"])
    parser.add_argument("--gb", type=float, default=4.0, help="size of the 'big' case (small and small-weights: a quarter)")
    parser.add_argument("--args", default="--dtype bf16", help="the conversion's options (default: --dtype bf16)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fsdp_restore_bench_convert"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {str(args.against): args.against.resolve(), "this checkout": ROOT}
    results: dict[str, dict[str, dict[str, object]]] = {}
    for case in args.cases:
        src = args.work / f"{case}.pt"
        make_case(src, case, args.gb / 4 if case.startswith("small") else args.gb)
        runs: dict[str, list[float]] = {name: [] for name in (*trees, "cp+sync")}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in (*order, "cp+sync"):
                # (a set of shards is a directory: `convert` refuses a file's name for one)
                dst = args.work / ("out" if "--max-shard-size" in args.args and name != "cp+sync" else "out.safetensors")
                shutil.rmtree(dst) if dst.is_dir() else dst.unlink(missing_ok=True)
                evict(src, "source")
                t = time.perf_counter()
                if name == "cp+sync":
                    subprocess.run(["sh", "-c", f"cp {shlex.quote(str(src))} {shlex.quote(str(dst))} && sync"],
                                   check=True)
                else:
                    # (as an installed package runs: from bytecode, which each tree writes on its first run; with
                    # PYTHONDONTWRITEBYTECODE a tree without it would compile its modules in every run)
                    subprocess.run([sys.executable, "-m", "fsdp_restore", "convert", str(src), str(dst),
                                    *shlex.split(args.args)], cwd=trees[name], check=True, capture_output=True,
                                   env=CHILD_ENV)
                runs[name].append(time.perf_counter() - t)
            print(case, r, {k: round(v[-1], 2) for k, v in runs.items()}, flush=True)
        (args.work / "out.safetensors").unlink(missing_ok=True)
        src.unlink()
        results[case] = {k: {"runs": v, "median": statistics.median(v)} for k, v in runs.items()}
        print(case, "medians:", {k: round(statistics.median(v), 2) for k, v in runs.items()}, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": args.args, "rounds": args.rounds, "cases": results}, indent=1))


if __name__ == "__main__":
    main()
