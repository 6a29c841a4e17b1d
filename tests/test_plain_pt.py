"""The conversion of a plain checkpoint without torch (plain_pt): the same tree torch.load gives, the same file the
conversion through torch writes, and the torch path for everything else.

Oracles: torch.load (each tensor's dtype, shape, stride, offset, storage sharing and bytes; every other value), and
the file the torch path writes (byte for byte), itself proven against torch.load by the rest of the suite. The
lane is called directly here and `convert` is switched to the torch path (`helpers.through_torch`); the CLI tests
run `fsdp-restore convert` in a fresh process, where the lane is taken, and check torch was never imported (or,
with a cast, that torch's loader was not).
"""

from __future__ import annotations

import argparse
import importlib
import io
import math
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_restore import ConvertError, FormatError, UnsafePickleError, convert
from fsdp_restore.format import STORED_DTYPES
from fsdp_restore.plain_pt import NotPlain, StoredTensor, load_plain
from helpers import archive_records, through_torch, torch_archive

convert_module = importlib.import_module("fsdp_restore.convert")
plain_pt_module = importlib.import_module("fsdp_restore.plain_pt")  # the package's `convert` is the function

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


@pytest.fixture(autouse=True)
def _convert_through_torch():
    """`convert` here is the torch path, the oracle; the lane is called directly (`_lane`)."""
    with through_torch():
        yield


def _lane(src, dst, **options):
    defaults = {"select": None, "on_unsupported": "error", "threads": 2, "max_shard_size": None, "force": False,
                "progress": None}
    return convert_module._convert_plain(src, dst, **{**defaults, **options})


def _tensor(draw_shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, draw_shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(draw_shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, draw_shape, generator=g).to(dtype)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    t = _tensor(shape, dtype, draw(st.integers(0, 1000)))
    kind = draw(st.sampled_from(["plain", "param", "grad", "slice"]))
    if kind == "param":
        return torch.nn.Parameter(t, requires_grad=dtype.is_floating_point and draw(st.booleans()))
    if kind == "grad" and dtype.is_floating_point:
        return t.requires_grad_(True)
    if kind == "slice" and t.dim() and t.shape[0] > 1:
        return t[1:]  # a view into a larger storage, saved with its base's bytes
    return t


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=8))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 50))
leaves = st.one_of(scalars, tensors())
checkpoints = st.recursive(
    leaves, lambda children: st.one_of(
        st.dictionaries(keys, children, max_size=4), st.lists(children, max_size=4),
        st.tuples(children, children), st.dictionaries(st.text(max_size=6), children, max_size=3).map(OrderedDict)),
    max_leaves=12)


@st.composite
def shared(draw):
    """Tensors that share storage: a base, views of it, the same tensor twice, a tied Parameter."""
    base = _tensor((6, 4), draw(st.sampled_from(DTYPES[:4])), draw(st.integers(0, 100)))
    picks = draw(st.lists(st.sampled_from(["base", "row", "tail", "same", "param"]), min_size=1, max_size=5))
    made = {"base": base, "row": base[2], "tail": base[3:], "same": base, "param": torch.nn.Parameter(base)}
    return {f"{i}.{p}": made[p] for i, p in enumerate(picks)}


def _same_tree(ours, ref, path="") -> None:
    """``ours`` (load_plain) is what torch.load gave, tensor by tensor."""
    if isinstance(ref, torch.Tensor):
        assert type(ours) is StoredTensor, path
        assert str(ours.dtype) == str(ref.dtype) and tuple(ours.shape) == tuple(ref.shape), path
        assert ours.stride() == ref.stride() and ours.storage_offset() == ref.storage_offset(), path
        assert ours.requires_grad == ref.requires_grad and ours.param == (type(ref) is torch.nn.Parameter), path
        return
    assert type(ours) is type(ref), (path, type(ours), type(ref))
    if isinstance(ref, dict):
        assert list(ours) == list(ref), path
        for k in ref:
            _same_tree(ours[k], ref[k], f"{path}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), path
        for i, (a, b) in enumerate(zip(ours, ref)):
            _same_tree(a, b, f"{path}.{i}")
    elif isinstance(ref, float) and math.isnan(ref):
        assert math.isnan(ours) and struct.pack("<d", ours) == struct.pack("<d", ref), path
    else:
        assert ours == ref, path


def _tensor_leaves(obj):
    if isinstance(obj, torch.Tensor) or type(obj) is StoredTensor:
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensor_leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensor_leaves(v)


def _check_against_torch(path) -> None:
    ours, ref = load_plain(path), torch.load(path, mmap=True, weights_only=True)
    _same_tree(ours, ref)
    a, b = list(_tensor_leaves(ours)), list(_tensor_leaves(ref))
    raw = path.read_bytes()
    for i, (s, t) in enumerate(zip(a, b)):
        if t.numel() and t.is_contiguous():  # the bytes where the lane will read them are torch's values
            nbytes = t.numel() * t.element_size()
            got = raw[s.file_offset:s.file_offset + nbytes]
            assert got == t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        for j in range(i):  # storage shared exactly where torch shares it
            if t.numel() and b[j].numel():
                same = t.untyped_storage().data_ptr() == b[j].untyped_storage().data_ptr()
                assert (s.storage is a[j].storage) == same


def _same_output(tmp_path, obj, **options) -> None:
    src = tmp_path / "src.pt"
    torch.save(obj, src)
    _check_against_torch(src)
    for name in ("lane.safetensors", "torch.safetensors"):
        (tmp_path / name).unlink(missing_ok=True)
    report = _lane(src, tmp_path / "lane.safetensors", **options)
    assert report is not None, "the lane declined a plain checkpoint"
    convert(src, tmp_path / "torch.safetensors", **options)  # torch is imported here: the torch path
    assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=checkpoints)
def test_the_lane_writes_the_torch_paths_file(tmp_path, obj):
    _same_output(tmp_path, {"top": obj})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=shared())
def test_shared_storage_is_stored_as_the_torch_path_stores_it(tmp_path, obj):
    _same_output(tmp_path, obj)


def test_a_training_checkpoint_with_select_and_skip(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1, "cfg": {"lr": 1e-3, "name": "run"}}
    _same_output(tmp_path, ckpt)
    _same_output(tmp_path, ckpt, select="model")
    _same_output(tmp_path, ckpt, on_unsupported="skip")
    torch.save(ckpt, tmp_path / "src.pt")
    _lane(tmp_path / "src.pt", tmp_path / "lane", max_shard_size="200B")  # (shards: a directory)
    convert(tmp_path / "src.pt", tmp_path / "torch", max_shard_size="200B")
    lane = sorted(p.name for p in (tmp_path / "lane").iterdir())
    assert lane == sorted(p.name for p in (tmp_path / "torch").iterdir()) and len(lane) > 2


class Custom:  # a class torch's weights-only loader refuses
    pass


DECLINED = {
    "numpy array": {"a": np.arange(3)},
    "Namespace": {"args": argparse.Namespace(lr=0.1)},
    "torch.Size": {"s": torch.Size([2, 3])},
    "dtype": {"d": torch.float16},
    "device": {"d": torch.device("cpu")},
    "bytes": {"b": b"abc"},
    "a set": {"s": {1, 2}},
    "complex": {"c": 1 + 2j},
    "transposed": {"t": torch.randn(3, 4).t()},
    "complex tensor": {"c": torch.randn(3, dtype=torch.complex64)},
    "float8": {"f": torch.zeros(3, dtype=torch.float8_e4m3fn)},
    "conj view": {"c": torch.randn(3, dtype=torch.complex64).conj()},
}


@pytest.mark.parametrize("what", list(DECLINED))
def test_what_the_lane_does_not_reproduce_goes_to_torch(tmp_path, what):
    torch.save(DECLINED[what], tmp_path / "src.pt")
    assert _lane(tmp_path / "src.pt", tmp_path / "out.safetensors") is None
    assert not (tmp_path / "out.safetensors").exists()


def test_a_refused_global_is_refused_by_torch_as_before(tmp_path):
    torch.save({"w": torch.ones(2), "c": Custom()}, tmp_path / "src.pt")
    assert _lane(tmp_path / "src.pt", tmp_path / "out.safetensors") is None
    with pytest.raises(UnsafePickleError, match="Custom"):
        convert(tmp_path / "src.pt", tmp_path / "out.safetensors")


def _rewritten(tmp_path, pickle_bytes: bytes, records=None, base=None):
    """src.pt: a torch.save of ``base`` with its data.pkl replaced (and records replaced)."""
    torch.save({"w": torch.ones(2)} if base is None else base, tmp_path / "base.pt")
    return torch_archive(tmp_path / "src.pt", {**archive_records(tmp_path / "base.pt"), **(records or {}),
                                               "data.pkl": pickle_bytes})


@pytest.mark.parametrize("what,data", [
    ("a string longer than the pickle", b"\x80\x02X\xff\xff\xff\x7fab."),
    ("an unknown opcode", b"\x80\x02}\x8f."),
    ("BINBYTES (protocol 3)", b"\x80\x03C\x03abc."),
    ("protocol 4", b"\x80\x04}."),
    ("a never-called blocked global", b"\x80\x02cos\nsystem\n0}."),
    ("SETITEM on a list", b"\x80\x02]K\x01K\x02s."),
    ("no STOP", b"\x80\x02}"),
])
def test_hostile_or_odd_pickles_are_declined(tmp_path, what, data):
    src = _rewritten(tmp_path, data)
    with pytest.raises(NotPlain):
        load_plain(src)
    assert _lane(src, tmp_path / "out.safetensors") is None


def test_a_memo_index_near_2_to_the_32_costs_nothing(tmp_path):
    """LONG_BINPUT 2**32-1: torch's memo is a dict, and so is this one (Python's C unpickler would size a table)."""
    src = _rewritten(tmp_path, b"\x80\x02}r\xff\xff\xff\xffh\x00.".replace(b"h\x00", b"j\xff\xff\xff\xff"))
    assert load_plain(src) == torch.load(src, weights_only=True) == {}


@pytest.mark.parametrize("record,value", [("byteorder", b"big"), ("version", b"99\n"), (".format_version", b"2"),
                                          ("extra_record", b"x")])
def test_records_torch_reads_otherwise_are_declined(tmp_path, record, value):
    torch.save({"w": torch.ones(2)}, tmp_path / "base.pt")
    data = zipfile.ZipFile(tmp_path / "base.pt").read("base/data.pkl")
    src = _rewritten(tmp_path, data, {record: value})
    with pytest.raises(NotPlain):
        load_plain(src)


def test_a_deflated_archive_is_declined(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as zin, \
            zipfile.ZipFile(tmp_path / "src.pt", "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    with pytest.raises(NotPlain, match="compressed"):
        load_plain(tmp_path / "src.pt")


def test_a_tensor_past_its_storage_is_declined(tmp_path):
    """torch refuses a tensor whose view runs past its storage; the lane must not build it."""
    torch.save({"w": torch.ones(4)}, tmp_path / "base.pt")
    data = zipfile.ZipFile(tmp_path / "base.pt").read("base/data.pkl")
    bad = data.replace(b"K\x04\x85", b"K\x05\x85", 1)  # size (4,) -> (5,) over a 4-element storage
    assert bad != data
    src = _rewritten(tmp_path, bad, base={"w": torch.ones(4)})
    with pytest.raises(NotPlain, match="past the end"):
        load_plain(src)
    with pytest.raises(Exception):  # noqa: B017 - torch's own refusal, whatever its type
        torch.load(src, weights_only=True)


@pytest.mark.parametrize("args,weights,unused", [
    ([], torch.float32, "torch"), (["--dtype", "bf16"], torch.float32, "torch"),
    (["--dtype", "fp16"], torch.float32, "torch"), (["--dtype", "fp32"], torch.bfloat16, "torch"),
    (["--dtype", "fp16"], torch.bfloat16, "torch"), (["--dtype", "bf16"], torch.float64, "fsdp_restore.torch_zip")],
    ids=["same dtype", "fp32 to bf16", "fp32 to fp16", "bf16 to fp32", "bf16 to fp16", "fp64 to bf16"])
def test_the_cli_converts_a_plain_checkpoint_without_torch_or_its_loader(tmp_path, args, weights, unused):
    """The CLI in a fresh process: a same-dtype conversion never imports torch, nor does a cast of finite values
    that `plain_cast` makes (fp32 -> bf16 or fp16, bf16 -> fp32 or fp16...); another cast (fp64 -> bf16, which torch
    may round twice) imports it for the cast alone (torch's loader, `torch_zip`, never); either way the file is the
    torch path's."""
    obj = {"model": {"w": torch.randn(4, 3).to(weights), "b": torch.zeros(3).to(weights)},
           "optim": {"m": torch.randn(4, 3)}, "step": 7, "names": ["a", "b"]}
    torch.save(obj, tmp_path / "src.pt")
    code = ("import sys; from fsdp_restore.cli import main; rc = main(['convert', *sys.argv[1:]]);"
            f" assert {unused!r} not in sys.modules, '{unused} was imported'; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "src.pt"), str(tmp_path / "cli.safetensors"),
                          *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    convert(tmp_path / "src.pt", tmp_path / "torch.safetensors", dtype=args[1] if args else None)
    assert (tmp_path / "cli.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("target", ["bf16", "fp16", "fp32", "fp64"])
def test_a_cast_is_the_cast_torch_makes_of_what_torch_load_gives(tmp_path, target):
    """``--dtype`` on the lane: each tensor as safetensors' own reader reads it is torch.load's tensor cast by
    torch (floating tensors of one dimension or more; the rest as they were), bit for bit, and the file is the
    torch path's. The tensors cover several steps of the cast's staging buffer, odd sizes, views that start
    inside their storage (a read placed off the page's start), 0-dim and empty tensors and every source dtype."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3000, generator=g)
    obj = {"big": torch.randn(1_500_001, generator=g), "half": torch.randn(7, 5, generator=g).half(),
           "bf": torch.randn(33, generator=g).bfloat16(), "double": torch.randn(4, 4, generator=g).double(),
           "view": base[3:2003].view(40, 50), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3),
           "ints": torch.arange(5), "flags": torch.tensor([True, False]), "huge": torch.tensor([1e30, -2e-30])}
    if target == "fp16":  # 1e30 is beyond fp16: refused (as the next test checks)
        del obj["huge"]
    _same_output(tmp_path, obj, dtype=target)
    to = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[target]
    written = safetensors.torch.load_file(tmp_path / "lane.safetensors")
    loaded = torch.load(tmp_path / "src.pt", weights_only=True)
    assert set(written) == set(loaded)
    for key, t in loaded.items():
        expected = t.to(to) if t.is_floating_point() and t.dim() else t
        assert written[key].dtype == expected.dtype and written[key].shape == expected.shape, key
        assert torch.equal(_bits(written[key]), _bits(expected)), key


@pytest.mark.parametrize("target,obj,include", [
    ("fp16", {"model": {"w": torch.tensor([1.0, 1e6, -7e4]), "ok": torch.ones(3)}}, None),
    ("bf16", {"model": {"w": torch.ones(3)}, "optim": {"step": torch.arange(300.0), "lr": torch.tensor(0.1)}},
     ["model.*", "optim.step", "optim.lr"]),
    ("bf16", {"model": {"w": torch.tensor([1.0, 3.4e38, -3.39e38]), "ok": torch.ones(3)}}, None),
])
def test_a_cast_the_lane_refuses_is_refused_as_the_torch_path_refuses_it(tmp_path, target, obj, include):
    """Values a cast makes infinite, and whole numbers or 0-dim values it changes: the same error from the lane as
    from the torch path, naming the same tensors, and nothing written."""
    torch.save(obj, tmp_path / "src.pt")
    with pytest.raises(ConvertError) as lane:
        _lane(tmp_path / "src.pt", tmp_path / "lane.safetensors", dtype=target, cast_include=include)
    with pytest.raises(ConvertError) as torch_path:
        convert(tmp_path / "src.pt", tmp_path / "torch.safetensors", dtype=target, cast_include=include)
    assert str(lane.value) == str(torch_path.value)
    assert ("optim.step" in str(lane.value)) if include else ("model.w" in str(lane.value))
    assert not any(p.name != "src.pt" for p in tmp_path.iterdir())


@pytest.mark.parametrize("source,target,n", [(torch.float16, "fp32", 2 * 1024 * 1024 + 2),
                                             (torch.float64, "bf16", 524_290), (torch.float32, "bf16", 1_048_579)])
def test_a_cast_of_nans_writes_the_torch_paths_bytes(tmp_path, source, target, n):
    """torch's cast kernel writes a NaN one way in its vectorised loop and another in its scalar one (fp16 -> fp32,
    fp64 -> bf16), so by the NaN's place within a call and within each thread's share of it (the suite runs torch
    on one thread; a conversion runs it on every core): both paths cast in the same steps, several here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _same_output(tmp_path, {"w": torch.full((n,), -float("nan"), dtype=source)}, dtype=target)
    finally:
        torch.set_num_threads(threads)


def test_a_step_holding_a_nan_among_finite_values_is_cast_as_the_torch_path_casts_it(tmp_path):
    """An fp32 -> bf16 cast is made without torch step by step until a step holds a value whose cast is not finite
    (a NaN, an inf): that tensor's piece is then cast by torch, whole, as the torch path casts it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1_500_001, generator=g)
    w[1_200_000] = float("nan")  # in the second step of the cast's staging
    w[7] = float("inf")
    obj = {"model": {"w": w, "v": torch.randn(3000, generator=g)}, "optim": {"m": torch.randn(5, generator=g)}}
    _same_output(tmp_path, obj, dtype="bf16")
    written = safetensors.torch.load_file(tmp_path / "lane.safetensors")
    for key in ("model.w", "model.v"):
        expected = torch.load(tmp_path / "src.pt", weights_only=True)["model"][key.split(".")[1]].to(torch.bfloat16)
        assert torch.equal(written[key].isnan(), expected.isnan()), key
        finite = ~expected.isnan()
        assert torch.equal(_bits(written[key][finite]), _bits(expected[finite])), key


def _many_small(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Hundreds of small tensors as a model file holds them, with what a batched read or cast must leave to the piece
    by piece path: a NaN, an inf, values past 256 and 2048, 0-dim and empty tensors, other dtypes between the layers'
    ones (``dtype``), views into a shared storage (their bytes do not lie next to each other) and one tensor larger
    than a cast's step."""
    g = torch.Generator().manual_seed(seed)
    # ~80 KB each: a cast's step (4 MB of source) holds ~50 of them, so the tensors below fall in different steps
    model = {f"layers.{i}.w": torch.randn(125 + i % 7, 160, generator=g).to(dtype) for i in range(400)}
    model["layers.10.w"][1, 2] = float("nan")
    model["layers.20.w"][0, 0] = float("inf")
    model["layers.130.w"][2, 1] = 300.0  # past 256: bf16 no longer holds every whole number from there
    model["layers.140.w"][0, 1] = 3000.0  # past 2048: nor does fp16
    model.update({"a.scalar": torch.tensor(2.5), "a.empty": torch.zeros(0, 4), "a.half": torch.randn(9, generator=g).half(),
                  "a.ints": torch.arange(7), "a.big": torch.randn(1_200_000, generator=g)})
    base = torch.randn(64, 8, generator=g)
    model.update({f"views.{i}": base[i * 3:i * 3 + 2] for i in range(10)})
    return model


@pytest.mark.parametrize("dtype,source", [(None, torch.float32), ("bf16", torch.float32), ("fp16", torch.float32),
                                          ("fp32", torch.bfloat16)], ids=["same", "bf16", "fp16", "bf16 to fp32"])
@pytest.mark.parametrize("block_bytes", [None, 12_288])
def test_many_small_tensors_read_and_cast_together_are_each_what_torch_gives(tmp_path, monkeypatch, dtype, source,
                                                                          block_bytes):
    """The writer reads the pieces that lie next to each other in the source with one ``preadv`` and casts them
    (fp32 -> bf16 or fp16, bf16 -> fp32) with one call: each tensor is still torch.load's tensor (cast by torch),
    bit for bit, and the file is the torch path's, with blocks of the usual size and with blocks that cut tensors
    in pieces (a piece that is not a whole tensor is read and cast on its own)."""
    write_module = importlib.import_module("fsdp_restore.write")
    if block_bytes:
        monkeypatch.setattr(write_module, "BLOCK_BYTES", block_bytes)
    batched = []
    real = write_module.preadv_exactly
    monkeypatch.setattr(write_module, "preadv_exactly",
                        lambda fd, views, offset: (batched.append(len(views)), real(fd, views, offset))[1])
    _same_output(tmp_path, _many_small(dtype=source), dtype=dtype)
    assert max(batched) > 10  # the reads were batched (else this tests nothing new)
    written = safetensors.torch.load_file(tmp_path / "lane.safetensors")
    loaded = torch.load(tmp_path / "src.pt", weights_only=True)
    assert set(written) == set(loaded)
    for key, t in loaded.items():
        to = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype)
        expected = t.to(to) if to and t.is_floating_point() and t.dim() else t
        assert written[key].dtype == expected.dtype and written[key].shape == expected.shape, key
        assert torch.equal(_bits(written[key]), _bits(expected)), key


@pytest.mark.parametrize("offender", ["a value that rounds to inf", "whole numbers the cast changes",
                                      "a 0-dim value the cast changes"])
def test_a_cast_refused_among_many_small_tensors_is_refused_as_the_torch_path_refuses_it(tmp_path, offender):
    """A tensor the cast would change in a way the torch path refuses (an overflow; whole numbers past 256 and a
    0-dim value cast when asked for, which only the torch path's look at the whole tensor judges) in a run of small
    tensors cast together: the same error as the torch path's, naming that tensor alone, and nothing written."""
    obj, include = _many_small(), None
    if offender == "a value that rounds to inf":
        obj["layers.331.w"][2, 1] = 3.4e38
    elif offender == "whole numbers the cast changes":
        obj["layers.331.w"] = torch.arange(250.0, 265.0).reshape(3, 5)  # 257.0 is 256 in bf16
    else:
        obj["layers.331.w"], include = torch.tensor(0.1), ["layers.*", "layers.331.w"]  # 0-dim: cast only when named
    torch.save(obj, tmp_path / "src.pt")
    with pytest.raises(ConvertError) as lane:
        _lane(tmp_path / "src.pt", tmp_path / "lane.safetensors", dtype="bf16", cast_include=include)
    with pytest.raises(ConvertError) as torch_path:
        convert(tmp_path / "src.pt", tmp_path / "torch.safetensors", dtype="bf16", cast_include=include)
    assert str(lane.value) == str(torch_path.value) and "layers.331.w" in str(lane.value)
    assert "layers.330.w" not in str(lane.value) and "layers.332.w" not in str(lane.value)
    assert not any(p.name != "src.pt" for p in tmp_path.iterdir())


def test_a_load_endianness_torch_was_told_sends_the_conversion_through_torch(tmp_path, monkeypatch):
    """In a process that set torch's load endianness to big, torch.load byte-swaps a file that does not say its
    byte order (older torch.save files): `convert` then converts what torch.load gives, not the lane's reading."""
    monkeypatch.setattr(convert_module, "_TORCH_FREE_READS", True)  # as outside these tests
    torch.save({"w": torch.arange(8.0)}, tmp_path / "src.pt")
    raw = (tmp_path / "src.pt").read_bytes()
    assert raw.count(b"src/byteorder") == 2  # its local header and its directory entry: renamed, no longer read
    (tmp_path / "src.pt").write_bytes(raw.replace(b"src/byteorder", b"src/data/9999"))
    before = torch.serialization.get_default_load_endianness()
    torch.serialization.set_default_load_endianness(torch.serialization.LoadEndianness.BIG)
    try:
        expected = torch.load(tmp_path / "src.pt", weights_only=True)["w"]
        convert(tmp_path / "src.pt", tmp_path / "out.safetensors")
    finally:
        torch.serialization.set_default_load_endianness(before)
    assert not torch.equal(expected, torch.arange(8.0))  # byte-swapped
    assert torch.equal(_bits(safetensors.torch.load_file(tmp_path / "out.safetensors")["w"]), _bits(expected))


class _Storage:
    """Pickled as torch.save pickles a storage: a persistent id naming a record (see `_crafted`)."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Rebuild:
    """Pickled as a call of torch's tensor rebuild with the given arguments, whatever they are."""

    def __init__(self, *args) -> None:
        self.args = args

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


def _crafted(tmp_path, obj):
    """src.pt: a torch.save of {"w": 4 floats} whose pickle is ``obj`` pickled as torch.save pickles (protocol 2,
    storages as persistent ids), so that arguments torch.save never writes can be given."""
    class Pickler(pickle.Pickler):
        def persistent_id(self, value):
            if isinstance(value, _Storage):
                return ("storage", torch.FloatStorage, value.key, "cpu", value.numel)
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(obj)
    return _rewritten(tmp_path, buffer.getvalue(), base={"w": torch.ones(4)})


@pytest.mark.parametrize("what,obj", [
    ("a size past int64", {"w": _Rebuild(_Storage("0", 4), 0, (2**63, 0), (1, 1), False, OrderedDict())}),
    ("a stride past int64", {"w": _Rebuild(_Storage("0", 4), 0, (1,), (2**64,), False, OrderedDict())}),
    ("an offset past int64", {"w": _Rebuild(_Storage("0", 4), 2**64, (0,), (1,), False, OrderedDict())}),
    ("an element count past int64", {"w": _Rebuild(_Storage("0", 4), 0, (2**62, 2**62), (0, 0), False,
                                                    OrderedDict())}),
    ("one key as an empty and a full storage", {"a": _Rebuild(_Storage("0", 0), 0, (0,), (1,), False, OrderedDict()),
                                                "b": _Rebuild(_Storage("0", 4), 0, (4,), (1,), False, OrderedDict())}),
])
def test_tensors_torch_refuses_are_declined(tmp_path, what, obj):
    src = _crafted(tmp_path, obj)
    with pytest.raises(Exception):  # noqa: B017 - torch's own refusal, whatever its type
        torch.load(src, weights_only=True, mmap=True)
    with pytest.raises(NotPlain):
        load_plain(src)


@pytest.mark.parametrize("wrap", ["tensor", "parameter"])
def test_an_integer_tensor_that_requires_grad_is_declined(tmp_path, wrap):
    """torch.load(weights_only=True) refuses an int64 tensor or parameter pickled with requires_grad=True (only
    floating tensors can require gradients): the last NEWFALSE of the pickle (the outermost rebuild's
    requires_grad) made NEWTRUE. Found by a fault-injection review: without the tensor's check, only the slow
    bit-flip test failed."""
    base = {"i": torch.zeros(2, dtype=torch.int64)}
    if wrap == "parameter":
        base = {"i": torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)}
    torch.save(base, tmp_path / "b.pt")
    data = zipfile.ZipFile(tmp_path / "b.pt").read("b/data.pkl")
    at = data.rindex(b"\x89")
    src = _rewritten(tmp_path, data[:at] + b"\x88" + data[at + 1:], base=base)
    with pytest.raises(RuntimeError, match="floating point"):  # the oracle: torch's own refusal
        torch.load(src, weights_only=True)
    with pytest.raises(NotPlain, match="requires_grad"):
        load_plain(src)
    assert _lane(src, tmp_path / "out.safetensors") is None


def test_a_crafted_pickle_of_an_ordinary_tensor_loads_as_torch_loads_it(tmp_path):
    """The crafting above is faithful: the same arguments torch.save writes load alike."""
    src = _crafted(tmp_path, {"w": _Rebuild(_Storage("0", 4), 1, (3,), (1,), False, OrderedDict())})
    _check_against_torch(src)


def test_bytes_before_the_archive_are_declined(tmp_path):
    """Python's zip reader takes an archive after other bytes; torch's reader does not."""
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    (tmp_path / "src.pt").write_bytes(b"#!/bin/sh\nexit 0\n" + (tmp_path / "plain.pt").read_bytes())
    with pytest.raises(NotPlain):
        load_plain(tmp_path / "src.pt")


def test_record_names_that_differ_only_in_case_are_declined(tmp_path):
    """torch's zip reader finds records without regard to case: which of two it reads is its own choice."""
    torch.save({"w": torch.ones(2)}, tmp_path / "base.pt")
    torch_archive(tmp_path / "src.pt", {**archive_records(tmp_path / "base.pt"), "DATA/0": b"\0" * 8})
    with pytest.raises(NotPlain, match="record names"):
        load_plain(tmp_path / "src.pt")


def test_a_list_that_holds_itself_is_declined_at_once(tmp_path):
    """[L, L] where L holds itself: the walk visits each container once (it looped, or grew without bound)."""
    src = _rewritten(tmp_path, b"\x80\x02}X\x04\x00\x00\x00loop]q\x00h\x00h\x00\x86as.")
    assert _lane(src, tmp_path / "out.safetensors") is None
    assert not (tmp_path / "out.safetensors").exists()


def _declined_or_as_torch_reads(path, deepspeed: bool = False) -> str | None:
    """None where the lane declines ``path`` or reads what torch.load reads from it (every tensor the
    conversion would copy, at the bytes torch.load gives it); else what differs. ``deepspeed``: a file of a ZeRO
    checkpoint, against torch.load with the stand-ins the conversion's torch path allows (`zero.STAND_INS`)."""
    from fsdp_restore.plain_pt import StandIn, StoredSize, StoredZeroStage, load_plain_archive
    from fsdp_restore.zero import STAND_INS

    fd = os.open(path, os.O_RDONLY)
    try:
        ours = load_plain_archive(fd, deepspeed=deepspeed)[0]
    except NotPlain:
        return None
    finally:
        os.close(fd)
    try:
        with torch.serialization.safe_globals(STAND_INS if deepspeed else []):
            theirs = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any refusal of torch's
        return f"the lane reads a file torch.load refuses ({type(e).__name__}: {e})"
    data = path.read_bytes()
    stack = [(ours, theirs, "")]
    while stack:
        a, b, where = stack.pop()
        if isinstance(a, StoredTensor):
            if not a.is_contiguous():
                continue  # the conversion declines it (torch copies such a tensor)
            raw = b.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if b.numel() else b""
            if (str(a.dtype), a.shape) != (str(b.dtype), tuple(b.shape)) or \
                    data[a.file_offset:a.file_offset + len(raw)] != raw:
                return f"{where}: the lane's tensor is not torch.load's"
        elif type(a) is StandIn:  # torch's path: the stand-in class, its attributes set
            if f"{type(b).__module__}.{type(b).__name__}" != a.name or list(a.state) != list(vars(b)):
                return f"{where}: {a.name} with {list(a.state)} is not {type(b)} with {list(vars(b))}"
            stack += [(a.state[k], vars(b)[k], f"{where}.{k}") for k in a.state]
        elif type(a) is StoredSize or type(a) is StoredZeroStage:
            if type(b).__name__ != {StoredSize: "Size", StoredZeroStage: "ZeroStageEnum"}[type(a)] or a != b:
                return f"{where}: {a!r} is not {b!r}"
        elif isinstance(a, dict):
            if not isinstance(b, dict) or list(a) != list(b):
                return f"{where}: keys"
            stack += [(a[k], b[k], f"{where}.{k}") for k in a]
        elif isinstance(a, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                return f"{where}: a {type(a).__name__} of {len(a)}"
            stack += [(x, y, f"{where}.{i}") for i, (x, y) in enumerate(zip(a, b))]
        elif type(a).__name__ != "StoredStorage" and (type(a) is not type(b) or a != b):  # storages: declined
            return f"{where}: {a!r} != {b!r}"
    return None


def _flips(tmp_path, start: int | None):
    """Every single-bit flip of a small checkpoint from byte ``start`` (the central directory's, if None) on."""
    torch.save({"a": torch.arange(10.0), "b": {"c": torch.ones(3, dtype=torch.bfloat16)}, "step": 3,
                "l": [torch.zeros(2, dtype=torch.int64)]}, tmp_path / "base.pt")
    base = (tmp_path / "base.pt").read_bytes()
    if start is None:
        start = struct.unpack_from("<I", base, len(base) - 22 + 16)[0]  # the end record's directory offset
    path = tmp_path / "flipped.pt"
    for at in range(start, len(base)):
        for bit in range(8):
            flipped = bytearray(base)
            flipped[at] ^= 1 << bit
            path.write_bytes(flipped)
            yield at, bit, path


def test_every_bit_flip_of_the_zip_directory_is_declined_or_read_as_torch_reads_it(tmp_path):
    """Python's zip reader took archives torch's refuses (flag bits, sizes that differ, disk numbers, end-record
    counts, a directory attribute, a version it does not know): 938 of 5,232 flips of this directory were
    converted where torch.load refuses the file. The lane now reads only torch's layout."""
    wrong = [(at, bit, why) for at, bit, path in _flips(tmp_path, None)
             if (why := _declined_or_as_torch_reads(path)) is not None]
    assert not wrong, f"{len(wrong)} flips, e.g. {wrong[:3]}"


@pytest.mark.slow
def test_every_bit_flip_of_the_file_is_declined_or_read_as_torch_reads_it(tmp_path):
    """The local headers, the pickle, the small records and the data too."""
    wrong = [(at, bit, why) for at, bit, path in _flips(tmp_path, 0)
             if (why := _declined_or_as_torch_reads(path)) is not None]
    assert not wrong, f"{len(wrong)} flips, e.g. {wrong[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["records past 65,535", "data past 4 GiB"])
def test_zip64_archives_are_read_where_torch_reads_them(tmp_path, case):
    """torch.save's zip64 layouts: the end record's counts saturated (its zip64 record holds them), and sizes and
    offsets past 32 bits in each entry's zip64 field."""
    if case == "records past 65,535":
        obj = {f"t{i}": torch.full((2,), float(i)) for i in range(66_000)}
    else:
        obj = {"big": torch.zeros(2**32 + 100, dtype=torch.uint8), "after": torch.arange(5.0)}
        obj["big"][-3:] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    torch.save(obj, tmp_path / "src.pt")
    del obj
    ours = load_plain(tmp_path / "src.pt")
    theirs = torch.load(tmp_path / "src.pt", weights_only=True, mmap=True, map_location="cpu")
    assert list(ours) == list(theirs)
    fd = os.open(tmp_path / "src.pt", os.O_RDONLY)
    try:  # where the data was taken to start without the local headers: where they say (zip64's fields counted)
        archive = plain_pt_module._Archive(fd)
        assumed, _ = plain_pt_module.load_plain_archive(fd, archive=archive, assume_layout=True)
        archive.prove_assumed()
        assert [t.file_offset for t in assumed.values()] == [t.file_offset for t in ours.values()]
    finally:
        os.close(fd)
    with open(tmp_path / "src.pt", "rb") as f:
        for key in list(ours)[::997] + [list(ours)[-1]]:
            a, b = ours[key], theirs[key]
            tail = min(64, b.numel() * b.element_size())
            f.seek(a.file_offset + a.numel() * a.dtype.itemsize - tail)
            assert a.shape == tuple(b.shape) and f.read(tail) == b.view(-1).view(torch.uint8)[-tail:].numpy().tobytes()


def _padded(src, dst, record: str, extra: int = 64) -> None:
    """``src`` (a torch.save file) rewritten as ``dst`` with ``extra`` more bytes of padding in record ``record``'s
    local header (its alignment field made longer): a valid zip archive torch.load reads as before, whose record's
    data no longer starts where torch's writer puts it (the records after it, and the central directory, moved
    along; the directory's offsets and the end records say so)."""
    data = bytearray(open(src, "rb").read())
    with zipfile.ZipFile(src) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/" + record))
    at = info.header_offset
    name_len, extra_len = struct.unpack_from("<HH", data, at + 26)
    field = at + 30 + name_len  # torch's padding field: b"FB", its length, then padding
    assert data[field:field + 2] == b"FB" and struct.unpack_from("<H", data, field + 2)[0] == extra_len - 4
    struct.pack_into("<HH", data, at + 26, name_len, extra_len + extra)
    struct.pack_into("<H", data, field + 2, extra_len - 4 + extra)
    data[field + 4:field + 4] = b"Z" * extra
    end = len(data) - 22
    directory_at = struct.unpack_from("<I", data, end + 16)[0] + extra
    struct.pack_into("<I", data, end + 16, directory_at)
    if data[end - 20:end - 16] == b"PK\x06\x07":  # zip64's locator, then its end record, before the end record
        locator = end - 20
        struct.pack_into("<Q", data, locator + 8, struct.unpack_from("<Q", data, locator + 8)[0] + extra)
        struct.pack_into("<Q", data, locator - 56 + 48, directory_at)
    entry = directory_at
    while data[entry:entry + 4] == b"PK\x01\x02":  # every entry after the record: its header offset moved
        offset = struct.unpack_from("<I", data, entry + 42)[0]
        if offset > at:
            struct.pack_into("<I", data, entry + 42, offset + extra)
        n, e, c = struct.unpack_from("<HHH", data, entry + 28)
        entry += 46 + n + e + c
    open(dst, "wb").write(bytes(data))


def test_where_torchs_writer_puts_each_records_data_is_where_its_local_header_says(tmp_path):
    """`_Archive.assumed_data_at` (no read) against `_Archive.data_at` (the local header read), for records of
    every name length up to 100 and sizes around the alignment, written by torch's own writer."""
    records = {"data.pkl": b"\x80\x02}q\x00.", **{f"data/{'k' * n}": bytes(n * 7 % 130) for n in range(1, 100)}}
    path = torch_archive(tmp_path / "src.pt", records)
    fd = os.open(path, os.O_RDONLY)
    try:
        archive = plain_pt_module._Archive(fd)
        assumed = [archive.assumed_data_at(m) for m in archive.members]
        assert assumed == [archive.data_at(m) for m in archive.members]
        archive.prove_assumed()
        assert not archive.assumed
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", [None, "bf16"])  # bf16: cast records' crc32s are not checked by default
def test_data_not_where_torchs_writer_puts_it_is_converted_from_where_it_lies(tmp_path, monkeypatch, dtype):
    """The lane takes each storage's data to start where torch's writer puts it, without reading the record's
    local header first (a read per record, spread over the file: `_Archive.assumed_data_at`), and proves it before
    the first block of the output is written. A record whose header pads it otherwise, which torch.load reads from
    where it lies, is converted from there (by the torch path), not from where the lane took it to be."""
    values = {"a": torch.arange(100.0), "b": torch.arange(50, dtype=torch.int64), "c": torch.full((64,), 2.5)}
    torch.save(values, tmp_path / "base.pt")
    _padded(tmp_path / "base.pt", tmp_path / "src.pt", "data/2")
    loaded = torch.load(tmp_path / "src.pt", weights_only=True)  # the oracle: torch reads it as before
    assert all(torch.equal(loaded[k], v) for k, v in values.items())

    fd = os.open(tmp_path / "src.pt", os.O_RDONLY)
    try:
        archive = plain_pt_module._Archive(fd)
        plain_pt_module.load_plain_archive(fd, archive=archive, assume_layout=True)
        with pytest.raises(NotPlain, match="data/2'"):
            archive.prove_assumed()
    finally:
        os.close(fd)
    from fsdp_restore import write as write_module

    blocks = []
    real_block = write_module._write_block
    monkeypatch.setattr(write_module, "_write_block", lambda *a: blocks.append(a) or real_block(*a))
    lane = _lane(tmp_path / "src.pt", tmp_path / "lane.safetensors", dtype=dtype and STORED_DTYPES["bfloat16"])
    assert lane is None and not blocks  # declined before a block was written (`write_safetensors`'s before_write)
    monkeypatch.setattr(write_module, "_write_block", real_block)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.pt", "src.pt"]
    monkeypatch.setattr(convert_module, "_TORCH_FREE_READS", True)  # the lane, then the torch path
    convert(tmp_path / "src.pt", tmp_path / "out.safetensors", dtype=dtype)
    out = safetensors.torch.load_file(tmp_path / "out.safetensors")
    cast = {"a": torch.bfloat16, "c": torch.bfloat16} if dtype else {}
    assert all(torch.equal(out[k], v.to(cast.get(k, v.dtype))) for k, v in values.items())


def _renamed_over_after_flatten(monkeypatch, src, other):
    """``other`` renamed over ``src`` once the conversion has read the pickle, before it copies the bytes."""
    real = convert_module.flatten

    def racing(*args, **kwargs):
        flattened = real(*args, **kwargs)
        os.replace(other, src)
        return flattened

    monkeypatch.setattr(convert_module, "flatten", racing)


def test_a_source_renamed_over_while_it_is_read_is_read_whole_from_one_file(tmp_path, monkeypatch):
    """The lane read the archive by path, then opened the path again for the tensors' bytes: a file renamed over
    the source in between was read at the first file's offsets. Now one descriptor serves both."""
    first = {"w": torch.arange(64.0)}
    torch.save(first, tmp_path / "src.pt")
    torch.save({"w": -torch.arange(64.0)}, tmp_path / "other.pt")  # the same layout, other values
    _renamed_over_after_flatten(monkeypatch, tmp_path / "src.pt", tmp_path / "other.pt")
    assert _lane(tmp_path / "src.pt", tmp_path / "out.safetensors") is not None
    assert torch.equal(safetensors.torch.load_file(tmp_path / "out.safetensors")["w"], first["w"])


def test_the_torch_path_refuses_a_source_renamed_over_while_it_is_read(tmp_path, monkeypatch):
    """The torch path maps the file in torch.load and copies through a descriptor opened after it: a file renamed
    over the source in between is refused, not read at the first file's offsets."""
    torch.save({"w": torch.arange(64.0)}, tmp_path / "src.pt")
    torch.save({"w": -torch.arange(64.0)}, tmp_path / "other.pt")
    _renamed_over_after_flatten(monkeypatch, tmp_path / "src.pt", tmp_path / "other.pt")
    with pytest.raises(FormatError, match="replaced or rewritten while it was being read"):
        convert(tmp_path / "src.pt", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def _deepspeed_like(path) -> None:
    """A file as DeepSpeed saves a ZeRO rank's: its stage enum, loss scaler, ``torch.Size`` shapes and flat groups
    that carry its ``ds_id`` (pickled through ``_rebuild_from_type_v2``); DeepSpeed's own classes."""
    pytest.importorskip("deepspeed")  # its classes, pickled as DeepSpeed pickles them
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    flat = torch.arange(12.0)
    flat.ds_id = "0_141"
    torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum(3), "loss_scaler": LossScaler(2.0),
                                         "fp32_flat_groups": [flat], "partition_count": 2},
                "param_shapes": [OrderedDict(w=torch.Size([3, 4]))], "ds_version": "0.19.8"}, path)


def test_a_deepspeed_file_is_read_as_the_torch_path_reads_it(tmp_path):
    _deepspeed_like(tmp_path / "rank.pt")
    assert _declined_or_as_torch_reads(tmp_path / "rank.pt", deepspeed=True) is None
    fd = os.open(tmp_path / "rank.pt", os.O_RDONLY)
    try:
        read = plain_pt_module.load_plain_archive(fd, deepspeed=True)[0]
        with pytest.raises(NotPlain, match="global deepspeed"):  # a plain checkpoint's lane takes none of it
            plain_pt_module.load_plain_archive(fd)
    finally:
        os.close(fd)
    assert read["optimizer_state_dict"]["loss_scaler"].state == {"cur_scale": 2.0, "dynamic": False}
    assert not convert_module._lane_values(read)  # not flattened as tuples and ints


@pytest.mark.parametrize("what,old,new", [
    ("a tensor rebuilt as another type", b"ctorch\nTensor\n", b"ctorch\nSize\n"),
    ("an attribute other than ds_id", b"ds_id", b"ds_xx"),
    ("a stand-in made with arguments", b")\x81", b"N\x85\x81"),
])
def test_what_the_deepspeed_reader_declines(tmp_path, what, old, new):
    _deepspeed_like(tmp_path / "base.pt")
    data = archive_records(tmp_path / "base.pt")["data.pkl"]
    assert old in data, what
    src = torch_archive(tmp_path / "src.pt", {**archive_records(tmp_path / "base.pt"),
                                              "data.pkl": data.replace(old, new, 1)})
    fd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(NotPlain):
            plain_pt_module.load_plain_archive(fd, deepspeed=True)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_every_bit_flip_of_a_deepspeed_file_is_declined_or_read_as_the_torch_path_reads_it(tmp_path):
    _deepspeed_like(tmp_path / "base.pt")
    base = (tmp_path / "base.pt").read_bytes()
    path, wrong = tmp_path / "flipped.pt", []
    for at in range(len(base)):
        for bit in range(8):
            flipped = bytearray(base)
            flipped[at] ^= 1 << bit
            path.write_bytes(flipped)
            if (why := _declined_or_as_torch_reads(path, deepspeed=True)) is not None:
                wrong.append((at, bit, why))
    assert not wrong, f"{len(wrong)} flips, e.g. {wrong[:3]}"


def test_a_fifo_put_in_the_sources_place_is_declined_at_once(tmp_path, monkeypatch):
    """The source replaced by a FIFO after the lane saw a file there: its open blocked until a writer came."""
    import threading

    torch.save({"w": torch.ones(2)}, tmp_path / "src.pt")
    real = convert_module.check_destination

    def replaced(*args, **kwargs):  # called between the lane's is_file() and its open
        (tmp_path / "src.pt").unlink()
        os.mkfifo(tmp_path / "src.pt")
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_module, "check_destination", replaced)
    result = []
    thread = threading.Thread(target=lambda: result.append(_lane(tmp_path / "src.pt", tmp_path / "out.safetensors")),
                              daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        os.close(os.open(tmp_path / "src.pt", os.O_WRONLY | os.O_NONBLOCK))  # let the blocked open go
        thread.join(20)
        pytest.fail("the lane blocked on the FIFO")
    assert result == [None]
