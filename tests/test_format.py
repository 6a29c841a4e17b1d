"""Every malformed header is a FormatError naming the file: proven with a grammar-based fuzz that puts
lists, objects, bools, huge integers and deep nesting into every slot of a safetensors header."""

from __future__ import annotations

import json
import re

import pytest
from helpers import raw_safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_restore import FormatError
from fsdp_restore.format import read_header

DEEP = 100_000


def _deep(opening: str, closing: str) -> str:
    return opening * DEEP + closing * DEEP


# JSON values of every kind, including the ones no field may hold
_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([2**64, -1, 0, 10**30])
            | st.floats(allow_nan=False) | st.text(max_size=6) | st.sampled_from(["F32", "I8", "BF16", "F7"]))
_junk = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                     max_leaves=8)


def _slot(valid):
    return st.one_of(valid, _junk)


_entry = st.fixed_dictionaries({"dtype": _slot(st.sampled_from(["F32", "U8"])),
                                "shape": _slot(st.lists(st.integers(0, 3), max_size=2)),
                                "data_offsets": _slot(st.just([0, 4]))})
_header = st.dictionaries(st.text(min_size=1, max_size=5), _slot(_entry), max_size=3).flatmap(
    lambda h: st.one_of(st.just(h), _junk.map(lambda m: {**h, "__metadata__": m}),
                        st.dictionaries(st.text(max_size=3), _junk, max_size=2).map(lambda m: {**h, "__metadata__": m})))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_header, st.binary(max_size=16))
def test_fuzz_header_grammar(tmp_path, header, data):
    path = tmp_path / "g.safetensors"
    path.write_bytes(raw_safetensors(json.dumps(header), data))
    try:
        read_header(path)
    except FormatError as e:
        assert str(path) in str(e)


@pytest.mark.parametrize("name,text,message", [
    ("dtype_list", '{"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', "unknown dtype"),
    ("dtype_dict", '{"a": {"dtype": {"x": 1}, "shape": [1], "data_offsets": [0, 4]}}', "unknown dtype"),
    ("shape_bool", '{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', "shape"),
    ("shape_bool_second", '{"a": {"dtype": "U8", "shape": [4, true], "data_offsets": [0, 4]}}', "shape .* non-negative"),
    ("shape_negative", '{"a": {"dtype": "U8", "shape": [-2, -2], "data_offsets": [0, 4]}}', "shape .* non-negative"),
    ("shape_float", '{"a": {"dtype": "U8", "shape": [4.0], "data_offsets": [0, 4]}}', "shape .* non-negative"),
    ("shape_text", '{"a": {"dtype": "U8", "shape": "4", "data_offsets": [0, 4]}}', "shape .* non-negative"),
    ("shape_null", '{"a": {"dtype": "U8", "shape": null, "data_offsets": [0, 4]}}', "shape .* non-negative"),
    ("shape_nested", '{"a": {"dtype": "U8", "shape": [[4]], "data_offsets": [0, 4]}}', "shape .* non-negative"),
    ("offset_bool", '{"a": {"dtype": "U8", "shape": [1], "data_offsets": [false, true]}}', "data_offsets"),
    ("huge_int", '{"a": {"dtype": "U8", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 1]}}', "not usable JSON"),
    ("huge_shape", '{"a": {"dtype": "U8", "shape": [18446744073709551616], "data_offsets": [0, 1]}}', "need"),
    ("deep_list", _deep("[", "]"), "nested too deeply"),
    ("deep_dict", _deep('{"a":', "}"), "nested too deeply"),
    ("metadata_list", '{"__metadata__": []}', "__metadata__"),
    ("metadata_null", '{"__metadata__": null}', "__metadata__"),
    ("metadata_nested", '{"__metadata__": {"k": {"v": 1}}}', "__metadata__"),
    ("entry_list", '{"a": [1, 2]}', "not a JSON object"),
])
def test_crafted_header_is_a_format_error(tmp_path, name, text, message):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(raw_safetensors(text, b"\0" * 4))
    with pytest.raises(FormatError, match=message) as info:
        read_header(path)
    assert str(path) in str(info.value)


# ---- the header's own checksum (issue 20, item 2) ------------------------------------------------------------


def _convert(tmp_path, sharded=False):
    """A small training checkpoint converted by convert: lr 0.001 and step 12345 live only in the header."""
    import torch

    import fsdp_restore

    src = tmp_path / "run.pt"
    torch.save({"model": {"w": torch.arange(6.0).view(2, 3)},
                "optim": {"param_groups": [{"lr": 0.001, "params": [0]}]}, "step": 12345}, src)
    dst = tmp_path / ("run_dir" if sharded else "run.safetensors")
    fsdp_restore.convert(src, dst, max_shard_size=8 if sharded else None)
    return src, dst


def _edit(path, old: bytes, new: bytes) -> None:
    """Overwrite bytes in place (same length, so every offset stays valid), as a hex editor would."""
    data = path.read_bytes()
    assert old in data and len(old) == len(new)
    path.write_bytes(data.replace(old, new, 1))


@pytest.mark.parametrize("old, new", [(b"0.001", b"0.000"), (b"12345", b"12344"),
                                      (b'"shape":[2,3]', b'"shape":[3,2]')], ids=["lr", "step", "shape"])
def test_a_modified_header_is_refused_by_verify_and_readers(tmp_path, old, new):
    import torch

    import fsdp_restore

    src, dst = _convert(tmp_path)
    assert fsdp_restore.load(dst)["optim"]["param_groups"][0]["lr"] == torch.load(src)["optim"]["param_groups"][0]["lr"]
    _edit(dst, old, new)
    report = fsdp_restore.verify(dst)
    assert not report.ok and report.exit_code != 0
    assert any("header" in what and "modified" in what for _, what in report.problems), report.problems
    for reader in (fsdp_restore.load, fsdp_restore.inspect_checkpoint, fsdp_restore.open_checkpoint):
        with pytest.raises(FormatError, match=r"run\.safetensors.*header.*modified.*convert its source \(run\.pt, as"
                                               r" it records\) again with the options of its first conversion"
                                               r" \(fsdp-restore convert run\.pt \S+run\.safetensors --force, plus"):
            reader(dst)


def test_a_modified_index_is_refused(tmp_path):
    import fsdp_restore

    _, dst = _convert(tmp_path, sharded=True)
    _edit(dst / "model.safetensors.index.json", b"0.001", b"0.000")
    with pytest.raises(FormatError, match=r"index\.json.*header.*modified.*convert its source \(run\.pt, as it"
                                           r" records\) again .*\(fsdp-restore convert run\.pt \S+run_dir"
                                           r" --max-shard-size SIZE --force, plus --select or --dtype if"):
        fsdp_restore.load(dst)
    assert not fsdp_restore.verify(dst).ok


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "index"])
def test_a_header_whose_checksum_field_was_renamed_is_refused(tmp_path, sharded):
    """An edit that also renames the crc32 field (one letter) must not pass as another tool's unsealed file:
    the header still says it is of a sealed format version."""
    import fsdp_restore

    _, dst = _convert(tmp_path, sharded=sharded)
    target = dst / "model.safetensors.index.json" if sharded else dst
    _edit(target, b"0.001", b"0.000")
    _edit(target, b"fsdp_restore.header_crc32", b"fsdp_restore.Header_crc32")
    with pytest.raises(FormatError, match=r"modified.*format version 2.*header_crc32' field is gone"):
        fsdp_restore.load(dst)
    assert not fsdp_restore.verify(dst).ok


@pytest.mark.parametrize("new", [b"__metadatb__", b"_-metadatA__"], ids=["one-bit", "two-bytes"])
def test_a_damaged_metadata_key_is_named_as_damage(tmp_path, new):
    """A bit flipped in the header's '__metadata__' key hides the metadata (and its crc32) and leaves an entry that
    is no tensor: said as damage to the header, not as a tensor of unknown dtype."""
    import fsdp_restore

    _, dst = _convert(tmp_path)
    _edit(dst, b"__metadata__", new)
    with pytest.raises(FormatError, match=r"header is damaged: it holds '_.metadat.__' where safetensors writes"
                                           r" '__metadata__'.*copy the file again"):
        fsdp_restore.load(dst)
    assert not fsdp_restore.verify(dst).ok


def test_files_without_a_header_checksum_still_open(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    import fsdp_restore

    path = tmp_path / "hf.safetensors"
    save_file({"a": torch.ones(3), "b": torch.arange(4)}, path, metadata={"format": "pt"})
    got, expected = fsdp_restore.load(path), load_file(path)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_restore_refuses_a_modified_header(tmp_path):
    import torch
    from torch import nn

    import fsdp_restore

    _, dst = _convert(tmp_path)
    _edit(dst, b"12345", b"12344")
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(fsdp_restore.FsdpRestoreError, match=r"run\.safetensors.*header.*modified"):
        fsdp_restore.restore_model(model, dst)
    assert torch.equal(model.w.detach(), torch.zeros(2, 3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.text("abcxyz._", min_size=1, max_size=40),
                          st.sampled_from(["float32", "bfloat16", "int8"]), st.lists(st.integers(0, 5), max_size=3)),
                min_size=1, max_size=12, unique_by=lambda t: t[0]))
def test_the_data_section_starts_page_aligned_and_safetensors_reads_it(tmp_path, specs):
    """Whatever the header's length, our files' data start at a `DATA_ALIGNMENT` boundary (the header is padded
    with spaces, as the format allows), and safetensors' own reader gives back every tensor bit for bit."""
    import torch
    from safetensors.torch import load_file

    from fsdp_restore import verify
    from fsdp_restore.convert import save
    from fsdp_restore.format import DATA_ALIGNMENT
    from fsdp_restore.read import Checkpoint

    g = torch.Generator().manual_seed(len(specs))
    tensors = {name: torch.randint(-100, 100, shape, generator=g).to(getattr(torch, dtype))
               for name, dtype, shape in specs}
    path = tmp_path / "aligned.safetensors"
    path.unlink(missing_ok=True)
    save(tensors, path)
    raw = path.read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    assert data_start % DATA_ALIGNMENT == 0
    assert raw[data_start - 1:data_start] in (b" ", b"}")
    theirs = load_file(path)
    assert theirs.keys() == tensors.keys()
    for name, t in tensors.items():
        assert theirs[name].dtype == t.dtype
        assert torch.equal(theirs[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    with Checkpoint(path) as ours:  # and our reader: the header's seal and checksums hold over the padding
        for name, t in tensors.items():
            dest = torch.empty(t.numel(), dtype=t.dtype)
            ours.read_range(name, 0, dest)
            assert torch.equal(dest.view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert verify(path).ok


def test_a_tensor_named_like_the_metadata_field_is_refused():
    """safetensors keeps its metadata under "__metadata__": a tensor of that name would make the file unreadable
    (flatten never names one so; a model's parameter could be)."""
    import torch

    from fsdp_restore.format import build_header

    with pytest.raises(ValueError, match="__metadata__.*rename it"):
        build_header([("w", torch.float32, (2,)), ("__metadata__", torch.float32, (2,))], {})


def test_a_legacy_torch_save_file_is_told_from_any_pickle_or_garbage(tmp_path):
    """Legacy torch.save files start with torch's magic number, pickled (after a FRAME from protocol 4): only
    those are sent to torch's unpickler as one. A damaged safetensors file that came to start with b"\\x80\\x04"
    (hypothesis found it) was refused as a protocol-4 pickle (UnsafePickleError) instead of a bad file."""
    import io
    import pickle

    import torch

    import fsdp_restore
    from fsdp_restore.format import SNIFF_BYTES, is_legacy_torch_save

    for protocol in (0, 1, 2, 3, 4, 5):
        buf = io.BytesIO()
        torch.save({"a": torch.ones(2)}, buf, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
        assert is_legacy_torch_save(buf.getvalue()[:SNIFF_BYTES]), protocol
    assert not is_legacy_torch_save(pickle.dumps({"a": 1}, protocol=2)[:SNIFF_BYTES])
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"\x80\x04" + b"\x0f\x00" * 50)
    with pytest.raises(FormatError):
        fsdp_restore.load(path)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_plain_pickle_is_named_as_one_with_the_command_that_converts_it(tmp_path, protocol):
    """A pickle opened as a checkpoint said "header length 177538176 exceeds the 104857600 byte limit"; convert
    refuses a plain pickle too, so the error says what does read it."""
    import pickle

    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps({"step": 3, "lr": [0.1, 0.01]}, protocol=protocol))
    with pytest.raises(FormatError, match=re.escape(
            f"{path}: a plain pickle, not a safetensors file (its first bytes are pickle's), and nothing here reads"
            " one (unpickling runs code): where you trust it, load it and write what it holds with fsdp_restore.save")):
        read_header(path)
