"""verify catches every kind of damage and names the key; a good file passes."""

import json
import struct

import pytest
import torch

import fsdp_restore
from fsdp_restore.format import read_header
from fsdp_restore.verify import inspect_checkpoint, verify


@pytest.fixture
def good(tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"model": {"a": torch.arange(100.0), "b": torch.ones(50, dtype=torch.int32)}, "step": 3}, src)
    fsdp_restore.convert(src, tmp_path / "out.safetensors")
    return src, tmp_path / "out.safetensors"


def _flip(path, key, byte=3):
    entry = read_header(path).entries[key]
    data = bytearray(path.read_bytes())
    data[entry.offset + byte] ^= 0xFF
    path.write_bytes(bytes(data))


def test_good_file_passes(good):
    src, dst = good
    assert verify(dst).ok
    report = verify(dst, against=src)
    assert report.ok and report.checksummed == 2 and report.compared == 2


def test_flipped_byte_names_the_key(good):
    src, dst = good
    _flip(dst, "model.b")
    report = verify(dst)
    assert not report.ok and report.problems[0][0] == "model.b" and "checksum" in report.problems[0][1]
    assert any(k == "model.b" and "differ" in m for k, m in verify(dst, against=src).problems)


def test_selected_subtree_against_source(good, tmp_path):
    src, _ = good
    fsdp_restore.convert(src, tmp_path / "model.safetensors", select="model", dtype="bf16")
    hinted = verify(tmp_path / "model.safetensors", against=src)
    assert not hinted.ok and any("--select" in m for _, m in hinted.problems)
    report = verify(tmp_path / "model.safetensors", against=src, select="model")
    assert report.ok and report.compared == 2, report.problems
    state = torch.load(src)
    state["model"]["a"][7] += 1
    torch.save(state, src)
    changed = verify(tmp_path / "model.safetensors", against=src, select="model")
    assert [k for k, _ in changed.problems] == ["a"]
    wrong = verify(tmp_path / "model.safetensors", against=src, select="nope")
    assert not wrong.ok and "no key 'nope'" in wrong.problems[0][1]


def test_truncated_file(good):
    _, dst = good
    dst.write_bytes(dst.read_bytes()[:-10])
    report = verify(dst)
    assert not report.ok and "truncated" in report.problems[0][1]


def test_swapped_tensor_against_source(tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"x": torch.zeros(4), "y": torch.ones(4)}, src)
    fsdp_restore.save({"x": torch.ones(4), "y": torch.zeros(4)}, tmp_path / "swapped.safetensors")
    report = verify(tmp_path / "swapped.safetensors", against=src)
    assert sorted(k for k, _ in report.problems) == ["x", "y"]


def test_missing_key(tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"x": torch.zeros(4), "y": torch.ones(4)}, src)
    fsdp_restore.save({"x": torch.zeros(4)}, tmp_path / "less.safetensors")
    report = verify(tmp_path / "less.safetensors", against=src)
    assert ("y", "in the source but missing from the checkpoint") in report.problems


def test_corrupt_header_is_reported_not_raised(good):
    _, dst = good
    data = bytearray(dst.read_bytes())
    data[0:8] = struct.pack("<Q", 10**12)
    dst.write_bytes(bytes(data))
    report = verify(dst)
    assert not report.ok and "header length" in report.problems[0][1]


def test_inspect_json(good):
    _, dst = good
    info = inspect_checkpoint(dst)
    assert info["tensors"] == 2 and info["bytes"] == 600 and info["checksums"] == 2
    model = info["tree"]["children"][0]
    assert model["name"] == "model" and model["bytes"] == 600 and model["tensors"] == 2
    json.dumps(info)
