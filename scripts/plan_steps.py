"""Where a restore's plan spends its time, step by step, in one process (world size 1, gloo, FSDP2), warm.

    python scripts/plan_steps.py                          # this checkout: 977 Linear(64, 64) units, 15 restores
    python scripts/plan_steps.py --against /tmp/old       # and another tree, alternating processes
    python scripts/plan_steps.py --layers 511 --stat min --against /tmp/old   # 1022 tensors; minima (a noisy hour)

Each run is a fresh process: it builds ``--layers`` ``Linear(64, 64)`` layers, shards each with ``fully_shard``,
restores them 3 times (warm-up), then 15 times with `restore_model(check=False)`, and prints the median (``--stat
min``: the minimum) plan time (``report.timings["plan"]``) and of each step of it per restore, timed by wrapping the
functions that do it where the tree has them. ``--against`` is a directory holding another version's ``fsdp_restore`` package (e.g.
``git archive COMMIT fsdp_restore | tar -x -C /tmp/old``); the trees alternate, ``--rounds`` processes each.
Results are in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = [("restore", "open_checkpoint"), ("restore", "_warn_of_load_code"), ("restore", "_reshard_fsdp2"),
         ("restore", "build_plan"), ("plan", "local_targets"), ("plan", "_plan_weights"), ("plan", "tensor_sources"),
         ("check", "model_storages"), ("check", "validate_plan"), ("check", "coverage_terms"), ("restore", "agree")]


def _child(layers: int, stat: str) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from torch.distributed.fsdp import fully_shard

    import fsdp_restore

    times: dict[str, list[float]] = {}
    for module, name in STEPS:
        owner = importlib.import_module(f"fsdp_restore.{module}")
        fn = getattr(owner, name, None)
        if fn is None:
            continue

        def timed(*args: object, _fn=fn, _label=f"{module}.{name}", **kwargs: object) -> object:
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                times.setdefault(_label, []).append(time.perf_counter() - t)

        setattr(owner, name, functools.wraps(fn)(timed))

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])

    with tempfile.TemporaryDirectory() as d:
        torch.save(build().state_dict(), f"{d}/m.pt")
        fsdp_restore.convert(f"{d}/m.pt", f"{d}/m.safetensors")
        model = build()
        for unit in model:
            fully_shard(unit)
        fully_shard(model)
        for _ in range(3):
            fsdp_restore.restore_model(model, f"{d}/m.safetensors", check=False)
        times.clear()
        plans = [fsdp_restore.restore_model(model, f"{d}/m.safetensors", check=False).timings["plan"]
                 for _ in range(15)]
    dist.destroy_process_group()
    pick = min if stat == "min" else statistics.median  # min: the step's cost where the machine did not get in its way
    calls = {k: len(v) // 15 for k, v in times.items()}  # a step called several times per restore: summed
    per = {k: [sum(v[i * calls[k]:(i + 1) * calls[k]]) for i in range(15)] for k, v in times.items()}
    print(json.dumps({"plan": pick(plans), **{k: pick(v) for k, v in per.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=977)
    parser.add_argument("--against", type=Path, help="a directory holding another version's fsdp_restore package")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="each process's median of its 15 restores, or the minimum (steadier on a noisy machine)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.layers, args.stat)
        return
    trees = {"this checkout": str(Path(__file__).resolve().parent.parent)}
    if args.against:
        trees = {str(args.against): str(args.against.resolve()), **trees}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, root in trees.items():
            env = dict(os.environ, PYTHONPATH=root)
            out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--stat", args.stat, "--child"], env=env,
                                 capture_output=True, text=True, check=True, cwd="/")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for name, rows in runs.items():
        print(f"{name}: {args.rounds} processes, ms (each process's {args.stat} of 15 restores)")
        for label in rows[0]:
            print(f"  {label:28s} " + " / ".join(f"{row[label] * 1e3:6.2f}" for row in rows if label in row))


if __name__ == "__main__":
    main()
