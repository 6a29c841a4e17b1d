"""crc32 of one tensor computed in pieces, so that several threads can share one huge tensor.

The stored checksum is the standard zlib crc32 of a tensor's bytes. Computed in one pass it ties a
tensor to one thread: a 1 GB embedding among 4 GB of other weights bounds a 16-thread conversion
(or verification) at a quarter of its work. Instead each thread checksums a segment, and the
segments' crcs are joined with :func:`crc32_combine` (what zlib's ``crc32_combine`` does; Python's
``zlib`` module does not expose it). Joining costs microseconds, whatever the lengths.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

_POLY = 0xEDB88320  # crc32's polynomial, bit-reflected: bit 31 is x^0, bit 0 is x^31
_ONE = 1 << 31  # the polynomial 1 in that representation

SEGMENT_MIN_BYTES = 64 * 1024 * 1024  # below this a split costs more in task overhead than it gains


def _fastest_crc32() -> Callable[..., int]:
    """zlib's crc32, folded with carry-less multiplication where the optional extension is built and the CPU has
    PCLMULQDQ (`fsdp_restore/_crc32.c`: several times zlib's table loop, BENCHMARKS.md); else zlib's own.
    ``FSDP_RESTORE_NATIVE=0`` takes zlib's. The writers checksum what they write with it; the provers (`verify`,
    the restore's ``verify_checksums``) keep zlib's, so that a fault of this one cannot bless its own output."""
    if os.environ.get("FSDP_RESTORE_NATIVE", "1") != "0":
        try:
            from . import _crc32  # type: ignore[attr-defined]

            if _crc32.has_pclmul():
                return _crc32.crc32  # type: ignore[no-any-return]
        except ImportError:
            pass
    return zlib.crc32


crc32: Callable[[Any, int], int] = _fastest_crc32()  # crc32(data, value=0), as zlib.crc32


def _multiply(a: int, b: int) -> int:
    """a(x) * b(x) modulo crc32's polynomial, both in the reflected representation."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1  # b *= x
    return product


def _squarings(count: int) -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial for k < ``count``: x^(2^(k+1)) is x^(2^k) squared."""
    powers = [_ONE >> 1]
    while len(powers) < count:
        powers.append(_multiply(powers[-1], powers[-1]))
    return tuple(powers)


# Built once at import, never lazily: the writer threads of a save ask for them at once, and a list grown by
# whichever thread came first once held one power twice, shifting all above it (wrong checksums in a header).
# 8 * nbytes < 2^67 for any nbytes a file can hold.
_X_TO_THE_2_TO_THE = _squarings(67)


def _x_to_the_2_to_the(k: int) -> int:
    """x^(2^k) modulo the polynomial."""
    return _X_TO_THE_2_TO_THE[k]


@functools.lru_cache(maxsize=1 << 14)
def shift_power(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial. Cached: tensors and their pieces come in a few sizes, and each power
    costs ~log2(nbytes) multiplications in Python, where applying a cached one costs one."""
    power, k, n = _ONE, 3, nbytes  # 8 * nbytes = nbytes << 3
    while n:
        if n & 1:
            power = _multiply(_x_to_the_2_to_the(k), power)
        n >>= 1
        k += 1
    return power


def _shift(crc: int, nbytes: int) -> int:
    """crc(x) * x^(8 * nbytes): the effect of appending ``nbytes`` zero bytes' worth of length."""
    return _multiply(shift_power(nbytes), crc) if crc and nbytes else crc


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    return _shift(crc1, len2) ^ crc2 if len2 else crc1


def zeros_crc(nbytes: int) -> int:
    """The crc32 of ``nbytes`` zero bytes, without reading any (the register, all ones at the start, times
    x^(8 nbytes), complemented)."""
    return _shift(0xFFFFFFFF, nbytes) ^ 0xFFFFFFFF if nbytes else 0


def placed_crc(crc: int, nbytes: int, after: int) -> int:
    """The linear part of the crc32 of a message that is all zeros but for a part of ``nbytes`` whose crc32 is
    ``crc``, followed by ``after`` bytes (what precedes it does not matter: zeros leave a zero register as it is).

    crc32 is affine: for messages of one length, ``crc(A ^ B) = crc(A) ^ crc(B) ^ crc(zeros)``. So the crc32 of
    a message cut into parts, each placed alone in zeros, is the XOR of their `placed_crc` and the
    `zeros_crc` of the whole length: the parts may be checksummed apart, in any order, by any process."""
    return _shift(crc ^ zeros_crc(nbytes), after)


def strided_placed_crc(row_crcs: Iterable[int], run_bytes: int, stride_bytes: int, after_last: int) -> int:
    """`placed_crc` of equal runs of ``run_bytes``, ``stride_bytes`` apart (a column block of a row-major tensor),
    from each run's crc32, in order; ``after_last``: the bytes that follow the last run. One multiplication per
    run (Horner's rule), where placing each run alone would cost one power per run."""
    acc, zeros = 0, zeros_crc(run_bytes)
    row_crcs = list(row_crcs)
    if len(row_crcs) > _TABLE_ROWS:  # thousands of rows (a column block): one table, then four lookups per row
        times = _times_table(shift_power(stride_bytes))
        t0, t1, t2, t3 = times
        for crc in row_crcs:
            acc = t0[acc & 0xFF] ^ t1[(acc >> 8) & 0xFF] ^ t2[(acc >> 16) & 0xFF] ^ t3[acc >> 24] ^ crc ^ zeros
    else:
        for crc in row_crcs:
            acc = _shift(acc, stride_bytes) ^ crc ^ zeros
    return _shift(acc, after_last)


_TABLE_ROWS = 256  # past this many runs, a table of products (1024 multiplications) costs less than one per run


@functools.lru_cache(maxsize=64)
def _times_table(factor: int) -> tuple[tuple[int, ...], ...]:
    """Multiplication by ``factor`` as four tables of 256 (one per byte of the other operand): the product is
    linear over GF(2), so it is the XOR of the products of the operand's bytes."""
    return tuple(tuple(_multiply(b << (8 * k), factor) for b in range(256)) for k in range(4))


def combine_segments(segments: Iterable[tuple[int, int]]) -> int:
    """Join ``(crc32, nbytes)`` of consecutive segments, in order, into the crc32 of the whole."""
    crc = 0
    for seg_crc, nbytes in segments:
        crc = crc32_combine(crc, seg_crc, nbytes)  # onto 0 (the first segment) no multiplication: see _shift
    return crc


def segment_bytes(total_bytes: int, threads: int) -> int:
    """How large a piece of one tensor a thread should take: small enough that the biggest tensor
    spreads over all threads (a few segments per thread for balance), large enough to be worth a task."""
    return max(SEGMENT_MIN_BYTES, -(-total_bytes // (4 * max(1, threads))))


def split_elements(numel: int, itemsize: int, max_bytes: int) -> list[tuple[int, int]]:
    """Cut ``numel`` elements into near-equal ``(start, stop)`` ranges of at most ``max_bytes`` each
    (one element when an element is larger)."""
    most = max(1, max_bytes // itemsize)  # elements per range
    if numel <= most:
        return [(0, numel)]
    parts = -(-numel // most)  # then near-equal ranges: none longer than ``most``
    bounds = [numel * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def plan_segments(tensors: Iterable[tuple[T, int, int, bool]], threads: int) -> list[tuple[T, int, int]]:
    """The tasks that ``threads`` threads share: ``tensors`` are ``(item, numel, itemsize, splittable)``;
    returns ``(item, start, stop)`` element ranges, biggest first (better load balance). A splittable
    tensor larger than `segment_bytes` is cut into near-equal segments."""
    tensors = list(tensors)
    most = segment_bytes(sum(numel * size for _, numel, size, _ in tensors), threads)
    tasks = [(item, start, stop, (stop - start) * size) for item, numel, size, splittable in tensors
             for start, stop in split_elements(numel, size, most if splittable else numel * size)]
    tasks.sort(key=lambda t: -t[3])
    return [(item, start, stop) for item, start, stop, _ in tasks]
