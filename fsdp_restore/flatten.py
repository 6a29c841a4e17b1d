"""Map any nested checkpoint object to ``(Dict[str, Tensor], structure)`` and back, exactly.

The structure is plain JSON (no pickle): every node is either a JSON scalar that stands for itself
(``null``, ``true``/``false``, an integer within int64, a string) or an object with a ``"type"``
tag. Tensor nodes name their key in the flat dict; keys are readable dotted paths
(``model.layers.0.attn.weight``, ``optim.state.3.exp_avg``). See FORMAT.md for the full grammar.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import struct
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from . import format as formats
from .errors import FormatError, UnsupportedObjectError, on_unsupported_argument
from .format import torch_dtype_name
from .plain_pt import StoredTensor

if TYPE_CHECKING:  # imported where used: a plain checkpoint (plain_pt) is flattened without either
    import numpy as np
    import torch

STRUCTURE_VERSION = 1
_INT64 = (-(2**63), 2**63 - 1)
_PATH_TYPES = {cls.__name__: cls for cls in (pathlib.PosixPath, pathlib.WindowsPath,
                                             pathlib.PurePosixPath, pathlib.PureWindowsPath)}

Structure = dict[str, Any]


@dataclass
class _TensorRef:
    """A tensor seen during flattening, with its path."""

    tensor: torch.Tensor
    path: str
    node: dict[str, Any]
    identity: int | None = None  # an ndarray's id(): the same array object twice is stored once


def flatten(obj: Any, *, on_unsupported: Literal["error", "skip"] = "error") -> tuple[dict[str, torch.Tensor], Structure]:
    """Split ``obj`` into a flat ``{key: tensor}`` dict and a JSON-serialisable structure.

    Tensors that are identical aliases (same storage, offset, shape, stride and dtype, e.g. tied
    weights) are stored once; a tensor that is a view into another stored tensor is recorded as a
    view of it. ``on_unsupported="skip"`` replaces unsupported values with ``None`` and warns with
    their paths instead of raising `UnsupportedObjectError`.
    """
    on_unsupported_argument(on_unsupported)  # (any other value read as "error")
    flattener = _Flattener(on_unsupported)
    root = flattener.encode(obj, "")
    tensors = flattener.assign_storage()
    if flattener.skipped:
        warnings.warn("skipped unsupported values (restored as None): " + ", ".join(flattener.skipped),
                      stacklevel=2)
    return tensors, {"version": STRUCTURE_VERSION, "root": root}


class _Flattener:
    def __init__(self, on_unsupported: str) -> None:
        self.on_unsupported = on_unsupported
        # torch's and numpy's objects exist only where they were imported: their types are asked for only then
        self.torch, self.np = sys.modules.get("torch"), sys.modules.get("numpy")
        self.refs: list[_TensorRef] = []
        # "__metadata__" is the safetensors header's own field, never a tensor name: a dict key of that name
        # gets "__metadata__~2", as any other collision does
        self.used_keys: set[str] = {"__metadata__"}
        self.skipped: list[str] = []

    def key_for(self, path: str, obj: object = None) -> str:
        """A unique readable key for ``path`` (collisions such as {'a.b': x, 'a': {'b': y}} get ``~N``). A stored
        name must be valid Unicode (the structure's JSON escapes any string; the safetensors header's names are
        UTF-8): `UnsupportedObjectError` naming the path where it is not."""
        if not _utf8(path):
            raise UnsupportedObjectError(path, obj, f"its name is {_NOT_UTF8}", skippable=False)
        key, n = path or "_", 1
        while key in self.used_keys:
            n += 1
            key = f"{path or '_'}~{n}"
        self.used_keys.add(key)
        return key

    def encode(self, obj: Any, path: str, depth: int = 0) -> Any:
        # Exact type checks: a subclass (IntEnum, defaultdict, a custom dict) would not come back as itself.
        t = type(obj)
        if depth >= MAX_DEPTH and t in _HOLDERS and _holds_itself(obj):  # a cycle: endless depth (looked
            # for only this deep, where every container of a cycle is met: it costs nothing before)
            cut = path if len(path) <= 120 else f"{path[:120]}..."
            raise UnsupportedObjectError(cut, obj, "a container that holds itself (a cycle: a list, dict or tuple"
                                         " among its own items, at any depth), which no checkpoint can store; remove"
                                         " the reference back to it before saving", skippable=False)
        if depth > MAX_DEPTH:  # readers refuse deeper structures (validate_structure): never write one
            raise UnsupportedObjectError(path, obj, f"nested deeper than {MAX_DEPTH} levels, which readers refuse;"
                                         " flatten that part (e.g. a list of its items) before saving")
        down = depth + 1
        if obj is None or t is str or t is bool:
            return obj
        if t is int:
            return obj if _INT64[0] <= obj <= _INT64[1] else {"type": "int", "value": str(obj)}
        if t is float:
            node = {"type": "float", "value": repr(obj)}
            return {**node, "hex": _F64.pack(obj).hex()} if _odd_nan(obj) else node
        if t is complex:
            node = {"type": "complex", "real": repr(obj.real), "imag": repr(obj.imag)}
            odd = _odd_nan(obj.real) or _odd_nan(obj.imag)
            return {**node, "hex": _C128.pack(obj.real, obj.imag).hex()} if odd else node
        if t is dict or t is OrderedDict:
            items = [[self.encode_key(k, _join(path, k), down), self.encode(v, _join(path, k), down)]
                     for k, v in obj.items()]
            return {"type": "dict" if t is dict else "OrderedDict", "items": items}
        if t is list or t is tuple:
            return {"type": t.__name__, "items": [self.encode(v, _join(path, i), down) for i, v in enumerate(obj)]}
        if t is set or t is frozenset:
            return {"type": t.__name__, "items": [self.encode(v, _join(path, i), down) for i, v in enumerate(obj)]}
        if t is StoredTensor:
            return self.encode_stored(obj, path)
        torch, np = self.torch, self.np
        if torch is not None and isinstance(obj, torch.Tensor) and (t is torch.Tensor or t is torch.nn.Parameter):
            return self.encode_tensor(obj, path)
        if np is not None and t is np.ndarray:
            return self.encode_ndarray(obj, path)
        if np is not None and isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            return {"type": "np_scalar", "dtype": obj.dtype.str, "hex": obj.tobytes().hex()}
        if t is bytes or t is bytearray:
            import torch

            node = {"type": t.__name__}
            self.refs.append(_TensorRef(torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj
                                        else torch.empty(0, dtype=torch.uint8), path, node))
            return node
        if torch is not None and t is torch.dtype:
            return {"type": "dtype", "value": torch_dtype_name(obj)}
        if torch is not None and t is torch.Size:
            return {"type": "Size", "items": list(obj)}
        if torch is not None and t is torch.device:
            return {"type": "device", "value": str(obj)}
        if t is argparse.Namespace:
            items = [[k, self.encode(v, _join(path, k), down)] for k, v in vars(obj).items()]
            return {"type": "Namespace", "items": items}
        if t.__name__ in _PATH_TYPES and _PATH_TYPES[t.__name__] is t:
            return {"type": "path", "class": t.__name__, "value": str(obj)}
        return self.unsupported(obj, path)

    def unsupported(self, obj: Any, path: str, hint: str = "") -> Any:
        if self.on_unsupported == "skip":
            self.skipped.append(f"{path or '<root>'} ({type(obj).__qualname__})")
            return {"type": "skipped", "python_type": f"{type(obj).__module__}.{type(obj).__qualname__}"}
        raise UnsupportedObjectError(path, obj, hint)

    def encode_key(self, key: Any, path: str, depth: int) -> Any:
        """A dict key (``path`` is its entry's): only what readers accept as a key node, tuples of those too."""
        if not _storable_key(key):
            raise UnsupportedObjectError(path, key, "dict keys must be str, int, float, bool, None, torch.dtype"
                                         " or tuples of those", skippable=False)
        return self.encode(key, path, depth)

    def encode_stored(self, tensor: StoredTensor, path: str) -> Any:
        """The node `encode_tensor` makes of the tensor torch would have rebuilt (a plain one: never nested,
        quantized, conj or neg; of a dtype safetensors stores)."""
        node: dict[str, Any] = {"type": "tensor"}
        if tensor.param:
            node["param"] = True
        if tensor.requires_grad:
            node["requires_grad"] = True
        self.refs.append(_TensorRef(tensor, path, node))  # type: ignore[arg-type]
        return node

    def encode_tensor(self, tensor: torch.Tensor, path: str) -> Any:
        import torch

        if tensor.is_nested:  # checked first: a nested tensor raises on most other questions
            return self.unsupported(tensor, path, "a nested (jagged) tensor has no fixed shape to store; store its"
                                    " components (tensor.unbind()) instead")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
            return self.unsupported(tensor, path, f"tensor with layout {tensor.layout}"
                                    f"{' (quantized)' if tensor.is_quantized else ''}"
                                    f"{' on the meta device (no data)' if tensor.is_meta else ''} is not supported")
        if tensor.dtype not in formats.DTYPE_TO_NAME:
            return self.unsupported(tensor, path, f"dtype {tensor.dtype} has no safetensors equivalent")
        node: dict[str, Any] = {"type": "tensor"}
        if type(tensor) is torch.nn.Parameter:
            node["param"] = True
        if tensor.requires_grad:
            node["requires_grad"] = True
        # A conj or neg view shares its base's memory and negates on reading: store the memory as it is (so
        # that it still aliases its base) and the bit in the node
        raw = tensor.detach()
        if raw.is_conj():
            node["conj"], raw = True, raw.conj()
        if raw.is_neg():
            node["neg"], raw = True, torch._neg_view(raw)
        self.refs.append(_TensorRef(raw, path, node))
        return node

    def encode_ndarray(self, array: np.ndarray, path: str) -> Any:
        import numpy as np
        import torch

        if array.dtype.kind not in "biufc" or array.dtype.hasobject:
            return self.unsupported(array, path, f"numpy dtype {array.dtype} is not a plain numeric dtype")
        native = array.astype(array.dtype.newbyteorder("="), copy=False)
        try:
            # np.ascontiguousarray makes a 0-d array 1-d: reshape keeps its shape
            tensor = torch.from_numpy(np.ascontiguousarray(native).reshape(native.shape))
        except TypeError:
            return self.unsupported(array, path, f"numpy dtype {array.dtype} has no torch equivalent")
        if tensor.dtype not in formats.DTYPE_TO_NAME:
            return self.unsupported(array, path, f"numpy dtype {array.dtype} has no safetensors equivalent")
        node = {"type": "ndarray", "dtype": array.dtype.str}
        self.refs.append(_TensorRef(tensor, path, node, id(array)))
        return node

    def assign_storage(self) -> dict[str, torch.Tensor]:
        """Give each tensor node a key, storing shared storage once (aliases and views)."""
        groups: dict[tuple[str, int], list[_TensorRef]] = {}
        for ref in self.refs:
            t = ref.tensor
            # empty tensors may all report data_ptr 0: never group them; nor arrays (and bytes), which torch.save
            # pickles by value: an array sharing a tensor's memory is its own copy after torch.load, uncast
            if t.numel() == 0 or ref.node["type"] != "tensor":  # (the same array object twice: one group)
                groups.setdefault(("own", ref.identity if ref.identity is not None else id(ref)), []).append(ref)
            elif type(t) is StoredTensor:  # one storage record, as torch.load maps it to one storage
                groups.setdefault(("stored", id(t.storage)), []).append(ref)
            else:
                groups.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(ref)
        tensors: dict[str, torch.Tensor] = {}
        for refs in groups.values():
            base = _covering_base(refs)
            if base is None:
                if len(refs) > 1:
                    warnings.warn("tensors at " + ", ".join(r.path for r in refs) + " share storage but none of"
                                  " them is a row-major tensor, of the others' dtype, that covers them (a flat"
                                  " buffer's views, a channels_last tensor and its views, views in another dtype);"
                                  " storing them as separate tensors", stacklevel=3)
                for ref in refs:
                    ref.node["key"] = key = self.key_for(ref.path, ref.tensor)
                    tensors[key] = ref.tensor
                    if len(refs) > 1:  # declared: `verify` takes the storage no longer shared as this change
                        ref.node["apart"] = True
                continue
            base_key = self.key_for(base.path, base.tensor)
            tensors[base_key] = base.tensor
            for ref in refs:
                ref.node["key"] = base_key
                if not _same_view(ref.tensor, base.tensor):
                    ref.node["view"] = {"offset": ref.tensor.storage_offset() - base.tensor.storage_offset(),
                                        "shape": list(ref.tensor.shape), "stride": list(ref.tensor.stride())}
        return tensors


# a NaN's sign and payload (x86 makes 0/0 a negative NaN) are lost by repr(): such a NaN also carries its bits
_F64, _C128 = struct.Struct("<d"), struct.Struct("<dd")
_NAN_BITS = _F64.pack(float("nan"))


def _odd_nan(x: float) -> bool:
    """A NaN whose bits are not ``float('nan')``'s."""
    return x != x and _F64.pack(x) != _NAN_BITS


_NOT_UTF8 = ("not valid Unicode (a lone surrogate, as a file name decoded with surrogateescape gives), which a"
             " safetensors header cannot hold: rename the entry (e.g. name.encode('utf-8', 'surrogateescape')"
             ".decode('utf-8', 'replace'))")


def _utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (the header's JSON): no lone surrogates."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _storable_key(key: Any) -> bool:
    """A dict key readers accept: a JSON scalar, a float, a dtype, or a tuple of those (validate_structure)."""
    if type(key) is tuple:
        return all(_storable_key(k) for k in key)
    torch = sys.modules.get("torch")  # a torch dtype exists only where torch was imported
    return key is None or type(key) in (str, int, bool, float) or (torch is not None and type(key) is torch.dtype)


def _join(path: str, key: Any) -> str:
    part = key if isinstance(key, str) else str(key)
    return f"{path}.{part}" if path else part


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset())


def _covering_base(refs: list[_TensorRef]) -> _TensorRef | None:
    """The first contiguous tensor of the group whose elements cover every other member's."""
    if len(refs) == 1:
        return refs[0]
    for cand in refs:
        t = cand.tensor
        if not t.is_contiguous() or any(r.tensor.dtype != t.dtype for r in refs):
            continue
        lo, hi = t.storage_offset(), t.storage_offset() + t.numel()
        if all(lo <= r.tensor.storage_offset() and _last_element(r.tensor) < hi for r in refs):
            return cand
    return None


def _last_element(t: torch.Tensor) -> int:
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


# ---------------------------------------------------------------------------------------------
# unflatten


def unflatten(tensors: Mapping[str, torch.Tensor], structure: Structure) -> Any:
    """Rebuild the object `flatten` produced from its flat tensors and structure.

    ``tensors`` may be any mapping (a lazy memory-mapped one included); each key is looked up
    once, so aliases come back as the same tensor object or as views of it.
    """
    if not isinstance(structure, dict) or structure.get("version") != STRUCTURE_VERSION or "root" not in structure:
        raise FormatError("<structure>", f"unsupported structure (expected version {STRUCTURE_VERSION}"
                          f" with a 'root'), got keys {sorted(structure)[:5] if isinstance(structure, dict) else type(structure).__name__}")
    cache: dict[Any, Any] = {}  # per key; per ("requires_grad", key) and ("ndarray", key): one object each
    return _decode(structure["root"], tensors, cache, "")


def _decode(node: Any, tensors: Mapping[str, torch.Tensor], cache: dict[Any, Any], path: str) -> Any:
    import numpy as np
    import torch

    if node is None or isinstance(node, (str, bool, int)) and not isinstance(node, float):
        return node
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise FormatError("<structure>", f"at '{path}': malformed node {str(node)[:80]!r}")
    kind = node["type"]
    try:
        if kind in ("dict", "OrderedDict"):
            pairs = ((_decode(k, tensors, cache, path), v) for k, v in node["items"])
            out = {} if kind == "dict" else OrderedDict()
            for k, v in pairs:
                out[k] = _decode(v, tensors, cache, _join(path, k))
            return out
        if kind in ("list", "tuple", "set", "frozenset"):
            items = [_decode(v, tensors, cache, _join(path, i)) for i, v in enumerate(node["items"])]
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
        if kind == "int":
            return int(node["value"])
        if kind == "float":
            return float(node["value"]) if "hex" not in node else _F64.unpack(bytes.fromhex(node["hex"]))[0]
        if kind == "complex":
            if "hex" in node:
                return complex(*_C128.unpack(bytes.fromhex(node["hex"])))
            return complex(float(node["real"]), float(node["imag"]))
        if kind == "tensor":
            t = _lookup(node, tensors, cache, path)
            if node.get("neg"):
                t = torch._neg_view(t)
            if node.get("conj"):
                t = t.conj()
            if node.get("param"):
                return torch.nn.Parameter(t, requires_grad=bool(node.get("requires_grad")))
            if not node.get("requires_grad"):
                return t
            if t is not cache.get(node["key"]):  # a view made for this node alone
                return t.requires_grad_(True)
            # the tensor every alias of this key shares: its own object, so that the others stay as they were
            # (a detached copy of a weight must not come back requiring grad); one per key, as torch.load shares it
            grad_key = ("requires_grad", node["key"])
            if grad_key not in cache:
                cache[grad_key] = t.detach().requires_grad_(True)
            return cache[grad_key]
        if kind == "ndarray":  # one object per key, as torch.load gives the same array object twice
            array_key = ("ndarray", node["key"])
            if array_key not in cache:
                array = _lookup(node, tensors, cache, path).numpy()
                dtype = np.dtype(node["dtype"])
                if dtype.kind not in "biufc":
                    raise ValueError(f"ndarray dtype {dtype} is not numeric")
                cache[array_key] = array if array.dtype == dtype else array.astype(dtype)
            return cache[array_key]
        if kind in ("bytes", "bytearray"):
            data = _lookup(node, tensors, cache, path).numpy().tobytes()
            return data if kind == "bytes" else bytearray(data)
        if kind == "np_scalar":
            return np.frombuffer(bytes.fromhex(node["hex"]), dtype=np.dtype(node["dtype"]))[0]
        if kind == "dtype":
            dtype = getattr(torch, str(node["value"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{node['value']!r} is not a torch dtype")
            return dtype
        if kind == "Size":
            return torch.Size(node["items"])
        if kind == "device":
            if not isinstance(node["value"], str):
                raise ValueError("device must be a string")
            return torch.device(node["value"])
        if kind == "Namespace":
            return argparse.Namespace(**{k: _decode(v, tensors, cache, _join(path, k)) for k, v in node["items"]})
        if kind == "path":
            return _PATH_TYPES[node["class"]](node["value"])
        if kind == "skipped":
            return None
    except FormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError,
            struct.error) as e:
        raise FormatError("<structure>", f"at '{path}': malformed {kind} node ({type(e).__name__}: {e})") from None
    raise FormatError("<structure>", f"at '{path}': unknown node type {kind!r}")


def _lookup(node: dict[str, Any], tensors: Mapping[str, torch.Tensor], cache: dict[Any, Any], path: str
            ) -> torch.Tensor:
    key = node["key"]
    if key not in cache:
        try:
            cache[key] = tensors[key]
        except KeyError:
            raise FormatError("<structure>", f"at '{path}': tensor key '{key}' is missing from the tensors") from None
    t = cache[key]
    view = node.get("view")
    if view is None:
        return t
    end = t.storage_offset() + view["offset"] + sum((n - 1) * s for n, s in zip(view["shape"], view["stride"]))
    if view["offset"] < 0 or (math.prod(view["shape"]) and end >= t.storage_offset() + t.numel()):
        raise FormatError("<structure>", f"at '{path}': view of '{key}' runs outside it")
    return t.as_strided(view["shape"], view["stride"], t.storage_offset() + view["offset"])


# ---------------------------------------------------------------------------------------------
# validating a structure read from a file

MAX_DEPTH = 256  # real checkpoints nest a few levels; the limit keeps every recursive walk safe
_CONTAINERS = {"list", "tuple", "set", "frozenset"}
_MAPPINGS = {"dict", "OrderedDict", "Namespace"}
_STORED = {"tensor", "ndarray", "bytes", "bytearray"}
_PLAIN_TENSOR_FIELDS = {"type", "key"}  # a tensor node with no view, flag or value of its own
_BITS = {"float": 16, "complex": 32}  # the optional "hex" of a NaN that is not float('nan'): its bytes, little-endian
_STRING_FIELDS = {"int": ("value",), "float": ("value",), "complex": ("real", "imag"), "np_scalar": ("dtype", "hex"),
                  "dtype": ("value",), "device": ("value",), "path": ("class", "value"), "skipped": ("python_type",)}


def validate_structure(structure: Any, where: object, keys: Mapping[str, Any] | None = None) -> None:
    """Check a structure read from a file against the grammar of FORMAT.md, so that everything that walks
    it afterwards can trust its shape: every node's fields have the right JSON types, nesting stays
    within `MAX_DEPTH`, and every tensor node names a key of ``keys`` (when given). Raises `FormatError`
    naming ``where`` and the path of the first bad node."""
    if not isinstance(structure, dict) or structure.get("version") != STRUCTURE_VERSION or "root" not in structure:
        raise FormatError(where, f"structure metadata is not {{'version': {STRUCTURE_VERSION}, 'root': ...}}")
    stack: list[tuple[Any, str, int, bool]] = [(structure["root"], "", 0, False)]
    while stack:
        node, path, depth, is_key = stack.pop()
        if depth > MAX_DEPTH:
            raise _bad_node(where, path, f"nested deeper than {MAX_DEPTH} levels")
        if node is None or type(node) in (str, bool):
            continue
        if type(node) is int:
            if not _INT64[0] <= node <= _INT64[1]:
                raise _bad_node(where, path, "a bare integer outside int64 (those are {'type': 'int'} nodes)")
            continue
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise _bad_node(where, path, f"not a node: {str(node)[:60]}")
        kind = node["type"]
        if is_key and kind not in ("int", "float", "tuple", "dtype"):
            raise _bad_node(where, path, f"a {kind} node cannot be a dict key")
        if kind in _MAPPINGS or kind in _CONTAINERS or kind == "Size":
            items = node.get("items")
            if not isinstance(items, list):
                raise _bad_node(where, path, f"{kind} node without an 'items' list")
            if kind == "Size":
                if not all(_is_json_int(i) and i >= 0 for i in items):
                    raise _bad_node(where, path, "Size items must be non-negative integers")
                continue
            for i, item in enumerate(items):
                if kind in _MAPPINGS:
                    if not (isinstance(item, list) and len(item) == 2):
                        raise _bad_node(where, path, f"{kind} item {i} is not a [key, value] pair")
                    key, value = item
                    if (type(value) is dict and value.keys() == _PLAIN_TENSOR_FIELDS and type(key) is str
                            and value["type"] == "tensor" and type(value["key"]) is str and depth < MAX_DEPTH
                            and (keys is None or value["key"] in keys)):
                        continue  # a plain tensor under a name (most nodes of a weights file): nothing else to check
                    if kind == "Namespace" and not isinstance(key, str):
                        raise _bad_node(where, path, f"Namespace item {i} has a non-string name")
                    label = key if isinstance(key, (str, int)) and not isinstance(key, bool) else f"<key {i}>"
                    at = _join(path, label)
                    if type(key) is not str:  # (a string key is valid as it is: most keys, not walked)
                        stack.append((key, at, depth + 1, True))
                    stack.append((value, at, depth + 1, False))
                else:
                    stack.append((item, _join(path, i), depth + 1, is_key and kind == "tuple"))
        elif kind in _STORED:
            key = node.get("key")
            if not isinstance(key, str) or (keys is not None and key not in keys):
                raise _bad_node(where, path, f"names tensor {str(key)[:60]!r}, which the file does not hold")
            if kind == "ndarray" and not isinstance(node.get("dtype"), str):
                raise _bad_node(where, path, "ndarray node without a dtype string")
            if (type(node.get("conj", False)) is not bool or type(node.get("neg", False)) is not bool
                    or type(node.get("param", False)) is not bool or type(node.get("requires_grad", False)) is not bool):
                raise _bad_node(where, path, "conj, neg, param and requires_grad must be true or false")
            view = node.get("view")
            if view is not None:
                if not (isinstance(view, dict) and _is_json_int(view.get("offset")) and view["offset"] >= 0
                        and isinstance(view.get("shape"), list) and isinstance(view.get("stride"), list)
                        and len(view["shape"]) == len(view["stride"])
                        and all(_is_json_int(d) and d >= 0 for d in view["shape"])
                        and all(_is_json_int(d) for d in view["stride"])):
                    raise _bad_node(where, path, "view must be {'offset': int >= 0, 'shape': [ints >= 0],"
                                    " 'stride': [ints]} of equal lengths")
        elif kind in _STRING_FIELDS:
            missing = [f for f in _STRING_FIELDS[kind] if not isinstance(node.get(f), str)]
            if missing:
                raise _bad_node(where, path, f"{kind} node needs string field(s) {', '.join(missing)}")
            bits = node.get("hex")
            if kind in _BITS and bits is not None and not (isinstance(bits, str) and len(bits) == _BITS[kind]
                                                           and all(c in "0123456789abcdef" for c in bits)):
                raise _bad_node(where, path, f"a {kind} node's hex must be {_BITS[kind]} lowercase hex digits")
        else:
            raise _bad_node(where, path, f"unknown node type {kind[:40]!r}")


def _bad_node(where: object, path: str, problem: str) -> FormatError:
    return FormatError(where, f"structure at '{path or '<root>'}': {problem}")


def _is_json_int(x: Any) -> bool:
    return type(x) is int and _INT64[0] <= x <= _INT64[1]


# ---------------------------------------------------------------------------------------------
# navigating a structure without rebuilding it


def holds_model_subtree(structure: Structure) -> bool:
    """Whether the top level is a dict with a ``"model"`` subtree (a training checkpoint saved as
    ``{"model": ..., "optim": ...}``). Only that exact key counts: Hugging Face state dicts have flat keys
    that themselves start with ``model.`` (``LlamaForCausalLM``)."""
    root = structure.get("root")
    return (isinstance(root, dict) and root.get("type") in ("dict", "OrderedDict")
            and any(k == "model" and isinstance(v, dict) and v.get("type") != "tensor" for k, v in root["items"]))


def subtree(structure: Structure, prefix: str) -> Any:
    """The node at dotted ``prefix`` ("" = root); raises KeyError naming the missing part."""
    node = structure["root"]
    if not prefix:
        return node
    walked = []
    for part in prefix.split("."):
        walked.append(part)
        child = _child(node, part)
        if child is _MISSING:
            raise KeyError(".".join(walked))
        node = child
    return node


_MISSING = object()


def _child(node: Any, part: str) -> Any:
    if not isinstance(node, dict):
        return _MISSING
    kind = node.get("type")
    if kind in ("dict", "OrderedDict", "Namespace"):
        for k, v in node["items"]:
            if (k if isinstance(k, str) else str(k)) == part:
                return v
    elif kind in ("list", "tuple") and part.isdigit() and int(part) < len(node["items"]):
        return node["items"][int(part)]
    return _MISSING


def iter_tensor_nodes(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(dotted path, tensor node)`` for every tensor below ``node`` (nested dicts flattened)."""
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "tensor":
        yield path, node
    elif kind in ("dict", "OrderedDict", "Namespace"):
        for k, v in node["items"]:
            name = k if isinstance(k, str) else str(k) if isinstance(k, int) else None
            if name is None:
                continue
            if type(v) is dict and v.get("type") == "tensor":  # (most children: no generator of their own)
                yield _join(path, name), v
            else:
                yield from iter_tensor_nodes(v, _join(path, name))
    elif kind in ("list", "tuple"):
        for i, v in enumerate(node["items"]):
            yield from iter_tensor_nodes(v, _join(path, i))


def flat_structure(keys: list[str]) -> Structure:
    """The structure of a plain ``Dict[str, Tensor]`` file that carries none of its own."""
    return {"version": STRUCTURE_VERSION,
            "root": {"type": "dict", "items": [[k, {"type": "tensor", "key": k}] for k in keys]}}


def iter_nodes(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(dotted path, node)`` for ``node`` and every node below it, containers and leaves alike."""
    if not isinstance(node, dict):
        return
    yield path, node
    kind = node.get("type")
    if kind in _MAPPINGS:
        for k, v in node.get("items", []):
            yield from iter_nodes(v, _join(path, k if isinstance(k, (str, int)) else "?"))
    elif kind in _CONTAINERS:
        for i, v in enumerate(node.get("items", [])):
            yield from iter_nodes(v, _join(path, i))


def is_optimizer_state_dict(node: Any) -> bool:
    """Whether a structure node is an optimizer's state dict as ``Optimizer.state_dict()`` gives it: ``state`` beside
    ``param_groups``, a list of groups each with ``params`` (a config that has keys of those names is not one)."""
    if not isinstance(node, dict) or node.get("type") not in _MAPPINGS:
        return False
    items = dict((k, v) for k, v in node.get("items", ()) if k in ("state", "param_groups"))
    groups = items.get("param_groups")
    listed = groups.get("items") if isinstance(groups, dict) and groups.get("type") == "list" else None
    return "state" in items and bool(listed) and all(
        isinstance(g, dict) and g.get("type") in _MAPPINGS and any(k == "params" for k, _ in g.get("items", ()))
        for g in listed)


def skipped_values(structure: Structure | None) -> list[str]:
    """Paths of the values a conversion with ``on_unsupported="skip"`` did not store (restored as None)."""
    if not structure:
        return []
    return [path or "<root>" for path, node in iter_nodes(structure.get("root")) if node.get("type") == "skipped"]


def iter_nodes_with_keys(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(path, node)`` for every node that names a stored tensor (tensor, ndarray, bytes)."""
    if not isinstance(node, dict):
        return
    if "key" in node and node.get("type") in ("tensor", "ndarray", "bytes", "bytearray"):
        yield path, node
    elif node.get("type") in ("dict", "OrderedDict", "Namespace"):
        for k, v in node.get("items", []):
            yield from iter_nodes_with_keys(v, _join(path, k if isinstance(k, (str, int)) else "?"))
    elif node.get("type") in ("list", "tuple", "set", "frozenset"):
        for i, v in enumerate(node.get("items", [])):
            yield from iter_nodes_with_keys(v, _join(path, i))


_HOLDERS = (dict, OrderedDict, list, tuple)  # Python containers a cycle may run through (not the node kinds above)


def _holds_itself(obj: Any) -> bool:
    """Whether ``obj``, a container, is among the containers it holds at any depth (a cycle)."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        node = todo.pop()
        for item in node.values() if type(node) in (dict, OrderedDict) else node:
            if item is obj:
                return True
            if type(item) in _HOLDERS and id(item) not in seen:
                seen.add(id(item))
                todo.append(item)
    return False
