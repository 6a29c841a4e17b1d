"""What each way of getting host bytes onto a GPU costs on this machine, measured in one process (needs a GPU):

    python scripts/gpu_staging.py [--out staging.json] [--gds FILE]

- pin: allocating pinned memory (torch's pinned allocator, `cudaHostAlloc`) of 4-256 MB, alone and as 16 MB
  buffers pinned by 1-16 threads at once (does the driver pin in parallel?);
- register: the same bytes as pageable memory, first touched (page faults), then `cudaHostRegister`-ed;
- h2d: 1 GB in 16 MB copies from pinned, registered and pageable (already touched) memory, on 1-8 threads,
  each with its own stream (a pageable copy goes through the driver's own staging); and whether torch's
  ``is_pinned`` sees registered memory as pinned;
- gds (``--gds FILE``): `torch.cuda.gds.GdsFile` reading the file's first GB into device memory.
Run by ``scripts/gpu_checks.sh staging``; the numbers go to BENCHMARKS.md ("GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch

MB = 2**20


def _timed_threads(n: int, fn) -> float:  # noqa: ANN001 - fn(i) runs on thread i; wall seconds of all
    start = threading.Barrier(n + 1)

    def run(i: int) -> None:
        torch.cuda.set_device(0)
        start.wait()
        fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pin(results: dict) -> None:
    for mb in (4, 16, 64, 256):
        torch._C._host_emptyCache()
        t0 = time.perf_counter()
        b = torch.empty(mb * MB, dtype=torch.uint8, pin_memory=True)
        s = time.perf_counter() - t0
        del b
        results[f"pin_{mb}MB_gbps"] = mb * MB / s / 1e9
    for n in (1, 2, 4, 8, 16):
        torch._C._host_emptyCache()
        held: list[torch.Tensor] = []
        s = _timed_threads(n, lambda i: held.append(torch.empty(16 * MB, dtype=torch.uint8, pin_memory=True)))
        results[f"pin_16MB_x{n}_threads_s"] = s
        results[f"pin_16MB_x{n}_threads_gbps"] = n * 16 * MB / s / 1e9
        held.clear()
    torch._C._host_emptyCache()


def register(results: dict) -> None:
    cudart = torch.cuda.cudart()
    for mb in (16, 256):
        b = torch.empty(mb * MB, dtype=torch.uint8)
        t0 = time.perf_counter()
        b.fill_(0xFF)  # page faults: what a first use of pageable memory costs
        t1 = time.perf_counter()
        err = cudart.cudaHostRegister(b.data_ptr(), b.numel(), 0)
        t2 = time.perf_counter()
        results[f"touch_{mb}MB_gbps"] = mb * MB / (t1 - t0) / 1e9
        results[f"register_{mb}MB_gbps"] = mb * MB / (t2 - t1) / 1e9 if int(err) == 0 else f"error {err}"
        if int(err) == 0:
            cudart.cudaHostUnregister(b.data_ptr())


def h2d(results: dict) -> None:
    total, step = 1024 * MB, 16 * MB
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    cudart = torch.cuda.cudart()
    for kind in ("pinned", "registered", "pageable"):
        for n in (1, 2, 4, 8):
            bufs = [torch.full((step,), 1, dtype=torch.uint8, pin_memory=kind == "pinned") for _ in range(n)]
            if kind == "registered":
                for b in bufs:
                    assert int(cudart.cudaHostRegister(b.data_ptr(), b.numel(), 0)) == 0, "cudaHostRegister failed"
                results["registered_is_pinned"] = bufs[0].is_pinned()
            streams = [torch.cuda.Stream() for _ in range(n)]

            def copy(i: int) -> None:
                with torch.cuda.stream(streams[i]):
                    for off in range(i * step, total, n * step):
                        dst[off:off + step].copy_(bufs[i], non_blocking=True)
                streams[i].synchronize()

            _timed_threads(n, copy)  # warm-up
            results[f"h2d_{kind}_x{n}_threads_gbps"] = total / _timed_threads(n, copy) / 1e9
            if kind == "registered":
                for b in bufs:
                    cudart.cudaHostUnregister(b.data_ptr())


def gds(results: dict, path: str) -> None:
    from torch.cuda.gds import GdsFile

    nbytes = min(1024 * MB, os.path.getsize(path) // MB * MB)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    f = GdsFile(path, os.O_RDONLY)
    f.load_storage(dst.untyped_storage(), offset=0)  # warm-up (and the page cache)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f.load_storage(dst.untyped_storage(), offset=0)
    torch.cuda.synchronize()
    results["gds_1GB_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
    with open(path, "rb") as src:
        first = torch.frombuffer(bytearray(src.read(MB)), dtype=torch.uint8)
    results["gds_bytes_match"] = bool(torch.equal(dst[:MB].cpu(), first))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--gds", help="a file of at least 1 MB: also time GPUDirect Storage reads of it")
    args = parser.parse_args()
    torch.empty(1, device="cuda")
    torch.empty(1, pin_memory=True)
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    steps = [("gds", lambda r: gds(r, args.gds))] if args.gds else [("pin", pin), ("register", register), ("h2d", h2d)]
    for name, fn in steps:
        try:
            fn(results)
        except Exception as e:  # noqa: BLE001 - a way that fails here is a finding, not the end of the run
            results[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
        print(json.dumps(results, indent=1), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
