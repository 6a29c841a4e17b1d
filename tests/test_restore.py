"""Restore into sharded models on real ranks: bit-for-bit equal to the source, 1x bytes read in total."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist import GLOO, GPU, NCCL, backends, cases, run_ranks, slow
from models import build, full_state, wrap

import fsdp_restore
from fsdp_restore import RestoreError, restore_model


def _restore_and_compare(rank, world_size, path, model_name, how, options):
    model = wrap(build(model_name, seed=1234), how, world_size)  # a different init than the checkpoint
    report = restore_model(model, path, **options)
    expected = fsdp_restore.load(path)["model"]
    got = full_state(model, how)
    assert set(got) == set(expected), set(got) ^ set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor.to(got[key].dtype)), f"{key} differs after restore"
    return {"bytes_read": report.bytes_read, "tensors": report.tensors, "cast": report.cast}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("restore")
    for name in ("mlp", "gpt2", "llama"):
        model = build(name, seed=0)
        with torch.no_grad():
            for buf in model.buffers():
                if buf.is_floating_point():
                    buf.add_(0.25)  # buffers must come from the checkpoint, not from init
        src = root / f"{name}.pt"
        torch.save({"model": model.state_dict(), "step": 7}, src)
        fsdp_restore.convert(src, root / f"{name}.safetensors")
        out[name] = root / f"{name}.safetensors"
        out[name + "_bytes"] = sum(t.numel() * t.element_size() for t in
                                   {t.data_ptr(): t for t in model.state_dict().values()}.values())
    return out


@pytest.mark.parametrize("world_size,backend", [c for ws in (1, 2, 3, 4) for c in cases(ws)])
def test_fsdp2_mlp_every_world_size(ckpts, world_size, backend):
    results = run_ranks(_restore_and_compare, world_size, ckpts["mlp"], "mlp", "fsdp2", {}, backend=backend)
    total = sum(r["bytes_read"] for r in results)
    buffers = (5 * 4 + 4 * 8) * (world_size - 1)  # buffers are replicated: every rank reads them
    assert total <= ckpts["mlp_bytes"] + buffers, (total, ckpts["mlp_bytes"])


@pytest.mark.parametrize("model_name,world_size,backend", cases(2, "gpt2", only=GLOO) + cases(3, "gpt2", only=GLOO)
                         + cases(3, "llama", only=GLOO) + slow(cases(4, "llama", only=GLOO)) + cases(1, "llama", only=GPU)
                         + cases(3, "llama", only=GPU))
def test_fsdp2_transformers(ckpts, model_name, world_size, backend):
    results = run_ranks(_restore_and_compare, world_size, ckpts[model_name], model_name, "fsdp2", {}, backend=backend)
    total = sum(r["bytes_read"] for r in results)
    assert total <= ckpts[model_name + "_bytes"] * 1.02 + 4096 * world_size, (total, ckpts[model_name + "_bytes"])


def test_hsdp_2d_mesh(ckpts):
    results = run_ranks(_restore_and_compare, 4, ckpts["llama"], "llama", "hsdp", {})
    # two replicas: each reads the model once, each rank a half
    assert sum(r["bytes_read"] for r in results) <= 2 * ckpts["llama_bytes"] * 1.02


def fsdp1_cases(world_size: int, *values) -> list:
    """FSDP1 gathers its full state with collectives gloo cannot run on GPU memory: NCCL only on a GPU."""
    return cases(world_size, *values, only=("gloo", "nccl")) + cases(1, *values, only=NCCL)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("params", ["orig", "flat"])
@pytest.mark.parametrize("world_size,backend", fsdp1_cases(2))
def test_fsdp1_strategies(ckpts, strategy, params, world_size, backend):
    results = run_ranks(_restore_and_compare, world_size, ckpts["gpt2"], "gpt2", f"fsdp1-{strategy}-{params}", {},
                        backend=backend)
    total = sum(r["bytes_read"] for r in results)
    factor = 2 if strategy == "NO_SHARD" else 1
    assert total <= factor * ckpts["gpt2_bytes"] * 1.02 + 8192, (total, ckpts["gpt2_bytes"])


@pytest.mark.parametrize("params", ["orig", "flat"])
def test_fsdp1_hybrid_shard(ckpts, params):
    run_ranks(_restore_and_compare, 4, ckpts["mlp"], "mlp", f"fsdp1-HYBRID_SHARD-{params}", {})


@pytest.mark.parametrize("params", [pytest.param("orig", marks=pytest.mark.slow), "flat"])  # (orig: 3 ranks below)
def test_fsdp1_world_size_3_llama(ckpts, params):
    run_ranks(_restore_and_compare, 3, ckpts["llama"], "llama", f"fsdp1-FULL_SHARD-{params}", {})


@pytest.mark.parametrize("params", ["orig", "flat"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp1_apply_route(ckpts, params, world_size):
    results = run_ranks(_restore_and_compare, world_size, ckpts["gpt2"], "gpt2", f"fsdp1-FULL_SHARD-{params}",
                        {"method": "apply"})
    # the seed's route reads every tensor in full on every rank: that is its documented cost
    assert all(r["bytes_read"] >= ckpts["gpt2_bytes"] * 0.9 for r in results)


def _restore_in_tiny_chunks(rank, world_size, path, model_name, how, options):
    import importlib

    # 52 bytes: every piece is split into many chunks that end mid-row and are read by different threads
    importlib.import_module("fsdp_restore.execute").READ_CHUNK_BYTES = 52
    return _restore_and_compare(rank, world_size, path, model_name, how, options)


@pytest.mark.parametrize("how,world_size,backend", cases(3, "fsdp2") + fsdp1_cases(3, "fsdp1-FULL_SHARD-flat"))
def test_pieces_split_into_chunks_restore_exactly(ckpts, how, world_size, backend):
    run_ranks(_restore_in_tiny_chunks, world_size, ckpts["llama"], "llama", how, {"thread_count": 3}, backend=backend)


@pytest.mark.parametrize("how", ["plain", "ddp"])
def test_plain_and_ddp(ckpts, how):
    run_ranks(_restore_and_compare, 2, ckpts["gpt2"], "gpt2", how, {})


def _restore_meta(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard

    model = build("llama", device="meta")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    with pytest.raises(RestoreError, match="meta device.*to_empty"):
        restore_model(model, path)
    import models

    model.to_empty(device=models.DEVICE)  # uninitialized memory: only the restore gives it values
    # ...but no checkpoint holds the rotary embedding's non-persistent inv_freq: refused, with the fix
    with pytest.raises(RestoreError, match="(?s)rotary_emb.inv_freq.*init_non_persistent_buffers"):
        restore_model(model, path)
    assert fsdp_restore.init_non_persistent_buffers(model) == ["model.rotary_emb.inv_freq",
                                                               "model.rotary_emb.original_inv_freq"]
    restore_model(model, path)
    expected = fsdp_restore.load(path)["model"]
    got = full_state(model, "fsdp2")
    reference = build("llama", seed=0, device=models.DEVICE)  # the checkpoint's model, built for real
    ids = torch.arange(12, device=models.DEVICE).view(2, 6)
    return (all(torch.equal(got[k], v) for k, v in expected.items())
            and torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
            and torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-6))


@pytest.mark.parametrize("world_size,backend", cases(2, only=("gloo", "nccl")) + cases(1, only=NCCL))  # forward
def test_meta_device_model_needs_its_non_persistent_buffers(ckpts, world_size, backend):
    """A meta-built Llama's rotary inv_freq is uninitialised after to_empty and in no checkpoint: the restore
    refuses it naming the fix; after init_non_persistent_buffers the logits equal the really built model's."""
    assert all(run_ranks(_restore_meta, world_size, ckpts["llama"], backend=backend))


def _restore_expect_error(rank, world_size, path, how, options):
    model = wrap(build("mlp", seed=3), how, world_size)
    with pytest.raises(RestoreError) as info:
        restore_model(model, path, **options)
    return str(info.value)


def test_missing_key_fails_on_every_rank_naming_it(ckpts, tmp_path):
    state = fsdp_restore.load(ckpts["mlp"])
    del state["model"]["blocks.1.weight"]
    state["model"]["extra.weight"] = torch.ones(2)
    state["model"]["inp.weight"] = torch.zeros(3, 3)
    fsdp_restore.save(state, tmp_path / "bad.safetensors")
    messages = run_ranks(_restore_expect_error, 3, tmp_path / "bad.safetensors", "fsdp2", {})
    for msg in messages:
        assert "blocks.1.weight" in msg and "extra.weight" in msg and "inp.weight" in msg
    assert len(set(messages)) == 1  # every rank reports the same verdict


def _restore_non_strict(rank, world_size, path):
    model = wrap(build("mlp", seed=3), "fsdp2", world_size)
    report = restore_model(model, path, strict=False)
    return report.missing, report.unexpected


def test_non_strict_reports_instead_of_failing(ckpts, tmp_path):
    state = fsdp_restore.load(ckpts["mlp"])
    del state["model"]["blocks.1.weight"]
    fsdp_restore.save(state, tmp_path / "partial.safetensors")
    missing, unexpected = run_ranks(_restore_non_strict, 2, tmp_path / "partial.safetensors")[0]
    assert missing == ["blocks.1.weight"] and unexpected == []


@pytest.mark.parametrize("backend", backends(2))
def test_dtype_cast_is_reported(ckpts, tmp_path, backend):
    src = tmp_path / "mlp.pt"
    torch.save({"model": build("mlp").state_dict()}, src)
    fsdp_restore.convert(src, tmp_path / "bf16.safetensors", dtype="bf16")
    results = run_ranks(_restore_and_compare, 2, tmp_path / "bf16.safetensors", "mlp", "fsdp2", {}, backend=backend)
    assert any("inp.weight: torch.bfloat16 -> torch.float32" in c for c in results[0]["cast"])


def _nan_worker(rank, world_size, path):
    model = wrap(build("mlp", seed=3), "fsdp2", world_size)
    report = restore_model(model, path)
    return report.nan_in_checkpoint


@pytest.mark.parametrize("backend", backends(2))
def test_nan_in_checkpoint_is_not_unrestored(tmp_path, backend):
    state = build("mlp").state_dict()
    state["inp.weight"][4, 6] = float("nan")  # the last row: on the last rank
    torch.save({"model": state}, tmp_path / "nan.pt")
    fsdp_restore.convert(tmp_path / "nan.pt", tmp_path / "nan.safetensors")
    found = run_ranks(_nan_worker, 2, tmp_path / "nan.safetensors", backend=backend)
    assert found[1] == ["inp.weight"] and found[0] == []


def test_plain_hf_weights_file_without_prefix(ckpts, tmp_path):
    from safetensors.torch import save_file

    model = build("llama")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    other = build("llama", seed=9)
    report = restore_model(other, tmp_path / "model.safetensors")  # no dist: plain module, prefix ""
    assert report.prefix == "" and all(torch.equal(other.state_dict()[k], v) for k, v in state.items())


def _restore_flat_hf_keys(rank, world_size, path):
    model = wrap(build("llama", seed=1234), "fsdp2", world_size)
    report = restore_model(model, path)  # default prefix: the keys themselves start with "model."
    expected = fsdp_restore.load(path)
    got = full_state(model, "fsdp2")
    assert set(got) == set(expected), set(got) ^ set(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    return report.prefix


@pytest.mark.parametrize("saved", ["state_dict", "select"])
def test_converted_hf_state_dict_keys_starting_with_model(tmp_path, saved):
    """A Llama's own keys start with "model." (model.layers.0...): only a top-level "model" subtree
    may be taken for the training-checkpoint prefix, or every key is looked up one level too deep."""
    state = build("llama").state_dict()
    src = tmp_path / "ck.pt"
    torch.save(state if saved == "state_dict" else {"model": state, "step": 3}, src)
    fsdp_restore.convert(src, tmp_path / "w.safetensors", select="model" if saved == "select" else None)
    assert run_ranks(_restore_flat_hf_keys, 2, tmp_path / "w.safetensors") == ["", ""]


def test_default_prefix_only_for_a_top_level_model_subtree(tmp_path):
    from fsdp_restore.restore import default_prefix

    cases = {"nested": ({"model": {"w": torch.ones(2)}, "optim": {}}, "model"),
             "flat_hf": ({"model.embed.weight": torch.ones(2), "lm_head.weight": torch.ones(2)}, ""),
             "model_is_a_tensor": ({"model": torch.ones(2), "step": 1}, ""),
             "list_root": ([{"model": {"w": torch.ones(2)}}], "")}
    for name, (obj, prefix) in cases.items():
        fsdp_restore.save(obj, tmp_path / f"{name}.safetensors")
        with fsdp_restore.Checkpoint(tmp_path / f"{name}.safetensors") as ckpt:
            assert default_prefix(ckpt) == prefix, name


def _refused_restore(folder, saved: dict, **options) -> RestoreError:
    """``saved`` converted and restored into a plain "mlp" with ``options``: the `RestoreError` it must raise,
    the model checked unmodified."""
    torch.save(saved, folder / "m.pt")
    fsdp_restore.convert(folder / "m.pt", folder / "m.safetensors")
    model = build("mlp", seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RestoreError) as info:
        restore_model(model, folder / "m.safetensors", **options)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing was modified
    return info.value


def test_dtype_policy_error_lists_every_problem_at_once(tmp_path):
    state = build("mlp").state_dict()
    state["inp.weight"] = state["inp.weight"].to(torch.bfloat16)
    state["out.weight"] = state["out.weight"][:2]
    del state["blocks.0.bias"]
    error = _refused_restore(tmp_path, {"model": state}, dtype_policy="error")
    msg = str(error)
    assert "inp.weight: checkpoint torch.bfloat16 vs model torch.float32" in msg
    assert "out.weight: checkpoint [2, 5] vs model [3, 5]" in msg and "blocks.0.bias" in msg
    assert set(error.problems) == {"missing", "shape", "dtype"}


@pytest.mark.parametrize("check", [True, False])
def test_a_cast_into_the_model_beyond_its_range_fails_naming_every_tensor(tmp_path, check):
    """An fp32 value beyond fp16's 65504 restored into an fp16 model became inf silently (the check looks for
    NaN); into float8_e4m3fnuz it became NaN and was reported as 'not restored'. Values the file holds as inf
    are not the cast's doing."""
    state = build("mlp").state_dict()
    state["inp.weight"][0, 0] = 7e4
    state["out.weight"][1, 2] = -1e6
    state["blocks.0.bias"][0] = float("inf")
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    model = build("mlp").half()
    with pytest.raises(RestoreError) as info:
        restore_model(model, tmp_path / "m.safetensors", check=check)
    text = str(info.value)
    assert "'model.inp.weight' (1 values), 'model.out.weight' (1 values)" in text and "bias" not in text, text
    assert "partly written" in text
    state["inp.weight"][0, 0], state["out.weight"][1, 2] = 1.0, 2.0  # in range: restores, inf where the file has it
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors", force=True)
    restore_model(model, tmp_path / "m.safetensors", check=check)
    assert torch.equal(model.blocks[0].bias.detach(), state["blocks.0.bias"].half())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2])
def test_a_cast_into_a_float8_model_beyond_its_range_fails_too(tmp_path, dtype):
    """float8_e4m3fn has no inf: an fp32 1e6 saturated to 448 and restored as if it fit; into e4m3fnuz the screen
    itself crashed (torch has no isfinite for it). A value just past the largest that rounds down to it fits."""
    top = torch.finfo(dtype).max
    state = build("mlp").state_dict()
    state["inp.weight"][0, 0] = 1e6
    state["out.weight"][1, 2] = top * (1 + torch.finfo(dtype).eps / 4)  # rounds to the largest, within range
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    model = build("mlp").to(dtype)
    with pytest.raises(RestoreError) as info:
        restore_model(model, tmp_path / "m.safetensors", check=False)
    text = str(info.value)
    assert "'model.inp.weight' (1 values)" in text and "out.weight" not in text, text
    state["inp.weight"][0, 0] = 1.0
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors", force=True)
    restore_model(model, tmp_path / "m.safetensors", check=False)
    assert float(model.out.weight[1, 2].float()) == top


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz])
def test_a_checked_restore_into_a_float8_model(tmp_path, dtype):
    """With the check on, a restore into a float8 model failed before reading anything (the buffer screen
    called isfinite, which torch lacks for these dtypes); now it restores every value as torch's cast makes it."""
    state = build("mlp").state_dict()
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    model = build("mlp").to(dtype)
    restore_model(model, tmp_path / "m.safetensors", check=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name].to(dtype) if value.is_floating_point() else state[name]), name


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz])
def test_an_inf_into_a_float8_dtype_without_infinity_fails(tmp_path, dtype):
    """A stored inf cast into float8_e4m3fn became 448 (finite, uncounted, the check blind to it) and into the
    fnuz types NaN; e5m2 has an infinity and keeps it."""
    state = build("mlp").state_dict()
    state["inp.weight"][0, 0] = float("-inf")
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    model = build("mlp").to(dtype)
    if dtype == torch.float8_e5m2:
        restore_model(model, tmp_path / "m.safetensors", check=False)
        assert float(model.inp.weight[0, 0].float()) == float("-inf")
        return
    with pytest.raises(RestoreError) as info:
        restore_model(model, tmp_path / "m.safetensors", check=False)
    assert "'model.inp.weight' (1 values)" in str(info.value) and "without infinity" in str(info.value), info.value


@pytest.mark.parametrize("check", [True, False])
def test_an_integer_beyond_the_models_floating_range_fails_too(tmp_path, check):
    """An int32 70000 restored into an fp16 parameter became inf silently (only float-to-float casts were
    screened)."""
    class Counts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16), requires_grad=False)

    stored = torch.tensor([1, 70000, -70000, 65504], dtype=torch.int32)
    fsdp_restore.save({"w": stored}, tmp_path / "c.safetensors")
    model = Counts()
    with pytest.raises(RestoreError, match=r"'w' \(2 values\)"):
        restore_model(model, tmp_path / "c.safetensors", check=check)
    fsdp_restore.save({"w": torch.tensor([1, 7, -7, 65504], dtype=torch.int32)}, tmp_path / "c.safetensors")
    restore_model(model, tmp_path / "c.safetensors", check=check)
    assert torch.equal(model.w.detach(), torch.tensor([1, 7, -7, 65504], dtype=torch.float16))


def _apply_route_overflow(rank, world_size, path):
    model = wrap(build("mlp").half(), "fsdp1-FULL_SHARD-flat", world_size)
    with pytest.raises(RestoreError) as info:
        restore_model(model, path, method="apply")
    return str(info.value)


def test_the_apply_route_screens_its_casts_too(tmp_path):
    state = build("mlp").state_dict()
    state["inp.weight"][0, 0] = 7e4
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    texts = run_ranks(_apply_route_overflow, 2, tmp_path / "m.safetensors")
    assert texts[0] == texts[1] and "'model.inp.weight' (1 values)" in texts[0], texts


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


class _HoldsModule(torch.nn.Module):
    """Its only child is a real submodule named ``module``: every name starts with DDP's prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Sequential(_Block(), _Block())


def _apply_route_module_child(rank, world_size, path, expected):
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(rank + 7)
    model = FSDP(_HoldsModule(), auto_wrap_policy=ModuleWrapPolicy({_Block}), device_id=torch.device("cpu"))
    restore_model(model, path, method="apply", check=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        got = model.state_dict()
    return sorted(k for k, v in expected.items() if not torch.equal(got[k], v))


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled-checkpoint"])
def test_the_apply_route_restores_a_model_whose_child_is_called_module(tmp_path, compiled):
    """The apply route matched the checkpoint's names without the model's: 'module.' was taken for DDP's prefix
    and stripped, no name matched, and with check=False it reported success with every weight left as it was."""
    torch.manual_seed(0)
    state = _HoldsModule().state_dict()
    saved = {f"_orig_mod.{k}": v for k, v in state.items()} if compiled else state
    fsdp_restore.save(saved, tmp_path / "m.safetensors")
    assert run_ranks(_apply_route_module_child, 2, tmp_path / "m.safetensors", state) == [[], []]


def test_a_prefix_with_no_tensors_is_one_problem_naming_the_top_level(tmp_path):
    error = _refused_restore(tmp_path, {"model": build("mlp").state_dict(), "step": 3}, model_prefix="modle")
    msg = str(error)
    assert "no tensors under prefix 'modle' (its top-level names: model)" in msg and "--model-prefix" in msg, msg
    assert set(error.problems) == {"error"}, error.problems  # not one more per tensor never planned


def test_fsdp1_tied_weight_owned_by_another_unit(tmp_path):
    """ModuleWrapPolicy({Linear}) wraps the tied head on its own: embed.weight becomes a view of the head unit's
    flat parameter, and must be treated as an alias, not as a tensor of its local size."""
    torch.save({"model": build("tied").state_dict()}, tmp_path / "t.pt")
    fsdp_restore.convert(tmp_path / "t.pt", tmp_path / "t.safetensors")
    assert all(run_ranks(_restore_tied_cross_unit, 2, tmp_path / "t.safetensors"))


def _restore_tied_cross_unit(rank, world_size, path):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = wrap(build("tied", seed=9), "fsdp1-FULL_SHARD-orig", world_size)
    restore_model(model, path)
    ref = build("tied")
    # Compared under summon_full_params: FSDP1's FULL_STATE_DICT gather returns a wrong embed.weight when a
    # tie crosses units (a torch limitation), while the module's parameters themselves are right.
    with FSDP.summon_full_params(model, writeback=False):
        inner = model.module
        return (torch.equal(inner.head.weight, ref.head.weight) and torch.equal(inner.embed.weight, ref.embed.weight)
                and all(torch.equal(a, b) for a, b in zip(inner.blocks.parameters(), ref.blocks.parameters())))


class _Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(4096, 4096, bias=False)  # 64 MB: a full copy would show


def _memory_worker(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard

    from fsdp_restore.measure import PeakAnonMemory

    with torch.device("meta"):
        model = _Wide()
    fully_shard(model)
    model.to_empty(device="cpu")
    fsdp_restore.restore_model(model, path, thread_count=1)  # warm-up: first-time allocations and imports
    with PeakAnonMemory(interval=0.002) as mem:
        report = restore_model(model, path)
    expected = model.big.weight.to_local()
    return mem.peak - mem.start, report.bytes_read, expected.numel() * 4


def test_no_rank_materializes_a_full_tensor(tmp_path):
    torch.manual_seed(0)
    torch.save({"model": _Wide().state_dict()}, tmp_path / "w.pt")
    fsdp_restore.convert(tmp_path / "w.pt", tmp_path / "w.safetensors")
    for extra, read, shard in run_ranks(_memory_worker, 2, tmp_path / "w.safetensors"):
        assert read == shard  # exactly this rank's 32 MB
        # Half the 32 MB shard: any copy of the slice or the 64 MB tensor fails this; thread stacks and the
        # verdict exchange (a few MB, seen 8.0 MB under load) do not.
        assert extra < 16 * 2**20, extra


# ---- tied weights stored under either name ------------------------------------------------------------


def _restore_tied(rank, world_size, path, model_name, how):
    model = wrap(build(model_name, seed=1234), how, world_size)
    report = restore_model(model, path)  # strict: the tied name missing from the file is no problem
    got = full_state(model, how)
    reference = build(model_name, seed=0, device="cpu")
    return report.missing, all(torch.equal(got[k], v) for k, v in reference.state_dict().items())


@pytest.mark.parametrize("model_name", ["gpt2", "llama-tied"])
@pytest.mark.parametrize("how,world_size,backend", cases(2, "fsdp2") + cases(2, "plain") + fsdp1_cases(2, "fsdp1-FULL_SHARD-orig"))
def test_tied_weight_stored_under_the_other_name(tmp_path, model_name, how, world_size, backend):
    """safetensors' save_model keeps one name of a tied pair (GPT-2, Llama with tie_word_embeddings: lm_head.weight)
    and records the other in its metadata: every name tied to the stored tensor is restored."""
    from safetensors.torch import save_model

    model = build(model_name, seed=0)
    save_model(model, str(tmp_path / "tied.safetensors"))
    with fsdp_restore.Checkpoint(tmp_path / "tied.safetensors") as ckpt:
        stored = set(ckpt.entries)
    embed = "transformer.wte.weight" if model_name == "gpt2" else "model.embed_tokens.weight"
    assert "lm_head.weight" in stored and embed not in stored  # the case this test is about
    for missing, equal in run_ranks(_restore_tied, world_size, tmp_path / "tied.safetensors", model_name, how,
                                    backend=backend):
        assert missing == [] and equal


# ---- FSDP2 parameters left unsharded by a forward -----------------------------------------------------


def _restore_unsharded(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard

    import models

    model = build("llama", seed=1234)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    ids = torch.arange(12, device=models.DEVICE).view(2, 6)
    model(input_ids=ids)  # leaves every unit unsharded
    restore_model(model, path)
    expected = fsdp_restore.load(path)["model"]
    got = full_state(model, "fsdp2")
    same = all(torch.equal(got[k], v) for k, v in expected.items())
    logits = model(input_ids=ids).logits  # resharding and the next forward still work
    model.reshard()
    reference = build("llama", seed=0)
    return same and torch.allclose(logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size,backend", cases(2, only=("gloo", "nccl")) + cases(1, only=NCCL))  # forward
def test_fsdp2_unsharded_parameters_are_restored_into_the_sharded_storage(ckpts, world_size, backend):
    assert all(run_ranks(_restore_unsharded, world_size, ckpts["llama"], backend=backend))


def _restore_inside_summon(rank, world_size, path):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = wrap(build("mlp", seed=3), "fsdp1-FULL_SHARD-flat", world_size)
    model(torch.randn(2, 7))  # lazy init
    with FSDP.summon_full_params(model):
        with pytest.raises(RestoreError, match="unsharded parameters"):
            restore_model(model, path)
    restore_model(model, path)
    return True


def test_fsdp1_restore_inside_summon_full_params_is_refused(ckpts):
    assert all(run_ranks(_restore_inside_summon, 2, ckpts["mlp"]))


def test_restore_reads_a_plain_weights_file_by_default(tmp_path):
    """restore(), like restore_model(), finds the weights of a plain weights file (Hugging Face layout, a
    weights-only save_sharded) at the top level; there is nothing else to return then."""
    from models import build

    fsdp_restore.save(build("mlp", seed=4).state_dict(), tmp_path / "w.safetensors")
    model = build("mlp", seed=1)
    result = fsdp_restore.restore(model, tmp_path / "w.safetensors")
    assert dict(result) == {} and result.model.tensors == len(model.state_dict())
    for name, value in build("mlp", seed=4).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


# ---- thread_count: the one name of the option (threads=: its deprecated old name); in-process, world size 1 ------


def _trained_checkpoint(folder, model_key: str = "model", optim_key: str = "optim"):
    """A plain model's weights and one AdamW step's state, as a training checkpoint with those subtree names:
    (its path, the weights saved)."""
    model = build("mlp", seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, model.inp.in_features)).sum().backward()
    opt.step()
    path = folder / "run.safetensors"
    fsdp_restore.save({model_key: model.state_dict(), optim_key: opt.state_dict(), "step": 1}, path)
    return path, model.state_dict()


@pytest.fixture(scope="module")
def trained_file(tmp_path_factory):
    return _trained_checkpoint(tmp_path_factory.mktemp("thread_count"))[0]


def _entry(name, path):
    """The public entry point ``name`` on a fresh plain model (and optimizer): (call(**options), model, optimizer)."""
    model = build("mlp", seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    call = {"restore_model": lambda **kw: restore_model(model, path, **kw),
            "restore": lambda **kw: fsdp_restore.restore(model, path, optimizer=opt, **kw),
            "restore_optimizer": lambda **kw: fsdp_restore.restore_optimizer(opt, model, path, **kw)}[name]
    return call, model, opt


@pytest.mark.parametrize("name", ["restore_model", "restore", "restore_optimizer"])
def test_thread_count_and_its_deprecated_old_name(trained_file, monkeypatch, name):
    import importlib

    restore_module = importlib.import_module("fsdp_restore.restore")
    seen = []
    execute = restore_module.execute_reads
    monkeypatch.setattr(restore_module, "execute_reads", lambda *a, **k: seen.append(a[2]) or execute(*a, **k))
    _entry(name, trained_file)[0](thread_count=2)
    with pytest.warns(DeprecationWarning, match=r"threads= is renamed thread_count=") as caught:
        _entry(name, trained_file)[0](threads=3)  # the old name still works
    assert caught[0].filename == __file__  # the warning points at the caller's line
    _entry(name, trained_file)[0]()
    assert seen == [2, 3, 4]  # 4: the default read threads, as before
    with pytest.raises(TypeError, match="thread_count"):
        _entry(name, trained_file)[0](thread_count=2, threads=2)


@pytest.fixture(scope="module")
def moved_file(tmp_path_factory):
    """A training checkpoint whose weights and optimizer state lie under names that are not the defaults."""
    return _trained_checkpoint(tmp_path_factory.mktemp("renamed"), "weights", "opt")


_SUBTREES = {"restore_model": ({"model_prefix": "weights"}, {"prefix": "weights"}),
             "restore": ({"model_prefix": "weights", "optim_prefix": "opt"},
                         {"model_key": "weights", "optim_key": "opt"}),
             "restore_optimizer": ({"optim_prefix": "opt"}, {"prefix": "opt"})}


def _call_direct(name, model, opt, path, options):
    """The entry point called from this line of this file (no wrapper between): returns that line's number."""
    import inspect

    line = inspect.currentframe().f_lineno
    if name == "restore_model":
        restore_model(model, path, **options)
        return line + 2
    if name == "restore":
        fsdp_restore.restore(model, path, optimizer=opt, **options)
        return line + 5
    fsdp_restore.restore_optimizer(opt, model, path, **options)
    return line + 7


@pytest.mark.parametrize("name", ["restore_model", "restore", "restore_optimizer"])
def test_subtree_options_have_one_name_each_and_the_old_ones_still_work(moved_file, name):
    """model_prefix= / optim_prefix= in every restore entry point; prefix=, model_key=, optim_key= (their names
    before) restore the same with a DeprecationWarning pointing at the caller's line; an old and a new name
    together are a TypeError, whatever the values (optim_prefix="optim", its default's value, included)."""
    path, saved = moved_file
    new, old = _SUBTREES[name]
    for options in (new, old):
        _, model, opt = _entry(name, path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = _call_direct(name, model, opt, path, options)
        renamed = [w for w in caught if issubclass(w.category, DeprecationWarning) and "is renamed" in str(w.message)]
        assert len(renamed) == (len(old) if options is old else 0), [str(w.message) for w in caught]
        assert all((w.filename, w.lineno) == (__file__, line) for w in renamed), [(w.filename, w.lineno)
                                                                                  for w in renamed]
        if name != "restore_optimizer":
            assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    at_default = [{**new, "optim_prefix": "optim", **old}] if "optim_prefix" in new else []  # "optim" given
    for both in [{**new, **old}, *at_default]:
        with pytest.raises(TypeError, match="deprecated old name"):
            _entry(name, path)[0](**both)


@pytest.mark.parametrize("name,options,looked_in", [
    ("restore_model", {"model_prefix": "weights"}, "the weights under 'weights' (model_prefix='weights')"),
    ("restore_model", {"model_prefix": ""}, "the weights at its top level (model_prefix='')"),
    ("restore", {"model_prefix": "weights", "optim_prefix": "opt"},
     "the weights under 'weights' (model_prefix='weights'); the optimizer state under 'opt' (optim_prefix='opt')"),
    ("restore_optimizer", {"optim_prefix": "elsewhere"}, None)])
def test_a_failed_restore_names_the_file_and_where_it_looked_for_names(moved_file, name, options, looked_in):
    """The verdict's first line names the file; where names are missing or unexpected, a line says which subtree
    they were looked for in (a prefix may have been found, not given: the fix is often another one)."""
    path, _ = moved_file
    call, model, _ = _entry(name, path)
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))  # in no checkpoint: a failing restore
    with pytest.raises(RestoreError) as info:
        call(**options)
    lines = str(info.value).splitlines()
    subject = "optimizer restore" if name == "restore_optimizer" else "restore"
    assert lines[0] == f"{subject} of {path} failed:", lines
    assert [line for line in lines if "looked for in" in line] == (
        [f"  names looked for in: {looked_in}"] if looked_in else []), lines
    assert "looked_in" not in info.value.problems  # where it looked is context, not a problem


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4"])
@pytest.mark.parametrize("name", ["restore_model", "restore", "restore_optimizer"])
def test_bad_thread_count_is_refused_before_anything_is_read(trained_file, name, bad):
    call, model, opt = _entry(name, trained_file)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="thread_count must be a positive int"):
        call(thread_count=bad)
    with pytest.raises(ValueError, match="thread_count"), pytest.warns(DeprecationWarning):
        call(threads=bad)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and not opt.state


class _TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(5, 3)
        self.lm_head = torch.nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("writer", ["safetensors", "ours"])
def test_a_tied_weight_stored_twice_must_hold_one_value(tmp_path, writer):
    """A file holding different values under two names the model ties restored one of them and dropped the other
    without a word (torch's load_state_dict keeps the last, transformers' re-tying the first). Equal values, as
    files saved with a clone hold them, restore; compared by the file's crc32 where it has them, else by reading."""
    from safetensors.torch import save_file

    def write(state, name):
        if writer == "safetensors":
            save_file(state, tmp_path / name)
        else:
            fsdp_restore.save(state, tmp_path / name)
        return tmp_path / name

    value = torch.randn(5, 3)
    same = write({"embed_tokens.weight": value.clone(), "lm_head.weight": value.clone()}, "same.safetensors")
    model = _TiedLM()
    restore_model(model, same)
    assert torch.equal(model.lm_head.weight.detach(), value)
    other = value.clone()
    other[4, 2] += 1
    differ = write({"embed_tokens.weight": value.clone(), "lm_head.weight": other}, "differ.safetensors")
    with pytest.raises(RestoreError, match=r"embed_tokens.weight and lm_head.weight: the model ties them") as info:
        restore_model(_TiedLM(), differ)
    assert "tie_word_embeddings=False" in str(info.value)



def test_a_three_way_tie_stored_under_two_of_its_names_must_hold_one_value(tmp_path):
    """T5's shared / encoder / decoder embedding: the file held two of the three names, with different values, and
    the restore took the first it found without a word."""
    from safetensors.torch import save_file

    class ThreeWay(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = torch.nn.Embedding(4, 2)
            self.enc = torch.nn.Embedding(4, 2)
            self.dec = torch.nn.Embedding(4, 2)
            self.enc.weight = self.dec.weight = self.shared.weight

    save_file({"enc.weight": torch.zeros(4, 2), "dec.weight": torch.ones(4, 2)}, tmp_path / "t5.safetensors")
    with pytest.raises(RestoreError, match=r"enc.weight and dec.weight: the model ties them"):
        restore_model(ThreeWay(), tmp_path / "t5.safetensors")
    save_file({"enc.weight": torch.ones(4, 2), "dec.weight": torch.ones(4, 2)}, tmp_path / "same.safetensors")
    model = ThreeWay()
    restore_model(model, tmp_path / "same.safetensors")
    assert torch.equal(model.shared.weight.detach(), torch.ones(4, 2))


class _Scaling(torch.nn.Linear):
    """A module with state beside its tensors (TransformerEngine's FP8 modules keep their scaling so)."""

    def __init__(self, state: object) -> None:
        super().__init__(4, 4)
        self.state, self.given = state, []

    def get_extra_state(self):
        return self.state

    def set_extra_state(self, state):
        self.given.append(state)


class _Counter(torch.nn.Linear):
    state: object = {"calls": torch.tensor(3)}

    def get_extra_state(self):  # saves a value, but takes none back (torch then calls a stored one unexpected)
        return self.state


def _net(state: object) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Scaling(state), torch.nn.Linear(4, 2))


def _converted(tmp_path, model: torch.nn.Module, name: str = "c") -> str:
    torch.save({"model": model.state_dict(), "step": 1}, tmp_path / f"{name}.pt")
    fsdp_restore.convert(tmp_path / f"{name}.pt", tmp_path / f"{name}.safetensors")
    return str(tmp_path / f"{name}.safetensors")


@pytest.mark.parametrize("state", [{"amax": torch.arange(4.0), "recipe": "delayed"},
                                   torch.tensor([1, 2, 250], dtype=torch.uint8), "just a string"],
                         ids=["dict", "uint8 tensor", "str"])
def test_a_modules_extra_state_is_given_to_it_as_load_state_dict_gives_it(tmp_path, state):
    """The restore refused a file holding a module's extra state (its tensors read as unexpected names), or, where
    the state held no tensor, never gave it to the module."""
    path = _converted(tmp_path, _net(state))
    oracle, ours = _net(None), _net(None)
    oracle.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["model"])
    report = restore_model(ours, path)
    assert len(oracle[0].given) == len(ours[0].given) == 1 and not report.unexpected
    expected, got = oracle[0].given[0], ours[0].given[0]
    if isinstance(state, dict):
        assert got.keys() == expected.keys() and got["recipe"] == expected["recipe"]
        assert torch.equal(got["amax"], expected["amax"])
    elif isinstance(state, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    else:
        assert got == expected == state


def test_a_missing_extra_state_is_missing_as_torch_says_it(tmp_path):
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    path = _converted(tmp_path, plain)
    ours = _net(None)
    torch_says = ours.load_state_dict(plain.state_dict(), strict=False)
    assert torch_says.missing_keys == ["0._extra_state"]
    ours[0].given.clear()
    with pytest.raises(RestoreError, match=r"missing from the checkpoint \(1\): 0\._extra_state"):
        restore_model(ours, path)
    report = restore_model(ours, path, strict=False)
    assert report.missing == ["0._extra_state"] and ours[0].given == []


@pytest.mark.parametrize("state", [{"calls": torch.tensor(3)}, {"calls": 3, "recipe": "delayed"}, None],
                         ids=["holding a tensor", "no tensor", "None"])
def test_an_extra_state_stored_for_a_module_that_takes_none_is_unexpected(tmp_path, monkeypatch, state):
    """A value holding no tensor (a dict of numbers, None) was not reported: the restore's names were its tensors'."""
    monkeypatch.setattr(_Counter, "state", state)
    torch.manual_seed(0)
    saved = torch.nn.Sequential(_Counter(4, 4), torch.nn.Linear(4, 2))
    path = _converted(tmp_path, saved)
    with pytest.raises(RuntimeError, match="Unexpected key"):  # torch's own verdict on the same state dict
        torch.nn.Sequential(_Counter(4, 4), torch.nn.Linear(4, 2)).load_state_dict(saved.state_dict())
    with pytest.raises(RestoreError, match=r"unexpected .*0\._extra_state"):
        restore_model(torch.nn.Sequential(_Counter(4, 4), torch.nn.Linear(4, 2)), path)
    torch_says = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).load_state_dict(
        saved.state_dict(), strict=False)
    report = restore_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), path, strict=False)
    assert report.unexpected == torch_says.unexpected_keys == ["0._extra_state"]


def test_an_extra_state_under_ddps_prefix_or_beside_another_subtree_is_given(tmp_path):
    """The check for values no module takes called `module.0._extra_state` (a DDP checkpoint) and `ema.0._extra_state`
    (a subtree beside weights stored at the top level) unexpected: names as stored, not as the tensors' are read."""
    saved = _net({"amax": 1.5})
    ddp = {f"module.{k}": v for k, v in saved.state_dict().items()}
    fsdp_restore.save(ddp, tmp_path / "ddp.safetensors")
    oracle = _net(None)
    consumed = dict(ddp)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(consumed, "module.")
    oracle.load_state_dict(consumed)  # torch's verdict: every key matched
    ours = _net(None)
    restore_model(ours, tmp_path / "ddp.safetensors")
    assert ours[0].given == oracle[0].given == [{"amax": 1.5}]
    fsdp_restore.save({**saved.state_dict(), "ema": _net({"amax": 2.5}).state_dict(), "train_state": {"step": 5}},
                      tmp_path / "top.safetensors")
    ours = _net(None)
    report = restore_model(ours, tmp_path / "top.safetensors")
    assert ours[0].given == [{"amax": 1.5}] and not report.unexpected


def test_an_extra_state_is_not_given_when_the_restore_fails(tmp_path):
    path = _converted(tmp_path, _net({"amax": torch.arange(4.0)}))
    ours = torch.nn.Sequential(_Scaling(None), torch.nn.Linear(4, 3))  # a shape the file does not hold
    with pytest.raises(RestoreError, match="shape"):
        restore_model(ours, path)
    assert ours[0].given == []


def test_the_model_and_optimizer_are_checked_at_the_door(tmp_path):
    """Swapped arguments said "'AdamW' object has no attribute 'modules'" from deep in the plan; a factory's
    non-module, "'int' object has no attribute 'modules'"."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    path = _converted(tmp_path, model)
    with pytest.raises(TypeError, match=r"swapped: the call is restore_optimizer\(optimizer, model, checkpoint\)"):
        fsdp_restore.restore_optimizer(model, opt, path)
    with pytest.raises(TypeError, match=r"swapped: the call is restore\(model, checkpoint, optimizer\)"):
        fsdp_restore.restore(opt, path, model)
    with pytest.raises(TypeError, match="model must be an nn.Module .*not int"):
        restore_model(3, path)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None, not dict"):
        fsdp_restore.restore(model, path, {"lr": 1})
    fsdp_restore.restore(model, path)  # no optimizer: fine
    restore_model(model, path)


def test_an_optimizer_state_dict_restored_as_weights_is_said_to_be_one(tmp_path):
    """A Hugging Face Trainer's optimizer.pt given to restore_model listed every weight missing and every moment
    unexpected; it is now one error saying what the file is and where it goes. restore_optimizer takes it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    fsdp_restore.convert(tmp_path / "optimizer.pt", tmp_path / "optimizer.safetensors")
    with pytest.raises(RestoreError) as info:
        restore_model(model, tmp_path / "optimizer.safetensors")
    text = str(info.value)
    assert "holds an optimizer's state dict (state, param_groups), not a model's weights" in text, text
    assert "missing" not in text and "unexpected" not in text, text
    fresh = torch.optim.AdamW(model.parameters())
    fsdp_restore.restore_optimizer(fresh, model, tmp_path / "optimizer.safetensors", optim_prefix="")
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_extra_states_of_a_shared_module_and_of_none_as_load_state_dict_gives_them(tmp_path):
    """A module under two names has its extra state under each (torch calls set_extra_state twice; the restore
    called the second name's unexpected), and a state of None is a value (it was taken for missing)."""
    def net(state):
        torch.manual_seed(0)
        shared = _Scaling(state)
        return torch.nn.ModuleDict({"a": shared, "b": shared, "c": _Scaling(None), "out": torch.nn.Linear(4, 2)})

    saved = net({"amax": torch.arange(4.0)})
    assert list(saved.state_dict()).count("b._extra_state") == 1 and "c._extra_state" in saved.state_dict()
    path = _converted(tmp_path, saved)
    oracle, ours = net("unset"), net("unset")
    oracle.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["model"])
    restore_model(ours, path)
    for name in ("a", "c"):
        assert len(ours[name].given) == len(oracle[name].given), name
    assert len(ours["a"].given) == 2 and ours["c"].given == [None] == oracle["c"].given
    assert all(torch.equal(g["amax"], torch.arange(4.0)) for g in ours["a"].given)


def _checkpointed_then_fsdp1(rank, world_size, path, params):
    """Activation checkpointing applied before FSDP1 wraps the blocks: each unit's name ends with the wrapper's
    ``_checkpoint_wrapped_module`` (CheckpointWrapper(FSDP(block)))."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = build("mlp", seed=3)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, torch.nn.Linear) and m is not model.out)
    model = FSDP(model, use_orig_params=params == "orig", auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                 device_id=torch.device("cpu"))
    assert any(n.endswith("_checkpoint_wrapped_module") for n, m in model.named_modules() if isinstance(m, FSDP))
    restore_model(model, path)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        restored = {k: v.clone() for k, v in model.state_dict().items()}
    saved = path.replace(".safetensors", f"-{params}-saved.safetensors")
    fsdp_restore.save_sharded(model, saved)  # the same names back
    return restored, saved


@pytest.mark.parametrize("params", ["flat", "orig"])
def test_fsdp1_units_inside_activation_checkpoint_wrappers(tmp_path, params):
    """The restore read the file's names with the wrapper's infix ('missing: ..._checkpoint_wrapped_module...'),
    and save_sharded refused ('state-dict names and its tensors differ'): a unit's name ending with the
    wrapper's own name was not cleaned."""
    from safetensors.torch import load_file

    oracle = build("mlp", seed=0).state_dict()
    path = str(tmp_path / "w.safetensors")
    fsdp_restore.save(oracle, path)
    for restored, saved in run_ranks(_checkpointed_then_fsdp1, 2, path, params):
        assert restored.keys() == oracle.keys()
        assert all(torch.equal(restored[k], oracle[k]) for k in oracle)
        written = load_file(saved)
        assert written.keys() == oracle.keys() and all(torch.equal(written[k], oracle[k]) for k in oracle)


class _LoadsTransposed(torch.nn.Linear):
    """Its load_state_dict transposes the stored weight (a checkpoint of an older layout, as some libraries do)."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _halve_on_load(state_dict, prefix, *args):  # a load pre-hook from outside torch
    state_dict[prefix + "weight"] = state_dict[prefix + "weight"] / 2


def _halve_after_load(module, incompatible_keys):  # a load post-hook from outside torch
    module.weight.data.mul_(0.5)


@pytest.mark.parametrize("how", ["override", "pre-hook", "post-hook"])
def test_a_model_whose_load_state_dict_runs_code_of_its_own_is_warned_of(tmp_path, how):
    """The restore writes the stored values past a module's own load code, without a word: a value-changing hook or
    override then left other values in the model than load_state_dict gives it (torch's, the oracle). It is not
    refused (most such code renames old checkpoints' entries: Mamba, DETR's frozen batch norm, TransformerEngine),
    but named in a warning; torch.nn's own overrides (BatchNorm, InstanceNorm) are not."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.InstanceNorm1d(3))
    path = _converted(tmp_path, plain)

    def target() -> torch.nn.Sequential:
        model = torch.nn.Sequential(_LoadsTransposed(3, 3) if how == "override" else torch.nn.Linear(3, 3),
                                    torch.nn.BatchNorm1d(3), torch.nn.InstanceNorm1d(3))
        if how == "pre-hook":
            model[0]._register_load_state_dict_pre_hook(_halve_on_load)
        elif how == "post-hook":
            model[0].register_load_state_dict_post_hook(_halve_after_load)
        return model

    oracle = target()
    oracle.load_state_dict(plain.state_dict())
    assert not torch.equal(oracle[0].weight, plain[0].weight)  # what torch would have made of them
    ours = target()
    why = {"override": "_LoadsTransposed overrides _load_from_state_dict", "pre-hook": "a load_state_dict hook of",
           "post-hook": "a load_state_dict hook of"}[how]
    with pytest.warns(UserWarning, match=r"past the load_state_dict code of 1 module\(s\): 0 \(" + why) as caught:
        restore_model(ours, path)
    assert caught[0].filename == __file__  # pointed at the caller's line
    assert torch.equal(ours[0].weight, plain[0].weight)  # the stored values, as the warning says
    plain_target = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.InstanceNorm1d(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.nn's own overrides: no warning
        restore_model(plain_target, path)
    for name, value in plain.state_dict().items():
        assert torch.equal(plain_target.state_dict()[name], value), name


@pytest.mark.parametrize("call,bad,expected", [
    ("restore_model", {"check": "no"}, "check must be True or False, not 'no'"),
    ("restore_model", {"strict": None}, "strict must be True or False, not None"),
    ("restore_model", {"check_buffers": 1}, "check_buffers must be True or False, not 1"),
    ("restore_model", {"model_prefix": 3}, "model_prefix must be a dotted subtree name .* not 3"),
    ("restore", {"optim_prefix": 3}, "optim_prefix must be a dotted subtree name .* not 3"),
    ("restore_optimizer", {"strict": "yes"}, "strict must be True or False, not 'yes'"),
    ("restore_optimizer", {"optim_prefix": ["optim"]}, r"optim_prefix must be a dotted subtree name .* not \['optim'\]"),
])
def test_options_are_checked_at_the_door(tmp_path, call, bad, expected):
    """check="no" read as true and a prefix of 3 failed deep in the plan ("unsupported operand type(s) for +"): each
    is a TypeError naming the option before anything is read, and the model is untouched."""
    path = _converted(tmp_path, torch.nn.Linear(2, 2))
    fresh = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    args = {"restore_model": (fresh, path), "restore": (fresh, path, torch.optim.AdamW(fresh.parameters())),
            "restore_optimizer": (torch.optim.AdamW(fresh.parameters()), fresh, path)}[call]
    with pytest.raises(TypeError, match=expected):
        getattr(fsdp_restore, call)(*args, **bad)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_a_strict_restore_of_the_trained_part_alone_says_what_the_missing_are(tmp_path):
    """A file of the trainable parameters alone (save_sharded(ignore_frozen_params=True), an adapter's file) into
    the whole model: the strict error says that every missing tensor is a frozen parameter and that strict=False
    restores such a file; a file that also lacks a trained parameter does not get that line."""
    from safetensors.torch import save_file

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    trained = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("0.")}
    save_file(trained, tmp_path / "part.safetensors")
    save_file({k: v for k, v in trained.items() if k != "2.bias"}, tmp_path / "less.safetensors")
    with pytest.raises(RestoreError, match=r"the missing: each of the 2 is a parameter that does not require grad.*"
                                           r"strict=False") as e:
        restore_model(model, tmp_path / "part.safetensors")
    assert "0.weight" in str(e.value) and "0.bias" in str(e.value)
    with pytest.raises(RestoreError) as e:
        restore_model(model, tmp_path / "less.safetensors")
    assert "2.bias" in str(e.value) and "does not require grad" not in str(e.value)
    restore_model(model, tmp_path / "part.safetensors", strict=False)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())


def test_a_non_strict_restore_from_a_file_of_no_tensors_fails_and_an_all_frozen_part_is_not_saved(tmp_path):
    """strict=False from a file that holds nothing (under the prefix) would restore nothing: an error, as for a
    file of other names; and save_sharded(ignore_frozen_params=True) of a model with nothing trainable refuses to
    write such a file."""
    from safetensors.torch import save_file

    model = torch.nn.Linear(3, 2)
    save_file({}, tmp_path / "empty.safetensors")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RestoreError, match="the file holds no tensors under prefix '', so strict=False would restore"
                                           " none of the model's 2"):
        restore_model(model, tmp_path / "empty.safetensors", strict=False)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    model.requires_grad_(False)
    with pytest.raises(fsdp_restore.SaveError, match="no parameter of the model requires grad"):
        fsdp_restore.save_sharded(model, tmp_path / "part.safetensors", ignore_frozen_params=True)
    assert not (tmp_path / "part.safetensors").exists()
