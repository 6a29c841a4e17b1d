"""Start reading a conversion's source from disk while the interpreter is still importing torch.

A command's first ``import torch`` costs a couple of CPU seconds (BENCHMARKS.md) in which the disk would sit
idle; asking the kernel to read the source meanwhile (``POSIX_FADV_WILLNEED``, from a background thread, since
the call itself can block while it queues the reads) turns that time into reading time. A file's calls are made
by a process of their own (`fsdp_restore.advise`), which this thread waits for: made by the thread itself, they
would wait for the interpreter lock whenever the conversion runs Python. At most a quarter of
the memory the system has available is asked for, so a source larger than memory is not read twice.

A file is read from its head (torch.save's zip archive from its central directory, at its end, then its head).
A DeepSpeed ZeRO directory is read where the conversion will read it: the optimizer files' storages (which ones, from an inert sketch of their pickles: `fsdp_restore.pickle_sketch`),
and for a weights-only conversion (``select`` of ``model``) only the fp32 master partitions, a third of those
files, so that the moments are no more read from disk than without this. Imports nothing heavy: it runs
before torch is loaded.

The sketches run in a child process of their own (`_sketch_child`), with its address space capped and a time
limit: the files are untrusted, and Python's C unpickler, which the sketch runs, can be made to allocate memory
out of proportion to a pickle's size (a memo index of 2**32 zeroes a 64 GiB table) or to exhaust the C stack (a
hash of a tuple nested millions deep). Either ends the child; this process then reads nothing ahead, and the
conversion's own loader (torch's) refuses the file as it would have.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from .advise import Ranges, advise, command
from .pickle_sketch import sketch, storage_range, storage_refs
from .plain_pt import ZIP_TAIL_BYTES, end_records
from .zero_files import STAGE_1_2_MASTERS, STAGE_3_MASTERS, is_zero_checkpoint, optim_files, resolve_tag

CHILD_MEMORY_BYTES = 1 << 30  # the sketching child's address space: a ZeRO pickle's sketch takes megabytes
CHILD_SECONDS = 60  # the sketching child's time limit (it ends itself)


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


def _zero_ranges(optim_file: Path, weights_only: bool) -> Ranges:
    """The byte ranges of a ZeRO optimizer file's storages a conversion reads, in file order: every storage,
    or only the fp32 masters'."""
    s = sketch(optim_file)
    state = s.root.get("optimizer_state_dict") if isinstance(s.root, dict) else None
    if not isinstance(state, dict):
        return []
    wanted = [state.get(STAGE_1_2_MASTERS), state.get(STAGE_3_MASTERS)] if weights_only else state
    ranges = []
    for ref in storage_refs(wanted):
        with contextlib.suppress(ValueError, OSError):  # a record missing or compressed: the others are still read
            ranges.append(storage_range(s, ref))
    return sorted(ranges)


def _sketch_child(argv: Sequence[str]) -> None:
    """The child's work (``argv``: "1" for weights only, else "0", then the optimizer files): one JSON line per
    file, ``[file, ranges]``, as soon as it is sketched; no ranges for a file it cannot sketch."""
    import resource
    import signal

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    signal.alarm(CHILD_SECONDS)
    weights_only = argv[0] == "1"
    for name in argv[1:]:
        try:
            ranges = _zero_ranges(Path(name), weights_only)
        except Exception:  # noqa: BLE001 - MemoryError included: nothing to read ahead for this file
            ranges = []
        print(json.dumps([name, ranges]), flush=True)


def _isolated_zero_ranges(files: Sequence[Path], weights_only: bool) -> Iterator[tuple[Path, Ranges]]:
    """`_zero_ranges` of each file, computed in a child process (module doc), as the child finishes each."""
    root = str(Path(__file__).resolve().parent.parent)  # where this package is imported from
    code = "import sys; sys.path.insert(0, sys.argv[1]); from fsdp_restore.prefetch import _sketch_child; " \
           "_sketch_child(sys.argv[2:])"
    proc = subprocess.Popen([sys.executable, "-I", "-c", code, root, "1" if weights_only else "0", *map(str, files)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            name, ranges = json.loads(line)
            yield Path(name), [(int(start), int(nbytes)) for start, nbytes in ranges]
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()  # else a ResourceWarning, which the CLI shows, when the pipe is collected


def _file_ranges(path: Path) -> Ranges:
    """A file from its head; a zip archive (``torch.save``'s) from its central directory, at its end, then from its
    head: a conversion reads the directory before anything else, and asked for last it would come only after the
    whole file (the disk serves the requests in turn). Only the first bytes and the end records are read here, a
    hundred bytes; anything that does not begin and end as a zip archive does is read from the head."""
    size = os.stat(path).st_size
    fd = os.open(path, os.O_RDONLY)
    try:  # the end read only for an archive: it brings that page in
        head = os.pread(fd, 4, 0)
        tail = os.pread(fd, ZIP_TAIL_BYTES, max(0, size - ZIP_TAIL_BYTES)) if head == b"PK\x03\x04" else b""
    finally:
        os.close(fd)
    at = -1
    if (ends := end_records(tail)) is not None and ends[0][0] == b"PK\x05\x06":
        end, zip64 = ends
        at = end[6]  # the end record's directory offset; zip64's where that one is saturated
        if at == 0xFFFFFFFF and zip64 is not None:
            at = zip64[1][9]
    return [(at, size - at), (0, at)] if 0 < at < size else [(0, size)]


def _read_ahead(path: Path, select: str | None, tag: str | None, budget: list[int]) -> None:
    if path.is_file():
        try:
            ranges = _file_ranges(path)
        except OSError:  # gone meanwhile: the command itself reports it
            return
        if sys.executable and not getattr(sys, "frozen", False):
            try:  # asked for by a process of its own (`advise`), waited for here
                subprocess.run(command(path, ranges, budget[0]), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
                return
            except (OSError, ValueError):  # no process could be started: asked for by this thread instead
                pass
        # (a frozen or embedded build's executable is its host program, not an interpreter to run advise.py with)
        advise(path, ranges, budget)
        return
    weights_only = select is not None and (select == "model" or select.startswith("model."))
    try:  # what a ZeRO conversion will read, file by file, each asked for as soon as its pickle is sketched
        for f, ranges in _isolated_zero_ranges(optim_files(resolve_tag(path, tag)), weights_only):
            advise(f, ranges, budget)
    except Exception:  # noqa: BLE001 - any unreadable file: the conversion itself says what is wrong with it
        return


def start_prefetch(path: str | os.PathLike[str], *, select: str | None = None, tag: str | None = None,
                   max_bytes: int | None = None) -> threading.Thread | None:
    """Ask the kernel, from a daemon thread, to read into the page cache what a conversion of ``path`` reads
    (module doc; ``select`` and ``tag`` as `fsdp_restore.convert` takes them), at most ``max_bytes`` (default:
    a quarter of the available memory); returns the thread, or None where there is nothing to do (neither a
    regular file nor a ZeRO checkpoint, no ``posix_fadvise``)."""
    path = Path(path)
    budget = available_memory() // 4 if max_bytes is None else max_bytes
    if not hasattr(os, "posix_fadvise") or budget <= 0 or not (path.is_file() or is_zero_checkpoint(path)):
        return None
    thread = threading.Thread(target=_read_ahead, args=(path, select, tag, [budget]), name="fsdp-restore-prefetch",
                              daemon=True)
    thread.start()
    return thread
