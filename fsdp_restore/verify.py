"""Prove a converted checkpoint right: `verify` (checksums, optionally bit for bit against the
source ``.pt`` as torch.load returns it) and `inspect` (what is inside, as a tree with sizes)."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import pickle
import re
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from .errors import FsdpRestoreError, allowed_global, thread_count_argument
from .flatten import flatten, iter_nodes_with_keys
from .format import SNIFF_BYTES, is_legacy_torch_save, torch_dtype_name
from .measure import Stopwatch
from .read import Checkpoint, find_safetensors_for
from .checksum import combine_segments, plan_segments
from .write import default_threads, tensor_bytes
from .zero_files import is_zero_checkpoint

CHUNK_BYTES = 16 * 1024 * 1024
COMPARE_BYTES = 4 * 1024 * 1024  # a piece compared with the source: up to two copies of it per thread


IDENTICAL = "identical"
IDENTICAL_UP_TO_CAST = "identical up to the declared cast"
IDENTICAL_UP_TO_DECLARED = "identical up to the declared changes"  # values dropped on conversion, and any casts
HEADER_ONLY = "header only"
FAILED = "failed"
EXIT_CODES = {IDENTICAL: 0, IDENTICAL_UP_TO_CAST: 0, IDENTICAL_UP_TO_DECLARED: 0, FAILED: 1, HEADER_ONLY: 3}


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
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (path, type) the file declares it dropped
    # tensors that share storage in the source, none covering the others, stored apart as the file declares
    apart: list[str] = field(default_factory=list)
    hint: str | None = None  # of a failure: its likely cause (a source other than the one the file records)

    @property
    def verdict(self) -> str:
        if self.problems:
            return FAILED
        if self.against is not None:
            return (IDENTICAL_UP_TO_DECLARED if self.dropped or self.apart else IDENTICAL_UP_TO_CAST if self.casts
                    else IDENTICAL)
        return IDENTICAL if self.checksummed == self.tensors else HEADER_ONLY

    @property
    def ok(self) -> bool:
        """The checkpoint was proven: identical, or identical up to its declared casts."""
        return self.verdict in (IDENTICAL, IDENTICAL_UP_TO_CAST, IDENTICAL_UP_TO_DECLARED)

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
    overflowed: int = 0  # finite source values stored as inf or NaN (beyond the stored dtype's range)

    def update(self, src: torch.Tensor, stored: torch.Tensor) -> None:
        src64, back = src.double(), stored.to(src.dtype).double()
        finite = torch.isfinite(src64) & torch.isfinite(back)
        self.overflowed += int((torch.isfinite(src64) & ~torch.isfinite(back)).sum())
        diff = (back - src64).abs()[finite]
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.max_rel = max(self.max_rel, float((diff / src64.abs()[finite].clamp_min(1e-30)).max()))
        self.changed |= bool(((back != src64) & ~(back.isnan() & src64.isnan())).any())  # NaN stays NaN: no change
        whole = src64[torch.isfinite(src64)]
        self.integer_valued &= bool((whole == whole.round()).all())

    def merge(self, other: _CastStats) -> None:
        self.max_abs, self.max_rel = max(self.max_abs, other.max_abs), max(self.max_rel, other.max_rel)
        self.integer_valued &= other.integer_valued
        self.changed |= other.changed
        self.overflowed += other.overflowed


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
            differs = None
            if not torch.equal(expected, actual):
                differs = (_cast_differs(src, piece) if cast is not None else
                           (expected.reshape(piece.numel(), -1) != actual.reshape(piece.numel(), -1)).any(dim=1))
            if differs is not None and bool(differs.any()):
                at = first + int(differs.nonzero()[0])
                diff = (f"bytes differ from the source (first at flat element {at},"
                        f" {int(differs.sum())} elements in that chunk)")
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
           select: str | None = None, thread_count: int | None = None, trust_pickle: bool = False,
           tag: str | None = None, progress: Callable[[int, int], None] | None = None,
           threads: int | None = None, allow_globals: Sequence[str] = ()) -> VerifyReport:
    """Check a checkpoint without its source: header sanity (offsets in range, no overlaps or
    holes, sizes), index consistency, the structure metadata, and every checksum.

    With ``against`` a ``.pt``, also prove that `fsdp_restore.load` of the checkpoint returns what
    ``torch.load`` returns for the source (weights-only unless ``trust_pickle``; its subtree ``select``
    when the checkpoint was converted with ``select``; ``allow_globals``: classes, as ``"module.Name"``, that
    the weights-only load may build, as given to `convert`), sharing no code with convert: node by node, types,
    keys and their order, lengths, shapes, dtypes (or the declared cast), conj/neg bits, requires_grad,
    storage sharing (both ways, where the file records it: not in a plain safetensors file) and every
    value bit for bit, in pieces of at most `COMPARE_BYTES`. A name the source holds and ``load`` does not
    return is missing, even when the file's metadata names it a tied alias (safetensors' ``save_model``); a
    value the file declares dropped (``on_unsupported="skip"``), where the source holds that type, is a declared
    change, reported in ``dropped``.
    With ``against`` a ZeRO or DCP directory, the structure and every tensor are compared by name (``tag``:
    the DeepSpeed tag the checkpoint was converted from, as `convert`'s; default: the one ``latest`` names).
    ``thread_count``: checksum and compare threads (default: every core); ``threads=``, its old name, still
    works with a `DeprecationWarning`. Never raises for a bad checkpoint: the problems are in the report
    (a ``thread_count`` that is not an int >= 1 is a `ValueError`: a bad argument, not a bad checkpoint).
    """
    thread_count = thread_count_argument(thread_count, threads)
    allowed = _allowed_classes(allow_globals)
    if select is not None and against is None:
        raise ValueError(f"select='{select}' (--select) picks the subtree of the source to compare with; it needs"
                         " against= (--against): pass the source, or drop select")
    if tag is not None and not (against is not None and is_zero_checkpoint(against)):
        raise ValueError(f"tag='{tag}' (--tag) picks a tag of the DeepSpeed checkpoint directory given as against="
                         f" (--against); {against if against is not None else 'no source'} is not one: drop tag")
    report = VerifyReport(path=str(path), against=str(against) if against else None)
    # what is checked: x.pt names its sibling x.safetensors (None: it has none, and opening it below says so)
    checked = find_safetensors_for(path)
    if (against is not None and checked is not None and os.path.exists(against) and os.path.exists(checked)
            and os.path.samefile(checked, against)):
        report.problems.append((str(against), "is the checkpoint itself: a comparison with itself proves nothing;"
                                " pass the source it was converted from (.pt, ZeRO or DCP directory)"))
        return report
    with Stopwatch() as clock:
        try:
            ckpt = Checkpoint(path)
        except FsdpRestoreError as e:
            report.problems.append((getattr(e, "path", str(path)), getattr(e, "problem", str(e))))
            return report
        with ckpt:
            _verify_open(ckpt, report, against, select, thread_count, (trust_pickle, allowed), progress, tag)
    if report.problems and against is not None:
        report.hint = _another_source(ckpt.source, against, path)
    report.seconds = clock.seconds
    return report


def _another_source(recorded: dict[str, Any] | None, against: Any, report_path: Any) -> str | None:
    """Where a comparison failed: that the file records another source than ``against``, the likely cause. Said
    only of a failure (what the file records never makes a comparison pass), and only where the record shows it:
    another name and another size (a source renamed since its conversion keeps its size)."""
    name, size = (recorded.get("name"), recorded.get("size")) if isinstance(recorded, dict) else (None, None)
    given = Path(against)
    if not isinstance(name, str) or name == given.name or not isinstance(size, int) or not given.is_file():
        return None
    given_size = given.stat().st_size
    if size == given_size:
        return None
    return (f"{given.name} is not the source {Path(report_path).name} records: that was {name}, of {size} bytes"
            f" ({given.name} has {given_size}); compare it with that one, or convert {given.name}")


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


def _sharded_source(against: Any, select: str | None, tag: str | None = None,
                    trusted: tuple[bool, Sequence[Any]] = (False, ())) -> tuple[dict[str, Any], dict[str, Any]]:
    """The flat tensors and structure of a ZeRO / DCP directory, whose sharded tensors are compared piece by
    piece, never assembled whole. ``trusted``: ``(trust_pickle, extra allowed classes)``."""
    from .convert import _allowlist, select_subtree  # the allowlist decides what loads, never what it holds
    from .dcp_in import is_dcp_checkpoint, read_dcp
    from .zero import read_zero

    trust_pickle, allowed = trusted
    safe = {"safe_globals": _allowlist() + list(allowed), "trust_pickle": trust_pickle}
    obj, pieces = read_dcp(against, **safe) if is_dcp_checkpoint(against) else read_zero(against, tag=tag, **safe)[:2]
    with warnings.catch_warnings():  # a value no file can hold is a skipped node here, compared with what the file
        warnings.simplefilter("ignore")  # declares it dropped (the structures must match), never a failure
        tensors, structure = flatten(select_subtree(obj, select), on_unsupported="skip")
    for key, t in list(tensors.items()):
        held = pieces.get(t.data_ptr())
        if held is not None:
            tensors[key] = _Piecewise(*held)
    return tensors, structure


def _is_sharded_source(against: Any) -> bool:
    from .dcp_in import is_dcp_checkpoint

    return Path(against).is_dir() and (is_zero_checkpoint(against) or is_dcp_checkpoint(against))


def _stored_names(structure: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """``{name: (stored key, view or None)}`` for every tensor, ndarray and bytes node of a structure."""
    return {path: (node["key"], node.get("view")) for path, node in iter_nodes_with_keys(structure["root"])}


def _whole_file_hint(select: str) -> str:
    """What to say where ``select`` was given but the checkpoint holds the whole source, the selected subtree in it."""
    return (f"no name in common with the source's '{select}', and the checkpoint holds '{select.split('.')[0]}'"
            " itself: it was converted without --select. Drop --select to compare the whole file (or convert again"
            f" with --select {select})")


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
    if src_names and not (src_names.keys() & ck_names.keys()):
        head = (select or "").split(".")[0]
        if not select:
            report.problems.append(("<structure>", "no tensor name in common with the source; if the checkpoint"
                                    " was converted with --select, pass the same --select to verify"))
        elif any(name == head or name.startswith(f"{head}.") for name in ck_names):
            report.problems.append(("<structure>", _whole_file_hint(select)))
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


# ---------------------------------------------------------------------------------------------
# the oracle for a .pt source: torch.load's object against fsdp_restore.load's, node by node. It shares no code
# with convert (no load_pt, no flatten), so a bug there cannot make both sides agree.


def _allowed_classes(names: Sequence[str]) -> list[Any]:
    """The classes ``"module.Name"`` names, imported (a `ValueError` naming any that cannot be): an importer of the
    oracle's own, not convert's."""
    if isinstance(names, str):
        raise ValueError("allow_globals must be a list of names such as ['mypkg.Config'], not a string")
    found = []
    for name in names:
        module, _, attr = str(name).rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"allow_globals: cannot import '{name}' ({e})") from None
        found.append(allowed_global(str(name), obj))  # the rule convert's allow list follows: classes that hold data
    return found


def _load_pt_as_torch_does(path: str | os.PathLike[str], trust_pickle: bool, allowed: Sequence[Any] = ()) -> Any:
    """The source exactly as ``torch.load`` returns it: weights-only unless trusted, memory-mapped when torch
    can map it. Its mmap path takes a compressed zip member's bytes as tensor data (garbage), so a file with
    any member not ZIP_STORED is read with torch's plain reader, which inflates them (in memory)."""
    from .convert import _allowlist  # which globals may be *imported*: decides what loads, never what it holds

    mmap = zipfile.is_zipfile(path)
    if mmap:
        with zipfile.ZipFile(path) as z:
            mmap = all(info.compress_type == zipfile.ZIP_STORED for info in z.infolist())
    kwargs: dict[str, Any] = {"map_location": "cpu", "mmap": mmap, "weights_only": not trust_pickle}
    if trust_pickle:
        return torch.load(path, **kwargs)
    with torch.serialization.safe_globals(_allowlist() + list(allowed)):
        return torch.load(path, **kwargs)


def _source_part(path: Any, select: str | None, trust_pickle: bool, allowed: Sequence[Any]) -> Any:
    """The part ``select`` of the source as ``torch.load`` returns it (`_load_pt_as_torch_does`). Where torch's
    weights-only unpickler refuses a global and a part is selected, the file is loaded again by it with each refused
    global an inert stand-in (`inert`, as convert's `load_selected` does, so that a part converted without
    the globals around it verifies the same way), and the part is compared if no stand-in is inside it."""
    try:
        try:
            return _select(_load_pt_as_torch_does(path, trust_pickle, allowed), select)
        except KeyError as e:
            if trust_pickle:  # the file's own code raised it
                raise RuntimeError(f"KeyError: {e}") from None
            raise _NoPickle(f"unknown pickle opcode {e}") from None  # weights-only: bytes that are no pickle
    except Exception as e:
        if select is None or trust_pickle or "Unsupported global" not in str(e):
            raise
        refusal = e
    from .convert import refused_globals
    from .errors import allow_global_hint
    from .inert import inert_within, load_with_stand_ins, refused_in

    # (a legacy file's pickle is not scanned: torch's refusal names its first global, the loads the others)
    refused = refused_globals(path, allowed) if zipfile.is_zipfile(path) else refused_in(str(refusal))
    if not refused:
        raise refusal
    try:
        whole, aliases = load_with_stand_ins(lambda stand_ins: _load_pt_as_torch_does(
            path, False, [*allowed, *stand_ins]), refused)
    except Exception:  # noqa: BLE001 - torch refuses the file even with them inert: its first refusal stands
        raise refusal from None
    part = _select(whole, select)
    inside = inert_within(part, aliases)
    if inside:
        raise FsdpRestoreError(f"the part '{select}' holds objects of {', '.join(inside)}, which torch.load's"
                               f" weights-only unpickler refuses. {allow_global_hint(inside)}")
    return part


def _whole_torch_zip(path: Any) -> bool:
    """A zip archive with its directory and a pickle record, as torch.save writes one (or a legacy file, which is
    no zip: its failures are the pickle's, not the container's)."""
    try:
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                return is_legacy_torch_save(f.read(SNIFF_BYTES))
        with zipfile.ZipFile(path) as z:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
    except OSError:
        return False


class _NoPickle(Exception):
    """torch's weights-only unpickler met a byte that is no pickle opcode (it raises KeyError for it)."""


def _truncated_zip(path: Any) -> bool:
    """A file that starts as a zip archive but that Python's `zipfile` cannot open (no end of central directory)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return False
        return not zipfile.is_zipfile(path)
    except OSError:
        return False


def _load_failure(e: Exception, path: Any, trust_pickle: bool) -> str:
    """One line for torch.load's refusal of the source, and what to do."""
    from .convert import weights_only_refusal_hint

    text = str(e)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    hint = weights_only_refusal_hint(path) if "Weights only load failed" in text and not trust_pickle else ""
    if not hint and "Unsupported global" not in text:  # not a refusal of what the file holds
        # weights-only, nothing of the file's runs: any failure is the file's; trusted, its own code may fail too
        damaged = (not trust_pickle or isinstance(e, (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, _NoPickle))
                   or not _whole_torch_zip(path))
        if damaged and _truncated_zip(path):
            return ("a zip archive (torch.save's format) without its central directory: truncated or damaged"
                    f" (torch.load: {type(e).__name__}: {first[:120]}); copy it again from where it was saved")
        return (f"torch.load cannot read it ({type(e).__name__}: {first[:200]})"
                + (": not a torch.save file, or a damaged one" if damaged else ""))
    why = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    return (f"torch.load's weights-only unpickler refuses it ({(why.group(1) if why else first)[:200]})"
            f"{hint}; pass the classes convert was allowed with --allow-global"
            " (allow_globals=), or, if you trust the file, --trust-pickle (trust_pickle=True)")


def _select(obj: Any, select: str | None) -> Any:
    """The subtree at dotted path ``select``: dict keys, str or int (matched by their text: of the keys that the rest
    of the path starts with, up to a dot, the shortest with which the rest is found, so that a key holding dots is
    found where no shorter key leads on; a str key before an int of the same text), list indices, attributes.
    A walker of its own, not `convert.select_subtree`: the oracle shares no code with what it checks."""
    stops: list[tuple[int, str]] = []  # (length of the path walked, why it stopped): the longest is said

    def follow(node: Any, rest: str, done: str) -> tuple[bool, Any]:
        if not rest:
            return True, node
        here = done or "<root>"
        if isinstance(node, dict):
            matching = sorted((k for k in node if type(k) in (str, int)  # (a bool or a float key: no path names it)
                               and (rest == str(k) or rest.startswith(f"{k}."))),
                              key=lambda k: (len(str(k)), not isinstance(k, str)))
            if not matching:
                stops.append((len(done), f"no key '{rest.split('.', 1)[0]}' at '{here}' (keys there:"
                              f" {', '.join(str(k) for k in list(node)[:10])}{', ...' if len(node) > 10 else ''})"))
            for key in matching:
                step = str(key)
                reached, value = follow(node[key], rest[len(step) + 1:], f"{done}.{step}" if done else step)
                if reached:
                    return True, value
            return False, None
        step = rest.split(".", 1)[0]
        if isinstance(node, (list, tuple)) and step.isdigit() and int(step) < len(node):
            child = node[int(step)]
        elif isinstance(node, argparse.Namespace) and hasattr(node, step):
            child = getattr(node, step)
        else:
            stops.append((len(done), f"cannot descend into {type(node).__name__} at '{here}' with '{step}'"))
            return False, None
        return follow(child, rest[len(step) + 1:], f"{done}.{step}" if done else step)

    reached, value = follow(obj, select or "", "")
    if not reached:
        raise KeyError(f"select='{select}': {max(stops, key=lambda s: s[0])[1]}")
    return value


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _skipped_values(node: Any, parts: tuple[Any, ...] = (), found: dict[tuple[Any, ...], str] | None = None
                    ) -> dict[tuple[Any, ...], str]:
    """``{typed path: python type}`` of every value the structure records as dropped on conversion (a
    ``skipped`` node). A typed path is the steps `_Comparer.walk` takes: ``("key", type, key)`` into a mapping,
    ``("item", i)`` into a list or tuple, so that keys 1 and "1", a key "a.b" and a key "b" under "a", item 0 and
    key "0" stay apart. Keys that are JSON scalars (str, int, bool, None) only: a value dropped under another key
    or inside a set is not looked for, and so stays a difference."""
    found = {} if found is None else found
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "skipped":
            found[parts] = str(node.get("python_type"))
        elif kind in ("dict", "OrderedDict", "Namespace"):
            for key, value in node.get("items", []):
                if key is None or type(key) in (str, int, bool):
                    _skipped_values(value, (*parts, ("key", type(key), key)), found)
        elif kind in ("list", "tuple"):
            for i, value in enumerate(node.get("items", [])):
                _skipped_values(value, (*parts, ("item", i)), found)
    return found


def _typed_path_text(parts: tuple[Any, ...]) -> str:
    """A typed path of `_skipped_values` as text, dotted as the structure's names are."""
    return ".".join(str(step[2]) if step[0] == "key" else str(step[1]) for step in parts) or "<root>"


def _same_float(a: float, b: float) -> bool:
    """Equal as stored, bit for bit: a NaN equals a NaN of the same sign and payload, -0.0 differs from 0.0."""
    if a != a or b != b:
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


@dataclass
class _Pair:
    """A source tensor (or ndarray) and the checkpoint's at the same path, to compare bit for bit;
    ``cast_key`` is the checkpoint's stored key when the pair's dtypes differ by a declared cast."""

    path: str
    src: Any
    out: Any
    cast_key: str | None = None

    @property
    def itemsize(self) -> int:
        return self.out.itemsize if isinstance(self.out, np.ndarray) else self.out.element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(np.shape(self.out)) * self.itemsize


class _Comparer:
    """One walk over both objects, side by side. Records every difference in types, keys and their order,
    lengths, shapes, dtypes, conj/neg bits, requires_grad, storage sharing and non-tensor values as
    ``(path, message)``; the tensors whose values need comparing go to ``pairs`` (`_compare_values`)."""

    def __init__(self, ckpt: Checkpoint, select: str | None) -> None:
        # Only our structure records a container's type, its key order and shared storage; a plain
        # safetensors file (no structure) is a dict of names whatever was saved, and cannot share storage.
        self.structured = ckpt.has_structure
        self.select = select
        nodes = list(iter_nodes_with_keys(ckpt.structure["root"]))
        self.keys = {path: node["key"] for path, node in nodes}
        self.stored_apart = {path for path, node in nodes if node.get("apart") is True}
        self.apart: list[str] = []
        self.cast = ckpt.cast
        self.aliases = ckpt.tied_aliases()
        self.problems: list[tuple[str, str]] = []
        self.skipped = _skipped_values(ckpt.structure["root"]) if self.structured else {}
        self.dropped: list[tuple[str, str]] = []
        self.pairs: list[_Pair] = []
        self._groups: tuple[dict[int, tuple[str, int]], dict[int, tuple[str, int]]] = ({}, {})
        self._seen: set[tuple[Any, ...]] = set()

    def walk(self, src: Any, out: Any, path: str = "", parts: tuple[Any, ...] = ()) -> None:
        """Compare ``src`` with ``out`` at ``path`` (its text) / ``parts`` (its typed steps: `_skipped_values`)."""
        t = type(src)
        if out is None and self.skipped.get(parts) == f"{t.__module__}.{t.__qualname__}":
            self.dropped.append((path or "<root>", self.skipped[parts]))  # dropped on conversion, as declared
            return
        if t is not type(out) and not (path == "" and not self.structured and isinstance(src, dict)
                                       and isinstance(out, dict)):
            # a dict for an OrderedDict under the same names (what they hold is compared too, below); at the root,
            # other names mean a subtree converted alone, or a --select that does not fit the file
            both_mappings = (isinstance(src, dict) and isinstance(out, dict)
                             and (path != "" or list(src) == list(out)))
            self.problems.append((path or "<root>", f"{type(out).__qualname__} but the source has {t.__qualname__}"
                                                    f"{self._kind_hint(path, out, both_mappings)}"))
            if both_mappings:
                self._mapping(path, parts, list(src.items()), list(out.items()))
        elif isinstance(src, torch.Tensor):
            self._tensor(path, src, out)
        elif t is np.ndarray:
            self._ndarray(path, src, out)
        elif isinstance(src, dict):
            self._mapping(path, parts, list(src.items()), list(out.items()))
        elif t is argparse.Namespace:
            self._mapping(path, parts, list(vars(src).items()), list(vars(out).items()))
        elif t is list or t is tuple:
            if len(src) != len(out):
                self.problems.append((path or "<root>", f"{len(out)} items but the source has {len(src)}"))
            for i, (a, b) in enumerate(zip(src, out)):
                self.walk(a, b, _join(path, i), (*parts, ("item", i)))
        elif not self._same_value(src, out):
            self.problems.append((path or "<root>", f"value {out!r:.60} but the source has {src!r:.60}"))

    def _kind_hint(self, path: str, out: Any, both_mappings: bool) -> str:
        """What a value of another kind than the source's at ``path`` likely means."""
        if both_mappings:
            return ("; a file save_sharded wrote holds plain dicts, where torch.save(model.state_dict()) holds an"
                    " OrderedDict: what they hold is compared all the same")
        if path:
            return ""
        if not self.select:
            return "; if the checkpoint was converted with --select, pass the same --select to verify"
        if isinstance(out, dict) and self.select.split(".", 1)[0] in out:
            return (f"; the checkpoint holds '{self.select}' itself: it was converted without --select. Drop --select"
                    " to compare the whole file")
        return ""

    @staticmethod
    def _same_value(a: Any, b: Any) -> bool:
        if type(a) is float:
            return _same_float(a, b)
        if type(a) is complex:
            return _same_float(a.real, b.real) and _same_float(a.imag, b.imag)
        if isinstance(a, np.generic):
            return a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes()
        try:
            return bool(a == b)
        except Exception:  # an object (only with trust_pickle) whose == does not give one bool
            return False

    def _mapping(self, path: str, parts: tuple[Any, ...], src: list[tuple[Any, Any]], out: list[tuple[Any, Any]]
                 ) -> None:
        """Keys as (type, value) pairs, so that 1, 1.0 and True stay apart; values walked by key."""
        out_by_key = {(type(k), k): v for k, v in out}
        src_keys = [(type(k), k) for k, _ in src]
        if path == "" and src and out and not out_by_key.keys() & set(src_keys):
            if not self.select:
                self.problems.append(("<structure>", "no name in common with the source; if the checkpoint was"
                                      " converted with --select, pass the same --select to verify"))
            elif (str, self.select.split(".")[0]) in out_by_key:
                self.problems.append(("<structure>", _whole_file_hint(self.select)))
        for (kt, k), (_, v) in zip(src_keys, src):
            if (kt, k) in out_by_key:
                self.walk(v, out_by_key[(kt, k)], _join(path, k), (*parts, ("key", kt, k)))
            else:
                alias = self.aliases.get(_join(path, k))
                hint = (f" (the file's metadata records it as an alias of '{alias}', as safetensors' save_model"
                        " writes: restore honours that, but load() does not return it)") if alias else ""
                self.problems.append((_join(path, k), "in the source but missing from the checkpoint" + hint))
        for kt, k in out_by_key.keys() - set(src_keys):
            self.problems.append((_join(path, k), "in the checkpoint but not in the source"))
        common = set(src_keys) & out_by_key.keys()
        if self.structured and [k for k in src_keys if k in common] != [(type(k), k) for k, _ in out
                                                                         if (type(k), k) in common]:
            self.problems.append((path or "<root>", "keys are in another order than in the source"))

    def _tensor(self, path: str, src: torch.Tensor, out: torch.Tensor) -> None:
        where = path or "<root>"
        for what, a, b in (("conj bit", src.is_conj(), out.is_conj()), ("neg bit", src.is_neg(), out.is_neg()),
                           ("requires_grad", src.requires_grad, out.requires_grad)):
            if a != b:
                self.problems.append((where, f"{what} {b} but the source has {a}"))
        if src.shape != out.shape:
            self.problems.append((where, f"shape {list(out.shape)} but the source has {list(src.shape)}"))
            return
        key = self.keys.get(path, path)
        cast = src.dtype != out.dtype
        if cast and self.cast.get(key) != torch_dtype_name(src.dtype):
            self.problems.append((where, f"dtype {out.dtype} but the source has {src.dtype} (and no cast was recorded)"))
            return
        self._shared_alike(where, src, out)
        self._add(_Pair(path, src.detach(), out.detach(), key if cast else None))

    def _ndarray(self, path: str, src: np.ndarray, out: np.ndarray) -> None:
        if src.dtype.str != out.dtype.str or src.shape != out.shape:
            self.problems.append((path or "<root>", f"ndarray of dtype {out.dtype.str} and shape {list(out.shape)} but"
                                  f" the source has dtype {src.dtype.str} and shape {list(src.shape)}"))
            return
        self._add(_Pair(path, src, out))

    def _shared_alike(self, where: str, src: torch.Tensor, out: torch.Tensor) -> None:
        """Tensors that share storage in the source share it in the checkpoint, at the same element offset from
        the first tensor seen on that storage, and no others do (where the file can record sharing)."""
        if not self.structured or src.numel() == 0:
            return
        places = []
        for groups, t in zip(self._groups, (src, out)):
            first = groups.setdefault(t.untyped_storage().data_ptr(), (where, t.storage_offset()))
            places.append((first[0], t.storage_offset() - first[1]))
        if places[0] != places[1] and places[1][0] == where and where in self.stored_apart:
            self.apart.append(where)  # shared in the source, none of its tensors covering the others: as declared
        elif places[0] != places[1]:
            def say(p: tuple[str, int]) -> str:
                return "its own storage" if p[0] == where else f"storage of '{p[0]}' at element offset {p[1]:+d}"
            self.problems.append((where, f"{say(places[1])} but in the source {say(places[0])}"))

    def _add(self, pair: _Pair) -> None:
        """Queue a value comparison, once for each (source view, checkpoint view): an alias seen again is
        already compared."""
        def view(x: Any) -> tuple[Any, ...]:
            if isinstance(x, np.ndarray):
                return (id(x),)
            return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype,
                    x.is_conj(), x.is_neg())
        seen = (view(pair.src), view(pair.out))
        if seen not in self._seen:
            self._seen.add(seen)
            self.pairs.append(pair)


def _chunks(shape: tuple[int, ...], itemsize: int) -> Iterator[tuple[Any, ...]]:
    """Indices that cut an array of ``shape`` into pieces of at most `COMPARE_BYTES` (runs of whole rows, or
    pieces of one row when a row is bigger), so that no comparison holds a big tensor whole."""
    if not shape or math.prod(shape) * itemsize <= COMPARE_BYTES:
        yield ()
        return
    step = COMPARE_BYTES // (math.prod(shape[1:]) * itemsize)
    if step:
        for i in range(0, shape[0], step):
            yield (slice(i, i + step),)
    else:
        for i in range(shape[0]):
            for rest in _chunks(shape[1:], itemsize):
                yield (i, *rest)


def _raw(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor | np.ndarray:
    """The bytes of one piece, as uint8: a tensor's with its conj/neg bits applied (they are compared apart),
    after the declared cast ``dtype``; NaN payloads and -0.0 differ from other NaNs and 0.0 as stored."""
    if isinstance(x, torch.Tensor):
        x = x.resolve_conj().resolve_neg()
        if dtype is not None:
            x = x.to(dtype)
        return x.contiguous().reshape(-1).view(torch.uint8)
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _equal(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    # torch.equal compares in place; np.array_equal would first allocate a bool per byte
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else bool(np.array_equal(a, b))


@dataclass
class _Piece:
    """What comparing one piece found: elements that differ (the first one's index), bytes read, and for a
    cast what it changed; ``error`` when the piece could not be compared at all."""

    nbytes: int
    differ: int = 0
    first: list[int] | None = None
    cast: _CastStats | None = None
    error: str | None = None


def _cast_differs(src: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Per element of a declared cast, flat: whether ``stored`` differs from ``src`` cast to its dtype, bit for bit,
    except that any NaN equals any NaN. Which NaN a cast makes depends on torch's code path, not on the file (fp32 ->
    bf16: 0x7fc0 from a 0-dim `.to`, 0xffff from a vectorized copy); outside casts NaN bits are compared."""
    expected = src.resolve_conj().resolve_neg().to(stored.dtype).contiguous().reshape(-1)
    stored = stored.contiguous().reshape(-1)
    n = expected.numel()
    bits_differ = (expected.view(torch.uint8).reshape(n, -1) != stored.view(torch.uint8).reshape(n, -1)).any(dim=1)

    def nan(t: torch.Tensor) -> torch.Tensor:
        return (t.float() if t.element_size() == 1 else t).isnan()

    return bits_differ & ~(nan(expected) & nan(stored))


def _compare_piece(pair: _Pair, idx: tuple[Any, ...]) -> _Piece:
    """Compare ``pair`` at ``idx`` (one of `_chunks`): a copy of at most `COMPARE_BYTES` per side."""
    src, out = pair.src[idx], pair.out[idx]
    a, b = _raw(src, out.dtype if pair.cast_key else None), _raw(out)
    shape = tuple(np.shape(out))
    n = math.prod(shape)
    differ = None
    if not _equal(a, b):
        if pair.cast_key is not None:
            differ = _cast_differs(src, out).numpy()
        else:
            a, b = np.asarray(a), np.asarray(b)  # a uint8 tensor's bytes, not copied
            differ = (a.reshape(n, -1) != b.reshape(n, -1)).any(axis=1)
    if differ is None or not differ.any():
        stats = None
        if pair.cast_key is not None and n:
            stats = _CastStats()
            stats.update(src, out)
        return _Piece(math.prod(b.shape), cast=stats)
    local = [int(i) for i in np.unravel_index(int(np.argmax(differ)), shape)] if shape else []
    if idx and isinstance(idx[-1], slice):  # a run of rows: its first row's index
        local[0] += idx[-1].start
    return _Piece(math.prod(b.shape), int(differ.sum()), [i for i in idx if isinstance(i, int)] + local)


def _compare_values(comparer: _Comparer, ckpt: Checkpoint, report: VerifyReport, pool: ThreadPoolExecutor,
                    tick: Callable[[int], None]) -> None:
    """Compare every queued pair bit for bit, piece by piece on the pool; judge declared casts per stored key."""
    tasks = [(pair, idx) for pair in comparer.pairs for idx in _chunks(tuple(np.shape(pair.out)), pair.itemsize)]

    def run(task: tuple[_Pair, tuple[Any, ...]]) -> _Piece:
        try:
            piece = _compare_piece(*task)
        except (RuntimeError, TypeError, ValueError) as e:  # a layout torch cannot slice or view as bytes
            piece = _Piece(0, error=(str(e).strip().splitlines() or [type(e).__name__])[0][:160])
        tick(piece.nbytes)
        return piece

    found: dict[str, _Piece] = {}  # per path: the first problem, differing elements summed
    casts: dict[str, tuple[torch.Tensor, _CastStats]] = {}
    for (pair, _), piece in zip(tasks, pool.map(run, tasks)):
        if piece.error or piece.differ:
            seen = found.setdefault(pair.path, _Piece(0, first=piece.first, error=piece.error))
            seen.differ += piece.differ
        elif piece.cast is not None:
            src, stats = casts.get(pair.cast_key, (pair.src, _CastStats()))
            stats.merge(piece.cast)  # type: ignore[arg-type]
            # judged as the tensor stored, not as an alias of another shape (w[3] beside w, s.expand(4) beside s)
            stored = tuple(pair.src.shape) == tuple(ckpt.entries[pair.cast_key].shape)
            casts[pair.cast_key] = (pair.src if stored else src, stats)
    for path, p in found.items():
        report.problems.append((path or "<root>", f"cannot compare with the source: {p.error}" if p.error else
                                f"bytes differ from the source ({p.differ} elements, first at index {p.first})"))
    failed = {comparer.keys.get(path, path) for path in found}
    for key, (src, stats) in casts.items():
        if key not in failed:
            _judge_cast(report, key, ckpt, src, stats)
    report.compared = len(comparer.pairs)


_UNLOADED = object()  # `_verify_open`: the checkpoint could not be loaded (its problem is reported)


def _verify_open(ckpt: Checkpoint, report: VerifyReport, against: Any, select: str | None, threads: int | None,
                 unpickling: tuple[bool, list[Any]], progress: Callable[[int, int], None] | None,
                 tag: str | None = None) -> None:
    trust_pickle, allowed = unpickling
    report.tensors = len(ckpt.entries)
    loaded: Any = _UNLOADED  # not None: a file may hold None, or a dropped value, at its root
    try:
        loaded = ckpt.load()  # what fsdp_restore.load returns: the structure decoded over memory-mapped tensors
    except FsdpRestoreError as e:
        report.problems.append(("<structure>", str(e)))
    source: dict[str, torch.Tensor] = {}  # stored key -> source tensor, compared while checksumming (directories)
    comparer: _Comparer | None = None  # a .pt source: compared node by node with what load returned
    if against is not None:
        try:
            if _is_sharded_source(against):
                src_tensors, src_structure = _sharded_source(against, select, tag, (trust_pickle, allowed))
            else:
                src_obj = _source_part(against, select, trust_pickle, allowed)
        except FsdpRestoreError as e:
            report.problems.append((str(against), str(e)))
            return
        except KeyError as e:
            report.problems.append((str(against), str(e.args[0]) if e.args else str(e)))
            return
        except Exception as e:  # torch.load's own refusal: corrupt, or beyond the weights-only unpickler
            report.problems.append((str(against), _load_failure(e, against, trust_pickle)))
            return
        if _is_sharded_source(against):
            if ckpt.has_structure and src_structure != ckpt.structure:
                report.problems.append(("<structure>", "nested structure differs from the source"
                                        " (keys, types or non-tensor values)"))
            elif ckpt.has_structure:  # the values the source holds and the file declares it dropped (and nothing else)
                report.dropped = [(_typed_path_text(parts), kind) for parts, kind in
                                  _skipped_values(ckpt.structure["root"]).items()]
            source = _match_by_name(ckpt, src_tensors, src_structure, report, select)
        elif loaded is not _UNLOADED:
            comparer = _Comparer(ckpt, select)
            try:
                comparer.walk(src_obj, loaded)
            except RecursionError:
                comparer.problems.append(("<root>", "nested too deeply to compare"))
            report.problems += comparer.problems
            report.dropped = comparer.dropped
            report.apart = comparer.apart
    for key in list(source):
        mismatch = _source_mismatch(ckpt, key, source[key])
        if mismatch:
            report.problems.append((key, mismatch))
            del source[key]
    checked = [k for k in ckpt.entries if k in ckpt.checksums or k in source]
    total = sum(ckpt.entries[k].nbytes for k in checked)  # one read per byte: checksum and compare share it
    total += sum(p.nbytes for p in comparer.pairs) if comparer else 0
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
        if comparer is not None:
            _compare_values(comparer, ckpt, report, pool, tick)
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
    report.compared += len(source)
    report.nbytes = done[0]
    report.problems.sort()


def _judge_cast(report: VerifyReport, key: str, ckpt: Checkpoint, source: torch.Tensor, st: _CastStats) -> None:
    """A declared cast is acceptable on weights; one that made finite values inf or NaN, or changed a whole-number
    tensor (a counter, an index) or a 0-dim value (a step), changed what the run will do, and fails the
    verification."""
    before, after = torch_dtype_name(source.dtype), torch_dtype_name(ckpt.entries[key].dtype)
    report.casts.append(CastChange(key, before, after, st.max_abs, st.max_rel))
    if st.overflowed:
        report.problems.append((key, f"the cast {before} -> {after} made {st.overflowed} finite value(s) infinite or"
                                     f" NaN (beyond {after}'s range): the run would not go on as it was"))
    elif st.changed and not ckpt.entries[key].shape:  # the tensor stored is 0-dim, whatever views name it too
        value = source.reshape(-1)[0:1]  # (a slice: a source held in pieces, `_Piecewise`, reads slices only)
        report.problems.append((key, f"the cast {before} -> {after} changed this 0-dim value"
                                     f" ({value.item()!r} -> {value.to(ckpt.entries[key].dtype).item()!r})"))
    elif st.changed and st.integer_valued:
        report.problems.append((key, f"the cast {before} -> {after} changed a tensor of whole numbers (a counter"
                                     f" or index?) by up to {st.max_abs:g}"))


def render_verify(report: VerifyReport, console: Console) -> None:
    console.print(f"verify {report.path}" + (f" against {report.against}" if report.against else ""),
                  highlight=False, soft_wrap=True)  # whole paths on one line (a table title wraps them)
    table = Table()
    table.add_column("check")
    table.add_column("result", justify="right")
    table.add_row("tensors", str(report.tensors))
    table.add_row("checksums verified", f"{report.checksummed}/{report.tensors}")
    if report.against:
        table.add_row("compared with the source", str(report.compared))
        if report.casts:
            table.add_row("cast on conversion (declared)", str(len(report.casts)))
    table.add_row("bytes read", f"{report.nbytes / 1e6:.1f} MB in {report.seconds:.2f} s")
    colour = {IDENTICAL: "green", IDENTICAL_UP_TO_CAST: "green", IDENTICAL_UP_TO_DECLARED: "green",
              HEADER_ONLY: "yellow", FAILED: "red"}[report.verdict]
    text = report.verdict if report.verdict != FAILED else f"{len(report.problems)} problem(s)"
    table.add_row("verdict", f"[{colour}]{text}[/]")
    if report.tensors or report.nbytes or not report.problems:  # a table of zeros says nothing of an unopened file
        console.print(table)
    if report.casts:
        worst = sorted(report.casts, key=lambda c: -c.max_rel)
        console.print(f"{len(report.casts)} tensors differ from the source only by their declared cast; largest changes:",
                      highlight=False)
        for c in worst[:5]:
            console.print(f"  {c.key}: {c.before} -> {c.after}, max abs {c.max_abs:.3g}, max rel {c.max_rel:.3g}",
                          highlight=False, soft_wrap=True)  # one tensor, one line, piped too
    if report.dropped:
        console.print(Text(f"{len(report.dropped)} values were dropped on conversion, as the file declares"
                           " (on_unsupported=skip; load() returns None there): " + ", ".join(
                               f"{where} ({kind})" for where, kind in report.dropped[:10])), highlight=False,
                          soft_wrap=True)
    if report.apart:
        console.print(Text(f"{len(report.apart)} tensors are stored apart from the storage they share with another in"
                           " the source (none of them covering the others), as the file declares: "
                           + ", ".join(report.apart[:10])),
                      highlight=False, soft_wrap=True)
    if report.verdict == HEADER_ONLY:
        console.print(f"[yellow]only the header was checked[/]: {report.tensors - report.checksummed} tensors carry no"
                      " checksum (a file written by another tool?); pass --against SOURCE.pt to compare every tensor",
                      highlight=False)
    for where, what in report.problems:  # unwrapped (a path cut across lines cannot be copied), no markup read
        console.print(Text.assemble(("FAIL", "red"), f" {where}: {what}"), highlight=False, soft_wrap=True)
    if report.hint:
        console.print(Text.assemble(("hint", "yellow"), f": {report.hint}"), highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# inspect


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-able description: files, totals, and the structure as a tree with sizes per subtree. A ``torch.save``
    file is described as it is (not a converted sibling), its pickle run by torch's weights-only unpickler and
    every global that refuses (a config class, a framework's object) an inert stand-in that nothing imports or
    runs (`inert`), named in the tree where it stands: what to ``--select`` when converting it."""
    from .format import TORCH_LEGACY, TORCH_ZIP, detect

    if detect(path) in (TORCH_ZIP, TORCH_LEGACY):  # the file named, whatever converted sibling it has
        return _inspect_torch_save(Path(path))
    with Checkpoint(path) as ckpt:
        tree = _describe(ckpt.structure["root"], ckpt, "")
        _count_stored_once(tree)
        from .jobs import cast_groups

        casts = {k: (v, torch_dtype_name(ckpt.entries[k].dtype)) for k, v in ckpt.cast.items() if k in ckpt.entries}
        return {"path": str(ckpt.path), "files": [str(Path(p)) for p in ckpt.headers],
                "has_structure": ckpt.has_structure, "tensors": len(ckpt.entries),
                "bytes": sum(e.nbytes for e in ckpt.entries.values()),
                "checksums": len(ckpt.checksums), "cast": ckpt.cast, "cast_groups": cast_groups(casts),
                "source": ckpt.source, "tree": tree}


MAX_INSPECTED_VALUES = 2_000_000  # a pickle's values, each container once: one naming more is not inspected


def _inspect_torch_save(path: Path) -> dict[str, Any]:
    """`inspect_checkpoint` of a ``torch.save`` file: its small records (the pickle) checked against their crc32s
    first, as convert checks them; loaded memory-mapped (nothing of the tensors is read); the globals the
    weights-only unpickler refuses as stand-ins."""
    from .convert import _torch_reason, load_pt, load_pt_with_stand_ins
    from .errors import FormatError, RefusedGlobalsError, UnsafePickleError
    from .inert import made_by
    from .source_crc import Archive, check_small_records

    fd = os.open(path, os.O_RDONLY)
    try:
        archive = Archive.open(fd)
        if archive is not None:
            check_small_records(path, archive)  # a damaged pickle said as such, not read as another one
    finally:
        os.close(fd)

    try:
        try:
            with warnings.catch_warnings():  # (a legacy file's "loaded fully into memory": inspect reads it all)
                warnings.simplefilter("ignore")
                obj, aliases = load_pt(path), []
        except RefusedGlobalsError as e:
            obj, aliases = load_pt_with_stand_ins(path, e.names)
    except UnsafePickleError as e:  # refused even with its classes inert: say why, not what to trust
        reason = _torch_reason(e)
        raise FormatError(path, f"torch's weights-only unpickler refuses it even with the classes it does not allow"
                                f" left unloaded ({reason}); nothing of it was run") from None
    walk = _ObjectTree(made_by(aliases))
    try:
        tree = walk.describe(obj, "", "<root>")
    except RecursionError:
        raise FormatError(path, "nested too deeply to inspect") from None
    except MemoryError:
        raise FormatError(path, "holds too many values to inspect") from None
    _count_stored_once(tree)
    return {"path": str(path), "files": [str(path)], "format": "torch.save", "has_structure": True,
            "tensors": tree["tensors"], "bytes": tree["bytes"], "checksums": 0, "cast": {}, "cast_groups": {},
            "source": None, "tree": tree, "not_loaded": sorted(name for _, name in aliases)}


class _ObjectTree:
    """`_describe`'s tree for a loaded object: containers with their children (a container met again under
    another path: named as the same one, not expanded twice); a tensor (or ndarray) with its dtype, shape and
    bytes, counted once per storage (``key``: its storage, numbered in the order met; a tensor of a storage met
    before is the same tensor or a view of it); a stand-in under its global's name (one filled as a dict or a list:
    with its items); any other value as its text. ``made``: the stand-ins' dicts and lists, by id."""

    def __init__(self, made: dict[int, str]) -> None:
        self.made = made
        self.storages: dict[tuple[int, int], tuple[int, str, tuple]] = {}  # -> (number, first path, geometry)
        self.containers: dict[int, str] = {}  # id -> the path it was described at
        self.values = 0

    def describe(self, obj: Any, name: str, path: str) -> dict[str, Any]:
        from .inert import stand_in_name

        self.values += 1
        if self.values > MAX_INSPECTED_VALUES:
            raise MemoryError
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, name, path)
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            return {"name": name, "kind": "ndarray", "key": f"ndarray:{path}", "dtype": str(obj.dtype),
                    "shape": list(obj.shape), "bytes": obj.nbytes, "tensors": 1}
        leaf = {"name": name, "bytes": 0, "tensors": 0}
        stand_in = stand_in_name(obj, self.made)
        if stand_in is not None and id(obj) not in self.made:  # (a dict or list stand-in is shown with its items)
            return {**leaf, "kind": stand_in, "value": "not loaded"}
        if isinstance(obj, dict):
            children = list(obj.items())
        elif isinstance(obj, (list, tuple)):
            children = list(enumerate(obj))
        elif isinstance(obj, argparse.Namespace):
            children = list(vars(obj).items())
        else:
            value = obj if obj is None or isinstance(obj, (bool, int, float, str)) else str(obj)
            return {**leaf, "kind": type(obj).__name__ if obj is not None else "None",
                    "value": value if not isinstance(value, float) or math.isfinite(value) else str(value)}
        kind = f"{stand_in} (not loaded: its items)" if stand_in else type(obj).__name__
        if id(obj) in self.containers:  # a container held twice (or holding itself): described once
            return {**leaf, "kind": kind, "value": f"(the same as {self.containers[id(obj)]})"}
        self.containers[id(obj)] = path
        return {"name": name, "kind": kind, "children": [
            self.describe(v, key, f"{path}.{key}" if path != "<root>" else key)
            for k, v in children for key in [k if isinstance(k, str) else str(k)]]}

    def _tensor(self, t: torch.Tensor, name: str, path: str) -> dict[str, Any]:
        storage = t.untyped_storage()
        geometry = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        # (an empty storage has no address of its own: each is its own)
        place = (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else (-len(self.storages) - 1, 0)
        node = {"name": name, "kind": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "bytes": t.numel() * t.element_size(), "tensors": 1}
        if place not in self.storages:
            self.storages[place] = (len(self.storages), path, geometry)
        number, first, first_geometry = self.storages[place]
        node["key"] = f"storage {number}" + ("" if geometry == first_geometry else f" as {path}")
        if geometry != first_geometry:  # another view of a storage met before: no bytes of its own
            node["view_of"] = first
            node["bytes"] = 0
        return node


def _describe(node: Any, ckpt: Checkpoint, name: str) -> dict[str, Any]:
    if not isinstance(node, dict):  # a JSON scalar standing for itself: the value as it is (inspect --json)
        return {"name": name, "kind": type(node).__name__ if node is not None else "None", "value": node,
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
        return {"name": name, "kind": kind, "children": children}  # totals: `_count_stored_once`
    value = node.get("value", node.get("items", ""))
    if kind == "float" and math.isfinite(float(value)):  # a JSON number; nan, inf and ints beyond int64 stay text
        value = float(value)
    elif kind == "complex":
        value = f"({node['real']}, {node['imag']})"
    elif kind == "np_scalar":  # its value, as numpy prints it (the node holds its bytes)
        value = f"{np.frombuffer(bytes.fromhex(node['hex']), dtype=np.dtype(node['dtype']))[0]!r}"
    if kind in ("float", "complex") and "hex" in node:  # a NaN of another sign or payload: its bits too
        value = f"{value} (bits {node['hex']})"
    return {"name": name, "kind": kind, "value": value if isinstance(value, float) else str(value), "bytes": 0,
            "tensors": 0}


def _count_stored_once(tree: dict[str, Any]) -> None:
    """Each stored tensor counted (tensors and bytes) once, where it first appears in the tree: a later name for
    the same tensor (tied weights) is marked ``alias_of`` that first path, and a view of a stored tensor counts
    no bytes and no tensor of its own; every subtree's totals are sums of what it holds counted so. The root's
    totals are then the file's own (its stored tensors)."""
    owners: dict[str, str] = {}

    def visit(d: dict[str, Any], path: str) -> None:
        if "children" in d:
            for c in d["children"]:
                visit(c, f"{path}.{c['name']}" if path else c["name"])
            d["bytes"] = sum(c["bytes"] for c in d["children"])
            d["tensors"] = sum(c["tensors"] for c in d["children"])
        elif "key" in d:
            if "view_of" in d:
                d["tensors"] = 0
            elif d["key"] in owners:
                d.update(bytes=0, tensors=0, alias_of=owners[d["key"]])
            else:
                owners[d["key"]] = path or "<root>"

    visit(tree, "")


LISTED_ITEMS = 20  # a list's items shown by inspect; the rest counted


def render_inspect(info: dict[str, Any], console: Console, max_depth: int = 3) -> None:
    def label(d: dict[str, Any]) -> str:
        size = f"{d['bytes'] / 1e6:.2f} MB" if d["bytes"] >= 1e5 else f"{d['bytes']} B"
        if "children" in d:
            return (f"[bold]{escape(d['name']) or '<root>'}[/] {d['kind']} ({len(d['children'])} items, {d['tensors']}"
                    f" tensors, {size})")
        if "dtype" in d:
            extra = (f" view of {d['view_of']}" if "view_of" in d else
                     f" (the same tensor as {d['alias_of']})" if "alias_of" in d else "")
            return f"{escape(d['name'] or '<root>')} [cyan]{d['dtype']}[/] {d['shape']} {size}{escape(extra)}"
        shown = repr(d["value"]) if d["kind"] == "str" else str(d["value"])
        return f"{escape(d['name'] or '<root>')} [dim]{escape(d['kind'])}[/] = {escape(shown[:60])}"

    def add(tree: Tree, d: dict[str, Any], depth: int) -> None:
        children = d.get("children", [])
        hidden = len(children) - LISTED_ITEMS if d["kind"] in ("list", "tuple", "set", "frozenset") else 0
        for c in children[:len(children) - hidden] if hidden > 0 else children:  # (an RNG state's 625 ints)
            branch = tree.add(label(c), highlight=False)
            if depth < max_depth:
                add(branch, c, depth + 1)
            elif c.get("children"):
                branch.add("[dim]...[/]")
        if hidden > 0:
            tree.add(f"[dim]... ({hidden} more items)[/]")

    root = Tree(label(info["tree"]) + f"  [dim]{escape(info['path'])}[/]")
    if max_depth >= 1:
        add(root, info["tree"], 1)
    elif info["tree"].get("children"):  # depth 0: the root's line and the totals only
        root.add("[dim]...[/]")
    console.print(root)
    if info.get("format") == "torch.save":
        parts = "children" in info["tree"]
        console.print(f"{info['tensors']} tensors, {info['bytes'] / 1e6:.2f} MB; a torch.save file, read by torch's"
                      " weights-only unpickler" + (f", without loading {', '.join(info['not_loaded'])}" + (
                          " (--select a part that holds none of them to convert it)" if parts else "")
                          if info["not_loaded"] else ""), highlight=False, soft_wrap=True)
        return
    console.print(f"{info['tensors']} tensors, {info['bytes'] / 1e6:.2f} MB in {len(info['files'])} file(s);"
                  f" {info['checksums']} checksums; structure: {'yes' if info['has_structure'] else 'none (plain file)'}")
    for group, g in info.get("cast_groups", {}).items():
        console.print(f"cast on conversion: {group}: {g['tensors']} tensors ("
                      + ", ".join(f"{n} {label}" for label, n in g["casts"].items()) + ")", highlight=False)
    source = info.get("source")
    if source:
        console.print(f"converted from {source.get('name')} ({source.get('size')} bytes)", highlight=False)
