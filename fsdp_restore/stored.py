"""What a checkpoint holds, decoded once from its stored structure into a typed, read-only view.

The restore's planners never walk the header's JSON by hand: they ask this module where a named tensor's
elements lie (`Source`), which subtree holds the model (`default_prefix`), and what an optimizer state dict
holds (`StoredOptimizer`: its param groups, each with the ids its state is keyed by and, when the saver
recorded them, the parameters' names). The rules that used to live in several places live here once:

- the top level of a training checkpoint holds a ``model`` subtree (only that exact key);
- names as a wrapper saved them are normalized as ``torch.distributed.checkpoint.state_dict`` does:
  ``_orig_mod.`` (torch.compile), ``_checkpoint_wrapped_module.``, ``_fsdp_wrapped_module.`` anywhere, and
  DDP's leading ``module.`` when every stored name has it (and the model's names do not);
- optimizer state comes keyed by torch's integer ids (``Optimizer.state_dict()``), by ids with
  ``param_names`` beside them (optimizers built from ``named_parameters()``), or by names
  (``get_optimizer_state_dict``, FSDP1's full optimizer state dict).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from types import MappingProxyType
from typing import Any, NamedTuple

from .errors import FsdpRestoreError
from .flatten import holds_model_subtree, is_optimizer_state_dict, iter_tensor_nodes, subtree, unflatten
from .read import Checkpoint
from .shards import _join, clean_name

_DDP_PREFIX = "module."
# param-group entries that say which parameters a group holds, not how to optimize them
GROUP_MEMBERSHIP = ("params", "param_names")


class Source(NamedTuple):  # (immutable and cheap to make: a frozen dataclass costs 4x, once per tensor per restore)
    """Where a named tensor's elements start inside a stored tensor (views of a stored buffer too)."""

    key: str
    start: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)


def node_source(ckpt: Checkpoint, node: Mapping[str, Any]) -> Source | None:
    """The `Source` of a tensor node, or None when its values are not one range of stored elements: a
    strided view, or a conj / neg view (its stored memory is not its values; see `unreadable`)."""
    if len(node) == 2:  # a tensor node (`is_tensor_node`, validated) of no other field: a whole stored tensor
        return Source(node["key"], 0, ckpt.entries[node["key"]].shape)
    if node.get("conj") or node.get("neg"):
        return None
    entry = ckpt.entries[node["key"]]
    view = node.get("view")
    if view is None:
        return Source(node["key"], 0, entry.shape)
    shape = tuple(view["shape"])
    contiguous = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        contiguous[d] = contiguous[d + 1] * shape[d + 1]
    if all(s == c for s, c, n in zip(view["stride"], contiguous, shape) if n > 1):
        return Source(node["key"], view["offset"], shape)
    return None


def unreadable(node: Mapping[str, Any]) -> str:
    """Why a tensor node has no `Source`."""
    if node.get("conj") or node.get("neg"):
        return f"a {'conj' if node.get('conj') else 'neg'} view of '{node['key']}': its stored memory is not its values"
    return f"a strided view of '{node['key']}'"


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, Mapping) and node.get("type") == "tensor" and "key" in node


def node_shape(ckpt: Checkpoint, node: Mapping[str, Any]) -> tuple[int, ...]:
    view = node.get("view")
    return tuple(view["shape"]) if view else ckpt.entries[node["key"]].shape


def normalize_names(names: Iterable[str], model_names: Iterable[str] = ()) -> dict[str, str]:
    """``{stored name: normalized name}``: wrapper infixes dropped, and DDP's ``module.`` when every stored
    name starts with it and not every model name does (a model may have a submodule called ``module``)."""
    cleaned = {n: clean_name(n) for n in names}  # first: torch.compile(DDP(m)) saves '_orig_mod.module.x'
    model_names = list(model_names)
    strip = (bool(cleaned) and all(c.startswith(_DDP_PREFIX) for c in cleaned.values())
             and not (model_names and all(n.startswith(_DDP_PREFIX) for n in model_names)))
    return {n: c.removeprefix(_DDP_PREFIX) if strip else c for n, c in cleaned.items()}


def default_prefix(ckpt: Checkpoint) -> str:
    """``"model"`` when the top level holds a ``"model"`` subtree (`flatten.holds_model_subtree`); ``""``
    for plain weight files (Hugging Face files, ``--select`` outputs, a converted
    ``torch.save(model.state_dict())``)."""
    return "model" if ckpt.has_structure and holds_model_subtree(ckpt.structure) else ""


def tensor_sources(ckpt: Checkpoint, prefix: str, model_names: Iterable[str] = ()
                   ) -> tuple[dict[str, Source], dict[str, str]]:
    """``{normalized name: Source}`` for every tensor under dotted ``prefix``, and ``{normalized name: why}`` for
    the names that cannot be range-read: a view whose values are not one range of stored elements, or a name
    that two of the checkpoint's tensors share (a key holding dots beside a nested one, ``{"a.b": x, "a": {"b":
    y}}``, or a wrapper's name beside the plain one): the restore must not pick one of them silently.

    Names that a plain safetensors file dropped as duplicates of a tied tensor
    (``safetensors.torch.save_model`` records ``{dropped: kept}`` in its metadata) resolve to the kept one."""
    found: dict[str, Source] = {}
    unreadable_as: dict[str, str] = {}  # stored name -> why
    other: dict[str, tuple] = {}  # stored name -> what an unreadable node reads (a readable one's: its Source)
    clashes: dict[str, list[tuple]] = {}  # stored name found twice -> what each of them reads
    lead = prefix + "." if prefix else ""

    def reads(name: str) -> tuple:  # two nodes are one tensor only where they read the same elements
        if name in found:
            return found[name].key, found[name].start, found[name].shape
        return other[name]

    for path, node in iter_tensor_nodes(ckpt.structure["root"]):
        if not path.startswith(lead):
            continue
        name = path[len(lead):]
        previous = reads(name) if name in found or name in unreadable_as else None
        src = node_source(ckpt, node)
        if src is None:
            unreadable_as[name] = unreadable(node)
            other[name] = (node["key"], repr(node.get("view")), bool(node.get("conj")), bool(node.get("neg")))
            found.pop(name, None)
        else:
            found[name] = src
            unreadable_as.pop(name, None)
        if previous is not None:
            clashes.setdefault(name, [previous]).append(reads(name))
    if not ckpt.has_structure:
        for dropped, kept in ckpt.tied_aliases().items():
            name, kept_name = dropped[len(lead):], kept[len(lead):]
            if dropped.startswith(lead) and kept.startswith(lead) and kept_name in found:
                found.setdefault(name, found[kept_name])
    normal = normalize_names([*found, *unreadable_as], model_names)
    problems = {normal[n]: why for n, why in unreadable_as.items()}
    clashing = {name: [n] for n, name in normal.items() if n in clashes}
    if len(set(normal.values())) < len(normal):  # names that normalize alike ('_orig_mod.a' and 'a'): rare
        by_normal: dict[str, list[str]] = {}
        for stored, name in normal.items():
            by_normal.setdefault(name, []).append(stored)
        clashing.update({name: stored for name, stored in by_normal.items() if len(stored) > 1})
    for name, stored in clashing.items():
        held = {r for n in stored for r in clashes.get(n, [reads(n)])}
        if len(held) > 1:  # (one tensor under two names of a tied pair is not a clash)
            names = f" (as {', '.join(repr(n) for n in stored)})" if len(stored) > 1 else ""
            keys = sorted({str(r[0]) for r in held})
            problems[name] = (f"{len(held)} of the checkpoint's tensors have this name{names}, stored as"
                              f" {', '.join(repr(k) for k in keys)}")
    return {normal[n]: src for n, src in found.items() if normal[n] not in problems}, problems


# ---- optimizer state ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredGroup:
    """One saved param group: ``ids`` keys its parameters' state (torch's integer ids as text, or names),
    ``names`` the parameters' normalized names when the saver recorded them (``param_names``, or the ids
    themselves when they are names), else None; ``hyper`` its hyperparameters (lr, betas, ...)."""

    ids: tuple[str, ...]
    names: tuple[str, ...] | None
    hyper: Mapping[str, Any]


@dataclass(frozen=True)
class StoredOptimizer:
    """A saved optimizer state dict: its groups in order, and ``state[id][field]`` structure nodes."""

    groups: tuple[StoredGroup, ...]
    state: Mapping[str, Mapping[str, Any]]

    def renamed(self, rename: Callable[[str], str]) -> StoredOptimizer:
        """The same state with every recorded parameter name passed through ``rename`` (e.g. a key map)."""
        groups = tuple(StoredGroup(g.ids, None if g.names is None else tuple(map(rename, g.names)), g.hyper)
                       for g in self.groups)
        return StoredOptimizer(groups, self.state)


_MAPPING_KINDS = ("dict", "OrderedDict", "Namespace")  # structure nodes whose items are [key, value] pairs


def _items(node: Any) -> list[tuple[Any, Any]]:
    """A mapping node's (key, value) pairs; none for any other node (a list's items are values, not pairs)."""
    if not isinstance(node, Mapping) or node.get("type") not in _MAPPING_KINDS:
        return []
    return [(k, v) for k, v in node.get("items", [])]


def _child(node: Any, name: str, prefix: str, ckpt: Checkpoint) -> Any:
    items = _items(node)
    for k, v in items:
        if k == name:
            return v
    where = f"'{prefix}' in the checkpoint" if prefix else "the checkpoint's top level"
    held = ", ".join(repr(k) for k, _ in items[:5]) + (", ..." if len(items) > 5 else "") or "no named entries"
    found = [p for p in optimizer_prefixes(ckpt) if p != prefix]
    fix = (f"it holds one under {' and '.join(repr(p) for p in found)}: pass optim_prefix={found[0]!r}" if found else
           "pass the file that holds the optimizer's state (a weights file holds none), or optim_prefix= the key that"
           " holds it")
    raise FsdpRestoreError(f"{where} is not an optimizer state dict (no '{name}'; it holds {held}): {fix}")


def default_optim_prefix(ckpt: Checkpoint) -> str:
    """Where a restore looks for the optimizer's state when not told (``optim_prefix=None``): the one optimizer state
    dict the checkpoint holds, wherever it is (``optimizer`` in nanoGPT's, the root of a Hugging Face Trainer's
    ``optimizer.pt``); else ``optim``, where our conversions and saves put it (and where none or several are held,
    the error names them)."""
    found = optimizer_prefixes(ckpt)
    return found[0] if len(found) == 1 else "optim"


def optimizer_prefixes(ckpt: Checkpoint) -> list[str]:
    """Where the checkpoint holds an optimizer state dict (a node with ``state`` and ``param_groups``): its root
    (a file of ``torch.save(opt.state_dict())``), a top-level entry (``optimizer`` in nanoGPT's checkpoints) or an
    entry of one (PyTorch Lightning's ``optimizer_states.0``)."""
    root = ckpt.structure["root"]
    candidates = [("", root)] + [(str(k), v) for k, v in _items(root)]
    for top, node in candidates[1:]:
        kind = node.get("type") if isinstance(node, Mapping) else None
        if kind in ("list", "tuple"):
            candidates += [(f"{top}.{i}", v) for i, v in enumerate(node.get("items", []))]
        elif kind in _MAPPING_KINDS and not _is_optimizer(node, top):
            candidates += [(f"{top}.{k}", v) for k, v in _items(node)
                           if isinstance(v, Mapping) and v.get("type") in _MAPPING_KINDS]
    return [prefix for prefix, node in candidates if _is_optimizer(node, prefix)]


def _is_optimizer(node: Any, prefix: str) -> bool:
    """An optimizer's state dict: ``state`` beside ``param_groups``, a list of groups with ``params`` (a config that
    has keys of those names is not one), or a flattened one."""
    return is_optimizer_state_dict(node) or (isinstance(node, dict) and bool(prefix) and _flattened(node))


def top_level_subtrees(ckpt: Checkpoint) -> list[str]:
    """The top-level entries that are containers (a dict, a list...), not tensors: where the weights lie at the top
    level under their own dotted names (torchtitan, a Hugging Face file), the rest of a checkpoint (``optimizer``,
    ``train_state``)."""
    return [str(k) for k, v in _items(ckpt.structure["root"]) if isinstance(v, Mapping)
            and v.get("type") in (*_MAPPING_KINDS, "list", "tuple")]


_FLAT_STATE, _FLAT_GROUPS = "state.", "param_groups."


def _flattened(node: Any) -> bool:
    """Whether ``node`` is an optimizer state dict as ``get_optimizer_state_dict(..., StateDictOptions(
    flatten_optimizer_state_dict=True))`` gives it (torchtitan's and OLMo-core's checkpoints): ``state.<name>.<field>``
    and ``param_groups.<name>.<option>`` keys, one per parameter, no groups."""
    keys = [k for k, _ in _items(node)]
    return (bool(keys) and all(isinstance(k, str) and k.startswith((_FLAT_STATE, _FLAT_GROUPS)) for k in keys)
            and any(k.startswith(_FLAT_GROUPS) for k in keys))


def _split_flat(key: str, lead: str) -> tuple[str, str]:
    """``("<name>", "<field>")`` of a flattened key: fields and options hold no dots (exp_avg, lr, betas)."""
    name, _, field = key[len(lead):].rpartition(".")
    return name, field


def _stored_flattened(ckpt: Checkpoint, node: Any, prefix: str, model_names: Iterable[str],
                      live_names: Sequence[Sequence[str]] | None) -> StoredOptimizer:
    """A flattened optimizer state dict (`_flattened`) grouped as ``live_names`` (the optimizer's groups, by model
    name) groups the parameters, as ``set_optimizer_state_dict`` regroups it: each group's options are those saved
    for its first parameter the file holds. Saved parameters that no group holds join the last group, where the
    matching names them (``strict``) or leaves them unrestored (a pipeline stage's optimizer)."""
    options: dict[str, dict[str, Any]] = {}
    for key, child in _items(node):  # options first: their names have no dots, and every parameter has some
        if key.startswith(_FLAT_GROUPS):
            name, field = _split_flat(key, _FLAT_GROUPS)
            if not name or not field:
                raise FsdpRestoreError(f"'{_join(prefix, key)}' in the checkpoint is not param_groups."
                                       "<parameter>.<option>")
            options.setdefault(name, {})[field] = child
    paths: dict[str, dict[tuple[str, ...], Any]] = {}
    for key, child in _items(node):  # a state value may nest (Shampoo's pre.L): the longest parameter name first
        if key.startswith(_FLAT_STATE):
            rest = key[len(_FLAT_STATE):]
            name = max((n for n in options if rest.startswith(n + ".")), key=len, default=None)
            name = name if name is not None else _split_flat(key, _FLAT_STATE)[0]
            path = tuple(rest[len(name) + 1:].split("."))
            if not name or not all(path):
                raise FsdpRestoreError(f"'{_join(prefix, key)}' in the checkpoint is not state.<parameter>.<field>")
            paths.setdefault(name, {})[path] = child
    state = {name: _nested_fields(fields) for name, fields in paths.items()}
    stored = list(dict.fromkeys([*options, *state]))
    normal = normalize_names(stored, model_names)
    by_normal = {normal[n]: n for n in stored}
    lazy = ckpt.tensors(exact=True)  # small values (lr as a tensor, betas): no mmap readahead
    groups: list[StoredGroup] = []
    taken: set[str] = set()
    for names in live_names or []:
        held = [by_normal[n] for n in names if n in by_normal]
        taken.update(held)
        first = next((n for n in held if n in options), None)
        hyper = {} if first is None else unflatten(lazy, {"version": 1, "root": {
            "type": "dict", "items": [[k, v] for k, v in options[first].items() if k not in GROUP_MEMBERSHIP]}})
        groups.append(StoredGroup(tuple(held), tuple(normal[n] for n in held), MappingProxyType(hyper)))
    rest = [n for n in stored if n not in taken]
    if rest and groups:  # in the last group: its parameters "only in the checkpoint", as the matching says of them
        last = groups[-1]
        groups[-1] = StoredGroup(last.ids + tuple(rest), (last.names or ()) + tuple(normal[n] for n in rest), last.hyper)
    elif rest:
        groups.append(StoredGroup(tuple(rest), tuple(normal[n] for n in rest), MappingProxyType({})))
    return StoredOptimizer(tuple(groups), MappingProxyType({n: MappingProxyType(f) for n, f in state.items()}))


def _nested_fields(paths: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """``{field: node}`` from ``{(field, inner, ...): node}``, in first-seen order: a longer path's nodes go into a
    dict node of the structure under its field (which the state's reader takes as it takes any value)."""
    fields: dict[str, Any] = {}
    inner: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, child in paths.items():
        if len(path) == 1:
            fields[path[0]] = child
        else:
            fields.setdefault(path[0], None)
            inner.setdefault(path[0], {})[path[1:]] = child
    for field, below in inner.items():
        fields[field] = {"type": "dict", "items": [[k, v] for k, v in _nested_fields(below).items()]}
    return fields


def key_text(key: Any) -> str:
    """A state dict key as text: integer ids and names alike (JSON-encoded keys carry their value)."""
    return str(key) if not isinstance(key, Mapping) else str(key.get("value"))


def stored_optimizer(ckpt: Checkpoint, prefix: str, model_names: Iterable[str] = (),
                     live_names: Sequence[Sequence[str]] | None = None) -> StoredOptimizer:
    """Decode the optimizer state dict under ``prefix``; raises FsdpRestoreError when there is none. A flattened
    one (`_flattened`), which holds no groups, is grouped as ``live_names`` (the optimizer's groups' model names)."""
    try:
        node = subtree(ckpt.structure, prefix)
    except KeyError:
        found = optimizer_prefixes(ckpt)
        where = (f": it holds one under {' and '.join(repr(p) for p in found)}, pass optim_prefix={found[0]!r}"
                 if found else " (pass optim_prefix=..., the subtree that holds 'state' and 'param_groups')")
        raise FsdpRestoreError(f"the checkpoint has no optimizer state under '{prefix}'{where}") from None
    if _flattened(node):
        return _stored_flattened(ckpt, node, prefix, model_names, live_names)
    lazy = ckpt.tensors(exact=True)  # small values (group tensors such as lr): no mmap readahead
    groups = unflatten(lazy, {"version": 1, "root": _child(node, "param_groups", prefix, ckpt)})
    state_node = _child(node, "state", prefix, ckpt)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise FsdpRestoreError(f"'{prefix}.param_groups' in the checkpoint is not a list of param groups with 'params'")
    recorded = [str(n) for g in groups for n in (g.get("param_names") or [])]
    recorded += [p for g in groups for p in g["params"] if isinstance(p, str)]
    normal = normalize_names(recorded, model_names)
    out = []
    for g in groups:
        ids = tuple(key_text(p) for p in g["params"])
        if g.get("param_names") is not None:
            names: tuple[str, ...] | None = tuple(normal[str(n)] for n in g["param_names"])
        elif g["params"] and all(isinstance(p, str) for p in g["params"]):
            names = tuple(normal[p] for p in g["params"])
        else:
            names = None
        hyper = MappingProxyType({k: v for k, v in g.items() if k not in GROUP_MEMBERSHIP})
        out.append(StoredGroup(ids, names, hyper))
    state = {key_text(k): MappingProxyType({str(f): v for f, v in _items(s)}) for k, s in _items(state_node)}
    return StoredOptimizer(tuple(out), MappingProxyType(state))


def whole_values(ckpt: Checkpoint, prefix: str, names: Iterable[str] | Callable[[str], bool]) -> dict[str, Any]:
    """``{name: node}`` for each of ``names`` (or each name ``names(name)`` is true of) that the checkpoint holds
    under dotted ``prefix`` as one value of any kind (a tensor, a dict of them, a string: a module's extra state),
    its stored name normalized as `tensor_sources` normalizes them (a wrapper's parts, DDP's ``module.``); the first
    where two normalize alike. `value` reads one."""
    listed = None if callable(names) else set(names)
    wanted = names if listed is None else listed.__contains__
    found: dict[str, Any] = {}
    lead = prefix + "." if prefix else ""

    def walk(node: Any, path: str) -> None:
        if path.startswith(lead) and path != prefix:
            name = clean_name(path[len(lead):])
            for candidate in (name, name.removeprefix(_DDP_PREFIX)):
                if wanted(candidate):
                    found.setdefault(candidate, node)
                    return
        if not isinstance(node, Mapping):
            return
        kind = node.get("type")
        if kind in ("dict", "OrderedDict", "Namespace"):
            children = [(k if isinstance(k, str) else str(k) if isinstance(k, int) else None, v)
                        for k, v in node["items"]]
        elif kind in ("list", "tuple"):
            children = [(str(i), v) for i, v in enumerate(node["items"])]
        else:
            return
        for part, child in children:
            below = f"{path}.{part}" if path else part if part is not None else None
            if below is not None and (below.startswith(lead) or lead.startswith(below + ".")):  # on the way to prefix
                walk(child, below)

    if listed is None or listed:
        walk(ckpt.structure["root"], "")
    return found


def value(ckpt: Checkpoint, node: Any) -> Any:
    """The object a node of the checkpoint's structure stands for, its tensors read with exact positional reads."""
    return unflatten(ckpt.tensors(exact=True), {"version": 1, "root": node})


def extras(ckpt: Checkpoint, skip: Iterable[str], *, tensors: bool = True) -> dict[str, Any]:
    """Every top-level entry but ``skip`` (the model and optimizer subtrees) as ordinary objects: the step,
    scheduler, RNG states and config a restore hands back; tensors read with exact positional reads.
    ``tensors=False``: no entry that is a tensor, nor a module's extra state (weights stored at the top level, beside
    the rest). An optimizer state dict is never among them: unrestored, it is not read (unsharded on every rank, it
    can be several times the model)."""
    root = ckpt.structure["root"]
    if not (isinstance(root, dict) and root.get("type") in ("dict", "OrderedDict")):
        return {}
    skip = set(skip) | set(optimizer_prefixes(ckpt))
    kept = {"type": "dict", "items": [[k, v] for k, v in root["items"] if k not in skip and (
        tensors or not (is_tensor_node(v) or str(k).rsplit(".", 1)[-1] == "_extra_state"))]}
    nested = tuple(s for s in skip if "." in s)  # a subtree within an entry (Lightning's state_dict.model)
    return value(ckpt, _without(kept, "", nested) if nested else kept)


def _without(node: Any, path: str, skip: tuple[str, ...]) -> Any:
    """``node`` (at dotted ``path``) without what lies under the dotted paths ``skip``, a container that only
    held such things left out too (the weights and optimizer state restored from within an entry: not read)."""
    kind = node.get("type") if isinstance(node, Mapping) else None
    if kind not in (*_MAPPING_KINDS, "list", "tuple"):
        return node
    pairs = node.get("items", []) if kind in _MAPPING_KINDS else list(enumerate(node.get("items", [])))
    items = []
    for k, child in pairs:
        at = f"{path}.{k}" if path else str(k)
        if at in skip or at.startswith(tuple(s + "." for s in skip)):
            if kind not in _MAPPING_KINDS:
                items.append(None)  # in a list, its place kept: the items after it keep their indices
            continue
        if any(s.startswith(at + ".") for s in skip):
            pruned = _without(child, at, skip)
            if isinstance(pruned, Mapping) and pruned.get("type") in (*_MAPPING_KINDS, "list", "tuple") and all(
                    item is None for item in pruned.get("items") or ()) and child.get("items"):
                continue  # it held nothing else
            child = pruned
        items.append([k, child] if kind in _MAPPING_KINDS else child)
    return {**node, "items": items}
