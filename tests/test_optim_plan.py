"""Optimizer state saved the ways people save it, mapped to parameters exactly as torch maps it.

`torch.save(opt.state_dict())` numbers parameters in the *optimizer's* order, group by group; a restore must
map them as `Optimizer.load_state_dict` does (saved groups zip the live optimizer's groups, ids in group
order), whatever order the model lists its parameters in. The oracle everywhere is torch's own
`Optimizer.load_state_dict` on an unsharded model, compared with what `get_optimizer_state_dict` gathers from
the restored (sharded) optimizer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist import run_ranks
from models import build, wrap

import fsdp_restore
from fsdp_restore import RestoreError


def _clean(name: str) -> str:
    return name.removeprefix("module.").replace("_fsdp_wrapped_module.", "").replace("_orig_mod.", "")


def _groups(named: list[tuple[str, torch.nn.Parameter]], grouping: str, with_names: bool = False) -> list[dict[str, Any]]:
    """Param groups as users build them; ``with_names``: (name, param) pairs, so torch records param_names."""
    named = [(n, p) for n, p in named if p.requires_grad]

    def group(items, **hyper):
        return {"params": items if with_names else [p for _, p in items], **hyper}

    if grouping == "sorted":  # one group, in another order than model.parameters()
        return [group(sorted(named, key=lambda np_: _clean(np_[0]), reverse=True))]
    if grouping in ("decay", "lora"):  # nanoGPT / HF Trainer: weight decay on matrices only (decided by name:
        # FSDP1's original parameters are 1-D views of its flat shard)
        return [group([x for x in named if _is_matrix(x[0])], weight_decay=0.1),
                group([x for x in named if not _is_matrix(x[0])], weight_decay=0.0)]
    raise ValueError(grouping)


def _is_matrix(name: str) -> bool:
    return name.endswith("weight") and "norm" not in name


def _freeze(model: torch.nn.Module, grouping: str) -> torch.nn.Module:
    if grouping == "lora":  # a trainable subset: the optimizer holds fewer parameters than the model
        for name, p in model.named_parameters():
            if _clean(name).startswith(("inp.", "norm.")):
                p.requires_grad_(False)
    return model


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        model(torch.randn(6, 7, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _source(path, grouping: str, *, with_names: bool = False, compiled: bool = False, ddp_prefix: bool = False) -> None:
    """Train an unsharded model under ``grouping`` and torch.save model + optimizer as they come."""
    model = _freeze(build("mlp", seed=0), grouping)
    if compiled:  # torch.compile's wrapper: names gain "_orig_mod." (the eager backend needs no compiler)
        model = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(_groups(list(model.named_parameters()), grouping, with_names), lr=1e-2)
    _train(model, opt, 3)
    state = model.state_dict()
    optim = opt.state_dict()
    if ddp_prefix:  # what a DDP-wrapped model's state_dict() and named_parameters() call everything
        state = {f"module.{k}": v for k, v in state.items()}
        for g in optim["param_groups"]:
            if "param_names" in g:
                g["param_names"] = [f"module.{n}" for n in g["param_names"]]
    torch.save({"model": state, "optim": optim}, path)


def _oracle(path, grouping: str) -> dict[str, dict[str, torch.Tensor]]:
    """torch's own mapping: an unsharded model's optimizer built the same way, `load_state_dict` of the .pt."""
    model = _freeze(build("mlp", seed=1), grouping)
    opt = torch.optim.AdamW(_groups(list(model.named_parameters()), grouping), lr=1e-2)
    opt.load_state_dict(torch.load(path, weights_only=True)["optim"])
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {name_of[id(p)]: dict(s) for p, s in opt.state.items()}


def _restored_state(rank: int, world_size: int, path, how: str, grouping: str) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = wrap(_freeze(build("mlp", seed=77), grouping), how, world_size)
    opt = torch.optim.AdamW(_groups(list(model.named_parameters()), grouping), lr=1e-2)
    fsdp_restore.restore(model, path, optimizer=opt)
    gathered = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {_clean(name): {k: v.detach().cpu() for k, v in s.items()} for name, s in gathered["state"].items()}


def _assert_same_state(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> None:
    assert sorted(got) == sorted(want)
    for name, state in want.items():
        assert sorted(got[name]) == sorted(state), name
        for key, value in state.items():
            assert torch.equal(got[name][key].to(value.dtype), value), f"{name}.{key}"


@pytest.mark.parametrize("grouping", ["sorted", "decay", "lora"])
@pytest.mark.parametrize("how,world_size", [("plain", 1), ("fsdp2", 2), ("ddp", 2), ("fsdp1-FULL_SHARD-orig", 3)])
def test_integer_ids_map_as_load_state_dict_maps_them(tmp_path, grouping, how, world_size):
    """Ids numbered in the optimizer's order (one group in another order than the model's; decay / no-decay
    groups; a trainable subset) land on the parameters torch's own load_state_dict gives them."""
    _source(tmp_path / "ck.pt", grouping)
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    want = _oracle(tmp_path / "ck.pt", grouping)
    for got in run_ranks(_restored_state, world_size, tmp_path / "ck.safetensors", how, grouping):
        _assert_same_state(got, want)


@pytest.mark.parametrize("source", ["compiled-ids", "compiled-names", "ddp-names"])
def test_wrapper_infixes_in_the_checkpoint_are_normalized(tmp_path, source):
    """A checkpoint saved from torch.compile (`_orig_mod.`) or DDP (`module.`), weights and optimizer names,
    restores into a sharded model of plain names."""
    _source(tmp_path / "ck.pt", "decay", with_names=source.endswith("names"), compiled=source.startswith("compiled"),
            ddp_prefix=source.startswith("ddp"))
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    want = _oracle(tmp_path / "ck.pt", "decay")
    for got in run_ranks(_restored_state, 2, tmp_path / "ck.safetensors", "fsdp2", "decay"):
        _assert_same_state(got, want)


def _compiled_target(rank: int, world_size: int, path) -> bool:
    model = torch.compile(build("mlp", seed=77), backend="eager")
    opt = torch.optim.AdamW(_groups(list(model.named_parameters()), "decay"), lr=1e-2)
    fsdp_restore.restore(model, path, optimizer=opt)
    return True


def test_restore_into_a_compiled_model(tmp_path):
    _source(tmp_path / "ck.pt", "decay", with_names=True)
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    assert run_ranks(_compiled_target, 1, tmp_path / "ck.safetensors") == [True]


def _expect_error(rank: int, world_size: int, path, grouping: str) -> str:
    model = wrap(_freeze(build("mlp", seed=77), "none" if grouping == "sizes" else grouping), "fsdp2", world_size)
    named = list(model.named_parameters())
    if grouping == "sizes":  # decay / no-decay, but the norm's weight put among the matrices
        groups = [{"params": [p for n, p in named if _is_matrix(n) or n == "norm.weight"]},
                  {"params": [p for n, p in named if not _is_matrix(n) and n != "norm.weight"]}]
    else:  # same group sizes, another order: the shapes do not fit
        groups = [{"params": [p for _, p in reversed(named)]}]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore(model, path, optimizer=opt)
    return str(info.value)


def test_group_sizes_differ_every_problem_listed_once_on_every_rank(tmp_path):
    _source(tmp_path / "ck.pt", "decay")
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    ck["model"]["out.weight"] = torch.zeros(4, 5)  # a weight problem too: both halves are reported
    torch.save(ck, tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    messages = run_ranks(_expect_error, 2, tmp_path / "ck.safetensors", "sizes")
    assert len(set(messages)) == 1
    text = messages[0]
    assert "param group 0" in text and "5 parameters" in text and "4" in text, text
    assert "out.weight: checkpoint [4, 5] vs model [3, 5]" in text, text


def test_ids_whose_shapes_do_not_fit_are_refused_naming_them(tmp_path):
    _source(tmp_path / "ck.pt", "sorted")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    messages = run_ranks(_expect_error, 2, tmp_path / "ck.safetensors", "reversed")
    assert len(set(messages)) == 1
    # saved in reverse name order, restored in reverse model order: id 8 was norm.weight's [5] in the saved run
    assert "param group 0, id 8 -> inp.weight [5, 7]: saved 'exp_avg' has shape [5]" in messages[0], messages[0]
    assert "belongs to other parameters" in messages[0]


def test_one_moment_of_another_shape_is_named_without_blaming_the_order(tmp_path):
    """One saved moment of another shape (the rest fit) was followed by "the saved state above belongs to other
    parameters ... list each group's parameters in the order the saved run did", a second problem that no other
    order could cause."""
    from models import build

    model = build("mlp", seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 7)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["exp_avg"] = saved["state"][0]["exp_avg"].t().contiguous()
    fsdp_restore.save({"model": model.state_dict(), "optim": saved}, tmp_path / "ck.safetensors")
    fresh = build("mlp", seed=1)
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore(fresh, tmp_path / "ck.safetensors", optimizer=torch.optim.AdamW(fresh.parameters()))
    text = str(info.value)
    assert "optimizer (1): param group 0, id 0 -> inp.weight [5, 7]: saved 'exp_avg' has shape [7, 5]" in text, text
    assert "belongs to other parameters" not in text, text


# ---- a Hugging Face Trainer output directory ----------------------------------------------------------


def _trainer_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """transformers.Trainer's groups: weight decay on everything but biases and norm weights."""
    decay = [n for n, _ in model.named_parameters() if not n.endswith("bias") and "norm" not in _clean(n)]
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def _trainer_run(out) -> None:
    """What Trainer leaves in a checkpoint directory: model.safetensors (save_pretrained) beside optimizer.pt,
    torch.save(optimizer.state_dict()) saved alone (integer ids over two groups)."""
    from helpers import tiny_llama

    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(_trainer_groups(model), lr=1e-3)
    for step in range(2):
        ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out, safe_serialization=True)
    torch.save(opt.state_dict(), out / "optimizer.pt")


def _trainer_resume(rank: int, world_size: int, out) -> dict[str, dict[str, torch.Tensor]]:
    from helpers import tiny_llama
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = wrap(tiny_llama(seed=5), "fsdp2", world_size)
    opt = torch.optim.AdamW(_trainer_groups(model), lr=1e-3)
    fsdp_restore.restore_model(model, out / "model.safetensors")
    fsdp_restore.restore_optimizer(opt, model, out / "optimizer.safetensors", optim_prefix="")
    gathered = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {name: {k: v.detach().cpu() for k, v in s.items()} for name, s in gathered["state"].items()}


def test_hf_trainer_directory_resumes_under_fsdp2(tmp_path):
    from helpers import tiny_llama

    _trainer_run(tmp_path)
    fsdp_restore.convert(tmp_path / "optimizer.pt", tmp_path / "optimizer.safetensors")
    model = tiny_llama(seed=9)
    opt = torch.optim.AdamW(_trainer_groups(model), lr=1e-3)
    opt.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))  # the oracle: torch's mapping
    name_of = {id(p): n for n, p in model.named_parameters()}
    want = {name_of[id(p)]: dict(s) for p, s in opt.state.items()}
    for got in run_ranks(_trainer_resume, 2, tmp_path):
        _assert_same_state(got, want)


def test_a_named_group_may_hold_a_part_of_the_saved_one_only_without_strict():
    """The matching alone (one process): a live group holding some of a named saved group's parameters (a pipeline
    stage) maps them by name with strict=False, listing the rest; strict refuses, naming the way; a live name the
    checkpoint lacks, or a group saved with torch's integer ids only, is refused either way."""
    from fsdp_restore.optim_plan import match_saved
    from fsdp_restore.stored import StoredGroup, StoredOptimizer

    named = StoredOptimizer((StoredGroup(("0", "1", "2"), ("a", "b", "c"), {}),), {})
    problems: list[str] = []
    assert match_saved(named, [["c", "a"]], problems) == {} and "strict=False" in problems[0]
    problems, unrestored = [], []
    mapping = match_saved(named, [["c", "a"]], problems, strict=False, unrestored=unrestored)
    assert not problems and (mapping["a"], mapping["c"]) == ("0", "2") and unrestored == ["b"]
    problems = []
    assert match_saved(named, [["a", "z"]], problems, strict=False) == {} and "only in the optimizer: z" in problems[0]
    numbered = StoredOptimizer((StoredGroup(("0", "1", "2"), None, {}),), {})
    problems = []
    assert match_saved(numbered, [["c", "a"]], problems, strict=False) == {} and "has 3 parameters" in problems[0]


@pytest.mark.parametrize("saved,given", [("AdamW", "SGD"), ("SGD", "AdamW")])
def test_state_of_another_optimizer_type_is_refused(tmp_path, saved, given):
    """AdamW's state restored into SGD reported success: SGD's groups kept their own momentum beside the saved betas,
    and the state held exp_avg where SGD looks for momentum_buffer (torch's load_state_dict takes it too, and the
    first step fails). A group saved by an older torch, lacking the options added since, still restores."""
    options = {"SGD": {"momentum": 0.9}, "AdamW": {}}
    model = torch.nn.Linear(3, 2)
    opt = getattr(torch.optim, saved)(model.parameters(), lr=0.1, **options[saved])
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    state["param_groups"][0]["initial_lr"] = 0.1  # a scheduler's key: not a sign of another type
    torch.save({"model": model.state_dict(), "optim": state}, tmp_path / "c.pt")
    fsdp_restore.convert(tmp_path / "c.pt", tmp_path / "c.safetensors")
    other = getattr(torch.optim, given)(model.parameters(), lr=0.1, **options[given])
    before = {k: v for k, v in other.param_groups[0].items() if k != "params"}
    with pytest.raises(RestoreError, match=f"param group 0 of the checkpoint lacks .*which {given}'s groups need"
                                           ".*saved from another optimizer type"):
        fsdp_restore.restore(model, tmp_path / "c.safetensors", optimizer=other)
    assert {k: v for k, v in other.param_groups[0].items() if k != "params"} == before and not other.state
    # the same type, saved by a torch before maximize, foreach, capturable, differentiable and fused: restored
    for group in state["param_groups"]:
        for key in ("maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"):
            group.pop(key, None)
    torch.save({"model": model.state_dict(), "optim": state}, tmp_path / "old.pt")
    fsdp_restore.convert(tmp_path / "old.pt", tmp_path / "old.safetensors")
    same = getattr(torch.optim, saved)(model.parameters(), lr=0.5, **options[saved])
    fsdp_restore.restore(model, tmp_path / "old.safetensors", optimizer=same)
    oracle = getattr(torch.optim, saved)(model.parameters(), lr=0.5, **options[saved])
    oracle.load_state_dict(state)
    assert same.param_groups[0]["lr"] == oracle.param_groups[0]["lr"] == 0.1
    assert {k for k in same.param_groups[0]} == {k for k in oracle.param_groups[0]}


def test_a_group_saved_before_an_option_existed_still_restores(tmp_path):
    """SparseAdam has no __setstate__ to add the options later torch versions gave it (maximize): a group saved
    without one was refused as another optimizer type's, which torch's load_state_dict and step() take."""
    model = torch.nn.Embedding(5, 3, sparse=True)
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.1)
    model(torch.tensor([1, 3])).sum().backward()
    opt.step()
    state = opt.state_dict()
    del state["param_groups"][0]["maximize"]
    torch.save({"model": model.state_dict(), "optim": state}, tmp_path / "c.pt")
    fsdp_restore.convert(tmp_path / "c.pt", tmp_path / "c.safetensors")
    fresh = torch.optim.SparseAdam(model.parameters(), lr=0.5)
    fsdp_restore.restore(model, tmp_path / "c.safetensors", optimizer=fresh)
    oracle = torch.optim.SparseAdam(model.parameters(), lr=0.5)
    oracle.load_state_dict(state)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fresh.state[model.weight][key], oracle.state[model.weight][key])
    assert fresh.param_groups[0]["lr"] == 0.1
