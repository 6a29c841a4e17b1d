"""Benchmark fsdp_restore side by side with the baselines, in one run, on the same files.

    python scripts/benchmark.py                      # defaults: 3 GB convert, 512 MB model restore
    python scripts/benchmark.py --convert-gb 1 --restore-mb 256 --world-sizes 2 --out BENCHMARKS.json

Convert (each method in a fresh process, page cache dropped first): ours; torch.load + an OLMo-style
flatten (base64-pickled keys, pickled non-tensors) + safetensors.save_file; torch.load(mmap=True) +
save_file of the tensors only; a plain file copy of the same bytes (the physical limit).

Restore (gloo on CPU, FSDP2 and FSDP1, every rank reading its own copy of the files so that ranks do
not share a page cache, as on separate nodes; cache dropped before each run): ours; dcp.load with
HuggingFaceStorageReader (FSDP2); set_model_state_dict(broadcast_from_rank0=True) from a rank-0 mmap load;
every rank loading the whole file and copying its slice (OLMo style; for FSDP1 the seed's FSDP.apply
route). Per rank: wall time, peak anonymous memory above the sharded model, disk bytes read
(/proc/self/io read_bytes around the restore only).

Save (scripts/benchmark_save.py, the same model with AdamW state): ours against a rank-0 gather, dcp.save,
dcp.save with Hugging Face consolidation, and the floor (every rank pwrite-ing its share into one file).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_restore.measure import PeakAnonMemory, disk_read_bytes  # noqa: E402

console = Console()


def drop_caches() -> bool:
    """Drop the page cache (root only) so that reads come from disk; False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# checkpoints


class BenchModel(torch.nn.Module):
    """Layers of square-ish Linear weights; sizes are odd so that shards are uneven."""

    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(dim, dim + 1) for _ in range(layers)])


LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16,
             vocab_size=32003, tie_word_embeddings=False)  # odd vocabulary: uneven embedding shards


def _llama_config(total_mb: float) -> Any:
    from transformers import LlamaConfig

    shape = dict(LLAMA)
    if total_mb < 400:  # the 1024-wide embeddings alone are 262 MB: narrow the model for small (test) sizes
        shape.update(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=4)
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    per_layer = (4 * h * h + 3 * h * i + 2 * h) * 4
    layers = max(1, round((total_mb * 1e6 - 2 * v * h * 4) / per_layer))
    return LlamaConfig(num_hidden_layers=layers, **shape)


def build_model(kind: str, total_mb: float) -> torch.nn.Module:
    """The restore benchmark's model, ~total_mb of fp32 weights, on the current default device."""
    if kind == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(_llama_config(total_mb))
    return BenchModel(*model_shape(total_mb))


def describe_model(model: torch.nn.Module) -> str:
    if isinstance(model, BenchModel):
        w = model.blocks[0].weight
        return f"{len(model.blocks)} x Linear({w.shape[1]}, {w.shape[0]})"
    cfg = model.config
    return (f"{type(model).__name__}({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size},"
            f" random init)")


def wrap_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules each FSDP unit wraps: every Linear of the toy model, every decoder layer of a Llama."""
    if isinstance(model, BenchModel):
        return list(model.blocks)
    return list(model.model.layers)


def model_shape(total_mb: float) -> tuple[int, int]:
    dim = 1023
    layers = max(1, round(total_mb * 1e6 / ((dim * (dim + 1) + dim + 1) * 4)))
    return layers, dim


def make_training_checkpoint(path: Path, total_gb: float) -> None:
    """Model weights + AdamW state (exp_avg, exp_avg_sq) + extras, ~total_gb, saved like a training run."""
    n = max(1, round(total_gb * 1e9 / 3 / (32 * 2**20)))  # 32 MiB fp32 tensors, three per parameter
    model = {f"layers.{i}.weight": torch.rand(8 * 2**20) for i in range(n)}
    optim = {"state": {i: {"step": torch.tensor(10.0), "exp_avg": torch.rand(8 * 2**20),
                           "exp_avg_sq": torch.rand(8 * 2**20)} for i in range(n)},
             "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(range(n))}]}
    torch.save({"model": model, "optim": optim, "step": 10, "rng": torch.get_rng_state(),
                "config": {"name": "bench", "layers": n}}, path)


# ---------------------------------------------------------------------------------------------
# convert methods (run in a child process: python benchmark.py --convert-method NAME SRC DST)


def _olmo_flatten(obj: Any, path: tuple = ()) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_olmo_flatten(v, path + (k,)))
        return out
    key = base64.urlsafe_b64encode(pickle.dumps(path)).decode()
    if isinstance(obj, torch.Tensor):
        out[key] = obj.contiguous()
    else:
        out[key] = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return out


def convert_method(method: str, src: str, dst: str) -> dict[str, Any]:
    from safetensors.torch import save_file

    with PeakAnonMemory(interval=0.01) as mem:
        t0 = time.perf_counter()
        if method == "ours":
            import fsdp_restore

            fsdp_restore.convert(src, dst, force=True)
        elif method == "ours-bf16":
            import fsdp_restore

            # every floating tensor, optimizer state included (the default casts only the model's weights):
            # the same work as the rows recorded before that default changed
            fsdp_restore.convert(src, dst, force=True, dtype="bf16", cast_include=["*"])
        elif method == "olmo":
            save_file(_olmo_flatten(torch.load(src, weights_only=False)), dst)
        elif method == "mmap+save_file":
            obj = torch.load(src, mmap=True, weights_only=True)
            flat: dict[str, torch.Tensor] = {}

            def walk(o: Any, prefix: str) -> None:
                if isinstance(o, dict):
                    for k, v in o.items():
                        walk(v, f"{prefix}{k}.")
                elif isinstance(o, (list, tuple)):
                    for i, v in enumerate(o):
                        walk(v, f"{prefix}{i}.")
                elif isinstance(o, torch.Tensor):
                    flat[prefix[:-1]] = o

            walk(obj, "")
            save_file(flat, dst)
        elif method == "copy":
            shutil.copyfile(src, dst)
        else:
            raise ValueError(method)
        os.sync()
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_anon": mem.peak - mem.start, "written": os.path.getsize(dst)}


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time (disk writeback makes single runs vary by +-15% here)."""
    row = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])
    row["runs_seconds"] = sorted(round(r["seconds"], 3) for r in runs)
    return row


def bench_convert(work: Path, gb: float, repeat: int = 3, cache: str = "cold") -> list[dict[str, Any]]:
    src = work / "train.pt"
    console.print(f"[bold]convert[/]: generating a {gb:.1f} GB training checkpoint ...")
    make_training_checkpoint(src, gb)
    rows = []
    for method in ("copy", "ours", "ours-bf16", "mmap+save_file", "olmo"):
        dst = work / f"conv-{method}.safetensors"
        runs = []
        for _ in range(repeat):
            cold = cache == "cold" and drop_caches()
            out = subprocess.run([sys.executable, __file__, "--convert-method", method, str(src), str(dst)],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                console.print(f"[red]{method} failed[/]: {out.stderr.strip().splitlines()[-1:]}")
                break
            run = json.loads(out.stdout.strip().splitlines()[-1])
            run.update(method=method, cold_cache=cold, source_bytes=src.stat().st_size)
            runs.append(run)
            dst.unlink()
        if not runs:
            continue
        row = _median_row(runs)
        rows.append(row)
        console.print(f"  {method}: {row['runs_seconds']} s")
    return rows


# ---------------------------------------------------------------------------------------------
# restore methods (run on real ranks)

BLKIO = Path("/sys/fs/cgroup/blkio")


def limit_read_bandwidth(path: str, rank: int, mbps: float, *, writes: bool = False) -> str:
    """Put this process in its own cgroup-v1 blkio group reading (and with ``writes``, writing) at most ``mbps``
    MB/s on the disk holding ``path``: each rank then has a disk of its own bandwidth, as on separate nodes
    (one host's ranks otherwise share one disk, and total bytes, not bytes per rank, set the time).

    A write cap holds for writes this process submits: ``O_DIRECT``, and the writeback of its own dirty pages
    that its ``fsync`` (or ``POSIX_FADV_DONTNEED``) starts; not for writeback the kernel's flusher does on its
    own (over ``vm.dirty_background_ratio`` of memory, or pages dirty longer than ``vm.dirty_expire_centisecs``),
    which cgroup v1 charges to the root group. The save benchmark's outputs stay under both."""
    dev = os.stat(path).st_dev
    group = BLKIO / f"fsdp_restore_bench_rank{rank}"
    group.mkdir(exist_ok=True)
    limit = f"{os.major(dev)}:{os.minor(dev)} {int(mbps * 1e6)}\n"
    (group / "blkio.throttle.read_bps_device").write_text(limit)
    if writes:
        (group / "blkio.throttle.write_bps_device").write_text(limit)
    (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    return str(group)


def leave_read_limit(group: str) -> None:
    (BLKIO / "cgroup.procs").write_text(f"{os.getpid()}\n")
    try:
        os.rmdir(group)
    except OSError:
        pass


def _tensor_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's Llama plan on a 2-way TP mesh, FSDP2 over the rest: q/k/v/gate/up column-split, o/down
    row-split (Shard(1): column blocks), the embedding column-split (Shard(1)), the head column-split."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    plan: dict[str, Any] = {"model.embed_tokens": ColwiseParallel(), "lm_head": ColwiseParallel()}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for unit in wrap_units(model):
        fully_shard(unit, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _build(fsdp: str, kind: str, mb: float) -> torch.nn.Module:
    from fsdp_restore import init_non_persistent_buffers

    with torch.device("meta"):
        model = build_model(kind, mb)
    if fsdp == "fsdp2+tp":
        _tensor_parallel(model).to_empty(device="cpu")
    elif fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in wrap_units(model):
            fully_shard(unit)
        fully_shard(model)
        model.to_empty(device="cpu")
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        unit_types = {type(u) for u in wrap_units(model)}
        model = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy(unit_types),
                     param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False), use_orig_params=True)
    init_non_persistent_buffers(model)  # rotary inv_freq: in no checkpoint, uninitialised after to_empty
    return model


def restore_worker(rank: int, world_size: int, method: str, fsdp: str, kind: str, mb: float,
                   files: list[str], full_files: list[str], threads: int | None = None,
                   cold: bool = True, rank_mbps: float | None = None) -> dict[str, Any]:
    import torch.distributed as dist

    import fsdp_restore

    # Import everything any method uses before the measured window: after the cache drop, a first-time
    # import reads .py/.so files from disk and would be counted as checkpoint reads.
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp._flat_param  # noqa: F401
    import torch.distributed.tensor._utils  # noqa: F401
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401

    import fsdp_restore.apply  # noqa: F401

    torch.empty(4).numpy()  # the first .numpy() call imports lazily too

    model = _build(fsdp, kind, mb)
    path = files[rank]
    group = limit_read_bandwidth(path, rank, rank_mbps) if rank_mbps else None
    counted = [0]

    def run() -> None:
        if method in ("ours", "ours-nocheck"):  # nocheck: without the NaN fill and screen (check=False)
            counted[0] = fsdp_restore.restore_model(model, path, thread_count=threads,
                                                    check=method == "ours").bytes_read
        elif method == "ours+optim":
            # a fresh optimizer (no state yet), as when resuming; restoring into existing state reuses it
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with fsdp_restore.Checkpoint(full_files[rank]) as ckpt:
                fsdp_restore.restore(model, ckpt, optimizer=opt, thread_count=threads)
                counted[0] = ckpt.bytes_read
        elif method == "apply":
            fsdp_restore.restore_model(model, path, method="apply")
        elif method == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import HuggingFaceStorageReader

            state = model.state_dict()
            dcp.load(state, storage_reader=HuggingFaceStorageReader(path=os.path.dirname(path)))
        elif method in ("broadcast", "every-rank-loads"):
            from safetensors import safe_open
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            broadcast = method == "broadcast"
            state: dict[str, torch.Tensor] = {}
            if rank == 0 or not broadcast:
                with safe_open(path, "pt") as f:  # memory-mapped on rank 0 (mmap load)
                    state = {k: f.get_tensor(k) for k in f.keys()}
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                         broadcast_from_rank0=broadcast))
            del state
        else:
            raise ValueError(method)

    # A first, unmeasured run warms the code: after a cache drop, first-time code paths fault library pages
    # in from disk, which /proc/self/io counts like checkpoint reads. Pages mapped by a live process survive
    # the drop; the checkpoint's own pages do not.
    run()
    dist.barrier()
    if rank == 0 and cold:
        drop_caches()
    dist.barrier()
    read0 = disk_read_bytes()
    with PeakAnonMemory(interval=0.01) as mem:
        t0 = time.perf_counter()
        run()
        dist.barrier()
        seconds = time.perf_counter() - t0
    if group:
        leave_read_limit(group)
    return {"seconds": seconds, "peak_anon": mem.peak - mem.start, "read": disk_read_bytes() - read0,
            "requested": counted[0]}


def bench_restore(work: Path, mb: float, world_sizes: list[int], only: list[str] | None = None,
                  repeat: int = 3, read_threads: list[int] | None = None, cache: str = "cold",
                  rank_mbps: float | None = None, kind: str = "linear") -> list[dict[str, Any]]:
    from fsdp_restore import convert
    from fsdp_restore.launch import RankFailure, run_ranks

    torch.manual_seed(0)
    full = build_model(kind, mb)
    model_bytes = sum(t.numel() * 4 for t in full.state_dict().values())
    console.print(f"[bold]restore[/]: {describe_model(full)} = {model_bytes / 1e6:.0f} MB, per-rank file copies ...")
    opt = torch.optim.AdamW(full.parameters(), lr=1e-4)
    sum(p.sum() for p in full.parameters()).backward()
    opt.step()  # real AdamW state (exp_avg / exp_avg_sq for every parameter)
    torch.save({"model": full.state_dict(), "optim": opt.state_dict(), "step": 1}, work / "model.pt")
    del full, opt
    files, full_files = [], []
    for r in range(max(world_sizes)):
        d = work / f"rank{r}"
        d.mkdir(exist_ok=True)
        # a plain weights file (HF layout, the same file for every method) and the full training checkpoint
        convert(work / "model.pt", d / "model.safetensors", select="model", force=True)
        convert(work / "model.pt", d / "full.safetensors", force=True)
        files.append(str(d / "model.safetensors"))
        full_files.append(str(d / "full.safetensors"))
    rows = []
    for ws in world_sizes:
        flavours = [("fsdp2", ["ours", "ours-nocheck", "dcp", "broadcast", "every-rank-loads", "ours+optim"]),
                    ("fsdp1", ["ours", "ours-nocheck", "broadcast", "apply", "ours+optim"])]
        if kind == "llama" and ws % 2 == 0:  # FSDP2 over 2-way tensor parallel: column blocks (Shard(1))
            flavours.append(("fsdp2+tp", ["ours", "ours-nocheck", "dcp", "broadcast"]))
        for fsdp, methods in flavours:
            # ours at each requested read-thread count (default: the library's default only)
            variants = [(m, t) for m in methods for t in ((read_threads or [None]) if m.startswith("ours") else [None])]
            for method, threads in variants:
                if only and f"{fsdp}:{method}" not in only and method not in only:
                    continue
                label = method if not (read_threads and method.startswith("ours")) else f"{method} t={threads}"
                runs = []
                for _ in range(repeat):
                    # each cold run also drops the cache again between its warm-up and the measurement; a warm
                    # run measures with what its own warm-up read still cached (I/O nearly free: CPU costs only)
                    cold = cache == "cold" and drop_caches()
                    try:
                        per_rank = run_ranks(restore_worker, ws, method, fsdp, kind, mb, files, full_files,
                                             threads, cold, rank_mbps, timeout=600, backend="gloo")
                    except RankFailure as e:
                        console.print(f"[red]{fsdp} {label} ws={ws} failed[/]: {str(e).splitlines()[1][:200]}")
                        break
                    runs.append(_restore_row(per_rank, fsdp, label, ws, cold, model_bytes))
                if not runs:
                    continue
                row = _median_row(runs)
                row["rank_read_mbps"] = rank_mbps
                row["model"] = kind
                rows.append(row)
                console.print(f"  ws={ws} {fsdp} {label}: {row['runs_seconds']} s, read per rank"
                              f" {[round(r / 1e6, 1) for r in row['read_per_rank']]} MB"
                              f" (requested {[round(r / 1e6, 1) for r in row['requested']]})")
    return rows


def _restore_row(per_rank: list[dict[str, Any]], fsdp: str, method: str, ws: int, cold: bool,
                 model_bytes: int) -> dict[str, Any]:
    return {"fsdp": fsdp, "method": method, "world_size": ws, "cold_cache": cold, "model_bytes": model_bytes,
            "seconds": max(r["seconds"] for r in per_rank),
            "peak_anon_max": max(r["peak_anon"] for r in per_rank),
            "read_max": max(r["read"] for r in per_rank),
            "read_total": sum(r["read"] for r in per_rank),
            "read_per_rank": [r["read"] for r in per_rank],
            "requested": [r["requested"] for r in per_rank]}


# ---------------------------------------------------------------------------------------------
# report


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def report(convert_rows: list[dict[str, Any]], restore_rows: list[dict[str, Any]]) -> str:
    lines = []
    if convert_rows:
        copy = next((r for r in convert_rows if r["method"] == "copy"), None)
        t = Table(title="convert (fresh process per method)")
        for c in ("method", "seconds", "x copy", "peak anon memory", "written"):
            t.add_column(c, justify="right")
        lines.append("| method | seconds | x copy | peak anonymous memory | bytes written |\n|---|---|---|---|---|")
        for r in convert_rows:
            ratio = f"{r['seconds'] / copy['seconds']:.2f}" if copy else "-"
            t.add_row(r["method"], f"{r['seconds']:.2f}", ratio, mb(r["peak_anon"]), mb(r["written"]))
            lines.append(f"| {r['method']} | {r['seconds']:.2f} | {ratio} | {mb(r['peak_anon'])} | {mb(r['written'])} |")
        console.print(t)
    if restore_rows:
        cache = "cold" if all(r["cold_cache"] for r in restore_rows) else "warm"
        cap = restore_rows[0].get("rank_read_mbps")
        t = Table(title=f"restore ({restore_rows[0].get('model', 'linear')} model, gloo, CPU, {cache} page cache{f', reads capped at {cap:g} MB/s per rank' if cap else ''};"
                        " max over ranks)")
        for c in ("ws", "fsdp", "method", "seconds", "x ours", "read/rank", "read/rank / (model/N)", "peak anon/rank"):
            t.add_column(c, justify="right")
        lines.append("\n| ws | fsdp | method | seconds | x ours | read per rank | read per rank / (model/N) |"
                     " peak anon per rank |\n|---|---|---|---|---|---|---|---|")
        for r in restore_rows:
            ours = next((o for o in restore_rows if o["method"].split(" ")[0] == "ours" and o["fsdp"] == r["fsdp"]
                         and o["world_size"] == r["world_size"]), None)
            ratio = f"{r['seconds'] / ours['seconds']:.2f}" if ours else "-"
            share = r["model_bytes"] / r["world_size"]
            cells = [str(r["world_size"]), r["fsdp"], r["method"], f"{r['seconds']:.2f}", ratio, mb(r["read_max"]),
                     f"{r['read_max'] / share:.2f}", mb(r["peak_anon_max"])]
            t.add_row(*cells)
            lines.append("| " + " | ".join(cells) + " |")
        console.print(t)
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--convert-method":
        print(json.dumps(convert_method(*sys.argv[2:5])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--convert-gb", type=float, default=3.0)
    parser.add_argument("--restore-mb", type=float, default=512)
    parser.add_argument("--model", choices=["linear", "llama"], default="linear",
                        help="restore subject: a stack of odd-sized Linear layers (default) or a random-init"
                             " transformers LlamaForCausalLM (embeddings, norms, many small tensors)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--skip", choices=["convert", "restore", "save"], action="append", default=[])
    parser.add_argument("--repeat", type=int, default=3, help="runs per method; the median is reported")
    parser.add_argument("--methods", nargs="+", help="restore methods to run, e.g. ours dcp fsdp1:apply")
    parser.add_argument("--read-threads", type=int, nargs="+",
                        help="read threads per rank for our methods; several values run one row each")
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold",
                        help="read from disk (cold, default: the page cache is dropped before each run, as root) or from"
                             " the page cache (warm: nothing dropped; a restore reads what its warm-up cached)")
    parser.add_argument("--rank-read-mbps", type=float,
                        help="cap each rank's disk reads at this many MB/s (cgroup v1 blkio, root): emulates one"
                             " disk per rank, as on separate nodes")
    parser.add_argument("--workdir", help="where to put the files (default: a temporary directory)")
    parser.add_argument("--out", help="also write the raw results as JSON here")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fsdp_restore_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        conv = [] if "convert" in args.skip else bench_convert(work, args.convert_gb, args.repeat, args.cache)
        rest = [] if "restore" in args.skip else bench_restore(work, args.restore_mb, args.world_sizes, args.methods, args.repeat,
                                                               args.read_threads, args.cache, args.rank_read_mbps, args.model)
        markdown = report(conv, rest)
        saved: list[dict[str, Any]] = []
        if "save" not in args.skip:  # scripts/benchmark_save.py: the same model, saved from its shards
            from benchmark_save import bench_save, report_save

            saved = bench_save(work, args.restore_mb, args.world_sizes, kind=args.model, repeat=args.repeat)
            markdown += "\n\n" + report_save(saved)
        if args.out:
            Path(args.out).write_text(json.dumps({"convert": conv, "restore": rest, "save": saved, "markdown": markdown},
                                                 indent=2))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
