"""Positional reads: ranges and column blocks (rows at a stride) read exactly the requested elements."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import fsdp_restore
from fsdp_restore import FormatError, read
from fsdp_restore.read import Checkpoint


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Tensors of several widths (rows of a few hundred bytes and of 36 KB)."""
    path = tmp_path_factory.mktemp("read") / "t.safetensors"
    tensors = {"a_odd": torch.arange(3, dtype=torch.bfloat16), "b": torch.randn(300, 70),
               "c": torch.randn(40, 9000)}
    save_file(tensors, path)
    return path, tensors


@settings(max_examples=60, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("key", ["b", "c"])
def test_read_rows_equals_indexing(stored, key, data):
    path, tensors = stored
    t = tensors[key]
    rows_total, cols = t.shape
    r0 = data.draw(st.integers(0, rows_total - 1))
    rows = data.draw(st.integers(1, rows_total - r0))
    c0 = data.draw(st.integers(0, cols - 1))
    run = data.draw(st.integers(1, cols - c0))
    expected = t[r0:r0 + rows, c0:c0 + run].reshape(-1)
    with Checkpoint(path) as ckpt:
        got = torch.full((rows * run,), float("nan"))
        ckpt.read_rows(key, r0 * cols + c0, got, rows, cols)
        assert torch.equal(got, expected)
        assert ckpt.bytes_read == rows * run * 4  # the runs' bytes, not the span's


@pytest.mark.parametrize("row_bytes", [4, 1 << 30])  # every row by its own read / one mapped strided copy
def test_both_row_paths_agree(stored, monkeypatch, row_bytes):
    path, tensors = stored
    monkeypatch.setattr(read, "ROW_READ_MIN_BYTES", row_bytes)
    with Checkpoint(path) as ckpt:
        got = torch.empty(40 * 100)
        ckpt.read_rows("c", 4500, got, 40, 9000)
    assert torch.equal(got, tensors["c"][:, 4500:4600].reshape(-1))


def test_read_rows_outside_the_tensor_is_refused(stored):
    path, _ = stored
    with Checkpoint(path) as ckpt:
        with pytest.raises(ValueError, match="do not fit tensor 'b'"):
            ckpt.read_rows("b", 69, torch.empty(300 * 2), 300, 70)  # the last row runs past the end
        with pytest.raises(ValueError, match="do not fit"):
            ckpt.read_rows("b", 0, torch.empty(10), 2, 3)  # rows overlap (stride < run)


def test_misaligned_tensor_reads_row_by_row(tmp_path):
    """A file whose float32 tensor starts 2 bytes into the data (legal safetensors, seen in hand-written
    files) cannot be viewed as float32 in place: each row is read by its own positional read."""
    import json
    import struct

    b = torch.randn(6, 8)
    header = json.dumps({"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]},
                         "b": {"dtype": "F32", "shape": [6, 8], "data_offsets": [2, 2 + b.numel() * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0" + b.numpy().tobytes())
    with Checkpoint(path) as ckpt:
        got = torch.empty(6 * 3)
        ckpt.read_rows("b", 5, got, 6, 8)
    assert torch.equal(got, b[:, 5:8].reshape(-1))


def test_a_file_that_ends_early_names_the_tensor(stored, tmp_path):
    """Truncated after the header was read: the failing read names the file and the tensor."""
    import shutil

    from fsdp_restore.errors import FormatError

    path, _ = stored
    copy = tmp_path / "cut.safetensors"
    shutil.copy(path, copy)
    with Checkpoint(copy) as ckpt:
        entry = ckpt.entries["c"]
        with open(copy, "r+b") as f:
            f.truncate(entry.offset + 100)
        with pytest.raises(FormatError, match=r"cut.safetensors.*tensor 'c': file ends at byte"):
            ckpt.read_range("c", 0, torch.empty(40 * 9000))
        with pytest.raises(FormatError, match=r"tensor 'c': file ends"):  # a scattering read, two parts
            ckpt.read_contiguous([("c", 0, torch.empty(10)), ("c", 10, torch.empty(100))])


@pytest.mark.parametrize("most", [1001, 4096, 12_345])
def test_short_reads_are_resumed_where_they_stopped(stored, monkeypatch, most):
    """The kernel may return fewer bytes than asked (a signal, a network file system): the scattering read goes
    on from the byte where the last one stopped, inside a part or at its end, and fills every part exactly."""
    path, tensors = stored
    real = os.preadv
    calls = [0]

    def short(fd, buffers, offset):  # reads at most ``most`` bytes, into the first buffers only
        calls[0] += 1
        left, views = most, []
        for b in buffers:
            view = memoryview(b).cast("B")
            if left <= 0:
                break
            views.append(view[:left])
            left -= len(views[-1])
        return real(fd, views, offset)

    with Checkpoint(path) as ckpt:
        monkeypatch.setattr(os, "preadv", short)
        got = [torch.empty(300 * 70), torch.empty(40 * 9000)]
        ckpt.read_contiguous([("b", 0, got[0]), ("c", 0, got[1])])
        part = torch.empty(5 * 9000)
        ckpt.read_range("c", 9000 * 3 + 17, part)
    assert calls[0] >= (300 * 70 + 40 * 9000) * 4 // most
    assert torch.equal(got[0], tensors["b"].reshape(-1)) and torch.equal(got[1], tensors["c"].reshape(-1))
    assert torch.equal(part, tensors["c"].reshape(-1)[9000 * 3 + 17:9000 * 8 + 17])


# ---- files are recognised by their content, not their name (issue 20, item 4) ---------------------------------


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert type(a[k]) is type(b[k])
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]


def test_a_checkpoint_without_a_suffix_is_read_as_one(tmp_path):
    import fsdp_restore

    src = tmp_path / "run.pt"
    torch.save({"w": torch.randn(4, 5), "step": 7}, src)
    out = tmp_path / "out"  # what `fsdp-restore convert ds_dir out` writes
    fsdp_restore.convert(src, out)
    _same(fsdp_restore.load(out), torch.load(src))
    _same(fsdp_restore.load(out, mmap=False), torch.load(src))
    assert fsdp_restore.inspect_checkpoint(out)["tensors"] == 1
    assert fsdp_restore.verify(out).ok
    with fsdp_restore.open_checkpoint(out) as ckpt:
        assert ckpt.path == out


def test_a_safetensors_file_named_bin_is_read_as_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    import fsdp_restore

    path = tmp_path / "pytorch_model.bin"
    save_file({"a": torch.randn(3, 2), "b": torch.arange(5)}, path)
    _same(fsdp_restore.load(path), load_file(path))
    assert fsdp_restore.inspect_checkpoint(path)["tensors"] == 2
    with fsdp_restore.open_checkpoint(path) as ckpt:
        assert torch.equal(ckpt.read_tensor("a"), load_file(path)["a"])


def test_a_torch_file_named_safetensors_is_named_for_what_it_is(tmp_path):
    import fsdp_restore
    from fsdp_restore import FormatError

    path = tmp_path / "model.safetensors"
    torch.save({"a": torch.ones(2)}, path)
    with pytest.raises(FormatError, match=r"model\.safetensors.*torch\.save.*fsdp-restore convert"):
        fsdp_restore.open_checkpoint(path)
    # inspect describes it for what it is (by content, as everything is read): a torch.save file
    info = fsdp_restore.inspect_checkpoint(path)
    assert info["format"] == "torch.save" and info["tree"]["children"][0]["shape"] == [2]


def test_a_trainer_directory_says_which_file_to_pass(tmp_path):
    """A Hugging Face Trainer checkpoint holds model.safetensors beside optimizer.pt (or its conversion): the
    reader names the files and the convert command says to convert them one by one."""
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, tmp_path / "optimizer.pt")
    with pytest.raises(FormatError, match=r"convert its files one by one.*optimizer.pt ...; model.safetensors need"):
        fsdp_restore.convert(tmp_path, tmp_path.parent / "out.safetensors")
    bins = tmp_path / "bins"  # Hugging Face's sharded .bin weights: no model.safetensors to speak of
    bins.mkdir()
    for i in (1, 2):
        torch.save({f"w{i}": torch.ones(2)}, bins / f"pytorch_model-0000{i}-of-00002.bin")
    with pytest.raises(FormatError) as info:
        fsdp_restore.convert(bins, tmp_path.parent / "out.safetensors")
    assert "one by one instead (fsdp-restore convert" in str(info.value) and "safetensors need" not in str(info.value)
    (bins / "pytorch_model.bin.index.json").write_text('{"metadata": {}, "weight_map": {"w1": "x.bin"}}')
    with pytest.raises(FormatError, match="is a JSON index of a sharded checkpoint, not a torch.save file.*convert"
                                          " each shard"):  # it said only "not a torch.save file"
        fsdp_restore.convert(bins / "pytorch_model.bin.index.json", tmp_path.parent / "out.safetensors")
    fsdp_restore.convert(tmp_path / "optimizer.pt", tmp_path / "optimizer.safetensors")
    with pytest.raises(FormatError, match=r"several \.safetensors files \(model\.safetensors, optimizer\.safetensors\)"
                                          ": pass the one to read"):
        fsdp_restore.Checkpoint(tmp_path)


def test_a_fault_of_the_sibling_read_in_place_of_a_pt_says_so(tmp_path):
    """inspect/restore of x.pt whose converted x.safetensors is truncated named x.safetensors alone: the user, who
    named x.pt, was not told why another file was read, nor the fix."""
    import fsdp_restore

    torch.save({"w": torch.ones(1000)}, tmp_path / "x.pt")
    fsdp_restore.convert(tmp_path / "x.pt", tmp_path / "x.safetensors")
    os.truncate(tmp_path / "x.safetensors", 3000)
    with pytest.raises(FormatError) as info:
        fsdp_restore.open_checkpoint(tmp_path / "x.pt")
    text = str(info.value)
    assert text.startswith(f"{tmp_path / 'x.safetensors'}: ") and "truncated" in text, text
    assert "read in place of x.pt, as its converted sibling: convert it again with fsdp-restore convert" in text
    with pytest.raises(FormatError) as direct:  # named itself: as before
        fsdp_restore.open_checkpoint(tmp_path / "x.safetensors")
    assert "in place of" not in str(direct.value)
    assert "truncated?): copy the file again, or convert or save it again" in str(direct.value)  # (no fix was said)
    fsdp_restore.convert(tmp_path / "x.pt", tmp_path / "x.safetensors", force=True)
    torch.save({"w": torch.zeros(1000)}, tmp_path / "x.pt")  # changed since: stale, whose error gives the fix once
    with pytest.raises(FormatError, match=r"x\.safetensors: was not converted from \S*x\.pt as it is now") as stale:
        fsdp_restore.open_checkpoint(tmp_path / "x.pt")
    assert str(stale.value).count("fsdp-restore convert") == 1, stale.value
    assert "in place of" not in str(stale.value), stale.value  # (said once: which file was read for which)


def test_an_index_of_torch_shards_reads_their_conversions(tmp_path, monkeypatch):
    """transformers' older layout (pytorch_model-0000N-of-0000M.bin + pytorch_model.bin.index.json): each shard
    converted as the converter says, the index or its directory was refused ("no index json", or the .bin read as
    a safetensors header: "header length ... exceeds the limit"); now the index reads each shard's conversion,
    checked to be of that shard as it is now."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=200))
    # as transformers before 5.0 wrote it (save_pretrained(safe_serialization=False); 5.0 writes safetensors only)
    state, weight_map, parts = model.state_dict(), {}, 3
    for i in range(parts):
        name = f"pytorch_model-{i + 1:05d}-of-{parts:05d}.bin"
        part = {k: v.clone() for k, v in list(state.items())[i::parts]}
        torch.save(part, tmp_path / name)
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shards = sorted(tmp_path.glob("pytorch_model-*.bin"))
    assert len(shards) > 1 and (tmp_path / "pytorch_model.bin.index.json").exists()
    with pytest.raises(FormatError, match=rf"{len(shards)} of {len(shards)} have no converted sibling .* convert each"):
        Checkpoint(tmp_path / "pytorch_model.bin.index.json")
    for shard in shards:
        fsdp_restore.convert(shard, shard.with_suffix(".safetensors"))
    oracle = {}
    for shard in shards:  # torch's own loader, shard by shard
        oracle.update(torch.load(shard, weights_only=True))
    # the directory by a relative path too ("hf/", "."): its conversions were not recognised as the index's
    for cwd, path in ((None, tmp_path), (None, tmp_path / "pytorch_model.bin.index.json"),
                      (tmp_path.parent, Path(tmp_path.name)), (tmp_path, Path("."))):
        if cwd is not None:
            monkeypatch.chdir(cwd)
        fresh = LlamaForCausalLM(model.config)
        report = fsdp_restore.restore_model(fresh, path)
        assert not report.missing and not report.unexpected
        state = fresh.state_dict()
        assert all(torch.equal(state[k], v) for k, v in oracle.items())
    elsewhere = tmp_path.parent / f"{tmp_path.name}-kept"  # a conversion linked in from another directory
    elsewhere.mkdir()
    moved = shards[0].with_suffix(".safetensors")
    moved.rename(elsewhere / moved.name)
    moved.symlink_to(elsewhere / moved.name)
    fresh = LlamaForCausalLM(model.config)
    assert not fsdp_restore.restore_model(fresh, tmp_path).missing
    changed = torch.load(shards[0], weights_only=True)
    next(iter(changed.values())).add_(1)
    torch.save(changed, shards[0])  # the shard rewritten after its conversion, with other values
    with pytest.raises(FormatError, match=rf"was not converted from {shards[0].name} as it is now .* convert it again"):
        Checkpoint(tmp_path)


def test_an_index_of_torch_shards_with_a_tie_within_one_then_deleted(tmp_path):
    """A shard holding a tied weight twice (T5's embeddings) converts it once, the other name a view: the index
    named it a tensor the shard did not hold. Shards deleted after their conversion (to free the space) made the
    index unreadable (a raw FileNotFoundError); and a model.safetensors beside such an index is what to read."""
    torch.manual_seed(0)
    emb = torch.randn(5, 3)
    parts = {"pytorch_model-00001-of-00002.bin": {"emb.weight": emb, "head.weight": emb, "q.weight": torch.randn(3)},
             "pytorch_model-00002-of-00002.bin": {"n.weight": torch.randn(2)}}
    for name, part in parts.items():
        torch.save(part, tmp_path / name)
    weight_map = {key: name for name, part in parts.items() for key in part}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in parts:
        fsdp_restore.convert(tmp_path / name, (tmp_path / name).with_suffix(".safetensors"))
    expected = {key: value for part in parts.values() for key, value in part.items()}
    for _ in range(2):
        with Checkpoint(tmp_path) as ckpt:
            state = ckpt.load()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], v) for k, v in expected.items())
        for name in parts:  # the second time round: only the conversions are there
            (tmp_path / name).unlink(missing_ok=True)
    fsdp_restore.save({"only": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(FormatError, match="several .safetensors files"):  # which to read: the user's to say
        Checkpoint(tmp_path)
    for name in parts:
        (tmp_path / name).with_suffix(".safetensors").unlink()
    with Checkpoint(tmp_path) as ckpt:  # beside an index of shards never converted: model.safetensors is read
        assert list(ckpt.load()) == ["only"]


def test_a_dcp_directory_is_named_with_the_command_that_converts_it(tmp_path):
    """A directory `convert` reads but a restore cannot (a DCP checkpoint) gets the conversion's command, and that
    command works; a directory of nothing of the kind gets no such hint."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: dcp says it assumes a single process)
        dcp.save(state, checkpoint_id=str(tmp_path / "run"))
    with pytest.raises(FormatError) as info:
        Checkpoint(tmp_path / "run")
    command = f"fsdp-restore convert {tmp_path / 'run'} {tmp_path / 'run.safetensors'}"
    assert f"a DCP checkpoint: convert it first: {command}" in str(info.value)
    fsdp_restore.convert(tmp_path / "run", tmp_path / "run.safetensors")  # what the command does
    with Checkpoint(tmp_path / "run.safetensors") as ckpt:
        assert torch.equal(ckpt.read_tensor("w"), state["w"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError) as info:
        Checkpoint(tmp_path / "empty")
    assert "convert it first" not in str(info.value)


def test_the_descriptors_a_checkpoint_keeps_are_blocking(tmp_path, monkeypatch):
    """Opened non-blocking (a FIFO must not wait for a writer), then made blocking again: Lustre reads O_NONBLOCK on
    each read as "do not wait for a lock" and fails the read with EAGAIN instead."""
    save_file({"w": torch.ones(4)}, str(tmp_path / "a.safetensors"))
    with Checkpoint(tmp_path / "a.safetensors") as ckpt:
        assert ckpt._fds and all(os.get_blocking(fd) for fd in ckpt._fds.values())
    monkeypatch.chdir(tmp_path)  # a directory named "." is told the file to write beside it, not inside it
    (tmp_path / "a.safetensors").unlink()
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "run"))
    monkeypatch.chdir(tmp_path / "run")
    with pytest.raises(FormatError, match=re.escape(f"fsdp-restore convert . {tmp_path / 'run.safetensors'}")):
        Checkpoint(".")
