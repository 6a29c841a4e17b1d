"""Run a read plan: positional reads on a few threads, straight into local memory.

Items are cut into chunks of at most ``READ_CHUNK_BYTES`` and taken in file order, so that one large
tensor (an embedding) is read by every thread at once and the disk sees near-sequential reads.

- CPU memory of the stored dtype is read into directly.
- GPU memory: each worker thread owns a few pinned host buffers, allocated once per call and reused
  (the pool), and a CUDA stream of its own. It reads chunk k+1 into the next buffer while chunk k is
  copied to the device with ``non_blocking=True`` on its stream; an event per buffer says when it may be
  reused, so the host waits only when it is a whole pool ahead. A dtype cast runs on the device after
  the copy (through a device buffer of the pool's size). Worker threads set the destination's device,
  so no thread creates a context on GPU 0 by accident.
- CPU memory of another dtype: a reused per-worker buffer, cast by ``copy_``.

The executor knows nothing of the check: the check poisons and screens the memory on its own
(check.py), so that a bug here cannot hide from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .plan import ReadItem
from .read import Checkpoint

DEFAULT_READ_THREADS = 4
READ_CHUNK_BYTES = 16 * 1024 * 1024  # items above this are split so that several threads share them
PINNED_BUFFERS_PER_THREAD = 3  # reads run up to this many chunks ahead of the host-to-device copies


def read_piece(ckpt: Checkpoint, key: str, src_start: int, dest: torch.Tensor, rows: int = 1, stride: int = 0) -> None:
    """Read into ``dest`` (1-D, contiguous) on the calling thread, wherever it lives, and wait for it
    (a one-off staging buffer when it is not CPU memory of the stored dtype). The executor uses `_Worker`."""
    caller_stream = torch.cuda.current_stream(dest.device) if dest.device.type == "cuda" else None
    worker = _Worker(ckpt, dest.device, after=caller_stream, pinned_buffers=1)
    try:
        worker.read(key, src_start, dest, rows, stride)
    finally:
        worker.finish()


def parts(src_start: int, n: int, rows: int, stride: int, step: int) -> Iterator[tuple[int, int, int, int]]:
    """Cut a read of ``n`` elements (``rows`` runs ``stride`` apart) into parts of at most ``step`` elements
    made of whole runs where runs fit: (first local element, count, stored start, rows)."""
    if rows <= 1:
        for s in range(0, n, step):
            yield s, min(step, n - s), src_start + s, 1
        return
    run = n // rows
    if run > step:
        for i in range(rows):
            for s in range(0, run, step):
                yield i * run + s, min(step, run - s), src_start + i * stride + s, 1
        return
    per = max(1, step // run)
    for i in range(0, rows, per):
        r = min(per, rows - i)
        yield i * run, r * run, src_start + i * stride, r


@dataclass
class _Worker:
    """One read thread's staging: pinned buffers, events and a stream (GPU), or one plain buffer (cast)."""

    ckpt: Checkpoint
    device: torch.device
    after: torch.cuda.Stream | None = None  # the caller's stream: its work (the NaN fill) comes first
    poison: bool = False  # keep staging buffers all-ones bytes (NaN in every float dtype) between uses
    pinned_buffers: int = PINNED_BUFFERS_PER_THREAD
    chunk_bytes: int = READ_CHUNK_BYTES
    host: list[torch.Tensor] = field(default_factory=list)
    on_device: list[torch.Tensor | None] = field(default_factory=list)
    events: list[torch.cuda.Event | None] = field(default_factory=list)
    stream: torch.cuda.Stream | None = None
    ones: torch.Tensor | None = None  # 0xFF bytes on the device: the source that re-poisons a pinned buffer
    turn: int = 0

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            if self.after is not None:  # the check's NaN fill runs there: our copies must land after it
                self.stream.wait_stream(self.after)

    def _slot(self, nbytes: int) -> int:
        """A staging buffer of at least ``nbytes`` that no copy in flight still reads."""
        count = self.pinned_buffers if self.device.type == "cuda" else 1
        if not self.host:
            size = max(nbytes, self.chunk_bytes)
            pin = self.device.type == "cuda"
            self.host = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
            self.on_device = [None] * count
            self.events = [None] * count
            if self.poison:
                for buf in self.host:
                    buf.fill_(0xFF)
        i = self.turn
        self.turn = (i + 1) % count
        event = self.events[i]
        if event is not None:
            event.synchronize()
            self.events[i] = None
        if self.host[i].numel() < nbytes:  # a chunk larger than the pool's buffers (read_piece's one-offs)
            self.host[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self.on_device[i] = None
            if self.poison:
                self.host[i].fill_(0xFF)
        return i

    def read(self, key: str, src_start: int, dest: torch.Tensor, rows: int = 1, stride: int = 0) -> None:
        """Read ``dest.numel()`` elements (``rows`` runs ``stride`` apart) of ``key`` from ``src_start``."""
        entry = self.ckpt.entries[key]
        if dest.device.type == "cpu" and dest.dtype == entry.dtype:
            self.ckpt.read_rows(key, src_start, dest, rows, stride)
            return
        step = max(1, self.chunk_bytes // entry.itemsize)
        for s, m, part_start, part_rows in parts(src_start, dest.numel(), rows, stride, step):
            i = self._slot(m * entry.itemsize)
            raw_bytes = self.host[i][:m * entry.itemsize]
            staged = raw_bytes.view(entry.dtype)
            # With the check on, a staging buffer holds 0xFF bytes (NaN in every float dtype) until the read
            # fills it: a read that writes nothing, or too little, leaves NaN for the check to find, not the
            # previous chunk's bytes. The host re-poisons its own (CPU) buffer; a pinned one is re-poisoned by
            # a device-to-host copy after its upload (the idle direction of the link; no host CPU time).
            self.ckpt.read_rows(key, part_start, staged, part_rows, stride)
            part = dest[s:s + m]
            if self.stream is None:
                part.copy_(staged)
                if self.poison:
                    raw_bytes.fill_(0xFF)
                continue
            with torch.cuda.stream(self.stream):
                if part.dtype == entry.dtype:
                    part.copy_(staged, non_blocking=True)
                else:  # copy as stored, cast on the device
                    buf = self.on_device[i]
                    if buf is None or buf.numel() < self.host[i].numel():
                        buf = self.on_device[i] = torch.empty(self.host[i].numel(), dtype=torch.uint8,
                                                              device=self.device)
                    raw = buf[:m * entry.itemsize].view(entry.dtype)
                    raw.copy_(staged, non_blocking=True)
                    part.copy_(raw)
                if self.poison:
                    if self.ones is None or self.ones.numel() < raw_bytes.numel():
                        self.ones = torch.full((max(raw_bytes.numel(), self.chunk_bytes),), 0xFF, dtype=torch.uint8,
                                               device=self.device)
                    raw_bytes.copy_(self.ones[:raw_bytes.numel()], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                self.events[i] = event

    def finish(self) -> None:
        """Wait for every copy in flight; the caller's stream may then use the memory."""
        if self.stream is not None:
            self.stream.synchronize()


class Chunk(NamedTuple):
    """``count`` elements of ``item.dest`` from ``first``: ``rows`` runs of the item from stored ``src_start``."""

    item: ReadItem
    first: int
    count: int
    src_start: int
    rows: int


def chunked(items: Sequence[ReadItem], ckpt: Checkpoint) -> list[Chunk]:
    """Every item cut into chunks of at most `READ_CHUNK_BYTES` (whole runs of a column block), in file order."""

    def file_position(item: ReadItem) -> tuple[str, int]:
        entry = ckpt.entries[item.key]
        return str(entry.file), entry.offset + item.src_start * entry.itemsize

    chunks: list[Chunk] = []
    for item in sorted(items, key=file_position):
        step = max(1, READ_CHUNK_BYTES // max(1, ckpt.entries[item.key].itemsize))
        chunks.extend(Chunk(item, *part) for part in parts(item.src_start, item.dest.numel(), item.rows, item.stride, step))
    return chunks


def execute_reads(ckpt: Checkpoint, items: Sequence[ReadItem], threads: int = DEFAULT_READ_THREADS, *,
                  before: Callable[[torch.Tensor], None] | None = None,
                  after: Callable[[torch.Tensor], None] | None = None, poison_staging: bool = False) -> None:
    """Run every read of ``items`` on ``threads`` threads; positional reads release the GIL, so reads
    overlap each other and the copies into device memory. Marks each item done once all its
    chunks were read; the first failed read raises. ``before`` / ``after`` are called with each
    chunk's destination on the thread that reads it, just before and right after the read (the
    check's ledger: host memory only, where the read is complete when it returns). ``poison_staging``:
    keep staging buffers NaN between uses (the check is on), so that no stale bytes can pass for a read."""
    chunks = chunked(items, ckpt)
    if not chunks:
        return
    devices = {chunk.item.dest.device for chunk in chunks}
    device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
    cuda = device.type == "cuda"
    caller_stream = torch.cuda.current_stream(device) if cuda else None
    local = threading.local()
    workers: list[_Worker] = []
    lock = threading.Lock()

    def worker() -> _Worker:
        w = getattr(local, "worker", None)
        if w is None:
            w = local.worker = _Worker(ckpt, device, after=caller_stream, poison=poison_staging)
            with lock:
                workers.append(w)
        return w

    def read(chunk: Chunk) -> None:
        item = chunk.item
        dest = item.dest[chunk.first:chunk.first + chunk.count]
        if before is not None:
            before(dest)
        if dest.device != device:  # items on several devices (rare): one-off staging on this thread
            read_piece(ckpt, item.key, chunk.src_start, dest, chunk.rows, item.stride)
        else:
            worker().read(item.key, chunk.src_start, dest, chunk.rows, item.stride)
        if after is not None:
            after(dest)

    # Long-lived workers that take the next chunk in file order: no future per chunk (a model of thousands
    # of small tensors paid more in thread hand-offs than in reads).
    next_chunk = iter(chunks)
    failed: list[BaseException] = []

    def work(own_thread: bool = True) -> None:
        if own_thread:
            torch.set_grad_enabled(False)
            if cuda:  # each thread works on the destination's device (not a context on GPU 0 by default)
                torch.cuda.set_device(device)
        try:
            while not failed:
                with lock:
                    chunk = next(next_chunk, None)
                if chunk is None:
                    return
                read(chunk)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
            failed.append(e)

    try:
        if threads <= 1 or len(chunks) <= 1:
            with torch.no_grad():
                work(own_thread=False)
        else:
            pool = [threading.Thread(target=work, name=f"fsdp_restore-read-{i}", daemon=True)
                    for i in range(min(threads, len(chunks)))]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
    finally:
        for w in workers:
            w.finish()
    if failed:
        raise failed[0]
    for item in items:  # reached only when every chunk was read (a failed read raised above)
        item.done = True
