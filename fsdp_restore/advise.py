"""Ask the kernel to read byte ranges of a file into the page cache (``POSIX_FADV_WILLNEED``): the read-ahead of a
conversion's source (`fsdp_restore.prefetch`).

Imports only the standard library, and nothing of this package: it also runs as a script in a process of its own
(``python -I -S advise.py PARENT PATH BUDGET [START NBYTES]...``), started in a few milliseconds, so that its
thousands of calls never wait for the interpreter lock of a conversion whose main thread runs Python meanwhile.
From a thread of that process the calls got the lock only between the main thread's switch intervals: half of a
1 GB file had been asked for when the disk could have read all of it (BENCHMARKS.md, session 31).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Sequence

# One readahead request per step, in file order, so that the first bytes are asked for first. Small: Linux reads
# at most max(read_ahead_kb, max_sectors_kb) of the device per POSIX_FADV_WILLNEED call (force_page_cache_ra) and
# drops the rest of the range, so that larger steps left most of the source unread (BENCHMARKS.md).
STEP = 512 * 1024

Ranges = list[tuple[int, int]]  # (offset, nbytes) in a file, in the order to read them


def advise(path: str | os.PathLike[str], ranges: Sequence[tuple[int, int]], budget: list[int],
           go_on: Callable[[], bool] = lambda: True) -> None:
    """Ask for ``ranges`` of ``path``, in steps, while ``budget[0]`` (bytes, shared by the files) lasts and
    ``go_on()`` says so (asked at every step)."""
    try:  # (a FIFO put in the file's place meanwhile would block a plain open until a writer came)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return  # the command itself reports a missing or unreadable source
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        for start, nbytes in ranges:
            for offset in range(start, start + min(nbytes, budget[0]), STEP):
                if not go_on():
                    return
                os.posix_fadvise(fd, offset, min(STEP, start + nbytes - offset), os.POSIX_FADV_WILLNEED)
            budget[0] -= min(nbytes, budget[0])
    except OSError:
        pass
    finally:
        os.close(fd)


def command(path: str | os.PathLike[str], ranges: Sequence[tuple[int, int]], budget: int) -> list[str]:
    """The command line of a process that runs `advise` on its own, for as long as this process, its parent,
    lives (a command that ended, or failed, leaves nothing reading on its behalf)."""
    numbers = [str(n) for r in ranges for n in r]
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), os.fspath(path), str(budget),
            *numbers]


def main(argv: Sequence[str]) -> None:
    """The script's work: ``PARENT PATH BUDGET [START NBYTES]...`` (`command`); it stops once its parent is not
    the process ``PARENT`` (that one has ended: the child was handed to another)."""
    parent, path, budget, numbers = int(argv[0]), argv[1], int(argv[2]), [int(n) for n in argv[3:]]
    advise(path, list(zip(numbers[::2], numbers[1::2])), [budget], go_on=lambda: os.getppid() == parent)


if __name__ == "__main__":
    main(sys.argv[1:])
