"""`plain_cast`: each cast made with numpy gives torch's bits for every finite result, and declines (None, nothing
written) every input whose source or result is not finite. The oracle is torch's own cast."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_restore.plain_cast import torch_free_cast

TORCH = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BITS = {"float64": np.uint64, "float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
SIGNED = {np.uint64: torch.int64, np.uint32: torch.int32, np.uint16: torch.int16}
PAIRS = [("float32", "bfloat16"), ("float32", "float16"), ("float64", "float32"), ("float32", "float64"),
         ("float16", "float32"), ("float16", "float64"), ("bfloat16", "float32"), ("bfloat16", "float64"),
         ("float16", "bfloat16"), ("bfloat16", "float16")]
UNTOUCHED = {np.uint16: 0xABCD, np.uint32: 0xABCD_EF01, np.uint64: 0xABCD_EF01_2345_6789}  # no input gives these


def _as_torch(bits: np.ndarray, dtype: str) -> torch.Tensor:
    signed = torch.from_numpy(bits.view(np.dtype(bits.dtype.str.replace("u", "i"))).copy())
    return signed.view(TORCH[dtype])


def _torch_bits(bits: np.ndarray, source: str, target: str) -> np.ndarray:
    """torch's cast of these ``source`` bit patterns to ``target``, as unsigned bits."""
    out = _as_torch(bits, source).to(TORCH[target])
    return out.view(SIGNED[BITS[target]]).numpy().view(BITS[target])


def _ours(bits: np.ndarray, source: str, target: str) -> tuple[np.ndarray, bool | None]:
    cast = torch_free_cast(source, target)
    assert cast is not None
    out = np.full(bits.size, UNTOUCHED[BITS[target]], dtype=BITS[target])
    result = cast(bits.astype(BITS[source]), out, np.empty(8 * max(1, bits.size), dtype=np.uint8))
    return out, result


def _finite_after_cast(bits: np.ndarray, source: str, target: str) -> bool:
    with np.errstate(all="ignore"):
        before = _as_torch(bits, source)
        return bool(before.isfinite().all() and before.to(TORCH[target]).isfinite().all())


def _whole_limit(target: str) -> float:
    return 2.0 / torch.finfo(TORCH[target]).eps  # 256 in bf16, 2048 in fp16, 2**24 in fp32


def _rounds_whole_numbers(source: str, target: str) -> bool:
    return torch.finfo(TORCH[target]).eps > torch.finfo(TORCH[source]).eps


def _check(bits: np.ndarray, source: str, target: str) -> None:
    out, result = _ours(bits, source, target)
    if not _finite_after_cast(bits, source, target):
        assert result is None and (out == UNTOUCHED[BITS[target]]).all()  # left to torch, nothing written
        return
    expected = _torch_bits(bits, source, target)
    assert np.array_equal(out, expected), [hex(int(b)) for b in bits[out != expected][:5]]
    magnitudes = _as_torch(expected, target).double().abs()
    assert result == (_rounds_whole_numbers(source, target) and bool((magnitudes >= _whole_limit(target)).any()))


def _bits(value: float, fmt: str) -> int:
    return int.from_bytes(struct.pack(f"<{fmt}", value), "little")


# edge cases of each source format: zeros, the smallest and largest subnormals, ties to even on both sides (for
# bf16 and fp16 targets), the last finite values and the first ones that round to inf, values around the
# whole-number limits, inf and NaN
EDGES = {
    "float32": [0x0000_0000, 0x8000_0000, 0x0000_0001, 0x807F_FFFF, 0x0000_8000, 0x0001_8000, 0x3F80_8000,
                0x3F81_8000, 0xBF80_8000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7F_7FFF, 0xFF7F_7FFF, 0x7F7F_8000,
                0xFF7F_8000, 0x7F7F_FFFF, 0x437F_0000, 0x4380_0000, 0x4380_8000, 0xC380_0000, 0x437F_FFFF,
                0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0xFFFF_FFFF, 0x7F80_0001,
                # fp16: its largest finite, the tie that rounds to inf and below it, its subnormals' range, the
                # smallest fp32 that rounds to fp16's smallest subnormal, 2047 / 2048 / 2049
                _bits(65504.0, "f"), _bits(65520.0, "f"), _bits(65519.996, "f"), 0x3380_0000, 0x3300_0001,
                0x3300_0000, 0x3880_0000, 0x387F_E000, 0x387F_F000, _bits(2047.0, "f"), _bits(2048.0, "f"),
                _bits(2049.0, "f"), _bits(2050.0, "f"), 0x3A80_1000, 0x3A80_3000],
    "float64": [0, 2**63, 1, _bits(3.4028234663852886e38, "d"), _bits(3.4028235677973366e38, "d"),
                _bits(3.4028235677973362e38, "d"), _bits(1e-45, "d"), _bits(7e-46, "d"), _bits(1.4e-45, "d"),
                _bits(2.0**24 - 1, "d"), _bits(2.0**24, "d"), _bits(2.0**24 + 1, "d"), _bits(1.0 + 2**-24, "d"),
                _bits(1.0 + 3 * 2**-24, "d"), 0x7FF0_0000_0000_0000, 0x7FF8_0000_0000_0000, _bits(1e300, "d")],
    # fp16 -> bf16: ties to even at 1 + 2**-8 and 1 + 3 * 2**-8, 255 / 256 / 257 / 258 / 259, the largest
    "float16": [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x3C00,
                0x3C04, 0x3C0C, 0x3C02, 0x3C06, 0x5BF8, 0x5C00, 0x5C04, 0x5C08, 0x5C0C],
    # bf16 -> fp16: the largest it holds (65280) and the next (65536, inf), fp16's subnormal range and below it
    "bfloat16": [0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x4380,
                 0x477F, 0x4780, 0xC77F, 0xC780, 0x3880, 0x3800, 0x3380, 0x3300, 0x3340, 0x33C0, 0x3000],
}


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_each_edge_value_is_torchs_cast_or_declined(source, target):
    for bits in EDGES[source]:
        _check(np.array([bits], dtype=BITS[source]), source, target)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_the_edge_values_together_are_cast_or_declined_as_a_whole(source, target):
    """One array of every finite edge value (past numpy's and torch's vector widths when repeated), then with a value
    that is not finite after the cast among them: all of it declined, nothing written."""
    finite = [b for b in EDGES[source] if _finite_after_cast(np.array([b], dtype=BITS[source]), source, target)]
    bits = np.array(finite * 7, dtype=BITS[source])
    _check(bits, source, target)
    declined = [b for b in EDGES[source] if b not in finite]
    _check(np.concatenate([bits, np.array(declined[:1], dtype=BITS[source])]), source, target)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(PAIRS), st.data())
def test_any_bit_patterns_cast_as_torch_casts_them(pair, data):
    """Arrays of any bit patterns of the source format: torch's bits where every result is finite; else declined
    with nothing written."""
    source, target = pair
    width = 8 * np.dtype(BITS[source]).itemsize
    values = data.draw(st.lists(st.integers(0, 2**width - 1), min_size=1, max_size=2000))
    _check(np.array(values, dtype=BITS[source]), source, target)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_a_million_random_finite_values_cast_as_torch_casts_them(source, target):
    """torch's vectorised kernel over a long array (its scalar tail and its threads' shares alike) against ours:
    random bit patterns, and normal values around 1, whose casts round."""
    rng = np.random.default_rng(0)
    width = 8 * np.dtype(BITS[source]).itemsize
    bits = rng.integers(0, 2**min(width, 63), size=1_000_003, dtype=np.uint64).astype(BITS[source])
    if width == 64:
        bits |= rng.integers(0, 2, size=bits.size, dtype=np.uint64) << np.uint64(63)
    keep = _as_torch(bits, source).isfinite()
    with np.errstate(all="ignore"):
        keep &= _as_torch(bits, source).to(TORCH[target]).isfinite()
    _check(bits[keep.numpy()], source, target)
    normal = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(TORCH[source])
    _check(normal.view(SIGNED[BITS[source]]).numpy().view(BITS[source]), source, target)


def test_an_empty_array_is_cast_to_nothing():
    cast = torch_free_cast("float32", "bfloat16")
    assert cast(np.empty(0, np.uint32), np.empty(0, np.uint16), np.empty(1, np.uint32)) is False


@pytest.mark.parametrize("source,target", [("float64", "bfloat16"), ("float64", "float16"), ("float32", "float32")])
def test_casts_that_torch_may_round_twice_are_left_to_torch(source, target):
    assert torch_free_cast(source, target) is None
