"""Prove a converted checkpoint right: `verify` (checksums, optionally bit for bit against the
source ``.pt``) and `inspect` (what is inside, as a tree with sizes)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from .errors import FsdpRestoreError
from .flatten import flatten
from .format import torch_dtype_name
from .measure import Stopwatch
from .read import Checkpoint
from .checksum import combine_segments, plan_segments
from .write import default_threads, tensor_bytes

CHUNK_BYTES = 16 * 1024 * 1024


@dataclass
class VerifyReport:
    """The verdict: ``ok`` only when every check held. ``problems`` are (key or file, message)."""

    path: str
    against: str | None = None
    tensors: int = 0
    checksummed: int = 0
    compared: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _read_chunks(ckpt: Checkpoint, key: str, start: int, stop: int):
    """Yield the stored bytes of elements ``[start, stop)`` of ``key`` in chunks (positional reads; no
    mmap, no whole tensor)."""
    entry = ckpt.entries[key]
    step = max(1, CHUNK_BYTES // entry.itemsize)
    buf = torch.empty(min(step, max(stop - start, 1)), dtype=entry.dtype)
    for first in range(start, stop, step):
        piece = buf[: min(step, stop - first)]
        ckpt.read_range(key, first, piece)
        yield first, piece


def _check_segment(ckpt: Checkpoint, key: str, start: int, stop: int, source: torch.Tensor | None,
                   progress: Callable[[int], None]) -> tuple[int, str | None]:
    """One pass over elements ``[start, stop)`` of ``key``: their crc32, and (when ``source`` is given)
    None if they equal the source's after the recorded cast, else what differs."""
    entry = ckpt.entries[key]
    flat = source.detach().reshape(-1) if source is not None else None
    crc, diff = 0, None
    for first, piece in _read_chunks(ckpt, key, start, stop):
        crc = zlib.crc32(tensor_bytes(piece), crc)
        if flat is not None and diff is None:  # after the first difference, only the checksum goes on
            expected = flat[first:first + piece.numel()].to(entry.dtype).contiguous().view(torch.uint8)
            actual = piece.view(torch.uint8)
            if not torch.equal(expected, actual):
                same = (expected.reshape(piece.numel(), -1) == actual.reshape(piece.numel(), -1)).all(dim=1)
                at = first + int((~same).nonzero()[0])
                diff = (f"bytes differ from the source (first at flat element {at},"
                        f" {int((~same).sum())} elements in that chunk)")
        progress(piece.numel() * piece.element_size())
    return crc, diff


def _source_mismatch(ckpt: Checkpoint, key: str, source: torch.Tensor) -> str | None:
    """What makes ``source`` incomparable with the stored tensor (shape, dtype), or None."""
    entry = ckpt.entries[key]
    if tuple(source.shape) != entry.shape:
        return f"shape {list(entry.shape)} but source has {list(source.shape)}"
    original = ckpt.cast.get(key)
    if source.dtype != entry.dtype and original != torch_dtype_name(source.dtype):
        return f"dtype {entry.dtype} but source has {source.dtype} (and no cast was recorded)"
    return None


def verify(path: str | os.PathLike[str], *, against: str | os.PathLike[str] | None = None,
           select: str | None = None, threads: int | None = None, trust_pickle: bool = False,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check a checkpoint without its source: header sanity (offsets in range, no overlaps or
    holes, sizes), index consistency, the structure metadata, and every checksum. With
    ``against``, also compare the structure and every tensor bit for bit with the source ``.pt``
    (its subtree ``select`` when the checkpoint was converted with ``select``).
    Never raises for a bad checkpoint: the problems are in the report.
    """
    report = VerifyReport(path=str(path), against=str(against) if against else None)
    with Stopwatch() as clock:
        try:
            ckpt = Checkpoint(path)
        except FsdpRestoreError as e:
            report.problems.append((getattr(e, "path", str(path)), getattr(e, "problem", str(e))))
            return report
        with ckpt:
            _verify_open(ckpt, report, against, select, threads, trust_pickle, progress)
    report.seconds = clock.seconds
    return report


def _verify_open(ckpt: Checkpoint, report: VerifyReport, against: Any, select: str | None, threads: int | None,
                 trust_pickle: bool, progress: Callable[[int, int], None] | None) -> None:
    report.tensors = len(ckpt.entries)
    try:
        ckpt.load()  # decodes the whole structure against the real (memory-mapped) tensors
    except FsdpRestoreError as e:
        report.problems.append(("<structure>", str(e)))
    source: dict[str, torch.Tensor] = {}
    if against is not None:
        from .convert import load_pt, select_subtree

        try:
            src_tensors, src_structure = flatten(select_subtree(load_pt(against, trust_pickle=trust_pickle), select))
        except FsdpRestoreError as e:
            report.problems.append((str(against), str(e)))
            return
        except KeyError as e:
            report.problems.append((str(against), str(e).strip("'\"")))
            return
        if not select and not (src_tensors.keys() & ckpt.entries.keys()):
            report.problems.append(("<structure>", "no tensor key in common with the source; if the checkpoint"
                                    " was converted with --select, pass the same --select to verify"))
        if ckpt.has_structure and src_structure != ckpt.structure:
            report.problems.append(("<structure>", "nested structure differs from the source"
                                    " (keys, types or non-tensor values)"))
        for key in src_tensors.keys() - ckpt.entries.keys():
            report.problems.append((key, "in the source but missing from the checkpoint"))
        for key in ckpt.entries.keys() - src_tensors.keys():
            report.problems.append((key, "in the checkpoint but not in the source"))
        source = {k: t for k, t in src_tensors.items() if k in ckpt.entries}
    for key in list(source):
        mismatch = _source_mismatch(ckpt, key, source[key])
        if mismatch:
            report.problems.append((key, mismatch))
            del source[key]
    checked = [k for k in ckpt.entries if k in ckpt.checksums or k in source]
    total = sum(ckpt.entries[k].nbytes for k in checked)  # one read per byte: checksum and compare share it
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], total)

    threads = threads or default_threads()
    # a big tensor is cut into segments so that it spreads over the threads (crc32s are joined after)
    tasks = plan_segments(((k, ckpt.entries[k].numel, ckpt.entries[k].itemsize, True) for k in checked), threads)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(lambda t: _check_segment(ckpt, *t, source.get(t[0]), tick), tasks))
    segments: dict[str, list[tuple[int, int, int, str | None]]] = {k: [] for k in checked}
    for (key, start, stop), (crc, diff) in zip(tasks, results):
        segments[key].append((start, crc, (stop - start) * ckpt.entries[key].itemsize, diff))
    for key, parts in segments.items():
        parts.sort()
        diff = next((d for _, _, _, d in parts if d), None)  # the first difference in the tensor
        if diff:
            report.problems.append((key, diff))
        expected = ckpt.checksums.get(key)
        if expected is not None:  # with a diff too: a mismatch says the file changed after it was written
            actual = combine_segments((crc, nbytes) for _, crc, nbytes, _ in parts)
            if f"{actual:08x}" != expected:
                report.problems.append((key, f"checksum mismatch: stored crc32 {expected}, data has {actual:08x}"))
    for key in ckpt.checksums.keys() - ckpt.entries.keys():
        report.problems.append((key, "has a checksum but no tensor"))
    report.checksummed = sum(1 for k in ckpt.entries if k in ckpt.checksums)
    report.compared = len(source)
    report.nbytes = done[0]
    report.problems.sort()


def render_verify(report: VerifyReport, console: Console) -> None:
    table = Table(title=f"verify {report.path}" + (f" against {report.against}" if report.against else ""))
    table.add_column("check")
    table.add_column("result", justify="right")
    table.add_row("tensors", str(report.tensors))
    table.add_row("checksums verified", f"{report.checksummed}/{report.tensors}")
    if report.against:
        table.add_row("compared bit for bit", str(report.compared))
    table.add_row("bytes read", f"{report.nbytes / 1e6:.1f} MB in {report.seconds:.2f} s")
    table.add_row("verdict", "[green]OK[/]" if report.ok else f"[red]{len(report.problems)} problem(s)[/]")
    console.print(table)
    for where, what in report.problems:
        console.print(f"[red]FAIL[/] {where}: {what}", markup=True, highlight=False)


# ---------------------------------------------------------------------------------------------
# inspect


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-able description: files, totals, and the structure as a tree with sizes per subtree."""
    with Checkpoint(path) as ckpt:
        tree = _describe(ckpt.structure["root"], ckpt, "")
        return {"path": str(ckpt.path), "files": [str(Path(p)) for p in ckpt.headers],
                "has_structure": ckpt.has_structure, "tensors": len(ckpt.entries),
                "bytes": sum(e.nbytes for e in ckpt.entries.values()),
                "checksums": len(ckpt.checksums), "cast": ckpt.cast, "tree": tree}


def _describe(node: Any, ckpt: Checkpoint, name: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        return {"name": name, "kind": type(node).__name__ if node is not None else "None", "value": repr(node)[:60],
                "bytes": 0, "tensors": 0}
    kind = node.get("type")
    if kind in ("tensor", "ndarray", "bytes", "bytearray"):  # the validated structure: these carry a key
        entry = ckpt.entries[node["key"]]
        view = node.get("view")
        shape = view["shape"] if view else list(entry.shape)
        return {"name": name, "kind": kind, "key": node["key"], "dtype": str(entry.dtype).removeprefix("torch."),
                "shape": shape, "bytes": 0 if view else entry.nbytes,
                "tensors": 1, **({"view_of": node["key"]} if view else {})}
    if kind in ("dict", "OrderedDict", "Namespace", "list", "tuple", "set", "frozenset"):
        items = node["items"]
        pairs = items if kind in ("dict", "OrderedDict", "Namespace") else list(enumerate(items))
        children = [_describe(v, ckpt, k if isinstance(k, str) else str(k) if not isinstance(k, dict) else repr(k))
                    for k, v in pairs]
        seen: set[str] = set()
        for c in _leaves(children):  # aliases count once
            if c.get("key") in seen:
                c["bytes"] = 0
            seen.add(c.get("key", ""))
        return {"name": name, "kind": kind, "children": children,
                "bytes": sum(c["bytes"] for c in children), "tensors": sum(c["tensors"] for c in children)}
    value = node.get("value", node.get("items", ""))
    return {"name": name, "kind": kind, "value": str(value)[:60], "bytes": 0, "tensors": 0}


def _leaves(children: list[dict[str, Any]]):
    for c in children:
        if "children" in c:
            yield from _leaves(c["children"])
        else:
            yield c


def render_inspect(info: dict[str, Any], console: Console, max_depth: int = 3) -> None:
    def label(d: dict[str, Any]) -> str:
        size = f"{d['bytes'] / 1e6:.2f} MB" if d["bytes"] >= 1e5 else f"{d['bytes']} B"
        if "children" in d:
            return f"[bold]{d['name'] or '<root>'}[/] {d['kind']} ({len(d['children'])} items, {d['tensors']} tensors, {size})"
        if "dtype" in d:
            extra = f" view of {d['view_of']}" if "view_of" in d else ""
            return f"{d['name']} [cyan]{d['dtype']}[/] {d['shape']} {size}{extra}"
        return f"{d['name']} [dim]{d['kind']}[/] = {d['value']}"

    def add(tree: Tree, d: dict[str, Any], depth: int) -> None:
        for c in d.get("children", []):
            branch = tree.add(label(c), highlight=False)
            if depth < max_depth:
                add(branch, c, depth + 1)
            elif c.get("children"):
                branch.add("[dim]...[/]")

    root = Tree(label(info["tree"]) + f"  [dim]{info['path']}[/]")
    add(root, info["tree"], 1)
    console.print(root)
    console.print(f"{info['tensors']} tensors, {info['bytes'] / 1e6:.2f} MB in {len(info['files'])} file(s);"
                  f" {info['checksums']} checksums; structure: {'yes' if info['has_structure'] else 'none (plain file)'}")
