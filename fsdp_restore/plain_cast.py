"""The casts of a conversion made without torch: the bits torch's cast gives, made with numpy.

Why: a ``--dtype`` conversion of a checkpoint `plain_pt` reads needed torch for the cast alone, and importing torch
costs more than a second before anything is written; with thousands of small tensors torch's calls per tensor cost
as much again (BENCHMARKS.md, "Casts without torch").

Each cast here gives, for every finite result, the bits torch's CPU cast gives (tests/test_plain_cast.py compares
them with torch's over edge values and random bit patterns):

* fp32 -> bf16 is fp32's upper half, rounded to nearest, ties to even: ``(bits + 0x7FFF + (bits >> 16 & 1)) >> 16``,
  the rule torch's kernels use for every finite value (numpy has no bf16);
* fp32 -> fp16 and fp64 -> fp32 are numpy's casts, which round to nearest, ties to even, subnormal results
  included, as torch's do (one rounding: torch casts these directly);
* fp16 -> bf16 and bf16 -> fp16 go through fp32, as torch's do: exactly there, then rounded once;
* fp16 -> fp32 / fp64, bf16 -> fp32 / fp64 and fp32 -> fp64 are exact (bf16 -> fp32 is a shift by 16 bits).

fp64 -> bf16 and fp64 -> fp16 are left to torch (it goes through fp32 and may round twice on the way). NaN is
where torch's kernels differ among themselves (its scalar and vector paths write different NaN bits), and a value
that rounds to inf is an overflow the writer must count, so a step whose source holds a NaN or an inf, or a value
that the cast makes infinite, is left to the torch path (`Cast.__call__` says so, writing nothing): this module writes
only finite results, exactly as torch writes them. A narrowing cast that reaches the magnitude where the target
stops holding every whole number (256 in bf16, 2048 in fp16, 2**24 in fp32) is made here too, and said so; the
writer then reads that tensor again through torch to decide whether the cast changed a tensor of whole numbers
(`write.changed_by_cast`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class _Format:
    """A floating format by its bits: their unsigned integer type, the magnitude's mask, the magnitude of inf (every
    larger one is a NaN), numpy's float type where numpy has one, its precision (significand bits), and
    ``whole_limit``: the magnitude's bits of the first power of two from which the format no longer holds every
    whole number (2 / eps)."""

    bits: type
    magnitude: int
    inf: int
    numpy: type | None
    precision: int
    whole_limit: int


def _bits_of(value: float, fmt: str) -> int:
    return int.from_bytes(struct.pack(f"<{fmt}", value), "little")


_FORMATS = {
    "float64": _Format(np.uint64, 2**63 - 1, 0x7FF0_0000_0000_0000, np.float64, 53, _bits_of(2.0**53, "d")),
    "float32": _Format(np.uint32, 2**31 - 1, 0x7F80_0000, np.float32, 24, _bits_of(2.0**24, "f")),
    "float16": _Format(np.uint16, 2**15 - 1, 0x7C00, np.float16, 11, _bits_of(2.0**11, "e")),
    "bfloat16": _Format(np.uint16, 2**15 - 1, 0x7F80, None, 8, 0x4380),  # 256.0
}

# The smallest source magnitude (as its bits) that a narrowing cast rounds to inf: the target's largest finite value
# plus half its last step, a tie that rounds to the even neighbour, inf (the largest finite's last bit is odd).
_ROUNDS_TO_INF = {
    ("float32", "bfloat16"): 0x7F7F_8000,
    ("float32", "float16"): _bits_of(65504.0 + 16.0, "f"),
    ("float64", "float32"): _bits_of(float(np.finfo(np.float32).max) + 2.0**103, "d"),
    ("bfloat16", "float16"): 0x4780,  # 65536: bf16's next value after 65280 (which fp16 holds) is past fp16's range
}
_WIDENING = {("float32", "float64"), ("float16", "float32"), ("float16", "float64"), ("bfloat16", "float32"),
             ("bfloat16", "float64")}
_ROUNDING = {("float16", "bfloat16")}  # fewer significand bits, a wider range: it rounds, and never to inf


@dataclass(frozen=True)
class Cast:
    """One cast made without torch, from ``source`` to ``target`` (torch's dtype names). Called on arrays of the two
    formats' bits (``source_bits`` and ``target_bits`` types), with a scratch buffer of at least 4 bytes and the
    source's own item size per element."""

    source: str
    target: str

    @property
    def exact(self) -> bool:
        """Whether every finite value is cast exactly (a widening cast: it rounds nothing)."""
        return (self.source, self.target) in _WIDENING

    @property
    def source_bits(self) -> type:
        return _FORMATS[self.source].bits

    @property
    def target_bits(self) -> type:
        return _FORMATS[self.target].bits

    def __call__(self, source: np.ndarray, out: np.ndarray, work: np.ndarray) -> bool | None:
        """Cast ``source`` (bits) into ``out`` (bits, as many) as torch does, with ``work`` (any numpy array of at
        least 4 bytes and the source's item size per element) as scratch. Returns whether the cast may have rounded
        a whole number (a narrowing cast whose result reaches the target's `_Format.whole_limit`: the writer's
        `changed_by_cast` then looks at the tensor); None, with ``out`` untouched, if a source value is NaN or inf
        or the cast makes one inf (the torch path casts and counts those)."""
        n = source.size
        if n == 0:
            return False
        src = _FORMATS[self.source]
        magnitudes = work.view(np.uint8)[:n * source.itemsize].view(src.bits)
        np.bitwise_and(source, src.bits(src.magnitude), out=magnitudes)
        top = int(magnitudes.max())  # each cast is monotonic in the magnitude: the largest one decides
        if top >= src.inf or top >= _ROUNDS_TO_INF.get((self.source, self.target), src.inf):
            return None
        self._cast(source, out, work)
        if self.exact or _FORMATS[self.target].precision >= src.precision:  # (bf16 -> fp16: only its range narrows)
            return False
        one = np.empty(1, dtype=self.target_bits)
        self._cast(np.array([top], dtype=src.bits), one, np.empty(8, dtype=np.uint8))
        return int(one[0]) >= _FORMATS[self.target].whole_limit

    def _cast(self, source: np.ndarray, out: np.ndarray, work: np.ndarray) -> None:
        n = source.size
        scratch = work.view(np.uint8)[:4 * n].view(np.uint32)
        if (self.source, self.target) == ("float32", "bfloat16"):
            np.right_shift(source, 16, out=scratch)
            np.bitwise_and(scratch, 1, out=scratch)
            scratch += 0x7FFF
            scratch += source  # no wrap: a finite magnitude below inf's rounding plus the sign bit and 0x8000 fits
            np.right_shift(scratch, 16, out=out, casting="unsafe")
        elif self.source == "bfloat16":  # bf16 is fp32's upper half
            if self.target == "float32":
                np.left_shift(source, 16, out=out, dtype=np.uint32, casting="unsafe")
            else:
                np.left_shift(source, 16, out=scratch, dtype=np.uint32, casting="unsafe")
                with np.errstate(all="ignore"):
                    np.copyto(out.view(_FORMATS[self.target].numpy), scratch.view(np.float32), casting="unsafe")
        elif self.target == "bfloat16":  # fp16: exactly to fp32, then rounded once
            np.copyto(scratch.view(np.float32), source.view(np.float16), casting="unsafe")
            _f32_to_bf16_in_place(scratch, out)
        else:
            numpy_in, numpy_out = _FORMATS[self.source].numpy, _FORMATS[self.target].numpy
            with np.errstate(all="ignore"):  # (no overflow reaches here: refused above)
                np.copyto(out.view(numpy_out), source.view(numpy_in), casting="unsafe")


def _f32_to_bf16_in_place(bits: np.ndarray, out: np.ndarray) -> None:
    """fp32 ``bits`` (uint32, finite values below bf16's rounding to inf; overwritten) rounded to bf16's bits in
    ``out`` (uint16, as many; also the scratch for the rounding bit)."""
    np.right_shift(bits, 16, out=out, casting="unsafe")
    np.bitwise_and(out, 1, out=out)
    bits += out
    bits += 0x7FFF  # no wrap: a finite magnitude below inf's rounding plus the sign bit and 0x8000 fits 32 bits
    np.right_shift(bits, 16, out=out, casting="unsafe")


_CASTS = {pair: Cast(*pair) for pair in (*_ROUNDS_TO_INF, *_WIDENING, *_ROUNDING)}


def torch_free_cast(source: str, target: str) -> Cast | None:
    """The cast from dtype ``source`` to ``target`` (torch's names, e.g. ``"float32"``) made here, or None if torch
    must make it."""
    return _CASTS.get((source, target))
