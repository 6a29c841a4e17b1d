"""fsdp_restore: move checkpoints between "one big .pt file" and "a model sharded over many GPUs".

Pipeline: format -> flatten -> write/convert -> read -> restore -> check -> verify -> cli.
"""

from __future__ import annotations

import os
from typing import Any

from .convert import ConvertReport, convert, load_pt, save
from .errors import (FormatError, FsdpRestoreError, RestoreError, UnsafePickleError, UnsupportedObjectError,
                     VerifyError)
from .flatten import flatten, unflatten
from .read import Checkpoint, find_safetensors_for, open_checkpoint
from .optim import restore, restore_optimizer
from .restore import RestoreReport, restore_model
from .verify import VerifyReport, inspect_checkpoint, verify

__version__ = "0.1.0"


def load(path: str | os.PathLike[str], *, mmap: bool = True, trust_pickle: bool = False) -> Any:
    """Load a checkpoint as the nested object it was saved as.

    Our safetensors files (or sharded directories) come back with memory-mapped tensors: nothing
    is read until used; ``mmap=False`` reads every tensor eagerly with large positional reads
    (for network filesystems). Given ``x.pt``, a sibling ``x.safetensors`` (file or directory) is
    used when one exists, as OLMo does; otherwise the ``.pt`` is loaded safely (see `load_pt`).
    """
    if find_safetensors_for(path) is not None:
        if mmap:
            return Checkpoint(path).load()
        with Checkpoint(path) as ckpt:
            return ckpt.load(mmap=False)
    return load_pt(path, trust_pickle=trust_pickle)


__all__ = [
    "Checkpoint", "ConvertReport", "FormatError", "FsdpRestoreError", "RestoreError", "UnsafePickleError",
    "UnsupportedObjectError", "VerifyError", "convert", "find_safetensors_for", "flatten", "load", "load_pt",
    "inspect_checkpoint", "open_checkpoint", "verify", "VerifyReport", "restore", "restore_model", "restore_optimizer", "RestoreReport", "save", "unflatten",
]
