"""Where a conversion's time goes, step by step: the steps of ``convert()`` on one ``torch.save`` file, each
timed (wall and CPU seconds) in one process, page cache warm, for this checkout and optionally for another one.

    python scripts/convert_phases.py SRC.pt                              # this checkout, 5 runs, medians
    python scripts/convert_phases.py SRC.pt --against /tmp/old --runs 5  # and an older tree, runs interleaved

``--against`` is a directory holding another version's ``fsdp_restore`` package (e.g. ``git archive COMMIT
fsdp_restore | tar -x -C /tmp/old``); each run is a fresh process with that directory first on the path, and the
two versions alternate so that drift on a shared machine hits both alike. The steps are run as ``convert()`` runs
them (with its garbage-collector pause where the version has one); the indented rows are parts of the step above
them, timed by wrapping the functions that do them where the version has them: the zip directory, the scan of
the pickle's globals and torch.load of the older loader; the unpickler of `torch_zip`; the writer's header, its
checksum patch and crc joins. Results are in BENCHMARKS.md ("Convert at the disk's speed").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _child(src: str, dst: str) -> None:
    """One process: time every step, print ``{step: [wall, cpu]}`` as JSON."""
    import contextlib
    import functools
    import importlib

    t0, c0 = time.perf_counter(), time.process_time()
    import torch

    convert = importlib.import_module("fsdp_restore.convert")
    from fsdp_restore import write
    from fsdp_restore.flatten import flatten
    from fsdp_restore.format import META_SOURCE
    from fsdp_restore.jobs import plan_jobs
    from fsdp_restore.mapped import MappedFile
    from fsdp_restore.provenance import source_identity

    times: dict[str, list[float]] = {"import torch + fsdp_restore": [time.perf_counter() - t0, time.process_time() - c0]}

    def part(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def timed(*args: object, **kwargs: object) -> object:
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc = times.setdefault(label, [0.0, 0.0])
                acc[0] += time.perf_counter() - t
                acc[1] += time.process_time() - c

        setattr(owner, name, timed)

    part(convert, "_check_zip_members", "  zip central directory (zipfile)")
    part(convert, "weights_only_refusal_hint", "  zip central directory (zipfile)")
    part(torch.serialization, "get_unsafe_globals_in_checkpoint", "  scan of the pickle's globals")
    part(torch, "load", "  torch.load")
    torch_zip = sys.modules.get("fsdp_restore.torch_zip")
    if torch_zip is not None:
        part(torch_zip._Unpickler, "load", "  torch's unpickler, with the storages and the tensors' rebuild")
    part(write, "file_header", "  header, built (twice before with_checksums)")
    if hasattr(write, "with_checksums"):
        part(write, "with_checksums", "  checksums patched into the header")
    part(write, "combine_segments", "  crc32 joins")

    def step(label: str, fn: object) -> object:
        t, c = time.perf_counter(), time.process_time()
        result = fn()  # type: ignore[operator]
        times[label] = [time.perf_counter() - t, time.process_time() - c]
        return result

    with getattr(convert, "_gc_paused", contextlib.nullcontext)():
        identity = step("source identity (provenance)", lambda: source_identity(src))
        obj = step("load_pt", lambda: convert.load_pt(src))
        tensors, structure = step("flatten", lambda: flatten(obj))
        mapped, fd = MappedFile(src), os.open(src, os.O_RDONLY)
        where = step("offset_of", lambda: {k: (fd, o) for k, t in tensors.items()
                                           if (o := mapped.offset_of(t)) is not None})
        jobs = step("plan_jobs", lambda: plan_jobs(tensors, structure, None))
        for job in jobs:
            job.location = where.get(job.key)
        step("write", lambda: write.write_safetensors(
            dst, jobs, structure_json=json.dumps(structure, separators=(",", ":")), threads=4, force=True,
            metadata={META_SOURCE: json.dumps(identity)}))
    print(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("--dst", type=Path, default=None, help="default: SRC with .phases.safetensors, deleted after")
    parser.add_argument("--against", type=Path, help="a directory holding another version's fsdp_restore package")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write every run's times as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dst = args.dst or args.src.with_suffix(".phases.safetensors")
    if args.child:
        _child(str(args.src), str(dst))
        return
    trees = {"this checkout": str(Path(__file__).resolve().parent.parent)}
    if args.against:
        trees = {f"{args.against}": str(args.against.resolve()), **trees}
    open(args.src, "rb").read()  # page cache warm
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, root in trees.items():
            env = dict(os.environ, PYTHONPATH=root)
            out = subprocess.run([sys.executable, __file__, str(args.src), "--dst", str(dst), "--child"], env=env,
                                 capture_output=True, text=True, check=True, cwd="/")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    dst.unlink(missing_ok=True)
    for name, rows in runs.items():
        print(f"{name}: median of {len(rows)} runs, seconds (wall / CPU)")
        labels = list(dict.fromkeys(label for row in rows for label in row))
        for label in labels:
            wall = statistics.median(row[label][0] for row in rows if label in row)
            cpu = statistics.median(row[label][1] for row in rows if label in row)
            print(f"  {label:64s} {wall:6.2f} / {cpu:5.2f}")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
