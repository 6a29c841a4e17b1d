"""Process measurements for reports and benchmarks: anonymous memory (RssAnon) and disk bytes read."""

from __future__ import annotations

import threading
import time
from types import TracebackType


def rss_anon_bytes() -> int:
    """Current anonymous resident memory (heap, not page cache or mapped files), from /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (``read_bytes`` in /proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakAnonMemory:
    """Samples RssAnon in a background thread; ``peak`` is the highest value seen (Linux has no
    peak-RssAnon counter: VmHWM also counts memory-mapped file pages, which are not the cost)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_anon_bytes())

    def __enter__(self) -> PeakAnonMemory:
        self.start = self.peak = rss_anon_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())


class Stopwatch:
    def __enter__(self) -> Stopwatch:
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
