"""What a same-dtype conversion of many small tensors costs with no torch at all: a lower bound, not a converter.

    python scripts/convert_floor.py                 # the small case of benchmark_convert.py, 5 interleaved triples
    python scripts/convert_floor.py --pairs 3 --gb 1

Three whole processes, run in turns, the source's pages dropped before each (the method of
`scripts/benchmark_convert.py`): ``floor``: this file run as ``--floor SRC DST``, which does only what any
conversion of a ``torch.save`` file must do, in plain Python with no torch imported: run the pickle through Python's
pure-Python unpickler with every global an inert stand-in (the cheapest unpickler that executes nothing and has no
C-level exposure), find each storage record's data in the zip (one local-header ``pread`` per record), lay out a
header, and copy every tensor's bytes into 32 MB ``O_DIRECT`` blocks on 4 threads with a crc32 of each piece and
an ``fsync``, while a thread reads the source ahead; ``ours``: ``fsdp-restore convert``; ``cp+sync``. The floor's
output is not a usable file (no structure, placeholder metadata) and it checks nothing a converter must check
(torch's refusals, record bounds, names): every real conversion costs at least this.
"""

from __future__ import annotations

import argparse
import io
import json
import mmap
import os
import pickle
import statistics
import struct
import sys
import threading
import time
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BLOCK = 32 * 2**20
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_ITEMSIZE = {"torch.FloatStorage": 4, "torch.DoubleStorage": 8, "torch.HalfStorage": 2, "torch.BFloat16Storage": 2,
             "torch.LongStorage": 8, "torch.IntStorage": 4, "torch.ByteStorage": 1, "torch.BoolStorage": 1}


class _Global:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any) -> tuple[str, tuple[Any, ...]]:
        return self.name, args


class _InertUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # the pure-Python one: no C exposure
    def find_class(self, module: str, name: str) -> _Global:
        return _Global(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[str, str, str]:
        return "storage", pid[2], pid[1].name


def floor(src: str, dst: str) -> None:
    """The floor's conversion of ``src`` into ``dst`` (see the module's docstring)."""
    def read_ahead() -> None:
        fd, buf = os.open(src, os.O_RDONLY), bytearray(8 * 2**20)
        at, view = 0, memoryview(buf)
        while (n := os.preadv(fd, [view], at)) > 0:
            at += n

    threading.Thread(target=read_ahead, daemon=True).start()
    t0 = time.perf_counter()
    archive = zipfile.ZipFile(src)
    infos = {i.filename: i for i in archive.infolist()}
    pickle_name = next(n for n in infos if n.endswith("data.pkl"))
    prefix = pickle_name[:-len("data.pkl")]
    obj = _InertUnpickler(io.BytesIO(archive.read(pickle_name))).load()
    t1 = time.perf_counter()
    fd = os.open(src, os.O_RDONLY)

    def data_at(record: str) -> int:
        info = infos[prefix + record]
        fields = _LOCAL_HEADER.unpack(os.pread(fd, _LOCAL_HEADER.size, info.header_offset))
        return info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]

    tensors: list[tuple[str, int, int, list[int]]] = []  # key, source offset, bytes, shape
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            stack += [(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{path}.{i}") for i, v in enumerate(node)]
        elif isinstance(node, tuple) and len(node) == 2 and node[0] == "torch._utils._rebuild_tensor_v2":
            storage, offset, shape = node[1][:3]
            size = _ITEMSIZE[storage[2]]
            tensors.append((path, data_at(f"data/{storage[1]}") + offset * size, size * _prod(shape), list(shape)))
    entries, at = {}, 0
    for key, _, nbytes, shape in tensors:
        entries[key] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    header = json.dumps({"__metadata__": {"floor": "not a usable file"}, **entries}).encode()
    header += b" " * (-(len(header) + 8) % 8)
    start = 8 + len(header)
    size = start + at
    pieces: dict[int, list[tuple[int, int, int]]] = {}  # block -> (source offset, at in the file, bytes)
    at = start
    for _, offset, nbytes, _ in tensors:
        end, first = at + nbytes, at
        while at < end:
            stop = min(end, (at // BLOCK + 1) * BLOCK)
            pieces.setdefault(at // BLOCK, []).append((offset + at - first, at, stop - at))
            at = stop
    t2 = time.perf_counter()
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    local = threading.local()

    def write_block(index: int) -> None:
        if getattr(local, "memory", None) is None:
            local.memory = mmap.mmap(-1, BLOCK)
        memory, base = local.memory, index * BLOCK
        view = memoryview(memory)
        if index == 0:
            memory[:start] = struct.pack("<Q", len(header)) + header
        for offset, at, nbytes in pieces.get(index, []):
            os.preadv(fd, [view[at - base:at - base + nbytes]], offset)
            zlib.crc32(view[at - base:at - base + nbytes])
        os.pwrite(out, view[:-(-min(BLOCK, size - base) // 4096) * 4096], base)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write_block, range(-(-size // BLOCK))))
    os.ftruncate(out, size)
    os.fsync(out)
    os.close(out)
    t3 = time.perf_counter()
    print(json.dumps({"unpickle": t1 - t0, "locate_and_lay_out": t2 - t1, "copy_crc_write_fsync": t3 - t2,
                      "tensors": len(tensors)}), file=sys.stderr)


def _prod(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--floor", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fsdp_restore_bench_floor"))
    parser.add_argument("--gb", type=float, default=1.0, help="size of the small case")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.floor:
        floor(*args.floor)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchmark_convert import CLI, _remove, evict, make_case, run

    args.work.mkdir(parents=True, exist_ok=True)
    src = args.work / "small.pt"
    if not src.exists():
        make_case(src, "small", args.gb)
    commands = {"floor": [sys.executable, __file__, "--floor", str(src), str(args.work / "floor.out")],
                "ours": CLI + ["convert", str(src), str(args.work / "ours.safetensors"), "--force"],
                "cp+sync": ["sh", "-c", f"cp '{src}' '{args.work / 'copy.out'}' && sync"]}
    outputs = [args.work / n for n in ("floor.out", "ours.safetensors", "copy.out")]
    rows = []
    for _ in range(args.pairs):
        row = {}
        for (name, cmd), dst in zip(commands.items(), outputs):
            _remove(dst)
            evict(src, "source")
            row[name] = run(cmd)
            _remove(dst)
        rows.append(row)
        print("  ".join(f"{n} {row[n]['wall']:.2f} s" for n in commands), flush=True)
    summary = {n: statistics.median(r[n]["wall"] for r in rows) for n in commands}
    ratios = {n: statistics.median(r[n]["wall"] / r["cp+sync"]["wall"] for r in rows) for n in ("floor", "ours")}
    print(json.dumps({"median_wall": summary, "median_ratio_to_cp_sync": ratios}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"source_bytes": src.stat().st_size, "rows": rows, "median_wall": summary,
                                        "median_ratio_to_cp_sync": ratios}, indent=1))


if __name__ == "__main__":
    main()
