"""What a read plan is made of: `ReadItem`s (stored elements -> local memory), the optimizer state they fill
(`OptimizerPlan`), the per-restore `RestoreReport`, and the `ReadPlan` that holds them with every problem found.

Built by plan.py (weights) and optim_plan.py (optimizer state); validated by check.py; run by execute.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .shards import Target


@dataclass(slots=True)  # (one or more per tensor per restore: slots make and read them faster)
class ReadItem:
    """Read ``dest.numel()`` elements of stored tensor ``key`` from flat element ``src_start`` into
    ``dest`` (a contiguous 1-D view of local memory). ``name`` is the model tensor (``optim:NAME.FIELD``
    for optimizer state) and ``global_start`` the flat index in that tensor where ``dest`` begins.

    With ``rows > 1`` the elements are ``rows`` runs of ``dest.numel() // rows``, ``stride`` elements
    apart both in the stored tensor and in the model tensor (a column block: one item, not one per row)."""

    key: str
    src_start: int
    dest: torch.Tensor
    name: str
    global_start: int
    global_numel: int
    rows: int = 1
    stride: int = 0
    done: bool = False

    @property
    def run(self) -> int:
        return self.dest.numel() // self.rows if self.rows else 0

    @property
    def span(self) -> int:
        """Elements from the first to the last one read, gaps between runs included."""
        if self.rows <= 1:
            return self.dest.numel()
        return (self.rows - 1) * self.stride + self.run if self.dest.numel() else 0


@dataclass
class RestoreReport:
    """What a restore did on this rank (model weights, or optimizer state)."""

    tensors: int = 0
    elements: int = 0  # elements read into local memory
    checked_elements: int = 0  # local elements NaN-filled and screened by the check
    bytes_read: int = 0
    seconds: float = 0.0
    cast: list[str] = field(default_factory=list)  # "name: stored dtype -> model dtype"
    # tensors of which this rank read NaN stored in the file (so the check did not count them unrestored): this
    # rank's shard only, not agreed (another rank's shard of the same tensor may hold NaN where this one holds none)
    nan_in_checkpoint: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # only when strict=False
    unexpected: list[str] = field(default_factory=list)  # only when strict=False
    prefix: str = ""  # the subtree read: the model_prefix of the weights, the optim_prefix of the optimizer state
    method: str = "read"
    # seconds per phase of the whole restore call: "plan" (open, plan, validate, read the rest of the checkpoint
    # that `restore` returns, agree), "read" (with the
    # ledger's fill and screen on the read threads), "check" (the verdict of the check), "agree"
    timings: dict[str, float] = field(default_factory=dict)
    # verify_checksums=True: stored tensors whose restored values are proven the file's bytes by its crc32s, and
    # "key: reason" for each restored one that could not be compared (cast on reading, no crc32 in the file)
    checksums_verified: int = 0
    checksums_unverified: list[str] = field(default_factory=list)


@dataclass
class OptimizerPlan:
    """Optimizer state to install once every read has been checked (`install`)."""

    optimizer: torch.optim.Optimizer
    state: dict[torch.Tensor, dict[str, Any]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    # (param, field) of every state tensor laid out like its parameter's local shard: the check covers them
    shaped: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    # each parameter's place in the saved state: installed in the file's order, as load_state_dict installs it (a
    # later save_sharded, or state_dict(), then keeps torch's order of first state)
    order: dict[torch.Tensor, int] = field(default_factory=dict)

    def install(self) -> None:
        for current, saved in zip(self.optimizer.param_groups, self.groups):
            current.update(saved)
        self.optimizer.state.clear()
        for param, state in sorted(self.state.items(), key=lambda item: self.order.get(item[0], len(self.order))):
            self.optimizer.state[param] = state
        # as load_state_dict ends: the optimizer's own __setstate__ brings state of an older torch up to date (Adam's
        # step saved as a number becomes the tensor its step() needs; group options added since get their defaults)
        self.optimizer.__setstate__({"state": self.optimizer.state, "param_groups": self.optimizer.param_groups})


@dataclass
class ReadPlan:
    items: list[ReadItem] = field(default_factory=list)
    problems: dict[str, list[str]] = field(default_factory=dict)
    model_report: RestoreReport | None = None
    optim_report: RestoreReport | None = None
    optim: OptimizerPlan | None = None
    # names the caller accepted as missing (strict=False): the check leaves their memory untouched
    skipped: set[str] = field(default_factory=set)
    # names not planned because of a problem already reported (missing, shape, dtype)
    refused: set[str] = field(default_factory=set)
    targets: list[Target] = field(default_factory=list)
    # {model name: the checkpoint's name} as the key map applied (every rank must read from the same names)
    stored_as: dict[str, str] = field(default_factory=dict)
    # (entry name, module, the stored node) of each module's extra state (``set_extra_state``), set after the reads
    extra_states: list[tuple[str, nn.Module, Any]] = field(default_factory=list)
    # what the restore warns of (rank 0) without failing: a key_map that left names of a strict=False restore unread
    warnings: list[str] = field(default_factory=list)
    # the model's tensors a strict restore found no key for (the "missing" problems' names, without their notes)
    missing: list[str] = field(default_factory=list)

    def add_problem(self, kind: str, text: str) -> None:
        self.problems.setdefault(kind, []).append(text)
