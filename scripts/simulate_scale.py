"""Restore at 8 .. 1024 ranks, on paper and in simulation: every rank's plan for a Llama-3-405B-shaped model.

    python scripts/simulate_scale.py                           # FSDP2 at 8, 64, 256, 1024 ranks; HSDP 8 x 128
    python scripts/simulate_scale.py --world-sizes 8 1024 --layers 8 --out x.json   # quicker

No processes are launched and no GPU is needed. One rank at a time runs in its own process with torch's
fake process group (``torch.testing._internal.distributed.fake_pg``: a real ``ProcessGroup`` whose
collectives do nothing) at the simulated rank and world size, so that FSDP2's ``fully_shard`` lays out
a real 405B-parameter Hugging Face Llama exactly as it would on that rank; ``to_empty`` gives its
shards memory that is never touched (virtual), and the library's real planner (`build_plan`,
`validate_plan`, `coverage_terms`, the executor's chunking) runs against a real checkpoint file: a
safetensors header describing the 405B bf16 tensors, on a sparse file of the full size (nothing is
read: planning reads only the header). Per simulated rank: plan time, reads, bytes, peak RSS and the
verdict's payload. Then, for every rank of every layout (not a sample), torch's own layout arithmetic
(at each rank's mesh coordinate, with the simulated model's own placements) and our row blocks give
each rank's coverage terms, which must sum to zero for every tensor: the check the verdict's
all-reduce makes, done for all 1024 ranks. Layouts: FSDP2 at each world size, HSDP 8 x N/8, and FSDP2
over 8-way tensor parallelism (torchtitan's plan: Shard(1) row-wise outputs, _StridedShard).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_405B = dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                  rms_norm_eps=1e-5, rope_theta=500000.0)


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**LLAMA_405B, "num_hidden_layers": layers})


def _shapes(layers: int) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(layers))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def write_sparse_checkpoint(path: Path, layers: int) -> int:
    """A safetensors file of the 405B model's bf16 tensors (Hugging Face names): a real header, the data a
    hole of the full size (sparse: no disk used). Returns the data bytes."""
    header, at = {}, 0
    for name, shape in _shapes(layers).items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + at)
    return at


TP = 8  # tensor-parallel degree of the fsdp2+tp layout (one 8-GPU node)


def _tp_plan(layers: int) -> dict:
    """torchtitan's Llama plan: column-split projections and head, row-split outputs (Shard(1)), a
    row-split embedding, sequence-parallel norms (Replicate)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel(), "model.norm": SequenceParallel()}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        for name in ("input_layernorm", "post_attention_layernorm"):
            plan[f"model.layers.{i}.{name}"] = SequenceParallel()
    return plan


def simulated_model(layout: str, world: int, rank: int, layers: int):
    """The 405B Llama laid out as ``rank`` of ``world`` would hold it (meta device), under torch's fake
    process group: fsdp2 (1-D), hsdp (8 replicas), or fsdp2+tp (FSDP2 over TP on a (world/8) x 8 mesh)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaForCausalLM

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(layers)).to(torch.bfloat16)
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (8, world // 8), mesh_dim_names=("replicate", "shard"))
    elif layout == "fsdp2+tp":
        from torch.distributed.tensor.parallel import parallelize_module

        mesh_2d = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh_2d["tp"], _tp_plan(layers))
        mesh = mesh_2d["dp"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def one_rank(layout: str, world: int, rank: int, path: str, layers: int) -> dict:
    """Plan one simulated rank (runs in its own process)."""
    import torch.distributed as dist

    import fsdp_restore
    from fsdp_restore.check import coverage_terms, model_storages, validate_plan
    from fsdp_restore.execute import chunked
    from fsdp_restore.plan import build_plan
    from fsdp_restore.read import Checkpoint

    model = simulated_model(layout, world, rank, layers)
    model.to_empty(device="cpu")  # the shards' memory: allocated, never touched
    fsdp_restore.init_non_persistent_buffers(model)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gc.disable()  # as restore() does while it plans and reads
    t0 = time.perf_counter()
    ckpt = Checkpoint(path)
    plan = build_plan(model, ckpt, prefix="")
    t1 = time.perf_counter()
    problems = validate_plan(plan, model_storages(model), ckpt)
    t2 = time.perf_counter()
    terms = coverage_terms(plan.items)
    t3 = time.perf_counter()
    reads = len(chunked(plan.items, ckpt))
    # the verdict of a phase, as the restore runs it; the fake group's collectives do nothing, so record them
    from fsdp_restore import verdict

    sent: list[int] = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        # success path (the other ranks' terms are not summed here: the fake group adds nothing)
        verdict.agree(verdict.new_problems(), "restore", coverage=None, buffer_prints=[])
    finally:
        dist.all_reduce = real_all_reduce
    local = sum(i.dest.numel() * ckpt.entries[i.key].itemsize for i in plan.items)
    column_blocks = sum(1 for i in plan.items if i.rows > 1)
    rows_described = sum(i.rows for i in plan.items if i.rows > 1)
    return {"layout": layout, "world": world, "rank": rank, "tensors": len(plan.targets), "items": len(plan.items),
            "reads": reads, "bytes": local, "plan_s": t1 - t0, "validate_s": t2 - t1, "coverage_s": t3 - t2,
            "problems": plan.problems | problems, "coverage_names": len(terms),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "plan_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024,
            "verdict_bytes_per_phase": sum(sent), "verdict_collectives_per_phase": len(sent),
            "column_blocks": column_blocks, "rows_described": rows_described}


def every_rank_covers(layout: str, world: int, layers: int) -> dict:
    """Sum every rank's coverage terms per distinct (shape, placements): torch's layout arithmetic at each
    rank's mesh coordinate -> our row blocks -> our moments. Zero for every tensor means the ranks together
    read each element equally often. The placements are the simulated model's own (rank 0's: every rank
    holds the same placements). Runs in its own process (it needs the fake process group)."""
    import itertools

    import torch
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from fsdp_restore.check import coverage_terms
    from fsdp_restore.plan import ReadItem
    from fsdp_restore.shards import block_rows

    model = simulated_model(layout, world, 0, layers)
    layouts = {}
    for param in model.parameters():
        mesh_shape = tuple(param.device_mesh.shape)
        layouts[(tuple(param.shape), mesh_shape, tuple(param.placements))] = None
    bad, copies, t0 = [], set(), time.perf_counter()
    for shape, mesh_shape, placements in layouts:
        n = 1
        for d in shape:
            n *= d
        items = []  # every rank's reads of this tensor, as the plan would describe them (no memory: meta)
        for coord in itertools.product(*(range(m) for m in mesh_shape)):
            local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
            blocks, run = block_rows(tuple(shape), tuple(local), tuple(offset))
            items.extend(ReadItem("w", b.start, torch.empty(b.rows * run, device="meta"), "w", b.start, n, b.rows,
                                  b.stride) for b in blocks if run)
        terms = coverage_terms(items)  # summed over every rank, as the verdict's all-reduce sums them
        if any(terms.get("w", (0, 0))):
            bad.append([list(shape), str(placements)])
        copies.add(sum(i.dest.numel() for i in items) // n)
    return {"layout": layout, "world": world, "shapes": len(layouts), "uncovered": bad, "copies": sorted(copies),
            "placements": sorted({type(p).__name__ for _, _, ps in layouts for p in ps}),
            "seconds": time.perf_counter() - t0}


def _child(argv: list[str], layers: int) -> dict:
    """Run this script with ``argv`` in a fresh process (one fake process group each); its JSON answer."""
    out = subprocess.run([sys.executable, __file__, "--layers", str(layers), *argv], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--hsdp", action=argparse.BooleanOptionalAction, default=True, help="also HSDP 8 x 128")
    parser.add_argument("--layers", type=int, default=126)
    parser.add_argument("--workdir", default="/tmp/fsdp_restore_scale")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tp", action=argparse.BooleanOptionalAction, default=True,
                        help="also FSDP2 over tensor parallel, (ranks/8) x 8, at the largest world size")
    parser.add_argument("--one", nargs=4, metavar=("LAYOUT", "WORLD", "RANK", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--cover", nargs=2, metavar=("LAYOUT", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        layout, world, rank, path = args.one
        print(json.dumps(one_rank(layout, int(world), int(rank), path, args.layers)))
        return
    if args.cover:
        print(json.dumps(every_rank_covers(args.cover[0], int(args.cover[1]), args.layers)))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"llama405b-{args.layers}layers.safetensors"
    total = write_sparse_checkpoint(path, args.layers)
    console.print(f"checkpoint header for {total / 1e9:.0f} GB of bf16 weights (sparse file: {path})")
    layouts = [("fsdp2", w) for w in args.world_sizes] + ([("hsdp", 1024)] if args.hsdp else [])
    layouts += [("fsdp2+tp", max(args.world_sizes))] if args.tp and max(args.world_sizes) >= 2 * TP else []
    rows, covers = [], []
    for layout, world in layouts:
        for rank in sorted({0, world // 2 + 1, world - 1}):
            rows.append(_child(["--one", layout, str(world), str(rank), str(path)], args.layers))
        covers.append(_child(["--cover", layout, str(world)], args.layers))
    table = Table(title=f"Llama-3-405B shape ({args.layers} layers), bf16 weights: one simulated rank at a time")
    for col in ("layout", "ranks", "rank", "tensors", "reads", "GB read", "x share", "plan s", "validate s",
                "column blocks (rows)", "RSS MB (plan)", "verdict B"):
        table.add_column(col, justify="right")
    for r in rows:
        share = total / (r["world"] // 8 if r["layout"] == "hsdp" else r["world"])
        blocks = f"{r['column_blocks']} ({r['rows_described']})" if r["column_blocks"] else "0"
        table.add_row(r["layout"], str(r["world"]), str(r["rank"]), str(r["tensors"]), str(r["reads"]),
                      f"{r['bytes'] / 1e9:.2f}", f"{r['bytes'] / share:.3f}", f"{r['plan_s']:.2f}",
                      f"{r['validate_s'] + r['coverage_s']:.2f}", blocks, f"{r['plan_rss_mb']:.0f}",
                      str(r["verdict_bytes_per_phase"]))
        if r["problems"]:
            console.print(f"[red]problems[/] {r['layout']} {r['world']} rank {r['rank']}: {r['problems']}")
    console.print(table)
    for c in covers:
        verdict = "[green]every element covered[/]" if not c["uncovered"] else f"[red]uncovered {c['uncovered']}[/]"
        console.print(f"{c['layout']} x {c['world']} ranks: all {c['world']} ranks' coverage terms summed over"
                      f" {c['shapes']} tensor layouts ({', '.join(c['placements'])}; copies {c['copies']}):"
                      f" {verdict} ({c['seconds']:.1f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps({"layers": args.layers, "bytes": total, "ranks": rows,
                                              "coverage": covers}, indent=1))


if __name__ == "__main__":
    main()
