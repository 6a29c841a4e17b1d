"""Where a memory-mapped tensor's bytes lie in its file, so that they can be read with ``pread`` instead.

``torch.load(mmap=True)`` maps the whole checkpoint once and every storage is a slice of that mapping. Copying
a tensor out of the mapping faults its pages in one by one (and maps them into our address space, which
costs page-table work that a read into a reused buffer does not); a positional read of the same bytes asks
the kernel for the whole range in one call. The mapping's address and file offset come from
``/proc/self/maps`` (Linux); elsewhere nothing is found and the tensors are copied from the mapping.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a MappedFile exists only where torch.load mapped a file; pread_exactly needs no torch
    import torch


class MappedFile:
    """The mappings of one file in this process: ``offset_of(t)`` is the file offset of ``t``'s first byte."""

    def __init__(self, path: str | os.PathLike[str], fd: int | None = None) -> None:
        """``fd``: the descriptor the caller reads the file through: only mappings of that very file are taken
        (a file renamed over ``path`` meanwhile is not another's)."""
        from .torch_zip import bytes_as_loaded

        self.path = Path(path).resolve()
        st = os.fstat(fd) if fd is not None else os.stat(self.path)
        self._ranges: list[tuple[int, int, int]] = []  # (start address, end address, file offset), sorted
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    # (a mapping of a file renamed over since is listed as "path (deleted)")
                    if len(fields) < 6 or int(fields[4]) != st.st_ino or fields[5].strip() != str(self.path):
                        continue
                    start, end = (int(a, 16) for a in fields[0].split("-"))
                    self._ranges.append((start, end, int(fields[2], 16)))
        except OSError:
            pass
        if self._ranges and not bytes_as_loaded(self.path):  # byte-swapped by torch.load: memory is not the file
            self._ranges = []
        self._ranges.sort()
        self._starts = [r[0] for r in self._ranges]

    @property
    def mapped(self) -> bool:
        """Whether any mapping of the file was found (the tensors' memory is the file's bytes)."""
        return bool(self._ranges)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The file offset of contiguous CPU tensor ``t``'s bytes, if they all lie in one mapping of this file."""
        if t.device.type != "cpu" or not t.is_contiguous() or not self._ranges:
            return None
        return self.offset_at(t.data_ptr(), t.numel() * t.element_size())

    def offset_at(self, address: int, nbytes: int = 0) -> int | None:
        """The file offset of the ``nbytes`` at ``address``, if they lie in one mapping of this file."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        start, end, offset = self._ranges[i]
        if not (start <= address and address + nbytes <= end):
            return None
        return offset + address - start


def pread_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from file ``fd`` at ``offset`` (``preadv`` may read less than asked); `EOFError` naming the
    byte where the file ended, should it end first."""
    while view:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise EOFError(f"the file ends at byte {offset}, before the end of a tensor's bytes: truncated?")
        view, offset = view[n:], offset + n


IOV_MAX = 1024  # buffers one preadv takes (Linux's UIO_MAXIOV)


def preadv_exactly(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill ``views`` in turn from file ``fd`` at ``offset`` (at most `IOV_MAX` of them), again where ``preadv`` reads
    less than asked; `EOFError` as `pread_exactly`'s, should the file end first."""
    views = [view for view in views if len(view)]  # (an empty buffer: preadv reads nothing into it and says 0)
    left = sum(len(view) for view in views)
    while views:
        n = os.preadv(fd, views, offset)
        if n <= 0:
            raise EOFError(f"the file ends at byte {offset}, before the end of a tensor's bytes: truncated?")
        if n == left:  # (the usual case: no list of the buffers left to make)
            return
        left, offset = left - n, offset + n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
