"""`plain_cast`: the fp32 -> bf16 cast made with numpy gives torch's bits for every finite result, and declines
(None, nothing written) every input whose result is not finite. The oracle is torch's own cast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_restore.plain_cast import cast_f32_to_bf16

_ROUNDS_TO_INF = 0x7F7F_8000


def _torch_bits(bits: np.ndarray) -> np.ndarray:
    """torch's cast of these fp32 bit patterns to bf16, as uint16 bits."""
    source = torch.from_numpy(bits.astype(np.uint32).view(np.int32).copy()).view(torch.float32)
    return source.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _ours(bits: np.ndarray) -> tuple[np.ndarray, bool | None]:
    out = np.full(bits.size, 0xABCD, dtype=np.uint16)  # a value no test input gives: untouched stays visible
    large = cast_f32_to_bf16(bits.astype(np.uint32), out, np.empty(max(1, bits.size), dtype=np.uint32))
    return out, large


def _finite_after_cast(bits: np.ndarray) -> bool:
    return bool(((bits & 0x7FFF_FFFF) < _ROUNDS_TO_INF).all())


# edge cases: zeros, the smallest and largest denormals, ties to even on both sides, the last finite values and
# the first ones that round to inf, 255/256/257 around the whole-number limit
EDGES = [0x0000_0000, 0x8000_0000, 0x0000_0001, 0x807F_FFFF, 0x0000_8000, 0x0001_8000, 0x3F80_8000, 0x3F81_8000,
         0xBF80_8000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7F_7FFF, 0xFF7F_7FFF, 0x7F7F_8000, 0xFF7F_8000, 0x7F7F_FFFF,
         0x437F_0000, 0x4380_0000, 0x4380_8000, 0xC380_0000, 0x437F_FFFF, 0x7F80_0000, 0xFF80_0000, 0x7FC0_0000,
         0xFFFF_FFFF, 0x7F80_0001]


@pytest.mark.parametrize("bits", EDGES, ids=hex)
def test_each_edge_value_is_torchs_cast_or_declined(bits):
    source = np.array([bits], dtype=np.uint32)
    out, large = _ours(source)
    if not _finite_after_cast(source):
        assert large is None and out[0] == 0xABCD  # NaN, inf, or rounds to inf: left to torch, nothing written
        return
    assert out[0] == _torch_bits(source)[0], hex(bits)
    value = float(torch.from_numpy(_torch_bits(source).view(np.int16)).view(torch.bfloat16).float())
    assert large == (abs(value) >= 256)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=2000))
def test_any_bit_patterns_cast_as_torch_casts_them(values):
    """Arrays of any fp32 bit patterns (past numpy's and torch's vector widths): torch's bits where every result is
    finite; else declined with nothing written."""
    source = np.array(values, dtype=np.uint32)
    out, large = _ours(source)
    if not _finite_after_cast(source):
        assert large is None and (out == 0xABCD).all()
        return
    expected = _torch_bits(source)
    assert np.array_equal(out, expected)
    magnitudes = torch.from_numpy(expected.view(np.int16)).view(torch.bfloat16).float().abs()
    assert large == bool((magnitudes >= 256).any())


def test_a_million_random_finite_values_cast_as_torch_casts_them():
    """torch's vectorised kernel over a long array (its scalar tail and its threads' shares alike) against ours."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=1_000_003, dtype=np.uint64).astype(np.uint32)
    bits = bits[(bits & 0x7FFF_FFFF) < _ROUNDS_TO_INF]
    out, large = _ours(bits)
    assert large is True and np.array_equal(out, _torch_bits(bits))


def test_an_empty_array_is_cast_to_nothing():
    assert cast_f32_to_bf16(np.empty(0, np.uint32), np.empty(0, np.uint16), np.empty(1, np.uint32)) is False
