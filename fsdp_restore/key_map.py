"""Restore under other names: ``key_map`` sends a model's tensor name to the checkpoint's.

A key map renames, nothing else: the bytes restored are the bytes stored under the mapped name. A
checkpoint whose tensors must be *transformed* to fit the model (q, k and v fused into one tensor,
rotary-embedding row permutations, transposes) cannot be restored by a rename; where the shapes differ
the restore refuses it, and where they agree (a permutation) only the caller can know.

Accepted forms (``KeyMap`` below), all taking a model name (clean, as ``model.state_dict()`` of the
unwrapped model names it) and giving the checkpoint's name:

- a callable ``name -> checkpoint name``;
- a dict ``{model name: checkpoint name}``; names it does not list keep their own name;
- a list of ``(regex, replacement)`` pairs, as ``re.sub`` takes them: the first pattern that matches
  the name rewrites it (as Hugging Face's ``key_mapping``); a name no pattern matches keeps its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
KeyMap = Callable[[str], str] | Mapping[str, str] | Sequence[tuple[str, str]]


def as_function(key_map: KeyMap | None) -> Callable[[str], object] | None:
    """The map as a function (None for no map). Raises ValueError for a malformed map (a bad regex)."""
    if key_map is None:
        return None
    if callable(key_map):
        return key_map
    if isinstance(key_map, Mapping):
        table = dict(key_map)
        return lambda name: table.get(name, name)
    if isinstance(key_map, (str, bytes)) or not isinstance(key_map, Iterable):
        raise ValueError(f"key_map must be a mapping, a function or (regex, replacement) pairs, not"
                         f" {type(key_map).__name__} {key_map!r}"[:300])
    pairs = []
    for pair in key_map:
        # (any sequence of two strings: a tuple, a list, an omegaconf ListConfig from the shipped YAML maps)
        if not (isinstance(pair, Sequence) and not isinstance(pair, (str, bytes)) and len(pair) == 2
                and all(isinstance(p, str) for p in pair)):
            raise ValueError(f"key_map: {pair!r} is not a (regex, replacement) pair of strings")
        try:
            pairs.append((re.compile(pair[0]), pair[1]))
        except re.error as e:
            raise ValueError(f"key_map: bad regex '{pair[0]}' (entry {len(pairs) + 1}): {e}") from None

    def rewrite(name: str) -> str:
        for pattern, replacement in pairs:
            new, count = pattern.subn(replacement, name)
            if count:
                return new
        return name

    return rewrite


def unused_entries(key_map: KeyMap | None, names: Iterable[str]) -> list[str]:
    """The entries of a dict or (regex, replacement) map that no name of ``names`` meets (a dict's key that is no
    such name, a pattern that matches none), as they are written: a typo in a map restores nothing under it, and
    with ``strict=False`` says so nowhere else. A function's cannot be told."""
    if key_map is None or callable(key_map):
        return []
    names = list(names)
    if isinstance(key_map, Mapping):
        present = set(names)
        return [f"'{k}'" for k in key_map if k not in present]
    return [f"'{pattern}'" for pattern, _ in key_map  # (checked already by `as_function`)
            if not any(re.search(pattern, name) for name in names)]


def apply(key_map: KeyMap | None, names: Iterable[str], *, same: Mapping[str, str] | None = None
          ) -> tuple[dict[str, str], list[str]]:
    """``{model name: checkpoint name}`` for ``names``, and the problems of the map: a name sent to
    nothing (not a non-empty string), two names sent to one key. ``same`` maps tied names to their
    canonical name: tied names may share a key."""
    fn = as_function(key_map)
    names = list(names)
    if fn is None:
        return {n: n for n in names}, []
    out: dict[str, str] = {}
    problems: list[str] = []
    owners: dict[str, str] = {}
    same = same or {}
    for name in names:
        try:
            key = fn(name)
        except Exception as e:  # noqa: BLE001 - the user's function: reported with the name it failed on
            problems.append(f"{name}: key_map raised {type(e).__name__}: {e}")
            continue
        if isinstance(key, (list, tuple)):
            problems.append(f"{name}: key_map gives several names ({key!r}); it must give one (a str): a rename"
                            " cannot fuse several stored tensors into one parameter")
            continue
        if not isinstance(key, str) or not key:
            problems.append(f"{name}: key_map sends it to nothing ({key!r})")
            continue
        out[name] = key
        owner = owners.setdefault(key, name)
        if owner != name and same.get(owner, owner) != same.get(name, name):
            problems.append(f"{owner} and {name}: key_map sends both to '{key}'")
    return out, problems


def parse_spec(spec: str) -> KeyMap:
    """A key map given on the command line: a JSON or YAML file holding a list of ``[regex, replacement]``
    pairs or a ``{model name: checkpoint name}`` mapping, or ``module:attribute`` naming any `KeyMap`."""
    import os

    if os.path.isfile(spec):
        from omegaconf import OmegaConf

        try:
            value = OmegaConf.to_container(OmegaConf.load(spec))
        except Exception as e:  # noqa: BLE001 - a parse error of the user's file, named with the file
            raise ValueError(f"--key-map {spec}: not a JSON/YAML file ({e})") from None
        if isinstance(value, list):
            pairs = [tuple(p) if isinstance(p, list) else p for p in value]
            try:
                as_function(pairs)  # a bad regex fails here, naming it
            except ValueError as e:
                raise ValueError(f"--key-map {spec}: {e}") from None
            return pairs
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        raise ValueError(f"--key-map {spec}: expected a list of [regex, replacement] pairs or a mapping")
    module, sep, attr = spec.rpartition(":")
    if not sep:
        raise ValueError(f"--key-map: no file {spec}, and not module:attribute")
    import importlib
    import sys

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value = getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, or what the user's module raised at import
        raise ValueError(f"--key-map {spec}: {type(e).__name__}: {e}") from None
    as_function(value)  # validate here, not on every rank
    return value
