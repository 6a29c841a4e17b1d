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
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed as dist
from dist import run_ranks
from safetensors.torch import load_file

import fsdp_restore
from fsdp_restore import FormatError
from fsdp_restore.errors import ConvertError
from fsdp_restore.source_crc import RunsCheck

# what the conversions here are told (the fused views stored apart; trust_pickle; a legacy file loaded whole)
pytestmark = [pytest.mark.filterwarnings("ignore:tensors at model.q, model.k, model.v share storage"),
              pytest.mark.filterwarnings("ignore:.*trust_pickle=True executes the file's pickle"),
              pytest.mark.filterwarnings("ignore:.*is a legacy .non-zip. torch.save file")]


def _record_span(path, suffix: str) -> tuple[int, int, int]:
    """(first data byte, size, recorded crc32) of the record whose name ends with ``suffix``, per `zipfile`."""
    with zipfile.ZipFile(path) as z:
        (info,) = [i for i in z.infolist() if i.filename.endswith(suffix)]
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size, info.CRC


def _flip(path, suffix: str, at: int = 0, mask: int = 1) -> None:
    """Flip the bits ``mask`` (one, the lowest, unless told) of byte ``at`` of a record (a bit rotten on disk): its
    recorded crc32 no longer fits."""
    first, size, crc = _record_span(path, suffix)
    with open(path, "r+b") as f:
        f.seek(first + at)
        byte = f.read(1)
        f.seek(first + at)
        f.write(bytes([byte[0] ^ mask]))
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
    crcs = fsdp_restore.convert(src, dst, **how).source_crcs
    with zipfile.ZipFile(src) as z:
        records = len(z.infolist())
    # the pickle, the small ones, whole storages, a tied pair and a fused storage whose three views tile it: checked
    # from the written tensors' checksums, at no cost; the storage of a view of part of it is left (a pass over it)
    assert crcs.records == records and crcs.unrecorded == 0 and crcs.reread_bytes == 0
    assert crcs.checked == records - 1 and crcs.skipped == 1
    crcs = fsdp_restore.convert(src, dst, force=True, verify_checksums=True, **how).source_crcs
    _, size, _ = _record_span(src, _storage_of(src, ["model", "part"]))
    assert crcs.checked == records and crcs.reread_bytes == size == 40  # that one read again
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
    if where == "partial view":  # a pass over its bytes: checked when asked
        fsdp_restore.convert(src, dst, **how)
        os.remove(dst)
        how = {**how, "verify_checksums": True}
    with pytest.raises(FormatError) as info:
        fsdp_restore.convert(src, dst, **how)
    text = str(info.value)
    assert str(src) in text and suffix in text and "differ from the crc32 torch.save recorded" in text
    assert "Copy the checkpoint again" in text
    if where == "weight":
        assert "tensors model.a.weight" in text
    _nothing_written(dst)


@pytest.mark.parametrize("how", PATHS)
def test_a_cast_conversion_checks_the_bytes_its_cast_read(tmp_path, how):
    """A cast's source bytes are checksummed where the cast reads them: no second read of the source (only the
    partial view's storage is read again)."""
    src, dst = tmp_path / "c.pt", tmp_path / "c.safetensors"
    _checkpoint(src)
    assert fsdp_restore.convert(src, dst, dtype="bf16", **how).source_crcs.skipped > 1  # casts: when asked
    crcs = fsdp_restore.convert(src, dst, dtype="bf16", force=True, verify_checksums=True, **how).source_crcs
    assert crcs.checked == crcs.records and crcs.reread_bytes == 40
    for where, at in (("a.weight", 5), ("q", 2), ("part", 9)):  # a cast weight, a fused cast view, a partial one
        copy, record = tmp_path / f"{where}.pt", _storage_of(src, ["model", where])
        copy.write_bytes(src.read_bytes())
        _flip(copy, record, at)
        with pytest.raises(FormatError, match=f"differ from the crc32 .*{record}'"):
            fsdp_restore.convert(copy, tmp_path / "d.safetensors", dtype="bf16", verify_checksums=True, **how)
        _nothing_written(tmp_path / "d.safetensors")


@pytest.mark.parametrize("how", PATHS)
def test_a_strided_tensors_storage_is_checked(tmp_path, how):
    """A transposed weight (and a strided slice) is written from its storage's bytes in another order: its record
    is read again (it was left unchecked)."""
    src = tmp_path / "t.pt"
    torch.manual_seed(0)
    torch.save({"w": torch.randn(4, 6).t(), "s": torch.randn(20)[::2]}, src)
    assert fsdp_restore.convert(src, tmp_path / "ok.safetensors", **how).source_crcs.skipped == 2
    assert fsdp_restore.convert(src, tmp_path / "ok.safetensors", force=True, verify_checksums=True,
                                **how).source_crcs.reread_bytes == 96 + 80
    for key in ("w", "s"):
        copy, record = tmp_path / f"{key}.pt", _storage_of(src, [key])
        copy.write_bytes(src.read_bytes())
        _flip(copy, record, 3)
        with pytest.raises(FormatError, match=f"differ from the crc32 .*{record}'"):
            fsdp_restore.convert(copy, tmp_path / f"{key}.safetensors", verify_checksums=True, **how)


@pytest.mark.parametrize("how", PATHS)
@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_damaged_pickle_is_named_as_damage_not_as_what_it_then_looks_like(tmp_path, how, at):
    """The pickle's crc32 is checked before it is read: a flipped bit there is not an unpickling error, a global
    to allow, or an advice to trust the pickle."""
    src = tmp_path / "c.pt"
    _checkpoint(src)
    _flip(src, "data.pkl", at)
    with pytest.raises(FormatError) as info:
        fsdp_restore.convert(src, tmp_path / "c.safetensors", **how)
    assert "data.pkl" in str(info.value) and "differ from the crc32" in str(info.value)
    assert "trust" not in str(info.value) and "allow" not in str(info.value)


@pytest.mark.parametrize("how", PATHS)
def test_damage_that_makes_a_cast_overflow_is_named_as_damage(tmp_path, how):
    """A flipped exponent bit makes a finite fp32 value overflow fp16: the damage is what is said, not the cast."""
    src = tmp_path / "c.pt"
    torch.save({"w": torch.full((8,), 0.75)}, src)
    _flip(src, "data/0", 3 * 4 + 3, mask=0x40)  # (the exponent's top bit of element 3: 0.75 becomes 2.6e38)
    assert torch.isfinite(torch.load(src)["w"]).all() and torch.load(src)["w"][3] > 1e38
    with pytest.raises(FormatError, match="differ from the crc32"):
        fsdp_restore.convert(src, tmp_path / "c.safetensors", dtype="fp16", cast_include=["w"], verify_checksums=True,
                             **how)


def test_a_select_checks_only_what_it_converts(tmp_path):
    src = tmp_path / "c.pt"
    _checkpoint(src)
    _flip(src, _storage_of(src, ["optim", "state", 0, "exp_avg"]), 9)
    crcs = fsdp_restore.convert(src, tmp_path / "m.safetensors", select="model").source_crcs  # the optimizer's not read
    from fsdp_restore.source_crc import describe_rest

    assert 0 < crcs.checked < crcs.records and crcs.skipped == 1  # (the partial view)
    assert "1 record(s) of tensors cast or partly viewed not checked" in describe_rest(crcs)
    crcs = fsdp_restore.convert(src, tmp_path / "m.safetensors", select="model", force=True,
                                verify_checksums=True).source_crcs
    assert "the records not converted were not checked" in describe_rest(crcs)
    with pytest.raises(FormatError, match="differ from the crc32"):
        fsdp_restore.convert(src, tmp_path / "all.safetensors")


def test_an_archive_saved_without_crc32s_converts_and_says_so(tmp_path):
    from fsdp_restore.source_crc import describe_rest

    src, dst = tmp_path / "c.pt", tmp_path / "c.safetensors"
    torch.serialization.set_crc32_options(False)
    try:
        _checkpoint(src)
    finally:
        torch.serialization.set_crc32_options(True)
    crcs = fsdp_restore.convert(src, dst).source_crcs
    assert crcs.checked == 0 and crcs.unrecorded > 0
    assert "set_crc32_options(False)" in describe_rest(crcs)
    torch.save({"w": torch.ones(3)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    legacy = fsdp_restore.convert(tmp_path / "old.pt", tmp_path / "old.safetensors").source_crcs
    assert "a legacy torch.save file" in describe_rest(legacy)


def test_numpy_arrays_in_the_pickle_are_not_storages_to_read_again(tmp_path):
    """The torch path finds each tensor's storage in torch.load's mapping; a numpy array (an RNG state) has none,
    which must not make it read every storage again."""
    import numpy as np

    src = tmp_path / "c.pt"
    torch.save({"w": torch.randn(64, 64), "rng": np.random.RandomState(0).get_state()[1]}, src)
    crcs = fsdp_restore.convert(src, tmp_path / "c.safetensors", trust_pickle=True).source_crcs
    assert crcs.checked == crcs.records and crcs.reread_bytes == 0


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
    cast = tmp_path / "cast.pt"  # a cast's source: checked when asked
    _checkpoint(cast)
    _flip(cast, _storage_of(cast, ["model", "a.weight"]), 0)
    assert main(["convert", str(cast), str(tmp_path / "c1.safetensors"), "--dtype", "bf16"]) == 0
    assert "not checked (a pass over their bytes): --verify-checksums checks them" in capsys.readouterr().out
    assert main(["convert", str(cast), str(tmp_path / "c2.safetensors"), "--dtype", "bf16", "--verify-checksums"]) == 1
    assert "differ from the crc32" in capsys.readouterr().err


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


def test_a_flipped_byte_anywhere_outside_the_storages_is_an_error_of_ours_or_converts(tmp_path):
    """Every third byte of a small checkpoint's archive outside its storages' data (local headers, the pickle, the
    small records, the central directory), flipped in turn: the conversion either converts (a byte no reader acts
    on: padding, a time) or raises one of our errors, never another exception, and leaves nothing behind."""
    from fsdp_restore.errors import FsdpRestoreError

    src = tmp_path / "c.pt"
    torch.save({"w": torch.arange(6.0), "step": 3, "name": "run"}, src)
    clean = src.read_bytes()
    first, size, _ = _record_span(src, "data/0")
    outcomes = {"converted": 0, "refused": 0}
    for at in [i for i in range(0, len(clean), 3) if not first <= i < first + size]:
        damaged = bytearray(clean)
        damaged[at] ^= 0x10
        src.write_bytes(bytes(damaged))
        dst = tmp_path / "out.safetensors"
        try:
            fsdp_restore.convert(src, dst)
            outcomes["converted"] += 1
            os.remove(dst)
        except FsdpRestoreError:
            outcomes["refused"] += 1
            _nothing_written(dst)
    assert outcomes["refused"] > outcomes["converted"] > 0, outcomes


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_records_crc32_from_the_parts_read_and_the_rest_read_again(tmp_path_factory, data):
    """`RunsCheck`'s crc32 of one record (a ZeRO partition) from the crc32s of the parts a conversion read of it,
    the bytes between them read again: always the record's own (zlib of its bytes), whatever the parts (gaps,
    parts of other records before and after it, a part across its ends, overlapping parts), and only the bytes no
    part covers read again where the parts lie apart inside it."""
    path = tmp_path_factory.mktemp("runs") / "file"
    content = os.urandom(300)
    path.write_bytes(content)
    at = data.draw(st.integers(0, 200), "at")
    size = data.draw(st.integers(1, 300 - at), "size")
    spans = data.draw(st.lists(st.tuples(st.integers(0, 299), st.integers(1, 60)), max_size=8), "parts")
    parts = sorted({(o, min(n, 300 - o), zlib.crc32(content[o:o + n])) for o, n in spans})
    fd = os.open(path, os.O_RDONLY)
    try:
        crc, reread = RunsCheck._crc_of_record(fd, at, size, parts)
    finally:
        os.close(fd)
    assert crc == zlib.crc32(content[at:at + size])
    inside = [(o, n) for o, n, _ in parts if at <= o and o + n <= at + size]
    apart = all(a[0] + a[1] <= b[0] for a, b in zip(inside, inside[1:]))
    if apart and len(inside) == sum(1 for o, _, _ in parts if at <= o < at + size):
        assert reread == size - sum(n for _, n in inside)
