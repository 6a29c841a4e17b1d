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

import functools
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from .format import TensorEntry
from .plan import ReadItem
from .read import Checkpoint
from .write import cast_overflow, narrowing, overflow_count, overflow_listing

DEFAULT_READ_THREADS = 4  # past 4, more threads read no faster on the GPU path (BENCHMARKS.md, "GPU")
READ_CHUNK_BYTES = 16 * 1024 * 1024  # items above this are split so that several threads share them
GROUP_MAX_PARTS = 512  # small chunks stored back to back are read together, up to READ_CHUNK_BYTES
PINNED_BUFFERS_PER_THREAD = 3  # reads run up to this many chunks ahead of the host-to-device copies
CACHE_CHUNK_FALLBACK_BYTES = 4 * 1024 * 1024  # `cache_chunk_bytes` where the machine does not say its cache size
MIN_CHUNK_BYTES = 1024 * 1024  # below this, Python per chunk costs more than the cache saves (BENCHMARKS.md)
PAGE_BYTES = 4096
ALIGN_SLACK = PAGE_BYTES  # spare bytes per staging buffer, to place a read at the source's page offset
PINNED_ALIGNMENT = 64  # a read into pinned memory starts on a cache line, as the copy engine saw it before placement
ALIASED_MIN_BYTES = 256 * 1024  # a smaller read costs more in the detour through staging than it saves


def aliased(dest_ptr: int, file_offset: int) -> bool:
    """Whether the kernel's copy of file bytes at ``file_offset`` into memory at ``dest_ptr`` falls in the band
    where the destination lies 1-31 bytes after the source modulo the page (4K aliasing): such a copy is several
    times slower than a page-aligned one, and a detour through a staging buffer placed like the source plus one
    copy in memory beats it. Other placements cost far less than the detour would, and are read directly
    (BENCHMARKS.md, "Where the memory lies")."""
    return 0 < (dest_ptr - file_offset) % PAGE_BYTES < 32


def staging_shift(buffer_ptr: int, file_offset: int, alignment: int = 1) -> int:
    """Where in a staging buffer to put a read of file bytes from ``file_offset`` so that the kernel copies them
    to the same offset within a page as they have in the file (the fastest placement); rounded down to a multiple
    of ``alignment`` (at least the itemsize, so that the bytes can be viewed as their dtype): a placement a few
    bytes before the source's, never in the aliased band after it."""
    shift = (file_offset - buffer_ptr) % PAGE_BYTES
    return shift - shift % max(1, alignment)


def _read_bytes(device: torch.device, chunk_bytes: int) -> int:
    """The most one read may take for a staging buffer of ``chunk_bytes`` on ``device``: pinned buffers are kept at
    the chunk size (torch's pinned allocator rounds a request up to a power of two), so a read leaves them the
    placement slack; host buffers are allocated with the slack added."""
    return max(chunk_bytes // 2, chunk_bytes - ALIGN_SLACK) if device.type == "cuda" else chunk_bytes


def cache_chunk_bytes(threads: int) -> int:
    """A chunk size for reads whose destinations are also filled and screened on the read thread (the check's
    ledger): every thread's chunk twice over fits the last-level cache, so that the fill, the read and the sum
    of a chunk meet it there rather than in DRAM (measured: BENCHMARKS.md); at most `READ_CHUNK_BYTES`."""
    cache = last_level_cache_bytes()
    if cache <= 0:
        return CACHE_CHUNK_FALLBACK_BYTES
    return max(MIN_CHUNK_BYTES, min(READ_CHUNK_BYTES, cache // (2 * max(1, threads))))


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of CPU 0's largest (last-level) data or unified cache, from Linux's sysfs; 0 where unknown."""
    best = (0, 0)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
            size = int(text.rstrip("KMG")) * scale
        except (OSError, ValueError):
            continue
        best = max(best, (level, size))
    return best[1]


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def start_readers(threads: int, work: Callable[[], None], count: int) -> list[Future[None]]:
    """``count`` runs of ``work`` on the process's read threads, started once and kept: starting 4 threads on every
    restore cost more than planning it on a busy machine (BENCHMARKS.md). Grown when more threads are asked for;
    started again in a forked child (threads do not survive a fork, and a pool that thinks they did never runs).
    Submitted under the lock that grows the pool: a restore on another thread growing it meanwhile shuts the old
    pool down, which then refuses new work."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < threads:
            old, _pool_size = _pool, max(threads, DEFAULT_READ_THREADS)
            _pool = ThreadPoolExecutor(max_workers=_pool_size, thread_name_prefix="fsdp_restore-read")
            if old is not None:
                old.shutdown(wait=False)  # (what was submitted to it still runs)
        return [_pool.submit(work) for _ in range(count)]


def _forget_pool_after_fork() -> None:
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def read_piece(ckpt: Checkpoint, key: str, src_start: int, dest: torch.Tensor, rows: int = 1, stride: int = 0) -> int:
    """Read into ``dest`` (1-D, contiguous) on the calling thread, wherever it lives, and wait for it
    (a one-off staging buffer when it is not CPU memory of the stored dtype). Returns how many finite values
    a cast into ``dest``'s dtype made inf or NaN (`cast_overflow`). The executor uses `_Worker`."""
    caller_stream = torch.cuda.current_stream(dest.device) if dest.device.type == "cuda" else None
    worker = _Worker(ckpt, dest.device, after=caller_stream, pinned_buffers=1,
                     chunk_bytes=_read_bytes(dest.device, READ_CHUNK_BYTES))
    try:
        worker.read(key, src_start, dest, rows, stride)
    finally:
        worker.finish()
    return worker.overflowed[key]


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
    chunk_bytes: int = READ_CHUNK_BYTES  # the most one read takes; each staging buffer has `ALIGN_SLACK` more
    host: list[torch.Tensor] = field(default_factory=list)
    on_device: list[torch.Tensor | None] = field(default_factory=list)
    events: list[torch.cuda.Event | None] = field(default_factory=list)
    stream: torch.cuda.Stream | None = None
    ones: torch.Tensor | None = None  # 0xFF bytes on the device: the source that re-poisons a pinned buffer
    turn: int = 0
    overflowed: Counter[str] = field(default_factory=Counter)  # per stored key: finite values a cast made inf/NaN
    # (GPU) the same, per cast still on the device: counted there, read once the stream is done (`finish`)
    device_overflows: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            if self.after is not None:  # the check's NaN fill runs there: our copies must land after it
                self.stream.wait_stream(self.after)

    def _slot(self, nbytes: int) -> int:
        """A staging buffer of at least ``nbytes`` that no copy in flight still reads. Pinned buffers are
        allocated one at a time, another only when every one so far is still being uploaded (up to
        ``pinned_buffers``): pinning host memory costs time in proportion to its size, and an upload is
        usually done long before the next read is (BENCHMARKS.md, "GPU")."""
        cuda = self.device.type == "cuda"
        if not self.host:
            self._add_buffer(0, nbytes)
        i = self.turn  # the buffer used longest ago
        event = self.events[i]
        if event is not None and cuda and len(self.host) < self.pinned_buffers and not event.query():
            self._add_buffer(i, nbytes)  # the new buffer takes its turn: the oldest stays next in line
            event = None
        self.turn = (i + 1) % len(self.host)
        if event is not None:
            event.synchronize()
            self.events[i] = None
        if self.host[i].numel() < nbytes + ALIGN_SLACK:  # a read larger than the chunk size (not from the executor)
            self.host[i] = self._buffer(nbytes)
            self.on_device[i] = None
        return i

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A staging buffer for reads of up to ``max(nbytes, chunk_bytes)`` bytes, placed anywhere within it
        (`ALIGN_SLACK`); pinned for a GPU; all 0xFF (NaN) with the check on."""
        size = max(nbytes, self.chunk_bytes) + ALIGN_SLACK
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        if self.poison:
            buf.fill_(0xFF)
        return buf

    def _add_buffer(self, at: int, nbytes: int) -> None:
        self.host.insert(at, self._buffer(nbytes))
        self.on_device.insert(at, None)
        self.events.insert(at, None)

    def read(self, key: str, src_start: int, dest: torch.Tensor, rows: int = 1, stride: int = 0) -> None:
        """Read ``dest.numel()`` elements (``rows`` runs ``stride`` apart) of ``key`` from ``src_start``."""
        entry = self.ckpt.entries[key]
        if dest.device.type == "cpu" and dest.dtype == entry.dtype and not (
                rows <= 1 and self._detour(dest.numel() * entry.itemsize, dest.data_ptr(),
                                           entry.offset + src_start * entry.itemsize)):
            self.ckpt.read_rows(key, src_start, dest, rows, stride)
            return
        step = max(1, self.chunk_bytes // entry.itemsize)
        for s, m, part_start, part_rows in parts(src_start, dest.numel(), rows, stride, step):
            self._staged([(key, part_start, dest[s:s + m], part_rows, stride)])

    def read_group(self, group: Sequence[Chunk], dests: Sequence[torch.Tensor]) -> None:
        """Read chunks that lie back to back in one file (see `grouped`) into their ``dests`` (`Chunk.dest`) with
        one positional read: straight into CPU memory of the stored dtype, else into one staging buffer, then
        copied (and cast) per chunk."""
        if len(group) == 1:
            c = group[0]
            self.read(c.item.key, c.src_start, dests[0], c.rows, c.item.stride)
            return
        if not all(d.is_cpu and d.dtype == c.entry.dtype for c, d in zip(group, dests)):
            self._staged([(c.item.key, c.src_start, d, 1, 0) for c, d in zip(group, dests)])
            return
        # straight into memory, but an aliased part (see `aliased`) through staging: runs of the others in one read
        run: list[tuple[str, int, torch.Tensor]] = []
        for c, dest in zip(group, dests):
            if self._detour(c.count * c.entry.itemsize, dest.data_ptr(), c.offset):
                if run:
                    self.ckpt.read_contiguous(run)
                    run = []
                self._staged([(c.item.key, c.src_start, dest, 1, 0)])
            else:
                run.append((c.item.key, c.src_start, dest))
        if run:
            self.ckpt.read_contiguous(run)

    def direct(self, group: Sequence[Chunk],
               dests: Sequence[torch.Tensor]) -> list[tuple[str, int, torch.Tensor]] | None:
        """``group``'s reads as `read_group` would make them in one `Checkpoint.read_contiguous` (``(key, first
        element, dest)``, straight into CPU memory of the stored dtype, none aliased), or None where it would not."""
        parts = []
        for c, dest in zip(group, dests):
            if (c.rows > 1 or not dest.is_cpu or dest.dtype != c.entry.dtype
                    or self._detour(c.count * c.entry.itemsize, dest.data_ptr(), c.offset)):
                return None
            parts.append((c.item.key, c.src_start, dest))
        return parts

    def _detour(self, nbytes: int, dest_ptr: int, file_offset: int) -> bool:
        """Whether a direct read of ``nbytes`` into memory at ``dest_ptr`` would be an aliased copy worth the detour
        through staging (which also needs room: a chunk of at most the staging size)."""
        return ALIASED_MIN_BYTES <= nbytes <= self.chunk_bytes and aliased(dest_ptr, file_offset)

    def _staged(self, reads: Sequence[tuple[str, int, torch.Tensor, int, int]]) -> None:
        """Reads ``(key, stored start, dest, rows, stride)`` through one staging buffer: one read (a column
        block), or several back to back in one file; then copied into each ``dest`` (cast on the device)."""
        entries = [self.ckpt.entries[key] for key, *_ in reads]
        sizes = [dest.numel() * e.itemsize for (_, _, dest, _, _), e in zip(reads, entries)]
        i = self._slot(sum(sizes))
        first_start = reads[0][1]
        shift = staging_shift(self.host[i].data_ptr(), entries[0].offset + first_start * entries[0].itemsize,
                              PINNED_ALIGNMENT if self.stream is not None else max(e.itemsize for e in entries))
        raw_bytes = self.host[i][shift:shift + sum(sizes)]
        staged, at = [], 0
        for size, e in zip(sizes, entries):
            staged.append(raw_bytes[at:at + size].view(e.dtype))
            at += size
        # With the check on, a staging buffer holds 0xFF bytes (NaN in every float dtype) until the read
        # fills it: a read that writes nothing, or too little, leaves NaN for the check to find, not the
        # previous chunk's bytes. The host re-poisons its own (CPU) buffer; a pinned one is re-poisoned by
        # a device-to-host copy after its upload (the idle direction of the link; no host CPU time).
        if len(reads) == 1:
            key, start, _, rows, stride = reads[0]
            self.ckpt.read_rows(key, start, staged[0], rows, stride)
        else:
            self.ckpt.read_contiguous([(key, start, v) for (key, start, *_), v in zip(reads, staged)])
        dests = [dest for _, _, dest, _, _ in reads]
        if self.stream is None:
            for (key, *_), d, v in zip(reads, dests, staged):
                d.copy_(v)
                if n := cast_overflow(v.dtype, d, lambda: v):
                    self.overflowed[key] += n
            if self.poison:
                raw_bytes.fill_(0xFF)
            return
        with torch.cuda.stream(self.stream):
            if all(d.dtype == e.dtype for d, e in zip(dests, entries)):
                if len(dests) == 1:
                    dests[0].copy_(staged[0], non_blocking=True)
                else:  # one call for the group: Python per copy held the GIL that the other readers wait for
                    torch._foreach_copy_(dests, staged, non_blocking=True)
            else:  # to the device as stored in one copy, then cast there
                buf = self.on_device[i]
                if buf is None or buf.numel() < self.host[i].numel():
                    buf = self.on_device[i] = torch.empty(self.host[i].numel(), dtype=torch.uint8, device=self.device)
                buf[:raw_bytes.numel()].copy_(raw_bytes, non_blocking=True)
                at = 0
                for (key, *_), d, size, e in zip(reads, dests, sizes, entries):
                    stored = buf[at:at + size].view(e.dtype)
                    d.copy_(stored)
                    # as on the CPU (`cast_overflow`), without waiting for the device; its masks are transient
                    # device memory of a few bytes per element of the chunk (at most a chunk's, per read thread)
                    if narrowing(e.dtype, d.dtype):
                        self.device_overflows.append((key, overflow_count(stored, d)))
                    at += size
            self._repoison_and_record(i, raw_bytes)

    def _repoison_and_record(self, i: int, raw_bytes: torch.Tensor) -> None:
        """(On the worker's stream) make pinned buffer ``i`` NaN again once its upload is done, and record
        the event that says when the host may reuse it."""
        if self.poison:
            if self.ones is None or self.ones.numel() < raw_bytes.numel():
                self.ones = torch.full((max(raw_bytes.numel(), self.chunk_bytes),), 0xFF, dtype=torch.uint8,
                                       device=self.device)
            raw_bytes.copy_(self.ones[:raw_bytes.numel()], non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events[i] = event

    def finish(self) -> None:
        """Wait for every copy in flight; the caller's stream may then use the memory. The casts' overflow
        counts made on the device are read now, in one transfer."""
        if self.stream is not None:
            self.stream.synchronize()
        if self.device_overflows:
            keys = [key for key, _ in self.device_overflows]
            counts = torch.stack([n for _, n in self.device_overflows]).tolist()
            self.device_overflows = []
            for key, n in zip(keys, counts):
                if n:
                    self.overflowed[key] += n


class Chunk(NamedTuple):
    """``count`` elements of ``item.dest`` from ``first``: ``rows`` runs of the item from stored ``src_start``, the
    first at byte ``offset`` of ``entry.file`` (both looked up once, when the chunk is made)."""

    item: ReadItem
    first: int
    count: int
    src_start: int
    rows: int
    entry: TensorEntry
    offset: int

    def dest(self) -> torch.Tensor:
        """The chunk's memory: the item's own tensor when the chunk is all of it (most are; a slice is a torch
        call, and the read threads' Python per chunk is what they queue for the GIL with)."""
        d = self.item.dest
        return d if self.first == 0 and self.count == d.numel() else d[self.first:self.first + self.count]


def chunked(items: Sequence[ReadItem], ckpt: Checkpoint, chunk_bytes: int | None = None) -> list[Chunk]:
    """Every item cut into chunks of at most ``chunk_bytes`` (default `READ_CHUNK_BYTES`; whole runs of a column
    block), in file order."""
    chunk_bytes = chunk_bytes or READ_CHUNK_BYTES
    entries = ckpt.entries
    placed = []  # (file byte of the item's first element, entry, item): the sort key and the chunks' offset
    for item in items:
        entry = entries[item.key]
        placed.append((entry.offset + item.src_start * entry.itemsize, entry, item))
    # files in name order (the order the disks see), ranked once: comparing Paths per item cost more than the rest
    files = {id(entry.file): entry.file for _, entry, _ in placed}
    rank = {key: i for i, key in enumerate(sorted(files, key=lambda k: str(files[k])))}
    placed.sort(key=lambda p: (rank[id(p[1].file)], p[0]))
    chunks: list[Chunk] = []
    for offset, entry, item in placed:
        n = item.dest.numel()
        itemsize = entry.itemsize
        step = max(1, chunk_bytes // max(1, itemsize))
        if item.rows <= 1 and 0 < n <= step:  # most items: one chunk, no generator
            chunks.append(Chunk(item, 0, n, item.src_start, 1, entry, offset))
            continue
        chunks.extend(Chunk(item, *part, entry, entry.offset + part[2] * itemsize)
                      for part in parts(item.src_start, n, item.rows, item.stride, step))
    return chunks


def grouped(chunks: Iterable[Chunk], chunk_bytes: int | None = None) -> Iterator[list[Chunk]]:
    """Consecutive chunks (in file order) whose bytes lie back to back in one file, plain ranges into
    memory on one device, together at most ``chunk_bytes`` (default `READ_CHUNK_BYTES`): one positional read
    each group (a model of thousands of small tensors paid more per read call than per byte). Made as they are
    asked for: the read threads take each group as it is made, reading the ones before it meanwhile."""
    chunk_bytes = chunk_bytes or READ_CHUNK_BYTES
    group: list[Chunk] = []
    end_file: object = None
    end = -1
    size = 0
    last_rows, last_device = 0, None
    for c in chunks:
        entry = c.entry
        itemsize = entry.itemsize
        start = c.offset
        nbytes = c.count * itemsize
        device = c.item.dest.device
        if (group and c.rows == 1 and last_rows == 1 and start == end
                and (entry.file is end_file or entry.file == end_file)
                and size + nbytes <= chunk_bytes and len(group) < GROUP_MAX_PARTS
                and size % itemsize == 0  # its place in a staging buffer can be viewed as its dtype
                and device == last_device):
            group.append(c)
            size += nbytes
        else:
            if group:
                yield group
            group = [c]
            size = nbytes
        end_file, end, last_rows, last_device = entry.file, start + nbytes, c.rows, device
    if group:
        yield group


def overflow_message(overflowed: dict[str, int]) -> str:
    """A restore's casts into the model's dtype that made finite values of these stored keys inf or NaN, or an inf
    something else (`write.overflow_count`)."""
    return ("the cast into the model's dtype made finite values infinite or NaN (beyond that dtype's range), or"
            " infinite values finite or NaN (a float8 dtype without infinity), in "
            + overflow_listing(overflowed, quoted=True) + ": restore into a model whose dtype's range holds them"
              " (fp16 tops out at 65504), or bring those values into range before casting")


def execute_reads(ckpt: Checkpoint, items: Sequence[ReadItem], threads: int = DEFAULT_READ_THREADS, *,
                  before: Callable[[list[torch.Tensor]], None] | None = None,
                  after: Callable[[list[torch.Tensor]], None] | None = None,
                  screened: Callable[[list[tuple[str, int, torch.Tensor]]], None] | None = None,
                  poison_staging: bool = False, chunk_bytes: int | None = None) -> None:
    """Run every read of ``items`` on ``threads`` threads; positional reads release the GIL, so reads
    overlap each other and the copies into device memory. Marks each item done once all its
    chunks were read; the first failed read raises. ``before`` / ``after`` are called with the
    destinations of each read (a group of chunks, `grouped`) on the thread that reads it, just before and
    right after the read (the check's ledger: host memory only, where the read is complete when it
    returns); ``screened``, where given, takes instead the groups read straight into host memory of the stored
    dtype (`_Worker.direct`: ``(key, first element, dest)`` each), to read them itself (`check.Ledger.read`,
    which fills and screens as it reads). ``poison_staging``: keep staging buffers NaN between uses (the check
    is on), so that no stale bytes can pass for a read. ``chunk_bytes``: the most one read (a chunk, a group)
    takes, default `READ_CHUNK_BYTES` (the ledger's caller passes `cache_chunk_bytes`)."""
    devices = {item.dest.device for item in items if item.dest.numel()}
    device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
    cuda = device.type == "cuda"
    chunk_bytes = _read_bytes(device, chunk_bytes or READ_CHUNK_BYTES)
    chunks = chunked(items, ckpt, chunk_bytes)
    if not chunks:
        return
    groups = grouped(chunks, chunk_bytes)  # made as the threads take them (under the lock below)
    caller_stream = torch.cuda.current_stream(device) if cuda else None
    local = threading.local()
    workers: list[_Worker] = []
    lock = threading.Lock()

    def worker() -> _Worker:
        w = getattr(local, "worker", None)
        if w is None:
            w = local.worker = _Worker(ckpt, device, after=caller_stream, poison=poison_staging,
                                       chunk_bytes=chunk_bytes)
            with lock:
                workers.append(w)
        return w

    def read(group: list[Chunk]) -> None:
        dests = [c.dest() for c in group]
        if screened is not None and (parts := worker().direct(group, dests)) is not None:
            screened(parts)
            return
        if before is not None:
            before(dests)
        if dests[0].device != device:  # items on several devices (rare): one-off staging on this thread
            w = worker()
            for c, dest in zip(group, dests):
                if n := read_piece(ckpt, c.item.key, c.src_start, dest, c.rows, c.item.stride):
                    w.overflowed[c.item.key] += n  # (the worker's own count, said with the others below)
        else:
            worker().read_group(group, dests)
        if after is not None:
            after(dests)

    # Long-lived workers that take the next group in file order: no future per read (a model of thousands
    # of small tensors paid more in thread hand-offs than in reads).
    next_group = groups
    failed: list[BaseException] = []

    def work(own_thread: bool = True) -> None:
        if own_thread:
            torch.set_grad_enabled(False)
            if cuda:  # each thread works on the destination's device (not a context on GPU 0 by default)
                torch.cuda.set_device(device)
        try:
            while not failed:
                with lock:
                    group = next(next_group, None)
                if group is None:
                    return
                read(group)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
            failed.append(e)

    try:
        if threads <= 1 or len(chunks) <= 1:
            with torch.no_grad():
                work(own_thread=False)
        else:
            running = start_readers(threads, work, min(threads, len(chunks)))
            try:
                for f in running:
                    f.result()
            except BaseException as e:  # interrupted (Ctrl-C): no read may land in the model after this returns
                failed.append(e)  # each worker stops at its next group
                wait(running)
                raise
    finally:
        unfinished: list[BaseException] = []
        for w in workers:  # every worker waited for, whichever fails: none leaves copies in flight
            try:
                w.finish()
            except BaseException as e:  # noqa: BLE001 - raised below, after the first failed read's error
                unfinished.append(e)
    if failed:
        raise failed[0]
    if unfinished:
        raise unfinished[0]
    overflowed = sum((w.overflowed for w in workers), Counter())
    if overflowed:  # every element was written, but not with a value of the checkpoint's
        raise ValueError(overflow_message(overflowed))
    for item in items:  # reached only when every chunk was read (a failed read raised above)
        item.done = True
