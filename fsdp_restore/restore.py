"""Restore model weights and optimizer state on every rank, each rank reading only its own bytes.

This module only orchestrates, in two phases with one verdict each (verdict.py):

1. open the checkpoint, build the read plan for model and optimizer (plan.py), list what the check
   covers from the model itself and validate the plan against it (check.py); agree. Nothing has
   been modified when this fails.
2. NaN-fill every element to restore, execute the plan (execute.py, or the ``FSDP.apply`` route in
   apply.py), screen every element, read the rest of the checkpoint; agree. Then install the
   optimizer state.

Any exception on any rank in either phase becomes the same `RestoreError` on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from . import check as checks
from .buffers import buffer_problems
from .errors import (RestoreError, flag_argument, objects_argument, process_group_argument, renamed_argument,
                     thread_count_argument)
from .execute import DEFAULT_READ_THREADS, cache_chunk_bytes, execute_reads
from .key_map import KeyMap
from .plan import ReadPlan, RestoreReport, build_plan, default_prefix
from .read import Checkpoint, open_checkpoint
from .restored_sums import ChecksumVerdict, joined_verdict, local_sums
from .shards import frozen_parameter_names, module_walk, state_dict_code
from .stored import default_optim_prefix, extras
from .stored import value as stored_value
from .verdict import agree, new_problems

__all__ = ["RestoreReport", "RestoreResult", "default_prefix", "restore", "restore_model", "restore_optimizer"]


@dataclass
class RestoreResult(Mapping[str, Any]):
    """What `restore` returns: the rest of the checkpoint (``result["step"]``: a read-only mapping over
    ``extra``) and the reports of the model and optimizer restores."""

    model: RestoreReport | None = None
    optimizer: RestoreReport | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.extra)

    def __len__(self) -> int:
        return len(self.extra)


def _reshard_fsdp2(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None) -> None:
    """Put FSDP2 modules back on their sharded parameters (a forward with ``reshard_after_forward=False``
    leaves them unsharded): the restore writes the sharded storage, which is what training keeps.
    ``modules``: `shards.module_walk`'s list, when the caller has it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    seen: set[int] = set()  # a module reachable under two names is resharded once, as model.modules() gives it
    for _, module in module_walk(model) if modules is None else modules:
        if isinstance(module, FSDPModule) and id(module) not in seen:
            seen.add(id(module))
            module.reshard()


def _refuse_unsharded_fsdp1(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None) -> None:
    from .shards import _fsdp1_units

    unsharded = []
    for prefix, handle in _fsdp1_units(model, modules):
        shard = getattr(handle.flat_param, "_local_shard", None)  # set at FSDP's lazy init (first forward)
        if handle.uses_sharded_strategy and shard is not None and handle.flat_param.data_ptr() != shard.data_ptr():
            unsharded.append(prefix or "<root>")
    if unsharded:
        raise ValueError(f"FSDP1 units {', '.join(unsharded[:5])} hold unsharded parameters (inside"
                         " summon_full_params, or between forward and backward): restore outside them")


def _warn_of_load_code(modules: list[tuple[str, nn.Module]], group: dist.ProcessGroup | None) -> None:
    """Warn (rank 0) of modules whose ``load_state_dict`` runs code of their own (`state_dict_code`): the restore
    writes the stored values into their parameters and buffers as they are, past that code. Most such code renames
    or drops entries of old checkpoints (names the restore matches itself, strictly); code that changes values
    (quantized layers, fused projections) would have given the model other values than the restore does."""
    offenders = state_dict_code(modules, loading=True)
    if offenders and (not dist.is_initialized() or dist.get_rank(group) == 0):
        warnings.warn(
            f"the restore writes the checkpoint's values as stored, past the load_state_dict code of"
            f" {len(offenders)} module(s): {'; '.join(offenders[:5])}{' ...' if len(offenders) > 5 else ''}. If that"
            " code changes values rather than names (quantized layers, fused projections), load such a model with"
            " load_state_dict (or torch.distributed.checkpoint's set_model_state_dict) instead", stacklevel=5)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector: a restore allocates a few objects per tensor (plan items,
    views), and with thousands of tensors the collector's full passes over everything the training script
    holds cost more than the planning itself (BENCHMARKS.md). Reference counting still frees everything."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _headline(label: str, checkpoint: object) -> str:
    """A verdict's subject: "restore of run/step1000.safetensors". From the checkpoint as the call gave it, so that a
    rank refusing an argument at the door and a rank that got as far as the plan's verdict raise the same text."""
    if isinstance(checkpoint, Checkpoint):
        return f"{label} of {checkpoint.path}"
    if isinstance(checkpoint, (str, os.PathLike)):
        return f"{label} of {os.fspath(checkpoint)}"
    return label


def _subtrees_read(plan: ReadPlan) -> list[str]:
    """Where in the checkpoint the plan looked for names, for a verdict that reports names missing or unexpected
    (a prefix may have been found rather than given, and such names are often the wrong subtree's)."""
    parts = []
    for report, what, option in ((plan.model_report, "the weights", "model_prefix"),
                                 (plan.optim_report, "the optimizer state", "optim_prefix")):
        if report is not None:
            at = f"under '{report.prefix}'" if report.prefix else "at its top level"
            parts.append(f"{what} {at} ({option}={report.prefix!r})")
    return ["; ".join(parts)] if parts else []


def _refuse_on_every_rank(error: Exception, label: str, checkpoint: object, group: dist.ProcessGroup | None
                          ) -> NoReturn:
    """A bad argument found at the door of an entry point on this rank. Alone, it is raised as it is (a
    `ValueError` or `TypeError`); with several ranks the others are already on their way to the plan's verdict, so
    this rank joins that verdict with the error and every rank raises the same `RestoreError` naming it, at once,
    instead of the others waiting in a collective for a rank that has left."""
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not several:
        raise error
    problems = new_problems()
    with problems.guard():
        raise error
    agree(problems, _headline(label, checkpoint), group, generic=label)
    raise error  # not reached: agree raised on every rank


def _run(model: nn.Module, checkpoint: str | os.PathLike[str] | Checkpoint, **options: Any
         ) -> tuple[ReadPlan, dict[str, Any]]:
    with _no_cyclic_gc():
        return _run_phases(model, checkpoint, **options)


def _run_phases(model: nn.Module, checkpoint: str | os.PathLike[str] | Checkpoint, *, weights: bool,
         optimizer: torch.optim.Optimizer | None, prefix: str | None, optim_prefix: str | None, strict: bool,
         check: bool,
         check_buffers: bool, method: str, threads: int | None, dtype_policy: str,
         group: dist.ProcessGroup | None, extra_keys: tuple[str, ...] | None = None, key_map: KeyMap | None = None,
         verify_checksums: bool = False) -> tuple[ReadPlan, dict[str, Any]]:
    """Both phases of a restore of ``weights`` and/or ``optimizer``; returns the plan (with its
    reports) and, with ``extra_keys``, every other top-level entry of the checkpoint."""
    t0 = time.perf_counter()
    threads = threads or DEFAULT_READ_THREADS
    own = not isinstance(checkpoint, Checkpoint)
    ckpt: Checkpoint | None = None
    plan = ReadPlan()
    model_memory: list[checks.Storage] = []
    optim_memory: list[checks.Storage] = []
    coverage: dict[str, tuple[int, int]] = {}
    prints: list[tuple[str, int]] = []
    same: list[tuple[str | None, str]] = []
    extra: dict[str, Any] = {}
    extra_states: list[tuple[nn.Module, Any]] = []
    label = "restore" if weights else "optimizer restore"
    what, check_what = _headline(label, checkpoint), _headline(f"{label} check", checkpoint)
    planned: dict[str, str] | None = None  # the plan's names, once planned (compared between the ranks)
    resolved_optim_prefix = optim_prefix  # (None: found in the checkpoint once it is open)
    try:
        # -- phase 1: open, plan, validate the plan against the model's memory (nothing is modified) --------
        problems = new_problems()
        with problems.guard():
            if method not in ("read", "apply"):
                raise ValueError(f"unknown method '{method}' (use 'read' or 'apply')")
            if verify_checksums and method != "read":
                raise ValueError("verify_checksums=True checks what the read route restored: use method='read'")
            ckpt = open_checkpoint(checkpoint)
            if resolved_optim_prefix is None:  # not given: where the checkpoint holds its optimizer state
                resolved_optim_prefix = default_optim_prefix(ckpt)
            modules = module_walk(model)  # one walk of the module tree for every step below
            if weights:
                _warn_of_load_code(modules, group)
            _reshard_fsdp2(model, modules)
            _refuse_unsharded_fsdp1(model, modules)
            plan = build_plan(model, ckpt, prefix=prefix, strict=strict, dtype_policy=dtype_policy, weights=weights,
                              optimizer=optimizer, optim_prefix=resolved_optim_prefix, key_map=key_map,
                              modules=modules)
            planned = plan.stored_as
            problems.update(plan.problems)
            if plan.warnings and not plan.problems and (not dist.is_initialized() or dist.get_rank(group) == 0):
                for text in plan.warnings:
                    warnings.warn(text, stacklevel=4)
            if "missing" in plan.problems or "unexpected" in plan.problems:
                problems.add("looked_in", _subtrees_read(plan))
            if plan.missing and weights and set(plan.missing) <= frozen_parameter_names(model):
                problems.add("frozen", [f"each of the {len(plan.missing)} is a parameter that does not require"
                                        " grad: the file holds the trained part alone (save_sharded("
                                        "ignore_frozen_params=True), an adapter's file); restore it with strict=False"
                                        " (CLI: --no-strict) over the frozen weights"])
            # the modules' extra states, read now (small values): a failure here leaves the model untouched
            extra_states = [(module, stored_value(ckpt, node)) for _, module, node in plan.extra_states]
            if verify_checksums:
                _refuse_without_checksums(plan, ckpt)
            memory = checks.model_storages(model, modules)  # from the model itself, not from the plan
            if weights:
                model_memory = checks.without(memory, plan.skipped)
            if plan.optim is not None:
                optim_memory = checks.optimizer_storages(plan.optim, memory)
            problems.update(checks.validate_plan(plan, model_memory + optim_memory, ckpt))
            coverage = checks.coverage_terms(plan.items)
            if check and check_buffers:
                buffer_issues, prints = buffer_problems(model)
                problems.add("buffers", buffer_issues)
            if extra_keys is not None and plan.model_report is not None:
                # the rest of the checkpoint (small values), read now: a failure here leaves the model untouched;
                # a plain weights file (prefix "") has nothing but its weights
                weights_at = plan.model_report.prefix
                # (None in extra_keys: the optimizer's subtree, where it was found)
                others = tuple(resolved_optim_prefix if k is None else k for k in extra_keys)
                extra = extras(ckpt, (weights_at, *others)) if weights_at else extras(
                    ckpt, others, tensors=False)  # weights at the top level (torchtitan): its other values
        with problems.guard():  # whatever failed above: what this rank learnt (a rank given another file fails on
            if dist.is_initialized() and dist.get_world_size(group) > 1:  # what differs in it; the verdict says why)
                called = {"prefix": prefix, "optim_prefix": optim_prefix, "weights": weights, "optimizer": optimizer,
                          "strict": strict, "check": check, "check_buffers": check_buffers, "method": method,
                          "dtype_policy": dtype_policy, "verify_checksums": verify_checksums}
                same = _same_on_every_rank(None, stored_as=None, **called)  # (its texts, should the next one fail)
                same = _same_on_every_rank(ckpt, stored_as=planned, **called)
        agree(problems, what, group, coverage=coverage, buffer_prints=prints, same=same, generic=label)
        assert ckpt is not None
        timings = {"plan": time.perf_counter() - t0}

        # -- phase 2: poison, read, screen -----------------------------------------------------------------
        problems = new_problems()
        before = ckpt.bytes_read
        result = checks.CheckResult()
        storages = model_memory + optim_memory
        sums: dict[str, list[int]] = {}  # set before any step that may fail: every rank joins the checksums below
        t_sums = time.perf_counter()
        # host memory: the check fills and screens each chunk on the read threads (a ledger); GPU memory and
        # the apply route: one fill pass before the reads and one screen pass after
        ledger = checks.Ledger(storages) if check and method == "read" and all(
            s.memory.device.type == "cpu" for s in storages) else None
        with problems.guard():
            with torch.no_grad():
                t1_fill = time.perf_counter()
                if check and ledger is None:
                    checks.poison(storages, threads)
                t1 = time.perf_counter()
                if method == "apply":
                    from .apply import execute_by_apply

                    execute_by_apply(model, ckpt, plan.items, prefix=plan.model_report.prefix if plan.model_report
                                     else "", threads=threads)
                elif ledger is not None:
                    execute_reads(ckpt, plan.items, threads, before=ledger.before, after=ledger.after,
                                  screened=functools.partial(ledger.read, ckpt), poison_staging=True,
                                  chunk_bytes=cache_chunk_bytes(threads))
                else:
                    execute_reads(ckpt, plan.items, threads, poison_staging=check)
                for module, state in extra_states:  # as load_state_dict gives them, with the tensors
                    module.set_extra_state(state)
                t2 = time.perf_counter()
                timings["read"] = t2 - t1
                if ledger is not None:
                    result = checks.settle(storages, plan, ckpt, ledger)
                elif check:
                    result = checks.screen(storages, plan, ckpt, threads)
                problems.add("unrestored", result.unrestored)
                timings["check"] = (t1 - t1_fill) + (time.perf_counter() - t2)  # fill pass + verdict
                t_sums = time.perf_counter()
                if verify_checksums:
                    sums, mismatched = local_sums(plan.items, ckpt, threads)
                    problems.add("checksum", mismatched)
        sums_verdict = None
        if verify_checksums:  # every rank joins, whatever its reads did (the options agreed in phase 1)
            with problems.guard():
                sums_verdict = joined_verdict(sums, ckpt, check_what, group)
                problems.add("checksum", sums_verdict.damaged)
            timings["checksums"] = time.perf_counter() - t_sums
        t3 = time.perf_counter()
        try:
            agree(problems, check_what, group, generic=f"{label} check")
        except RestoreError as e:  # unlike a failure of the plan, this one comes after the model was written to
            if "partly written" in str(e):
                raise
            raise RestoreError(f"{e}\n  hint: {_PARTLY_WRITTEN[weights]}", e.problems, e.counts) from None
        timings["agree"] = time.perf_counter() - t3

        _fill_reports(plan, ckpt, result, bytes_read=ckpt.bytes_read - before, method=method,
                      seconds=time.perf_counter() - t0, checked=(model_memory, optim_memory) if check else ([], []),
                      timings=timings, sums=sums_verdict)
        if plan.optim is not None:
            plan.optim.install()
        return plan, extra
    finally:
        if own and ckpt is not None:
            ckpt.close()


def _options_argument(**options: object) -> None:
    """The boolean options (``strict``, ``check``, ``check_buffers``) and the subtree prefixes of a restore entry
    point, checked at the door: a string such as "no" would read as true, and a prefix that is not a string
    failed deep in the plan."""
    for name, value in options.items():
        if name.endswith("_prefix"):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a dotted subtree name (a string such as 'model', '' for the top"
                                f" level) or None, not {value!r}")
        else:
            flag_argument(name, value)


def _flag(name: str, value: object, label: str, checkpoint: object, group: dist.ProcessGroup | None) -> bool:
    """A boolean option checked at the door: True or False only (a string such as "no" would read as true)."""
    try:
        return flag_argument(name, value)
    except TypeError as e:
        _refuse_on_every_rank(e, label, checkpoint, group)


_PARTLY_WRITTEN = {  # by whether the model's weights were restored too
    True: "the reads had begun on every rank, so the model's parameters and buffers (and the optimizer's state"
          " tensors, if restored with them) are now partly written: restore again into them, or rebuild them,"
          " before using them",
    False: "the reads had begun on every rank, so the optimizer's state tensors are now partly written (the model"
           " is untouched): restore again into them, or rebuild the optimizer, before using it",
}


def _same_on_every_rank(ckpt: Checkpoint | None, *, prefix: str | None, optim_prefix: str | None, weights: bool,
                        optimizer: torch.optim.Optimizer | None, strict: bool, check: bool, check_buffers: bool,
                        method: str, dtype_policy: str, stored_as: dict[str, str] | None, verify_checksums: bool
                        ) -> list[tuple[str | None, str]]:
    """What every rank of a restore must hold alike, for `agree`: the checkpoint's content (ranks that open it
    while it is replaced may each see a whole version but not the same one; copies on two nodes may differ)
    and each option that decides what is read where, as the call uses it (a rank with another one would read
    other bytes, or check other memory, with no error of its own; an option the call ignores is not compared):
    the model's names with the checkpoint's name for each (``stored_as``: what a key map gave; without one, the
    names themselves), so that maps passed in different forms with the same effect agree, and ranks that hold
    different models are told so. What a rank could not learn (``ckpt`` None: it failed to open the checkpoint;
    ``stored_as`` None: to plan) is None, and left out of the comparison (`agree`); the texts are every rank's."""
    pairs: list[tuple[str | None, str]] = [(
        ckpt.content_sample() if ckpt is not None else None,
        "the ranks opened different versions of the checkpoint (they were given different"
              " files, such as a path computed on each rank, or it was replaced while they opened it, or the copies"
              " they read differ): give every rank the same file and restore again")]
    ignored = "(not used)"  # every rank has every slot, in the same order: the messages are the same everywhere
    options: dict[str, object] = {
        # check_buffers= decides only with the check: one slot, so that a rank differing in check= alone is told so
        "check": (bool(check), bool(check_buffers) if check else None), "optimizer": optimizer is not None,
        "dtype_policy": dtype_policy,
        "model_prefix": (prefix if prefix is not None else default_prefix(ckpt) if ckpt is not None else None)
                        if weights else ignored,
        "strict": bool(strict) if weights or optimizer is not None else ignored,
        "method": method if weights else ignored,
        # compared with or without an optimizer: restore() also leaves that subtree out of what it returns, and a rank
        # without an optimizer must not read as a rank with another optim_prefix= (the optimizer= slot says it)
        "optim_prefix": optim_prefix,
        "verify_checksums": bool(verify_checksums)}
    also = {"check": " (or, with the check, of check_buffers=)",
            # (a default found in the file: ranks given different files differ here first; the text is every rank's)
            "model_prefix": " (or, where none was given, each rank found another in the file it opened: 'model' for a"
                            " file with a model subtree, else ''; were they given different files?)"}
    for name in sorted(options):
        known = not (name == "model_prefix" and options[name] is None)
        pairs.append((repr(options[name]) if known else None, f"the ranks called the restore with different values of"
                                                              f" {name}={also.get(name, '')} (one value on every rank)"))
    pairs.append((repr(zlib.crc32(json.dumps(sorted(stored_as.items())).encode())) if stored_as is not None else None,
                  "the ranks hold different models (other parameter or buffer names), or called the restore with"
                  " key_map= values that name them differently: every rank of the process group restores the same"
                  " model with the same key map; ranks that hold different parts of it (pipeline stages) each restore"
                  " with process_group= the group of the ranks that hold the same part"))
    return pairs


def _fill_reports(plan: ReadPlan, ckpt: Checkpoint, result: checks.CheckResult, *, bytes_read: int, method: str,
                  seconds: float, checked: tuple[list[checks.Storage], list[checks.Storage]],
                  timings: dict[str, float], sums: ChecksumVerdict | None = None) -> None:
    """Counts per report. Bytes read: the model's are what its items asked for (the apply route: all it
    read); the optimizer's are the rest (with the check's re-reads of NaN held by the file, if any)."""
    model_bytes = bytes_read if plan.optim_report is None else 0
    if plan.model_report is not None and plan.optim_report is not None:
        model_bytes = sum(i.dest.numel() * ckpt.entries[i.key].itemsize for i in plan.items
                          if not i.name.startswith("optim:"))
    for report, optim, memory in ((plan.model_report, False, checked[0]), (plan.optim_report, True, checked[1])):
        if report is None:
            continue
        report.elements = sum(i.dest.numel() for i in plan.items if i.name.startswith("optim:") == optim)
        report.nan_in_checkpoint = [n for n in result.nan_in_checkpoint if n.startswith("optim:") == optim]
        report.checked_elements = sum(r.numel for s in memory if s.floating for r in s.regions)
        report.bytes_read = bytes_read - model_bytes if optim else model_bytes
        report.method = "optimizer" if optim else method
        report.seconds = seconds
        report.timings = dict(timings)
        if sums is not None:
            split = _optimizer_keys(plan)
            report.checksums_verified = sum(1 for k in sums.proven if _belongs(k, split, optim))
            report.checksums_unverified = [line for line in sums.unproven
                                           if _belongs(line.split(": ", 1)[0], split, optim)]


def _optimizer_keys(plan: ReadPlan) -> str | None:
    """How to tell the optimizer's stored keys from the model's in a restore of both: the optimizer subtree's
    prefix; None when the call restores the optimizer alone (every key is its)."""
    if plan.model_report is None or plan.optim_report is None:
        return None
    return plan.optim_report.prefix + "." if plan.optim_report.prefix else None


def _belongs(key: str, optimizer_prefix: str | None, optim: bool) -> bool:
    """Whether a stored key counts for the optimizer's report (``optim``) or the model's: the optimizer's keys start
    with its prefix; with None (one report), every key counts for it."""
    return optimizer_prefix is None or key.startswith(optimizer_prefix) == optim


def _refuse_without_checksums(plan: ReadPlan, ckpt: Checkpoint) -> None:
    """``verify_checksums=True`` on a file that records no crc32 for anything this restore reads: nothing could be
    verified, which the caller asked to be told of before the reads."""
    if plan.items and not ckpt.checksums:  # the file's, not this rank's items: the same answer on every rank
        raise ValueError(f"verify_checksums=True: {ckpt.path} records no checksums (another tool wrote it), so the"
                         " restored values cannot be compared with them; convert it with fsdp-restore convert to"
                         " get a file that does, or restore without verify_checksums")


def restore_model(model: nn.Module, checkpoint: str | os.PathLike[str] | Checkpoint, *,
                  model_prefix: str | None = None, strict: bool = True, check: bool = True, check_buffers: bool = True,
                  method: str = "read", thread_count: int | None = None, dtype_policy: str = "cast",
                  key_map: KeyMap | None = None, process_group: dist.ProcessGroup | None = None,
                  threads: int | None = None, prefix: str | None = None, verify_checksums: bool = False
                  ) -> RestoreReport:
    """Restore a model's weights from a checkpoint; call on every rank after sharding the model.

    ``checkpoint``: a path (file, sharded directory, or ``.pt`` with a ``.safetensors`` sibling) or
    an opened `Checkpoint`. ``model_prefix``: the dotted subtree holding the weights; default ``"model"``
    when the top level holds a ``model`` subtree, else ``""`` (``prefix=``, its old name, still works with a
    `DeprecationWarning`). Works for FSDP2 (``fully_shard``, any
    DTensor layout; unsharded modules are resharded first), FSDP1 (every sharding strategy,
    ``use_orig_params`` either way), DDP and plain modules; a model built on the meta device must be
    materialized (``to_empty``) first. Each rank reads only the bytes of its own shard.
    ``method="apply"`` uses the seed's FSDP1 route instead (``FSDP.apply`` summons each unit's full
    parameters; every rank reads everything). ``key_map`` restores a model whose names differ from the
    checkpoint's: a callable ``model name -> checkpoint name``, a dict, or ``(regex, replacement)``
    pairs (see `fsdp_restore.key_map`); it renames only, and is applied to optimizer state too.

    With ``check``, every local element of every floating parameter and persistent buffer is NaN-filled
    before the reads and screened after (``strict=False``: the missing names are left untouched), the
    plan is validated against the model's memory before any read, and non-persistent buffers (which
    no checkpoint holds) must be finite, equal on every rank and, where the module says how, equal to
    their own initialisation (``check_buffers``). Every rank raises the same `RestoreError` for any
    problem on any rank: missing / unexpected keys (``strict``), shapes, dtypes with
    ``dtype_policy="error"`` (default ``"cast"``: converted and listed in ``report.cast``), unrestored
    elements, or any exception.

    ``verify_checksums``: after the reads, prove that the restored values are the bytes the file was written
    with: each rank checksums the memory it restored, the ranks' parts are joined into each stored tensor's crc32
    (one all-reduce) and compared with the one the file records, so a file damaged after it was written (or a
    copy that differs) is the same `RestoreError` on every rank, naming each tensor. It reads the restored memory
    once more (a device's through host copies); tensors it cannot compare (cast into the model's dtype, or no
    crc32 in the file) are listed in ``report.checksums_unverified``; a file with no crc32s at all is refused
    before the reads. ``method="read"`` only.

    ``thread_count``: read threads per rank (default 4); ``threads=``, its old name, still works with a
    `DeprecationWarning`. A value that is not an int >= 1 is a `ValueError` before anything is read; with
    several ranks, a bad argument on any rank is the same `RestoreError` on every rank instead.
    """
    process_group_argument(process_group)  # raised alone: a group that is not one cannot carry it to the others
    try:
        objects_argument("restore_model(model, checkpoint)", model, optional=True)
        thread_count = thread_count_argument(thread_count, threads)
        model_prefix = renamed_argument("prefix", prefix, "model_prefix", model_prefix)
        _options_argument(strict=strict, check=check, check_buffers=check_buffers, model_prefix=model_prefix)
    except (TypeError, ValueError) as e:
        _refuse_on_every_rank(e, "restore", checkpoint, process_group)
    plan, _ = _run(model, checkpoint, weights=True, optimizer=None, prefix=model_prefix, optim_prefix="optim",
                   strict=strict, check=check, check_buffers=check_buffers, method=method, threads=thread_count,
                   dtype_policy=dtype_policy, group=process_group, key_map=key_map,
                   verify_checksums=_flag("verify_checksums", verify_checksums, "restore", checkpoint,
                                          process_group))
    assert plan.model_report is not None
    return plan.model_report


def restore_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                      checkpoint: str | os.PathLike[str] | Checkpoint, *, optim_prefix: str | None = None,
                      model_prefix: str | None = None, check: bool = True, thread_count: int | None = None,
                      key_map: KeyMap | None = None, process_group: dist.ProcessGroup | None = None,
                      threads: int | None = None, prefix: str | None = None, strict: bool = True,
                      verify_checksums: bool = False) -> RestoreReport:
    """Restore ``optimizer`` (built over the sharded ``model``) from the checkpoint subtree ``optim_prefix``
    (by default, None: the one optimizer state dict the checkpoint holds, wherever it is, such as nanoGPT's
    ``optimizer`` or the top level of a Hugging Face Trainer's ``optimizer.pt``; else ``"optim"``; ``prefix=``, its
    old name, still works with a `DeprecationWarning`).

    Per-parameter state tensors are read slice by slice into tensors laid out like each parameter's
    local shard (DTensors for FSDP2): the optimizer's existing state tensors when they have that
    layout (overwritten in place), else new ones. Scalar state (``step``) is copied whole and the
    param-group hyperparameters are restored. Saved parameters are matched to the optimizer's as
    ``Optimizer.load_state_dict`` matches them: saved group ``g`` to group ``g``, torch's integer ids by
    position within their group (or by name where ``param_names`` were saved), so the optimizer's groups
    must hold the parameters in the order the saved run's did. ``model_prefix`` is no longer needed
    for that and is accepted for compatibility. Every rank
    raises the same `RestoreError` when the optimizer does not match the checkpoint (nothing is
    modified then) or when a read or its check fails (the state is then not installed). ``strict=False``:
    where ``param_names`` were saved, a group may hold a part of the saved group's parameters (a pipeline
    stage of the saved run's model); the others are listed in ``report.unexpected``. ``thread_count`` and
    ``verify_checksums``: as `restore_model`."""
    process_group_argument(process_group)  # raised alone: a group that is not one cannot carry it to the others
    try:
        objects_argument("restore_optimizer(optimizer, model, checkpoint)", model, optimizer)
        thread_count = thread_count_argument(thread_count, threads)
        optim_prefix = renamed_argument("prefix", prefix, "optim_prefix", optim_prefix)
        _options_argument(strict=strict, check=check, optim_prefix=optim_prefix)
    except (TypeError, ValueError) as e:
        _refuse_on_every_rank(e, "optimizer restore", checkpoint, process_group)
    plan, _ = _run(model, checkpoint, weights=False, optimizer=optimizer, prefix=model_prefix,
                   optim_prefix=optim_prefix, strict=strict, check=check, check_buffers=False, method="read",
                   threads=thread_count, dtype_policy="cast", group=process_group, key_map=key_map,
                   verify_checksums=_flag("verify_checksums", verify_checksums, "optimizer restore", checkpoint,
                                          process_group))
    assert plan.optim_report is not None
    return plan.optim_report


def restore(model: nn.Module, checkpoint: str | os.PathLike[str] | Checkpoint,
            optimizer: torch.optim.Optimizer | None = None, *, model_prefix: str | None = None,
            optim_prefix: str | None = None, check: bool = True, check_buffers: bool = True, strict: bool = True,
            thread_count: int | None = None, key_map: KeyMap | None = None,
            process_group: dist.ProcessGroup | None = None, threads: int | None = None,
            model_key: str | None = None, optim_key: str | None = None, verify_checksums: bool = False
            ) -> RestoreResult:
    """Restore model (and optimizer) state on every rank in one pass: one plan, one read phase, two
    verdicts. Returns a `RestoreResult`: a mapping over every other top-level entry of the checkpoint
    (step, scheduler, RNG states, config...) as ordinary Python objects, with ``.model`` and
    ``.optimizer`` reports (``strict=False`` losses are in ``result.model.missing``). ``model_prefix``: the
    subtree holding the weights, by default (None) ``"model"`` when the top level holds a ``model`` subtree
    (a training checkpoint), else ``""`` (a plain weights file, such as a Hugging Face file or a weights-only
    `save_sharded`; nothing else is returned then); ``optim_prefix``: the optimizer's subtree (by default, None: the
    one the checkpoint holds, else ``"optim"``; it is not among the entries returned). ``model_key=`` and
    ``optim_key=``, their old names, still work with a `DeprecationWarning`. ``key_map``, ``thread_count`` and
    ``verify_checksums``: as `restore_model`."""
    process_group_argument(process_group)  # raised alone: a group that is not one cannot carry it to the others
    try:
        objects_argument("restore(model, checkpoint, optimizer)", model, optimizer, optional=True)
        thread_count = thread_count_argument(thread_count, threads)
        model_prefix = renamed_argument("model_key", model_key, "model_prefix", model_prefix)
        optim_prefix = renamed_argument("optim_key", optim_key, "optim_prefix", optim_prefix)
        _options_argument(strict=strict, check=check, check_buffers=check_buffers, model_prefix=model_prefix,
                          optim_prefix=optim_prefix)
    except (TypeError, ValueError) as e:
        _refuse_on_every_rank(e, "restore", checkpoint, process_group)
    plan, extra = _run(model, checkpoint, weights=True, optimizer=optimizer, prefix=model_prefix,
                       optim_prefix=optim_prefix, strict=strict, check=check, check_buffers=check_buffers,
                       method="read", threads=thread_count, dtype_policy="cast", group=process_group,
                       extra_keys=(optim_prefix,), key_map=key_map,
                       verify_checksums=_flag("verify_checksums", verify_checksums, "restore", checkpoint,
                                              process_group))
    return RestoreResult(model=plan.model_report, optimizer=plan.optim_report, extra=extra)
