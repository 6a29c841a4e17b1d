"""The check: proof that every local element was restored, independent of the plan that restored it.

What to cover comes from the model itself, not from the plan: every parameter's local memory (an
FSDP1 flat parameter's local shard, with its padding taken from FSDP's own ``_shard_param_infos``; a
DTensor's local shard; a plain tensor), every persistent buffer, and every optimizer state tensor
laid out like its parameter. Names the caller accepted as missing (``strict=False``) are left out by
name and left untouched.

1. `validate_plan`, before any byte is read: the plan's items must tile each local storage's real
   elements exactly (no gap, no overlap, nothing written into padding or under another name), read
   inside their stored tensors; `coverage_digest` folds each item's *global* element range into two
   numbers whose sum over all ranks is zero exactly when the ranks' plans together cover every tensor
   uniformly (checked in one all-reduce, see verdict.py): a piece shifted by a row on one rank fails it.
2. NaN fill and screen, in one of two ways. Memory the host writes itself (CPU): a `Ledger` on the
   read threads fills each chunk just before its read and screens it right after (overlapping the
   other threads' I/O; a read straight into the model's memory does both in `screened_read`, window by
   window), and `settle` holds the chunks it filled and screened against the model's memory: an
   element no such chunk covered was never read, whatever the executor says. GPU memory
   and the ``FSDP.apply`` route: `poison` every element in one pass before the reads, `screen` every
   element in one pass after (one reduction per chunk, one device sync per restore).
3. Only suspicious chunks are examined element by element, and NaN that the file itself holds
   (re-read from the file) is reported apart. Integer and bool tensors cannot hold NaN: in a ledger
   their chunks are accounted like the others; otherwise their coverage is the validated plan.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .plan import OptimizerPlan, ReadItem, ReadPlan
from .read import Checkpoint
from .screened_read import fill_nan, floating, holding_nan, nan_sum, pread_screened
from .shards import (_fsdp1_units, _join, clean_name, ddp_prefix, local_tensor, module_walk,
                     named_parameters_of)

CHECK_CHUNK_BYTES = 16 * 1024 * 1024
DIGEST_PRIME = 2**31 - 1  # modulus of the coverage digest: sums of world_size of them stay within int64


@dataclass(slots=True)  # (one per tensor per restore: slots make and read them faster)
class Region:
    """Real (non-padding) elements ``[offset, offset + numel)`` of a storage that belong to ``name``."""

    name: str
    offset: int
    numel: int


@dataclass(slots=True)
class Storage:
    """One block of local memory to restore: ``memory`` is all of it (padding included; contiguous: the plan refuses
    other tensors), and ``flat`` the same as one dimension (made when first asked for: by the check's passes; a view
    is a torch call per tensor, and a restore without the check, or the plan's proof, needs none)."""

    memory: torch.Tensor
    regions: list[Region]

    @property
    def floating(self) -> bool:
        return floating(self.memory.dtype)

    ptr_range: tuple[int, int] = field(init=False)  # [first byte, end) of ``memory``: looked up per read
    numel: int = field(init=False)  # of ``memory``
    itemsize: int = field(init=False)  # of ``memory``
    _flat: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        memory = self.memory
        start = memory.data_ptr()
        self.numel = memory.numel()
        self.itemsize = memory.element_size()
        self.ptr_range = (start, start + self.numel * self.itemsize)

    @property
    def flat(self) -> torch.Tensor:
        flat = self._flat
        if flat is None:
            memory = self.memory
            flat = self._flat = memory if memory.dim() == 1 and not memory.requires_grad else memory.view(-1)
        return flat


@dataclass
class CheckResult:
    unrestored: list[str] = field(default_factory=list)  # "name (k elements)" never written
    nan_in_checkpoint: list[str] = field(default_factory=list)  # restored NaN that the file holds
    checked_elements: int = 0


# ---- what to cover, from the model itself ----------------------------------------------------------


def model_storages(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None) -> list[Storage]:
    """Every parameter's and persistent buffer's local memory, with its real elements by name (``modules``:
    `shards.module_walk`'s list, when the caller has it)."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    top = ddp_prefix(model)
    storages: list[Storage] = []
    # Memory already listed: FSDP1 flat shards (a few spans: use_orig_params views lie inside them) and
    # every tensor's first element (a tied tensor is the same memory under a second name).
    flat_starts: list[int] = []
    flat_ends: list[int] = []
    seen: set[int] = set()

    def covered(ptr: int) -> bool:
        i = bisect.bisect_right(flat_starts, ptr) - 1
        return ptr in seen or (i >= 0 and ptr < flat_ends[i])

    def add(flat: torch.Tensor, regions: list[Region]) -> None:
        storages.append(Storage(flat, [r for r in regions if r.numel]))
        seen.add(flat.data_ptr())

    fsdp1 = False  # FlatParameter's isinstance is a Python metaclass hook: skipped where no FSDP1 unit exists
    modules = module_walk(model) if modules is None else modules
    for unit_prefix, handle in _fsdp1_units(model, modules):
        fsdp1 = True
        flat = handle.flat_param
        local = flat.data
        regions = [Region(_join(unit_prefix, clean_name(fqn)), info.offset_in_shard, info.numel_in_shard)
                   for fqn, info in zip(flat._fqns, flat._shard_param_infos) if info.in_shard]
        if local.numel():
            add(local.view(-1), regions)
            start = local.data_ptr()
            i = bisect.bisect_right(flat_starts, start)
            flat_starts.insert(i, start)
            flat_ends.insert(i, start + local.numel() * local.element_size())
    for raw, param in named_parameters_of(modules):
        if fsdp1 and isinstance(param, FlatParameter):
            continue
        local = local_tensor(param)
        n = local.numel()
        if n == 0 or (ptr := local.data_ptr()) in seen or (flat_starts and covered(ptr)):
            continue
        memory = local if local.is_contiguous() else local.reshape(-1)
        storages.append(Storage(memory, [Region(clean_name(raw.removeprefix(top)), 0, n)]))  # (add(), inlined)
        seen.add(ptr)
    for mod_name, module in modules:
        for buf_name, buf in module._buffers.items():
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            local = local_tensor(buf)
            if local.numel() == 0 or covered(local.data_ptr()):
                continue
            add(local.reshape(-1), [Region(clean_name(_join(mod_name, buf_name).removeprefix(top)), 0, local.numel())])
    return storages


def without(storages: Sequence[Storage], names: Iterable[str]) -> list[Storage]:
    """The storages with the regions of ``names`` left out (names the caller accepted as missing)."""
    names = set(names)
    if not names:
        return list(storages)
    return [Storage(s.memory, [r for r in s.regions if r.name not in names]) for s in storages]


def optimizer_storages(optim: OptimizerPlan, storages: Sequence[Storage]) -> list[Storage]:
    """The state tensors the optimizer plan will install that are laid out like their parameter:
    each gets its parameter's real elements (its padding is the parameter's padding)."""
    index = _StorageIndex(storages)
    out: list[Storage] = []
    for param, fld in optim.shaped:
        p_local = local_tensor(param)
        state = local_tensor(optim.state[param][fld]).reshape(-1)
        if p_local.numel() == 0:
            continue
        found = index.find(p_local.data_ptr())
        if found is None:
            continue  # a parameter outside the model's storage: validate_plan reports its items
        storage, base = found
        end = base + p_local.numel()
        regions = [Region(f"optim:{r.name}.{fld}", max(r.offset, base) - base, min(r.offset + r.numel, end) - max(r.offset, base))
                   for r in storage.regions if r.offset < end and r.offset + r.numel > base]
        out.append(Storage(state, regions))
    return out


class _StorageIndex:
    """Find the storage (and element offset in it) that holds a data pointer."""

    def __init__(self, storages: Sequence[Storage]) -> None:
        self.sorted = sorted((s for s in storages if s.numel), key=lambda s: s.ptr_range[0])
        self.starts = [s.ptr_range[0] for s in self.sorted]
        self.itemsize = [s.itemsize for s in self.sorted]
        # most lookups are of a storage's first byte (a parameter read whole): a dict answers those; the last
        # storage starting there, as the search below would find it
        self.at_start = {s.ptr_range[0]: (s, 0) for s in self.sorted}

    def find(self, ptr: int) -> tuple[Storage, int] | None:
        hit = self.at_start.get(ptr)
        if hit is not None:
            return hit
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0:
            return None
        storage = self.sorted[i]
        lo, hi = storage.ptr_range
        if not lo <= ptr < hi:
            return None
        return storage, (ptr - lo) // self.itemsize[i]


# ---- 1. the plan, validated before any byte is read --------------------------------------------------


def validate_plan(plan: ReadPlan, storages: Sequence[Storage], ckpt: Checkpoint) -> dict[str, list[str]]:
    """Problems with the plan (empty when it is exact): for every storage, the items tile its real
    elements exactly under the right names; every item reads inside its stored tensor and its global
    tensor. Problems are plan bugs, reported as such."""
    bad: dict[str, set[str]] = {}

    def report(kind: str, name: str) -> None:
        bad.setdefault(kind, set()).add(name)

    index = _StorageIndex(storages)
    find = index.find
    entries = ckpt.entries
    placed: dict[int, list[tuple[int, int, str]]] = {}
    for item in plan.items:  # once per tensor per restore: attribute lookups kept out of the loop's way
        dest = item.dest
        n = dest.numel()
        rows = item.rows
        if rows > 1:
            run = n // rows
            if run * rows != n or item.stride < run:
                report("reads overlapping or uneven rows", item.name)
                continue
            span = (rows - 1) * item.stride + run if n else 0
        else:
            span = n
        entry = entries.get(item.key)
        src_start = item.src_start
        if entry is None or src_start < 0 or src_start + span > entry.numel:
            report("reads outside its stored tensor", item.name)
        if item.global_start < 0 or item.global_start + span > item.global_numel:
            report("reads outside its tensor", item.name)
        if n == 0:
            continue
        found = find(dest.data_ptr())
        if found is None:
            report("writes outside the model's memory", item.name)
            continue
        storage, offset = found
        if dest.dtype != storage.memory.dtype or offset + n > storage.numel or not dest.is_contiguous():
            report("writes outside its tensor", item.name)
            continue
        placed.setdefault(id(storage), []).append((offset, n, item.name))
    for storage in storages:
        runs = placed.get(id(storage), [])
        regions = storage.regions
        if len(runs) == 1 and len(regions) == 1:  # most storages: one tensor read whole by one item
            (offset, n, name), region = runs[0], regions[0]
            if offset == region.offset and n == region.numel and name == region.name:
                continue  # (what the general walk below finds for it: tiled exactly, nothing to report)
        if len(runs) > 1:
            runs.sort()
        regions = regions if len(regions) < 2 else sorted(regions, key=lambda r: r.offset)
        starts = [r.offset for r in regions]
        covered = {r.name: 0 for r in regions}
        end = 0
        for offset, n, name in runs:
            if offset < end:
                report("planned twice", name)
            end = max(end, offset + n)
            i = bisect.bisect_right(starts, offset) - 1
            region = regions[i] if i >= 0 else None
            if region is None or offset + n > region.offset + region.numel or region.name != name:
                report("planned into padding or another tensor", name)
                continue
            covered[name] += n
        for region in regions:
            if covered[region.name] < region.numel and region.name not in plan.refused:
                report("never planned (elements left unread)", region.name)
                covered[region.name] = region.numel  # report each name once
    return {f"plan: {kind}": sorted(names) for kind, names in bad.items()}


@functools.lru_cache(maxsize=1 << 16)  # the same names every restore; a hash each costs microseconds
def name_weight(name: str, salt: bytes) -> int:
    """A pseudo-random weight of ``name`` below `DIGEST_PRIME`, the same on every rank."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8, salt=salt).digest(), "little") % DIGEST_PRIME


def _sum_squares(m: int) -> int:
    """0^2 + 1^2 + ... + (m-1)^2"""
    return (m - 1) * m * (2 * m - 1) // 6


def index_moments(start: int, run: int, rows: int, stride: int) -> tuple[int, int]:
    """(sum, sum of squares) of the indices start + i * stride + j for i < rows, j < run, in closed form
    (a column block of thousands of rows costs as little as one range)."""
    a1 = rows * start + stride * rows * (rows - 1) // 2  # sum of the row starts a_i
    a2 = rows * start * start + start * stride * rows * (rows - 1) + stride * stride * _sum_squares(rows)
    j1, j2 = run * (run - 1) // 2, _sum_squares(run)
    return run * a1 + rows * j1, run * a2 + 2 * j1 * a1 + rows * j2


def coverage_terms(items: Sequence[ReadItem]) -> dict[str, tuple[int, int]]:
    """Per name, (2 S1 - c (N-1), 6 S2 - c (N-1)(2N-1)) over the global indices this rank reads, where
    c is their count, S1 their sum and S2 the sum of their squares. Both are zero, summed over all
    ranks, exactly when the ranks cover the tensor's N elements m times each for some m (the first
    two moments of a uniform cover); a shifted, lost or doubled piece makes them non-zero."""
    terms: dict[str, list[int]] = {}
    for item in items:
        s, c, big_n = item.global_start, item.dest.numel(), item.global_numel
        if c == 0:
            continue
        rows = item.rows
        if rows == 1:  # a plain range (most items): `index_moments` of one row, without the call
            j1 = c * (c - 1) // 2
            s1, s2 = c * s + j1, c * s * s + 2 * j1 * s + _sum_squares(c)
        else:
            s1, s2 = index_moments(s, c // rows if rows else 0, rows, item.stride)  # (item.run, without a second numel)
        t = terms.setdefault(item.name, [0, 0])
        t[0] += 2 * s1 - c * (big_n - 1)
        t[1] += 6 * s2 - c * (big_n - 1) * (2 * big_n - 1)
    return {name: (a, b) for name, (a, b) in terms.items()}


def coverage_digest(terms: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """The terms of every name folded with per-name random weights, modulo `DIGEST_PRIME`."""
    d1 = sum(name_weight(n, b"moment1") * a for n, (a, _) in terms.items()) % DIGEST_PRIME
    d2 = sum(name_weight(n, b"moment2") * b for n, (_, b) in terms.items()) % DIGEST_PRIME
    return d1, d2


# ---- 2. poison, 3. screen --------------------------------------------------------------------------


def _spans(storage: Storage) -> list[tuple[int, int]]:
    """The storage's real elements as merged (offset, count) runs."""
    runs: list[tuple[int, int]] = []
    for r in sorted(storage.regions, key=lambda r: r.offset):
        if runs and runs[-1][0] + runs[-1][1] == r.offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + r.numel)
        else:
            runs.append((r.offset, r.numel))
    return runs


def _chunks(storages: Sequence[Storage]) -> list[torch.Tensor]:
    """Views over every floating storage's real elements: of at most CHECK_CHUNK_BYTES in CPU memory (so
    that threads share a large tensor), whole runs on a GPU (one kernel each; the GPU is parallel)."""
    out = []
    for storage in storages:
        if not storage.floating:
            continue
        on_cpu = storage.flat.device.type == "cpu"
        step = max(1, CHECK_CHUNK_BYTES // storage.flat.element_size()) if on_cpu else storage.flat.numel()
        for offset, count in _spans(storage):
            out.extend(storage.flat[s:s + min(step, offset + count - s)] for s in range(offset, offset + count, step))
    return out


def _run(fn, chunks: list[torch.Tensor], threads: int) -> list:
    """``fn`` over the chunks, in order: CPU chunks on ``threads`` threads (torch releases the GIL),
    device chunks on this thread (the kernels are queued on the caller's stream, asynchronously)."""
    with torch.no_grad():
        if threads <= 1 or len(chunks) <= 1 or all(c.device.type != "cpu" for c in chunks):
            return [fn(c) for c in chunks]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(fn, chunks))


# torch's multi-tensor (foreach) kernels take these on a GPU: one kernel covers many chunks
_FOREACH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _batched(chunks: Sequence[torch.Tensor]) -> tuple[list[list[int]], list[int]]:
    """Indices of GPU chunks by (device, dtype) where torch's multi-tensor kernels take them, and the rest: a
    model of thousands of tensors paid more in kernel launches (one per chunk) than the passes themselves."""
    batches: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    rest: list[int] = []
    for i, c in enumerate(chunks):
        if c.device.type == "cuda" and c.dtype in _FOREACH_DTYPES:
            batches.setdefault((c.device, c.dtype), []).append(i)
        else:
            rest.append(i)
    return list(batches.values()), rest


def poison(storages: Sequence[Storage], threads: int) -> int:
    """NaN-fill every real element of every floating storage; returns the element count."""
    chunks = _chunks(storages)
    batches, rest = _batched(chunks)
    for batch in batches:  # x * NaN is NaN for every x (inf, NaN, any bits): a NaN fill, many chunks per kernel
        torch._foreach_mul_([chunks[i] for i in batch], float("nan"))
    _run(lambda c: c.fill_(float("nan")), [chunks[i] for i in rest], threads)
    return sum(c.numel() for c in chunks)


def screen(storages: Sequence[Storage], plan: ReadPlan, ckpt: Checkpoint, threads: int) -> CheckResult:
    """After the reads (`poison` before them): every element still NaN that the file does not hold as
    NaN, by name; items not read to the end."""
    chunks = _chunks(storages)
    # A sum per chunk: one vectorized pass with no temporary (several times cheaper than isnan().any()),
    # and any NaN makes it NaN (so does inf - inf: a false alarm that the exact look below clears). On a GPU
    # the 1-norms of many chunks per kernel: NaN as well for any NaN (inf stays inf).
    batches, rest = _batched(chunks)
    found: list[tuple[list[int], torch.Tensor]] = []
    for batch in batches:
        norms = torch._foreach_norm([chunks[i] for i in batch], 1)
        found.append((batch, torch.isnan(torch.stack(norms))))
    sums = _run(nan_sum, [chunks[i] for i in rest], threads)
    if sums:
        found.append((rest, torch.isnan(torch.stack([(s.real + s.imag if s.is_complex() else s).float()
                                                     for s in sums]))))
    flagged = [chunks[i] for batch, nan in found for i, f in zip(batch, nan.tolist()) if f]  # a sync per batch
    return _verdict(_StorageIndex(storages), plan, ckpt, flagged, {}, sum(c.numel() for c in chunks))


class Ledger:
    """The check on the read threads, for memory the host writes itself: the executor calls `before` on
    each read's destinations just before reading into them and `after` right after, so the NaN fill
    and the screen run while other threads wait for the disk, on memory still in cache.

    The ledger does not trust the executor: it records the chunks poisoned *and* screened, and
    `settle` holds them against the model's memory. An element of a storage that no such chunk
    covered was never read (a lost piece, a skipped chunk) and is reported, without needing NaN; an
    element that a chunk covered was NaN just before the read and is screened just after. Reads straight
    into host memory (`read`) take the ledger's own read, `pread`, which fills, reads and screens the memory it
    is handed and records what that memory is from the model's storages, not from what the read layer says."""

    def __init__(self, storages: Sequence[Storage]) -> None:
        self.index = _StorageIndex(storages)
        self._lock = threading.Lock()
        self._open = threading.local()
        self.covered: dict[int, list[tuple[int, int]]] = {}  # id(storage) -> (offset, count) poisoned and screened
        self.flagged: list[torch.Tensor] = []

    def before(self, dests: list[torch.Tensor]) -> None:
        fill_nan(dests)
        self._open.dests = [(d.data_ptr(), d.numel()) for d in dests]

    def read(self, ckpt: Checkpoint, parts: list[tuple[str, int, torch.Tensor]]) -> None:
        """Read ``parts`` (``(key, first element, dest)``, back to back in one file, straight into CPU memory of
        the stored dtype) through `Checkpoint.read_contiguous` with the ledger's `pread`."""
        ckpt.read_contiguous(parts, pread=self.pread)

    def pread(self, fd: int, views: Sequence[Any], offset: int) -> int:
        """The check's read (`screened_read.pread_screened`) into ``views`` (ctypes arrays over host memory, back
        to back in the file from ``offset``): each view that lies inside one storage of the model is filled with
        NaN just before its bytes are read and screened right after, and recorded as covered only where all its
        bytes were (memory outside the model's storages is read into, and not recorded). Returns the bytes read."""
        find = self.index.find
        placed: list[tuple[Storage, int] | None] = []
        buffers = []
        for view in views:
            address, nbytes = ctypes.addressof(view), len(view)
            where = find(address)
            if where is not None and (address + nbytes > where[0].ptr_range[1] or nbytes % where[0].itemsize
                                      or (address - where[0].ptr_range[0]) % where[0].itemsize):
                where = None  # (a plan the check validated hands out no such view)
            placed.append(where)
            buffers.append((address, nbytes, where[0].memory.dtype if where is not None else torch.uint8))
        got, found, screened = pread_screened(fd, buffers, offset)
        covered = []
        for where, (_, nbytes, dtype), count in zip(placed, buffers, screened):
            if where is not None and nbytes and (count == nbytes or not floating(dtype)):
                covered.append((where[0], where[1], nbytes // where[0].itemsize))
        flagged = []  # (examined element by element in `settle`)
        for i in found:
            if (where := placed[i]) is not None:
                storage, start = where
                flagged.append(storage.flat[start:start + buffers[i][1] // storage.itemsize])
        with self._lock:
            for storage, start, count in covered:
                self.covered.setdefault(id(storage), []).append((start, count))
            self.flagged.extend(flagged)
        return got

    def after(self, dests: list[torch.Tensor]) -> None:
        opened = getattr(self._open, "dests", None)
        self._open.dests = None
        if opened != [(d.data_ptr(), d.numel()) for d in dests]:
            return  # not poisoned just before: not covered (settle reports it unless another read was)
        # one sum and one scalar per destination (a ledger is kept for host memory only, where a scalar costs
        # no device sync): a stack + isnan + any per read cost more Python than the sums
        suspicious = bool(holding_nan(dests))
        self._record(dests, [d for d in dests if floating(d.dtype) and d.numel()] if suspicious else [])

    def _record(self, dests: list[torch.Tensor], flagged: list[torch.Tensor]) -> None:
        """``dests`` poisoned and screened (covered), ``flagged`` of them holding NaN after (examined in `settle`)."""
        found = [(self.index.find(d.data_ptr()), d) for d in dests if d.numel()]
        with self._lock:
            for where, d in found:
                if where is not None:
                    self.covered.setdefault(id(where[0]), []).append((where[1], d.numel()))
            self.flagged.extend(flagged)


def settle(storages: Sequence[Storage], plan: ReadPlan, ckpt: Checkpoint, ledger: Ledger) -> CheckResult:
    """The verdict of a `Ledger` check: elements no poisoned-and-screened chunk covered, NaN left in the
    chunks that were (the file's own NaN apart), items not read to the end."""
    never: dict[str, int] = {}
    for storage in storages:
        runs = sorted(ledger.covered.get(id(storage), []))
        for region in storage.regions:
            missing = region.numel - _overlap(runs, region.offset, region.offset + region.numel)
            if missing:
                never[region.name] = never.get(region.name, 0) + missing
    checked = sum(r.numel for s in storages if s.floating for r in s.regions)
    return _verdict(ledger.index, plan, ckpt, ledger.flagged, never, checked)


def _overlap(runs: list[tuple[int, int]], lo: int, hi: int) -> int:
    """How many of the elements [lo, hi) the sorted (offset, count) runs cover (overlaps counted once)."""
    total, at = 0, lo
    for offset, count in runs[max(0, bisect.bisect_right(runs, (lo,)) - 1):]:
        if offset >= hi:
            break
        start, end = max(offset, at), min(offset + count, hi)
        if end > start:
            total += end - start
            at = end
    return total


def _verdict(index: _StorageIndex, plan: ReadPlan, ckpt: Checkpoint, flagged: Sequence[torch.Tensor],
             bad: dict[str, int], checked: int) -> CheckResult:
    result = CheckResult(checked_elements=checked)
    bad = dict(bad)
    for item in plan.items:
        if not item.done:
            bad[item.name] = bad.get(item.name, 0) + item.dest.numel()
    source_nan: set[str] = set()
    if flagged:
        by_storage = _items_by_storage(plan.items, index)
        for chunk in flagged:
            _examine(chunk, index, by_storage, ckpt, bad, source_nan)
    result.nan_in_checkpoint = sorted(source_nan - set(bad))
    result.unrestored = [f"{n} ({c} elements)" for n, c in sorted(bad.items())]
    return result


def _items_by_storage(items: Sequence[ReadItem], index: _StorageIndex) -> dict[int, list[tuple[int, ReadItem]]]:
    out: dict[int, list[tuple[int, ReadItem]]] = {}
    for item in items:
        found = index.find(item.dest.data_ptr()) if item.dest.numel() else None
        if found is not None:
            out.setdefault(id(found[0]), []).append((found[1], item))
    for runs in out.values():
        runs.sort(key=lambda r: r[0])
    return out


def _examine(chunk: torch.Tensor, index: _StorageIndex, by_storage: dict[int, list[tuple[int, ReadItem]]],
             ckpt: Checkpoint, bad: dict[str, int], source_nan: set[str]) -> None:
    """Element by element: NaN left in ``chunk`` is either unrestored or held by the file."""
    found = index.find(chunk.data_ptr())
    assert found is not None
    storage, chunk_start = found
    nan = torch.isnan(chunk).cpu()
    if not bool(nan.any()):
        return
    chunk_end = chunk_start + chunk.numel()
    explained = torch.zeros_like(nan)
    for offset, item in by_storage.get(id(storage), []):
        lo, hi = max(offset, chunk_start), min(offset + item.dest.numel(), chunk_end)
        if lo >= hi or not item.done or not bool(nan[lo - chunk_start:hi - chunk_start].any()):
            continue
        stored = _stored(ckpt, item, lo - offset, hi - offset)
        if floating(stored.dtype):
            held = torch.isnan(stored) & nan[lo - chunk_start:hi - chunk_start]
            if bool(held.any()):
                explained[lo - chunk_start:hi - chunk_start] |= held
                source_nan.add(item.name)
    left = nan & ~explained
    if not bool(left.any()):
        return
    for region in storage.regions:
        lo, hi = max(region.offset, chunk_start), min(region.offset + region.numel, chunk_end)
        if lo < hi:
            count = int(left[lo - chunk_start:hi - chunk_start].sum())
            if count:
                bad[region.name] = bad.get(region.name, 0) + count


def _stored(ckpt: Checkpoint, item: ReadItem, lo: int, hi: int) -> torch.Tensor:
    """What the file holds for elements ``[lo, hi)`` of ``item.dest``, read afresh (zeros where a read
    fails to write: that proves no NaN)."""
    entry = ckpt.entries[item.key]
    if item.rows <= 1:
        stored = torch.zeros(hi - lo, dtype=entry.dtype)
        ckpt.read_range(item.key, item.src_start + lo, stored)
        return stored
    run = item.run
    first, last = lo // run, (hi + run - 1) // run  # the whole rows that hold [lo, hi)
    rows = torch.zeros((last - first) * run, dtype=entry.dtype)
    ckpt.read_rows(item.key, item.src_start + first * item.stride, rows, last - first, item.stride)
    return rows[lo - first * run:hi - first * run]
