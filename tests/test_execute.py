"""The executor: small tensors stored back to back are read together, exactly, whatever their dtypes.

The oracle is safetensors' own reader (``load_file``) of the same file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import fsdp_restore
from fsdp_restore import execute
from fsdp_restore.execute import chunked, grouped
from fsdp_restore.plan import build_plan
from fsdp_restore.read import Checkpoint
from helpers import SecondThreadGate, reading_all_but


class Mixed(torch.nn.Module):
    """Many small tensors of mixed widths (bf16 and fp32 among fp32)."""

    def __init__(self, dtype=None):
        super().__init__()
        torch.manual_seed(0)
        self.small = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(37 + i)) for i in range(300)])
        self.odd = torch.nn.Parameter(torch.randn(3).to(torch.bfloat16))
        self.after_odd = torch.nn.Parameter(torch.randn(5))
        self.big = torch.nn.Parameter(torch.randn(300, 129))
        if dtype is not None:
            self.to(dtype)


@pytest.fixture
def stored(tmp_path):
    path = tmp_path / "mixed.safetensors"
    fsdp_restore.save(dict(Mixed().state_dict()), path)
    return path


def test_back_to_back_chunks_are_grouped_within_the_limits(stored, monkeypatch):
    model = Mixed()
    with Checkpoint(stored) as ckpt:
        plan = build_plan(model, ckpt, prefix="")
        chunks = chunked(plan.items, ckpt)
        groups = list(grouped(chunks))
        assert [c for g in groups for c in g] == chunks  # every chunk once, in file order
        assert len(groups) < len(chunks) / 10  # 303 tensors, a handful of reads
        for g in groups:
            entries = [ckpt.entries[c.item.key] for c in g]
            for a, b, ea, eb in zip(g, g[1:], entries, entries[1:]):  # back to back in the file
                assert ea.offset + (a.src_start + a.count) * ea.itemsize == eb.offset + b.src_start * eb.itemsize
        monkeypatch.setattr(execute, "GROUP_MAX_PARTS", 7)
        monkeypatch.setattr(execute, "READ_CHUNK_BYTES", 4096)
        for g in grouped(chunked(plan.items, ckpt)):
            assert len(g) <= 7 and (len(g) == 1 or sum(c.count * ckpt.entries[c.item.key].itemsize for c in g) <= 4096)


def test_a_chunk_size_of_its_own_cuts_and_groups_within_it(stored):
    """``chunk_bytes`` (the checked restore's cache-sized reads) bounds chunks and groups as `READ_CHUNK_BYTES` does,
    and every element is still in exactly one chunk."""
    model = Mixed()
    with Checkpoint(stored) as ckpt:
        plan = build_plan(model, ckpt, prefix="")
        chunks = chunked(plan.items, ckpt, 4096)
        for c in chunks:
            assert c.count * ckpt.entries[c.item.key].itemsize <= 4096
        for item in plan.items:
            mine = sorted((c.first, c.count) for c in chunks if c.item is item)
            assert sum(n for _, n in mine) == item.dest.numel() and all(
                a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))
        for g in grouped(chunks, 4096):
            assert len(g) == 1 or sum(c.count * ckpt.entries[c.item.key].itemsize for c in g) <= 4096


def test_the_cache_sized_chunk_stays_within_its_bounds(monkeypatch):
    for cache in (0, 256 * 1024, 32 * 2**20, 2**31):
        monkeypatch.setattr(execute, "last_level_cache_bytes", lambda cache=cache: cache)
        for threads in (1, 4, 64):
            size = execute.cache_chunk_bytes(threads)
            assert execute.MIN_CHUNK_BYTES <= size <= execute.READ_CHUNK_BYTES
            assert size == (execute.CACHE_CHUNK_FALLBACK_BYTES if cache == 0 else
                            max(execute.MIN_CHUNK_BYTES, min(execute.READ_CHUNK_BYTES, cache // (2 * threads))))


@pytest.mark.parametrize("dtype", [None, torch.float64])  # reads straight into memory / through staging + cast
@pytest.mark.parametrize("threads", [1, 3])
def test_grouped_reads_restore_exactly(stored, dtype, threads):
    model = Mixed(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7)
    report = fsdp_restore.restore_model(model, stored, thread_count=threads)
    expected = load_file(str(stored))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in expected.values())


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_a_read_that_skips_one_tensor_of_a_group_is_caught(stored, monkeypatch, native):
    """The read layer drops one small tensor of a group without a word (never handed to the check's read): the
    check names it, with the check's read native or in Python."""
    monkeypatch.setenv("FSDP_RESTORE_NATIVE", native)
    monkeypatch.setattr(Checkpoint, "read_contiguous",
                        reading_all_but(Checkpoint.read_contiguous, lambda part: part[0] == "small.150"))
    with pytest.raises(fsdp_restore.RestoreError, match=r"not restored.*small\.150"):
        fsdp_restore.restore_model(Mixed(), stored)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_misaligned_tensor_is_never_viewed_at_a_bad_offset(tmp_path, dtype):
    """A file from another tool whose fp32 tensor starts 2 bytes into the data (legal safetensors): it is
    not grouped where a staging buffer would have to view it at an offset its dtype cannot start at."""
    import json
    import struct

    b = torch.randn(6)
    header = json.dumps({"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]},
                         "b": {"dtype": "F32", "shape": [6], "data_offsets": [2, 26]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + torch.tensor([1.5], dtype=torch.bfloat16).view(
        torch.uint8).numpy().tobytes() + b.numpy().tobytes())
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(1, dtype=dtype))  # cast from bf16: through staging
    model.b = torch.nn.Parameter(torch.zeros(6, dtype=dtype))
    fsdp_restore.restore_model(model, path)
    assert model.a.item() == 1.5 and torch.equal(model.b, b.to(dtype))


def _restored_exactly(model: torch.nn.Module, path) -> bool:
    expected = load_file(path)
    return all(torch.equal(v, expected[k].to(v.dtype)) for k, v in model.state_dict().items())


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_the_kept_read_threads_work_again_in_a_forked_child(stored, monkeypatch):
    """The read threads are kept between calls; a child forked after a restore has none of them and must
    start its own (a pool that believes its threads survived the fork would wait forever)."""
    import os
    import time

    monkeypatch.setattr(execute, "READ_CHUNK_BYTES", 4096)  # many reads: the threads are used
    monkeypatch.setattr(execute, "MIN_CHUNK_BYTES", 4096)  # (the checked path's chunk too)
    monkeypatch.setattr(execute, "_pool", None)  # no pool from an earlier test: this restore must start it
    model = Mixed()
    fsdp_restore.restore_model(model, stored, model_prefix="", thread_count=3)
    assert execute._pool is not None  # the threads are kept now
    assert _restored_exactly(model, stored)
    pid = os.fork()
    if pid == 0:  # the child: restore into a fresh model with the parent's pool gone
        code = 1
        try:
            child = Mixed()
            with torch.no_grad():
                for p in child.parameters():
                    p.zero_()
            fsdp_restore.restore_model(child, stored, model_prefix="", thread_count=3)
            code = 0 if _restored_exactly(child, stored) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's restore hung: its read threads were never started")


ALIASED_SHAPES = {"a": (300, 1000), "b": (250, 1000), "c": (70_001,), "d": (90_000,)}


def _aliased_model(tmp_path) -> tuple[torch.nn.Module, object]:
    """A file of four tensors and a model whose parameters ``a`` and ``c`` lie 8 bytes after their stored bytes
    modulo the page (the slow 4K-aliased copy), ``b`` and ``d`` 64 bytes after (read straight in)."""
    torch.manual_seed(0)
    path = tmp_path / "aliased.safetensors"
    fsdp_restore.save({k: torch.randn(s) for k, s in ALIASED_SHAPES.items()}, path)
    with Checkpoint(path) as ckpt:
        offsets = {k: ckpt.entries[k].offset for k in ALIASED_SHAPES}
    arena = torch.zeros(sum(torch.Size(s).numel() * 4 for s in ALIASED_SHAPES.values()) + 5 * 8192,
                        dtype=torch.uint8)
    base, at = arena.data_ptr(), 0
    model = torch.nn.Module()
    for name, shape in ALIASED_SHAPES.items():
        placement = 8 if name in ("a", "c") else 64
        at += (offsets[name] + placement - (base + at)) % execute.PAGE_BYTES
        nbytes = torch.Size(shape).numel() * 4
        setattr(model, name, torch.nn.Parameter(arena[at:at + nbytes].view(torch.float32).view(shape)))
        assert execute.aliased(getattr(model, name).data_ptr(), offsets[name]) == (name in ("a", "c"))
        at += nbytes
    return model, path


@pytest.mark.parametrize("check", [True, False])
def test_a_read_into_memory_aliased_with_its_source_takes_the_detour_exactly(tmp_path, monkeypatch, check):
    """The aliased parameters are read through a staging buffer, the others of the same group straight in, and
    every byte lands (the oracle: safetensors' reader)."""
    model, path = _aliased_model(tmp_path)
    staged: list[str] = []
    real = execute._Worker._staged

    def spy(self, reads):
        staged.extend(key for key, *_ in reads)
        real(self, reads)

    monkeypatch.setattr(execute._Worker, "_staged", spy)
    report = fsdp_restore.restore_model(model, path, check=check, thread_count=1)
    assert set(staged) == {"a", "c"}  # each in one read or several (the checked restore's chunks are cache-sized)
    assert report.bytes_read == sum(torch.Size(s).numel() * 4 for s in ALIASED_SHAPES.values())  # nothing read twice
    assert _restored_exactly(model, path)


def test_a_detour_that_never_lands_is_caught_by_the_check(tmp_path, monkeypatch):
    """Fault injection: the detour reads into staging but drops the copy into place. The check names the aliased
    tensors as not restored, on the restore that took the detour."""
    model, path = _aliased_model(tmp_path)
    real = execute._Worker._staged

    def drop_copy(self, reads):
        real(self, [(key, start, torch.empty_like(dest), rows, stride) for key, start, dest, rows, stride in reads])

    monkeypatch.setattr(execute._Worker, "_staged", drop_copy)
    # exactly the two detoured tensors, whole: b and d, read straight in from the same group, are restored
    with pytest.raises(fsdp_restore.RestoreError,
                       match=r"not restored.*\(2\): a \(300000 elements\), c \(70001 elements\)"):
        fsdp_restore.restore_model(model, path, thread_count=1)


def test_a_staged_read_lands_at_its_source_page_offset():
    """The staging placement: at the source's page offset or up to ``alignment - 1`` bytes before it (never in the
    aliased band after it), at a multiple of the alignment (the dtype can view it), inside the buffer's slack."""
    for buffer_ptr in (0, 64, 4096 * 7 + 48, 123_456_784):
        for offset in range(0, 3 * 4096, 34):
            for alignment in (1, 2, 4, 8, 16, execute.PINNED_ALIGNMENT):
                shift = execute.staging_shift(buffer_ptr, offset, alignment)
                assert 0 <= shift < execute.ALIGN_SLACK and shift % alignment == 0
                assert (offset - buffer_ptr - shift) % execute.PAGE_BYTES < alignment
                assert not execute.aliased(buffer_ptr + shift, offset)


def test_pinned_staging_grows_only_while_every_buffer_is_in_flight_and_reuses_the_oldest(monkeypatch):
    """The GPU path's staging ring (CPU buffers and hand-made events stand in for pinned memory and CUDA
    events, which need a GPU): a buffer is added only while every one is still being uploaded, up to the
    limit; then the host waits for the one used longest ago, and buffers are used in turn."""
    class Upload:  # an event recorded after a buffer's upload
        def __init__(self, name, done=False):
            self.name, self.done, self.waited = name, done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

    def ring():
        worker = execute._Worker(None, torch.device("cpu"), pinned_buffers=3, chunk_bytes=64)
        worker.device = torch.device("cuda")  # the ring's GPU rules, without a stream
        monkeypatch.setattr(worker, "_buffer", lambda nbytes: torch.empty(64 + execute.ALIGN_SLACK, dtype=torch.uint8))
        return worker, []

    def stage(worker, used, name, done=False):
        i = worker._slot(64)
        used.append(worker.host[i].data_ptr())
        worker.events[i] = Upload(name, done)
        return worker.events[i]

    worker, used = ring()
    a = stage(worker, used, "a")
    b = stage(worker, used, "b")  # a still uploading: a second buffer
    a.done = True
    c = stage(worker, used, "c")  # next in line is a's buffer, free again: reused
    assert len(worker.host) == 2 and used[2] == used[0]
    d = stage(worker, used, "d")  # next in line is b's buffer, still uploading: a third
    assert len(worker.host) == 3 and len(set(used)) == 3
    stage(worker, used, "e")  # at the limit: waits for the upload started longest ago (b), not the newer c
    assert b.waited and not c.waited and not d.waited and used[4] == used[1]
    stage(worker, used, "f")  # then c, then d: in the order they were used
    assert c.waited and not d.waited and used[5] == used[2]

    worker, used = ring()
    stage(worker, used, "x", done=True)
    stage(worker, used, "y", done=True)  # the upload before it is done: its buffer again, nothing more pinned
    assert len(worker.host) == 1 and used[0] == used[1]
    assert len(worker.on_device) == len(worker.events) == len(worker.host)


def test_a_worker_that_fails_to_finish_neither_hides_the_failed_read_nor_leaves_the_others_unfinished(
        stored, monkeypatch):
    """Every worker is waited for (on a GPU: its copies still in flight), even when one fails to finish; a
    failed read's error is the one raised, and a worker's failure to finish is raised when no read failed."""
    monkeypatch.setattr(execute, "READ_CHUNK_BYTES", 4096)  # many groups: every thread gets a worker
    monkeypatch.setattr(execute, "MIN_CHUNK_BYTES", 4096)
    finished = []
    first = [True]

    def finish(self):
        finished.append(self)
        if first[0]:
            first[0] = False
            raise RuntimeError("the device stream failed")

    monkeypatch.setattr(execute._Worker, "finish", finish)
    real = Checkpoint.read_contiguous
    wait_for_a_second_reader = SecondThreadGate()

    def gated(self, parts, **options):
        wait_for_a_second_reader()
        return real(self, parts, **options)

    def fail_one(self, parts, **options):
        wait_for_a_second_reader()
        if any(part[0] == "small.150" for part in parts):
            raise OSError(5, "Input/output error")
        return real(self, parts, **options)

    monkeypatch.setattr(Checkpoint, "read_contiguous", fail_one)
    with pytest.raises(fsdp_restore.RestoreError, match="Input/output error") as info:
        fsdp_restore.restore_model(Mixed(), stored, check=False, thread_count=4)
    assert "device stream failed" not in str(info.value)
    assert len(finished) >= 2 and len(set(map(id, finished))) == len(finished)
    monkeypatch.setattr(Checkpoint, "read_contiguous", gated)
    finished.clear()
    wait_for_a_second_reader.reset()
    first[0] = True
    with pytest.raises(fsdp_restore.RestoreError, match="device stream failed"):
        fsdp_restore.restore_model(Mixed(), stored, check=False, thread_count=4)
    assert len(finished) >= 2


class _Interrupted(Exception):
    """What a signal handler raised in the restoring thread (as Ctrl-C's KeyboardInterrupt would)."""


def test_an_interrupted_read_leaves_no_read_running_into_the_model(tmp_path, monkeypatch):
    """A restore interrupted while its threads read (Ctrl-C, a SIGTERM handler that raises) must not return with
    reads still landing in the model: a second restore's NaN fill and check would not see them land after it."""
    import os
    import signal
    import threading
    import time

    from safetensors.torch import save_file

    from fsdp_restore.plan import ReadItem

    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.arange(1 << 18, dtype=torch.float32)}, path)
    ckpt = Checkpoint(path)
    dest = torch.full((1 << 18,), -1.0)
    reads = []
    real = Checkpoint.read_contiguous

    def slow(self, parts, **kwargs):  # slow storage: 20 ms a read, 64 reads on 4 threads
        time.sleep(0.02)
        reads.append(1)
        return real(self, parts, **kwargs)

    def interrupt(signum, frame):
        raise _Interrupted()

    monkeypatch.setattr(Checkpoint, "read_contiguous", slow)
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(_Interrupted):
            execute.execute_reads(ckpt, [ReadItem("w", 0, dest, "w", 0, 1 << 18)], threads=4, chunk_bytes=16 * 1024)
            time.sleep(5)  # (if the reads finished first, the signal lands here)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    at_return = (len(reads), int((dest >= 0).sum()))
    time.sleep(0.3)  # 15 more reads' time
    assert (len(reads), int((dest >= 0).sum())) == at_return, "reads went on after the restore returned"
    assert at_return[0] < 64  # it was interrupted mid-read


def test_a_restore_on_another_thread_growing_the_read_threads_does_not_break_this_one(tmp_path, monkeypatch):
    """Two restores in one process (threads of a server, say), the second asking for more read threads just as the
    first hands its reads to the pool: the pool is replaced and the old one shut down, which must not refuse the
    first restore's reads (it did: 'cannot schedule new futures after shutdown')."""
    import threading

    from safetensors.torch import save_file

    from fsdp_restore.plan import ReadItem

    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.arange(1 << 16, dtype=torch.float32)}, path)
    real_lock = threading.Lock()

    class OtherRestoreOnRelease:
        """The pool's lock; when this restore first lets go of it, the other restore grows the pool."""

        fired = False

        def __enter__(self):
            return real_lock.__enter__()

        def __exit__(self, *exc):
            real_lock.__exit__(*exc)
            if not OtherRestoreOnRelease.fired:
                OtherRestoreOnRelease.fired = True
                other = threading.Thread(target=execute.execute_reads, args=(
                    Checkpoint(path), [ReadItem("w", 0, torch.empty(1 << 16), "w", 0, 1 << 16)]),
                    kwargs={"threads": 12, "chunk_bytes": 4096})
                other.start()
                other.join()

    monkeypatch.setattr(execute, "_pool", None)
    monkeypatch.setattr(execute, "_pool_size", 0)
    monkeypatch.setattr(execute, "_pool_lock", OtherRestoreOnRelease())
    dest = torch.empty(1 << 16)
    execute.execute_reads(Checkpoint(path), [ReadItem("w", 0, dest, "w", 0, 1 << 16)], threads=4, chunk_bytes=4096)
    assert OtherRestoreOnRelease.fired and torch.equal(dest, torch.arange(1 << 16, dtype=torch.float32))
