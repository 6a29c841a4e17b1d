"""The read plan: which stored elements go into which local memory, for the model and its optimizer.

`build_plan` computes this rank's layout once (`shards.local_targets`), walks the checkpoint's
structure once, and returns a `ReadPlan`: one `ReadItem` per contiguous run ("read ``dest.numel()``
elements of stored tensor ``key`` from ``src_start`` into ``dest``"), the optimizer state tensors the
items fill (not installed yet), and every problem found (missing, unexpected, shape, dtype...).
Nothing is read and nothing of the model or optimizer is modified here; planning problems are
collected, never raised, so that every rank still reaches the verdict (see verdict.py). The plan is
checked against the model's own storage before any byte is read (`check.validate_plan`), as
``torch.distributed.checkpoint`` validates its global plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from . import key_map as key_maps
from .errors import FsdpRestoreError
from .key_map import KeyMap
from .optim_plan import plan_optimizer
from .read import Checkpoint
from .readplan import OptimizerPlan, ReadItem, ReadPlan, RestoreReport
from .shards import EXTRA_STATE, Target, clean_name, extra_state_modules, local_targets, module_walk
from .stored import (_DDP_PREFIX, Source, default_prefix, optimizer_prefixes, tensor_sources, top_level_subtrees,
                     whole_values)

__all__ = ["OptimizerPlan", "ReadItem", "ReadPlan", "RestoreReport", "Source", "build_plan", "default_prefix",
           "tensor_sources"]


# ---- the plan ------------------------------------------------------------------------------------


def build_plan(model: nn.Module, ckpt: Checkpoint, *, prefix: str | None, strict: bool = True,
               dtype_policy: str = "cast", weights: bool = True, optimizer: torch.optim.Optimizer | None = None,
               optim_prefix: str = "optim", key_map: KeyMap | None = None,
               modules: list[tuple[str, nn.Module]] | None = None) -> ReadPlan:
    """Plan the reads of the model's weights (``weights``) and/or ``optimizer``'s state on this rank.

    ``prefix`` is the subtree holding the weights (None: `default_prefix`). ``key_map``: the
    checkpoint's name of each model name (key_map.py). ``dtype_policy``:
    ``"cast"`` converts a stored dtype to the model's (and reports it), ``"error"`` makes any dtype
    difference a problem. ``modules``: `shards.module_walk`'s list, when the caller has it. Raises only
    for errors that leave nothing to plan (bad arguments, a model on the meta device); everything else lands
    in ``plan.problems``."""
    if dtype_policy not in ("cast", "error"):
        raise ValueError(f"dtype_policy must be 'cast' or 'error', not {dtype_policy!r}")
    prefix = default_prefix(ckpt) if prefix is None else prefix
    plan = ReadPlan()
    # one walk of the module tree for the targets and the extra states
    modules = module_walk(model) if modules is None else modules
    targets, aliases = local_targets(model, modules)
    plan.targets = targets
    on_meta = list(dict.fromkeys(t.name for t in targets for p in t.pieces if p.dest.is_meta))
    if on_meta:
        raise FsdpRestoreError(f"parameters on the meta device ({', '.join(on_meta[:5])}...): materialize the model"
                               " with model.to_empty(device=...) before restoring (then fsdp_restore."
                               "init_non_persistent_buffers(model) for buffers that no checkpoint holds)")
    names = [t.name for t in targets] + list(aliases)
    stored_as, map_problems = key_maps.apply(key_map, names, same=aliases)
    plan.stored_as = stored_as
    for text in map_problems:
        plan.add_problem("key_map", text)
    if weights:
        plan.model_report = RestoreReport(prefix=prefix)
        _plan_weights(plan, targets, aliases, ckpt, prefix, stored_as, strict=strict, dtype_policy=dtype_policy)
        _plan_extra_states(plan, extra_state_modules(model, "set_extra_state", modules), ckpt, prefix, key_map,
                           strict=strict)
        if key_map is not None:
            _judge_key_map(plan, key_map, names, strict=strict)
    if optimizer is not None:
        plan.optim_report = RestoreReport(prefix=optim_prefix, method="optimizer")
        plan.optim = OptimizerPlan(optimizer)
        plan_optimizer(plan, model, targets, aliases, ckpt, optim_prefix, stored_as, strict=strict)
    return plan


def _judge_key_map(plan: ReadPlan, key_map: KeyMap, names: list[str], *, strict: bool) -> None:
    """Where names were not restored (missing, unexpected), what of ``key_map`` may be why: its entries that meet no
    model name (a typo renames nothing) and, with ``strict=False``, the names a dict sent to keys the file does not
    hold.
    Said with the problems under ``strict``; a warning without it (the names are left as built, as asked)."""
    report = plan.model_report
    assert report is not None
    unrestored = ("missing" in plan.problems or "unexpected" in plan.problems) if strict else bool(report.missing)
    if not unrestored:
        return  # every name restored: nothing for the map to explain (and no pass of its patterns over the names)
    unused = key_maps.unused_entries(key_map, names)
    if strict:
        if unused:
            plan.add_problem("key_map", f"its entries {_first(unused, 5)} match no model name, so they rename nothing")
        return
    # (a dict's entries are names one by one; a pattern's or a function's renaming of a name left out on purpose,
    # such as an adapter's under a prefix a LoRA wrapper adds, is not a sign of a typo)
    sent = [f"{name} -> '{plan.stored_as[name]}'" for name in report.missing
            if plan.stored_as.get(name, name) != name] if isinstance(key_map, Mapping) else []
    if not (unused or sent):
        return
    said = ([f"it sent {_first(sent, 5)} to names the file does not hold"] if sent else []) + (
        [f"its entries {_first(unused, 5)} match no model name"] if unused else [])
    plan.warnings.append(f"strict=False left {len(report.missing)} of the model's tensors as built"
                         f" ({', '.join(report.missing[:3])}{', ...' if len(report.missing) > 3 else ''}), and key_map"
                         f" may be why: {'; '.join(said)}")


def _first(items: Sequence[str], n: int) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _plan_extra_states(plan: ReadPlan, modules: dict[str, nn.Module], ckpt: Checkpoint, prefix: str,
                       key_map: KeyMap | None, *, strict: bool) -> None:
    """Each module's extra state, as ``load_state_dict`` treats it: the stored value under ``<module>._extra_state``
    (any value: a tensor, a dict...) goes to the module's ``set_extra_state`` after the reads; missing, it is a
    problem (``strict``) or listed; stored for a module that takes none, it stays among the unexpected names."""
    report = plan.model_report
    assert report is not None
    # values stored as a module's extra state (`load_state_dict` calls one stored for a module that takes none
    # unexpected, by that name: not the names of the tensors within it, and also where it holds none)
    held = whole_values(ckpt, prefix, _is_extra_state) if ckpt.structure_mentions(EXTRA_STATE) else {}
    if held and not prefix:  # weights at the top level: not what lies in another top-level subtree (as the tensors)
        tops = {name.split(".", 1)[0] for name in plan.stored_as.values()}
        held = {name: node for name, node in held.items() if "." not in name or name.split(".", 1)[0] in tops
                or name.removeprefix(_DDP_PREFIX).split(".", 1)[0] in tops}
    if not modules and not held:
        return
    stored_as, map_problems = key_maps.apply(key_map, list(modules))
    for text in map_problems:
        plan.add_problem("key_map", text)
    nodes = whole_values(ckpt, prefix, stored_as.values())
    for name, module in modules.items():
        if name in stored_as and stored_as[name] in nodes:  # (a stored None is a value: set_extra_state(None))
            plan.extra_states.append((name, module, nodes[stored_as[name]]))
        elif name in stored_as and strict:
            plan.add_problem("missing", name)
        elif name in stored_as:
            report.missing.append(name)
    # what lies within a value given to a module is not unexpected; a value no module takes is, by its own name
    taken = {stored_as[name] for name, _, _ in plan.extra_states}
    # (a held name is as stored: DDP's `module.` first, which the modules' own names were matched without)
    untaken = [name for name in held if name not in taken and name.removeprefix(_DDP_PREFIX) not in taken]
    whole = (*taken, *untaken, *(name.removeprefix(_DDP_PREFIX) for name in untaken))
    below = tuple(name + "." for name in whole)
    problems = sorted([n for n in plan.problems.get("unexpected", []) if n not in whole and not n.startswith(below)]
                      + (untaken if strict else []))
    if problems:
        plan.problems["unexpected"] = problems
    else:
        plan.problems.pop("unexpected", None)
    report.unexpected[:] = sorted([n for n in report.unexpected if n not in whole and not n.startswith(below)]
                                  + ([] if strict else untaken))


def _is_extra_state(name: str) -> bool:
    return name == EXTRA_STATE or name.endswith("." + EXTRA_STATE)


def _same_values(ckpt: Checkpoint, a: Source, b: Source) -> bool:
    """Whether two stored tensors (or ranges of them) hold the same bytes: by the crc32 the file records of each
    where both are whole stored tensors, else read and compared in 16 MB steps (a file that holds a tied tensor
    twice without checksums: rare, and only on the way to restoring it)."""
    entry_a, entry_b = ckpt.entries[a.key], ckpt.entries[b.key]
    if entry_a.dtype != entry_b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    crc_a, crc_b = ckpt.checksums.get(a.key), ckpt.checksums.get(b.key)
    if crc_a and crc_b and a.start == b.start == 0 and a.numel == entry_a.numel and b.numel == entry_b.numel:
        return crc_a == crc_b
    step = max(1, (16 << 20) // entry_a.itemsize)
    first_buf, second_buf = (torch.empty(min(step, a.numel), dtype=entry_a.dtype) for _ in range(2))
    for first in range(0, a.numel, step):
        n = min(step, a.numel - first)
        ckpt.read_range(a.key, a.start + first, first_buf[:n])
        ckpt.read_range(b.key, b.start + first, second_buf[:n])
        if not torch.equal(first_buf[:n].view(torch.uint8), second_buf[:n].view(torch.uint8)):
            return False
    return True


def _plan_weights(plan: ReadPlan, targets: Sequence[Target], aliases: dict[str, str], ckpt: Checkpoint, prefix: str,
                  stored_as: dict[str, str], *, strict: bool, dtype_policy: str) -> None:
    report = plan.model_report
    assert report is not None
    sources, unsupported = tensor_sources(ckpt, prefix, [t.name for t in targets])
    if not sources and not unsupported and prefix:
        tops = sorted({key.split(".", 1)[0] for key in ckpt.entries})
        plan.add_problem("error", f"the checkpoint has no tensors under prefix '{prefix}' (its top-level names:"
                                  f" {', '.join(tops[:10])}{', ...' if len(tops) > 10 else ''}); pass the subtree"
                                  " that holds the model, or model_prefix='' (CLI: --model-prefix '') for a plain"
                                  " weights file")
        plan.refused.update(t.name for t in targets)  # one problem, not one more per tensor never planned
        return
    # (the cheap test first: optimizer_prefixes walks the file's top level, a cost per stored tensor)
    if not prefix and not any(stored_as.get(t.name) in sources for t in targets) and "" in optimizer_prefixes(ckpt):
        plan.add_problem("error", f"{ckpt.path} holds an optimizer's state dict (state, param_groups), not a model's"
                                  " weights: restore it into the optimizer (restore_optimizer(optimizer, model, path,"
                                  " optim_prefix='')), and the weights from their own file (check-restore proves"
                                  " a restore of weights)")
        plan.refused.update(t.name for t in targets)  # one problem, not one per name
        return
    tied_names: dict[str, list[str]] = {}
    for alias, name in aliases.items():
        tied_names.setdefault(name, []).append(alias)
    for target in targets:
        if target.unsupported:
            plan.add_problem("unsupported", f"{target.name}: {target.unsupported}")
            plan.refused.add(target.name)
            continue
        if target.name not in stored_as:  # the key map failed for it: reported already
            plan.refused.add(target.name)
            continue
        if stored_as[target.name] in unsupported:
            plan.add_problem("unreadable", f"{target.name}: {unsupported[stored_as[target.name]]}")
            plan.refused.add(target.name)
            continue
        # a tied tensor may be stored under any of its names (save_model keeps only one); names stored apart must
        # hold the same values, or the restore would keep one and lose the others
        tied = tied_names.get(target.name)
        held = [] if tied is None else [(name, found) for name in [target.name, *tied]
                                        if (found := sources.get(stored_as.get(name, ""))) is not None]
        src = sources.get(stored_as[target.name]) if tied is None else held[0][1] if held else None
        for alias, other in held[1:]:
            if (other.key, other.start) != (src.key, src.start) and not _same_values(ckpt, src, other):
                plan.add_problem("tied", f"{held[0][0]} and {alias}: the model ties them (one tensor), but the file"
                                         f" holds different values under them ('{src.key}', '{other.key}'), so the"
                                         " restore would keep one and drop the other; untie them in the model"
                                         " (transformers: tie_word_embeddings=False), or restore a file that holds"
                                         " one value")
                plan.refused.add(target.name)
        if src is None:
            if strict:
                key = stored_as[target.name]
                read_as = [n for n in (clean_name(key), clean_name(key).removeprefix("module.")) if n in sources]
                plan.missing.append(target.name)
                plan.add_problem("missing", target.name if key == target.name else f"{target.name} (as '{key}'" + (
                    f"; the restore reads the file's names without wrappers such as DDP's 'module.' and"
                    f" '_orig_mod.': give key_map '{read_as[0]}')" if read_as and read_as[0] != key else ")"))
                plan.refused.add(target.name)
            else:
                report.missing.append(target.name)
                plan.skipped.add(target.name)
            continue
        if tuple(src.shape) != tuple(target.global_shape):
            plan.add_problem("shape", f"{target.name}: checkpoint {list(src.shape)} vs model {list(target.global_shape)}")
            plan.refused.add(target.name)
            continue
        stored = ckpt.entries[src.key].dtype
        if stored != target.dtype:
            if dtype_policy == "error":
                plan.add_problem("dtype", f"{target.name}: checkpoint {stored} vs model {target.dtype}")
                plan.refused.add(target.name)
                continue
            report.cast.append(f"{target.name}: {stored} -> {target.dtype}")
        report.tensors += 1
        numel = src.numel
        for piece in target.pieces:
            plan.items.append(ReadItem(src.key, src.start + piece.start, piece.dest, target.name, piece.start, numel,
                                       piece.rows, piece.stride))
    if not strict and not report.tensors and report.missing and not plan.problems:
        # strict=False restores a part (a LoRA model from its base's file, adapters from theirs): none of it is a
        # wrong prefix or key_map, or a file of nothing, which restored nothing and said so only in report.missing
        model_names = ", ".join(report.missing[:3]) + (", ..." if len(report.missing) > 3 else "")
        file_names = ", ".join(sorted(sources)[:3]) + (", ..." if len(sources) > 3 else "")
        plan.add_problem("error", (f"none of the model's {len(report.missing)} tensors is in the file under the name"
                                   f" the restore looks for, so strict=False would restore nothing (the model: "
                                   f"{model_names}; the file, under prefix '{prefix}': {file_names}); check"
                                   " model_prefix and key_map (CLI: --model-prefix, --key-map)") if sources else
                         (f"the file holds no tensors under prefix '{prefix}', so strict=False would restore none"
                          f" of the model's {len(report.missing)} ({model_names}); is it the file you meant? Check"
                          " model_prefix (CLI: --model-prefix)"))
        plan.refused.update(report.missing)
        report.missing.clear()
        return
    known = {stored_as.get(n, n) for n in [t.name for t in targets] + list(aliases)}
    unexpected = sorted((set(sources) | set(unsupported)) - known)
    if unexpected and not prefix and not plan.problems.get("missing") and not report.missing:
        # weights at the top level beside other subtrees (torchtitan: optimizer, train_state), every one found: a
        # top-level subtree that holds none of the model's names is not weights, its tensors are not unexpected
        # (with names missing, they are listed: the weights may be in one of them, under another prefix)
        used = {name.split(".", 1)[0] for name in known}
        below = tuple(f"{top}." for top in top_level_subtrees(ckpt) if top not in used)
        unexpected = [name for name in unexpected if not name.startswith(below)] if below else unexpected
    if strict:
        # a stored name the key map sent elsewhere, to a name the file does not hold (a tied tensor's, read under its
        # other name, is not missing, so this is where it shows): said with the name it was sent to
        renamed = {name: key for name, key in stored_as.items() if key != name and key not in sources}
        for name in unexpected:
            key = renamed.get(name)
            if key is None:
                plan.add_problem("unexpected", name)
                continue
            clean = clean_name(key).removeprefix("module.")
            wrapped = (f"; the restore reads the file's names without wrappers such as '_orig_mod.': give key_map"
                       f" '{clean}'" if clean != key and clean in sources else "")
            partner = aliases.get(name) or ", ".join(tied_names.get(name, []))
            tie = f"; the model ties it to {partner}, read from there" if partner else ""
            plan.add_problem("unexpected", f"{name} (key_map reads the model's {name} as '{key}', which the file"
                                           f" does not hold{tie}{wrapped})")
    else:
        report.unexpected.extend(unexpected)
