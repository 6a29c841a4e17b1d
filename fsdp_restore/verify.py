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
from .flatten import flatten, iter_nodes_with_keys
from .format import torch_dtype_name
from .measure import Stopwatch
from .read import Checkpoint
from .checksum import combine_segments, plan_segments
from .write import default_threads, tensor_bytes

CHUNK_BYTES = 16 * 1024 * 1024


IDENTICAL = "identical"
IDENTICAL_UP_TO_CAST = "identical up to the declared cast"
HEADER_ONLY = "header only"
FAILED = "failed"
EXIT_CODES = {IDENTICAL: 0, IDENTICAL_UP_TO_CAST: 0, FAILED: 1, HEADER_ONLY: 3}


@dataclass
class CastChange:
    """How much a declared cast changed a tensor, measured against the source."""

    key: str
    before: str
    after: str
    max_abs: float
    max_rel: float


@dataclass
class VerifyReport:
    """What `verify` proved. ``verdict``: `IDENTICAL` (bit for bit against the source, or, without one,
    every tensor's checksum verified), `IDENTICAL_UP_TO_CAST` (against the source after the casts the
    file declares; ``casts`` says how much each changed), `HEADER_ONLY` (no source and not every tensor
    has a checksum: only the header and the checksums there are were checked) or `FAILED`.
    ``problems`` are (key or file, message)."""

    path: str
    against: str | None = None
    tensors: int = 0
    checksummed: int = 0
    compared: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    problems: list[tuple[str, str]] = field(default_factory=list)
    casts: list[CastChange] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.problems:
            return FAILED
        if self.against is not None:
            return IDENTICAL_UP_TO_CAST if self.casts else IDENTICAL
        return IDENTICAL if self.checksummed == self.tensors else HEADER_ONLY

    @property
    def ok(self) -> bool:
        """The checkpoint was proven: identical, or identical up to its declared casts."""
        return self.verdict in (IDENTICAL, IDENTICAL_UP_TO_CAST)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


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


@dataclass
class _CastStats:
    """Running measures of what a cast changed (over the segments of one tensor)."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    integer_valued: bool = True  # every finite source value is a whole number (a counter, an index)
    changed: bool = False

    def update(self, src: torch.Tensor, stored: torch.Tensor) -> None:
        src64, back = src.double(), stored.to(src.dtype).double()
        finite = torch.isfinite(src64) & torch.isfinite(back)
        diff = (back - src64).abs()[finite]
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.max_rel = max(self.max_rel, float((diff / src64.abs()[finite].clamp_min(1e-30)).max()))
        self.changed |= bool((back != src64).any()) and not bool((back.isnan() & src64.isnan()).all())
        whole = src64[torch.isfinite(src64)]
        self.integer_valued &= bool((whole == whole.round()).all())

    def merge(self, other: _CastStats) -> None:
        self.max_abs, self.max_rel = max(self.max_abs, other.max_abs), max(self.max_rel, other.max_rel)
        self.integer_valued &= other.integer_valued
        self.changed |= other.changed


def _check_segment(ckpt: Checkpoint, key: str, start: int, stop: int, source: torch.Tensor | None,
                   progress: Callable[[int], None]) -> tuple[int, str | None, _CastStats | None]:
    """One pass over elements ``[start, stop)`` of ``key``: their crc32, and (when ``source`` is given)
    None if they equal the source's after the recorded cast, else what differs; for a cast tensor, how
    much the cast changed it."""
    entry = ckpt.entries[key]
    flat = source.detach().reshape(-1) if source is not None else None
    cast = _CastStats() if flat is not None and flat.dtype != entry.dtype else None
    crc, diff = 0, None
    for first, piece in _read_chunks(ckpt, key, start, stop):
        crc = zlib.crc32(tensor_bytes(piece), crc)
        if flat is not None and diff is None:  # after the first difference, only the checksum goes on
            src = flat[first:first + piece.numel()]
            expected = src.to(entry.dtype).contiguous().view(torch.uint8)
            actual = piece.view(torch.uint8)
            if not torch.equal(expected, actual):
                same = (expected.reshape(piece.numel(), -1) == actual.reshape(piece.numel(), -1)).all(dim=1)
                at = first + int((~same).nonzero()[0])
                diff = (f"bytes differ from the source (first at flat element {at},"
                        f" {int((~same).sum())} elements in that chunk)")
            elif cast is not None:
                cast.update(src, piece)
        progress(piece.numel() * piece.element_size())
    return crc, diff, cast


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


class _Piecewise:
    """A source tensor held in pieces (a ZeRO or DCP directory): just what the comparison uses of a tensor
    (shape, dtype, flat slices), each slice assembled from the files on demand."""

    def __init__(self, meta: torch.Tensor, reader: Callable[[int, int], torch.Tensor]) -> None:
        self.shape, self.dtype, self._reader = meta.shape, meta.dtype, reader

    def detach(self) -> _Piecewise:
        return self

    def reshape(self, *shape: int) -> _Piecewise:
        return self

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, where: slice) -> torch.Tensor:
        return self._reader(where.start, where.stop - where.start)

    def item(self) -> Any:
        return self._reader(0, 1).item()

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self._reader(0, max(1, int(torch.Size(self.shape).numel()))).to(dtype).reshape(self.shape)


def _source(against: Any, select: str | None, trust_pickle: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The source's flat tensors and structure: a ``.pt`` (loaded safely), or a ZeRO / DCP directory, whose
    sharded tensors are compared piece by piece, never assembled whole."""
    from .convert import load_pt, select_subtree
    from .dcp_in import is_dcp_checkpoint, read_dcp
    from .zero import is_zero_checkpoint, read_zero

    if Path(against).is_dir() and (is_zero_checkpoint(against) or is_dcp_checkpoint(against)):
        obj, pieces = read_dcp(against) if is_dcp_checkpoint(against) else read_zero(against)[:2]
        tensors, structure = flatten(select_subtree(obj, select))
        for key, t in list(tensors.items()):
            held = pieces.get(t.data_ptr())
            if held is not None:
                tensors[key] = _Piecewise(*held)
        return tensors, structure
    return flatten(select_subtree(load_pt(against, trust_pickle=trust_pickle), select))


def _stored_names(structure: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """``{name: (stored key, view or None)}`` for every tensor, ndarray and bytes node of a structure."""
    return {path: (node["key"], node.get("view")) for path, node in iter_nodes_with_keys(structure["root"])}


def _match_by_name(ckpt: Checkpoint, src_tensors: dict[str, torch.Tensor], src_structure: dict[str, Any],
                   report: VerifyReport, select: str | None) -> dict[str, torch.Tensor]:
    """The source tensor of every stored key, matched by *name* (the path in the nested object), so that
    tied names are aliases whichever of them either side stores: a file that keeps both names of a tied
    pair, or one that keeps one and records the other (``save_model``), matches a source that stores it
    once. Names on one side only are problems."""
    src_names = _stored_names(src_structure)
    ck_names = _stored_names(ckpt.structure)
    for dropped, kept in ckpt.tied_aliases().items():
        ck_names.setdefault(dropped, (kept, None))
    if not select and src_names and not (src_names.keys() & ck_names.keys()):
        report.problems.append(("<structure>", "no tensor name in common with the source; if the checkpoint"
                                " was converted with --select, pass the same --select to verify"))
    for name in sorted(src_names.keys() - ck_names.keys()):
        report.problems.append((name, "in the source but missing from the checkpoint"))
    for name in sorted(ck_names.keys() - src_names.keys()):
        report.problems.append((name, "in the checkpoint but not in the source"))
    source: dict[str, torch.Tensor] = {}
    for name, (key, view) in ck_names.items():
        if view is not None or key in source or name not in src_names or key not in ckpt.entries:
            continue  # a view is checked through its base tensor; an alias through its first name
        src_key, src_view = src_names[name]
        tensor = src_tensors[src_key]
        if src_view is not None:
            tensor = tensor.as_strided(src_view["shape"], src_view["stride"], tensor.storage_offset() + src_view["offset"])
        source[key] = tensor
    return source


def _verify_open(ckpt: Checkpoint, report: VerifyReport, against: Any, select: str | None, threads: int | None,
                 trust_pickle: bool, progress: Callable[[int, int], None] | None) -> None:
    report.tensors = len(ckpt.entries)
    try:
        ckpt.load()  # decodes the whole structure against the real (memory-mapped) tensors
    except FsdpRestoreError as e:
        report.problems.append(("<structure>", str(e)))
    source: dict[str, torch.Tensor] = {}
    if against is not None:
        try:
            src_tensors, src_structure = _source(against, select, trust_pickle)
        except FsdpRestoreError as e:
            report.problems.append((str(against), str(e)))
            return
        except KeyError as e:
            report.problems.append((str(against), str(e).strip("'\"")))
            return
        if ckpt.has_structure and src_structure != ckpt.structure:
            report.problems.append(("<structure>", "nested structure differs from the source"
                                    " (keys, types or non-tensor values)"))
        source = _match_by_name(ckpt, src_tensors, src_structure, report, select)
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
    stats: dict[str, _CastStats] = {}
    for (key, start, stop), (crc, diff, cast) in zip(tasks, results):
        segments[key].append((start, crc, (stop - start) * ckpt.entries[key].itemsize, diff))
        if cast is not None:
            stats.setdefault(key, _CastStats(integer_valued=True)).merge(cast)
    for key, parts in segments.items():
        parts.sort()
        diff = next((d for _, _, _, d in parts if d), None)  # the first difference in the tensor
        if diff:
            report.problems.append((key, diff))
        elif key in stats:
            _judge_cast(report, key, ckpt, source[key], stats[key])
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


def _judge_cast(report: VerifyReport, key: str, ckpt: Checkpoint, source: torch.Tensor, st: _CastStats) -> None:
    """A declared cast is acceptable on weights; one that changed a whole-number tensor (a counter, an
    index) or a 0-dim value (a step) changed what the run will do, and fails the verification."""
    before, after = torch_dtype_name(source.dtype), torch_dtype_name(ckpt.entries[key].dtype)
    report.casts.append(CastChange(key, before, after, st.max_abs, st.max_rel))
    if st.changed and source.dim() == 0:
        report.problems.append((key, f"the cast {before} -> {after} changed this 0-dim value"
                                     f" ({source.item()!r} -> {source.to(ckpt.entries[key].dtype).item()!r})"))
    elif st.changed and st.integer_valued:
        report.problems.append((key, f"the cast {before} -> {after} changed a tensor of whole numbers (a counter"
                                     f" or index?) by up to {st.max_abs:g}"))


def render_verify(report: VerifyReport, console: Console) -> None:
    table = Table(title=f"verify {report.path}" + (f" against {report.against}" if report.against else ""))
    table.add_column("check")
    table.add_column("result", justify="right")
    table.add_row("tensors", str(report.tensors))
    table.add_row("checksums verified", f"{report.checksummed}/{report.tensors}")
    if report.against:
        table.add_row("compared with the source", str(report.compared))
        if report.casts:
            table.add_row("cast on conversion (declared)", str(len(report.casts)))
    table.add_row("bytes read", f"{report.nbytes / 1e6:.1f} MB in {report.seconds:.2f} s")
    colour = {IDENTICAL: "green", IDENTICAL_UP_TO_CAST: "green", HEADER_ONLY: "yellow", FAILED: "red"}[report.verdict]
    text = report.verdict if report.verdict != FAILED else f"{len(report.problems)} problem(s)"
    table.add_row("verdict", f"[{colour}]{text}[/]")
    console.print(table)
    if report.casts:
        worst = sorted(report.casts, key=lambda c: -c.max_rel)
        console.print(f"{len(report.casts)} tensors differ from the source only by their declared cast; largest changes:",
                      highlight=False)
        for c in worst[:5]:
            console.print(f"  {c.key}: {c.before} -> {c.after}, max abs {c.max_abs:.3g}, max rel {c.max_rel:.3g}",
                          highlight=False)
    if report.verdict == HEADER_ONLY:
        console.print(f"[yellow]only the header was checked[/]: {report.tensors - report.checksummed} tensors carry no"
                      " checksum (a file written by another tool?); pass --against SOURCE.pt to compare every tensor",
                      highlight=False)
    for where, what in report.problems:
        console.print(f"[red]FAIL[/] {where}: {what}", markup=True, highlight=False)


# ---------------------------------------------------------------------------------------------
# inspect


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-able description: files, totals, and the structure as a tree with sizes per subtree."""
    with Checkpoint(path) as ckpt:
        tree = _describe(ckpt.structure["root"], ckpt, "")
        from .jobs import cast_groups

        casts = {k: (v, torch_dtype_name(ckpt.entries[k].dtype)) for k, v in ckpt.cast.items() if k in ckpt.entries}
        return {"path": str(ckpt.path), "files": [str(Path(p)) for p in ckpt.headers],
                "has_structure": ckpt.has_structure, "tensors": len(ckpt.entries),
                "bytes": sum(e.nbytes for e in ckpt.entries.values()),
                "checksums": len(ckpt.checksums), "cast": ckpt.cast, "cast_groups": cast_groups(casts),
                "source": ckpt.source, "tree": tree}


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
    for group, g in info.get("cast_groups", {}).items():
        console.print(f"cast on conversion: {group}: {g['tensors']} tensors ("
                      + ", ".join(f"{n} {label}" for label, n in g["casts"].items()) + ")", highlight=False)
    source = info.get("source")
    if source:
        console.print(f"converted from {source.get('name')} ({source.get('size')} bytes)", highlight=False)
