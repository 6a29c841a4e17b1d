"""Run a function on N real ranks (separate processes, gloo process group) and collect results.

Processes come from a ``forkserver`` that has already imported torch: each rank starts in well
under a second instead of re-importing torch, and never inherits the test runner's threads.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed.fsdp", "fsdp_restore", "transformers"])
    return _CTX


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store: str, queue: Any, args: tuple) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain bytes: tensors sent as-is travel as shared-memory fds that die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # report every failure to the parent, whatever it is
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns results by rank.

    Raises AssertionError with every failing rank's traceback, or on timeout (a hang is a failure).
    """
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, queue, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, tuple[str, Any]] = {}
        import queue as queue_mod
        import time

        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                try:
                    rank, status, value = queue.get(timeout=1.0)
                    results[rank] = (status, value)
                    continue
                except queue_mod.Empty:
                    pass
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:  # a rank died without reporting (segfault, os._exit): fail now, not at the timeout
                    time.sleep(1.0)
                    while not queue.empty():
                        rank, status, value = queue.get()
                        results[rank] = (status, value)
                    dead = [r for r in dead if r not in results]
                    if dead:
                        raise AssertionError(f"ranks {dead} died with exit codes "
                                             f"{[procs[r].exitcode for r in dead]}; finished: {results}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish"
                                         f" within {timeout}s (hang?); finished: {results}")
        finally:
            for p in procs:
                if p.is_alive() and len(results) < world_size:
                    p.kill()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(errors.items())))
    import torch

    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]
