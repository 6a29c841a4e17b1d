"""What this rank holds of each model tensor, as flat pieces of the global (unsharded) tensor.

A `Target` is one state-dict entry (parameter or persistent buffer) under its clean name (no
``_fsdp_wrapped_module.`` / ``module.`` / ``_orig_mod.``), and ``pieces`` are contiguous 1-D views
into this rank's memory, each paired with the flat element index in the global tensor where it
starts. Restoring is then "read these element ranges into these views", whatever the wrapper:

- FSDP1 (`FullyShardedDataParallel`): the local shard of each `FlatParameter`; ``_shard_param_infos``
  says which slice of which original parameter lies where (padding belongs to no piece).
- FSDP2 (`fully_shard`) and any DTensor: the local block from the mesh and placements; a Shard(0)
  block is one range, other placements (Shard(1), tensor parallel row/column splits) are rows of equal
  length at a fixed stride: one `Piece` for all of them, not one per row.
- Plain modules, DDP, buffers: the whole tensor, one piece.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product
from math import prod
from types import FunctionType

import torch
from torch import nn
from torch.nn.modules.module import _WrappedHook

_WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


@dataclass(slots=True)
class Piece:
    """A contiguous 1-D view ``dest`` in this rank's memory holding ``rows`` runs of equal length: run ``i``
    is the global flat elements ``[start + i * stride, start + i * stride + run)``. One run (``rows == 1``)
    is a plain range; several describe a column block (``Shard(1)``) without one object per row."""

    dest: torch.Tensor
    start: int
    rows: int = 1
    stride: int = 0  # global flat elements from one run's start to the next's


@dataclass(slots=True)  # (one per tensor per restore and save: slots make and read them faster)
class Target:
    name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "param" | "buffer"
    pieces: list[Piece] = field(default_factory=list)
    layout: str = "full"  # "full" | "fsdp1" | "dtensor"
    unsupported: str = ""  # why this layout cannot be restored from a file (no pieces then)

    @property
    def local_numel(self) -> int:
        return sum(p.dest.numel() for p in self.pieces)


def clean_name(name: str) -> str:
    """Strip wrapper prefixes so names match an unwrapped model's ``state_dict`` keys: whole components named as
    a wrapper's child (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``, ``_orig_mod``), wherever they are
    (an FSDP1 unit inside an activation-checkpoint wrapper ends with one); never a part of another name."""
    if "_fsdp_wrapped_module" not in name and "_checkpoint_wrapped_module" not in name and "_orig_mod" not in name:
        return name.rstrip(".")  # most names: called per tensor, several times per restore
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES).rstrip(".")


def ddp_prefix(model: nn.Module) -> str:
    """What DDP puts before every name of ``model``'s (``module.``), with the ``_orig_mod.`` of any
    ``torch.compile`` wrapped around the DDP (``torch.compile(DDP(m))``: ``_orig_mod.module.``); ``""`` when no
    DDP is at the top. Removed before `clean_name`, so names match the unwrapped model's ``state_dict``."""
    lead = ""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        lead, model = lead + "_orig_mod.", model._orig_mod
    return lead + "module." if isinstance(model, nn.parallel.DistributedDataParallel) else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


@functools.cache
def _dtensor_class() -> type | tuple[()]:
    """DTensor, imported once (an import statement per tensor showed in the plan's profile); ``()`` (which
    nothing is an instance of) in a torch without distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return ()
    return DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, _dtensor_class())


def module_walk(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules(remove_duplicate=False)``, walked once for a caller that needs the model's FSDP1
    units, parameters and buffers (`named_parameters_of`): each of those is otherwise a walk of its own, a
    cost per module in every restore's plan (BENCHMARKS.md)."""
    return list(model.named_modules(remove_duplicate=False))


def named_parameters_of(modules: list[tuple[str, nn.Module]]) -> Iterator[tuple[str, nn.Parameter]]:
    """What ``model.named_parameters(remove_duplicate=False)`` yields, from `module_walk`'s list."""
    for prefix, module in modules:
        for name, param in module._parameters.items():
            if param is not None:
                yield (f"{prefix}.{name}" if prefix else name), param


def _fsdp1_units(model: nn.Module | None, modules: list[tuple[str, nn.Module]] | None = None):
    """(clean prefix, FlatParamHandle) for every FSDP1 unit that owns parameters (``modules``: `module_walk`'s
    list, when the caller has it; then ``model`` is not needed)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return
    seen: set[int] = set()  # a module reachable under two names: its first, as named_modules() gives it
    for name, module in model.named_modules() if modules is None else modules:
        handle = getattr(module, "_handle", None) if isinstance(module, FSDP) else None
        if handle is not None and id(module) not in seen:
            seen.add(id(module))
            yield clean_name(name), handle


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """The state-dict names (clean, tied names included) of the parameters that do not require grad: what torch's
    ``get_model_state_dict(..., ignore_frozen_params=True)`` leaves out. An FSDP1 flat parameter holds originals
    of one ``requires_grad`` (FSDP1 refuses others without ``use_orig_params``, which registers the originals on
    their modules, each with its own): the flat parameter's, for each of them."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    top = ddp_prefix(model)
    flat_frozen: dict[int, list[str]] = {}  # id(original module) -> its frozen parameter names held by a flat param
    for _, handle in _fsdp1_units(model):
        flat = handle.flat_param
        if not flat.requires_grad:
            for info in [*flat._param_infos, *flat._shared_param_infos]:
                flat_frozen.setdefault(id(info.module), []).append(info.param_name)
    frozen: set[str] = set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module._parameters.items():
            if p is not None and not isinstance(p, FlatParameter) and not p.requires_grad:
                frozen.add(clean_name(_join(mod_name, p_name).removeprefix(top)))
        for p_name in flat_frozen.get(id(module), ()):
            frozen.add(clean_name(_join(mod_name, p_name).removeprefix(top)))
    return frozen


def local_targets(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None
                  ) -> tuple[list[Target], dict[str, str]]:
    """This rank's `Target` for every parameter and persistent buffer, plus ``{alias: name}`` for
    tied parameters (an alias needs no reading of its own). ``modules``: `module_walk`'s list, when the caller
    has it."""
    targets: list[Target] = []
    aliases: dict[str, str] = {}
    done: set[str] = set()
    top = ddp_prefix(model)

    def clean(name: str) -> str:
        return clean_name(name.removeprefix(top))

    managed: dict[int, str] = {}  # FSDP1 original parameters (use_orig_params=True views) -> their name
    fsdp1 = False  # FlatParameter's isinstance is a Python metaclass hook: skipped where no FSDP1 unit exists
    modules = module_walk(model) if modules is None else modules
    for prefix, handle in _fsdp1_units(model, modules):
        fsdp1 = True
        flat = handle.flat_param
        for fqn, param in zip(flat._fqns, getattr(flat, "_params", None) or []):
            managed[id(param)] = _join(prefix, clean(fqn))
        for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
            target = Target(_join(prefix, clean(fqn)), tuple(shape), flat.dtype, "param", layout="fsdp1")
            if info.in_shard and info.numel_in_shard:
                view = flat.data[info.offset_in_shard: info.offset_in_shard + info.numel_in_shard]
                target.pieces.append(Piece(view, info.intra_param_start_idx))
            targets.append(target)
            done.add(target.name)
        for shared in flat._shared_param_infos:
            alias = _join(prefix, clean(_join(shared.module_name, shared.param_name)))
            aliases[alias] = _join(prefix, clean(_join(shared.prim_module_name, shared.prim_param_name)))
            done.add(alias)

    from torch.distributed.fsdp._flat_param import FlatParameter

    seen: dict[int, str] = {}
    dtensor = _dtensor_class()  # (`_tensor_target`'s test, once: the parameters are mostly DTensors or none are)
    for raw_name, param in named_parameters_of(modules):
        name = clean(raw_name)
        if (fsdp1 and isinstance(param, FlatParameter)) or name in done:
            continue
        if id(param) in managed:  # a tied view of a parameter another FSDP1 unit owns
            aliases[name] = managed[id(param)]
            continue
        if id(param) in seen:
            aliases[name] = seen[id(param)]
            continue
        seen[id(param)] = name
        targets.append(_dtensor_target(name, param, "param") if isinstance(param, dtensor)
                       else _tensor_target(name, param, "param"))
    for mod_name, module in modules:
        for buf_name, buf in module._buffers.items():
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            name = clean(_join(mod_name, buf_name))
            if name in done:
                continue
            if id(buf) in seen:
                if seen[id(buf)] != name:
                    aliases.setdefault(name, seen[id(buf)])
                continue
            seen[id(buf)] = name
            targets.append(_tensor_target(name, buf, "buffer"))
            done.add(name)
    return targets, aliases


def state_dict_code(modules: list[tuple[str, nn.Module]], *, loading: bool) -> list[str]:
    """Modules whose state dict (``loading``: whose ``load_state_dict``) runs code of their own that may rename or
    transform what they hold, one "name (why)" each: the save writes, and the restore fills, the parameters and
    buffers as they are held, past that code. Saving: a class overriding ``state_dict`` or ``_save_to_state_dict``
    (quantized and packed layers; a metric adding its states), or a state-dict hook from outside torch, unless
    the module's own ``state_dict(keep_vars=True)`` gives exactly its parameters and buffers (`_passes_through`).
    Loading: a class overriding ``load_state_dict`` or ``_load_from_state_dict``, or a load hook from outside torch.
    torch's own hooks (FSDP's, the activation-checkpoint wrapper's) keep names and values, and so do torch.nn's
    overrides of ``_load_from_state_dict`` (BatchNorm and InstanceNorm: for old checkpoints lacking an entry)."""
    offenders = []
    # under FSDP1 a wrapped module's own state_dict() shows none of the parameters its unit flattened away, so it
    # cannot show that it passes through: asked of no module of such a model
    may_pass = not loading and next(_fsdp1_units(None, modules), None) is None
    for name, module in modules:
        why = None
        overridden = _overridden(type(module), loading)
        if overridden:
            why = f"{type(module).__name__} overrides {overridden}"
        else:
            pre, post = ((module._load_state_dict_pre_hooks, module._load_state_dict_post_hooks) if loading
                         else (module._state_dict_pre_hooks, module._state_dict_hooks))
            if not (pre or post):  # most modules
                continue
            foreign = [h for hooks in (pre, post) for h in hooks.values() if not _from_torch(h)]
            if foreign:
                why = f"a {'load_' if loading else ''}state_dict hook of {_hook_module(foreign[0])}"
        if why and not (may_pass and _passes_through(module)):
            offenders.append(f"{clean_name(name) or '<root>'} ({why})")
    return offenders


def _passes_through(module: nn.Module) -> bool:
    """Whether ``module.state_dict(keep_vars=True)`` is exactly its parameters and persistent buffers, the same
    tensor objects under their own names (a metric whose states are not persistent): asked of the module's own
    code, so only of a module holding no sharded tensor (a sharded model's state dict is FSDP's to give) in a model
    without FSDP1 units (the caller's test)."""
    own: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind, tensors in (("p", sub._parameters), ("b", sub._buffers)):
            for key, t in tensors.items():
                if t is None or (kind == "b" and key in sub._non_persistent_buffers_set):
                    continue
                if _is_dtensor(t):
                    return False
                own.setdefault(_join(prefix, key), t)
    try:
        given = module.state_dict(keep_vars=True)
    except Exception:  # noqa: BLE001 - its code failed: not shown to pass through
        return False
    return given.keys() == own.keys() and all(given[k] is own[k] for k in own)


@functools.cache  # per class: a model repeats a few classes thousands of times
def _overridden(cls: type, loading: bool) -> str | None:
    """The first of the state-dict methods ``cls`` overrides that `state_dict_code` refuses; None if none."""
    methods = ("load_state_dict", "_load_from_state_dict") if loading else ("state_dict", "_save_to_state_dict")
    for method in methods:
        code = getattr(cls, method)
        if code is not getattr(nn.Module, method) and not (loading and _hook_module(code).startswith("torch.nn.")):
            return method
    return None


def _from_torch(hook: object) -> bool:
    """Whether a hook's code is torch's own (FSDP2 puts two on every module it shards: a plain function's module is
    read without `_hook_module`'s unwrapping, a cost per hook of every restore)."""
    module = (hook.__module__ if type(hook) is FunctionType else None) or _hook_module(hook)
    return module == "torch" or module.startswith("torch.")


def _hook_module(hook: object) -> str:
    """The module that defined a hook's code (through partials, bound methods and torch's hook wrapper)."""
    while True:
        if isinstance(hook, functools.partial):
            hook = hook.func
        elif isinstance(hook, _WrappedHook):  # torch's wrapper of a load pre-hook
            hook = hook.hook
        else:
            break
    hook = getattr(hook, "__func__", hook)  # a bound method
    return getattr(hook, "__module__", None) or type(hook).__module__


EXTRA_STATE = "_extra_state"  # the state-dict entry of a module's own state beside its tensors (nn.Module)


def extra_state_modules(model: nn.Module, method: str,
                        modules: list[tuple[str, nn.Module]] | None = None) -> dict[str, nn.Module]:
    """``{clean name of the entry: module}`` for every module whose class overrides ``nn.Module``'s ``method``
    (``"get_extra_state"``: the entries ``state_dict()`` holds; ``"set_extra_state"``: those ``load_state_dict``
    gives to the module, or says missing), in ``state_dict()`` order; a module reached under two names has an entry
    under each, as in ``state_dict()``.
    Such state (TransformerEngine's FP8 scaling, a module's own counters) is neither parameter nor buffer.
    ``modules``: `module_walk`'s list, when the caller has it."""
    base = getattr(nn.Module, method)
    top = ddp_prefix(model)
    out: dict[str, nn.Module] = {}
    for name, module in module_walk(model) if modules is None else modules:
        if getattr(type(module), method, base) is not base:
            out.setdefault(clean_name(_join(name, EXTRA_STATE).removeprefix(top)), module)
    return out


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The memory this rank holds of ``tensor``: a DTensor's local shard (the attribute, not ``to_local()``:
    that is an autograd Function call, thousands of times per restore), else its data."""
    if isinstance(tensor, _dtensor_class()):
        return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor.to_local()
    return tensor.data


def _tensor_target(name: str, tensor: torch.Tensor, kind: str) -> Target:
    if _is_dtensor(tensor):
        return _dtensor_target(name, tensor, kind)
    data = tensor.data
    target = Target(name, tuple(tensor.shape), tensor.dtype, kind)
    if data.numel():
        if not data.is_contiguous():
            layout = " (channels_last)" if data.dim() == 4 and data.is_contiguous(
                memory_format=torch.channels_last) else " (channels_last_3d)" if data.dim() == 5 and \
                data.is_contiguous(memory_format=torch.channels_last_3d) else ""
            fix = (" Restore or save while the model's tensors are contiguous: model.to(memory_format=torch."
                   "channels_last) after the restore, model.to(memory_format=torch.contiguous_format) before a save"
                   if layout else f" Make it contiguous first (the {kind}'s .data = .data.contiguous())")
            raise ValueError(
                f"{name}: a {kind} laid out with strides {tuple(data.stride())}{layout} is not supported: the restore"
                f" and the save move a tensor's row-major bytes straight between the file and its memory.{fix}")
        target.pieces.append(Piece(data.view(-1), 0))
    return target


@dataclass(frozen=True)
class RowBlock:
    """``rows`` runs of ``run`` elements, the first at global flat element ``start``, ``stride`` apart."""

    start: int
    rows: int
    stride: int


@functools.lru_cache(maxsize=4096)
def _block_runs(global_shape: tuple[int, ...], mesh: object, placements: tuple) -> tuple[tuple[int, ...], list[RowBlock], int]:
    """(local shape, row blocks, run length) of this rank's block of a DTensor layout, in local memory order.
    Cached: a model's layers share a handful of shapes and layouts, and torch's layout arithmetic costs
    tens of microseconds per call (thousands of parameters per restore)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(local_shape), *block_rows(tuple(global_shape), tuple(local_shape), tuple(offset))


_LAYOUTS: dict[tuple[tuple[int, ...], int, int], tuple[object, tuple, tuple]] = {}


def _layout(global_shape: tuple[int, ...], mesh: object, placements: tuple
            ) -> tuple[bool, tuple[int, ...], list[RowBlock], int]:
    """(whether a placement is Partial, then `_block_runs`'s answer) for a DTensor layout. FSDP2 and tensor
    parallel give every parameter of a layout the same mesh and placements objects: they are looked up by
    identity (checked, and held while cached so that no other object takes their id), as hashing placements
    calls Python per placement for every parameter of every restore; `_block_runs` answers for equal ones."""
    key = (global_shape, id(mesh), id(placements))
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is mesh and hit[1] is placements:
        return hit[2]
    if len(_LAYOUTS) >= 4096:
        _LAYOUTS.clear()
    partial = any(p.is_partial() for p in placements)
    answer = (True, (), [], 0) if partial else (False, *_block_runs(global_shape, mesh, placements))
    _LAYOUTS[key] = (mesh, placements, answer)
    return answer


def block_rows(global_shape: tuple[int, ...], local_shape: tuple[int, ...],
               offset: tuple[int, ...]) -> tuple[list[RowBlock], int]:
    """The block ``local_shape`` at ``offset`` of a row-major ``global_shape`` tensor as row blocks and a
    run length. k is the last dim where the block is partial (runs span it and the whole dims after it);
    m the last partial dim before k: every dim between m and k is whole, so the rows inside one index of
    the dims before m lie at one stride, and there is one `RowBlock` per index of the dims before m (one
    in all for 2-D tensors and any layout that splits at most two dims)."""
    ndim = len(global_shape)
    if ndim == 0:
        return [RowBlock(0, 1, 0)], 1
    strides = [prod(global_shape[d + 1:]) for d in range(ndim)]
    partial = [d for d in range(ndim) if local_shape[d] != global_shape[d]]
    k = partial[-1] if partial else 0
    run = prod(local_shape[k:])
    if k == 0 or run == 0:
        return [RowBlock(offset[0] * strides[0] if ndim else 0, 1, 0)], run
    before = [d for d in partial if d < k]
    m = before[-1] if before else 0
    rows = prod(local_shape[m:k])
    tail = offset[m] * strides[m] + offset[k] * strides[k]
    outer = [range(offset[d], offset[d] + local_shape[d]) for d in range(m)]
    blocks = [RowBlock(sum(j * strides[d] for d, j in enumerate(idx)) + tail, rows, strides[k - 1])
              for idx in product(*outer)]
    return blocks, run


def _dtensor_target(name: str, dt: torch.Tensor, kind: str) -> Target:
    # The spec's fields, not the DTensor's properties: each property is a Python call on a tensor subclass,
    # and this runs once per parameter on every restore.
    spec = dt._spec
    placements = spec.placements
    local = dt._local_tensor
    # the DTensor's own shape, not its spec's: `.data =` of another shape changes the first alone (torch 2.13),
    # and the local shard's check below then refuses the stale spec instead of restoring into it
    global_shape = tuple(dt.shape)
    partial, local_shape, blocks, run = _layout(global_shape, spec.mesh, placements)
    if partial:
        return Target(name, global_shape, dt.dtype, kind, layout="dtensor", unsupported=(
            f"a Partial placement ({placements}) holds addends of a pending reduction, and a stored value"
            " cannot be split into addends exactly; restore into the model before it is parallelized this way,"
            " or with Replicate/Shard placements"))
    target = Target(name, global_shape, local.dtype, kind, layout="dtensor")
    if 0 in global_shape:  # no element to read or write, whatever shape its shard has (FSDP2 makes a Shard(1) of a
        return target      # (0, n) tensor (0, 0), where the layout says (0, n / ranks))
    if local.shape != local_shape:
        raise ValueError(f"{name}: local shard shape {tuple(local.shape)} differs from the layout's {local_shape}")
    n_local = local.numel()
    if n_local == 0:
        return target
    if not local.is_contiguous():
        raise ValueError(f"{name}: non-contiguous local shard is not supported")
    if local.requires_grad:  # (FSDP2's and tensor parallel's local shards do not: no detach, a torch call, then)
        local = local.detach()
    # the local tensor itself where it is already flat (a bias, a norm): a view is a torch call
    flat_local = local if local.dim() == 1 else local.view(-1)
    if len(blocks) == 1:  # most layouts: the whole local block, no slice
        block = blocks[0]
        target.pieces.append(Piece(flat_local, block.start, block.rows, block.stride if block.rows > 1 else 0))
        return target
    at = 0
    for block in blocks:
        n = block.rows * run
        target.pieces.append(Piece(flat_local[at:at + n], block.start, block.rows, block.stride if block.rows > 1 else 0))
        at += n
    return target
