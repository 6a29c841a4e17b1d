"""Sharded checkpoints -> one safetensors file, side by side in one run: DeepSpeed ZeRO (ours against
DeepSpeed's own zero_to_fp32.py) and DCP (ours against torch's dcp_to_torch_save).

    python scripts/benchmark_sharded.py                     # ~300M parameters: ZeRO-2, ZeRO-3 (bf16), DCP (fp32)
    python scripts/benchmark_sharded.py --params-m 50 --stages 2 --repeat 1 --no-dcp

Makes the checkpoints with real DeepSpeed (2 ranks on CPU, gloo; a stack of Linear layers, no tied weights,
so that DeepSpeed's safetensors output works), then for each stage and method, in a fresh process with
the page cache dropped (root; ``--evict checkpoint``: only the checkpoint's files, ``fsync`` +
``POSIX_FADV_DONTNEED``, so that Python's and torch's libraries stay cached as in `benchmark_convert.py`),
measures wall time and the process's peak anonymous memory (RssAnon, sampled every 10 ms). The methods take
turns, one run of each per round. Methods (and ``cp -r`` + ``sync`` of the checkpoint directory, the floor of a
conversion that reads and writes everything once): DeepSpeed's ``zero_to_fp32.py CKPT OUT --safe_serialization`` (model
weights only, single core; and the same with the clock stopped only after a ``sync``, since ours fsyncs its
output and DeepSpeed's leaves it in the page cache) and ``fsdp-restore convert CKPT OUT.safetensors`` (weights and optimizer state,
every core) and ``--select model`` (the same output as DeepSpeed's). DCP: a directory written by
``dcp.save`` from FSDP2 on 2 ranks (model + AdamW state through ``get_state_dict``), converted by
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` and by ours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import console, drop_caches  # noqa: E402


def _make(rank: int, world_size: int, out: str, stage: int, params_m: float) -> str:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    dim = 2048
    layers = max(1, round(params_m * 1e6 / (dim * (dim + 1))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=torch.optim.AdamW(model.parameters()))
    x = torch.randn(1, dim, dtype=torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    engine.save_checkpoint(out)
    return "ok"


def _make_dcp(rank: int, world_size: int, out: str, params_m: float) -> str:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dim = 2048
    layers = max(1, round(params_m * 1e6 / (dim * (dim + 1))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, dim)).pow(2).mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=out)
    return "ok"


def _peak_anon(pid: int, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.01):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        except OSError:
            return


def evict(ckpt: Path, how: str) -> bool:
    """Drop the page cache before a run: every clean page (``all``, root), or the checkpoint's files only."""
    if how == "all":
        return drop_caches()
    os.sync()
    for f in ckpt.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    return True


def run(cmd: list[str], ckpt: Path, how: str, then_sync: bool = False, cwd: str | None = None) -> dict[str, Any]:
    """One timed run of ``cmd`` (in ``cwd``) after `evict`; ``then_sync``: the clock stops only once ``sync`` has put
    what it wrote on the disk (ours fsyncs its output before it exits; DeepSpeed's script leaves it in the page
    cache)."""
    cold = evict(ckpt, how)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    stop, peak = threading.Event(), [0]
    watcher = threading.Thread(target=_peak_anon, args=(proc.pid, stop, peak), daemon=True)
    watcher.start()
    out, err = proc.communicate()
    if then_sync:
        os.sync()
    seconds = time.perf_counter() - t0
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return {"seconds": seconds, "peak_anon": peak[0], "cold": cold}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=300, help="millions of parameters")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-dcp", action="store_true", help="skip the DCP comparison")
    parser.add_argument("--evict", choices=["all", "checkpoint"], default="all",
                        help="before each run, drop every cached page (all) or only the checkpoint's (checkpoint)")
    parser.add_argument("--workdir", default="/tmp/fsdp_restore_sharded_bench")
    parser.add_argument("--against", help="a directory holding another fsdp_restore package: its full conversion"
                        " takes its turn too (``python -m`` run there finds that package first)")
    parser.add_argument("--out")
    args = parser.parse_args()
    from fsdp_restore.launch import run_ranks

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for stage in args.stages:
        ckpt = work / f"z{stage}-{args.params_m:g}m"
        if not (ckpt / "latest").exists():
            console.print(f"making a ZeRO-{stage} checkpoint of {args.params_m:g}M parameters with DeepSpeed ...")
            run_ranks(_make, 2, str(ckpt), stage, args.params_m, timeout=3600, backend="gloo")
        size = sum(f.stat().st_size for f in ckpt.rglob("*.pt"))
        py = sys.executable
        methods = {
            "zero_to_fp32.py --safe_serialization": [py, str(ckpt / "zero_to_fp32.py"), str(ckpt),
                                                     str(work / "ds_out"), "--safe_serialization"],
            "ours (weights + optimizer state)": [py, "-m", "fsdp_restore", "convert", str(ckpt),
                                                 str(work / "ours.safetensors"), "--force"],
            "ours --select model (weights only)": [py, "-m", "fsdp_restore", "convert", str(ckpt),
                                                   str(work / "ours-model.safetensors"), "--force", "--select", "model"],
            "cp -r + sync (the floor of a full conversion)": ["sh", "-c", f"cp -r '{ckpt}' '{work / 'copy'}' && sync"],
            # every record read checked against its recorded crc32 (from the runs as read; the padding read again)
            "ours, --verify-checksums": [py, "-m", "fsdp_restore", "convert", str(ckpt),
                                         str(work / "ours.safetensors"), "--force", "--verify-checksums"],
            "ours --select model, --verify-checksums": [py, "-m", "fsdp_restore", "convert", str(ckpt),
                                                        str(work / "ours-model.safetensors"), "--force", "--select",
                                                        "model", "--verify-checksums"],
        }
        durable = {"zero_to_fp32.py --safe_serialization, then sync (its output on disk, as ours)":
                   methods["zero_to_fp32.py --safe_serialization"]}
        methods.update(durable)
        cwd_of: dict[str, str] = {}
        if args.against:
            for label in ("ours (weights + optimizer state)", "ours --select model (weights only)"):
                other = f"{label}, {args.against}"
                methods[other], cwd_of[other] = methods[label], str(Path(args.against).resolve())
        runs_of: dict[str, list[dict[str, Any]]] = {label: [] for label in methods}
        for _ in range(args.repeat):  # the methods take turns: drift over the run hits each alike
            for label, cmd in methods.items():
                shutil.rmtree(work / "ds_out", ignore_errors=True)
                shutil.rmtree(work / "copy", ignore_errors=True)
                runs_of[label].append(run(cmd, ckpt, args.evict, then_sync=label in durable, cwd=cwd_of.get(label)))
        for label, runs in runs_of.items():
            best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
            row = {"stage": stage, "method": label, "checkpoint_bytes": size, **best,
                   "runs_seconds": sorted(round(r["seconds"], 2) for r in runs)}
            rows.append(row)
            console.print(f"  ZeRO-{stage} {label}: {row['runs_seconds']} s, peak anon {row['peak_anon'] / 1e6:.0f} MB")
    if not args.no_dcp:
        ckpt = work / f"dcp-{args.params_m:g}m"
        if not (ckpt / ".metadata").exists():
            console.print(f"making a DCP checkpoint of {args.params_m:g}M parameters from FSDP2 ...")
            run_ranks(_make_dcp, 2, str(ckpt), args.params_m, timeout=3600, backend="gloo")
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        script = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save;"
                  "dcp_to_torch_save(sys.argv[1], sys.argv[2])")
        for label, cmd in {"dcp_to_torch_save": [sys.executable, "-c", script, str(ckpt), str(work / "dcp.pt")],
                           "ours": [sys.executable, "-m", "fsdp_restore", "convert", str(ckpt),
                                    str(work / "dcp.safetensors"), "--force"]}.items():
            runs = [run(cmd, ckpt, args.evict) for _ in range(args.repeat)]
            best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
            rows.append({"stage": "dcp", "method": label, "checkpoint_bytes": size, **best,
                         "runs_seconds": sorted(round(r["seconds"], 2) for r in runs)})
            console.print(f"  DCP {label}: {rows[-1]['runs_seconds']} s, peak anon {best['peak_anon'] / 1e6:.0f} MB")
    lines = ["| source | method | seconds (median) | x reference | peak anonymous memory |", "|---|---|---|---|---|"]
    for r in rows:
        ref = next(x for x in rows if x["stage"] == r["stage"] and x["method"] in (
            "zero_to_fp32.py --safe_serialization", "dcp_to_torch_save"))
        lines.append(f"| {'ZeRO-' if r['stage'] != 'dcp' else ''}{r['stage']} | {r['method']} | {r['seconds']:.2f} | {r['seconds'] / ref['seconds']:.2f} |"
                     f" {r['peak_anon'] / 1e6:,.0f} MB |")
    console.print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"evict": args.evict, "rows": rows, "markdown": "\n".join(lines)}, indent=2))


if __name__ == "__main__":
    main()
