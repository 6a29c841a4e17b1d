"""Start reading a conversion's source from disk while the interpreter is still importing torch.

A command's first ``import torch`` costs a couple of CPU seconds (BENCHMARKS.md) in which the disk would sit
idle; asking the kernel to read the head of the source meanwhile (``POSIX_FADV_WILLNEED``, from a
background thread, since the call itself can block while it queues the reads) turns that time into reading
time. Only the head is asked for, at most a quarter of the memory the system has available, so a source
larger than memory is not read twice. Imports nothing heavy: it runs before torch is loaded.
"""

from __future__ import annotations

import os
import threading

# One readahead request per step, in file order, so that the first bytes are asked for first. Small: Linux reads
# at most max(read_ahead_kb, max_sectors_kb) of the device per POSIX_FADV_WILLNEED call (force_page_cache_ra) and
# drops the rest of the range, so that larger steps left most of the source unread (BENCHMARKS.md).
_STEP = 512 * 1024


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _advise(path: str, nbytes: int) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # the command itself reports a missing or unreadable source
    try:
        for offset in range(0, nbytes, _STEP):
            os.posix_fadvise(fd, offset, min(_STEP, nbytes - offset), os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def start_prefetch(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> threading.Thread | None:
    """Ask the kernel, from a daemon thread, to read the first ``max_bytes`` (default: a quarter of the
    available memory) of regular file ``path`` into the page cache; returns the thread, or None where there
    is nothing to do (not a regular file, no ``posix_fadvise``)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        size = os.stat(path).st_size if os.path.isfile(path) else 0
    except OSError:
        return None
    nbytes = min(size, available_memory() // 4 if max_bytes is None else max_bytes)
    if nbytes <= 0:
        return None
    thread = threading.Thread(target=_advise, args=(os.fspath(path), nbytes), name="fsdp-restore-prefetch",
                              daemon=True)
    thread.start()
    return thread
