"""Process measurements for reports and benchmarks: anonymous memory (RssAnon) and disk bytes read."""

from __future__ import annotations

import threading
import time
from types import TracebackType


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (``RssAnon``, ``VmRSS``...), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_anon_bytes() -> int:
    """Current anonymous resident memory (heap, not page cache or mapped files), from /proc."""
    return status_bytes("RssAnon")


def _io_counter(field: str) -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (``read_bytes`` in /proc/self/io)."""
    return _io_counter("read_bytes")


def disk_write_bytes() -> int:
    """Bytes this process caused to be sent to storage (``write_bytes`` in /proc/self/io: dirtied page-cache
    pages are counted when dirtied, by the process that dirtied them)."""
    return _io_counter("write_bytes")


class PeakAnonMemory:
    """Samples RssAnon (or ``field``) in a background thread; ``peak`` is the highest value seen (Linux
    has no peak-RssAnon counter: VmHWM also counts memory-mapped file pages, which are not the cost).
    ``field="VmRSS"`` counts pinned (page-locked) host buffers too, which the driver maps."""

    def __init__(self, interval: float = 0.02, field: str = "RssAnon") -> None:
        self.interval = interval
        self.field = field
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, status_bytes(self.field))

    def __enter__(self) -> PeakAnonMemory:
        self.start = self.peak = status_bytes(self.field)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.peak = max(self.peak, status_bytes(self.field))


class Stopwatch:
    def __enter__(self) -> Stopwatch:
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
