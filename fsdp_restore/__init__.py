"""fsdp_restore: move checkpoints between "one big .pt file" and "a model sharded over many GPUs".

Pipeline: format -> flatten -> write/convert -> read -> (key_map) plan -> execute -> check -> restore -> verify -> cli.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (ConvertError, FormatError, FsdpRestoreError, RestoreError, SaveError, UnsafePickleError,
                     UnsupportedObjectError, VerifyError)

# The public names, each from its module, imported on first use (PEP 562): `fsdp-restore --help` and
# `--version` then answer without importing torch (seconds), and `import fsdp_restore` stays cheap.
_LAZY = {
    "ConvertReport": "convert", "convert": "convert", "load_pt": "convert", "save": "convert",
    "flatten": "flatten", "unflatten": "flatten",
    "Checkpoint": "read", "find_safetensors_for": "read", "open_checkpoint": "read", "stale_sibling": "read",
    "init_non_persistent_buffers": "buffers", "KeyMap": "key_map", "RestoreReport": "plan",
    "RestoreResult": "restore", "restore": "restore", "restore_model": "restore", "restore_optimizer": "restore",
    "SaveReport": "sharded_save", "save_sharded": "sharded_save",
    "VerifyReport": "verify", "inspect_checkpoint": "verify", "verify": "verify",
}

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from .buffers import init_non_persistent_buffers
    from .convert import ConvertReport, convert, load_pt, save
    from .flatten import flatten, unflatten
    from .key_map import KeyMap
    from .plan import RestoreReport
    from .read import Checkpoint, find_safetensors_for, open_checkpoint, stale_sibling  # noqa: F401
    from .restore import RestoreResult, restore, restore_model, restore_optimizer
    from .sharded_save import SaveReport, save_sharded
    from .verify import VerifyReport, inspect_checkpoint, verify


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp_restore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Importing a submodule binds its name on the package (``import fsdp_restore.restore`` sets
    ``fsdp_restore.restore``): where a public function shares its module's name (convert, flatten,
    restore, verify), the function is bound instead, so the public name never becomes a module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"


def load(path: str | os.PathLike[str], *, mmap: bool = True, trust_pickle: bool = False) -> Any:
    """Load a checkpoint as the nested object it was saved as.

    What ``path`` is, is decided by its content, whatever its name (`find_safetensors_for`). Our
    safetensors files (or sharded directories) come back with memory-mapped tensors: nothing is read until
    used; ``mmap=False`` reads every tensor eagerly with large positional reads (for network filesystems).
    Structure and tensors come from one opening of each file, so a checkpoint replaced meanwhile is read
    whole as one version. Given a ``torch.save`` file ``x.pt``, a sibling ``x.safetensors`` (file or
    directory) is used when one exists and was converted from ``x.pt`` as it is now, as OLMo does;
    otherwise the ``.pt`` is loaded safely (see `load_pt`), with a warning when a sibling exists but is stale.
    """
    from .convert import load_pt
    from .errors import flag_argument
    from .provenance import mismatch
    from .read import Checkpoint, find_safetensors_for

    flag_argument("mmap", mmap)
    flag_argument("trust_pickle", trust_pickle)
    found = find_safetensors_for(path)
    if found is None:
        return load_pt(path, trust_pickle=trust_pickle)
    with Checkpoint(found) as ckpt:  # opened directly (not through x.pt): a stale sibling is a warning here
        if found != Path(path) and Path(path).is_file():
            why = mismatch(ckpt.source, path, found, cast=ckpt.cast, skipped=ckpt.skipped_values())  # what it records
            if why:
                warnings.warn(f"{found} was not converted from {path} as it is now ({why}): loading {path} instead;"
                              f" convert it again to use the fast path: fsdp-restore convert {path} {found} --force",
                              stacklevel=2)
                return load_pt(path, trust_pickle=trust_pickle)
        return ckpt.load(mmap=mmap)  # mapped tensors outlive the descriptors closed on return


__all__ = [
    "Checkpoint", "ConvertError", "ConvertReport", "FormatError", "FsdpRestoreError", "KeyMap", "RestoreError", "RestoreReport", "RestoreResult",
    "UnsafePickleError", "UnsupportedObjectError", "VerifyError", "VerifyReport", "convert", "find_safetensors_for",
    "flatten", "init_non_persistent_buffers", "inspect_checkpoint", "load", "load_pt", "open_checkpoint", "restore",
    "restore_model", "restore_optimizer", "save", "SaveError", "SaveReport", "save_sharded", "unflatten", "verify",
]
