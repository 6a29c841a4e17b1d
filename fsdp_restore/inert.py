"""Inert stand-ins for the globals a ``torch.save`` pickle names outside the allowlist, for when only a part of the
file is wanted (``select``): torch's own weights-only unpickler builds the file with each such global aliased to a
class of its own that runs nothing, and the part is taken only where none of them is inside it.

Why: a training run's checkpoint often holds, beside its weights, a config or a framework's object (a dataclass of
the script's ``__main__``, an omegaconf ``DictConfig``, a Lightning ``AttributeDict``) that the weights-only
unpickler refuses. Converting or verifying the weights alone should need neither the code that defined those nor
trust in the file. A stand-in keeps its global's name, takes whatever the pickle gives it (arguments, state, items)
and calls nothing, so the pickle may name any function or class without any of it being imported or run. What the
allowed globals build is what torch.load builds; what is built of stand-ins is never handed on (`inert_within`
finds any inside the part asked for, and the caller refuses it as before)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar


class InertObject:
    """An object of a global that was not loaded: built from anything, running nothing. It keeps what the pickle
    gave it (arguments, state), only so that `inert_within` also finds the stand-ins nested in those. (Items are
    never given to it: torch's unpickler fills dicts and lists only, so a dict or list subclass's stand-in is one
    of those, `inert_aliases`.)"""

    global_name: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:  # (the pickle's NEWOBJ passes its arguments here)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.given: list[Any] = [args, kwargs]

    def __setstate__(self, state: Any) -> None:
        self.__dict__.setdefault("given", []).append(state)

    def __repr__(self) -> str:
        return f"<{self.global_name}: not loaded>"


# a legacy pickle's refused globals are found one load at a time: one naming more than this many is not loaded so
MAX_LOADS = 64
# torch's weights-only unpickler's refusal of a global it does not allow
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def refused_in(text: str) -> list[str]:
    """The globals torch's weights-only unpickler says in ``text`` that it refused, as "module.Name" (it writes a
    builtin without its module: ``list`` is ``builtins.list``)."""
    return [name if "." in name else f"builtins.{name}" for name in _REFUSED_GLOBAL.findall(text)]


# torch's weights-only unpickler's refusal to fill an object other than a dict or a list, naming a stand-in's class
_FILLED = re.compile(r"Can only (SETITEMS?|append|extend)\b[^<]*"
                     r"but got <class 'fsdp_restore\.inert\.(\S+) \(not loaded\)'>")


def inert_aliases(names: Iterable[str], kinds: Mapping[str, str] | None = None) -> list[tuple[type, str]]:
    """``(stand-in class, "module.Name")`` for each of ``names``, as ``torch.serialization.safe_globals`` takes an
    alias: the unpickler resolves that name to the stand-in. ``kinds``: ``{name: "mapping" | "sequence"}`` for the
    globals whose objects the pickle fills as a dict or a list (a dict or list subclass, ``defaultdict``): torch's
    unpickler fills nothing else, so their stand-ins are plain dicts or lists, each kept in its class's ``made``
    (`inert_within` finds them there)."""
    aliases = []
    for name in names:
        kind = (kinds or {}).get(name)
        body: dict[str, Any] = {"global_name": name, "__module__": __name__, "__qualname__": f"{name} (not loaded)"}
        if kind in ("mapping", "sequence"):
            made: list[Any] = []

            def __new__(cls: type, *args: Any, _made: list[Any] = made, _kind: str | None = kind,
                        **kwargs: Any) -> Any:
                _made.append({} if _kind == "mapping" else [])  # (not an instance of cls: no __init__ is run)
                return _made[-1]

            body.update(made=made, __new__=__new__)
        aliases.append((type(f"{name} (not loaded)", (InertObject,), body), name))
    return aliases


def load_with_stand_ins(load: Callable[[list[tuple[type, str]]], Any], names: Sequence[str]
                        ) -> tuple[Any, list[tuple[type, str]]]:
    """``load(aliases)`` with a stand-in for each of ``names`` (`inert_aliases`), and the aliases. Where torch's
    unpickler refuses another global (a legacy file's pickle is not scanned for them beforehand: each refusal names
    the next one, in the error's ``names`` or torch's own words), it gets a stand-in too; where it refuses to fill a
    stand-in as a dict or a list (the global is a dict or list subclass), that one becomes a dict or a list; and the
    load runs again. Any other failure is raised as it is."""
    names, kinds = list(names), {}
    for _ in range(MAX_LOADS):
        aliases = inert_aliases(names, kinds)
        try:
            return load(aliases), aliases
        except Exception as e:
            text = str(e)
            more = [n for n in getattr(e, "names", None) or refused_in(text) if n not in names]
            found = _FILLED.search(text)
            if more:
                names += more
            elif found is not None and found.group(2) not in kinds:
                kinds[found.group(2)] = "mapping" if found.group(1).startswith("SETITEM") else "sequence"
            else:
                raise
    raise ValueError(f"refused again after {MAX_LOADS} loads, each with more stand-ins: {', '.join(names[:8])} ...")


def _nodes(obj: Any) -> Iterator[Any]:
    """Every value within ``obj``: through dicts (keys and values), lists, tuples, sets, an object's attributes
    (argparse.Namespace) and numpy object arrays; each container once."""
    stack, seen = [obj], set()
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (dict, list, tuple, set, frozenset)) or hasattr(node, "__dict__") or _object_array(node):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, dict):
                stack.extend(node.keys())
                stack.extend(node.values())
            elif isinstance(node, (list, tuple, set, frozenset)):
                stack.extend(node)
            elif _object_array(node):
                stack.extend(node.flat)
            elif not isinstance(node, type) and type(node).__module__.split(".")[0] != "torch":
                stack.extend(vars(node).values())


def _object_array(node: Any) -> bool:
    return type(node).__name__ == "ndarray" and getattr(getattr(node, "dtype", None), "hasobject", False)


def made_by(aliases: Sequence[tuple[type, str]]) -> dict[int, str]:
    """``{id: global name}`` of the dicts and lists the ``aliases`` of the mapping and sequence kinds made."""
    return {id(o): cls.global_name  # type: ignore[attr-defined]
            for cls, _ in aliases for o in getattr(cls, "made", ())}


def stand_in_name(node: Any, made: Mapping[int, str]) -> str | None:
    """The global whose stand-in ``node`` is (an object, a dict or list of ``made``, `made_by`, or a stand-in class
    itself as a value); None for anything else."""
    if id(node) in made:
        return made[id(node)]
    if isinstance(node, InertObject) or (isinstance(node, type) and issubclass(node, InertObject)):
        return node.global_name
    return None


def inert_within(obj: Any, aliases: Sequence[tuple[type, str]] = ()) -> list[str]:
    """The names of the globals whose stand-ins (`stand_in_name`, for ``aliases``) are within ``obj``, sorted;
    empty where none is."""
    made = made_by(aliases)
    return sorted({name for node in _nodes(obj) if (name := stand_in_name(node, made)) is not None})


def holds_tensor(obj: Any) -> bool:
    """Whether any torch tensor is within ``obj`` (a part of a file worth selecting)."""
    import torch

    return any(isinstance(node, torch.Tensor) for node in _nodes(obj))
