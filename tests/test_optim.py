"""Optimizer state and full resume: restoring a .pt training checkpoint into a sharded model and
optimizer continues exactly as the unsharded run that never stopped."""

from __future__ import annotations

import pytest
import torch
from dist import NCCL, cases, run_ranks
from models import build, wrap

import fsdp_restore
from fsdp_restore import RestoreError

STEPS_BEFORE, STEPS_AFTER = 3, 3


def _batch(model_name: str, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    if model_name == "mlp":
        return (torch.randn(6, 7, generator=g),)
    ids = torch.randint(0, 97, (2, 8), generator=g)
    return (ids,)


def _loss(model, model_name, batch):
    import models

    x = batch[0].to(models.DEVICE)
    if model_name == "mlp":
        return model(x).pow(2).mean()
    return model(input_ids=x, labels=x).loss


def _make_optimizer(kind: str, params, named: bool = False):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    raise ValueError(kind)


def _train(model, opt, model_name, steps, first_step):
    losses = []
    for step in range(first_step, first_step + steps):
        loss = _loss(model, model_name, _batch(model_name, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def reference_run(model_name: str, kind: str, path, named: bool = False):
    """Unsharded: train, save a .pt checkpoint midway, keep going. Returns losses and final params."""
    model = build(model_name, seed=0)
    opt = _make_optimizer(kind, model.named_parameters() if named else model.parameters())
    _train(model, opt, model_name, STEPS_BEFORE, 0)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": STEPS_BEFORE,
                "rng": torch.get_rng_state()}, path)
    losses = _train(model, opt, model_name, STEPS_AFTER, STEPS_BEFORE)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _resume(rank, world_size, path, model_name, how, kind):
    from models import full_state

    model = wrap(build(model_name, seed=77), how, world_size)
    opt = _make_optimizer(kind, model.parameters())
    extra = fsdp_restore.restore(model, path, optimizer=opt)
    assert extra["step"] == STEPS_BEFORE and set(extra) == {"step", "rng"}
    for state in opt.state.values():  # padding included: no NaN poison or uninitialized memory left
        for value in state.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            assert torch.isfinite(local).all()
    assert opt.param_groups[0]["lr"] == 1e-2
    losses = _train(model, opt, model_name, STEPS_AFTER, STEPS_BEFORE)
    return losses, full_state(model, how)


def _check_same(results, ref_losses, ref_params, atol=1e-5):
    for losses, params in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, atol=atol, rtol=1e-4, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("how", ["fsdp2", "fsdp1-FULL_SHARD-orig", "fsdp1-FULL_SHARD-flat"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_resume_mlp_adamw_equals_never_stopping(tmp_path, how, world_size):
    ref_losses, ref_params = reference_run("mlp", "adamw", tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    _check_same(run_ranks(_resume, world_size, tmp_path / "ck.pt", "mlp", how, "adamw"), ref_losses, ref_params)


@pytest.mark.parametrize("how", ["fsdp2", "fsdp1-FULL_SHARD-flat"])
@pytest.mark.parametrize("world_size,backend", cases(1, only=NCCL) + cases(2, only=NCCL))  # training: NCCL
def test_resume_on_the_gpu(tmp_path, how, world_size, backend):
    """Model and AdamW state restored into GPU shards (pinned staging, side streams, the check on the device)."""
    ref_losses, ref_params = reference_run("mlp", "adamw", tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    # GPU kernels sum in another order than the CPU reference: a looser tolerance than CPU resumes
    results = run_ranks(_resume, world_size, tmp_path / "ck.safetensors", "mlp", how, "adamw", backend=backend)
    for losses, params in results:
        assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_resume_other_optimizers(tmp_path, kind):
    ref_losses, ref_params = reference_run("mlp", kind, tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    _check_same(run_ranks(_resume, 2, tmp_path / "ck.safetensors", "mlp", "fsdp2", kind), ref_losses, ref_params)


@pytest.mark.parametrize("how", ["fsdp2", "fsdp1-FULL_SHARD-flat"])
def test_resume_transformers_gpt2(tmp_path, how):
    ref_losses, ref_params = reference_run("gpt2", "adamw", tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    # atol 1e-4: a 3-way reduce-scatter sums gradients in another order than one process, and Adam's
    # g / sqrt(v) magnifies that for near-zero gradients (seen: 4e-5 on a bias); losses still match to 1e-5.
    _check_same(run_ranks(_resume, 3, tmp_path / "ck.safetensors", "gpt2", how, "adamw"), ref_losses, ref_params,
                atol=1e-4)


def test_resume_with_param_names(tmp_path):
    ref_losses, ref_params = reference_run("mlp", "adamw", tmp_path / "ck.pt", named=True)
    assert "param_names" in torch.load(tmp_path / "ck.pt")["optim"]["param_groups"][0]
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    _check_same(run_ranks(_resume, 2, tmp_path / "ck.safetensors", "mlp", "fsdp2", "adamw"), ref_losses, ref_params)


def _stage_worker(rank, world_size, path):
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world_size)]  # each stage restores within its own ranks
    stage = build("mlp", seed=77)
    names = [n for n, _ in stage.named_parameters()]
    keep = names[:2] if rank == 0 else names[2:]  # pipeline stages: a part of the parameters each
    opt = _make_optimizer("adamw", [(n, p) for n, p in stage.named_parameters() if n in keep])
    with pytest.raises(RestoreError) as info:  # strict: the groups must hold what was saved
        fsdp_restore.restore_optimizer(opt, stage, path, process_group=groups[rank])
    report = fsdp_restore.restore_optimizer(opt, stage, path, process_group=groups[rank], strict=False)
    by_param = dict(stage.named_parameters())
    return str(info.value), sorted(report.unexpected), {n: {k: v.clone() for k, v in opt.state[by_param[n]].items()}
                                                        for n in keep}


def test_an_optimizer_over_a_part_of_the_saved_model_restores_with_strict_false(tmp_path):
    """A pipeline stage's optimizer from a full checkpoint saved with param_names: refused with strict (naming
    strict=False), restored by name with strict=False as torch's set_optimizer_state_dict(strict=False) does;
    state compared with torch.load of the source."""
    reference_run("mlp", "adamw", tmp_path / "ck.pt", named=True)
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    source = torch.load(tmp_path / "ck.pt")["optim"]
    by_name = {n: source["state"][i] for g in source["param_groups"] for n, i in zip(g["param_names"], g["params"])}
    results = run_ranks(_stage_worker, 2, tmp_path / "ck.safetensors")
    every = sorted(by_name)
    for message, unexpected, state in results:
        assert "strict=False" in message and "only in the checkpoint" in message
        assert unexpected == sorted(set(every) - set(state))
        for name, values in state.items():
            assert values.keys() == by_name[name].keys()
            assert all(torch.equal(values[k], by_name[name][k]) for k in values), name


def _bytes_worker(rank, world_size, path):
    from fsdp_restore import restore_optimizer

    model = wrap(build("gpt2", seed=77), "fsdp2", world_size)
    opt = _make_optimizer("adamw", model.parameters())
    fsdp_restore.restore_model(model, path)
    report = restore_optimizer(opt, model, path)
    return report.bytes_read, report.tensors


def test_each_rank_reads_only_its_slice_of_optimizer_state(tmp_path):
    reference_run("gpt2", "adamw", tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    state = torch.load(tmp_path / "ck.pt")["optim"]["state"]
    per_param = sum(t.numel() * t.element_size() for s in state.values() for k, t in s.items() if t.dim() > 0)
    reads, tensors = zip(*run_ranks(_bytes_worker, 3, tmp_path / "ck.safetensors"))
    # the report counts what was read: every byte of the state once over the ranks (a report of 0 was a bug)
    assert per_param * 0.98 <= sum(reads) <= per_param * 1.02, (reads, per_param)
    assert max(reads) < per_param / 2
    assert set(tensors) == {sum(len(s) for s in state.values())}  # every state tensor, step included


def _restore_again_worker(rank, world_size, path, how):
    model = wrap(build("mlp", seed=77), how, world_size)
    opt = _make_optimizer("adamw", model.parameters())
    fsdp_restore.restore(model, path, optimizer=opt)

    def local(v):
        return v.to_local() if hasattr(v, "to_local") else v

    first = {(id(p), k): local(v).clone() for p, st in opt.state.items() for k, v in st.items()}
    objects = {(id(p), k): v for p, st in opt.state.items() for k, v in st.items() if local(v).dim() > 0}
    params = list(opt.state)
    # a few steps of training change every state tensor; one, in bf16, no longer has the parameter's layout
    _train(model, opt, "mlp", 2, STEPS_BEFORE)
    odd = params[0]
    opt.state[odd]["exp_avg"] = opt.state[odd]["exp_avg"].to(torch.bfloat16)
    fsdp_restore.restore(model, path, optimizer=opt)
    reused = 0
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(local(v), first[(id(p), k)]), k  # bit for bit the checkpoint's state again
            if (id(p), k) in objects:
                if p is odd and k == "exp_avg":
                    assert v is not objects[(id(p), k)] and local(v).dtype == torch.float32
                else:
                    assert v is objects[(id(p), k)]  # overwritten in place: no second copy of the state
                    reused += 1
    return reused


@pytest.mark.parametrize("how", ["fsdp2", "fsdp1-FULL_SHARD-flat"])
def test_restoring_into_existing_state_overwrites_it_in_place(tmp_path, how):
    reference_run("mlp", "adamw", tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    reused = run_ranks(_restore_again_worker, 3, tmp_path / "ck.safetensors", how)
    assert all(r > 0 for r in reused)


def _mismatch_worker(rank, world_size, path):
    model = wrap(build("mlp", seed=77), "fsdp2", world_size)
    params = [p for n, p in model.named_parameters() if not n.startswith("out")]
    opt = _make_optimizer("adamw", params)
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore(model, path, optimizer=opt)
    return str(info.value)


def test_optimizer_not_matching_checkpoint_fails_clearly_on_every_rank(tmp_path):
    reference_run("mlp", "adamw", tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    messages = run_ranks(_mismatch_worker, 2, tmp_path / "ck.safetensors")
    assert all("out.weight" in m for m in messages) and len(set(messages)) == 1


def _differing_steps_worker(rank, world_size, path, how):
    model = wrap(build("mlp", seed=77), how, world_size)
    opt = _make_optimizer("adamw", model.parameters())
    try:
        fsdp_restore.restore(model, path, optimizer=opt)
    except RestoreError as e:
        return str(e)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {name: float(state["step"]) for name, state in full["state"].items()}


def test_step_counters_that_differ_within_an_fsdp1_flat_parameter(tmp_path):
    """Adam keeps a step counter per parameter, which differ where a parameter got no gradient on some step. An
    FSDP1 flat parameter (use_orig_params=False) holds one state for all of its parameters: such a checkpoint
    restored every rank's flat parameter with the counter of whichever of its names came first (a resumed run's
    bias correction silently wrong), where torch's own loader refuses. Refused on every rank, naming the values;
    with use_orig_params=True each parameter keeps its own (compared with torch.load through torch's gather)."""
    model = build("mlp", seed=0)
    opt = _make_optimizer("adamw", model.parameters())
    _train(model, opt, "mlp", 2, 0)
    saved = opt.state_dict()
    for pid, state in saved["state"].items():
        state["step"] = torch.tensor(float(2 + pid))
    torch.save({"model": model.state_dict(), "optim": saved}, tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    messages = run_ranks(_differing_steps_worker, 2, tmp_path / "ck.safetensors", "fsdp1-FULL_SHARD-flat")
    assert len(set(messages)) == 1 and "saved 'step' differs between parameters that share one flat" in messages[0]
    assert "use_orig_params=True" in messages[0]
    steps = run_ranks(_differing_steps_worker, 2, tmp_path / "ck.safetensors", "fsdp1-FULL_SHARD-orig")
    source = torch.load(tmp_path / "ck.pt")["optim"]["state"]
    names = [n for n, _ in model.named_parameters()]
    assert steps[0] == {names[pid]: float(state["step"]) for pid, state in source.items()}


def test_fqn_keyed_optimizer_state(tmp_path):
    """The get_optimizer_state_dict(full_state_dict=True) / FSDP1 full optim state dict layout."""
    model = build("mlp", seed=0)
    opt = _make_optimizer("adamw", model.parameters())
    _train(model, opt, "mlp", 2, 0)
    names = [n for n, _ in model.named_parameters()]
    sd = opt.state_dict()
    fqn_sd = {"state": {names[i]: s for i, s in sd["state"].items()},
              "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}
    torch.save({"model": model.state_dict(), "optim": fqn_sd}, tmp_path / "fqn.pt")
    fsdp_restore.convert(tmp_path / "fqn.pt", tmp_path / "fqn.safetensors")
    fresh = build("mlp", seed=9)
    fresh_opt = _make_optimizer("adamw", fresh.parameters())
    fsdp_restore.restore(fresh, tmp_path / "fqn.safetensors", optimizer=fresh_opt)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), (name, key)


def test_state_padding_outside_every_piece_is_zeroed():
    """New state tensors start uninitialized; whatever no piece covers (FSDP1 padding) must be zero."""
    from fsdp_restore.optim_plan import zero_uncovered as _zero_uncovered

    flat = torch.full((20,), 7.0)
    _zero_uncovered(flat, [(12, 3), (2, 4), (4, 3)])  # unsorted, overlapping ranges
    expected = torch.full((20,), 7.0)
    expected[:2] = 0
    expected[7:12] = 0
    expected[15:] = 0
    assert torch.equal(flat, expected)
    full = torch.full((5,), 7.0)
    _zero_uncovered(full, [(0, 5)])
    assert torch.equal(full, torch.full((5,), 7.0))


# ---- state as the optimizer itself would hold it --------------------------------------------------------


def _resume_fused(rank, world_size, path):
    model = wrap(build("mlp", seed=77), "fsdp2", world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, fused=True)
    fsdp_restore.restore(model, path, optimizer=opt)
    steps = {(v.dtype, v.device.type) for st in opt.state.values() for k, v in st.items() if k == "step"}
    losses = _train(model, opt, "mlp", STEPS_AFTER, STEPS_BEFORE)
    from models import full_state

    return losses, full_state(model, "fsdp2"), steps


def test_fused_adamw_resume_equals_never_stopping(tmp_path):
    """AdamW(fused=True) keeps `step` as float32 on the parameter's device: restored where it expects it."""
    model = build("mlp", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, fused=True)
    _train(model, opt, "mlp", STEPS_BEFORE, 0)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck.pt")
    ref_losses = _train(model, opt, "mlp", STEPS_AFTER, STEPS_BEFORE)
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    for losses, params, steps in run_ranks(_resume_fused, 2, tmp_path / "ck.safetensors"):
        assert steps == {(torch.float32, "cpu")}
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(params[k], v, atol=1e-5, rtol=1e-4)


def _resume_bf16(rank, world_size, path):
    model = wrap(build("mlp", seed=77).to(torch.bfloat16), "fsdp2", world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
    result = fsdp_restore.restore(model, path, optimizer=opt)
    moments = {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"}
    batch_losses = []
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        loss = model(_batch("mlp", step)[0].to(torch.bfloat16)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        batch_losses.append(float(loss))
    return result.model.cast, result.optimizer.cast, moments, batch_losses


def test_bf16_model_with_fp32_moments_reports_the_cast_and_resumes_close(tmp_path):
    """fp32 training checkpoint into a bf16 model: weights and moments are cast as load_state_dict would, every
    cast is in the reports, and training continues within bf16's precision of the fp32 run (documented
    tolerance: losses within 2%)."""
    ref_losses, _ = reference_run("mlp", "adamw", tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    model_cast, optim_cast, moments, losses = run_ranks(_resume_bf16, 2, tmp_path / "ck.safetensors")[0]
    assert "inp.weight: torch.float32 -> torch.bfloat16" in model_cast
    assert "optim:inp.weight.exp_avg: torch.float32 -> torch.bfloat16" in optim_cast
    assert "optim:inp.weight.exp_avg_sq: torch.float32 -> torch.bfloat16" in optim_cast
    assert moments == {torch.bfloat16}
    assert losses == pytest.approx(ref_losses, rel=2e-2)


class _FactoredState(torch.optim.Optimizer):
    """A minimal optimizer whose state is not shaped like its parameter (Adafactor-style row factors)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if "row" not in st:
                    st["row"] = torch.zeros(p.shape[0], device=p.device, dtype=p.dtype)
                st["row"].add_(p.grad.pow(2).sum(dim=-1) if p.dim() > 1 else p.grad.pow(2))
                p.sub_(group["lr"] * p.grad)


def _factored_worker(rank, world_size, path, how):
    model = wrap(build("mlp", seed=77), how, world_size)
    opt = _FactoredState(model.parameters())
    try:
        fsdp_restore.restore(model, path, optimizer=opt)
    except RestoreError as e:
        return str(e)
    return {type(v).__name__ for st in opt.state.values() for v in st.values()}


@pytest.mark.parametrize("how", ["plain", "fsdp2"])
def test_state_not_shaped_like_its_parameter(tmp_path, how):
    model = build("mlp", seed=0)
    opt = _FactoredState(model.parameters())
    model(torch.randn(3, 7)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "f.pt")
    fsdp_restore.convert(tmp_path / "f.pt", tmp_path / "f.safetensors")
    results = run_ranks(_factored_worker, 2, tmp_path / "f.safetensors", how)
    if how == "plain":
        assert results == [{"Tensor"}] * 2  # restored whole, on the parameter's device
    else:  # a DTensor parameter: refused, naming the parameter and the key, on every rank
        assert len(set(results)) == 1 and "optimizer state 'row' of inp.weight" in results[0]


@pytest.mark.parametrize("layout", ["alone", "nanogpt"])
def test_the_optimizer_state_is_found_where_the_checkpoint_holds_it(tmp_path, layout):
    """An optimizer.pt saved alone (Hugging Face Trainer) holds its state at the root, nanoGPT's under 'optimizer':
    without optim_prefix the restore finds the one the file holds (it said which prefix to pass); a file holding
    none, or two, still says where it looked and what it found. Oracle: torch's Optimizer.load_state_dict."""
    model = build("mlp", seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, model.inp.in_features)).sum().backward()
    opt.step()
    obj = opt.state_dict() if layout == "alone" else {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(obj, tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    restored = torch.optim.AdamW(model.parameters())
    report = fsdp_restore.restore_optimizer(restored, model, tmp_path / "ck.safetensors")
    assert report.prefix == ("" if layout == "alone" else "optimizer")
    oracle = torch.optim.AdamW(model.parameters())
    oracle.load_state_dict(torch.load(tmp_path / "ck.pt")["optimizer"] if layout == "nanogpt" else
                           torch.load(tmp_path / "ck.pt"))
    for got, want in zip(restored.state.values(), oracle.state.values()):
        assert all(torch.equal(got[k], want[k]) for k in want)
    if layout == "nanogpt":  # restore() too, and the optimizer's subtree is not handed back among the other entries
        fresh = build("mlp", seed=1)
        result = fsdp_restore.restore(fresh, tmp_path / "ck.safetensors", optimizer=torch.optim.AdamW(fresh.parameters()))
        assert result.optimizer.prefix == "optimizer" and "optimizer" not in result
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": opt.state_dict()},
                   tmp_path / "two.pt")
        fsdp_restore.convert(tmp_path / "two.pt", tmp_path / "two.safetensors")
        with pytest.raises(RestoreError, match="no optimizer state under 'optim': it holds one under 'optimizer' and"
                                               " 'ema', pass optim_prefix='optimizer'"):
            fsdp_restore.restore_optimizer(torch.optim.AdamW(model.parameters()), model, tmp_path / "two.safetensors")
    torch.save({"model": model.state_dict()}, tmp_path / "none.pt")
    fsdp_restore.convert(tmp_path / "none.pt", tmp_path / "none.safetensors")
    with pytest.raises(RestoreError, match="no optimizer state under 'optim' \\(pass optim_prefix="):
        fsdp_restore.restore_optimizer(torch.optim.AdamW(model.parameters()), model, tmp_path / "none.safetensors")


def test_the_state_is_installed_in_the_order_the_file_holds_it(tmp_path):
    """The restore installed state in group order, so the optimizer's next state_dict() (and save_sharded) put a
    parameter that got its state late (no gradient on the first step) first, where torch's load_state_dict keeps
    the saved order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(2):
        model(torch.ones(1, 3)).sum().backward()
        if step == 0:
            for p in model[0].parameters():
                p.grad = None
        opt.step()
        opt.zero_grad()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c.pt")
    fsdp_restore.convert(tmp_path / "c.pt", tmp_path / "c.safetensors")
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    restored = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fsdp_restore.restore(fresh, tmp_path / "c.safetensors", optimizer=restored)
    oracle = torch.optim.AdamW(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)).parameters(), lr=0.1)
    oracle.load_state_dict(torch.load(tmp_path / "c.pt")["optim"])
    assert list(restored.state_dict()["state"]) == list(oracle.state_dict()["state"]) == [2, 3, 0, 1]


def _old_torch_state(kind: str):
    """A model and its optimizer's state dict as an older torch saved it: each ``step`` a Python number (torch <=
    1.11, transformers' own AdamW) and param groups without the options added since."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = getattr(torch.optim, kind)(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    for s in state["state"].values():
        s["step"] = int(s["step"].item())
    for group in state["param_groups"]:
        for option in ("foreach", "maximize", "capturable", "differentiable", "fused"):
            group.pop(option, None)
    return model, state


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_state_of_an_older_torch_is_brought_up_to_date_as_load_state_dict_does(tmp_path, kind):
    """A step saved as a number stayed a number after the restore, and the optimizer's next step() failed (torch's
    load_state_dict makes it a tensor through the optimizer's __setstate__)."""
    model, state = _old_torch_state(kind)
    torch.save({"model": model.state_dict(), "optim": state}, tmp_path / "old.pt")
    fsdp_restore.convert(tmp_path / "old.pt", tmp_path / "old.safetensors")

    def fresh():
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        return m, getattr(torch.optim, kind)(m.parameters(), lr=0.1)

    oracle, oracle_opt = fresh()
    oracle.load_state_dict(model.state_dict())
    oracle_opt.load_state_dict(torch.load(tmp_path / "old.pt", weights_only=True)["optim"])
    ours, ours_opt = fresh()
    fsdp_restore.restore(ours, tmp_path / "old.safetensors", ours_opt)
    expected, got = oracle_opt.state_dict(), ours_opt.state_dict()
    assert [{k: v for k, v in g.items() if k != "param_names"} for g in got["param_groups"]] == \
        expected["param_groups"]
    for pid, s in expected["state"].items():
        for key, value in s.items():
            assert type(got["state"][pid][key]) is type(value) and torch.equal(got["state"][pid][key], value), key
    for m, o in ((oracle, oracle_opt), (ours, ours_opt)):  # and both step on, alike
        torch.manual_seed(2)
        m(torch.randn(2, 4)).sum().backward()
        o.step()
    for a, b in zip(oracle.parameters(), ours.parameters()):
        assert torch.equal(a, b)
