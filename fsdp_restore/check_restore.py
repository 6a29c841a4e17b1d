"""``fsdp-restore check-restore``: prove that a checkpoint restores into *your* sharded model.

Spawns N local ranks, builds the model with the user's factory (``module:function`` or
``path/to/file.py:function``), shards it with FSDP2 (on the meta device, then ``to_empty``) or FSDP1,
restores with the NaN-fill check, then gathers every parameter's full value through FSDP itself and
compares it bit for bit with the stored tensor read by safetensors' own reader (an oracle that shares nothing
with the restore's plan or reader). The verdict is the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Group
from rich.table import Table
from torch import nn

from .errors import RestoreError, flag_argument
from .launch import RankFailure, pick_backend, run_ranks
from .key_map import KeyMap, as_function, parse_spec
from .read import Checkpoint
from .buffers import init_non_persistent_buffers
from .restore import default_prefix, restore_model
from .verdict import agree, new_problems


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """Import ``module:function`` (module on sys.path or the current directory) or ``file.py:function``."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like module:function or path/to/file.py:function, not '{spec}'")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ValueError(f"--model: no file {module_name}")
        loader_spec = importlib.util.spec_from_file_location(f"_fsdp_restore_user_{abs(hash(module_name))}", module_name)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: its error, named, is the message
            raise ValueError(f"--model: running {module_name} failed: {type(e).__name__}: {e}") from None
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - ImportError, or whatever the user's module raised at import
            raise ValueError(f"--model: cannot import {module_name}: {type(e).__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model: {module_name} has no function {attr}")

    def build() -> nn.Module:
        model = factory()
        if not isinstance(model, nn.Module):  # else an AttributeError deep in the sharding, naming nothing of theirs
            raise TypeError(f"--model: {spec} returned {type(model).__name__}, not a torch.nn.Module: the function"
                            " must build the model and return it")
        return model

    return build


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to wrap separately: members of every ModuleList."""
    return [m for mod in model.modules() if isinstance(mod, nn.ModuleList) for m in mod]


def shard_model(factory: Callable[[], nn.Module], fsdp: str, device: torch.device) -> nn.Module:
    if fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = factory()
        for block in _blocks(model):
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device=device)
        init_non_persistent_buffers(model)  # no checkpoint holds them; the restore's check verifies them
        return model
    if fsdp == "fsdp1":
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        model = factory()
        # Wrap exactly the blocks (as for FSDP2), not every module of their types: a tied head that is
        # an nn.Linear must stay in the root unit with its embedding.
        block_ids = {id(b) for b in _blocks(model)}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in block_ids)
        return FSDP(model, device_id=device, use_orig_params=True, auto_wrap_policy=policy if block_ids else None)
    raise ValueError(f"--fsdp must be fsdp2 or fsdp1, not '{fsdp}'")


class _StoredValues(Mapping[str, torch.Tensor]):
    """The stored weights by name, each read when the comparison asks for it by safetensors' own reader
    (``safe_open(...).get_tensor``), never through this package's index or reads: only the names come from the
    file's structure (or are its keys). A name stored as a view of another tensor (rare) is read through `load`."""

    def __init__(self, files: dict[str, str], keys: dict[str, str], viewed: Callable[[str], torch.Tensor],
                 views: dict[str, str]) -> None:
        from safetensors import safe_open

        self._keys, self._viewed, self._views = keys, viewed, views
        # every file opened, and every key found in it, now (headers only): a file safetensors cannot read, or a key
        # it does not hold there, fails here, in the step every rank agrees on, not in the middle of the gathers
        self._handles = {file: safe_open(file, framework="pt") for file in sorted(set(files.values()))}
        self._handle_of = {key: self._handles[file] for key, file in files.items()}
        for file, handle in self._handles.items():
            absent = {key for key, f in files.items() if f == file} - set(handle.keys())
            if absent:
                raise ValueError(f"safetensors does not find {', '.join(sorted(absent)[:5])} in {file}")

    def __contains__(self, name: object) -> bool:  # (Mapping's own would read the tensor to answer)
        return name in self._keys or name in self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._views:
            return self._viewed(self._views[name])
        key = self._keys[name]
        return self._handle_of[key].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._keys, *self._views])

    def __len__(self) -> int:
        return len(self._keys) + len(self._views)


def _expected_tensors(path: str, prefix: str) -> Mapping[str, torch.Tensor]:
    """The stored weights by name (`_StoredValues`: read by safetensors itself, not through the restore's plan or
    reader); names a save_model file dropped as tied resolve to the kept one."""
    from .flatten import iter_tensor_nodes

    lead = prefix + "." if prefix else ""
    keys: dict[str, str] = {}
    views: set[str] = set()  # names stored as views of another tensor: read through `load`
    with Checkpoint(path) as ckpt:
        if ckpt.has_structure:
            holds_prefix = not prefix
            for at, node in iter_tensor_nodes(ckpt.structure["root"]):
                if at.startswith(lead):
                    holds_prefix = True
                    name = at[len(lead):]
                    if node.get("view") is None and not node.get("conj") and not node.get("neg"):
                        keys[name] = node["key"]
                    else:
                        views.add(name)
            if not holds_prefix:
                raise ValueError(f"the checkpoint has no '{prefix}' subtree of tensors")
        else:
            keys = {key[len(lead):]: key for key in ckpt.entries if key.startswith(lead)}
        for dropped, kept in ckpt.tied_aliases().items():
            if dropped.startswith(lead) and kept.startswith(lead) and kept[len(lead):] in keys:
                keys.setdefault(dropped[len(lead):], keys[kept[len(lead):]])
        # which file of a set (or the .safetensors beside a .pt) holds each key, as the checkpoint was resolved; the
        # bytes, and where they lie in that file, are safetensors' to find
        files = {key: str(ckpt.entries[key].file) for key in keys.values()}
    loaded: list[Any] = []

    def viewed(name: str) -> torch.Tensor:
        from . import load

        if not loaded:  # every tensor of the loaded object by its dotted path, as the structure names them
            loaded.append(dict(_tensors_by_path(load(path))))
        return loaded[0][lead + name]

    names = {**_unwrapped_names({n: n for n in [*keys, *views]}), **{n: n for n in [*keys, *views]}}  # a name as
    # stored wins (a model whose own child is called `module`)
    return _StoredValues(files, {alias: keys[n] for alias, n in names.items() if n in keys}, viewed,
                         {alias: n for alias, n in names.items() if n in views})


def _tensors_by_path(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted path, tensor)`` of every tensor in a loaded object (nested dicts, Namespaces, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, argparse.Namespace):  # the structure walks a Namespace's attributes as a dict's items
        yield from _tensors_by_path(vars(obj), path)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, (str, int)):
                yield from _tensors_by_path(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors_by_path(value, f"{path}.{i}" if path else str(i))


_WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _unwrapped_names(state: dict[str, Any]) -> dict[str, Any]:
    """The names a plain model has for a state dict saved from a wrapped one: the wrapper infixes of FSDP1,
    activation checkpointing and ``torch.compile`` (a whole model's, or each block's) dropped wherever they
    stand, and DDP's ``module.`` taken off by torch's own `consume_prefix_in_state_dict_if_present` where every
    name has it. Written here, apart from the restore's own renaming, so that the comparison does not take the
    restore's word for which name is which."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    def unwrapped(key: Any) -> Any:
        if not isinstance(key, str):
            return key
        for infix in _WRAPPER_INFIXES:
            key = key.replace(infix, "")
        return key

    state = {unwrapped(k): v for k, v in state.items()}
    if state and all(isinstance(k, str) and k.startswith("module.") for k in state):
        consume_prefix_in_state_dict_if_present(state, "module.")
    return state


def _full_values(model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(names, full value) of every parameter and persistent buffer, one tensor (FSDP2) or one FSDP1
    unit at a time, gathered by FSDP itself (``full_tensor``, ``summon_full_params``): collective, so
    every rank walks the same order."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from .shards import _fsdp1_units, _join, clean_name

    done: set[int] = set()
    for unit_prefix, handle in _fsdp1_units(model):
        flat = handle.flat_param
        unit = next(m for m in model.modules() if isinstance(m, FSDP) and getattr(m, "_handle", None) is handle)
        # a tied parameter's names together (its first owner's, then each sharer's), as for FSDP2 below: a file may
        # hold it under one of them only (transformers' save_pretrained stores a tied head under the embedding's)
        names = [[_join(unit_prefix, clean_name(fqn))] for fqn in flat._fqns]
        owner = {(id(info.module), info.param_name): i for i, info in enumerate(flat._param_infos)}
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            alone = []
            for shared in flat._shared_param_infos:
                name = _join(unit_prefix, clean_name(_join(shared.module_name, shared.param_name)))
                i = owner.get((id(shared.prim_module), shared.prim_param_name))
                if i is None:
                    alone.append(([name], getattr(shared.module, shared.param_name).detach()))
                else:
                    names[i].append(name)
            for info, group in zip(flat._param_infos, names):
                yield group, getattr(info.module, info.param_name).detach()
            yield from alone
        done.add(id(flat))
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for raw, param in model.named_parameters(remove_duplicate=False):
        if id(param) in done or type(param).__name__ == "FlatParameter" or "_fsdp_wrapped_module" in raw:
            continue
        names_of.setdefault(id(param), []).append(clean_name(raw))
        tensors[id(param)] = param
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, buf in module._buffers.items():
            if buf is not None and attr not in module._non_persistent_buffers_set:
                names_of.setdefault(id(buf), []).append(clean_name(_join(mod_name, attr)))
                tensors[id(buf)] = buf
    for key, t in tensors.items():
        yield names_of[key], (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def compare_with_file(model: nn.Module, expected: Mapping[str, torch.Tensor], key_map: KeyMap | None = None
                      ) -> tuple[int, list[str], list[str]]:
    """Every parameter's and buffer's full value, gathered by FSDP, against ``expected`` (the stored
    tensors read by safetensors itself, under the checkpoint's names; ``key_map`` gives a model name's): an oracle
    that shares nothing with the restore's plan. Returns (tensors compared, names that differ, names the
    file does not hold under any name the comparison knows); each rank compares its share of the tensors.
    A strict restore restored every one of them, so a name not found is a failure, never a skip: a
    comparison of nothing must not pass."""
    import torch.distributed as dist

    rename = as_function(key_map) or (lambda name: name)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    compared, bad, not_found = 0, [], []
    for i, (names, full) in enumerate(_full_values(model)):
        if i % world != rank:
            continue
        try:  # a read that fails is this tensor's failure, never this rank's leaving the gathers
            stored = next((expected[k] for k in map(rename, names) if k in expected), None)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{names[0]} (reading the file's value failed: {type(e).__name__}: {e})")
            continue
        if stored is None:
            not_found.append(names[0])
            continue
        compared += 1
        got = full.cpu().contiguous()
        want = stored.to(got.dtype).contiguous()
        if got.shape != want.shape or not torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
            bad.append(names[0])
    return compared, bad, not_found


def _worker(rank: int, world_size: int, path: str, factory_spec: str, fsdp: str, model_prefix: str | None,
            key_map_spec: str | None = None, strict: bool = True) -> dict[str, Any]:
    """One rank: build and shard, restore, compare; each phase ends in a verdict that every rank
    shares, so a failure on one rank (a factory that raises) stops all of them at once."""
    import torch.distributed as dist

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    try:
        problems = new_problems()
        with problems.guard():
            model = shard_model(load_factory(factory_spec), fsdp, device)
            key_map = parse_spec(key_map_spec) if key_map_spec else None
            with Checkpoint(path) as ckpt:
                model_prefix = default_prefix(ckpt) if model_prefix is None else model_prefix
        agree(problems, "check-restore: building the model")
        report = restore_model(model, path, model_prefix=model_prefix, check=True, key_map=key_map, strict=strict)
        problems = new_problems()
        with problems.guard():
            expected = _expected_tensors(path, model_prefix or "")
        agree(problems, "check-restore: reading the file for the comparison")
        compared, mismatches, not_found = compare_with_file(model, expected, key_map)  # collectives: FSDP's gathers
        # strict=False: what the restore said the file lacks is left as the factory built it, not compared; a name
        # the comparison did not find and the restore did not call missing is still a failure
        said_missing = set(report.missing)
        left = [name for name in not_found if name in said_missing]
        not_found = [name for name in not_found if name not in said_missing]
        return {"tensors": report.tensors, "elements": report.elements, "bytes_read": report.bytes_read,
                "seconds": report.seconds, "compared": compared, "mismatches": mismatches, "not_found": not_found,
                "left_as_built": left, "unexpected": report.unexpected,
                "nan_in_checkpoint": report.nan_in_checkpoint, "error": None}
    except RestoreError as e:
        return {"error": str(e)}


@dataclass
class CheckRestoreReport:
    path: str
    nproc: int
    fsdp: str
    backend: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    strict: bool = True
    # strict=False: the model's tensors the file does not hold (left as the factory built them, not compared), and
    # the file's tensors the model has no place for
    left_as_built: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> Group:
        table = Table(title=f"check-restore {self.path}: {self.nproc} ranks, {self.fsdp}, {self.backend}")
        for col in ("rank", "tensors", "elements", "bytes read", "seconds", "tensors compared", "verdict"):
            table.add_column(col, justify="right")
        for rank, r in enumerate(self.ranks):
            if r.get("error"):
                table.add_row(str(rank), "", "", "", "", "", "[red]error[/]")
                continue
            proven = not r["mismatches"] and not r["not_found"]
            table.add_row(str(rank), str(r["tensors"]), str(r["elements"]), f"{r['bytes_read'] / 1e6:.2f} MB",
                          f"{r['seconds']:.2f}", str(r["compared"]), "[green]OK[/]" if proven else "[red]FAIL[/]")
        lines = [f"[red]FAIL[/] {p}" for p in self.problems]
        if not lines and self.strict:
            lines = ["[green]restore check passed[/]: every element restored (NaN-fill check) and equal to the file"]
        elif not lines:
            lines = ["[green]restore check passed[/]: every element of the tensors the file holds restored (NaN-fill"
                     " check) and equal to the file"]
        if not self.strict:  # what --no-strict let through, said in full: it is the user's to judge
            if self.left_as_built:
                lines.append(f"not in the file, left as the model was built ({len(self.left_as_built)}): "
                             + _listed(self.left_as_built))
            if self.unexpected:
                lines.append(f"in the file, not in the model ({len(self.unexpected)}): " + _listed(self.unexpected))
        return Group(table, *lines)


def _listed(names: list[str], most: int = 20) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def run_check_restore(path: str, factory: str, *, nproc: int = 2, fsdp: str = "fsdp2",
                      model_prefix: str | None = None, key_map: str | None = None, timeout: float = 600,
                      strict: bool = True) -> CheckRestoreReport:
    """Run the check on ``nproc`` local ranks; never raises for a failed check (see ``report.ok``).
    ``key_map``: a file or ``module:attribute`` (`fsdp_restore.key_map.parse_spec`). ``strict=False``: restore
    what the file holds of the model (a LoRA adapter's file, a partial checkpoint) and compare that; the rest is
    listed (``report.left_as_built``, ``report.unexpected``), not failed."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:  # 0 ranks would check nothing and "pass"
        raise ValueError(f"nproc must be a whole number >= 1 (the local ranks to restore on), not {nproc!r}")
    flag_argument("strict", strict)
    Checkpoint(path).close()  # a bad file fails here with a FormatError, before spawning anything
    load_factory(factory)  # likewise an import error in the factory
    if key_map:
        parse_spec(key_map)  # and a malformed key map
    backend = pick_backend(nproc)
    report = CheckRestoreReport(path=str(path), nproc=nproc, fsdp=fsdp, backend=backend, strict=strict)
    try:
        report.ranks = run_ranks(_worker, nproc, str(path), factory, fsdp, model_prefix, key_map, strict,
                                 timeout=timeout, backend=backend)
    except RankFailure as e:
        report.problems = [f"rank {r}: {msg.splitlines()[0]}" for r, msg in sorted(e.errors.items())]
        return report
    errors = {r.get("error") for r in report.ranks if r.get("error")}
    report.problems.extend(sorted(errors))
    mismatched = sorted({m for r in report.ranks for m in r.get("mismatches", [])})
    if mismatched:
        report.problems.append(f"restored values differ from the file: {', '.join(mismatched)}")
    report.left_as_built = sorted({m for r in report.ranks for m in r.get("left_as_built", [])})
    report.unexpected = sorted({m for r in report.ranks for m in r.get("unexpected", [])})
    if not strict and not any(r.get("compared") for r in report.ranks) and not errors:
        report.problems.append("the file holds none of the model's tensors under the names the restore looks for:"
                               " nothing was restored or compared (check --model-prefix and --key-map)")
    not_found = sorted({m for r in report.ranks for m in r.get("not_found", [])})
    if not_found:
        report.problems.append(f"the comparison found no tensor in the file for {', '.join(not_found[:20])}"
                               f"{f' and {len(not_found) - 20} more' if len(not_found) > 20 else ''}, which the"
                               " restore said it restored: nothing was proven for them (the names in the file differ"
                               " from the model's in a way only the restore's renaming knows; report it)")
    return report
