"""``.pt`` -> safetensors, streaming: never hold the model in memory, no pickle out.

Also home of `load_pt`, the safe way to open a ``torch.save`` file: ``weights_only=True`` plus an
explicit allowlist (numpy arrays and scalars, argparse.Namespace, pathlib paths). Anything else in
the pickle is refused before it is imported or called, unless the caller opts in with ``trust_pickle``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import pathlib
import pickle
import re
import stat
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (ConvertError, FormatError, RefusedGlobalsError, UnsafePickleError, allow_global_hint,
                     allowed_global, first_line, allow_globals_argument, flag_argument, main_hint, not_a_file,
                     on_unsupported_argument, thread_count_argument)
from .flatten import flatten
from .format import META_SOURCE, PT_SUFFIXES, SNIFF_BYTES, StoredDtype, is_legacy_torch_save
from .inert import refused_in
from .jobs import (ConvertReport, SourceFiles, SourceRecords, cast_groups, cast_target, plan_jobs, shard_size_argument,
                   write_converted)
from .measure import PeakAnonMemory, Stopwatch
from .provenance import source_identity
from .share import Share
from .plain_pt import NotPlain, StoredTensor
from .source_crc import Archive, DamagedRecords, SourceCrcs, check_files, check_small_records
from .write import ProgressFn, check_destination, default_io_threads, through_link, write_safetensors
from .zero_files import is_zero_checkpoint, resolve_tag

if TYPE_CHECKING:  # imported where used: a plain checkpoint converts without torch (plain_pt)
    import torch
    import torch.distributed as dist


def _allowlist() -> list[Any]:
    """Globals a weights_only unpickler may resolve in a checkpoint: data types, never callables
    with side effects."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allowed: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype,
                          argparse.Namespace, pathlib.PosixPath, pathlib.WindowsPath,
                          pathlib.PurePosixPath, pathlib.PureWindowsPath]
    dtypes_mod = getattr(np, "dtypes", None)
    if dtypes_mod is not None:
        allowed += [getattr(dtypes_mod, n) for n in dir(dtypes_mod) if n.endswith("DType")]
    return allowed


def _global_name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _import_global(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        main = f" ({main_hint(name)})" if module == "__main__" else ""
        raise ValueError(f"cannot import allowed global '{name}': {e}{main}") from None
    return allowed_global(name, found)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (back on after, if it was on). Loading, flattening
    and laying out a checkpoint allocate a few objects per tensor while the whole loaded object is alive, and
    every full collection walks all of it again: for a checkpoint of many small tensors that was much of the time
    of those steps (BENCHMARKS.md). They make no garbage cycles worth collecting meanwhile."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _pickle_protocol(path: Path) -> int | None:
    """The pickle protocol a ``torch.save`` file was written with (its pickle's PROTO opcode), or None."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
                head = z.open(name).read(2) if name else b""
        else:  # legacy format: the file opens with a pickled magic number, in the same protocol
            with open(path, "rb") as f:
                head = f.read(2)
    except Exception:  # noqa: BLE001 - only for a hint (a name that is not UTF-8, a bad member): the load says why
        return None
    return head[1] if len(head) == 2 and head[0] == 0x80 else None


def weights_only_refusal_hint(path: str | os.PathLike[str]) -> str:
    """Why torch's weights-only unpickler refuses a file that is not corrupt, when it is its pickle protocol."""
    protocol = _pickle_protocol(Path(path))
    if protocol is None or protocol <= 3:
        return ""
    return (f"; it was written with pickle protocol {protocol} (torch.save(..., pickle_protocol={protocol})), and"
            " torch's weights-only unpickler reads protocols 2 and 3 only")


def _check_zip_members(path: Path) -> bool:
    """Whether every member is stored uncompressed (what torch.save writes, and all torch can memory-map).
    DEFLATE members are read by torch's plain (non-mmap) loader; any other method is refused here."""
    try:
        with zipfile.ZipFile(path) as z:
            methods = {info.filename: info.compress_type for info in z.infolist()}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise FormatError(path, f"zip archive is corrupt ({e}); re-copy the file") from None
    for name, method in methods.items():
        if method not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise FormatError(path, f"zip member '{name}' is compressed with zip method {method}, which torch.load"
                              " cannot read; re-create the archive with members stored (zip -0) or DEFLATE-compressed")
    return all(m == zipfile.ZIP_STORED for m in methods.values())


def _listed(names: Any) -> Any:
    """Names given as any iterable (an omegaconf ListConfig, a generator) as a list, read once; a string or anything
    else as it is, for `allow_globals_argument` to refuse."""
    return list(names) if isinstance(names, Iterable) and not isinstance(names, (str, bytes, list, tuple)) else names


def load_pt(path: str | os.PathLike[str], *, trust_pickle: bool = False, allow_globals: Sequence[str] = (),
            mmap: bool = True) -> Any:
    """Load a ``torch.save`` file without executing untrusted code.

    Zip-format files are memory-mapped (tensor bytes are read lazily); one whose records are stored, as
    torch.save writes them, is read by `torch_zip.load` (torch's unpickler, without torch.load's cost per
    tensor), anything else by torch.load. Globals outside the allowlist (plus ``allow_globals``, given as
    ``"module.Name"``) raise `UnsafePickleError`, naming them all, before any of them is imported or called.
    ``trust_pickle=True`` runs the pickle as plain ``torch.load`` would: only for files you trust. Legacy
    (non-zip) files cannot be memory-mapped and load fully, with a warning.
    """
    flag_argument("trust_pickle", trust_pickle)
    flag_argument("mmap", mmap)
    allow_globals = _listed(allow_globals)
    allow_globals_argument(allow_globals)
    return _load_pt(Path(path), trust_pickle=trust_pickle, extra=[_import_global(n) for n in allow_globals], mmap=mmap)


def load_selected(path: str | os.PathLike[str], select: str | None, *, trust_pickle: bool = False,
                  allow_globals: Sequence[str] = ()) -> Any:
    """The part ``select`` of a ``torch.save`` file (`load_pt`, then `select_subtree`; all of it where ``select``
    is None). Where the pickle names globals outside the allowlist, a part that holds none of them is still
    loaded, without trusting the file: the file is built again by torch's weights-only unpickler with each of those
    globals an inert stand-in (`inert`), and the part is returned if no stand-in is inside it. Else (or without
    ``select``) `UnsafePickleError` names the globals, and, where some top-level parts of the file hold tensors and
    none of them, says that ``select`` of one of those would load."""
    flag_argument("trust_pickle", trust_pickle)
    allow_globals = _listed(allow_globals)
    allow_globals_argument(allow_globals)
    path = Path(path)
    extra = [_import_global(n) for n in allow_globals]
    try:
        return select_subtree(_load_pt(path, trust_pickle=trust_pickle, extra=extra), select, source=path)
    except RefusedGlobalsError as e:
        if trust_pickle:
            raise
        refused, refusal = e.names, e
    from .inert import holds_tensor, inert_within

    try:
        root, aliases = load_pt_with_stand_ins(path, refused, extra)
    except Exception as e:  # noqa: BLE001 - torch refuses the file even so: the refusal, and why --select cannot help
        if select is None:
            raise refusal from None
        raise RefusedGlobalsError(f"{refusal} (--select cannot leave them unloaded in this file: torch's weights-only"
                                  f" unpickler refuses it even with them inert: {_torch_reason(e)})", refused) from None
    if select is None:  # which parts would load: a hint
        clean = [k for k, v in root.items() if isinstance(k, str) and holds_tensor(v)
                 and not inert_within(v, aliases)] if isinstance(root, dict) else []
        if not clean:
            raise refusal from None
        refused = sorted(name for _, name in aliases)  # (a legacy file's: every one, not the first alone)
        raise RefusedGlobalsError(_refused_message(path, refused, clean), refused) from None
    part = select_subtree(root, select, source=path)
    inside = inert_within(part, aliases)
    if inside:
        raise RefusedGlobalsError(
            f"{path}: the part '{select}' holds objects of {', '.join(inside)}, which loading would import and may"
            f" call (arbitrary code execution). {allow_global_hint(inside)}", inside)
    return part


def load_pt_with_stand_ins(path: Path, refused: Sequence[str], extra: Sequence[Any] = ()
                           ) -> tuple[Any, list[tuple[type, str]]]:
    """`_load_pt` (untrusted, ``extra`` allowed) with an inert stand-in for each of the ``refused`` globals and any
    more the load finds (`inert.load_with_stand_ins`), and the stand-ins' aliases; the warnings the first load
    said already (a legacy or compressed file) are not said again."""
    from .inert import load_with_stand_ins

    def built(aliases: list[tuple[type, str]]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _load_pt(path, trust_pickle=False, extra=[*extra, *aliases])

    return load_with_stand_ins(built, refused)


def _torch_reason(e: BaseException) -> str:
    """What torch's weights-only unpickler said, without its advice or terminal colours: the line after
    "WeightsUnpickler error:" where there is one, else the first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    found = (re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
             or re.search(r"refused by the safe unpickler \((.+)\); pass --trust-pickle", text))
    return (found.group(1) if found else first_line(Exception(text))).strip().rstrip(".")


def _load_pt(path: Path, *, trust_pickle: bool, extra: list[Any], mmap: bool = True) -> Any:
    """`load_pt` of arguments already checked (``extra``: the allowed globals beyond `_allowlist`, objects or
    ``(object, "module.Name")`` aliases)."""
    from . import torch_zip
    import torch

    if not path.is_file():
        raise not_a_file(path)
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    magic = head[:4]
    try:
        is_zip = zipfile.is_zipfile(path)
    except zipfile.BadZipFile:  # an end record it cannot take (e.g. "spans several disks"): not one torch wrote
        is_zip = False
    if magic == b"PK\x03\x04" and not is_zip:
        raise FormatError(path, "zip archive is truncated or corrupt (no central directory); re-copy the file")
    if not is_zip and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size:
        raise FormatError(path, "is a safetensors file already (a JSON header after its 8-byte length): no conversion"
                                " is needed; restore it as it is (a safetensors file of another writer's too)")
    if not is_zip and head.lstrip()[:1] == b"{" and path.name.endswith(".json"):  # an index of shards (HF)
        raise FormatError(path, "is a JSON index of a sharded checkpoint, not a torch.save file: the index of"
                                " .safetensors shards needs no conversion (restore its directory); an index of .bin"
                                " shards (pytorch_model-00001-of-0000N.bin ...): convert each shard (fsdp-restore"
                                " convert SHARD.bin SHARD.safetensors), then restore this index or its directory")
    if not is_zip and not is_legacy_torch_save(head) and not trust_pickle:
        # neither torch.save's zip nor its legacy pickle (torch's magic number first): not a "legacy file"
        raise FormatError(path, f"not a torch.save file (it starts with {magic!r}: neither a zip archive nor a"
                                " legacy torch.save pickle); is it the file you meant?")
    if is_zip and mmap and not trust_pickle:
        try:  # the common case, without torch.load's cost per tensor; the same result and the same refusals
            with _gc_paused():
                return _load_stored_zip(path, extra)
        except torch_zip.NotHandled:
            pass  # a file only torch.load reads exactly (compressed, big-endian, ...): below, as before
    stored = is_zip and _check_zip_members(path)
    if is_zip and not stored:
        # torch's mmap path would take the compressed bytes as tensor data: read (and inflate) it whole instead
        warnings.warn(f"{path}: its zip members are DEFLATE-compressed, which cannot be memory-mapped; loading it"
                      " fully into memory (torch.save writes them uncompressed: re-save it to stream)", stacklevel=3)
    if not trust_pickle:
        hint = weights_only_refusal_hint(path)
        if hint:
            raise UnsafePickleError(f"{path}: refused by torch's weights-only unpickler{hint}. If you trust this file,"
                                    " pass --trust-pickle (trust_pickle=True) to convert it, or re-save it with"
                                    " torch.save's default protocol")
        if is_zip:
            _refuse_unsafe_globals(path, extra)
    else:
        warnings.warn(f"{path}: trust_pickle=True executes the file's pickle; only do this for files you trust",
                      stacklevel=3)
    if not is_zip:
        warnings.warn(f"{path} is a legacy (non-zip) torch.save file: it cannot be memory-mapped and is loaded"
                      " fully into memory; re-save it with a current torch for streaming", stacklevel=3)
    kwargs: dict[str, Any] = {"map_location": "cpu", "mmap": mmap and stored}
    try:
        if trust_pickle:
            return torch.load(path, weights_only=False, **kwargs)
        with torch.serialization.safe_globals(_allowlist() + extra):
            return torch.load(path, weights_only=True, **kwargs)
    except (UnsafePickleError, FormatError):
        raise
    except Exception as e:
        raise _load_error(path, e) from None


def _load_stored_zip(path: Path, extra: list[Any]) -> Any:
    """`torch_zip.load` with this module's allowlist; its failures reported as torch.load's below are.

    Globals are checked by torch's unpickler as it meets them (an allowed one is called, a refused one stops it
    before it is imported); only when it stops is the pickle scanned for every global it names, so that the
    error lists them all, and is the one the scan-first order gave: unreadable pickle, then refused globals,
    then what stopped the load."""
    from . import torch_zip

    try:
        return torch_zip.load(path, _allowlist() + extra)
    except torch_zip.NotHandled:
        raise
    except Exception as e:
        _refuse_unsafe_globals(path, extra)
        if isinstance(e, (UnsafePickleError, FormatError)):
            raise
        if isinstance(e, pickle.UnpicklingError):  # torch's weights-only unpickler refused an opcode or a call
            raise UnsafePickleError(f"{path}: refused by the safe unpickler ({first_line(e)}); pass --trust-pickle"
                                    " if you trust this file") from None
        raise _load_error(path, e) from None


def refused_globals(path: str | os.PathLike[str], extra: Sequence[Any] = ()) -> list[str]:
    """The globals the pickle of zip-format ``path`` names outside torch's and our allowlists and ``extra``
    (objects, or ``(object, "module.Name")`` aliases), sorted, found by torch's own scan of the pickle (nothing is
    unpickled); `FormatError` if the archive or its pickle cannot be read."""
    import torch

    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # a corrupt zip or pickle stream
        raise FormatError(path, f"cannot read the torch.save archive ({type(e).__name__}: {e})") from None
    allowed = {o[1] if isinstance(o, tuple) else _global_name(o) for o in [*_allowlist(), *extra]}
    # numpy moved numpy.core to numpy._core; pickles name either.
    return sorted(g for g in needed if g not in allowed and g.replace("numpy.core.", "numpy._core.") not in allowed)


def _refuse_unsafe_globals(path: Path, extra: list[Any]) -> None:
    """`RefusedGlobalsError` listing the globals the pickle names outside torch's and our allowlists
    (`refused_globals`); `FormatError` if the archive or its pickle cannot be read."""
    refused = refused_globals(path, extra)
    if refused:
        raise RefusedGlobalsError(_refused_message(path, refused), refused)


def _refused_message(path: Path, refused: list[str], clean: Sequence[str] = ()) -> str:
    """The refusal of ``refused`` globals; ``clean``: the top-level parts of the file that hold tensors and none of
    them (`load_selected`), offered first."""
    parts = ""
    if clean:
        listed = ", ".join(f"'{k}'" for k in clean[:6]) + (f" and {len(clean) - 6} more" if len(clean) > 6 else "")
        one = len(clean) == 1
        parts = (f" The file's {listed} hold{'s' if one else ''} tensors and none of them:"
                 f" select {'it' if one else 'one'}"
                 f" (--select {clean[0]}, select='{clean[0]}') and the rest is left unloaded, nothing of it imported"
                 " or run. Or:")
    return (f"{path}: the pickle references {', '.join(refused)}, which loading would import and may call (arbitrary"
            f" code execution).{parts} {allow_global_hint(refused)}")


def _load_error(path: Path, e: Exception) -> Exception:
    """What a failed torch.load (or `torch_zip.load`) is reported as: a refusal of the safe unpickler, or a
    file that cannot be read."""
    text = first_line(e)
    refused = refused_in(str(e))
    if refused:  # (a legacy file: torch.load names the first global it refuses, as nothing scanned the pickle before)
        return RefusedGlobalsError(_refused_message(path, refused), refused)
    if isinstance(e, TypeError) and "Tensor subclass" in text:  # (torch's rebuild of one, as a class not allowed)
        return UnsafePickleError(f"{path}: refused by the safe unpickler (a tensor subclass whose class is not"
                                 f" allowed: {text}); pass --trust-pickle if you trust this file")
    if "Unsupported global" in str(e) or "weights_only" in str(e) or "Weights only" in str(e):
        return UnsafePickleError(f"{path}: refused by the safe unpickler ({_torch_reason(e)}); pass --trust-pickle if"
                                 " you trust this file")
    if isinstance(e, ModuleNotFoundError) or (isinstance(e, AttributeError) and "Can't get attribute" in text):
        # (trust_pickle: the unpickler looked a class up and this process has none of that name)
        found = re.search(r"Can't get attribute '([\w.]+)' on <module '[\w.]*__main__'", text)
        main = f" {main_hint('__main__.' + found.group(1))}" if found else ""
        return FormatError(path, f"the pickle names a class or module this process cannot find ({text}): load it"
                                 f" where the code that saved it is importable.{main}")
    return FormatError(path, f"cannot load ({type(e).__name__}: {text}); truncated or corrupt?")


def select_subtree(obj: Any, select: str | None, *, source: object = None) -> Any:
    """The value at dotted path ``select`` inside ``obj`` (dict keys, list indices, attributes); a `KeyError`
    naming ``source`` (the file ``obj`` was loaded from) where there is no such path."""
    if not select:
        return obj
    try:
        return _descend(obj, select)
    except KeyError as e:
        if source is None:
            raise
        raise KeyError(f"{source}: {e.args[0]}") from None


def _descend(obj: Any, select: str) -> Any:
    """The subtree at ``select``: a dict's key by its text (a str key before an int of the same text; a key that
    holds dots, such as a flat state dict's ``model.embed.weight``: the shortest key with which the rest of the
    path is found), a list's index, a Namespace's attribute."""
    parts = select.split(".")
    failures: list[tuple[int, str]] = []  # (how far the path got, why it stopped there): the farthest is said

    def walk(node: Any, i: int) -> tuple[bool, Any]:
        if i == len(parts):
            return True, node
        part = parts[i]
        if isinstance(node, dict):
            matched = False
            for taken in range(1, len(parts) - i + 1):  # the shortest key first, dots and all
                text = ".".join(parts[i:i + taken])
                number = int(text) if text.lstrip("-").isdigit() and str(int(text)) == text else None
                for key in (text, number):  # a str key, then an int one written the same way (never a bool: 1 == True)
                    if key is None or key not in node or not any(type(k) is type(key) and k == key for k in node):
                        continue
                    matched = True
                    found, value = walk(node[key], i + taken)
                    if found:
                        return True, value
            if not matched:
                failures.append((i, f"no key '{part}' at '{'.'.join(parts[:i]) or '<root>'}' (keys there:"
                                    f" {', '.join(map(str, list(node)[:10]))})"))
            return False, None
        if isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            return walk(node[int(part)], i + 1)
        if isinstance(node, argparse.Namespace) and hasattr(node, part):
            return walk(getattr(node, part), i + 1)
        failures.append((i, f"cannot descend into {type(node).__name__} with '{part}'"))
        return False, None

    found, value = walk(obj, 0)
    if not found:
        raise KeyError(f"select='{select}': {max(failures, key=lambda f: f[0])[1]}")
    return value


def _directory_identity(path: Path) -> list[tuple[str, int, int]]:
    """Every file under ``path`` as ``(relative name, size, modification time in ns)``, sorted."""
    found = []
    for root, _, names in os.walk(path):
        for name in names:
            st = os.stat(os.path.join(root, name))
            found.append((os.path.relpath(os.path.join(root, name), path), st.st_size, st.st_mtime_ns))
    return sorted(found)


def _same_source(share: Share, identity: Any) -> None:
    """Every rank of a conversion on several ranks read the same source, as it is now, or `ConvertError` on
    every rank: ranks reading different checkpoints would each write their own blocks into the one file."""
    if share.world > 1 and any(other != identity for other in share.gather(identity, "compare the sources")):
        raise ConvertError("the ranks read different sources (another path, or the checkpoint changed while they"
                           " read it): every rank must convert the same source")


def _convert_directory(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, dtype: StoredDtype | None,
                       cast_include: Sequence[str] | None, cast_exclude: Sequence[str], max_shard_size: int | str | None,
                       select: str | None, threads: int | None, force: bool, on_unsupported: str,
                       progress: Callable[[int, int], None] | None, tag: str | None, share: Share,
                       trust_pickle: bool = False, allow_globals: Sequence[str] = (),
                       verify_checksums: bool = False) -> ConvertReport:
    """A sharded checkpoint directory in (DeepSpeed ZeRO: `zero.read_zero`; DCP: `dcp_in.read_dcp`), streamed
    out: each tensor held in pieces is assembled range by range as it is written."""
    from .dcp_in import is_dcp_checkpoint, read_dcp
    from .zero import read_zero

    threads = threads or default_io_threads()

    def read_source() -> tuple[str, Any, dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        if not (is_zero_checkpoint(src) or is_dcp_checkpoint(src)):
            files = sorted(p.name for p in Path(src).iterdir() if p.suffix in PT_SUFFIXES and p.is_file())
            # (the safetensors files named only where there are some: a directory of pytorch_model-*.bin has none)
            ready = sorted(p.name for p in Path(src).glob("*.safetensors") if p.is_file())
            kept = f"; {', '.join(ready[:3])}{' ...' if len(ready) > 3 else ''} need(s) no conversion" if ready else ""
            each = (f"; convert its files one by one instead (fsdp-restore convert {Path(src) / files[0]} ..."
                    f"{kept})" if files else "")
            raise FormatError(src, "a directory, but neither a DeepSpeed ZeRO checkpoint ('latest', or tag"
                              " directories with *_optim_states.pt files) nor a DCP checkpoint (.metadata +"
                              f" *.distcp){each}")
        check_destination(dst, force=force, sources=[src], one_file=max_shard_size is None)
        # the classes a .pt's pickle may build may be built from the directory's pickles too
        safe = {"safe_globals": _allowlist() + [_import_global(n) for n in allow_globals], "trust_pickle": trust_pickle}
        if is_dcp_checkpoint(src):
            obj, pieces = read_dcp(src, **safe)
            label = str(src)
            crcs[0] = SourceCrcs(0, 0, note="a DCP checkpoint's files record no crc32s")
        else:
            # its rank files' recorded crc32s first, as the torch-free read checks them (torch.load checks none):
            # damage said as damage, not as what torch's unpickler makes of it
            tag_dir = resolve_tag(src, tag)
            crcs[0] = check_files(str(tag_dir), sorted(str(p) for p in tag_dir.glob("*.pt")), threads=threads,
                                  full=verify_checksums)
            obj, pieces, layout = read_zero(src, tag=tag, **safe)
            label = str(layout.tag_dir)
        tensors, structure = flatten(select_subtree(obj, select, source=label),
                                     on_unsupported=on_unsupported)  # type: ignore[arg-type]
        return label, obj, tensors, structure, pieces

    crcs: list[SourceCrcs | None] = [None]
    with PeakAnonMemory() as mem, Stopwatch() as clock:
        label, obj, tensors, structure, pieces = share.step("read the source", read_source)  # type: ignore[misc]
        if share.world > 1:  # the files each rank read: the same directory as it is, on every rank
            _same_source(share, share.step("list the source", lambda: (label, _directory_identity(Path(label)))))
        readers = {}
        for key, t in tensors.items():
            held = pieces.get(t.data_ptr())
            if held is not None:  # a tensor held in pieces: its real shape and dtype, and how to read it
                tensors[key], readers[key] = held
        result, casts, _ = write_converted(tensors, structure, dst, readers=readers, dtype=dtype,
                                        cast_include=cast_include, cast_exclude=cast_exclude,
                                        max_shard_size=max_shard_size, threads=threads, force=force, progress=progress,
                                        share=share)
        del obj, tensors, readers, pieces
    return ConvertReport(src=label, dst=str(dst), files=[str(p) for p in result.paths],
                         tensors=len(result.checksums), nbytes=result.nbytes, cast_tensors=len(casts),
                         cast=cast_groups(casts), seconds=clock.seconds, peak_anon_bytes=mem.peak, threads=threads,
                         checksums=result.checksums, source_crcs=crcs[0])


def _truncated(src: str | os.PathLike[str], e: EOFError) -> FormatError:
    """A tensor's bytes read at their offset ran past the end: the file is shorter than its pickle says."""
    return FormatError(src, f"{str(e).removeprefix('the file ')}; was it truncated or rewritten while it was being"
                       " converted? Convert it again from a complete copy")


def _report(src: str | os.PathLike[str], dst: str | os.PathLike[str], result: Any, casts: dict[str, tuple[str, str]],
            *, seconds: float, peak: int, threads: int, source_crcs: SourceCrcs | None = None) -> ConvertReport:
    """The `ConvertReport` of a conversion of one file written as ``result`` (write_converted's)."""
    return ConvertReport(src=str(src), dst=str(dst), files=[str(p) for p in result.paths],
                         tensors=len(result.checksums), nbytes=result.nbytes, cast_tensors=len(casts),
                         cast=cast_groups(casts), seconds=seconds, peak_anon_bytes=peak, threads=threads,
                         checksums=result.checksums, source_crcs=source_crcs)


def _convert_plain(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, select: str | None,
                   on_unsupported: str, threads: int, max_shard_size: int | str | None, force: bool,
                   progress: Callable[[int, int], None] | None, dtype: StoredDtype | None = None,
                   cast_include: Sequence[str] | None = None,
                   cast_exclude: Sequence[str] = (), verify_checksums: bool = False) -> ConvertReport | None:
    """`convert` of a plain checkpoint without torch (`plain_pt`): the same file, byte for byte, as the conversion
    through torch.load writes (the tests compare them). None, with nothing written, where `plain_pt` does not read
    the file exactly as torch would, or anything before the write fails: the caller then converts through torch,
    which reports what is wrong as it always did."""
    from .plain_pt import load_plain_archive

    with PeakAnonMemory() as mem, Stopwatch() as clock, _gc_paused():
        if not Path(src).is_file():
            return None
        # first, as the torch path checks it
        check_destination(dst, force=force, sources=[src], one_file=max_shard_size is None)
        # one descriptor for the archive, the identity and the tensors' bytes: a source replaced (renamed over)
        # meanwhile is not read half from each file
        fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put in its place meanwhile opens at once
        try:
            try:
                before = os.fstat(fd)
                if not stat.S_ISREG(before.st_mode):
                    return None
                os.set_blocking(fd, True)  # (Lustre reads O_NONBLOCK on each read as "do not wait for a lock")
                archive = Archive.open(fd)
            except Exception:  # noqa: BLE001 - as below
                return None
            if archive is None:
                return None  # not laid out as torch.save lays it out: the torch path decides
            small_checked = check_small_records(src, archive)  # damage said as such, before the pickle is read
            try:
                # where each storage's data starts taken from the central directory alone, so that the Python
                # below runs while the disk still reads the source, not after it; proven before the first block
                # is written (``before_write``), else the torch path converts
                loaded, members = load_plain_archive(fd, archive=archive.parsed, assume_layout=True)
                st = os.fstat(fd)
                if (st.st_size, st.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                    return None  # rewritten while it was read: the torch path reads it again
                identity = source_identity(src, members=members, stat=st, select=select)
                obj = select_subtree(loaded, select, source=src)
                if not _lane_values(obj):
                    return None
                # its warnings (skipped values) said as the torch path says them; said again if it raises, or
                # where a storage is not where torch's writer puts it (`prove_assumed`: a file another writer made)
                tensors, structure = flatten(obj, on_unsupported=on_unsupported)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - the torch path reads the file again and says what is wrong with it
                return None
            locations = {key: (fd, t.file_offset) for key, t in tensors.items()}
            source = SourceRecords(src, archive, storage_at={key: t.storage.data_at for key, t in tensors.items()
                                                             if isinstance(t, StoredTensor)},
                                   small_checked=small_checked)
            result, casts, crcs = write_converted(
                tensors, structure, dst, dtype=dtype, cast_include=cast_include, cast_exclude=cast_exclude,
                max_shard_size=max_shard_size, threads=threads, force=force, progress=progress,
                metadata={META_SOURCE: json.dumps(identity)}, locations=locations, share=Share(0, 1), source=source,
                verify_checksums=verify_checksums, before_write=archive.parsed.prove_assumed)
        except EOFError as e:  # as the torch path says it
            raise _truncated(src, e) from None
        except NotPlain:  # a storage's data not where torch's writer puts it (`prove_assumed`): nothing was written
            return None
        finally:
            os.close(fd)
        del obj, tensors
    return _report(src, dst, result, casts, seconds=clock.seconds, peak=mem.peak, threads=threads,
                   source_crcs=crcs)


def _why_unchecked(src: str | os.PathLike[str]) -> SourceCrcs:
    """What the report says of a source whose records are not checked: a legacy file records no crc32s; any other
    is not a zip archive laid out as torch.save lays it out (compressed records, another writer)."""
    with open(src, "rb") as f:
        legacy = is_legacy_torch_save(f.read(SNIFF_BYTES))
    return SourceCrcs(0, 0, note="a legacy torch.save file: it records no crc32s" if legacy else
                      "not a zip archive laid out as torch.save writes one")


def _same_file(src: str | os.PathLike[str], before: os.stat_result, now: os.stat_result) -> None:
    """The file whose bytes are about to be copied (``now``, its descriptor's) is the one whose pickle was read
    (``before``): not another renamed over it meanwhile, nor rewritten."""
    if (before.st_ino, before.st_dev, before.st_size, before.st_mtime_ns) != (
            now.st_ino, now.st_dev, now.st_size, now.st_mtime_ns):
        raise FormatError(src, "was replaced or rewritten while it was being read; convert it again once it is"
                               " complete")


def _convert_zero_plain(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, select: str | None,
                        tag: str | None, on_unsupported: str, threads: int, max_shard_size: int | str | None,
                        force: bool, progress: Callable[[int, int], None] | None, dtype: StoredDtype | None = None,
                        cast_include: Sequence[str] | None = None, cast_exclude: Sequence[str] = (),
                        verify_checksums: bool = False) -> ConvertReport | None:
    """`convert` of a ZeRO checkpoint (the weights alone where ``select`` is ``model`` or within it) without torch
    (`zero_plain`): the same file, byte for byte, as the conversion through torch writes (the tests compare them).
    None, with nothing written, where `zero_plain` does not read the checkpoint exactly as that path would, or
    anything before the write fails: the caller then converts through torch, which reports what is wrong."""
    from .zero_plain import read_model

    with PeakAnonMemory() as mem, Stopwatch() as clock, _gc_paused():
        if not is_zero_checkpoint(src):
            return None
        # first, as the torch path checks it
        check_destination(dst, force=force, sources=[src], one_file=max_shard_size is None)
        weights = select is not None and (select == "model" or select.startswith("model."))  # no optimizer state
        try:
            read = read_model(src, tag, optimizer=not weights)
        except DamagedRecords:
            raise  # (the torch path would load the damaged values without a word)
        except Exception:  # noqa: BLE001 - the torch path reads the checkpoint again and says what is wrong with it
            return None
        label = str(read.tag_dir)
        try:
            try:
                obj = select_subtree({"model": read.model} if weights else read.obj, select, source=label)
                if not _lane_values(obj):
                    return None
                tensors, structure = flatten(obj, on_unsupported=on_unsupported)  # type: ignore[arg-type]
                locations: dict[str, Any] = {key: t.storage.extents if t.storage.extents is not None
                                             else (t.storage.fd, t.file_offset) for key, t in tensors.items()}
            except Exception:  # noqa: BLE001 - as above
                return None
            result, casts, crcs = write_converted(tensors, structure, dst, dtype=dtype, cast_include=cast_include,
                                                  cast_exclude=cast_exclude, max_shard_size=max_shard_size,
                                                  threads=threads, force=force, progress=progress,
                                                  locations=locations, share=Share(0, 1),
                                                  source=SourceFiles(label, read.files),
                                                  verify_checksums=verify_checksums)
        except EOFError as e:  # as the torch path says it
            raise _truncated(label, e) from None
        finally:
            read.close()
        del obj, tensors
    return _report(label, dst, result, casts, seconds=clock.seconds, peak=mem.peak, threads=threads,
                   source_crcs=crcs)


def _torch_loads_as_plain_pt_reads() -> bool:
    """Whether torch.load in this process reads a plain checkpoint as `plain_pt` does: its storages built from the
    records' bytes as they lie, a file that does not say its byte order read as little-endian (`plain_pt` reads
    those too)."""
    from .plain_pt import builds_storages_from_records, default_byte_order_little

    return builds_storages_from_records() and default_byte_order_little()


# Whether `convert` reads a plain checkpoint or a ZeRO checkpoint without torch's unpickler where it can
# (`plain_pt`, `zero_plain`: the same file as through torch, faster): the tests turn it off to compare the two paths
_TORCH_FREE_READS = True


def _lane_values(obj: Any) -> bool:
    """Whether ``obj`` holds nothing but what a plain checkpoint's pickle builds: dicts, lists, tuples, Python
    scalars and strings, and `plain_pt.StoredTensor`s (not a global the pickle named as a value, which torch
    would give as the object itself), each tensor's elements one run of its storage or a storage held in runs
    (`zero_plain`): any other tensor goes to the torch path, which copies it (even one that another tensor of its
    storage covers, which flatten then stores as a view of that one: rare, and only slower so). Decided before
    anything is flattened, so that what flatten says is not said again by the torch path."""
    from .plain_pt import StoredTensor

    scalars = (type(None), bool, int, float, str, StoredTensor)
    stack, seen = [obj], set()
    while stack:
        node = stack.pop()
        t = type(node)
        if t is dict or t is OrderedDict or t is list or t is tuple:
            if id(node) in seen:  # each container once: a pickle may make one hold itself (flatten then refuses)
                continue
            seen.add(id(node))
            if t is dict or t is OrderedDict:
                stack.extend(node.keys())
                stack.extend(node.values())
            else:
                stack.extend(node)
        elif t not in scalars or (t is StoredTensor and node.storage.extents is None and not node.is_contiguous()):
            return False
    return True


def save(obj: Any, path: str | os.PathLike[str], *, max_shard_size: int | str | None = None,
         dtype: torch.dtype | None = None, thread_count: int | None = None, force: bool = True,
         on_unsupported: str = "error", progress: ProgressFn | None = None, threads: int | None = None) -> list[Path]:
    """Write any supported nested object (see `flatten`) to ``path``; returns the files written.
    ``thread_count``: write threads (default: every core, at least 4 and at most 16); ``threads=``, its old
    name, still works with a `DeprecationWarning`; not an int >= 1: `ValueError`. ``force``: replace what is at
    ``path`` (default True, as ``torch.save`` and safetensors' ``save_file`` do); False refuses an existing file."""
    thread_count = thread_count_argument(thread_count, threads)
    flag_argument("force", force)
    tensors, structure = flatten(obj, on_unsupported=on_unsupported)  # type: ignore[arg-type]
    size = shard_size_argument(max_shard_size)
    jobs = plan_jobs(tensors, structure, dtype)
    return write_safetensors(through_link(path), jobs, structure_json=json.dumps(structure, separators=(",", ":")),
                             max_shard_size=size, threads=thread_count, force=force, progress=progress).paths


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
            cast_include: Sequence[str] | None = None, cast_exclude: Sequence[str] = (),
            max_shard_size: int | str | None = None, select: str | None = None, thread_count: int | None = None,
            force: bool = False, trust_pickle: bool = False, allow_globals: Sequence[str] = (),
            on_unsupported: str = "error", progress: Callable[[int, int], None] | None = None,
            tag: str | None = None, threads: int | None = None,
            process_group: dist.ProcessGroup | None = None, verify_checksums: bool = False) -> ConvertReport:
    """Stream a ``torch.save`` file into our safetensors format and report what it cost.

    A plain checkpoint of dicts, lists, tuples, Python scalars and tensors (one process, no ``trust_pickle`` or
    ``allow_globals``) is read without torch's unpickler (`plain_pt`: a subset of what torch's weights-only
    unpickler takes, built as it builds it; torch is imported only to cast, and not for a cast `plain_cast` makes
    (between fp32, fp16 and bf16, and from them to fp64; fp64 -> fp32) unless a value is NaN or inf before or after
    it, or a cast that rounds reaches the magnitude where whole numbers round (256 in bf16) or casts a 0-dim value:
    a same-dtype conversion, or such a cast, in a process that has not imported torch never does); anything else
    is memory-mapped
    (``torch.load(mmap=True, weights_only=True)``) to read its structure. Either way the result is the same file,
    byte for byte. The tensors' bytes are read with ``pread`` at their offsets into 32 MB blocks of the output, one
    per thread at a time (``thread_count``, default: every core, at least 4 and at most 16), cast if asked and
    written with ``O_DIRECT`` where the file system allows it, so anonymous memory stays near
    ``thread_count x 32 MB``. ``select`` keeps one subtree (``"model"`` writes the weights with plain keys a
    ``load_state_dict`` accepts); of a ``.pt``, it loads even where the rest of the file holds objects the safe
    unpickler refuses, as inert stand-ins that run nothing (`load_selected`). ``progress(done_bytes, total_bytes)``
    is called as data is written.

    ``src`` may also be a DeepSpeed ZeRO checkpoint directory (stages 1-3; ``tag`` picks a tag, default:
    ``latest``), consolidated into the same format: the fp32 master weights, frozen parameters and buffers
    under ``model``, per-parameter optimizer state under ``optim``, the rest of the run's state as it was;
    or a DCP directory (``dcp.save``), rebuilt as the object that was saved.

    ``dtype`` (bf16, fp16, fp32, fp64) casts the model's floating weights (`default_cast_scope`); optimizer
    state and 0-dim values keep their dtype unless ``cast_include`` patterns name them (a 0-dim tensor
    only by its exact key). ``report.cast`` lists what was cast, by group. A cast that would make a finite value
    infinite or NaN, or change a tensor of whole numbers (a counter, an index) or a 0-dim value, is a
    `ConvertError` naming every such tensor before anything is put at ``dst`` (what `verify` fails a file for).

    ``process_group``: convert on every rank of that group together (``torchrun``; the CLI does it when launched
    so), each rank reading and writing only its share of the output's 32 MB blocks into the one file
    (`fsdp_restore.share`); call it on every rank with the same arguments. A failure on any rank raises the same
    `ConvertError` on every rank, and nothing is put at ``dst``.

    The crc32s ``torch.save`` recorded for the source's records are checked before anything is put at ``dst``
    (``torch.load`` does not check them): the pickle and the small records before the pickle is read, and every
    storage the output holds unchanged from the written tensors' own checksums, at no cost. ``verify_checksums=True``
    also checks the storages of tensors cast (their crc32 taken as the cast reads them) and of views of part of a
    storage (read again). Of a DeepSpeed ZeRO checkpoint (read without torch), the files' pickles and small records
    are checked, and with ``verify_checksums=True`` every record read (from the crc32s of its runs as they were
    read, the padding read again). A damaged record is a `FormatError` naming it; ``report.source_crcs`` says what
    was checked.

    ``threads=``, the old name of ``thread_count``, still works with a `DeprecationWarning`; a
    ``thread_count`` that is not an int >= 1 is a `ValueError` before anything is read (with a
    ``process_group`` of several ranks, a bad argument on any rank is the same `ConvertError` on every rank).
    """
    one = Share.of(process_group) if process_group is not None else Share(0, 1)
    dst = through_link(dst)
    # patterns read once (a generator would be used up by the checks below); a bare string is refused there
    cast_include = cast_include if cast_include is None or isinstance(cast_include, str) else list(cast_include)
    cast_exclude = cast_exclude if isinstance(cast_exclude, str) else list(cast_exclude)
    allow_globals = _listed(allow_globals)

    def check_arguments() -> tuple[int | None, StoredDtype | None]:
        if tag is not None and not (Path(src).is_dir() and is_zero_checkpoint(src)):
            kind = "a file" if Path(src).is_file() else "not one"
            raise ValueError(f"tag='{tag}' (--tag) picks a tag of a DeepSpeed checkpoint directory; {src} is {kind}:"
                             " drop --tag")
        for name, patterns in (("cast_include", cast_include), ("cast_exclude", cast_exclude)):
            if patterns is not None and (isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns)):
                raise TypeError(f"{name} must be a list of key patterns (strings), not {patterns!r}")
        on_unsupported_argument(on_unsupported)
        shard_size_argument(max_shard_size)  # a bad size: here, not after the source was read
        flag_argument("force", force)
        flag_argument("trust_pickle", trust_pickle)
        flag_argument("verify_checksums", verify_checksums)
        allow_globals_argument(allow_globals)
        if select is not None and not isinstance(select, str):
            raise TypeError(f"select must be the name of one top-level subtree (a string such as 'model'), not"
                            f" {select!r}")
        return thread_count_argument(thread_count, threads, stacklevel=5), cast_target(dtype)

    # read without torch's unpickler where it can be (one process, nothing but torch's weights-only globals)
    lane = (process_group is None and not trust_pickle and not allow_globals and _TORCH_FREE_READS
            and _torch_loads_as_plain_pt_reads())
    # alone, a bad argument raises as it is; with several ranks, as the same ConvertError on every rank
    thread_count, dtype = one.step("check the arguments", check_arguments)  # type: ignore[misc]
    casting = {"dtype": dtype, "cast_include": cast_include, "cast_exclude": cast_exclude}
    if Path(src).is_dir():
        if lane:  # a ZeRO checkpoint: without torch, where its files allow (zero_plain)
            report = _convert_zero_plain(src, dst, select=select, tag=tag, on_unsupported=on_unsupported,
                                         threads=thread_count or default_io_threads(), max_shard_size=max_shard_size,
                                         force=force, progress=progress, verify_checksums=verify_checksums,
                                         **casting)
            if report is not None:
                return report
        return _convert_directory(src, dst, dtype=dtype, cast_include=cast_include, cast_exclude=cast_exclude,
                                  max_shard_size=max_shard_size, select=select, threads=thread_count, force=force,
                                  on_unsupported=on_unsupported, progress=progress, tag=tag, share=one,
                                  trust_pickle=trust_pickle, allow_globals=allow_globals,
                                  verify_checksums=verify_checksums)
    threads = thread_count or default_io_threads()
    if lane:  # without torch, where the file allows (plain_pt)
        report = _convert_plain(src, dst, select=select, on_unsupported=on_unsupported, threads=threads,
                                max_shard_size=max_shard_size, force=force, progress=progress,
                                verify_checksums=verify_checksums, **casting)
        if report is not None:
            return report

    def read_source() -> tuple[dict[str, Any], Any, dict[str, torch.Tensor], dict[str, Any], int, dict,
                               SourceRecords | None]:
        from . import mapped  # (torch's path only: it finds where torch.load mapped each tensor)

        if not Path(src).is_file():
            raise not_a_file(src)
        check_destination(dst, force=force, sources=[src], one_file=max_shard_size is None)
        before = os.stat(src)
        identity = source_identity(src, stat=before, select=select)  # before reading: a source rewritten meanwhile won't match it
        fd = os.open(src, os.O_RDONLY)
        try:
            _same_file(src, before, os.fstat(fd))
            source = None
            if one.rank == 0:  # (rank 0 checks the records: the small ones now, before the pickle is read)
                archive = Archive.open(fd)
                source = SourceRecords(src, archive, unchecked=None if archive else _why_unchecked(src))
                if archive is not None:
                    source.small_checked = check_small_records(src, archive)
            obj = load_selected(src, select, trust_pickle=trust_pickle, allow_globals=allow_globals)
            tensors, structure = flatten(obj, on_unsupported=on_unsupported)  # type: ignore[arg-type]
            _same_file(src, before, os.stat(src))  # what torch.load read by its path is the file of ``fd``
            mapping = mapped.MappedFile(src, fd)
            locations = {key: (fd, offset) for key, t in tensors.items()
                         if (offset := mapping.offset_of(t)) is not None}
            if source is not None and source.archive is not None:
                if mapping.mapped:  # where each tensor's storage lies (a numpy array's is none of the file's)
                    source.storage_at = {key: at for key, t in tensors.items()
                                         if (at := mapping.offset_at(t.untyped_storage().data_ptr())) is not None}
                else:  # nothing mapped (byte-swapped on loading): every storage is checked
                    source.every_storage = True
        except BaseException:
            os.close(fd)
            raise
        return identity, obj, tensors, structure, fd, locations, source

    with PeakAnonMemory() as mem, Stopwatch() as clock, _gc_paused():
        read = one.step("read the source", read_source)
        identity, obj, tensors, structure, fd, locations, source = read  # type: ignore[misc]
        try:
            _same_source(one, identity)
            result, casts, crcs = write_converted(
                tensors, structure, dst, dtype=dtype, cast_include=cast_include, cast_exclude=cast_exclude,
                max_shard_size=max_shard_size, threads=threads, force=force, progress=progress,
                metadata={META_SOURCE: json.dumps(identity)}, locations=locations, share=one, source=source,
                verify_checksums=verify_checksums)
        except EOFError as e:  # a tensor's bytes read at their offset: the file is shorter than its pickle says
            raise _truncated(src, e) from None
        finally:
            os.close(fd)
        del obj, tensors
    return _report(src, dst, result, casts, seconds=clock.seconds, peak=mem.peak, threads=threads,
                   source_crcs=crcs)
