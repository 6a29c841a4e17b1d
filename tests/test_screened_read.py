"""The check's read of host memory (`screened_read`, and its C extension where built): what lands in memory is the
file's bytes, read back with Python's own ``open().read()``; what is flagged is what torch's ``isnan`` finds in
those bytes (or the NaN fill left where the file ended). Both the native and the Python path, any window."""

from __future__ import annotations

import errno
import os
import shutil
import sysconfig

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_restore import screened_read
from fsdp_restore.screened_read import floating, pread_screened

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.int64, torch.uint8,
          torch.bool, torch.float8_e4m3fn]
NATIVE = [pytest.param(True, id="native"), pytest.param(False, id="python")]


def _buffers(dests: list[torch.Tensor]) -> list:
    """``(address, nbytes, dtype)`` of each: what `pread_screened` reads into."""
    return [(d.data_ptr(), d.numel() * d.element_size(), d.dtype) for d in dests]


def _values(dtype: torch.dtype, n: int, seed: int, nan_at: int | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(0, 100, (n,), generator=g).to(dtype)
    values = torch.randn(n, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)
    if nan_at is not None and n:
        values[nan_at % n] = float("nan")
    return values


@st.composite
def _layouts(draw):
    """Tensors back to back in a file after some leading bytes, some holding a NaN of their own."""
    count = draw(st.integers(1, 6))
    tensors = []
    for i in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        n = draw(st.integers(0, 300))
        nan_at = draw(st.none() | st.integers(0, 299))
        tensors.append(_values(dtype, n, seed=i, nan_at=nan_at))
    return draw(st.integers(0, 9)), tensors, draw(st.sampled_from([1, 7, 64, 1000, 4096, screened_read.WINDOW_BYTES]))


def _write(path, lead: int, tensors: list[torch.Tensor]) -> bytes:
    data = b"\x5a" * lead + b"".join(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors)
    path.write_bytes(data)
    with open(path, "rb") as f:  # the oracle: the bytes as Python reads them
        return f.read()


@pytest.mark.parametrize("native", NATIVE)
@settings(max_examples=60, deadline=None)
@given(layout=_layouts())
def test_the_files_bytes_land_and_only_nan_is_flagged(tmp_path_factory, native, layout):
    if native and screened_read._screened is None:
        pytest.skip("the C extension is not built")
    lead, tensors, window = layout
    path = tmp_path_factory.mktemp("screened") / "data.bin"
    data = _write(path, lead, tensors)
    dests = [torch.full_like(t, 7) if t.dtype != torch.bool else torch.ones_like(t) for t in tensors]
    fd = os.open(path, os.O_RDONLY)
    try:
        if native:  # the extension itself, at any window (the module's own window is one constant)
            kinds = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4, torch.complex64: 3}
            if any(floating(d.dtype) and d.dtype not in kinds for d in dests):
                got, flagged, filled = pread_screened(fd, _buffers(dests), lead)
            else:
                buffers = [(d.data_ptr(), d.numel() * d.element_size(), kinds.get(d.dtype, 0), d.element_size())
                           for d in dests]
                got, flagged, filled = screened_read._screened.pread_screened(fd, buffers, lead, window)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("FSDP_RESTORE_NATIVE", "0")
                got, flagged, filled = pread_screened(fd, _buffers(dests), lead)
    finally:
        os.close(fd)
    assert got == len(data) - lead
    at = lead
    for i, dest in enumerate(dests):
        nbytes = dest.numel() * dest.element_size()
        assert bytes(dest.view(torch.uint8).numpy().tobytes() if dest.numel() else b"") == data[at:at + nbytes]
        stored = torch.frombuffer(bytearray(data[at:at + nbytes]), dtype=torch.uint8).view(dest.dtype) if nbytes \
            else dest
        holds_nan = floating(dest.dtype) and bool(torch.isnan(stored).any())
        assert (i in flagged) == holds_nan, (i, dest.dtype, flagged)
        assert filled[i] == (nbytes if floating(dest.dtype) else 0)
        at += nbytes


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_where_the_file_ends_the_fill_is_left_and_flagged(tmp_path, monkeypatch, native, dtype):
    """A file that ends inside the second tensor: the bytes it has land, the rest is still the NaN fill (not what
    the memory held before), and that tensor is flagged."""
    if native and screened_read._screened is None:
        pytest.skip("the C extension is not built")
    monkeypatch.setenv("FSDP_RESTORE_NATIVE", "1" if native else "0")
    first, second = torch.arange(100, dtype=dtype), torch.arange(100, 300, dtype=dtype)
    data = _write(tmp_path / "short.bin", 0, [first, second])[:-40 * first.element_size()]
    (tmp_path / "short.bin").write_bytes(data)
    dests = [torch.zeros_like(first), torch.zeros_like(second)]
    fd = os.open(tmp_path / "short.bin", os.O_RDONLY)
    try:
        got, flagged, _ = pread_screened(fd, _buffers(dests), 0)
    finally:
        os.close(fd)
    assert got == len(data)
    assert flagged == [1]
    assert torch.equal(dests[0], first) and torch.equal(dests[1][:160], second[:160])
    assert torch.isnan(dests[1][160:]).all()


@pytest.mark.parametrize("native", NATIVE)
def test_a_failed_read_raises_the_systems_error(tmp_path, monkeypatch, native):
    if native and screened_read._screened is None:
        pytest.skip("the C extension is not built")
    monkeypatch.setenv("FSDP_RESTORE_NATIVE", "1" if native else "0")
    dest = torch.zeros(10)
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: read() fails with EISDIR
    try:
        with pytest.raises(OSError) as info:
            pread_screened(fd, _buffers([dest]), 0)
    finally:
        os.close(fd)
    assert info.value.errno == errno.EISDIR


def test_the_extension_refuses_a_buffer_it_cannot_screen():
    if screened_read._screened is None:
        pytest.skip("the C extension is not built")
    dest = torch.zeros(10)
    with pytest.raises(ValueError, match="kind 9"):
        screened_read._screened.pread_screened(0, [(dest.data_ptr(), 40, 9, 4)], 0, 4096)
    with pytest.raises(ValueError, match="-4 bytes of 4-byte items"):  # (it wrapped to 2**64 - 4 and overran)
        screened_read._screened.pread_screened(0, [(dest.data_ptr(), -4, 3, 4)], 0, 4096)
    with pytest.raises(ValueError, match="40 bytes of 3-byte items"):
        screened_read._screened.pread_screened(0, [(dest.data_ptr(), 40, 3, 3)], 0, 4096)
    with pytest.raises(TypeError, match="each buffer is"):
        screened_read._screened.pread_screened(0, [(dest.data_ptr(), 40)], 0, 4096)
    with pytest.raises(ValueError, match="negative offset"):
        screened_read._screened.pread_screened(0, [], -1, 4096)


def test_the_extension_is_built_where_a_c_compiler_is():
    """The install builds it where it can (setup.py, optional): a silent fallback would hide the check's speed."""
    if not (shutil.which("cc") or shutil.which("gcc")) or not os.path.exists(
            os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no C compiler or no Python headers here: the Python path is used")
    assert screened_read._screened is not None, (
        "fsdp_restore._screened was not built although a C compiler is here: pip install -e . builds it")


def _patterns(dtype: torch.dtype) -> torch.Tensor:
    """Bit patterns of ``dtype`` to screen one by one: every one for 16-bit floats; for wider ones the edges of the
    NaN range (infinities, the smallest and largest NaN of each sign, their neighbours) and random patterns."""
    bits = {torch.float32: 32, torch.float64: 64}.get(dtype, 16)
    if bits == 16:
        return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    inf = {32: 0x7F800000, 64: 0x7FF0000000000000}[bits]
    top = (1 << (bits - 1)) - 1
    edges = [0, 1, inf - 1, inf, inf + 1, inf + 2, top - 1, top]
    signed = edges + [e | (1 << (bits - 1)) for e in edges]
    g = torch.Generator().manual_seed(0)
    idtype = torch.int32 if bits == 32 else torch.int64
    randoms = torch.randint(-2**31 if bits == 32 else -2**62, 2**31 - 1 if bits == 32 else 2**62, (20000,),
                            generator=g, dtype=idtype)
    values = torch.tensor([v - (1 << bits) if v >= 1 << (bits - 1) else v for v in signed], dtype=idtype)
    return torch.cat([values, randoms, randoms | inf]).view(dtype)  # (| inf: NaN or infinity, mostly NaN)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_screen_flags_exactly_the_nan_patterns(tmp_path, monkeypatch, native, dtype):
    """One buffer per element, every 16-bit pattern and the edges of the NaN range of the wider formats: a buffer is
    flagged exactly where torch's ``isnan`` says its value is NaN (infinities, zeros and the largest finite values
    are not)."""
    if native and screened_read._screened is None:
        pytest.skip("the C extension is not built")
    monkeypatch.setenv("FSDP_RESTORE_NATIVE", "1" if native else "0")
    values = _patterns(dtype)
    _write(tmp_path / "patterns.bin", 0, [values])
    dest = torch.zeros_like(values)
    size = dest.element_size()
    fd = os.open(tmp_path / "patterns.bin", os.O_RDONLY)
    try:
        got, flagged, _ = pread_screened(fd, [(dest.data_ptr() + i * size, size, dtype) for i in range(len(dest))], 0)
    finally:
        os.close(fd)
    assert got == len(values) * size and torch.equal(dest.view(torch.uint8), values.view(torch.uint8))
    assert flagged == torch.isnan(values.float() if dtype != torch.float64 else values).nonzero().flatten().tolist()
