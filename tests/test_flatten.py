"""The flattener/unflattener round-trips every supported value exactly, types included."""

import argparse
import json
import math
import pathlib
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers import assert_same
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_restore import UnsupportedObjectError, flatten, unflatten
from fsdp_restore.errors import FormatError


def roundtrip(obj):
    tensors, structure = flatten(obj)
    structure = json.loads(json.dumps(structure))  # must survive JSON (it lives in the header)
    return unflatten(tensors, structure), tensors, structure


ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    back, _, _ = roundtrip({"t": t, "scalar": t[0, 0].clone(), "empty": t[:0]})
    assert_same(back["t"], t)


def test_scalars_and_containers_keep_types():
    obj = {
        "none": None, "true": True, "int": 7, "neg": -3, "big": 2**100, "float": 0.1, "nan": float("nan"),
        "inf": float("-inf"), "str": "héllo.world", "bytes": b"\x00\x01", "bytearray": bytearray(b"ab"),
        "complex": 1 - 2j, 3: "int key", "a.b": "dotted key", "list": [1, [2, (3,)]], "tuple": (), "emptyd": {},
        "od": OrderedDict([("z", 1), ("a", 2)]), "set": {1, 2}, "frozenset": frozenset({"x"}),
        "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "device": torch.device("cpu"),
        "ns": argparse.Namespace(lr=0.1, nested=argparse.Namespace(x=None)), "path": pathlib.Path("/a/b"),
        "pure": pathlib.PurePosixPath("x/y"), "np_scalar": np.float32(1.5), "np_int": np.int64(-4),
        "ndarray": np.arange(6, dtype=np.int16).reshape(2, 3), "big_endian": np.arange(3, dtype=">f4"),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        (1, "t"): "tuple key", 2.5: "float key", None: "none key", False: "bool key",
    }
    back, _, _ = roundtrip(obj)
    assert_same(back, obj)
    assert back["big_endian"].dtype == np.dtype(">f4")


def test_tensor_details():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {"noncontig": base.t(), "zero_dim": torch.tensor(3.5), "empty": torch.empty(0, 4),
           "param": torch.nn.Parameter(torch.randn(2)), "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False)}
    back, _, _ = roundtrip(obj)
    assert_same(back["noncontig"], obj["noncontig"].contiguous())
    assert type(back["param"]) is torch.nn.Parameter and back["param"].requires_grad
    assert type(back["frozen"]) is torch.nn.Parameter and not back["frozen"].requires_grad
    assert back["zero_dim"].shape == () and back["empty"].shape == (0, 4)


@pytest.mark.parametrize("order", ["base first", "aliases first"])
def test_requires_grad_stays_with_its_own_alias(tmp_path, order):
    """A weight requiring grad and detached aliases of it (the same memory, a view): loading gave every alias
    requires_grad (one was the weight's own object, a view had a grad_fn) as the flag was set on the tensor they
    shared. torch.load is the oracle, mapped and not."""
    import fsdp_restore

    w = torch.randn(3, 2, requires_grad=True)
    items = {"a": w, "b": w.detach(), "v": w.detach()[1:], "g": w[1:].detach().requires_grad_(True), "a2": w}
    obj = dict(items if order == "base first" else reversed(list(items.items())))
    torch.save(obj, tmp_path / "src.pt")
    fsdp_restore.convert(tmp_path / "src.pt", tmp_path / "out.safetensors")
    expected = torch.load(tmp_path / "src.pt", weights_only=True)
    for mmap in (True, False):
        back = fsdp_restore.load(tmp_path / "out.safetensors", mmap=mmap)
        for key, t in expected.items():
            got = back[key]
            assert (got.requires_grad, got.grad_fn, got.is_leaf) == (t.requires_grad, None, True), (mmap, key)
            assert torch.equal(got.detach(), t.detach()) and got.untyped_storage().data_ptr() == \
                back["a"].untyped_storage().data_ptr(), (mmap, key)  # still one storage
        assert back["a"] is back["a2"] and back["a"] is not back["b"]  # as torch.load shares objects


def test_tied_weights_stored_once_and_restored_as_aliases():
    w = torch.randn(5, 4)
    obj = {"model": {"wte.weight": w, "lm_head.weight": w}}
    back, tensors, _ = roundtrip(obj)
    assert list(tensors) == ["model.wte.weight"]
    assert back["model"]["lm_head.weight"] is back["model"]["wte.weight"]


def test_views_of_one_buffer_share_storage():
    buf = torch.arange(12.0)
    obj = [buf, buf[3:7], buf.view(3, 4), buf.view(3, 4)[:, 1]]
    back, tensors, _ = roundtrip(obj)
    assert len(tensors) == 1
    for a, b in zip(back, obj):
        assert_same(a, b.contiguous())
    back[0][5] = -1.0
    assert back[1][2] == -1.0 and back[2][1, 1] == -1.0


def test_a_channels_last_tensor_and_its_view_are_stored_apart_saying_why():
    """The tensor covers the storage but is not row-major: the warning said none of them covers the others."""
    c = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    with pytest.warns(UserWarning, match="row-major .*channels_last"):
        tensors, structure = flatten({"c": c, "c2": c[:, 1]})
    back = unflatten(tensors, structure)
    assert torch.equal(back["c"], c) and torch.equal(back["c2"], c[:, 1])


def test_readable_keys_and_collisions():
    t1, t2, t3 = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    obj = {"model": {"layers.0.attn.weight": t1}, "optim": {"state": {3: {"exp_avg": t2}}},
           "a.b": t3, "a": {"b": t3.clone()}}
    back, tensors, _ = roundtrip(obj)
    assert set(tensors) == {"model.layers.0.attn.weight", "optim.state.3.exp_avg", "a.b", "a.b~2"}
    assert_same(back, obj)


def test_unsupported_object_names_its_path_and_type():
    class Custom:
        pass

    with pytest.raises(UnsupportedObjectError, match=r"__main__|test_flatten.*Custom.*'cfg\.items\.1'|'cfg\.items\.1'"):
        flatten({"cfg": {"items": [1, Custom()]}})
    try:
        flatten({"cfg": {"items": [1, Custom()]}})
    except UnsupportedObjectError as e:
        assert e.path == "cfg.items.1" and "Custom" in e.type_name


@pytest.mark.parametrize("make", ["list", "dict", "tuple-in-list", "through-two"])
def test_a_container_that_holds_itself_is_named_as_a_cycle(make):
    """A cycle was reported as nesting past 256 levels, with a path of 256 keys and no word of a cycle."""
    if make == "list":
        obj = [torch.ones(1)]
        obj.append(obj)
    elif make == "dict":
        obj = {"w": torch.ones(1)}
        obj["self"] = obj
    elif make == "tuple-in-list":
        obj = []
        obj.append((obj, 1))
    else:
        a, b = {"x": 1}, {"y": 2}
        a["b"], b["a"] = b, a
        obj = [a]
    with pytest.raises(UnsupportedObjectError, match="holds itself") as info:
        flatten({"state": obj})
    assert len(str(info.value)) < 600 and "on_unsupported" not in str(info.value)


def test_nesting_past_the_limit_without_a_cycle_is_still_said_as_depth():
    deep = torch.ones(1)
    for _ in range(300):
        deep = [deep]
    with pytest.raises(UnsupportedObjectError, match="nested deeper than 256 levels"):
        flatten({"d": deep})


def test_skip_unsupported_warns_and_restores_none():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tensors, structure = flatten({"ok": 1, "bad": object(), "l": [lambda: 0]}, on_unsupported="skip")
    assert any("bad" in str(w.message) and "l.0" in str(w.message) for w in caught)
    assert unflatten(tensors, structure) == {"ok": 1, "bad": None, "l": [None]}


def test_subclasses_are_not_silently_downgraded():
    from collections import defaultdict

    with pytest.raises(UnsupportedObjectError, match="defaultdict"):
        flatten({"d": defaultdict(list)})


def test_malformed_structure_is_a_format_error():
    with pytest.raises(FormatError):
        unflatten({}, {"version": 99, "root": None})
    with pytest.raises(FormatError, match="missing"):
        unflatten({}, {"version": 1, "root": {"type": "tensor", "key": "nope"}})
    with pytest.raises(FormatError, match="unknown node type"):
        unflatten({}, {"version": 1, "root": {"type": "pickle"}})


# ---- property tests --------------------------------------------------------------------------

_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8),
    st.builds(lambda n, d: (torch.arange(n) * 3 - 7).to(d), st.integers(0, 6),
              st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.int64])),
    st.builds(lambda n: np.arange(n, dtype=np.float32), st.integers(0, 4)),
)
_key = st.one_of(st.text(max_size=6), st.integers(-5, 50))
_tree = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_key, children, max_size=4),
        st.dictionaries(st.text(max_size=4), children, max_size=3).map(OrderedDict),
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(_tree)
def test_property_roundtrip(obj):
    back, _, _ = roundtrip(obj)
    assert_same(back, obj)


@settings(max_examples=50, deadline=None)
@given(_tree)
def test_property_roundtrip_through_file(tmp_path_factory, obj):
    import fsdp_restore

    path = tmp_path_factory.mktemp("p") / "x.safetensors"
    fsdp_restore.save({"root": obj}, path)
    assert_same(fsdp_restore.load(path)["root"], obj)


def test_float_repr_is_exact():
    values = [0.1, 1e-310, 2.0**-1074, math.pi, -0.0]
    back, _, _ = roundtrip(values)
    assert [v.hex() for v in back] == [v.hex() for v in values]


# ---- structures read from a file: every malformed one is a FormatError ------------------------------------

_junk = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=4), lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6)
_TYPES = ["dict", "OrderedDict", "list", "tuple", "set", "frozenset", "tensor", "ndarray", "bytes", "int", "float",
          "complex", "np_scalar", "dtype", "Size", "device", "Namespace", "path", "skipped", "zzz"]


def _node(children):
    """A node of the structure grammar with every field either right or junk."""
    def slot(valid):
        return st.one_of(valid, _junk)

    pair = st.lists(st.tuples(slot(st.text(max_size=3)), children).map(list), max_size=3)
    return st.fixed_dictionaries(
        {"type": st.one_of(st.sampled_from(_TYPES), _junk)},
        optional={"items": slot(st.one_of(pair, st.lists(children, max_size=3))),
                  "key": slot(st.sampled_from(["k", "ghost"])), "dtype": slot(st.just("<f4")),
                  "value": slot(st.sampled_from(["3", "nan", "float32", "cpu"])), "real": slot(st.just("1.0")),
                  "imag": slot(st.just("2.0")), "hex": slot(st.just("0000803f")), "class": slot(st.just("PosixPath")),
                  "view": slot(st.fixed_dictionaries({"offset": slot(st.integers(0, 2)),
                                                      "shape": slot(st.lists(st.integers(0, 2), max_size=2)),
                                                      "stride": slot(st.lists(st.integers(-1, 2), max_size=2))}))})


_structure = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=3), _node,
                          max_leaves=10)


def _file_with_structure(tmp_path, structure_text: str):
    from helpers import raw_safetensors

    header = {"__metadata__": {"fsdp_restore.structure": structure_text},
              "k": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    path = tmp_path / "s.safetensors"
    path.write_bytes(raw_safetensors(json.dumps(header), b"\0" * 8))
    return path


def _use_every_way(path):
    """What the CLI and the restore do with a structure: only FormatError may escape."""
    import fsdp_restore
    from fsdp_restore.plan import default_prefix, tensor_sources

    try:
        with fsdp_restore.Checkpoint(path) as ckpt:
            default_prefix(ckpt)
            tensor_sources(ckpt, "")
        fsdp_restore.load(path)
        fsdp_restore.inspect_checkpoint(path)
        fsdp_restore.verify(path)
    except FormatError as e:
        assert str(path) in str(e) or "<structure>" in str(e)


@settings(max_examples=400, deadline=None)
@given(st.one_of(_structure.map(lambda r: {"version": 1, "root": r}), _junk))
def test_fuzz_structure_grammar(tmp_path_factory, structure):
    _use_every_way(_file_with_structure(tmp_path_factory.mktemp("fz"), json.dumps(structure)))


@pytest.mark.parametrize("text", [
    '{"version": 1, "root": ' + '{"type": "list", "items": [' * 5000 + "]}" * 5000 + "}",  # within JSON's limit
    '{"version": 1, "root": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"version": 1, "root": {"type": "dict", "items": [[["a"], 1]]}}',  # a list as a key
    '{"version": 1, "root": {"type": "dict", "items": [[{"type": "list", "items": []}, 1]]}}',
    '{"version": 1, "root": {"type": "tensor", "key": ["k"]}}',
    '{"version": 1, "root": {"type": "tensor", "key": "k", "view": {"offset": true, "shape": [1], "stride": [1]}}}',
    '{"version": 1, "root": {"type": "Size", "items": [1, "2"]}}',
    '{"version": 1, "root": 18446744073709551616}',
    '{"version": 1, "root": {"type": "dict", "items": [["w", {"type": "tensor", "key": "nope"}]]}}',  # not in the file
    '{"version": 1, "root": ' + '{"type": "dict", "items": [["a", ' * 257 + '{"type": "tensor", "key": "k"}'
    + "]]}" * 257 + "}",  # a plain tensor node nested past MAX_DEPTH
    # nodes close to a plain tensor under a name, each refused as before (a tensor node read without its checks)
    '{"version": 1, "root": {"type": "dict", "items": [["w", {"type": "tensor", "key": ["k"]}]]}}',
    '{"version": 1, "root": {"type": "dict", "items": [["w", {"type": "ndarray", "key": "k"}]]}}',
    '{"version": 1, "root": {"type": "Namespace", "items": [[1, {"type": "tensor", "key": "k"}]]}}',
    '{"version": 1, "root": {"type": "dict", "items": [[{"type": "tensor", "key": "k"}, {"type": "tensor", "key": "k"}]]}}',
    '{"version": 1, "root": {"type": "dict", "items": [["w", {"type": "tensor", "key": "k", "view": 5}]]}}',
    '{"version": 1, "root": {"type": "dict", "items": [["w", {"type": "tensor", "key": "k", "conj": 1}]]}}',
])
def test_crafted_structure_is_a_format_error(tmp_path, text):
    path = _file_with_structure(tmp_path, text)
    with pytest.raises(FormatError) as info:
        import fsdp_restore

        fsdp_restore.Checkpoint(path)
    assert str(path) in str(info.value)


def test_conj_and_neg_bits_are_kept_beside_their_base():
    c = torch.randn(3, dtype=torch.complex64)
    x = torch.randn(4)
    back, tensors, structure = roundtrip({"c": c, "cc": c.conj(), "x": x, "nx": torch._neg_view(x)})
    assert len(tensors) == 2 and not any(t.is_conj() or t.is_neg() for t in tensors.values())  # raw memory
    assert back["cc"].is_conj() and back["nx"].is_neg() and not back["c"].is_conj()
    assert torch.equal(back["cc"].resolve_conj(), c.conj().resolve_conj())
    assert torch.equal(back["nx"].resolve_neg(), -x)
    assert back["cc"].untyped_storage().data_ptr() == back["c"].untyped_storage().data_ptr()


def test_zero_dim_ndarray_and_unsupported_arrays():
    back, _, _ = roundtrip({"a": np.array(1.5)})
    assert back["a"].shape == () and back["a"] == 1.5
    with pytest.raises(UnsupportedObjectError, match="'z'.*complex128"):
        flatten({"z": np.ones(2, dtype=np.complex128)})


def test_flags_must_be_booleans():
    from fsdp_restore.flatten import validate_structure

    structure = {"version": 1, "root": {"type": "tensor", "key": "t", "conj": "yes"}}
    with pytest.raises(FormatError, match="conj"):
        validate_structure(structure, "f.safetensors", {"t": None})


def test_a_tensor_named_with_a_string_that_is_not_valid_unicode_is_refused_naming_it(tmp_path):
    """A lone surrogate (a file name decoded with surrogateescape) in a tensor's name crashed convert with a bare
    UnicodeEncodeError (a safetensors header's names are UTF-8): refused now naming where, printable, with the
    fix, wherever the name comes from (a dict key, a Namespace attribute). Strings elsewhere (values, keys of
    other values, inside a tuple key) are escaped in the structure's JSON and come back as torch.load gives them."""
    import argparse

    import fsdp_restore
    from fsdp_restore.cli import main

    for name, obj in [("key", {"img_\udcff.png": torch.ones(2)}),
                      ("ns", {"args": argparse.Namespace(**{"ckpt_\udcff": torch.ones(2)})})]:
        torch.save(obj, tmp_path / f"{name}.pt")
        with pytest.raises(UnsupportedObjectError, match=r"\\udcff.*its name is not valid Unicode") as info:
            fsdp_restore.convert(tmp_path / f"{name}.pt", tmp_path / f"{name}.safetensors")
        assert "on_unsupported" not in str(info.value)  # a name cannot be dropped alone
        assert main(["convert", str(tmp_path / f"{name}.pt"), str(tmp_path / f"{name}2.safetensors")]) == 1
    fine = {"files": ["ok.png", "bad_\udcff.png"], ("a\udcff", "b"): 1, "k\udcff": "v", "w": torch.ones(1)}
    torch.save(fine, tmp_path / "fine.pt")
    fsdp_restore.convert(tmp_path / "fine.pt", tmp_path / "fine.safetensors")
    back, expected = fsdp_restore.load(tmp_path / "fine.safetensors"), torch.load(tmp_path / "fine.pt")
    assert list(back) == list(expected) and back["files"] == expected["files"] and back["k\udcff"] == "v"


def test_an_unsupported_tensor_names_both_the_problem_and_the_skip():
    with pytest.raises(UnsupportedObjectError, match=r"'c': dtype torch\.complex128.*; or pass on_unsupported='skip'"):
        flatten({"c": torch.zeros(2, dtype=torch.complex128)})


def test_an_array_sharing_a_tensors_memory_is_its_own_value(tmp_path):
    """torch.save pickles numpy arrays by value. An array sharing a tensor's memory (t.numpy()) was stored as a view
    of the tensor: save(dtype=fp16) cast it too, a bf16 cast left a file load could not read, and a tensor
    requiring grad made load fail. Arrays sharing memory with each other come back apart, as from torch.load."""
    import fsdp_restore

    t = torch.tensor([1.1, 2.2, 3.3], requires_grad=True)
    base = np.arange(6.0)
    obj = {"w": t, "arr": t.detach().numpy(), "x": base, "y": base[2:], "x2": base}
    torch.save(obj, tmp_path / "src.pt")
    expected = torch.load(tmp_path / "src.pt", weights_only=False)
    for dtype in (None, torch.float16, torch.bfloat16):
        fsdp_restore.save(obj, tmp_path / "out.safetensors", dtype=dtype)
        back = fsdp_restore.load(tmp_path / "out.safetensors")
        for key in ("arr", "x", "y"):
            assert back[key].dtype == expected[key].dtype and back[key].tobytes() == expected[key].tobytes(), key
        assert np.shares_memory(back["x"], back["y"]) == np.shares_memory(expected["x"], expected["y"])
        assert back["x"] is back["x2"] and expected["x"] is expected["x2"]  # one object, stored once
        assert back["w"].requires_grad and back["w"].dtype == (dtype or torch.float32)


def test_a_nan_keeps_its_sign_and_payload(tmp_path):
    """repr() made every NaN float('nan'): x86's 0/0 (a negative NaN, e.g. a diverged loss's .item()) came back
    positive and verify called it identical. torch.load is the oracle, bit for bit."""
    import struct

    import fsdp_restore

    negative = struct.unpack("<d", bytes.fromhex("000000000000f8ff"))[0]
    payload = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]
    obj = {"loss": negative, "p": payload, "plain": float("nan"), "z": complex(payload, -0.0), "zz": complex(1, 2)}
    torch.save(obj, tmp_path / "src.pt")
    fsdp_restore.convert(tmp_path / "src.pt", tmp_path / "out.safetensors")
    expected, back = torch.load(tmp_path / "src.pt"), fsdp_restore.load(tmp_path / "out.safetensors")

    def bits(v):
        return struct.pack("<dd", v.real, v.imag) if isinstance(v, complex) else struct.pack("<d", v)

    assert {k: bits(v) for k, v in back.items()} == {k: bits(v) for k, v in expected.items()}
    assert fsdp_restore.verify(tmp_path / "out.safetensors", against=tmp_path / "src.pt").verdict == "identical"
    _, structure = flatten(obj)
    plain = dict(structure["root"]["items"])["plain"]
    assert "hex" not in plain  # a file without such NaNs is written as before
