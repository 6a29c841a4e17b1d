"""The error types fsdp_restore raises. Every message names the file or key at fault and what to do.

Also the checks of the arguments every public entry point shares (`objects_argument`, `thread_count_argument`,
`process_group_argument`).
"""

from __future__ import annotations

import re
import sys
import warnings
from typing import Any


class FsdpRestoreError(Exception):
    """Base class of every error fsdp_restore raises on purpose."""


class FormatError(FsdpRestoreError):
    """A file is not a valid checkpoint (truncated, corrupt, inconsistent header or index)."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def not_a_file(path: object, mode: int | None = None) -> FormatError:
    """The error for a path that cannot be read as a checkpoint file: missing, or something other than a regular
    file (``mode``: its ``st_mode`` where known), which a checkpoint is not: it is read at offsets, more than once."""
    import os
    import stat

    if mode is None:
        try:
            mode = os.stat(path).st_mode  # type: ignore[arg-type]
        except OSError:
            return FormatError(path, "no such file")
    if stat.S_ISREG(mode):
        return FormatError(path, "cannot read it as a file")
    kind = ("a directory" if stat.S_ISDIR(mode) else "a pipe (FIFO)" if stat.S_ISFIFO(mode) else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
    return FormatError(path, f"is {kind}, not a regular file: a checkpoint is read at offsets; copy it into a"
                             " file first")


class UnsupportedObjectError(FsdpRestoreError):
    """The flattener met an object it cannot store without pickle."""

    def __init__(self, path: str, obj: object, hint: str = "", *, skippable: bool = True) -> None:
        self.path = path
        self.type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        shown = (path or "<root>").encode("utf-8", "backslashreplace").decode()  # printable, whatever the key
        msg = f"cannot store object of type {self.type_name} at '{shown}'"
        msg += f": {hint}" if hint else (
            "; convert it to a supported type (tensor, ndarray, dict, list, tuple, str, number, None)")
        if skippable:  # (a dict key cannot be dropped alone)
            msg += ("; or" if hint else " or") + (" pass on_unsupported='skip' (CLI: on_unsupported=skip) to drop it"
                                                  " with a warning")
        super().__init__(msg)


class UnsafePickleError(FsdpRestoreError):
    """A .pt file needs pickle globals outside the allowlist; loading it could execute code."""


class RefusedGlobalsError(UnsafePickleError):
    """An `UnsafePickleError` that knows which globals were refused (``names``: "module.Name" each)."""

    def __init__(self, message: str, names: list[str]) -> None:
        self.names = names
        super().__init__(message)


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (torch's run to paragraphs), or its type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def refused_global(where: str, e: BaseException) -> UnsafePickleError | None:
    """The error for torch's weights-only unpickler refusing a global (``e``), naming it and both ways on, or None
    when ``e`` is another failure. ``where``: what held the pickle (a file, a value in one)."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    if found is None:
        return None
    name = found.group(1)
    return UnsafePickleError(f"{where} names {name}, which loading would import and may call (arbitrary code"
                             f" execution). {allow_global_hint([name])}")


def allow_global_hint(names: list[str]) -> str:
    """The two ways on from a refused global, with what each one runs: ``--allow-global`` lets the unpickler call
    a class with the pickle's arguments (so only a data class may be allowed: a function, or a class of a module
    whose classes act, is refused at the door, `allowed_global`, and is not offered), ``--trust-pickle`` runs the
    whole pickle."""
    main = [n for n in names if n.startswith("__main__.")]
    if not main:
        return _allow_or_trust(names)
    rest = [n for n in names if not n.startswith("__main__.")]
    return (f"{main_hint(main[0])} Allowed, a class is called with the pickle's arguments: allow only a data class"
            " (a config, a dataclass). Such a value is not stored (only plain types are): on_unsupported='skip'"
            " drops it" + (f". Of {', '.join(rest)}: {_allow_or_trust(rest)}" if rest else ""))


def main_hint(name: str) -> str:
    """Where a class the saving script defined itself (pickled under ``__main__``, which in any other process is
    that process's own) can be loaded: from Python, where it is defined again."""
    return (f"{name} is a class the script that saved the file defined itself: the fsdp-restore command cannot"
            " import it (its __main__ is another), so convert from Python, in a script that defines or imports it"
            f" under that name as the saving script did: fsdp_restore.convert(src, dst, allow_globals=['{name}'],"
            " on_unsupported='skip').")


def _allow_or_trust(names: list[str]) -> str:
    functions = [n for n in names if _imported_non_class(n)]
    allowable = [n for n in names if n.split(".", 1)[0] not in _ACTING_MODULES and n not in _ACTING_CLASSES
                 and n not in functions]
    trust = ("If you trust the file, pass --trust-pickle (trust_pickle=True). Either way such a value is not stored"
             " (only plain types are): add on_unsupported=skip to drop it (load() returns None there; verify, given the"
             " same flags, accepts the drop the file declares)")
    if not allowable and functions == names:
        return (f"{'It is a function' if len(names) == 1 else 'Each is a function'}, not a data class: the unpickler"
                f" would call it with the pickle's arguments (running the pickle), so it cannot be allowed. {trust}")
    if not allowable:
        return (f"{'It is a class' if len(names) == 1 else 'Each is a class or a function'} of a module whose classes"
                f" act when called (files, processes, code), so it cannot be allowed. {trust}")
    return (f"If {'it is a data class' if len(allowable) == 1 else 'each is a data class'} you know (a config, a"
            f" dataclass, datetime.timedelta), allow it with --allow-global {allowable[0]} (allow_globals=[...]): the"
            " unpickler then calls the class with the pickle's arguments, so never allow one that acts (a file,"
            f" a process, a function such as shutil.rmtree: that is running the pickle). {trust}")


def _imported_non_class(name: str) -> bool:
    """Whether ``name`` is an attribute of a module this process has imported already (``builtins.eval``) that is
    not a class: a function, which `allowed_global` refuses. Nothing is imported to tell."""
    module, _, attr = name.rpartition(".")
    obj = getattr(sys.modules.get(module), attr, None) if module else None
    return obj is not None and not isinstance(obj, type)


# modules whose classes act when called (open or write files, start processes, load libraries, connect, run code):
# never a data class. A guard against the plain cases, not a proof: a class allowed is called with the pickle's
# arguments, and only its user can know it holds data (the hint says so)
_ACTING_MODULES = frozenset({
    "os", "posix", "nt", "subprocess", "shutil", "sys", "io", "_io", "_pyio", "importlib", "pickle", "_pickle",
    "marshal", "socket", "_socket", "socketserver", "ssl", "ctypes", "_ctypes", "runpy", "pty", "multiprocessing",
    "asyncio", "signal", "tempfile", "webbrowser", "code", "codeop", "zipfile", "tarfile", "gzip", "bz2", "lzma",
    "logging", "sqlite3", "_sqlite3", "shelve", "dbm", "mmap", "http", "urllib", "ftplib", "smtplib", "imaplib",
    "poplib", "xmlrpc", "selectors", "threading", "concurrent", "sched", "cProfile", "profile", "pdb", "bdb",
    "trace", "zipimport", "pkgutil", "venv", "ensurepip", "distutils", "setuptools", "pip", "fileinput"})
_ACTING_CLASSES = frozenset({"numpy.memmap"})
# functions that only rebuild data, which the default allow list holds: naming them again is no new allowance
_DATA_FUNCTIONS = frozenset({"numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
                             "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar"})


def allowed_global(name: str, obj: object) -> object:
    """``obj``, the global ``name`` an allow list names, if it may be allowed: a class, not from a module whose
    classes act when called (`_ACTING_MODULES`), or a function the default allow list holds already; else a
    `ValueError` saying why (the unpickler would call it)."""
    if name in _DATA_FUNCTIONS:
        return obj
    module = getattr(obj, "__module__", None) or name.rpartition(".")[0]
    if not isinstance(obj, type):
        raise ValueError(f"allow_globals: '{name}' is a {type(obj).__name__}, not a class: the unpickler would call"
                         " it with the pickle's arguments, which is running the pickle; allow data classes only, or"
                         " pass --trust-pickle (trust_pickle=True) for a file you trust")
    roots = {module.split(".")[0], name.split(".")[0]}
    if roots & _ACTING_MODULES or name in _ACTING_CLASSES or f"{module}.{obj.__qualname__}" in _ACTING_CLASSES:
        raise ValueError(f"allow_globals: '{name}' is a class of {module}, whose classes act when called (files,"
                         " processes, code): allow data classes only, or pass --trust-pickle (trust_pickle=True) for"
                         " a file you trust")
    return obj


class _AgreedError(FsdpRestoreError):
    """An error every rank raises alike, carrying the problems the ranks agreed on."""

    def __init__(self, message: str, problems: dict[str, list[str]] | None = None,
                 counts: dict[str, tuple[int, bool]] | None = None) -> None:
        self.problems = problems or {}  # by kind, the problems shown (a multi-rank failure shows some of them)
        # by kind, (how many there are, whether that is exact or a floor)
        self.counts = counts or {kind: (len(items), True) for kind, items in self.problems.items()}
        super().__init__(message)


class RestoreError(_AgreedError):
    """Restoring into a model failed; raised with the same message on every rank."""


class VerifyError(FsdpRestoreError):
    """A checkpoint failed verification."""


class ConvertError(FsdpRestoreError):
    """A conversion on several ranks (``convert(..., process_group=...)``) failed; raised with the same message on
    every rank (nothing is put at the destination), but where a rank died just after rank 0 put the whole output
    in place: rank 0 then says it is there, the others that it may be."""


class SaveError(_AgreedError):
    """`save_sharded` failed; raised with the same message on every rank (the destination is untouched), but where a
    rank died just after rank 0 put the whole new checkpoint in place: rank 0 then says it is there, the others
    that it may be."""


def on_unsupported_argument(on_unsupported: object) -> None:
    """The ``on_unsupported=`` of a public entry point, checked at the door: ``"error"`` or ``"skip"``, else a
    `ValueError` naming it."""
    if on_unsupported not in ("error", "skip"):
        raise ValueError(f"on_unsupported must be 'error' or 'skip', not {on_unsupported!r}")


def allow_globals_argument(allow_globals: object) -> None:
    """The ``allow_globals=`` of a public entry point, checked at the door: a list (tuple, set) of qualified names,
    else a `TypeError` naming it (a bare string was taken letter by letter)."""
    if isinstance(allow_globals, (str, bytes)) or not isinstance(allow_globals, (list, tuple, set, frozenset)) or not all(
            isinstance(g, str) for g in allow_globals):
        raise TypeError(f"allow_globals must be a list of qualified names such as ['datetime.timedelta'], not"
                        f" {type(allow_globals).__name__} {allow_globals!r}")


def flag_argument(name: str, value: object) -> bool:
    """A boolean option of a public entry point, checked at the door: True or False only (a string such as "no"
    would read as true), else a `TypeError` naming it."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return value


def thread_count_argument(thread_count: object, threads: object = None, *, stacklevel: int = 3) -> int | None:
    """The ``thread_count=`` of a public entry point, checked at the door: None (the entry point's default) or
    an int >= 1, else a `ValueError` naming it. ``threads=``, its name before, is accepted for one release with
    a `DeprecationWarning` (``stacklevel`` 3: pointing at the entry point's caller); both -> `TypeError`."""
    if threads is not None:
        if thread_count is not None:
            raise TypeError("pass thread_count= only: threads= is its deprecated old name, not a second option")
        warnings.warn("threads= is renamed thread_count= (threads= will be removed in the next release)",
                      DeprecationWarning, stacklevel=stacklevel)
        thread_count = threads
    if thread_count is not None and (isinstance(thread_count, bool) or not isinstance(thread_count, int)
                                     or thread_count < 1):
        raise ValueError(f"thread_count must be a positive int, not {thread_count!r}")
    return thread_count


def objects_argument(call: str, model: object, optimizer: object = None, *, optional: bool = False) -> None:
    """The model (and optimizer) of an entry point, checked at the door: a `TypeError` naming the call's order
    where they are swapped, else what each must be (an attribute error deep in the plan said neither).
    ``optional``: the optimizer may be None."""
    import torch

    is_module, is_optimizer = isinstance(model, torch.nn.Module), isinstance(optimizer, torch.optim.Optimizer)
    if isinstance(model, torch.optim.Optimizer) and isinstance(optimizer, torch.nn.Module):
        raise TypeError(f"the model and the optimizer are swapped: the call is {call}")
    if not is_module:
        raise TypeError(f"model must be an nn.Module (the sharded or plain model), not {type(model).__name__}:"
                        f" the call is {call}")
    if not is_optimizer and not (optional and optimizer is None):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer{' or None' if optional else ''}, not"
                        f" {type(optimizer).__name__}: the call is {call}")
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # imported where one was made
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        # its state lies in `optimizer.optim`, each rank's partition of parameters: `optimizer.state` is empty, so
        # a save would hold no moments and a restore would fill state the steps never read, both with no error
        raise TypeError(f"ZeroRedundancyOptimizer is not supported: each rank keeps the state of its own partition"
                        f" of the parameters (in .optim), which {call.partition('(')[0]} cannot map to the"
                        " parameters; use the plain optimizer (optimizer_class=...; under FSDP its state is sharded"
                        " with the parameters), or ZeroRedundancyOptimizer's own consolidate_state_dict() and"
                        " state_dict() to save, load_state_dict() to restore")


def process_group_argument(process_group: object) -> None:
    """The ``process_group=`` of a public entry point, checked at the door, before any collective uses it: None (the
    default group) or a ``torch.distributed.ProcessGroup``, else a `TypeError` naming it (torch's own error for,
    say, the string ``"WORLD"`` speaks of groups not registered)."""
    if process_group is None:
        return
    import torch.distributed as dist

    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD)"
                        f" or None, not {type(process_group).__name__}")


def renamed_argument(old: str, old_value: Any, new: str, new_value: Any, *, stacklevel: int = 3) -> Any:
    """The value of an option renamed ``old=`` -> ``new=`` (for both, None means not given): the old name is
    accepted for one release with a `DeprecationWarning` (``stacklevel`` 3: pointing at the entry point's
    caller); both given -> `TypeError`."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"pass {new}= only: {old}= is its deprecated old name, not a second option")
    warnings.warn(f"{old}= is renamed {new}= ({old}= will be removed in the next release)", DeprecationWarning,
                  stacklevel=stacklevel)
    return old_value
