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


def test_nothing_to_do_for_a_directory_or_a_missing_file(tmp_path):
    assert start_prefetch(tmp_path) is None
    assert start_prefetch(tmp_path / "missing.pt") is None
    assert start_prefetch(_evicted_file(tmp_path, PAGE), max_bytes=0) is None
