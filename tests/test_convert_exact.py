"""Convert keeps what torch.load returns, or refuses naming the path and the fix (issue 20, item 1). The
oracle is torch.load, which shares no code with our loader and flattener; `verify --against` must agree."""

import zipfile

import numpy as np
import pytest
import torch
from helpers import assert_same

import fsdp_restore
from fsdp_restore.convert import save
from fsdp_restore import UnsafePickleError, UnsupportedObjectError, convert
from fsdp_restore.read import Checkpoint
from fsdp_restore.verify import verify


def _roundtrip(tmp_path, obj, **save_kw):
    torch.save(obj, tmp_path / "src.pt", **save_kw)
    convert(tmp_path / "src.pt", tmp_path / "out.safetensors")
    return fsdp_restore.load(tmp_path / "out.safetensors")


def _deflate(src, dst):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)


def test_deflate_compressed_members_convert_exactly(tmp_path):
    obj = {"w": torch.randn(64, 33), "ids": torch.arange(1000), "step": 3}
    torch.save(obj, tmp_path / "plain.pt")
    _deflate(tmp_path / "plain.pt", tmp_path / "src.pt")
    with pytest.warns(UserWarning, match="DEFLATE"):
        convert(tmp_path / "src.pt", tmp_path / "out.safetensors")
    assert_same(fsdp_restore.load(tmp_path / "out.safetensors"), torch.load(tmp_path / "src.pt"))
    assert verify(tmp_path / "out.safetensors", against=tmp_path / "src.pt").verdict == "identical"


def test_a_zip_method_torch_cannot_read_is_refused(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as zin, zipfile.ZipFile(tmp_path / "src.pt", "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename), compress_type=zipfile.ZIP_BZIP2)
    with pytest.raises(fsdp_restore.FormatError, match="src.pt.*zip method 12.*cannot read"):
        convert(tmp_path / "src.pt", tmp_path / "out.safetensors")


def test_conj_and_neg_views_are_kept(tmp_path):
    c = torch.randn(5, dtype=torch.complex64)
    x = torch.randn(6)
    obj = {"c": c, "cc": c.conj(), "alone": torch.randn(3, dtype=torch.complex64).conj(), "x": x,
           "nx": torch._neg_view(x), "n_alone": torch._neg_view(torch.randn(4)),
           "both": torch._neg_view(torch.randn(2, dtype=torch.complex64).conj())}
    back = _roundtrip(tmp_path, obj)
    ref = torch.load(tmp_path / "src.pt")
    for name, t in ref.items():
        assert (back[name].is_conj(), back[name].is_neg()) == (t.is_conj(), t.is_neg()), name
        assert torch.equal(back[name].resolve_conj().resolve_neg(), t.resolve_conj().resolve_neg()), name
    assert back["cc"].untyped_storage().data_ptr() == back["c"].untyped_storage().data_ptr()
    assert back["nx"].untyped_storage().data_ptr() == back["x"].untyped_storage().data_ptr()
    assert verify(tmp_path / "out.safetensors", against=tmp_path / "src.pt").verdict == "identical"


def test_zero_dim_ndarray_keeps_its_shape(tmp_path):
    back = _roundtrip(tmp_path, {"a": np.array(2.5), "b": np.array(7, dtype=np.int32)})
    ref = torch.load(tmp_path / "src.pt", weights_only=False)
    for name, a in ref.items():
        assert back[name].shape == a.shape and back[name].dtype == a.dtype and back[name].tobytes() == a.tobytes()
    assert verify(tmp_path / "out.safetensors", against=tmp_path / "src.pt").ok


@pytest.mark.parametrize("value, what", [
    (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged), "NestedTensor"),
    (np.zeros(3, dtype=np.complex128), "complex128"),
    (torch.zeros(3, dtype=torch.complex128), "complex128"),
])
def test_unsupported_values_name_their_path(value, what, tmp_path):
    with pytest.raises(UnsupportedObjectError, match=f"'opt.state.0'.*{what}|{what}.*'opt.state.0'"):
        fsdp_restore.flatten({"opt": {"state": [value]}})


def _refused_by_no_reader(tmp_path, obj):
    """Converting ``obj`` either refuses, naming the path, or writes a file every reader opens, exactly."""
    try:
        save(obj, tmp_path / "out.safetensors")
    except UnsupportedObjectError as e:
        return str(e)
    from safetensors.torch import load_file

    load_file(str(tmp_path / "out.safetensors"))  # safetensors' own reader
    Checkpoint(tmp_path / "out.safetensors").load()
    return None


def test_deep_nesting_is_refused_at_conversion(tmp_path):
    obj = leaf = {}
    for _ in range(300):
        leaf["a"] = {}
        leaf = leaf["a"]
    leaf["w"] = torch.ones(2)
    message = _refused_by_no_reader(tmp_path, obj)
    assert message and "256" in message and "'a.a.a" in message
    fine = leaf = {}
    for _ in range(120):  # 240 levels: within the limit
        leaf["a"] = [{}]
        leaf = leaf["a"][0]
    assert _refused_by_no_reader(tmp_path, fine) is None


def test_a_metadata_named_key_is_stored_under_another_key(tmp_path):
    obj = {"__metadata__": torch.ones(2), "b": {"__metadata__": torch.zeros(1)}}
    assert _refused_by_no_reader(tmp_path, obj) is None
    torch.save(obj, tmp_path / "src.pt")
    convert(tmp_path / "src.pt", tmp_path / "c.safetensors")
    assert_same(fsdp_restore.load(tmp_path / "c.safetensors"), obj)
    assert verify(tmp_path / "c.safetensors", against=tmp_path / "src.pt").verdict == "identical"


def test_a_tensor_inside_a_dict_key_is_refused(tmp_path):
    message = _refused_by_no_reader(tmp_path, {"m": {(1, torch.ones(1)): 2}})
    assert message and "'m." in message and "dict keys" in message


@pytest.mark.parametrize("protocol", [4, 5])
def test_pickle_protocol_4_and_5_say_trust_pickle(tmp_path, protocol):
    obj = {"w": torch.randn(3), "step": 2}
    torch.save(obj, tmp_path / "src.pt", pickle_protocol=protocol)
    with pytest.raises(UnsafePickleError, match=f"protocol {protocol}.*--trust-pickle") as e:
        convert(tmp_path / "src.pt", tmp_path / "out.safetensors")
    assert "src.pt" in str(e.value)
    with pytest.warns(UserWarning, match="trust_pickle"):
        convert(tmp_path / "src.pt", tmp_path / "out.safetensors", trust_pickle=True)
    assert_same(fsdp_restore.load(tmp_path / "out.safetensors"), obj)
