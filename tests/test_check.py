"""The NaN-fill check catches what a restore failed to write, and only that."""

import importlib

import pytest
import torch
from models import build

import fsdp_restore
from fsdp_restore.check import fill_nan, find_unrestored, may_hold_nan
from fsdp_restore.read import Checkpoint
from fsdp_restore.restore import execute_reads, plan_model_reads, tensor_sources
from fsdp_restore.shards import local_targets

restore_module = importlib.import_module("fsdp_restore.restore")  # the package re-exports a function `restore`


def _converted(tmp_path, state):
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    return tmp_path / "m.safetensors"


def _plan(path, model):
    ckpt = Checkpoint(path)
    targets, aliases = local_targets(model)
    sources, _ = tensor_sources(ckpt, "model")
    tasks, problems, _ = plan_model_reads(targets, aliases, sources, ckpt, strict=True)
    assert not problems
    return ckpt, tasks


def test_skipped_read_is_named(tmp_path):
    model = build("mlp", seed=5)
    ckpt, tasks = _plan(_converted(tmp_path, build("mlp").state_dict()), model)
    fill_nan(tasks)
    skipped = [t for t in tasks if t.target.name in ("blocks.0.bias", "counter")]
    execute_reads(ckpt, [t for t in tasks if t not in skipped], threads=2)
    result = find_unrestored(tasks, ckpt)
    assert result.unrestored == ["blocks.0.bias (5 elements)", "counter (4 elements)"]
    assert torch.isnan(model.blocks[0].bias).all()  # the poison is visible, not silently kept old values


@pytest.mark.parametrize("chunk_bytes", [16 * 2**20, 40])
def test_partly_written_piece_is_caught(tmp_path, monkeypatch, chunk_bytes):
    """A read that leaves one element unwritten is caught, whether or not the piece was split in chunks."""
    model = build("mlp", seed=5)
    ckpt, tasks = _plan(_converted(tmp_path, build("mlp").state_dict()), model)
    monkeypatch.setattr(restore_module, "READ_CHUNK_BYTES", chunk_bytes)
    real_read = restore_module.read_piece
    target = model.inp.weight.data.view(-1)

    def read_but_skip_one(ckpt, key, src_start, dest):
        real_read(ckpt, key, src_start, dest)
        if dest.data_ptr() <= target[23].data_ptr() < dest.data_ptr() + dest.numel() * dest.element_size():
            dest.view(-1)[(target[23].data_ptr() - dest.data_ptr()) // dest.element_size()] = float("nan")

    monkeypatch.setattr(restore_module, "read_piece", read_but_skip_one)
    execute_reads(ckpt, tasks, threads=2, check=True)
    assert find_unrestored(tasks, ckpt).unrestored == ["inp.weight (1 elements)"]


def test_unscreened_pieces_are_examined(tmp_path):
    """Pieces written outside execute_reads (the apply route) carry no screen result and are checked in full."""
    model = build("mlp", seed=5)
    ckpt, tasks = _plan(_converted(tmp_path, build("mlp").state_dict()), model)
    execute_reads(ckpt, tasks, threads=1, check=True)
    model.inp.weight.data[2, 3] = float("nan")
    assert find_unrestored(tasks, ckpt).unrestored == []  # screened clean after the read: not re-examined
    for task in tasks:
        task.may_hold_nan = None
    assert find_unrestored(tasks, ckpt).unrestored == ["inp.weight (1 elements)"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.complex64])
def test_nan_screen(dtype):
    x = torch.ones(1000, dtype=dtype)
    assert not may_hold_nan(x)
    x[17] = float("nan")
    assert may_hold_nan(x)
    y = torch.ones(10, dtype=dtype)
    y[0], y[1] = float("inf"), float("-inf")
    assert may_hold_nan(y) and not torch.isnan(y).any()  # a false alarm, cleared by the exact check
    assert not may_hold_nan(torch.zeros(0, dtype=dtype))
    assert not may_hold_nan(torch.arange(5))  # integers cannot hold NaN


def test_all_restored_passes_and_source_nan_is_reported(tmp_path):
    state = build("mlp").state_dict()
    state["out.weight"][0, 0] = float("nan")
    model = build("mlp", seed=5)
    ckpt, tasks = _plan(_converted(tmp_path, state), model)
    fill_nan(tasks)
    execute_reads(ckpt, tasks, threads=2)
    result = find_unrestored(tasks, ckpt)
    assert result.unrestored == [] and result.nan_in_checkpoint == ["out.weight"]
