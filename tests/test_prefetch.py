"""prefetch.py: the head of a source is read into the page cache from a background thread, and no further.
Residency is read with cachestat(2) (ctypes), not with anything of ours."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest

from fsdp_restore.prefetch import start_prefetch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and cachestat: Linux")

PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_CACHESTAT = 451  # the cachestat(2) system call (Linux 6.5; the same number on every architecture)


def _cached_pages(path, offset: int, nbytes: int) -> int:
    """How many pages of ``path[offset:offset + nbytes]`` are in the page cache (cachestat(2)). Not mincore:
    current kernels report a file's residency through mincore only for pages mapped by the caller."""
    libc = ctypes.CDLL(None, use_errno=True)
    stat = _Stat()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(offset, nbytes)), ctypes.byref(stat), 0) != 0:
            pytest.skip(f"cachestat(2) is not available here (errno {ctypes.get_errno()})")
    finally:
        os.close(fd)
    return stat.nr_cache


def _evicted_file(tmp_path, nbytes):
    path = tmp_path / "src.pt"
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())  # clean pages can be dropped without privileges
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    return path


def test_the_head_is_read_and_nothing_past_the_limit(tmp_path):
    chunk = 256 * PAGE
    path = _evicted_file(tmp_path, 8 * chunk)
    if _cached_pages(path, 0, 8 * chunk):
        pytest.skip("this file system keeps the pages cached despite POSIX_FADV_DONTNEED")
    thread = start_prefetch(path, max_bytes=2 * chunk)
    assert thread is not None
    thread.join(30)
    assert _cached_pages(path, 0, 2 * chunk) == 2 * chunk // PAGE
    assert _cached_pages(path, 4 * chunk, 4 * chunk) == 0  # well past the limit: not asked for


def test_a_head_larger_than_one_readahead_is_read_whole(tmp_path):
    """Linux caps each POSIX_FADV_WILLNEED at the device's readahead size (8 MB on the benchmark's disk, often
    less): the head is asked for in steps under that cap, or most of it would never be read."""
    nbytes = 64 << 20
    path = _evicted_file(tmp_path, nbytes)
    if _cached_pages(path, 0, nbytes):
        pytest.skip("this file system keeps the pages cached despite POSIX_FADV_DONTNEED")
    thread = start_prefetch(path, max_bytes=nbytes)
    assert thread is not None
    thread.join(60)
    assert _cached_pages(path, 0, nbytes) == nbytes // PAGE


def test_a_zip_archives_directory_is_read_first(tmp_path):
    """torch.save's archive ends with its central directory, which a conversion reads before anything else: it is
    asked for first (asked for in file order it would come after the whole file), then the head."""
    import torch

    path = tmp_path / "src.pt"
    torch.save({f"t{i}": torch.zeros(1024) for i in range(2000)}, path)  # 2,000 records of 4 KB: 8 MB
    with open(path, "rb") as f:
        f.seek(-22, os.SEEK_END)
        directory_at = int.from_bytes(f.read(22)[16:20], "little")
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _cached_pages(path, 0, size):
        pytest.skip("this file system keeps the pages cached despite POSIX_FADV_DONTNEED")
    thread = start_prefetch(path, max_bytes=size - directory_at + 16 * PAGE)
    assert thread is not None
    thread.join(30)
    assert _cached_pages(path, directory_at, size - directory_at) >= (size - directory_at) // PAGE  # all of it
    assert _cached_pages(path, 0, 16 * PAGE) == 16  # then the head, as the budget allows
    assert _cached_pages(path, size // 3, size // 3) == 0  # not the rest


@pytest.mark.parametrize("tail,expected", [
    (b"x" * 100, None),  # not a zip archive: from the head
    (b"PK\x06\x06" + bytes(44) + (123).to_bytes(8, "little") + b"PK\x06\x07" + bytes(16)
     + b"PK\x05\x06" + bytes(12) + b"\xff" * 4 + bytes(2), 123),  # zip64: the offset from its end record
    (b"PK\x05\x06" + bytes(12) + (40).to_bytes(4, "little") + bytes(2), 40),
    (b"PK\x05\x06" + bytes(12) + (10 ** 6).to_bytes(4, "little") + bytes(2), None),  # past the end: from the head
])
def test_where_the_directory_lies_is_read_from_the_end_records_alone(tmp_path, tail, expected):
    from fsdp_restore.prefetch import _file_ranges

    path = tmp_path / "f"
    path.write_bytes(b"PK\x03\x04" + bytes(196) + tail)
    size = path.stat().st_size
    assert _file_ranges(path) == ([(0, size)] if expected is None else [(expected, size - expected), (0, expected)])


def test_nothing_to_do_for_a_directory_or_a_missing_file(tmp_path):
    assert start_prefetch(tmp_path) is None
    assert start_prefetch(tmp_path / "missing.pt") is None
    assert start_prefetch(_evicted_file(tmp_path, PAGE), max_bytes=0) is None


# ---- a ZeRO directory's pickles are sketched in a child process ---------------------------------------------------

_HUGE_MEMO = b"\x80\x02K\x01r\xff\xff\xff\xff."  # PUT at index 2**32 - 1: the C unpickler zeroes a 64 GiB memo table
_DEEP_KEY = b"\x80\x02}N" + b"\x85" * 3_000_000 + b"K\x01s."  # a tuple nested 3M deep as a dict key: its hash
#                                                              exhausts the C stack


def _zero_dir(tmp_path, pickles: dict[str, bytes | None]):
    """A DeepSpeed-shaped directory: ``latest`` and one optimizer file per entry (name -> its pickle, or None
    for a real torch.save of fp32 masters)."""
    import zipfile

    import torch

    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    files = {}
    for rank, (name, pkl) in enumerate(pickles.items()):
        path = tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        if pkl is None:
            torch.save({"optimizer_state_dict": {"single_partition_of_fp32_groups": [torch.ones(4096)]}}, path)
        else:
            with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
                z.writestr("archive/data.pkl", pkl)
        files[name] = path
    return tmp_path / "ckpt", files


def test_a_hostile_pickle_ends_the_sketching_child_not_this_process(tmp_path):
    """A memo index that would zero 64 GiB, and a key whose hash exhausts the C stack: the sketching child dies
    (its address space is capped; a crash is its own), the real file beside them still gets its ranges, and
    this process neither grows nor crashes (run in a fresh process to read its peak memory)."""
    import subprocess

    from fsdp_restore.prefetch import _isolated_zero_ranges

    ckpt, files = _zero_dir(tmp_path, {"memo": _HUGE_MEMO, "real": None})
    got = dict(_isolated_zero_ranges([files["memo"], files["real"]], weights_only=True))
    assert got[files["memo"]] == [] and len(got[files["real"]]) == 1  # the masters' storage, and only it
    _, deep = _zero_dir(tmp_path / "deep", {"deep": _DEEP_KEY})
    assert dict(_isolated_zero_ranges([deep["deep"]], weights_only=False)) == {}  # the child crashed: no line
    script = ("import sys; from fsdp_restore.prefetch import start_prefetch;"
              f"t = start_prefetch({str(ckpt)!r}, select='model'); t.join(120); assert not t.is_alive();"
              f"t = start_prefetch({str(deep['deep'].parent.parent)!r}); t.join(120); assert not t.is_alive();"
              "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    # this process's peak (VmHWM, KiB: ru_maxrss would count the forking parent's memory before exec)
    assert int(res.stdout.strip()) < 200 * 1024, res.stdout


def test_the_sketching_child_leaves_no_open_pipe(tmp_path):
    """The CLI shows warnings, so a pipe left for the collector was a 'ResourceWarning: unclosed file' line in
    every ZeRO conversion's output."""
    import gc
    import warnings

    from fsdp_restore.prefetch import _isolated_zero_ranges

    _, files = _zero_dir(tmp_path, {"real": None})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(dict(_isolated_zero_ranges([files["real"]], weights_only=True))) == 1
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


# ---- a file's read-ahead runs in a process of its own ------------------------------------------------------------

def test_a_files_read_ahead_is_made_by_a_process_of_its_own_while_its_parent_lives(tmp_path):
    """`advise`'s script, as `start_prefetch` runs it (isolated, without site-packages: it imports nothing of this
    package), reads the ranges asked for while the process named as its parent is its parent; named as the child
    of another (its parent ended, and it was handed on), it reads nothing more."""
    import subprocess

    from fsdp_restore.advise import command

    nbytes = 16 << 20
    path = _evicted_file(tmp_path, nbytes)
    if _cached_pages(path, 0, nbytes):
        pytest.skip("this file system keeps the pages cached despite POSIX_FADV_DONTNEED")
    orphaned = command(path, [(0, nbytes)], nbytes)
    orphaned[4] = "-1"  # the parent it was started by: not this process (nor init, where pytest runs as pid 1)
    subprocess.run(orphaned, check=True, timeout=60)
    assert _cached_pages(path, 0, nbytes) == 0
    subprocess.run(command(path, [(nbytes // 2, nbytes // 2), (0, PAGE)], nbytes), check=True, timeout=60)
    assert _cached_pages(path, nbytes // 2, nbytes // 2) == nbytes // 2 // PAGE
    assert _cached_pages(path, 0, PAGE) == 1 and _cached_pages(path, PAGE, nbytes // 2 - PAGE) == 0


def test_a_fifo_in_the_files_place_does_not_hold_the_read_ahead(tmp_path):
    """A FIFO put where the source was (after the command saw a file) would block a plain open until a writer came:
    the read-ahead's process would outlive the command, waiting. It opens without blocking and reads regular files
    only."""
    import threading

    from fsdp_restore.advise import advise

    fifo = tmp_path / "src.pt"
    os.mkfifo(fifo)
    done = threading.Thread(target=advise, args=(fifo, [(0, PAGE)], [PAGE]), daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive()


def test_without_an_interpreter_to_start_the_thread_reads_ahead_itself(tmp_path, monkeypatch):
    """A frozen or embedded build's sys.executable is its host program (or empty): no process is started, and the
    read-ahead is asked for by the thread, as it was before it had a process of its own."""
    nbytes = 4 << 20
    path = _evicted_file(tmp_path, nbytes)
    if _cached_pages(path, 0, nbytes):
        pytest.skip("this file system keeps the pages cached despite POSIX_FADV_DONTNEED")
    monkeypatch.setattr(sys, "executable", "")
    thread = start_prefetch(path, max_bytes=nbytes)
    assert thread is not None
    thread.join(60)
    assert _cached_pages(path, 0, nbytes) == nbytes // PAGE
