"""Segmented crc32: the joined checksum equals zlib's over the whole, and a tensor split across threads
is written, checksummed and verified exactly as one written in a single pass."""

import threading
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import fsdp_restore
from fsdp_restore import checksum, verify, write
from fsdp_restore.format import read_header
from fsdp_restore.read import Checkpoint
from helpers import SecondThreadGate


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=600), max_size=6))
def test_joined_segments_equal_crc32_of_the_whole(parts):
    joined = checksum.combine_segments((zlib.crc32(p), len(p)) for p in parts)
    assert joined == zlib.crc32(b"".join(parts))


@given(st.integers(0, 2**32 - 1), st.integers(1, 2**40))
def test_joining_onto_a_zero_crc_is_the_segment_itself(crc, nbytes):
    """What `combine_segments` skips the join for: a first segment (crc 0 before it) keeps its own crc32."""
    assert checksum.crc32_combine(0, crc, nbytes) == crc


def test_combine_handles_gigabyte_lengths():
    zeros = bytes(64 << 20)
    head = zlib.crc32(b"head")
    whole, tail = head, 0  # crc32 of head + 1 GB of zeros, and of the zeros alone, the slow way
    for _ in range(16):
        whole, tail = zlib.crc32(zeros, whole), zlib.crc32(zeros, tail)
    assert checksum.crc32_combine(head, tail, 1 << 30) == whole


@given(st.integers(0, 10_000), st.sampled_from([1, 2, 4, 8]), st.integers(1, 5_000))
def test_split_elements_tiles_the_range_within_the_limit(numel, itemsize, max_bytes):
    ranges = checksum.split_elements(numel, itemsize, max_bytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if len(ranges) > 1:
        assert all(0 < (stop - start) * itemsize <= max(max_bytes, itemsize) for start, stop in ranges)


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of 64 KB instead of 64 MB, so that a small test tensor is split across threads."""
    monkeypatch.setattr(checksum, "SEGMENT_MIN_BYTES", 64 * 1024)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_big_tensor_is_split_across_threads_and_stored_exactly(tmp_path, monkeypatch, dtype):
    src = tmp_path / "src.pt"
    big = torch.randn(1_000_003)  # odd length: pieces end mid-block
    torch.save({"model": {"embed": big, "bias": torch.randn(7)}, "step": 5}, src)
    monkeypatch.setattr(write, "BLOCK_BYTES", 64 * 1024)  # blocks of 64 KB, so that the tensor spans many
    writers: dict[tuple[int, int], int] = {}
    real = write._write_block
    wait_for_a_second_writer = SecondThreadGate()

    def recording(block, progress):
        wait_for_a_second_writer()
        for piece in block.pieces:
            if piece.job.key == "model.embed":
                size = piece.job.dtype.itemsize
                writers[(piece.first // size, (piece.first + piece.nbytes) // size)] = threading.get_ident()
        return real(block, progress)

    monkeypatch.setattr(write, "_write_block", recording)
    dst = tmp_path / "out.safetensors"
    fsdp_restore.convert(src, dst, thread_count=3, dtype=dtype)

    ranges = sorted(writers)
    assert len(ranges) > 3 and ranges[0][0] == 0 and ranges[-1][1] == big.numel()
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(set(writers.values())) > 1  # really written by several threads
    expected = big if dtype is None else big.to(dtype)
    assert torch.equal(load_file(dst)["model.embed"].view(torch.uint8), expected.view(torch.uint8))
    stored = Checkpoint(dst).checksums["model.embed"]
    assert stored == f"{zlib.crc32(expected.view(torch.uint8).numpy()):08x}"
    report = verify(dst, against=src, thread_count=3)
    assert report.ok and report.compared == 2, report.problems


def test_verify_of_a_split_tensor_finds_a_flipped_byte_in_a_late_segment(tmp_path, small_segments):
    src = tmp_path / "src.pt"
    torch.save({"embed": torch.randn(500_000)}, src)
    dst = tmp_path / "out.safetensors"
    fsdp_restore.convert(src, dst, thread_count=2)
    entry = read_header(dst).entries["embed"]
    data = bytearray(dst.read_bytes())
    data[entry.offset + 1_900_001] ^= 0x01  # element 475,000: in the last segment
    dst.write_bytes(bytes(data))

    problems = dict(verify(dst, thread_count=2).problems)
    assert "checksum mismatch" in problems["embed"]
    against = verify(dst, against=src, thread_count=2).problems
    assert [k for k, _ in against] == ["embed", "embed"]
    assert any("first at index [475000]" in m for _, m in against)  # the oracle names the element
    assert any("checksum mismatch" in m for _, m in against)


def test_crc_of_zeros_is_zlibs():
    """crc32 of n zero bytes from the register's shift alone (its powers cached by n), as zlib computes it by
    reading them (the save joins its ranks' folds with it, the restore's proof its placed pieces)."""
    from fsdp_restore.checksum import zeros_crc

    for n in (0, 1, 2, 3, 8, 255, 4096, 65_537, 1 << 20, 3_000_001):
        assert zeros_crc(n) == zlib.crc32(bytes(n)), n
        assert zeros_crc(n) == zlib.crc32(bytes(n)), n  # the cached answer too


_FRESH_THREADS = r"""
import sys, threading, zlib
sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows: a race shows at once
from fsdp_restore import checksum
sizes = [(1 << k) + 3 for k in range(4, 21)]
start, results = threading.Barrier(8), {}
def work(i):
    start.wait()
    results[i] = [checksum.zeros_crc(n) for n in sizes[i % 3:] + sizes[:i % 3]]
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
expected = {n: zlib.crc32(bytes(n)) for n in sizes}
wrong = sorted({n for i, got in results.items() for n, c in zip(sizes[i % 3:] + sizes[:i % 3], got) if c != expected[n]})
print(wrong)
"""


def test_powers_are_right_when_threads_ask_first_at_once():
    """The save's writer threads (and the convert's and verify's) fold crc32s at once from a fresh process: the
    powers of x they share must not be built by two threads at once (a race that once shifted the table by one and
    wrote wrong checksums into a save's header)."""
    import subprocess
    import sys

    for _ in range(3):  # a fresh interpreter each time: nothing computed yet
        out = subprocess.run([sys.executable, "-c", _FRESH_THREADS], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]", f"wrong crc32 of zeros for sizes {out.stdout.strip()}"


def test_the_folded_crc32_is_zlibs_on_every_length_and_start():
    """The writers' crc32 (`checksum.crc32`: the folded one where built, `_crc32.c`) against zlib's own, on every
    length through the folding's thresholds (64 bytes, then 16 at a time, then a byte table for the tail), from
    starting values that exercise the register, and on large buffers and the buffer types the writers pass."""
    import os
    import random

    import numpy as np

    from fsdp_restore import checksum

    native = pytest.importorskip("fsdp_restore._crc32")
    if not native.has_pclmul():
        pytest.skip("no PCLMULQDQ on this CPU: the writers use zlib's crc32")
    rng = random.Random(0)
    data = os.urandom(4096 + 700)
    for n in range(0, 700):
        for value in (0, 1, 0xFFFFFFFF, rng.getrandbits(32)):
            piece = data[n % 97:n % 97 + n]
            assert native.crc32(piece, value) == zlib.crc32(piece, value), (n, value)
    for n in (1 << 16, (1 << 16) + 1, (1 << 20) + 13, 5 << 20):  # (the GIL released from 64 KB)
        piece = os.urandom(n)
        assert native.crc32(piece) == zlib.crc32(piece)
    array = np.frombuffer(data, dtype=np.uint8)[3:4000]
    assert native.crc32(memoryview(data)[5:3000], 7) == zlib.crc32(memoryview(data)[5:3000], 7)
    assert native.crc32(array) == zlib.crc32(array)
    assert checksum.crc32 is native.crc32  # the writers take it


def test_the_writers_take_zlibs_crc32_when_told():
    import subprocess
    import sys

    code = "import zlib; from fsdp_restore import checksum; print(checksum.crc32 is zlib.crc32)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "FSDP_RESTORE_NATIVE": "0"})
    assert out.stdout.strip() == "True", out.stderr
