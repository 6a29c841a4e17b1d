"""The restore check's read of host memory: every element it reads into is filled with NaN just before the read
and screened for NaN right after, so that an element the read did not write is found (`check.Ledger`).

With the package's small C extension (``fsdp_restore._screened``, built at install where a C compiler is found)
the fill, the read and the screen run window by window (`WINDOW_BYTES`) without the GIL, each window still in
the core's own cache when the screen reaches it. Without it (or with ``FSDP_RESTORE_NATIVE=0`` in the
environment) the same contract in Python: one fill of every destination, the read, one sum each."""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from .mapped import IOV_MAX

try:
    from . import _screened  # type: ignore[attr-defined]
except ImportError:  # not built (no C compiler at install): the Python path
    _screened = None

# Measured on 2-core hosts with 4 MB of L2 per core (BENCHMARKS.md, session 25): 128-512 KB windows alike, 2 MB
# and more back at the speed of whole-chunk passes, 64 KB paying for its system calls.
WINDOW_BYTES = 256 * 1024

# what the extension screens, by how it tells NaN (complex: each part); other float formats take the Python path
_KINDS = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4, torch.complex32: 1,
          torch.complex64: 3, torch.complex128: 4}

# floating formats with no NaN (a NaN fill cannot mark them): covered by the validated plan, as integers are
_NO_NAN = frozenset(getattr(torch, name) for name in ("float4_e2m1fn_x2",) if hasattr(torch, name))
# formats torch holds NaN in but cannot sum (float8): screened with isnan instead
_NO_SUM = frozenset(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))


def native() -> bool:
    """Whether the C extension is built and not turned off (``FSDP_RESTORE_NATIVE=0``)."""
    return _screened is not None and os.environ.get("FSDP_RESTORE_NATIVE", "1") != "0"


def floating(dtype: torch.dtype) -> bool:
    """Whether memory of ``dtype`` can hold the check's NaN."""
    return (dtype.is_floating_point or dtype.is_complex) and dtype not in _NO_NAN


def nan_sum(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor that is NaN when ``t`` holds a NaN: its sum (one vectorized pass, no temporary; a false
    alarm from inf - inf is cleared by the exact look), or NaN / 0 from isnan where torch cannot sum the dtype."""
    if t.dtype in _NO_SUM:
        return torch.where(torch.isnan(t).any(), float("nan"), 0.0)
    return t.sum()


def scalar(total: torch.Tensor) -> float:
    """A sum as a float that is NaN when the sum is (a complex sum: when either part is)."""
    if total.is_complex():
        return float(total.real) + float(total.imag)
    return float(total)


def fill_nan(dests: Sequence[torch.Tensor]) -> list[int]:
    """Fill every `floating` one of ``dests`` with NaN (an element a read then fails to write stays NaN); returns
    the bytes filled of each."""
    filled = []
    for d in dests:
        screened = floating(d.dtype)
        if screened:
            d.fill_(float("nan"))
        filled.append(d.numel() * d.element_size() if screened else 0)
    return filled


def holding_nan(dests: Sequence[torch.Tensor]) -> list[int]:
    """The indices of the `floating` ``dests`` that hold a NaN (or whose sum is NaN: inf - inf, a false alarm the
    exact look clears)."""
    return [i for i, d in enumerate(dests) if floating(d.dtype) and d.numel() and math.isnan(scalar(nan_sum(d)))]


def pread_screened(fd: int, buffers: Sequence[tuple[int, int, torch.dtype]],
                   offset: int) -> tuple[int, list[int], list[int]]:
    """Read the bytes from ``offset`` of ``fd`` into ``buffers`` (``(address, nbytes, dtype)`` each: host memory
    holding ``dtype``, back to back in the file), filling each `floating` one with NaN just before its bytes are
    read and screening it for NaN right after. Returns (bytes read: fewer only where the file ends, indices of
    the `floating` buffers left holding NaN, bytes filled and screened of each buffer: all of a `floating`
    one's, none of another's)."""
    if native():
        kinds = [_KINDS.get(dtype, -1) if floating(dtype) else 0 for _, _, dtype in buffers]
        if -1 not in kinds:  # (the extension refuses sizes that are negative or not whole items)
            return _screened.pread_screened(fd, [(address, nbytes, kind, dtype.itemsize) for (address, nbytes, dtype),
                                                 kind in zip(buffers, kinds)], offset, WINDOW_BYTES)
    for address, nbytes, dtype in buffers:
        if nbytes < 0 or nbytes % dtype.itemsize:
            raise ValueError(f"pread_screened: {nbytes} bytes of {dtype} at {address:#x}")
    views = [(ctypes.c_char * nbytes).from_address(address) for address, nbytes, _ in buffers]
    # tensors over the same memory, for the fill and the screen (an empty buffer has nothing of either)
    held = [torch.frombuffer(v, dtype=dtype) if len(v) else torch.empty(0, dtype=dtype)
            for v, (_, _, dtype) in zip(views, buffers)]
    filled = fill_nan(held)
    got = pread_all(fd, views, offset)
    return got, holding_nan(held), filled


def pread_all(fd: int, views: Sequence[Any], offset: int) -> int:
    """Scattering positional reads into ``views`` (writable byte buffers, left as they are) from ``offset``, again
    where the kernel returns less, until they are full or the file ends; returns the bytes read."""
    views = list(views)
    total = 0
    while views:
        got = os.preadv(fd, views[:IOV_MAX], offset + total)
        if got == 0:
            break
        total += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:  # (a ctypes array's slice would be a copy: its bytes view is sliced instead)
            views[0] = memoryview(views[0]).cast("B")[got:]
    return total
