"""The NaN-fill check catches what a restore failed to write, and only that."""

import torch
from models import build

import fsdp_restore
from fsdp_restore.check import fill_nan, find_unrestored
from fsdp_restore.read import Checkpoint
from fsdp_restore.restore import execute_reads, plan_model_reads, tensor_sources
from fsdp_restore.shards import local_targets


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


def test_partly_written_piece_is_caught(tmp_path):
    model = build("mlp", seed=5)
    ckpt, tasks = _plan(_converted(tmp_path, build("mlp").state_dict()), model)
    fill_nan(tasks)
    execute_reads(ckpt, tasks, threads=1)
    model.inp.weight.data[2, 3] = float("nan")  # as if one element was never written
    assert find_unrestored(tasks, ckpt).unrestored == ["inp.weight (1 elements)"]


def test_all_restored_passes_and_source_nan_is_reported(tmp_path):
    state = build("mlp").state_dict()
    state["out.weight"][0, 0] = float("nan")
    model = build("mlp", seed=5)
    ckpt, tasks = _plan(_converted(tmp_path, state), model)
    fill_nan(tasks)
    execute_reads(ckpt, tasks, threads=2)
    result = find_unrestored(tasks, ckpt)
    assert result.unrestored == [] and result.nan_in_checkpoint == ["out.weight"]
