"""The source archive's own crc32s, checked by every conversion of a ``torch.save`` file (source_crc.py).

The oracle for "damaged" is the archive's central directory as Python's `zipfile` reads it and `zlib.crc32` of
the record's bytes, not our reader; each damaged file is also shown to load silently with ``torch.load`` (the
check is what catches it)."""

from __future__ import annotations

import os
import struct
import zipfile
import zlib

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from safetensors.torch import load_file

import fsdp_restore
from fsdp_restore import FormatError
from fsdp_restore.errors import ConvertError

# the fused q, k, v views are stored apart, as flatten warns
pytestmark = pytest.mark.filterwarnings("ignore:tensors at model.q, model.k, model.v share storage")


def _record_span(path, suffix: str) -> tuple[int, int, int]:
    """(first data byte, size, recorded crc32) of the record whose name ends with ``suffix``, per `zipfile`."""
    with zipfile.ZipFile(path) as z:
        (info,) = [i for i in z.infolist() if i.filename.endswith(suffix)]
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size, info.CRC


def _flip(path, suffix: str, at: int = 0) -> None:
    """Flip the lowest bit of byte ``at`` of a record (a bit rotten on disk): its recorded crc32 no longer fits."""
    first, size, crc = _record_span(path, suffix)
    with open(path, "r+b") as f:
        f.seek(first + at)
        byte = f.read(1)
        f.seek(first + at)
        f.write(bytes([byte[0] ^ 1]))
    with open(path, "rb") as f:
        f.seek(first)
        assert zlib.crc32(f.read(size)) != crc


def _storage_of(path, key_path) -> str:
    """The record suffix ('data/N') of the storage behind a tensor, found by loading and matching bytes."""
    obj = torch.load(path, weights_only=True)
    t = obj
    for k in key_path:
        t = t[k]
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if "/data/" in info.filename and z.read(info) == torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().tobytes():
                return "data/" + info.filename.rpartition("/data/")[2]
    raise AssertionError("no record holds it")


def _checkpoint(path) -> dict:
    torch.manual_seed(0)
    shared = torch.randn(6, 4)
    fused = torch.randn(3, 8)
    obj = {"model": {"a.weight": torch.randn(16, 8), "b.weight": shared, "tied.weight": shared,
                     "q": fused[0], "k": fused[1], "v": fused[2], "part": torch.randn(10)[2:7]},
           "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(16, 8)}},
                     "param_groups": [{"lr": 0.001, "betas": (0.9, 0.95), "params": [0]}]},
           "config": {"optimizer": "adamw"}}
    torch.save(obj, path)
    return obj


def _nothing_written(dst) -> None:
    assert not os.path.exists(dst)
    assert not [n for n in os.listdir(os.path.dirname(dst)) if n.startswith("." + os.path.basename(dst))
                or ".tmp" in n], os.listdir(os.path.dirname(dst))


# torch's own reader for a plain file (``trust_pickle=True`` makes the conversion load it with torch), and ours
PATHS = [pytest.param({}, id="torch-free"), pytest.param({"trust_pickle": True}, id="torch.load")]


@pytest.mark.parametrize("how", PATHS)
def test_a_clean_checkpoint_converts_with_every_record_checked(tmp_path, how):
    src, dst = tmp_path / "c.pt", tmp_path / "c.safetensors"
    obj = _checkpoint(src)
    report = fsdp_restore.convert(src, dst, **how)
    check = report.source_check
    assert check is not None and check.unrecorded == 0
    with zipfile.ZipFile(src) as z:
        records = {i.filename for i in z.infolist()}
    checked = {r.name for r, _ in check.tiled} | {r.name for r in check.reread}
    assert checked == records  # every record: the pickle and the small ones read again, every storage
    tiled = {r.name: [k for k, _ in tiles] for r, tiles in check.tiled}
    # whole storages and a tied pair are checked from the written tensors' checksums; a fused storage whose three
    # views tile it too; a view of part of its storage is read again
    assert sorted(tiled[next(n for n in tiled if n.endswith(_storage_of(src, ["model", "a.weight"])))]) == [
        "model.a.weight"]
    assert len(tiled[next(n for n in tiled if n.endswith(_storage_of(src, ["model", "b.weight"])))]) == 1
    assert [k for n, k in tiled.items() if n.endswith(_storage_of(src, ["model", "q"]))] == [
        ["model.q", "model.k", "model.v"]]
    reread = {r.name for r in check.reread}
    assert any(n.endswith(_storage_of(src, ["model", "part"])) for n in reread)
    assert all(n.endswith(("data.pkl", "version", "byteorder", ".format_version", ".storage_alignment",
                           "serialization_id")) or "/data/" in n for n in reread)
    torch.testing.assert_close(load_file(dst)["model.a.weight"], obj["model"]["a.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("how", PATHS)
@pytest.mark.parametrize("where", ["weight", "optimizer moment", "fused view", "partial view", "pickle"])
def test_a_flipped_bit_in_any_record_is_named_and_nothing_is_written(tmp_path, how, where):
    src, dst = tmp_path / "c.pt", tmp_path / "c.safetensors"
    _checkpoint(src)
    suffix = {"weight": lambda: _storage_of(src, ["model", "a.weight"]),
              "optimizer moment": lambda: _storage_of(src, ["optim", "state", 0, "exp_avg"]),
              "fused view": lambda: _storage_of(src, ["model", "k"]),
              "partial view": lambda: _storage_of(src, ["model", "part"]),
              "pickle": lambda: "data.pkl"}[where]()
    if where == "pickle":  # a letter of a string value: the pickle still loads, with "adamw" changed
        first, size, _ = _record_span(src, suffix)
        with open(src, "rb") as f:
            f.seek(first)
            at = f.read(size).index(b"adamw") + 4
    else:
        at = 37 if where != "partial view" else 0  # (byte 0 of "part"'s storage lies outside the view)
    _flip(src, suffix, at)
    torch.load(src, weights_only=True)  # torch loads it without a word
    with pytest.raises(FormatError) as info:
        fsdp_restore.convert(src, dst, **how)
    text = str(info.value)
    assert str(src) in text and suffix in text and "differ from the crc32 torch.save recorded" in text
    assert "Copy the checkpoint again" in text
    if where == "weight":
        assert "tensors model.a.weight" in text
    _nothing_written(dst)


def test_a_cast_conversion_reads_the_records_again(tmp_path):
    src, dst = tmp_path / "c.pt", tmp_path / "c.safetensors"
    _checkpoint(src)
    report = fsdp_restore.convert(src, dst, dtype="bf16")
    reread = {r.name for r in report.source_check.reread}
    assert any(n.endswith(_storage_of(src, ["model", "a.weight"])) for n in reread)  # cast: not its written bytes
    _flip(src, _storage_of(src, ["model", "a.weight"]), 5)
    with pytest.raises(FormatError, match="differ from the crc32"):
        fsdp_restore.convert(src, tmp_path / "d.safetensors", dtype="bf16")
    _nothing_written(tmp_path / "d.safetensors")


def test_a_select_checks_only_what_it_converts(tmp_path):
    src = tmp_path / "c.pt"
    _checkpoint(src)
    _flip(src, _storage_of(src, ["optim", "state", 0, "exp_avg"]), 9)
    report = fsdp_restore.convert(src, tmp_path / "m.safetensors", select="model")  # the optimizer's not read
    assert report.source_check.records > 0
    with pytest.raises(FormatError, match="differ from the crc32"):
        fsdp_restore.convert(src, tmp_path / "all.safetensors")


def test_an_archive_saved_without_crc32s_converts_and_says_so(tmp_path):
    src, dst = tmp_path / "c.pt", tmp_path / "c.safetensors"
    torch.serialization.set_crc32_options(False)
    try:
        _checkpoint(src)
    finally:
        torch.serialization.set_crc32_options(True)
    report = fsdp_restore.convert(src, dst)
    assert report.source_check.records == 0 and report.source_check.unrecorded > 0
    from fsdp_restore.source_crc import describe

    assert "set_crc32_options(False)" in describe(report.source_check)


def test_the_cli_names_the_damaged_record_without_a_traceback(tmp_path, capsys):
    from fsdp_restore.cli import main

    src = tmp_path / "c.pt"
    _checkpoint(src)
    assert main(["convert", str(src), str(tmp_path / "ok.safetensors")]) == 0
    assert "source crc32s checked" in capsys.readouterr().out
    _flip(src, _storage_of(src, ["model", "a.weight"]), 0)
    assert main(["convert", str(src), str(tmp_path / "bad.safetensors")]) != 0
    err = capsys.readouterr().err
    assert "differ from the crc32 torch.save recorded" in err and "Traceback" not in err


def _convert_on_ranks(rank: int, world_size: int, src: str, dst: str) -> str:
    try:
        fsdp_restore.convert(src, dst, process_group=dist.group.WORLD)
    except (ConvertError, FormatError) as e:
        return str(e)
    return "converted"


def test_a_damaged_source_fails_every_rank_of_a_shared_conversion(tmp_path):
    src, dst = tmp_path / "c.pt", tmp_path / "c.safetensors"
    _checkpoint(src)
    _flip(src, _storage_of(src, ["model", "a.weight"]), 3)
    texts = run_ranks(_convert_on_ranks, 2, str(src), str(dst))
    assert texts[0] == texts[1] and "differ from the crc32 torch.save recorded" in texts[0], texts
    _nothing_written(dst)
