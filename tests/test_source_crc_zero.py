"""The crc32 check of a ZeRO checkpoint's records (`source_crc.RunsCheck`, `zero_plain`) over many layouts (the slow
suite: 3 ranks of every stage, stage-3 sub-groups, casts, shards, and a flip of every byte of every record), with
oracles independent of the code under test: Python's `zipfile` for where each record's bytes lie, and the
conversion's own output only as "did the damaged byte reach the output". Written by an independent review; the
default suite's cases are in test_zero.py."""

from __future__ import annotations

import importlib
import shutil
import zipfile
from pathlib import Path

import pytest

import fsdp_restore
from fsdp_restore import FormatError
from fsdp_restore.source_crc import DamagedRecords

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from zero_checkpoints import generate

    root = tmp_path_factory.mktemp("zero-crc")
    generate(root, 3, [(1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
    generate(root, 2, [(3, "bf16")], sub_group_size=40)
    return root


def _lane(src, dst, select=None, dtype=None, verify=True, max_shard_size=None):
    convert = importlib.import_module("fsdp_restore.convert")
    return convert._convert_zero_plain(src, dst, select=select, tag=None, on_unsupported="error", threads=3,
                                       max_shard_size=max_shard_size, force=False, progress=None, dtype=dtype,
                                       verify_checksums=verify)


def _records(path):
    """(name, first data byte, size) of each storage record, from zipfile and the local headers."""
    out = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for i in z.infolist():
            f.seek(i.header_offset)
            h = f.read(30)
            at = i.header_offset + 30 + int.from_bytes(h[26:28], "little") + int.from_bytes(h[28:30], "little")
            if "/data/" in i.filename and i.file_size:
                out.append((i.filename, at, i.file_size))
    return out


def _body(path):
    b = Path(path).read_bytes()
    return b[8 + int.from_bytes(b[:8], "little"):]


def _copy(ckpts, name, tmp_path):
    src = tmp_path / "ck"
    shutil.copytree(ckpts / name, src)
    return src, next(p for p in src.iterdir() if p.is_dir())


NAMES = ["z1-fp32-ws3", "z2-bf16-ws3", "z3-fp32-ws3", "z3-bf16-ws3", "z3-bf16-ws2-sub40"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("select", [None, "model", "optim"])
@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_no_false_alarm_on_clean_checkpoints(ckpts, tmp_path, name, select, dtype):
    from fsdp_restore.jobs import cast_target

    d = cast_target(dtype) if dtype else None
    checked = _lane(ckpts / name, tmp_path / "v.safetensors", select=select, dtype=d)
    plain = _lane(ckpts / name, tmp_path / "p.safetensors", select=select, dtype=d, verify=False)
    assert checked is not None and checked.source_crcs.skipped == 0
    assert _body(tmp_path / "v.safetensors") == _body(tmp_path / "p.safetensors")
    assert plain.source_crcs.skipped > 0
    assert _lane(ckpts / name, tmp_path / "s", select=select, dtype=d, max_shard_size=1500) is not None


@pytest.mark.parametrize("name", ["z2-bf16-ws3", "z3-bf16-ws3"])
@pytest.mark.parametrize("select", [None, "model"])
def test_every_byte_of_a_record_read_is_checked(ckpts, tmp_path, name, select):
    """Flip every byte of every storage record of every rank file in turn: a record some of whose bytes reach the
    output (or raise) must raise for every byte of it (padding included), naming file and record; no flip may change
    the output silently; nothing is written on an error."""
    src, tag = _copy(ckpts, name, tmp_path)
    _lane(src, tmp_path / "clean.safetensors", select=select)
    clean = _body(tmp_path / "clean.safetensors")
    for f in sorted(tag.glob("*.pt")):
        data = bytearray(f.read_bytes())
        for rname, at, size in _records(f):
            outcomes = set()
            for o in range(size):
                data[at + o] ^= 0x10
                f.write_bytes(data)
                dst = tmp_path / "x.safetensors"
                try:
                    _lane(src, dst, select=select)
                    outcomes.add("same" if _body(dst) == clean else "changed")
                    dst.unlink()
                except DamagedRecords as e:
                    assert f.name in str(e) and rname in str(e), str(e)
                    assert not dst.exists()
                    outcomes.add("raised")
                finally:
                    data[at + o] ^= 0x10
                    f.write_bytes(data)
            assert "changed" not in outcomes, (f.name, rname)
            assert outcomes in ({"same"}, {"raised"}), (f.name, rname, outcomes)
