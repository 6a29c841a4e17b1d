"""The fp32 -> bf16 cast of a conversion without torch: the bits torch's cast gives, made with numpy.

Why: a ``--dtype bf16`` conversion of a checkpoint `plain_pt` reads needed torch for the cast alone, and importing
torch costs more than a second before anything is written; with thousands of small tensors torch's calls per tensor
cost as much again (BENCHMARKS.md, "Casts without torch"). bf16 is fp32's upper half, rounded to nearest, ties to
even: ``(bits + 0x7FFF + (bits >> 16 & 1)) >> 16``, the rule torch's kernels use for every finite value. NaN is
where torch's kernels differ among themselves (its scalar and vector paths write different NaN bits), and a value
that rounds to inf is an overflow the writer must count, so a step that holds either is left to the torch path
(`cast_f32_to_bf16` says so, writing nothing): this module writes only finite results, exactly as torch writes them.
A cast that reaches 256 in magnitude, or of a 0-dim value, is made here too; the writer then reads that tensor
again through torch to decide whether the cast changed a tensor of whole numbers (`write.changed_by_cast`).
"""

from __future__ import annotations

import numpy as np

_MAGNITUDE = 0x7FFF_FFFF  # an fp32's bits without its sign
_ROUNDS_TO_INF = 0x7F7F_8000  # the smallest fp32 magnitude that rounds to bf16's inf (a tie, to the odd 0x7F7F)
_BF16_WHOLE_LIMIT = 0x4380  # 256.0 in bf16: from it on, bf16 does not hold every whole number


def bf16_bits(bits: int) -> int:
    """One fp32's bits (as an unsigned int) cast to bf16's, rounded to nearest, ties to even (finite values)."""
    return (bits + 0x7FFF + (bits >> 16 & 1)) >> 16


def cast_f32_to_bf16(source: np.ndarray, out: np.ndarray, work: np.ndarray) -> bool | None:
    """Cast ``source`` (fp32 values as uint32 bits) into ``out`` (uint16, bf16 bits, as many) as torch does, with
    ``work`` (uint32, at least as many) as scratch. Returns whether a value's magnitude reaches 256 (where bf16
    stops holding whole numbers: the writer's `changed_by_cast` then looks at the tensor); None, with ``out``
    untouched, if a value is NaN or inf or rounds to inf (the torch path casts and counts those)."""
    n = source.size
    if n == 0:
        return False
    work = work[:n]
    np.bitwise_and(source, _MAGNITUDE, out=work)
    top = int(work.max())  # the cast is monotonic in the magnitude: the largest one decides both questions
    if top >= _ROUNDS_TO_INF:
        return None
    np.right_shift(source, 16, out=work)
    np.bitwise_and(work, 1, out=work)
    work += 0x7FFF
    work += source  # no wrap: a finite magnitude below _ROUNDS_TO_INF plus the sign bit and 0x8000 fits 32 bits
    np.right_shift(work, 16, out=out, casting="unsafe")
    return bf16_bits(top) >= _BF16_WHOLE_LIMIT
