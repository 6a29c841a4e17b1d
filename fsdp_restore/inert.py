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

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar


class InertObject:
    """An object of a global that was not loaded: built from anything, running nothing. It keeps what the pickle
    gave it (arguments, state, items), only so that `inert_within` also finds the stand-ins nested in those."""

    global_name: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:  # (the pickle's NEWOBJ passes its arguments here)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.given: list[Any] = [args, kwargs]

    def __setstate__(self, state: Any) -> None:
        self.__dict__.setdefault("given", []).append(state)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("given", []).append((key, value))

    def append(self, item: Any) -> None:
        self.__dict__.setdefault("given", []).append(item)

    def extend(self, items: Any) -> None:
        self.__dict__.setdefault("given", []).extend(items)

    def __repr__(self) -> str:
        return f"<{self.global_name}: not loaded>"


def inert_aliases(names: Iterable[str]) -> list[tuple[type, str]]:
    """``(stand-in class, "module.Name")`` for each of ``names``, as ``torch.serialization.safe_globals`` takes an
    alias: the unpickler resolves that name to the stand-in."""
    return [(type(f"Inert[{name}]", (InertObject,), {"global_name": name, "__module__": __name__}), name)
            for name in names]


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


def inert_within(obj: Any) -> list[str]:
    """The names of the globals whose stand-ins (objects, or the stand-in class itself as a value) are within
    ``obj``, sorted; empty where none is."""
    found = set()
    for node in _nodes(obj):
        if isinstance(node, InertObject):
            found.add(node.global_name)
        elif isinstance(node, type) and issubclass(node, InertObject):
            found.add(node.global_name)
    return sorted(found)


def holds_tensor(obj: Any) -> bool:
    """Whether any torch tensor is within ``obj`` (a part of a file worth selecting)."""
    import torch

    return any(isinstance(node, torch.Tensor) for node in _nodes(obj))
