"""The typed view of a stored checkpoint: names normalized as torch normalizes them, the model subtree rule,
optimizer state dicts in every save style, and tensors whose stored memory is not their values."""

from __future__ import annotations

import pytest
import torch

import fsdp_restore
from fsdp_restore import RestoreError
from fsdp_restore.convert import save
from fsdp_restore.stored import default_prefix, normalize_names, stored_optimizer, tensor_sources


def test_wrapper_names_are_normalized():
    names = ["module._orig_mod.a.weight", "module.b._checkpoint_wrapped_module.w", "module.c._fsdp_wrapped_module.x"]
    assert list(normalize_names(names).values()) == ["a.weight", "b.w", "c.x"]
    # DDP's prefix only when every stored name has it, and the model's own names do not
    assert normalize_names(["module.a", "b"]) == {"module.a": "module.a", "b": "b"}
    assert normalize_names(["module.a"], model_names=["module.a"]) == {"module.a": "module.a"}
    # whole components only: a name that holds a wrapper's as a part of its own is the user's ("x_orig_mod.weight"
    # became "xweight"); a wrapper's name at the end is dropped (an FSDP1 unit inside a checkpoint wrapper)
    assert list(normalize_names(["x_orig_mod.weight", "my_fsdp_wrapped_module.w", "a._checkpoint_wrapped_module",
                                 "b._fsdp_wrapped_module._checkpoint_wrapped_module.c"]).values()) == [
        "x_orig_mod.weight", "my_fsdp_wrapped_module.w", "a", "b.c"]


def test_model_subtree_only_for_the_exact_top_level_key(tmp_path):
    save({"model": {"w": torch.ones(2)}, "optim": {"state": {}, "param_groups": []}}, tmp_path / "t.safetensors")
    save({"model.w": torch.ones(2)}, tmp_path / "hf.safetensors")
    with fsdp_restore.open_checkpoint(tmp_path / "t.safetensors") as ckpt:
        assert default_prefix(ckpt) == "model"
    with fsdp_restore.open_checkpoint(tmp_path / "hf.safetensors") as ckpt:
        assert default_prefix(ckpt) == ""
        assert set(tensor_sources(ckpt, "")[0]) == {"model.w"}


@pytest.mark.parametrize("style", ["ids", "param_names", "names"])
def test_optimizer_groups_in_every_save_style(tmp_path, style):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    named = list(model.named_parameters())
    groups = [{"params": named[:2] if style == "param_names" else [p for _, p in named[:2]], "weight_decay": 0.1},
              {"params": named[2:] if style == "param_names" else [p for _, p in named[2:]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    if style == "names":  # keyed by names, as get_optimizer_state_dict writes it
        sd = {"state": {named[i][0]: s for i, s in sd["state"].items()},
              "param_groups": [{**g, "params": [named[i][0] for i in g["params"]]} for g in sd["param_groups"]]}
    save({"optim": sd}, tmp_path / "o.safetensors")
    with fsdp_restore.open_checkpoint(tmp_path / "o.safetensors") as ckpt:
        view = stored_optimizer(ckpt, "optim")
    assert [g.hyper["weight_decay"] for g in view.groups] == [0.1, 0.0]
    assert all("params" not in g.hyper and "param_names" not in g.hyper for g in view.groups)
    if style == "ids":
        assert [g.ids for g in view.groups] == [("0", "1"), ("2", "3")] and view.groups[0].names is None
    else:
        assert [g.names for g in view.groups] == [("0.weight", "0.bias"), ("1.weight", "1.bias")]
    assert set(view.state[view.groups[1].ids[0]]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("top", [[1000, 2000], ("a", None), [[1, 2], [3, 4]]])
def test_a_top_level_list_is_a_value_not_pairs(tmp_path, top):
    """The optimizer's whereabouts are looked for among the top level's entries; a list there (lr milestones,
    Python's RNG state) was unpacked as key/value pairs: "TypeError: cannot unpack non-iterable int object"."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    save({"model": model.state_dict(), "opt": opt.state_dict(), "milestones": top, "step": 10}, tmp_path / "c.safetensors")
    result = fsdp_restore.restore(model, tmp_path / "c.safetensors", optimizer=opt)  # found under 'opt'
    assert result.optimizer.prefix == "opt" and result["milestones"] == top and result["step"] == 10
    save({"weights": model.state_dict(), "history": top}, tmp_path / "w.safetensors")
    with pytest.raises(RestoreError, match="(?s)unexpected in the checkpoint .*weights.bias.*hint: check model_prefix="):
        fsdp_restore.restore_model(model, tmp_path / "w.safetensors")
    result = fsdp_restore.restore(model, tmp_path / "c.safetensors", optimizer=opt, optim_prefix="opt")
    assert result["milestones"] == top and result["step"] == 10


def test_a_conj_view_is_refused_not_read_as_its_memory(tmp_path):
    state = torch.nn.Linear(2, 2).to(torch.complex64).state_dict()
    state["weight"] = state["weight"].conj()
    save(state, tmp_path / "c.safetensors")
    with pytest.raises(RestoreError, match="a conj view of 'weight': its stored memory is not its values"):
        fsdp_restore.restore_model(torch.nn.Linear(2, 2).to(torch.complex64), tmp_path / "c.safetensors")


def test_a_transposed_view_is_one_clear_refusal_with_its_fix(tmp_path):
    """It was reported both as unsupported and as missing, with the hint to pass strict=False (which failed the
    same way); a view the model does not ask for is only unexpected."""
    base = torch.arange(24.0).reshape(4, 6)
    torch.save({"a": base, "b": base.t()}, tmp_path / "sv.pt")
    fsdp_restore.convert(tmp_path / "sv.pt", tmp_path / "sv.safetensors")
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(6, 4))
    for strict in (True, False):
        with pytest.raises(RestoreError) as info:
            fsdp_restore.restore_model(model, tmp_path / "sv.safetensors", strict=strict)
        text = str(info.value)
        assert "b: a strided view of 'a'" in text and ".contiguous()" in text and "missing" not in text, text
    only_a = torch.nn.Module()
    only_a.a = torch.nn.Parameter(torch.zeros(4, 6))
    report = fsdp_restore.restore_model(only_a, tmp_path / "sv.safetensors", strict=False)
    assert report.unexpected == ["b"] and torch.equal(only_a.a.detach(), base)


_BASE = torch.arange(4.0)


@pytest.mark.parametrize("saved", [{"a.b": torch.full((2,), 1.0), "a": {"b": torch.full((2,), 2.0)}},
                                   {"_orig_mod.a.b": torch.full((2,), 1.0), "a.b": torch.full((2,), 2.0)},
                                   {"full": _BASE, "a.b": _BASE[:2], "a": {"b": _BASE[2:]}}],
                         ids=["dotted-beside-nested", "compiled-beside-plain", "two-views-of-one-tensor"])
def test_two_tensors_under_one_name_are_refused_not_picked(tmp_path, saved):
    """{"a.b": x, "a": {"b": y}} restored y into a.b silently (the last one found won)."""
    torch.save(saved, tmp_path / "two.pt")
    fsdp_restore.convert(tmp_path / "two.pt", tmp_path / "two.safetensors")
    model = torch.nn.Module()
    model.a = torch.nn.Module()
    model.a.b = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(RestoreError, match=r"a\.b: 2 of the checkpoint's tensors have this name") as info:
        fsdp_restore.restore_model(model, tmp_path / "two.safetensors")
    assert "rename one in the source" in str(info.value) and torch.equal(model.a.b.detach(), torch.zeros(2))
    with fsdp_restore.open_checkpoint(tmp_path / "two.safetensors") as ckpt:
        found, problems = tensor_sources(ckpt, "", ["a.b"])
    assert "a.b" not in found and set(problems) == {"a.b"}


def test_a_checkpoint_of_a_compiled_ddp_model_restores_into_the_plain_model(tmp_path):
    """torch.compile(DDP(m)).state_dict() names are '_orig_mod.module.x': 'module.' was stripped only where it
    stood first, before the compile prefix was dropped, so every name was missing."""
    from models import build

    state = {f"_orig_mod.module.{k}": v for k, v in build("mlp", seed=3).state_dict().items()}
    assert normalize_names(list(state), ["inp.weight"])["_orig_mod.module.inp.weight"] == "inp.weight"
    save(state, tmp_path / "c.safetensors")
    model = build("mlp", seed=4)
    fsdp_restore.restore_model(model, tmp_path / "c.safetensors")
    assert all(torch.equal(v, state[f"_orig_mod.module.{k}"]) for k, v in model.state_dict().items())


def test_a_flattened_optimizer_keeps_nested_state_under_its_parameter(tmp_path):
    """``state.<name>.<field>.<inner>`` (Shampoo's preconditioners, flattened by get_optimizer_state_dict) was split
    at its last dot, making up a parameter ``<name>.<field>``; it is the field's nested value."""
    from fsdp_restore.stored import value

    flat = {"state.blocks.0.w.step": torch.tensor(2.0), "state.blocks.0.w.pre.L": torch.ones(2, 2),
            "state.blocks.0.w.pre.R": torch.zeros(3), "param_groups.blocks.0.w.lr": 0.1,
            "param_groups.blocks.0.w.params": ["blocks.0.w"]}
    save({"blocks.0.w": torch.ones(2), "optimizer": flat}, tmp_path / "f.safetensors")
    with fsdp_restore.open_checkpoint(tmp_path / "f.safetensors") as ckpt:
        saved = stored_optimizer(ckpt, "optimizer", ["blocks.0.w"], [["blocks.0.w"]])
        assert [g.names for g in saved.groups] == [("blocks.0.w",)] and dict(saved.groups[0].hyper) == {"lr": 0.1}
        assert set(saved.state) == {"blocks.0.w"} and set(saved.state["blocks.0.w"]) == {"step", "pre"}
        pre = value(ckpt, saved.state["blocks.0.w"]["pre"])
        assert torch.equal(pre["L"], torch.ones(2, 2)) and torch.equal(pre["R"], torch.zeros(3))


def _lightning_checkpoint(path):
    """PyTorch Lightning's layout: the LightningModule's state dict (its model under `model.`) in `state_dict`, the
    optimizers' state dicts in the list `optimizer_states`, the rest beside them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "optimizer_states": [opt.state_dict()], "lr_schedulers": [{"last_epoch": 1}], "epoch": 3,
                "global_step": 10, "loops": {"fit_loop": {"epoch_progress": {"current": 3}}}}, path / "l.ckpt")
    fsdp_restore.convert(path / "l.ckpt", path / "l.safetensors")
    return model, opt


def test_a_subtree_within_an_entry_is_neither_read_nor_handed_back(tmp_path):
    """Restored from `state_dict.model` and `optimizer_states.0`, the result held both whole (every weight and
    Adam moment, unsharded, on every rank), and without `optimizer=` the optimizer's state still came back: only
    top-level names were left out, and only top-level optimizer state dicts were known."""
    model, opt = _lightning_checkpoint(tmp_path)
    torch.manual_seed(1)
    ours = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=0.5)
    rest = {"epoch": 3, "global_step": 10, "lr_schedulers": [{"last_epoch": 1}],
            "loops": {"fit_loop": {"epoch_progress": {"current": 3}}}}
    alone = fsdp_restore.restore(ours, tmp_path / "l.safetensors", model_prefix="state_dict.model")
    assert dict(alone) == rest
    result = fsdp_restore.restore(ours, tmp_path / "l.safetensors", optimizer=ours_opt,
                                  model_prefix="state_dict.model", optim_prefix="optimizer_states.0")
    assert dict(result) == rest
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), model.state_dict().values()))
    assert torch.equal(ours_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    found = fsdp_restore.restore(ours, tmp_path / "l.safetensors", optimizer=ours_opt,  # found where it lies
                                 model_prefix="state_dict.model")
    assert found.optimizer.prefix == "optimizer_states.0" and dict(found) == rest


def test_a_config_with_state_and_param_groups_keys_is_not_an_optimizer(tmp_path):
    """Found by key names alone, such a dict was taken for an optimizer's state and left out of the result; and an
    optimizer's state dropped from a list left the items after it at other indices."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save({"model": model.state_dict(), "hparams": {"state": 1, "param_groups": [1]},
          "optimizer_states": [opt.state_dict(), {"name": "second"}]}, tmp_path / "c.safetensors")
    ours = torch.nn.Linear(2, 2)
    rest = fsdp_restore.restore(ours, tmp_path / "c.safetensors", optimizer=torch.optim.SGD(ours.parameters(), lr=0.5),
                                optim_prefix="optimizer_states.0")
    assert dict(rest) == {"hparams": {"state": 1, "param_groups": [1]}, "optimizer_states": [None, {"name": "second"}]}


@pytest.mark.parametrize("layout", ["weights", "optimizer elsewhere"])
def test_an_optimizer_restored_from_where_none_is_says_what_is_there_and_the_fix(tmp_path, layout):
    """``restore_optimizer`` given a weights file (a review's case: the error named '' and nothing else), or a
    checkpoint whose optimizer is under another name: the error says where it looked, what is there, and the fix."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    obj = model.state_dict() if layout == "weights" else {"weights": model.state_dict(), "trainer": {
        "optimizer": opt.state_dict(), "param_groups": 1}}
    save(obj, tmp_path / "ck.safetensors")
    fresh_model = torch.nn.Linear(3, 2)
    fresh = torch.optim.AdamW(fresh_model.parameters())
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_optimizer(fresh, fresh_model, tmp_path / "ck.safetensors",
                                       optim_prefix="" if layout == "weights" else "trainer")
    text = str(info.value)
    if layout == "weights":
        assert ("the checkpoint's top level is not an optimizer state dict (no 'param_groups'; it holds 'weight',"
                in text), text
        assert "pass the file that holds the optimizer's state (a weights file holds none)" in text, text
    else:
        assert "'trainer' in the checkpoint is not an optimizer state dict (no 'state'; it holds 'optimizer'," in text
        assert "it holds one under 'trainer.optimizer': pass optim_prefix='trainer.optimizer'" in text, text
