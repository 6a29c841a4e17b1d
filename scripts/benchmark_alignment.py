"""How fast the kernel copies file bytes into memory, by where the memory lies relative to the file bytes.

    python scripts/benchmark_alignment.py                  # 2 GB from the page cache, 4 threads, 4 MB reads
    python scripts/benchmark_alignment.py --mb 512 --rounds 5

Warm (the file is read once first), one process: for each placement ``d`` = (memory address - file offset) mod 4096
of a loop of ``os.preadv`` calls on ``threads`` threads, each reading ``--chunk-mb`` into one preallocated buffer,
the median time over ``rounds`` rounds (placements alternate within each round), and the same bytes read the way
the restore reads an aliased destination: into a staging buffer placed like the source, then one ``copy_``.
Why it matters: a restore reads straight into the model's memory, whose placement relative to the file it does
not choose; a file written with its data on a page boundary and tensor sizes that are multiples of 64 bytes is
read at ``d`` = 64 (the offset of torch's large allocations in their page).

Then (``--restore-mb``, 0 to skip) whole restores of the same weights (``Linear(1024, 1024)`` layers, sizes
multiples of 64 bytes) from files that differ only in where their data section starts: written by
``fsdp_restore.save`` (on a page boundary) and by ``safetensors.torch.save_file``, its header padded with spaces
to start the data at page offsets the sweep above tells apart (where another writer's header length may put it),
each aliased one also read with the detour switched off; alternating round by round,
`restore_model(check=False)` into a plain model, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_restore.execute import aliased, staging_shift  # noqa: E402

PLACEMENTS = (0, 32, 64, 4, 8, 12, 16, 20, 24, 28, 36, 48, 60, 4088, 4080, 4064)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fsdp_restore_bench_align"))
    parser.add_argument("--mb", type=float, default=2048.0)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--restore-mb", type=float, default=1024.0, help="0: skip the restores")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chunk = int(args.chunk_mb * 2**20)
    total = int(args.mb * 2**20) // chunk * chunk
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / "bytes.bin"
    if not path.exists() or path.stat().st_size < total + 8192:
        with open(path, "wb") as f:
            for _ in range(0, total + 8192, 2**26):
                f.write(os.urandom(2**26))
    fd = os.open(path, os.O_RDONLY)
    memory = torch.zeros(total + 8192, dtype=torch.uint8)
    view = memoryview(memory.numpy())
    base = memory.data_ptr()
    pool = ThreadPoolExecutor(args.threads)
    local = threading.local()

    def start_of(placement: int) -> tuple[int, int]:
        """(memory index, file offset) of the first byte for a placement: the file from byte 4096."""
        at = (4096 + placement - base) % 4096
        return at, 4096

    def direct(placement: int) -> None:
        at, offset = start_of(placement)
        list(pool.map(lambda i: os.preadv(fd, [view[at + i:at + i + chunk]], offset + i), range(0, total, chunk)))

    def detour(placement: int) -> None:
        at, offset = start_of(placement)

        def one(i: int) -> None:
            staging = getattr(local, "staging", None)
            if staging is None:
                staging = local.staging = torch.empty(chunk + 8192, dtype=torch.uint8)
            shift = staging_shift(staging.data_ptr(), offset + i)
            os.preadv(fd, [memoryview(staging.numpy())[shift:shift + chunk]], offset + i)
            memory[at + i:at + i + chunk].copy_(staging[shift:shift + chunk])
        list(pool.map(one, range(0, total, chunk)))

    runs = {(p, "direct"): direct for p in PLACEMENTS} | {(p, "detour"): detour for p in PLACEMENTS if aliased(p, 0)}
    os.pread(fd, 1, 0)
    for (placement, _), run in runs.items():
        run(placement)  # warm: the page cache, the buffers
    seconds: dict[tuple[int, str], list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for (placement, how), run in runs.items():
            t0 = time.perf_counter()
            run(placement)
            seconds[(placement, how)].append(time.perf_counter() - t0)
    os.close(fd)
    floor = statistics.median(seconds[(0, "direct")])
    restores = _restores(args.work, args.restore_mb, args.threads, args.rounds) if args.restore_mb else []
    table = Table(title=f"{total / 1e9:.2f} GB from the page cache, {args.threads} threads, {chunk >> 20} MB reads "
                        f"(medians of {args.rounds})")
    for col in ("d = (memory - file) mod 4096", "aliased", "direct s", "x d=0", "detour s", "x d=0 "):
        table.add_column(col)
    results = []
    for placement in PLACEMENTS:
        d = statistics.median(seconds[(placement, "direct")])
        t = statistics.median(seconds[(placement, "detour")]) if (placement, "detour") in seconds else None
        results.append({"placement": placement, "aliased": aliased(placement, 0), "direct_s": d, "detour_s": t})
        table.add_row(str(placement), "yes" if aliased(placement, 0) else "", f"{d:.3f}", f"{floor / d:.2f}",
                      "" if t is None else f"{t:.3f}", "" if t is None else f"{floor / t:.2f}")
    console = Console()
    console.print(table)
    if restores:
        table = Table(title=f"restore_model(check=False) of {args.restore_mb:g} MB, {args.threads} threads, "
                            f"medians of {args.rounds}")
        for col in ("file", "data start mod 4096", "d of its reads", "aliased", "s", "x ours"):
            table.add_column(col)
        ours = restores[0]["median_s"]
        for r in restores:
            table.add_row(r["file"], str(r["data_start"] % 4096), str(r["placement"]),
                          "yes" if aliased(r["placement"], 0) else "", f"{r['median_s']:.3f}",
                          f"{ours / r['median_s']:.2f}")
        console.print(table)
    if args.out:
        args.out.write_text(json.dumps({"bytes": total, "threads": args.threads, "chunk": chunk, "rounds": args.rounds,
                                        "placements": results, "raw": {f"{p}/{h}": v for (p, h), v in seconds.items()},
                                        "restores": restores}, indent=1))


class _Layers(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(layers))


def _with_data_start(src: Path, dst: Path, start: int) -> None:
    """A copy of the safetensors file ``src`` with its header padded with spaces (as the format allows) so that its
    data section starts at ``start`` modulo 4096: where another writer's header length may put it."""
    with open(src, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n).rstrip(b" ")
        header += b" " * ((start - 8 - len(header)) % 4096)
        with open(dst, "wb") as out:
            out.write(len(header).to_bytes(8, "little") + header)
            while block := f.read(2**24):
                out.write(block)


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _restores(work: Path, mb: float, threads: int, rounds: int) -> list[dict]:
    """Restore the same weights from files whose data sections start at different page offsets (see the docstring)."""
    import fsdp_restore
    from safetensors.torch import save_file

    layers = max(1, round(mb * 2**20 / (1024 * 1025 * 4)))
    torch.manual_seed(0)
    weights = _Layers(layers).state_dict()
    model = _Layers(layers)
    placement_of = model.layers[0].weight.data_ptr() % 4096  # where torch put the model's tensors in their page
    files = {"fsdp_restore.save": work / f"ours-{layers}.safetensors"}
    if not files["fsdp_restore.save"].exists():
        fsdp_restore.save(weights, files["fsdp_restore.save"])
    plain = work / f"save_file-{layers}.safetensors"
    if not plain.exists():
        save_file(weights, plain)
    for start in (4096 - 8, 40, 48, 56):  # the data start's page offset: d = placement_of - start
        path = work / f"save_file-{layers}-{start}.safetensors"
        files[f"save_file, data at {start}"] = path
        if not path.exists():
            _with_data_start(plain, path, start)
    from fsdp_restore import execute

    detour = execute._Worker._detour
    runs = [(name, path, True) for name, path in files.items()]
    runs += [(f"{name}, no detour", path, False) for name, path in files.items()
             if aliased(placement_of, _data_start(path))]  # the same file read straight in: the detour's worth

    def restore(path: Path, allow_detour: bool) -> float:
        execute._Worker._detour = detour if allow_detour else lambda *_: False
        try:
            t0 = time.perf_counter()
            fsdp_restore.restore_model(model, path, check=False, thread_count=threads)
            return time.perf_counter() - t0
        finally:
            execute._Worker._detour = detour

    for _, path, allow in runs:
        restore(path, allow)  # warm
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(rounds):
        for name, path, allow in runs:
            seconds[name].append(restore(path, allow))
    out = []
    for name, path, _ in runs:
        data_start = _data_start(path)
        out.append({"file": name, "data_start": data_start, "placement": (placement_of - data_start) % 4096,
                    "median_s": statistics.median(seconds[name]), "seconds": seconds[name]})
    return out


if __name__ == "__main__":
    main()
