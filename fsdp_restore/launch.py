"""Run a function on N local ranks (separate processes, a real process group) and collect results.

Used by ``fsdp-restore check-restore`` and by the test suite. Processes come from a ``forkserver``
that has already imported torch, so each rank starts in well under a second and never inherits the
caller's threads. Ranks use NCCL on their own GPU when there are enough GPUs, else gloo on CPU.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX: Any = None
PRELOAD = ["torch", "torch.distributed.fsdp", "fsdp_restore"]
DEAD_RANK_GRACE_S = 3.0  # after a rank dies, how long the others get to report before they are stopped


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def pick_backend(world_size: int) -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store: str, backend: str, queue: Any,
            args: tuple, pg_timeout: float | None) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import faulthandler

    faulthandler.enable()  # a rank that crashes (SIGSEGV, SIGABRT) prints where, on stderr
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        import datetime

        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=pg_timeout)} if pg_timeout else {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            # bound to its GPU at init: NCCL's communicator is made now, on this device, and barrier() knows
            # which device to use instead of guessing (torch warns, and a wrong guess hangs)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size, **kwargs)
        result = fn(rank, world_size, *args)
        # Plain bytes: tensors sent as-is travel as shared-memory fds that die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # every failure goes back to the parent, whatever it is
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankFailure(RuntimeError):
    """One or more ranks raised, died or hung; ``errors`` maps rank -> message with traceback."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(errors.items())))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180,
              backend: str | None = None, pg_timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns results by rank.

    ``fn`` must be importable (module level). Raises `RankFailure` with every failing rank's
    traceback, when a rank dies without reporting, or on timeout (a hang is a failure).
    ``pg_timeout``: the process group's collective timeout in seconds (torch's default if None).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, not {world_size!r}: no rank would run")
    import torch

    ctx = _context()
    backend = backend or pick_backend(world_size)
    results: dict[int, tuple[str, Any]] = {}
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, backend, q, args, pg_timeout), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        died_at: float | None = None
        try:
            while len(results) < world_size:
                try:
                    rank, status, value = q.get(timeout=1.0)
                    results[rank] = (status, value)
                    continue
                except queue_mod.Empty:
                    pass
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                for r in dead:  # died without reporting (segfault, os._exit, OOM kill)
                    results[r] = ("error", f"died with exit code {procs[r].exitcode} without reporting")
                    died_at = died_at or time.monotonic()
                # Survivors in a gloo collective fail at once (the dead rank's sockets close) and report;
                # under NCCL, or blocked outside a collective, they would wait until their process-group
                # timeout: give them a moment to report anything they have, then stop them.
                if died_at is not None and time.monotonic() - died_at > DEAD_RANK_GRACE_S:
                    first = min(r for r, (s, v) in results.items() if s == "error" and "without reporting" in v)
                    for r in range(world_size):
                        results.setdefault(r, ("error", f"stopped: rank {first} died, so this rank could not finish"))
                if time.monotonic() > deadline:
                    for r in range(world_size):
                        results.setdefault(r, ("error", f"did not finish within {timeout}s (hang?)"))
        finally:
            for p in procs:
                if p.is_alive() and any(s == "error" for s, _ in results.values()):
                    p.kill()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise RankFailure(errors)
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]
