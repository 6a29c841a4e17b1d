"""torch_zip.load returns what torch.load(mmap=True, weights_only=True) returns, and refuses what it refuses.

The oracle is torch.load itself (its own zip reader, its own per-record lookups), which shares no code with
torch_zip's offsets and storages: tensors must come back bit for bit, with the same dtype, shape, stride and
storage offset, and views that share a storage in torch's result must share one in ours (and only those).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pathlib
import pickle
import sys
import uuid
import warnings
import zipfile
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_restore import FormatError, UnsafePickleError, torch_zip
from fsdp_restore.mapped import MappedFile

convert_module = importlib.import_module("fsdp_restore.convert")  # the package's `convert` is the function
load_pt = convert_module.load_pt
ALLOWED = convert_module._allowlist()


def _torch_load(path: Any) -> Any:
    """The oracle: torch's own loader, with the allowlist load_pt gives it."""
    with torch.serialization.safe_globals(ALLOWED):
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")


def _saved_dtypes() -> list[torch.dtype]:
    """Every dtype torch.save writes and torch.load (weights_only) reads back in this torch (the quantized ones
    need a quantizer: a real quantized tensor is in `test_containers_parameters_and_allowlisted_values`)."""
    import io

    found = []
    for dtype in sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str):
        if str(dtype).startswith(("torch.qint", "torch.quint")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                buf = io.BytesIO()
                torch.save(torch.zeros(4 * dtype.itemsize, dtype=torch.uint8).view(dtype), buf)
                buf.seek(0)
                torch.load(buf, weights_only=True)
        except Exception:  # noqa: BLE001 (sub-byte dtypes torch cannot save: not ours to read)
            continue
        found.append(dtype)
    return found


DTYPES = _saved_dtypes()


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (bool: 0/1), any dtype torch can view bytes as."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _tensors(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided and not obj.is_quantized:  # those whose storage has an address
            out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _tensors(v, out)
    return out


def assert_exactly(ours: Any, ref: Any, path: str = "") -> None:
    """``ours`` is ``ref``: same types and values, tensors bit for bit with the same layout, same sharing."""
    assert type(ours) is type(ref), f"{path}: {type(ours)} != {type(ref)}"
    if isinstance(ref, torch.Tensor) and ref.layout != torch.strided:  # sparse: compared by value
        assert ours.layout == ref.layout and torch.equal(ours.to_dense(), ref.to_dense()), path
    elif isinstance(ref, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.stride(), ours.storage_offset(), ours.requires_grad) == (
            ref.dtype, ref.shape, ref.stride(), ref.storage_offset(), ref.requires_grad), path
        assert ours.is_quantized == ref.is_quantized, path
        if ref.is_quantized:
            assert (ours.qscheme(), ours.q_scale(), ours.q_zero_point()) == (ref.qscheme(), ref.q_scale(),
                                                                            ref.q_zero_point()), path
            assert torch.equal(ours.int_repr(), ref.int_repr()), path
            return
        assert ours.untyped_storage().nbytes() == ref.untyped_storage().nbytes(), path
        assert torch.equal(_storage_bytes(ours), _storage_bytes(ref)), f"{path}: bytes"
    elif isinstance(ref, np.ndarray):
        assert (ours.dtype, ours.shape, ours.tobytes()) == (ref.dtype, ref.shape, ref.tobytes()), path
    elif isinstance(ref, np.generic):
        assert (ours.dtype, ours.tobytes()) == (ref.dtype, ref.tobytes()), path
    elif isinstance(ref, dict):
        assert list(ours) == list(ref), path
        for k in ref:
            assert_exactly(ours[k], ref[k], f"{path}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), path
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert_exactly(a, b, f"{path}.{i}")
    elif isinstance(ref, argparse.Namespace):
        assert_exactly(vars(ours), vars(ref), path)
    elif isinstance(ref, float) and ref != ref:
        assert ours != ours, path
    else:
        assert ours == ref, f"{path}: {ours!r} != {ref!r}"
    if path == "":  # at the top: which tensors share a storage, and where in it they start
        a, b = _tensors(ours), _tensors(ref)
        assert len(a) == len(b)
        for i in range(len(b)):
            for j in range(i):
                same_ref = b[i].untyped_storage().data_ptr() == b[j].untyped_storage().data_ptr() != 0
                same_ours = a[i].untyped_storage().data_ptr() == a[j].untyped_storage().data_ptr() != 0
                assert same_ours == same_ref, f"storage sharing of tensors {j} and {i}"


def _roundtrip(tmp_path: pathlib.Path, obj: Any, name: str = "src.pt", **save_kw: Any) -> tuple[Any, Any]:
    path = tmp_path / name
    torch.save(obj, path, **save_kw)
    return torch_zip.load(path, ALLOWED), _torch_load(path)


# ---- the same result as torch.load -------------------------------------------------------------------------------


def test_every_dtype_torch_saves_comes_back_bit_for_bit(tmp_path):
    assert {torch.bfloat16, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.uint8} <= set(DTYPES)
    obj = {str(d): _random_tensor(d, (3, 5), seed=i) for i, d in enumerate(DTYPES)}
    obj.update({f"0-dim {d}": _random_tensor(d, (), seed=i) for i, d in enumerate(DTYPES)})
    obj.update({f"empty {d}": torch.empty((0, 3), dtype=d) for d in DTYPES})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        ours, ref = _roundtrip(tmp_path, obj)
    assert_exactly(ours, ref)


def test_views_keep_their_layout_and_share_their_storage(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    other = torch.randn(4, 4, dtype=torch.float64)
    obj = {"base": base, "t": base.t(), "rows": base[1:4], "step": base[:, ::3], "narrow": base.narrow(1, 2, 5),
           "expand": torch.ones(1, 3).expand(4, 3), "diag": torch.diagonal(other), "other": other,
           "strided": torch.as_strided(torch.arange(20.0), (3, 3), (5, 2), 1), "alone_view": torch.arange(9.0)[2:5],
           "tied": [base, base], "empty_a": torch.empty(0), "empty_b": torch.empty(0, 2)[:, :1]}
    ours, ref = _roundtrip(tmp_path, obj)
    assert_exactly(ours, ref)
    assert ours["tied"][0] is ours["tied"][1] and ours["t"].untyped_storage().data_ptr() == ours[
        "base"].untyped_storage().data_ptr()


def test_containers_parameters_and_allowlisted_values(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 2))
    obj = OrderedDict(
        nested={"a": [1, 2.5, float("nan"), None, True, "s", (3, [torch.ones(2)])], (1, "k"): {"deep": {"x": p}}},
        frozen=torch.nn.Parameter(torch.zeros(2), requires_grad=False), grad=torch.ones(2, requires_grad=True),
        np_array=np.arange(6.0).reshape(2, 3), np_int=np.int32(7), np_f16=np.float16(1.5), np_0d=np.array(2.5),
        ns=argparse.Namespace(lr=1e-3, name="run"), path=pathlib.PurePosixPath("/ckpt/x"), s={1, 2},
        c=3 + 4j, b=b"\x00bytes", big=2**70, dtype=torch.bfloat16, size=torch.Size([2, 3]), dev=torch.device("cpu"),
        coo=torch.randn(3, 3).relu().to_sparse(), csr=torch.eye(3).to_sparse_csr())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        obj["q"] = torch.quantize_per_tensor(torch.randn(4), 0.1, 3, torch.qint8)
        ours, ref = _roundtrip(tmp_path, obj)
    assert_exactly(ours, ref)


def test_a_training_checkpoint_with_rng_states(tmp_path):
    import random

    from helpers import tiny_gpt2, training_checkpoint

    obj = training_checkpoint(tiny_gpt2())
    assert "numpy" in obj["rng"] and obj["rng"]["python"] == random.getstate()
    ours, ref = _roundtrip(tmp_path, obj)
    assert_exactly(ours, ref)


@pytest.mark.slow  # 16 s on 2 cores: the reader's scale (the other tests cover its records)
def test_many_tensors(tmp_path):
    obj = {"layers": [{"w": torch.randn(8, 8), "b": torch.randn(8), "step": torch.tensor(3.0)} for _ in range(1500)]}
    ours, ref = _roundtrip(tmp_path, obj)
    assert_exactly(ours, ref)


def test_storage_offsets_are_the_ones_torchs_reader_finds(tmp_path):
    """Each record's data offset read from its local header (torch's alignment padding in the extra field) is
    where torch's reader says the record's data is."""
    path = tmp_path / "src.pt"
    torch.save({f"t{i}": torch.randn(i + 1) for i in range(50)} | {"e": torch.empty(0)}, path)
    reader = torch._C.PyTorchFileReader(str(path))
    names = reader.get_all_records()
    assert len([n for n in names if n.startswith("data/")]) == 51
    fd = os.open(path, os.O_RDONLY)
    try:
        records = torch_zip._Records(path, reader, fd, set(names), path.stat().st_size)
        for name in names:
            assert records.find(name) == (reader.get_record_offset(name), reader.get_record_size(name)), name
    finally:
        os.close(fd)


def test_tensors_lie_in_one_mapping_of_the_file(tmp_path):
    """convert reads each tensor's bytes with pread at the file offset its address gives (`MappedFile`)."""
    path = tmp_path / "src.pt"
    torch.save({"a": torch.randn(100), "b": torch.arange(7, dtype=torch.int16), "c": torch.randn(3, 3)[1:]}, path)
    obj = torch_zip.load(path, ALLOWED)
    mapped, raw = MappedFile(path), path.read_bytes()
    for name, t in obj.items():
        offset = mapped.offset_of(t)
        assert offset is not None, name
        nbytes = t.numel() * t.element_size()
        assert raw[offset:offset + nbytes] == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), name


def test_archives_rewritten_by_other_zip_writers(tmp_path):
    """Records without torch's alignment padding, and with zip64 extra fields in their local headers."""
    obj = {"w": torch.randn(5, 3), "i": torch.arange(7), "h": torch.randn(3).half(), "v": torch.randn(4, 4).t()}
    torch.save(obj, tmp_path / "src.pt")
    for force_zip64 in (False, True):
        out = tmp_path / f"rewritten{int(force_zip64)}.pt"
        with zipfile.ZipFile(tmp_path / "src.pt") as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                with zout.open(info.filename, "w", force_zip64=force_zip64) as f:
                    f.write(zin.read(info.filename))
        assert_exactly(torch_zip.load(out, ALLOWED), _torch_load(out))
        assert_exactly(load_pt(out), _torch_load(out))


_DTYPES_FOR_VIEWS = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64, torch.uint8]


@st.composite
def _nested(draw: Any, depth: int = 0) -> Any:
    """Nested containers of tensors, some of them views of one another."""
    if depth > 2 or draw(st.booleans()):
        dtype = draw(st.sampled_from(_DTYPES_FOR_VIEWS))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        t = _random_tensor(dtype, shape, seed=draw(st.integers(0, 99)))
        how = draw(st.sampled_from(["plain", "t", "slice", "step", "flat"]))
        if how == "t" and t.dim() >= 2:
            return [t, t.transpose(0, 1)]
        if how == "slice" and t.dim() >= 1:
            return (t, t[1:])
        if how == "step" and t.dim() >= 1:
            return t[::2]
        if how == "flat":
            return t.reshape(-1)
        return t
    kind = draw(st.sampled_from(["dict", "list", "tuple"]))
    items = draw(st.lists(_nested(depth + 1), max_size=3))
    if kind == "dict":
        return {f"k{i}": v for i, v in enumerate(items)}
    return items if kind == "list" else tuple(items)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_nested())
def test_random_nested_objects_with_views(tmp_path, obj):
    ours, ref = _roundtrip(tmp_path, {"root": obj})
    assert_exactly(ours, ref)


def test_load_pt_reads_a_plain_file_without_torch_load(tmp_path, monkeypatch):
    """The fast path is the one taken: neither torch.load nor the separate scan of the pickle runs."""
    obj = {"w": torch.randn(3), "n": np.arange(3)}
    torch.save(obj, tmp_path / "src.pt")
    ref = _torch_load(tmp_path / "src.pt")

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the slow path ran")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch.serialization, "get_unsafe_globals_in_checkpoint", refuse)
    assert_exactly(load_pt(tmp_path / "src.pt"), ref)


# ---- files torch.load reads instead ------------------------------------------------------------------------------


def _rewrite(src: pathlib.Path, dst: pathlib.Path, replace: dict[str, bytes | None] | None = None,
             compress: int = zipfile.ZIP_STORED, deflate: tuple[str, ...] = ()) -> pathlib.Path:
    """``src`` rewritten record by record: ``replace`` maps a record's name (after the archive's folder) to new
    bytes, or to None to leave it out; the records named in ``deflate`` are compressed (all with ``compress``)."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compress) as zout:
        for info in zin.infolist():
            short = info.filename.split("/", 1)[1]
            data = replace.get(short, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED if short in deflate else None)
    return dst


def test_files_it_does_not_reproduce_go_to_torch_load(tmp_path):
    obj = {"w": torch.randn(5), "i": torch.arange(4, dtype=torch.int32)}
    torch.save(obj, tmp_path / "src.pt")
    deflated = _rewrite(tmp_path / "src.pt", tmp_path / "deflated.pt", compress=zipfile.ZIP_DEFLATED)
    big = _rewrite(tmp_path / "src.pt", tmp_path / "big.pt", {"byteorder": b"big"})
    torch.save(obj, tmp_path / "p4.pt", pickle_protocol=4)
    torch.save(obj, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for path in (deflated, big, tmp_path / "p4.pt", tmp_path / "legacy.pt"):
        with pytest.raises(torch_zip.NotHandled):
            torch_zip.load(path, ALLOWED)
    with pytest.warns(UserWarning, match="DEFLATE"), torch.serialization.safe_globals(ALLOWED):
        assert_exactly(load_pt(deflated), torch.load(deflated, weights_only=True))  # (mapped, it would be garbage)
    assert_exactly(load_pt(big), _torch_load(big))  # big-endian records: what torch.load(mmap=True) makes of them


def test_a_torch_whose_zip_reader_lacks_a_call_goes_to_torch_load(tmp_path, monkeypatch):
    """torch 2.11's reader has no ``get_record_size`` (found on a GPU machine, where every conversion of a .pt
    failed): such a torch reads the file with torch.load, and the result is the same."""
    obj = {"w": torch.randn(5), "i": torch.arange(4, dtype=torch.int32)}
    torch.save(obj, tmp_path / "src.pt")
    real = torch._C.PyTorchFileReader

    class OlderReader:  # torch 2.11's calls, the one it lacks left out
        def __init__(self, path: str) -> None:
            self._reader = real(path)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._reader, name)

        get_record_header_offset = real.get_record_header_offset
        get_all_records = real.get_all_records

    monkeypatch.setattr(torch._C, "PyTorchFileReader", OlderReader)
    with pytest.raises(torch_zip.NotHandled, match="zip reader"):
        torch_zip.load(tmp_path / "src.pt", ALLOWED)
    back = load_pt(tmp_path / "src.pt")  # torch.load, through the same reader
    monkeypatch.undo()
    assert_exactly(back, _torch_load(tmp_path / "src.pt"))


def test_a_compressed_storage_record_found_while_unpickling_goes_to_torch_load(tmp_path):
    """Storage records are looked at when the pickle asks for them: a compressed one stops the unpickler (which
    has called allowed globals only) and torch.load reads the file, unmapped, as before."""
    obj = {"a": torch.randn(6), "b": torch.arange(5), "c": torch.randn(2, 2)}
    torch.save(obj, tmp_path / "src.pt")
    mixed = _rewrite(tmp_path / "src.pt", tmp_path / "mixed.pt", deflate=("data/1",))
    with pytest.raises(torch_zip.NotHandled, match="data/1"):
        torch_zip.load(mixed, ALLOWED)
    with pytest.warns(UserWarning, match="DEFLATE"):
        back = load_pt(mixed)
    for name, t in obj.items():
        assert torch.equal(back[name], t), name


def test_a_load_byte_order_set_by_the_user_goes_to_torch_load(tmp_path):
    torch.save({"w": torch.randn(5)}, tmp_path / "src.pt")
    no_mark = _rewrite(tmp_path / "src.pt", tmp_path / "nomark.pt", {"byteorder": None})
    assert_exactly(torch_zip.load(no_mark, ALLOWED), _torch_load(no_mark))  # default: little
    before = torch.serialization.get_default_load_endianness()
    torch.serialization.set_default_load_endianness(torch.serialization.LoadEndianness.BIG)
    try:
        with pytest.raises(torch_zip.NotHandled):
            torch_zip.load(no_mark, ALLOWED)
        assert_exactly(load_pt(no_mark), _torch_load(no_mark))
    finally:
        torch.serialization.set_default_load_endianness(before)


def test_a_torchscript_archive_is_refused_as_before(tmp_path):
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "ts.pt")
    with pytest.raises(torch_zip.NotHandled):
        torch_zip.load(tmp_path / "ts.pt", ALLOWED)
    with pytest.raises(FormatError, match="ts.pt"):
        load_pt(tmp_path / "ts.pt")


# ---- refusals: nothing outside the allowlist is imported or called -----------------------------------------------


class _Stub:
    """Pickled by reference as a GLOBAL of this module, with its arguments; the tests rename the GLOBAL."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Stub, self.args)


def _with_global(tmp_path: pathlib.Path, obj: Any, module: str, attr: str, name: str = "evil.pt") -> pathlib.Path:
    """A torch.save archive of ``obj`` whose pickle names the global ``module.attr`` where `_Stub` was."""
    torch.save(obj, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    stub = b"c" + _Stub.__module__.encode() + b"\n_Stub\n"
    assert data.count(stub) == 1, "a GLOBAL is written once, then taken from the memo"
    data = data.replace(stub, b"c" + module.encode() + b"\n" + attr.encode() + b"\n")
    return _rewrite(tmp_path / "plain.pt", tmp_path / name, {"data.pkl": data})


@pytest.fixture
def side_effect_module(tmp_path, monkeypatch):
    """A module whose import leaves a file behind: ``(module name, that file)``."""
    name = f"fsdp_restore_side_effect_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n\nclass Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, marker
    sys.modules.pop(name, None)


def test_a_global_outside_the_allowlist_is_never_imported(tmp_path, side_effect_module):
    module, marker = side_effect_module
    obj = {"w": torch.randn(3), "later": [torch.ones(2), _Stub()]}  # the global comes after tensors
    path = _with_global(tmp_path, obj, module, "Thing")
    with pytest.raises(pickle.UnpicklingError, match=f"{module}.Thing"):
        torch_zip.load(path, ALLOWED)
    with pytest.raises(UnsafePickleError, match=rf"evil\.pt: the pickle references {module}\.Thing.*--trust-pickle"):
        load_pt(path)
    assert not marker.exists() and module not in sys.modules


def test_os_system_in_a_hand_built_pickle_is_never_called(tmp_path):
    marker = tmp_path / "ran"
    path = _with_global(tmp_path, {"w": torch.randn(3), "x": _Stub(f"touch {marker}")}, "os", "system")
    with pytest.raises(pickle.UnpicklingError):
        torch_zip.load(path, ALLOWED)
    with pytest.raises(UnsafePickleError, match=r"references os\.system, which loading would import"):
        load_pt(path)
    assert not marker.exists()


def test_every_refused_global_is_named(tmp_path, side_effect_module):
    module, marker = side_effect_module
    torch.save({"w": torch.randn(2), "a": _Stub(), "b": datetime.timedelta(days=1)}, tmp_path / "two.pt")
    with zipfile.ZipFile(tmp_path / "two.pt") as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    data = data.replace(b"c" + _Stub.__module__.encode() + b"\n_Stub\n", b"c" + module.encode() + b"\nThing\n")
    path = _rewrite(tmp_path / "two.pt", tmp_path / "evil.pt", {"data.pkl": data})
    with pytest.raises(UnsafePickleError, match=rf"references datetime\.timedelta, {module}\.Thing, which"):
        load_pt(path)
    assert not marker.exists() and module not in sys.modules


def test_allow_globals_extends_the_allowlist_on_the_fast_path(tmp_path, monkeypatch):
    obj = {"w": torch.randn(2), "every": datetime.timedelta(hours=3)}
    torch.save(obj, tmp_path / "src.pt")
    with pytest.raises(UnsafePickleError, match=r"datetime\.timedelta.*--allow-global"):
        load_pt(tmp_path / "src.pt")
    monkeypatch.setattr(torch, "load", None)  # and torch.load is not what reads it
    back = load_pt(tmp_path / "src.pt", allow_globals=["datetime.timedelta"])
    assert back["every"] == obj["every"] and torch.equal(back["w"], obj["w"])


# ---- corrupt archives: FormatError naming the file ---------------------------------------------------------------


@pytest.fixture
def plain(tmp_path):
    path = tmp_path / "src.pt"
    torch.save({"a": torch.randn(64), "b": torch.arange(16)}, path)
    return path


def _header_offset(path: pathlib.Path, short: str) -> int:
    with zipfile.ZipFile(path) as z:
        return next(i.header_offset for i in z.infolist() if i.filename.endswith("/" + short))


def test_a_broken_local_header_is_a_format_error(plain, tmp_path):
    raw = bytearray(plain.read_bytes())
    at = _header_offset(plain, "data/1")
    raw[at:at + 4] = b"XXXX"
    bad = tmp_path / "badheader.pt"
    bad.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=r"badheader\.pt.*no zip local header"):
        load_pt(bad)


def test_a_missing_storage_record_is_a_format_error(plain, tmp_path):
    bad = _rewrite(plain, tmp_path / "missing.pt", {"data/1": None})
    with pytest.raises(FormatError, match=r"missing\.pt.*'data/1', which the archive does not hold"):
        load_pt(bad)


def test_a_record_shorter_than_its_tensor_is_a_format_error(plain, tmp_path):
    with zipfile.ZipFile(plain) as z:
        short = z.read(next(n for n in z.namelist() if n.endswith("/data/0")))[:100]
    bad = _rewrite(plain, tmp_path / "short.pt", {"data/0": short})
    with pytest.raises(FormatError, match=r"short\.pt.*'data/0' holds 100 bytes, the pickle says 256"):
        load_pt(bad)


def test_a_truncated_pickle_is_a_format_error(plain, tmp_path):
    with zipfile.ZipFile(plain) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    bad = _rewrite(plain, tmp_path / "cut.pt", {"data.pkl": data[: len(data) // 2]})
    with pytest.raises(FormatError, match=r"cut\.pt"):
        load_pt(bad)


def test_a_truncated_archive_is_a_format_error(plain, tmp_path):
    raw = plain.read_bytes()
    for n in (len(raw) // 2, len(raw) - 10):
        bad = tmp_path / f"trunc{n}.pt"
        bad.write_bytes(raw[:n])
        with pytest.raises(FormatError, match=rf"trunc{n}\.pt"):
            load_pt(bad)


def test_a_local_header_name_that_is_not_utf8_loads_as_torch_loads_it(plain, tmp_path):
    """The pickle's local header flagged UTF-8 with a byte that is not (found by the fuzz test below): zipfile's
    UnicodeDecodeError, met while looking for the pickle protocol for a hint, escaped load_pt; torch's own reader
    does not mind the name, so load_pt returns what torch.load returns."""
    deflated = _rewrite(plain, tmp_path / "deflated.pt", compress=zipfile.ZIP_DEFLATED)  # not torch_zip's: the hint
    raw = bytearray(deflated.read_bytes())
    at = _header_offset(deflated, "data.pkl")
    raw[at + 7] |= 0x08  # general purpose flag bit 11: the name is UTF-8
    raw[at + 30] = 0x80  # the name's first byte: not UTF-8
    bad = tmp_path / "badname.pt"
    bad.write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the DEFLATE warning
        ours = load_pt(bad)
        with torch.serialization.safe_globals(ALLOWED):
            ref = torch.load(bad, weights_only=True)
    assert_exactly(ours, ref)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_mutated_archives_load_exactly_or_fail_cleanly(tmp_path, plain, data):
    """Bytes flipped anywhere: load_pt returns what torch.load returns, or raises FormatError / UnsafePickleError."""
    raw = bytearray(plain.read_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    bad = tmp_path / "mutated.pt"
    bad.write_bytes(bytes(raw))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = load_pt(bad)
    except (FormatError, UnsafePickleError) as e:
        assert "mutated.pt" in str(e)
        return
    try:
        ref = _torch_load(bad)
    except Exception:  # noqa: BLE001 (torch's reader is stricter about a record ours does not read, e.g. a crc)
        return
    assert_exactly(ours, ref)
