"""The block writer (write.py): a file cut into fixed blocks that threads fill and write, directly to the
device where the file system allows it. Every test reads the result back with safetensors' own reader
and compares bytes, and checks the stored crc32 against zlib's over those bytes."""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fsdp_restore import write
from fsdp_restore.convert import save
from fsdp_restore.read import Checkpoint


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 KB instead of 32 MB, so that small test tensors span blocks and blocks hold several."""
    monkeypatch.setattr(write, "BLOCK_BYTES", 8192)


def _check_stored(dst: Path, expected: dict[str, torch.Tensor]) -> None:
    got = load_file(dst)
    sums = Checkpoint(dst).checksums
    for key, tensor in expected.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), raw), key
        assert sums[key] == f"{zlib.crc32(raw.numpy()):08x}", key


@st.composite
def _strided(draw):
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    base = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    t = base.permute(*draw(st.permutations(range(len(shape)))))
    if draw(st.booleans()) and t.shape[-1] > 1:
        t = t[..., ::2]
    n = t.numel()
    first = draw(st.integers(0, n))
    return t, first, draw(st.integers(first, n))


@settings(max_examples=300, deadline=None)
@given(_strided())
def test_flat_range_of_a_strided_tensor_is_its_row_major_elements(case):
    t, first, stop = case
    parts = write.flat_range(t, first, stop)
    got = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.empty(0, dtype=t.dtype)
    assert torch.equal(got, t.reshape(-1)[first:stop])
    assert sum(p.numel() for p in parts) == stop - first
    assert len(parts) <= 2 * t.dim() + 1


def test_tensors_that_straddle_blocks_and_misaligned_offsets_are_stored_exactly(tmp_path, small_blocks):
    tensors = {
        "a_odd": torch.arange(4099, dtype=torch.uint8),  # odd length: what follows starts off its element size
        "b_f64": torch.randn(3001, dtype=torch.float64),  # so a block boundary cuts its elements
        "c_t": torch.randn(70, 90).t(),  # non-contiguous, written in pieces
        "d_small": torch.tensor([1, 2, 3], dtype=torch.int16),
        "e_empty": torch.empty(0, 5),
        "f_bf16": torch.randn(5000).to(torch.bfloat16),
    }
    dst = tmp_path / "out.safetensors"
    save(tensors, dst, thread_count=3)
    _check_stored(dst, tensors)


def test_a_header_longer_than_a_block(tmp_path, small_blocks):
    tensors = {f"layer.{i}.a_rather_long_parameter_name_to_make_the_header_big": torch.full((3,), float(i))
               for i in range(400)}
    dst = tmp_path / "out.safetensors"
    save(tensors, dst, thread_count=2)
    assert int.from_bytes(dst.read_bytes()[:8], "little") > 3 * write.BLOCK_BYTES
    _check_stored(dst, tensors)


def test_a_cast_is_written_in_blocks(tmp_path, small_blocks):
    source = {"w": torch.randn(10_001), "n": torch.randn(33, 7)}
    dst = tmp_path / "out.safetensors"
    save(source, dst, dtype=torch.bfloat16, thread_count=4)
    _check_stored(dst, {k: v.to(torch.bfloat16) for k, v in source.items()})


def test_where_the_file_system_refuses_o_direct_the_page_cache_is_used(tmp_path, monkeypatch, small_blocks):
    real_open, direct_opens = os.open, []

    def refusing(path, flags, *args, **kwargs):  # (os.open's signature: the readers pass dir_fd=)
        if flags & getattr(os, "O_DIRECT", 0):
            direct_opens.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    tensors = {"a": torch.randn(5000), "b": torch.arange(77, dtype=torch.int32)}
    dst = tmp_path / "out.safetensors"
    save(tensors, dst)
    assert direct_opens or not hasattr(os, "O_DIRECT")
    _check_stored(dst, tensors)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_tmpfs_destination(small_blocks):
    tensors = {"a": torch.randn(5000), "b": torch.arange(77, dtype=torch.int32)}
    dst = Path("/dev/shm") / f"fsdp_restore_test_{os.getpid()}.safetensors"
    try:
        save(tensors, dst)
        _check_stored(dst, tensors)
    finally:
        dst.unlink(missing_ok=True)


def test_sharded_output_in_blocks(tmp_path, small_blocks):
    tensors = {f"t{i}": torch.randn(1000 + 37 * i) for i in range(6)}
    dst = tmp_path / "set"
    paths = save(tensors, dst, max_shard_size=9000, thread_count=3)
    assert len(paths) > 2
    merged: dict[str, torch.Tensor] = {}
    for p in paths:
        merged.update(load_file(p))
    assert merged.keys() == tensors.keys()
    assert all(torch.equal(merged[k], v) for k, v in tensors.items())


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT")
def test_direct_writes_refused_after_the_open_go_on_through_the_page_cache(tmp_path, monkeypatch, small_blocks):
    import fcntl

    real_pwrite, refused = os.pwrite, []

    def refusing(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    tensors = {"a": torch.randn(5000), "b": torch.arange(777, dtype=torch.int32), "c": torch.randn(3, 7).t()}
    dst = tmp_path / "out.safetensors"
    save(tensors, dst, thread_count=3)
    _check_stored(dst, tensors)
    if not refused:
        pytest.skip("this file system refused O_DIRECT at the open already")


_KEYS = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_KEYS, st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]),
                                        st.integers(0, 5), st.integers(0, 2**32 - 1)), max_size=8),
       st.dictionaries(_KEYS, _KEYS, max_size=3))
def test_the_checksums_patched_into_a_header_give_the_header_built_with_them(entries, metadata):
    """`with_checksums` (the digits put in place, the header's own crc32 again) is `file_header` built anew with
    the checksums: the same bytes, for any key (quotes, backslashes, non-ASCII) and cast."""
    entries.pop("__metadata__", None)  # never a tensor's name (refused: test_format)
    jobs = [write.TensorJob(key, torch.empty((n,), dtype=dtype, device="meta"),
                            torch.float16 if dtype == torch.float32 and crc % 2 else dtype)
            for key, (dtype, n, crc) in entries.items()]
    sums = {key: f"{crc:08x}" for key, (_, _, crc) in entries.items()}
    placeholder, _ = write.file_header(jobs, metadata)
    assert write.with_checksums(placeholder, jobs, sums) == write.file_header(jobs, metadata, sums)[0]


@pytest.mark.parametrize("dtype,fits,beyond", [
    (torch.float8_e4m3fn, [463.0, 464.0, -464.0, 448.0], [465.0, -465.0, 1e6]),  # 464: a tie, to even 448
    (torch.float8_e5m2, [61439.0, -61439.0], [61440.0, -61440.0]),  # 61440: a tie, to even: inf
    (torch.float8_e4m3fnuz, [247.0], [248.0, -1e6]),
])
def test_a_cast_into_float8_counts_what_leaves_its_range(dtype, fits, beyond):
    """What a cast into float8 makes inf or NaN, or (e4m3fn, which has no inf) saturates to its largest value, is
    counted; what rounds to that largest value by ordinary rounding (a tie included, where it goes to even) is not.
    torch's own cast shows which is which; a float8 source (which torch cannot abs or isfinite) counts too. A
    stored inf counts where the dtype has no infinity (e4m3fn saturates it to 448, e4m3fnuz makes it NaN)."""
    top = torch.finfo(dtype).max
    src = torch.tensor(fits + beyond + [float("inf"), float("nan")])
    out = src.to(dtype)
    assert all(abs(float(v)) == top for v in out[:len(fits)].float()[[abs(f) > top for f in fits]])  # torch's view
    assert write.cast_overflow(src.dtype, out, lambda: src) == len(beyond) + (dtype != torch.float8_e5m2)
    wide = torch.tensor([1.0, -2.0, 224.0]).to(torch.float8_e5m2)  # float8 into float8, all in range
    assert write.cast_overflow(wide.dtype, wide.to(dtype), lambda: wide) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reader_is_asked_once_per_piece_whatever_the_cast_steps(monkeypatch, dtype):
    """A cast runs in steps of `write.CAST_STAGING_BYTES`, but a tensor held in pieces is read once per piece: a DCP
    tensor split by columns reloads every chunk on each read. Its bytes are the source's, cast by torch."""
    monkeypatch.setattr(write, "CAST_STAGING_BYTES", 256)  # 64 fp32 elements per step: 8 steps of this piece
    full = torch.arange(64 * 8, dtype=torch.float32)
    calls = []

    def reader(first: int, count: int) -> torch.Tensor:
        calls.append((first, count))
        return full[first:first + count].clone()

    job = write.TensorJob("w", torch.empty((64, 8), device="meta"), dtype, reader=reader)
    buffer = torch.zeros(4096, dtype=torch.uint8)
    write._copy_piece_into(write._Piece(job, 0, job.nbytes, 0), buffer)
    assert calls == [(0, 512)]
    assert torch.equal(buffer[:job.nbytes].view(dtype), full.to(dtype))


def test_what_before_write_raises_is_the_writes_error_with_nothing_written(tmp_path, monkeypatch, small_blocks):
    """``before_write`` (a proof that must pass before a byte is written): what it raises is the write's error,
    raised before any block is written, and nothing is left under any name."""
    hook = "before_write"
    tensors = {f"t{i}": torch.arange(1000.0) + i for i in range(6)}
    jobs = [write.TensorJob(k, t, t.dtype) for k, t in tensors.items()]
    written = []
    real = write._write_block
    monkeypatch.setattr(write, "_write_block", lambda *a: written.append(a) or real(*a))

    def fails() -> None:
        raise ValueError(f"{hook} says no ({len(written)} blocks written before)")

    with pytest.raises(ValueError, match=f"{hook} says no") as caught:
        write.write_safetensors(tmp_path / "out.safetensors", jobs, structure_json=None, threads=2, **{hook: fails})
    assert sorted(os.listdir(tmp_path)) == []
    assert "(0 blocks" in str(caught.value)
    monkeypatch.setattr(write, "_write_block", real)
    write.write_safetensors(tmp_path / "out.safetensors", jobs, structure_json=None, threads=2,
                            before_write=lambda: None)
    _check_stored(tmp_path / "out.safetensors", tensors)


def test_before_write_is_refused_for_a_write_made_by_several_ranks(tmp_path):
    """The other ranks would write their blocks without waiting for rank 0's proof: refused at the door, before any
    collective."""
    from fsdp_restore.share import Share

    job = write.TensorJob("t", torch.arange(4.0), torch.float32)
    with pytest.raises(ValueError, match="one process"):
        write.write_safetensors(tmp_path / "out.safetensors", [job], structure_json=None, threads=1,
                                share=Share(0, 2), before_write=lambda: None)
    assert not os.listdir(tmp_path)
