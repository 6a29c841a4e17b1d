"""DCP directories in: a checkpoint saved by ``dcp.save`` from FSDP2 (model + optimizer through
``get_state_dict``) converts exactly (oracle: torch's own ``dcp_to_torch_save``) and resumes."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from models import build

import fsdp_restore
from fsdp_restore import FormatError


class Wide(torch.nn.Module):
    """Last dimensions even at 2 ranks, so that FSDP2 can shard them (Shard(1) chunks are column blocks)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 6)
        self.mid = torch.nn.Linear(6, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.mid(torch.relu(self.inp(x))) * self.scale


def _model(name, seed):
    if name == "wide":
        torch.manual_seed(seed)
        return Wide()
    return build(name, seed=seed)


def _units(model):
    return [model.inp, model.mid] if isinstance(model, Wide) else [model.inp, *model.blocks]


def _batch(step, width):
    return torch.randn(4, width, generator=torch.Generator().manual_seed(50 + step))


def _train(model, opt, first, steps):
    losses = []
    width = 8 if isinstance(model, Wide) else 7
    for step in range(first, first + steps):
        loss = model(_batch(step, width)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _save(rank, world_size, out, name):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = _model(name, seed=0)
    kwargs = {"shard_placement_fn": lambda p: Shard(p.dim() - 1)} if name == "wide" else {}
    for block in _units(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, 0, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 2, "note": "dcp"}, checkpoint_id=out)
    return _train(model, opt, 2, 2)  # what a resumed run must reproduce


@pytest.fixture(scope="module", params=[("mlp", 3), ("wide", 2)], ids=["uneven-rows-3-ranks", "columns-2-ranks"])
def saved(request, tmp_path_factory):
    name, world_size = request.param
    root = tmp_path_factory.mktemp("dcp")
    losses = run_ranks(_save, world_size, str(root / "ckpt"), name)[0]
    return root, losses, name


def test_conversion_equals_torchs_own_dcp_to_torch_save(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, _, _ = saved
    fsdp_restore.convert(root / "ckpt", tmp_path / "c.safetensors")
    dcp_to_torch_save(root / "ckpt", tmp_path / "oracle.pt")
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=False)
    back = fsdp_restore.load(tmp_path / "c.safetensors")
    assert back["step"] == 2 and back["note"] == "dcp"
    for name, tensor in oracle["model"].items():
        assert torch.equal(back["model"][name], tensor), name
    for fqn, state in oracle["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(back["optim"]["state"][fqn][key], value), (fqn, key)
    assert back["optim"]["param_groups"] == oracle["optim"]["param_groups"]


def _resume(rank, world_size, path, name):
    from torch.distributed.fsdp import fully_shard

    model = _model(name, seed=5)
    for block in _units(model):
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    result = fsdp_restore.restore(model, path, optimizer=opt)
    assert result["step"] == 2
    return _train(model, opt, 2, 2)


def test_resume_from_a_converted_dcp_checkpoint(saved, tmp_path):
    root, reference, name = saved
    fsdp_restore.convert(root / "ckpt", tmp_path / "c.safetensors")
    for losses in run_ranks(_resume, 2, tmp_path / "c.safetensors", name):  # resumed with Shard(0) at 2 ranks
        assert losses == pytest.approx(reference, rel=1e-5)


def _decay_groups(model):
    """nanoGPT's groups, decayed matrices last, in another order than model.parameters()."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
            {"params": [p for _, p in reversed(named) if p.dim() >= 2], "weight_decay": 0.1}]


def _save_flattened(rank, world_size, out):
    """torchtitan's and OLMo-core's layout: the model's names at the top level, the optimizer flattened
    (``flatten_optimizer_state_dict=True``: ``state.<name>.<field>``, ``param_groups.<name>.<option>``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model("mlp", seed=0)
    for block in _units(model):
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(_decay_groups(model), lr=1e-2)
    _train(model, opt, 0, 2)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert any(k.startswith("param_groups.") for k in osd)
    # torchtitan's TrainState saves its step as a tensor: not one of the model's weights
    dcp.save({**msd, "optimizer": osd, "train_state": {"step": torch.tensor(2, dtype=torch.int32)}}, checkpoint_id=out)
    return _train(model, opt, 2, 2)


def _resume_flattened(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard

    model = _model("mlp", seed=5)
    for block in _units(model):
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(_decay_groups(model), lr=0.5)
    # without the optimizer: its state is not read (unsharded on every rank, several times the model)
    alone = fsdp_restore.restore(model, path)
    assert list(alone) == ["train_state"] and alone.model.bytes_read < 2 * sum(
        p.to_local().numel() * 4 for p in model.parameters())
    result = fsdp_restore.restore(model, path, optimizer=opt, optim_prefix="optimizer")  # strict
    assert list(result) == ["train_state"] and int(result["train_state"]["step"]) == 2
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1] and opt.param_groups[1]["lr"] == 1e-2
    return _train(model, opt, 2, 2)


def test_a_flattened_optimizer_beside_top_level_weights_resumes(tmp_path):
    """Refused as "not an optimizer state dict (no 'param_groups')", and, nested, every optimizer tensor listed as
    unexpected in the model's weights, with train_state dropped from the result."""
    reference = run_ranks(_save_flattened, 2, str(tmp_path / "ckpt"))[0]
    fsdp_restore.convert(tmp_path / "ckpt", tmp_path / "c.safetensors")
    for losses in run_ranks(_resume_flattened, 3, tmp_path / "c.safetensors"):  # another world size
        assert losses == pytest.approx(reference, rel=1e-5)
    # check-restore finds the model's names at the top level, beside the optimizer and train_state
    from fsdp_restore.check_restore import run_check_restore

    (tmp_path / "flat_factory.py").write_text("from models import build\n\n"
                                              "def make():\n    return build('mlp', seed=9)\n")
    # (FSDP1: built on the real device, so the model's non-persistent scratch buffer is the same on every rank)
    report = run_check_restore(str(tmp_path / "c.safetensors"), f"{tmp_path / 'flat_factory.py'}:make", nproc=2,
                               fsdp="fsdp1")
    assert report.ok, report.problems
    compared = sum(r["compared"] for r in report.ranks)  # the ranks share the comparisons out
    assert compared == len(build("mlp").state_dict()), report.ranks


def test_metadata_naming_other_code_is_refused(tmp_path):
    import pickle
    import subprocess

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ".metadata").write_bytes(pickle.dumps(subprocess.Popen))
    with pytest.raises(FormatError, match="without executing its pickle"):
        fsdp_restore.convert(tmp_path / "bad", tmp_path / "x.safetensors")


def test_values_a_pt_may_hold_convert_from_dcp_too(tmp_path):
    """numpy arrays and RNG states, an argparse Namespace: what a .pt conversion builds without running code was
    refused in a DCP directory (with torch's own advice to call add_safe_globals); a class of one's own is named
    with the fixes, which work for directories too (compared with torch.load of the saved values)."""
    import argparse
    import subprocess

    import numpy as np
    import torch.distributed.checkpoint as dcp

    values = {"rng": np.random.default_rng(0).bit_generator.state, "np_state": np.random.RandomState(1).get_state(),
              "args": argparse.Namespace(lr=0.1, name="run"), "w": torch.arange(6.0)}
    dcp.save(values, checkpoint_id=tmp_path / "ok", no_dist=True)
    fsdp_restore.convert(tmp_path / "ok", tmp_path / "ok.safetensors")
    back = fsdp_restore.load(tmp_path / "ok.safetensors")
    assert back["args"] == values["args"] and back["rng"] == values["rng"] and torch.equal(back["w"], values["w"])
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(back["np_state"], values["np_state"]))
    assert fsdp_restore.verify(tmp_path / "ok.safetensors", against=tmp_path / "ok").verdict == "identical"
    dcp.save({"w": torch.arange(3.0), "hook": subprocess.Popen}, checkpoint_id=tmp_path / "code", no_dist=True)
    with pytest.raises(fsdp_restore.UnsafePickleError, match=r"Popen, .*--trust-pickle"):
        fsdp_restore.convert(tmp_path / "code", tmp_path / "code.safetensors")
    assert not (tmp_path / "code.safetensors").exists()


@pytest.mark.parametrize("value", ["timedelta", "BytesIO"])
def test_a_value_dropped_on_conversion_verifies_against_its_dcp_source(tmp_path, value):
    """A DCP directory holding a value no safetensors file can hold (a timedelta; torchtitan's losses as a BytesIO)
    converts with it dropped (on_unsupported=skip, declared in the file), and verify against the directory failed
    ("cannot store object of type ..."), where the same drop from a .pt verified as a declared change."""
    import datetime
    import io

    import torch.distributed.checkpoint as dcp

    if value == "BytesIO":
        held = io.BytesIO()
        torch.save([3.1, 2.9], held)
        unpickling = {"trust_pickle": True}  # (a BytesIO is of _io, whose classes act: it cannot be allowed)
    else:
        held, unpickling = datetime.timedelta(seconds=5), {"allow_globals": ["datetime.timedelta"]}
    dcp.save({"w": torch.arange(3.0), "state": {"step": 3, "held": held}}, checkpoint_id=tmp_path / "d", no_dist=True)
    with pytest.raises(fsdp_restore.UnsafePickleError) as refused:  # the advice is what works: it advised
        fsdp_restore.convert(tmp_path / "d", tmp_path / "d.safetensors")  # --allow-global _io.BytesIO, then refused it
    text = str(refused.value)
    assert "on_unsupported=skip" in text and "--trust-pickle" in text
    assert ("cannot be allowed" in text and "--allow-global" not in text if value == "BytesIO"
            else "--allow-global datetime.timedelta" in text)
    fsdp_restore.convert(tmp_path / "d", tmp_path / "d.safetensors", on_unsupported="skip", **unpickling)
    assert fsdp_restore.load(tmp_path / "d.safetensors")["state"] == {"step": 3, "held": None}
    report = fsdp_restore.verify(tmp_path / "d.safetensors", against=tmp_path / "d", **unpickling)
    assert report.verdict == "identical up to the declared changes", report.problems
    assert report.dropped == [("state.held", f"{type(held).__module__}.{type(held).__qualname__}")]
    fsdp_restore.convert(tmp_path / "d", tmp_path / "other.safetensors", on_unsupported="skip", **unpickling)
    dcp.save({"w": torch.arange(3.0), "state": {"step": 4, "held": held}}, checkpoint_id=tmp_path / "e", no_dist=True)
    assert fsdp_restore.verify(tmp_path / "other.safetensors", against=tmp_path / "e", **unpickling).problems


def test_verify_against_the_dcp_directory(saved, tmp_path):
    root, _, _ = saved
    fsdp_restore.convert(root / "ckpt", tmp_path / "c.safetensors")
    report = fsdp_restore.verify(tmp_path / "c.safetensors", against=root / "ckpt")
    assert report.verdict == "identical", report.problems


def test_a_cast_that_rounds_whole_numbers_is_refused_from_a_directory_too(tmp_path):
    """Tensors of a DCP directory are read through their chunks' readers: the whole-number rule of a cast (convert
    refuses what `verify --against` fails) judges them over those readers, block by block and whole."""
    import torch.distributed.checkpoint as dcp

    values = {"model": {"ids": torch.arange(300.0).reshape(3, 100), "w": torch.linspace(-400.0, 400.0, 77)}}
    dcp.save(values, checkpoint_id=tmp_path / "d", no_dist=True)
    with pytest.raises(fsdp_restore.ConvertError, match=r"model\.ids \(whole numbers, by up to 1\)") as info:
        fsdp_restore.convert(tmp_path / "d", tmp_path / "o.safetensors", dtype="bf16")
    assert "model.w" not in str(info.value) and not (tmp_path / "o.safetensors").exists()
    fsdp_restore.convert(tmp_path / "d", tmp_path / "o.safetensors", dtype="bf16", cast_exclude=["model.ids"])
    assert fsdp_restore.verify(tmp_path / "o.safetensors", against=tmp_path / "d").verdict == (
        "identical up to the declared cast")


def test_a_reader_never_takes_another_checkpoints_chunk(tmp_path):
    """The per-thread chunk cache belongs to one reader: a later checkpoint's reader that Python placed at a freed
    one's address (as it often does) must read its own chunks (it was keyed by id() and read the old values)."""
    import gc
    import warnings

    import torch.distributed.checkpoint as dcp

    from fsdp_restore.dcp_in import read_dcp

    for name, value in (("a", 1.0), ("b", 2.0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.full((4, 4), value)}, checkpoint_id=str(tmp_path / name))

    def first_values(name):
        _, held = read_dcp(str(tmp_path / name))
        ((_, reader),) = held.values()
        return reader(0, 4).tolist()

    for _ in range(10):  # (the old cache failed within the first few, in most runs)
        assert first_values("a") == [1.0] * 4
        gc.collect()
        assert first_values("b") == [2.0] * 4
        gc.collect()
