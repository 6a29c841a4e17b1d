"""Where a DeepSpeed ZeRO checkpoint's files are: the tag directory and its optimizer files. Imports nothing
heavy, so that the CLI can find them (and start reading them, `fsdp_restore.prefetch`) before torch is loaded."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import FormatError

# Where each rank's fp32 master weights lie in its optimizer file's ``optimizer_state_dict`` (DeepSpeed's names):
STAGE_1_2_MASTERS = "single_partition_of_fp32_groups"  # one flat partition per parameter group
STAGE_3_MASTERS = "fp32_flat_groups"  # one flat group per parameter group
MP_RANK = re.compile(r"(?:^|_)mp_rank_(\d+)_.*\.pt$")  # a file of model-parallel rank N (data-parallel runs: 0)


def optim_files(tag_dir: Path) -> list[Path]:
    """The tag's optimizer files (one per rank), in rank order."""
    files = list(tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    rank = re.compile(r"zero_pp_rank_(\d+)_")
    return sorted(files, key=lambda p: int(rank.search(p.name).group(1)))  # type: ignore[union-attr]


def tags(path: Path) -> list[str]:
    """The tag directories in ``path``: those holding optimizer files, whatever their name (``global_stepN`` by
    default; ``save_checkpoint(dir, tag="best")`` names its own)."""
    return sorted(p.name for p in path.iterdir() if p.is_dir() and optim_files(p))


def is_zero_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A DeepSpeed checkpoint directory (holding ``latest`` or tag directories) or one tag directory."""
    path = Path(path)
    if not path.is_dir():
        return False
    return bool((path / "latest").is_file() or optim_files(path) or tags(path))


def resolve_tag(path: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The tag directory to read: ``path`` itself when it holds the files, else ``path/tag``, else the tag
    that ``path/latest`` names, else the only tag directory (`tags`)."""
    path = Path(path)
    if tag:
        chosen = path / tag
        if not chosen.is_dir():
            if path.name == tag and optim_files(path):
                return path  # the tag directory itself, named by its own tag
            raise FormatError(path, f"has no tag '{tag}' (its tags: {', '.join(tags(path)) or 'none'})")
    elif optim_files(path):
        return path
    elif (path / "latest").is_file():
        chosen = path / (path / "latest").read_text().strip()
    else:
        found = tags(path)
        if len(found) != 1:
            raise FormatError(path, f"{'no' if not found else 'several'} checkpoint tags ({', '.join(found)}) and no"
                              " 'latest' file: pass --tag")
        chosen = path / found[0]
    if not optim_files(chosen):
        raise FormatError(chosen, "no *_optim_states.pt files: not a DeepSpeed ZeRO checkpoint tag")
    return chosen
