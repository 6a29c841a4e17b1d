"""One page-locked host region for a GPU restore's staging buffers, made while the restore is planned.

torch's pinned allocator pins each buffer with its own ``cudaHostAlloc``, which on the machines we measured
moved 2-3 GB/s and ran one call at a time whatever the number of threads: a restore's first reads waited for
it (BENCHMARKS.md, "GPU"). Here the whole pool is ordinary memory, touched once (filled with 0xFF bytes, NaN in
every float dtype: the check's poison) and registered with one ``cudaHostRegister`` call, several times faster
per byte there; and it is made on a thread of its own that starts before the restore's plan, which needs the
GIL while this needs none. The read threads take their staging buffers from it (`take`); the restore gives it
back (`close`) once every copy from it is done. Where registering fails, `take` gives nothing and the read
threads pin their buffers with torch's allocator as before.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

PAGE_BYTES = 4096

_never_freed: list[torch.Tensor] = []  # regions whose unregistering failed: freeing them would free pinned pages


class PinnedPool:
    """``slots`` buffers of ``slot_bytes`` each, in one registered region; made on a thread of its own (`start`)."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int):
        self.device = device
        self.slot_bytes = slot_bytes
        self._slots = slots
        self._made: Future[list[torch.Tensor]] = Future()
        self._memory: torch.Tensor | None = None
        self._registered = 0  # the registered region's address (0: none)
        self._free: list[torch.Tensor] | None = None
        self._lock = threading.Lock()

    @classmethod
    def start(cls, device: torch.device, slots: int, slot_bytes: int) -> PinnedPool:
        """A pool whose memory is made on a new thread while the caller goes on."""
        pool = cls(device, slots, slot_bytes)
        threading.Thread(target=pool._make, name="fsdp_restore-pinned", daemon=True).start()
        return pool

    def _make(self) -> None:
        try:
            size = self._slots * self.slot_bytes
            memory = torch.empty(size + PAGE_BYTES, dtype=torch.uint8)
            start = -memory.data_ptr() % PAGE_BYTES  # whole pages: what the driver locks
            region = memory[start:start + size]
            region.fill_(0xFF)  # every page touched before it is locked, and NaN until a read fills it
            with torch.cuda.device(self.device):
                error = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), size, 0)
            if int(error) != 0:
                self._made.set_result([])
                return
            self._memory, self._registered = memory, region.data_ptr()
            self._made.set_result(list(region.split(self.slot_bytes)))
        except BaseException as e:  # noqa: BLE001 - the read threads then pin their own buffers
            self._made.set_result([])
            if not isinstance(e, Exception):
                raise

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A free buffer of at least ``nbytes`` (all 0xFF bytes), waiting for the pool to be made; None when the
        pool has none (all taken, too small, or registering failed)."""
        if nbytes > self.slot_bytes:
            return None
        with self._lock:
            if self._free is None:
                self._free = self._made.result()
            return self._free.pop() if self._free else None

    def close(self) -> None:
        """Give the region back, once every copy from it is done (a whole-device synchronize: callers have
        waited for their streams already, so this waits for nothing in the common case)."""
        self._made.result()  # a pool still being made is finished first: its thread must not register later
        if not self._registered:
            return
        ptr, self._registered = self._registered, 0
        memory, self._memory, self._free = self._memory, None, []
        torch.cuda.synchronize(self.device)
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _never_freed.append(memory)  # type: ignore[arg-type]
