"""Restoring under other names: a Hugging Face Llama checkpoint into torchtitan's names, on real ranks.

The oracle is the source model itself (rebuilt from its seed) and the source's own optimizer state
(``torch.load`` of the .pt), matched by a name table written out here, not by the key map."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist import run_ranks
from models import build, full_state, wrap

import fsdp_restore
from fsdp_restore import RestoreError
from fsdp_restore.key_map import apply, as_function, parse_spec, unused_entries

ROOT = Path(__file__).resolve().parent.parent
TITAN_MAP = ROOT / "configs" / "key_maps" / "torchtitan_llama_from_hf.yaml"


def titan_to_hf(name: str) -> str:
    """The same renaming as the shipped YAML map, spelled out by hand (the oracle's name table)."""
    table = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
    parts = name.split(".")
    if parts[0] in table:
        return ".".join([table[parts[0]], *parts[1:]])
    layer, group, *rest = parts[1:]
    inner = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
             "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    key = group if group in inner else f"{group}.{rest.pop(0)}"
    return ".".join(["model.layers", layer, inner[key], *rest])


# ---- the map itself -------------------------------------------------------------------------------------


def test_the_three_forms():
    assert as_function({"a": "b"})("a") == "b" and as_function({"a": "b"})("c") == "c"
    assert as_function([(r"^x\.(\d+)", r"y.\1"), (r"^x", "z")])("x.3.w") == "y.3.w"  # first match wins
    assert as_function(str.upper)("w") == "W"
    with pytest.raises(ValueError, match="bad regex"):
        as_function([("(", "x")])
    with pytest.raises(ValueError, match="not a \\(regex, replacement\\) pair"):
        as_function([("a", "b", "c")])


def test_collisions_and_names_sent_to_nothing_are_all_reported():
    mapping, problems = apply(lambda n: {"a": "k", "b": "k", "c": None}.get(n, n), ["a", "b", "c", "d"])
    assert mapping == {"a": "k", "b": "k", "d": "d"}
    assert problems == ["a and b: key_map sends both to 'k'", "c: key_map sends it to nothing (None)"]
    # tied names may share a key
    assert apply(lambda n: "k", ["head", "embed"], same={"head": "embed"})[1] == []


def test_shipped_yaml_map_equals_the_hand_written_table():
    fn = as_function(parse_spec(str(TITAN_MAP)))
    for name in build("titan").state_dict():
        assert fn(name) == titan_to_hf(name), name


# ---- on real ranks --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_training_ckpt(tmp_path_factory):
    from helpers import tiny_llama, training_checkpoint

    root = tmp_path_factory.mktemp("key_map")
    torch.save(training_checkpoint(tiny_llama(0)), root / "hf.pt")
    fsdp_restore.convert(root / "hf.pt", root / "hf.safetensors")
    return root / "hf.safetensors"


def _in_saved_order(model, hf_names):
    """The titan model's parameters in the order the saved (Hugging Face) run's optimizer listed its own:
    torch numbers a saved optimizer's parameters in its groups' order, and a key map renames only."""
    fn = as_function(parse_spec(str(TITAN_MAP)))
    named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    return [p for n, p in sorted(named, key=lambda np_: hf_names.index(fn(np_[0])))]


def _restore_titan(rank, world_size, path, how):
    saved = torch.load(str(path).replace(".safetensors", ".pt"), weights_only=False)  # written by this test
    hf_names = list(saved["model"])  # the saved optimizer's integer ids follow the HF parameter order
    model = wrap(build("titan", seed=5), how, world_size)
    opt = torch.optim.AdamW(_in_saved_order(model, hf_names), lr=1e-3)
    result = fsdp_restore.restore(model, path, optimizer=opt, key_map=parse_spec(str(TITAN_MAP)))
    wrong = [n for n, t in full_state(model, how).items() if not torch.equal(t, saved["model"][titan_to_hf(n)])]
    for name, param in model.named_parameters():
        name = name.replace("_fsdp_wrapped_module.", "")
        state = saved["optim"]["state"][hf_names.index(titan_to_hf(name))]
        for field in ("exp_avg", "exp_avg_sq"):
            value = opt.state[param][field]
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            if not torch.equal(value.cpu(), state[field]):
                wrong.append(f"optim {name}.{field}")
    return wrong, result.model.tensors


@pytest.mark.parametrize("how,world_size", [("fsdp2", 2), ("fsdp2", 3), ("plain", 1)])
def test_hf_llama_into_torchtitan_names(hf_training_ckpt, how, world_size):
    results = run_ranks(_restore_titan, world_size, hf_training_ckpt, how)
    assert all(wrong == [] for wrong, _ in results), results
    assert results[0][1] == len(build("titan").state_dict())


def _restore_titan_in_its_own_order(rank, world_size, path):
    model = wrap(build("titan", seed=5), "fsdp2", world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # w1, w2, w3: not the saved gate, up, down order
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore(model, path, optimizer=opt, key_map=parse_spec(str(TITAN_MAP)))
    return str(info.value)


def test_an_optimizer_in_another_order_than_the_saved_ids_is_refused(hf_training_ckpt):
    """Integer ids carry no names: under a key map as anywhere, they map by the optimizer's order (as torch's
    load_state_dict); torchtitan lists w2 (down) before w3 (up), so the saved moments do not fit: refused."""
    messages = run_ranks(_restore_titan_in_its_own_order, 2, hf_training_ckpt)
    assert len(set(messages)) == 1
    assert "-> layers.0.feed_forward.w2.weight [30, 46]: saved 'exp_avg' has shape [46, 30]" in messages[0]


def _restore_badly_mapped(rank, world_size, path):
    fn = as_function(parse_spec(str(TITAN_MAP)))

    def key_map(name):
        if name == "layers.0.feed_forward.w3.weight":
            return fn("layers.0.feed_forward.w1.weight")  # two names onto one key
        if name == "norm.weight":
            return "model.final_norm.weight"  # a key the checkpoint does not have
        return fn(name)

    model = wrap(build("titan", seed=5), "fsdp2", world_size)
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(model, path, key_map=key_map)
    return str(info.value)


def test_bad_map_is_one_error_listing_every_problem(hf_training_ckpt):
    messages = run_ranks(_restore_badly_mapped, 2, hf_training_ckpt)
    assert messages[0] == messages[1]
    text = messages[0]
    assert "layers.0.feed_forward.w1.weight and layers.0.feed_forward.w3.weight: key_map sends both to" in text
    assert "norm.weight (as 'model.final_norm.weight')" in text  # missing, under both names
    assert "model.layers.0.mlp.up_proj.weight" in text and "model.norm.weight" in text  # left unexpected


def test_a_rename_cannot_fuse(tmp_path):
    """Mapping q, k and v onto a fused tensor is a shape problem, refused; never a partial copy."""
    from models import converted

    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(30, 50, bias=False)

    path = converted(tmp_path, "llama")
    with pytest.raises(RestoreError, match=r"qkv.weight: checkpoint \[30, 30\] vs model \[50, 30\]") as info:
        fsdp_restore.restore_model(Fused(), path, strict=False,
                                   key_map={"qkv.weight": "model.layers.0.self_attn.q_proj.weight"})
    assert "a rename cannot fuse or split" in str(info.value)  # the hint said strict=False, which fails the same
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(RestoreError, match=r"key_map gives several names .* a rename cannot fuse"):
        fsdp_restore.restore_model(Fused(), path, strict=False, key_map=lambda name: names)


def test_readme_example_is_the_shipped_map():
    text = (ROOT / "README.md").read_text()
    start = text.index("HF_TO_TORCHTITAN = [")
    namespace: dict = {}
    exec(text[start:text.index("]\n", start) + 1], namespace)
    assert [tuple(p) for p in namespace["HF_TO_TORCHTITAN"]] == list(parse_spec(str(TITAN_MAP)))


OLMO_CORE_MAP = ROOT / "configs" / "key_maps" / "olmo_core_llama_from_hf.yaml"
HF_TO_OLMO_CORE = {"model.embed_tokens": "embeddings", "model.norm": "lm_head.norm", "lm_head": "lm_head.w_out",
                   "self_attn.q_proj": "attention.w_q", "self_attn.k_proj": "attention.w_k",
                   "self_attn.v_proj": "attention.w_v", "self_attn.o_proj": "attention.w_out",
                   "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
                   "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
                   "post_attention_layernorm": "feed_forward_norm"}


def olmo_core_name(hf: str) -> str:
    """The hand-written table, HF name -> OLMo-core name (the oracle's direction, not the map's)."""
    for old, new in HF_TO_OLMO_CORE.items():
        if hf.startswith(old + "."):
            return new + hf[len(old):]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    module, leaf = rest.rsplit(".", 1)
    return f"blocks.{layer}.{HF_TO_OLMO_CORE[module]}.{leaf}"


def renamed_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree holding a parameter of each shape under each name of ``state``."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.full_like(tensor, 3.0)))
    return root


def test_hf_llama_into_olmo_core_names(hf_training_ckpt):
    source = torch.load(str(hf_training_ckpt).replace(".safetensors", ".pt"), weights_only=False)["model"]
    model = renamed_model({olmo_core_name(n): t for n, t in source.items()})
    report = fsdp_restore.restore_model(model, hf_training_ckpt, key_map=parse_spec(str(OLMO_CORE_MAP)))
    assert report.tensors == len(source)
    for hf, tensor in source.items():
        assert torch.equal(model.get_parameter(olmo_core_name(hf)), tensor), hf


def _restore_titan_weights(rank, world_size, path, how):
    model = wrap(build("titan", seed=5), how, world_size)
    fsdp_restore.restore_model(model, path, key_map=parse_spec(str(TITAN_MAP)))
    saved = torch.load(str(path).replace(".safetensors", ".pt"), weights_only=False)["model"]
    return [n for n, t in full_state(model, how).items() if not torch.equal(t, saved[titan_to_hf(n)])]


@pytest.mark.parametrize("how", ["fsdp1-FULL_SHARD-flat", "fsdp1-FULL_SHARD-orig", "ddp"])
def test_key_map_under_fsdp1_and_ddp(hf_training_ckpt, how):
    """Flat parameters hold several renamed tensors each; DDP prefixes every name with module."""
    assert run_ranks(_restore_titan_weights, 2, hf_training_ckpt, how) == [[], []]


@pytest.mark.parametrize("wrapper", ["module.", "_orig_mod.", "_orig_mod.module."])
def test_a_map_that_gives_wrapped_names_is_told_the_names_to_give(tmp_path, wrapper):
    """The restore reads a DDP or compiled model's names without their wrappers; a map that gave the file's own
    names ('module.weight') was told they were missing, the file holding 'weight', which it does not say. It is now
    told the name to give; the map giving it restores (torch's loader as the oracle)."""
    torch.manual_seed(0)
    saved = torch.nn.Linear(3, 2)
    torch.save({wrapper + k: v for k, v in saved.state_dict().items()}, tmp_path / "w.pt")
    fsdp_restore.convert(tmp_path / "w.pt", tmp_path / "w.safetensors")
    with pytest.raises(RestoreError, match=f"weight \\(as '{wrapper}weight'; the restore reads the file's names"
                                           " without wrappers .* give key_map 'weight'\\)"):
        fsdp_restore.restore_model(torch.nn.Linear(3, 2), tmp_path / "w.safetensors",
                                   key_map=lambda name: wrapper + name)
    model = torch.nn.Linear(3, 2)
    fsdp_restore.restore_model(model, tmp_path / "w.safetensors", key_map=lambda name: name)
    oracle = torch.nn.Linear(3, 2)
    stored = torch.load(tmp_path / "w.pt")
    oracle.load_state_dict({n: stored[wrapper + n] for n in oracle.state_dict()})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), oracle.state_dict().values()))


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight  # (nanoGPT's tie)


@pytest.mark.parametrize("key_map,message", [
    ({"head.weight": "nonexistent.weight"}, "head.weight (key_map reads the model's head.weight as"
     " 'nonexistent.weight', which the file does not hold; the model ties it to wte.weight, read from there)"),
    ({"wte.weight": "nonexistent.weight"}, "wte.weight (key_map reads the model's wte.weight as 'nonexistent.weight',"
     " which the file does not hold; the model ties it to head.weight, read from there)"),
    ({"head.weight": "_orig_mod.head.weight"}, "head.weight (key_map reads the model's head.weight as"
     " '_orig_mod.head.weight', which the file does not hold; the model ties it to wte.weight, read from there; the"
     " restore reads the file's names without wrappers such as '_orig_mod.': give key_map 'head.weight')")],
    ids=["alias", "canonical", "wrapped"])
def test_a_tied_name_the_map_sends_astray_is_named_with_where_it_went(tmp_path, key_map, message):
    """A tied tensor is read under any of its names, so a map that sends one of them to a name the file lacks
    leaves the file's own name unexpected: the verdict said only that, never the map or the name it gave."""
    torch.save({"model": _Tied().state_dict()}, tmp_path / "t.pt")
    fsdp_restore.convert(tmp_path / "t.pt", tmp_path / "t.safetensors")
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(_Tied(), tmp_path / "t.safetensors", key_map=key_map)
    assert f"unexpected in the checkpoint (1): {message}" in str(info.value), str(info.value)


def test_no_map_never_reads_one_name_for_another(tmp_path):
    """The normalization of a map's names (above) was applied without a map too, name by name: a model with a real
    child called `module` took 'module.w' from the file's 'w' instead of reporting it missing."""
    from safetensors.torch import save_file

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))
            self.module = Inner()

    save_file({"w": torch.arange(4.0)}, tmp_path / "old.safetensors")
    with pytest.raises(RestoreError, match=r"missing from the checkpoint \(1\): module.w"):
        fsdp_restore.restore_model(Outer(), tmp_path / "old.safetensors")


def test_an_optimizer_alone_through_a_map_of_a_ddp_files_names(tmp_path):
    """restore_optimizer with a map, for a file saved from DDP: the names given as the restore reads them."""
    torch.manual_seed(0)
    src = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(list(src.named_parameters()), lr=1e-3)
    src(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    for group in state["param_groups"]:
        group["param_names"] = ["module.old_" + n for n in group["param_names"]]
    fsdp_restore.save({"model": {"module.old_" + k: v for k, v in src.state_dict().items()}, "optim": state},
                      tmp_path / "ck.safetensors")
    model = torch.nn.Linear(3, 2)
    restored = torch.optim.AdamW(list(model.named_parameters()), lr=1e-3)
    fsdp_restore.restore_optimizer(restored, model, tmp_path / "ck.safetensors", key_map=lambda n: "old_" + n)
    assert torch.equal(restored.state[model.weight]["exp_avg"], opt.state[src.weight]["exp_avg"])
    assert torch.equal(restored.state[model.bias]["exp_avg_sq"], opt.state[src.bias]["exp_avg_sq"])


@pytest.mark.parametrize("stored,key_map", [
    ({"module.weight": 1, "module.bias": 1, "head.weight": 2, "head.bias": 2},
     {"inner.weight": "module.weight", "inner.bias": "module.bias"}),  # 'module.' is a real name here: kept
    ({"module.x.weight": 1, "module.x.bias": 1, "module.y.weight": 2},
     {"inner.weight": "x.weight", "inner.bias": "x.bias"}),  # a DDP file: every name has it, read without it
])
def test_a_map_into_names_that_start_with_module(tmp_path, stored, key_map):
    """Whether 'module.' is DDP's prefix is the file's to say (all of its names have it), not the map's: a map into
    a file whose child is called 'module' keeps those names."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    values = {k: torch.randn(2, 3) if k.endswith("weight") else torch.randn(2) for k in stored}
    save_file(values, tmp_path / "f.safetensors")
    model = torch.nn.Module()
    model.inner = torch.nn.Linear(3, 2)
    report = fsdp_restore.restore_model(model, tmp_path / "f.safetensors", key_map=key_map, strict=False)
    assert report.missing == []
    stored_key = {k: k if k in values else "module." + k for k in key_map.values()}
    assert torch.equal(model.inner.weight.detach(), values[stored_key[key_map["inner.weight"]]])
    assert torch.equal(model.inner.bias.detach(), values[stored_key[key_map["inner.bias"]]])


def test_a_map_loaded_with_omegaconf_is_taken_as_it_is_loaded_by_the_cli():
    """The shipped maps say to load them with omegaconf: its ListConfig pairs are sequences, not lists."""
    from omegaconf import OmegaConf

    loaded, parsed = as_function(OmegaConf.load(TITAN_MAP)), as_function(parse_spec(str(TITAN_MAP)))
    names = ["tok_embeddings.weight", "layers.3.attention.wq.weight", "layers.0.feed_forward.w2.weight", "norm.weight",
             "output.weight", "something.else"]
    assert [loaded(n) for n in names] == [parsed(n) for n in names]
    assert loaded("tok_embeddings.weight") != "tok_embeddings.weight"


def test_a_maps_entries_that_meet_no_name_are_told_apart():
    assert unused_entries({"a": "x", "typo": "y"}, ["a", "b"]) == ["'typo'"]
    assert unused_entries([(r"^a\.", "x."), (r"^layres\.", "layers.")], ["a.w", "layers.0.w"]) == [r"'^layres\.'"]
    assert unused_entries(str.upper, ["a"]) == [] and unused_entries(None, ["a"]) == []


class _LoRA(torch.nn.Module):
    """A base Linear with its adapters, as LoRA wraps one: the base's names gain `.base`, the adapters are new."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_A = torch.nn.Parameter(torch.full((2, base.in_features), 0.5))
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, 2))


def _lora_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(_LoRA(torch.nn.Linear(4, 4)), _LoRA(torch.nn.Linear(4, 3)))


def test_a_non_strict_restore_that_would_restore_nothing_is_an_error(tmp_path):
    """strict=False with a wrong prefix or map restored 0 tensors, said only in report.missing: the model kept its
    random init and training went on from it."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    fsdp_restore.save({"model": base.state_dict()}, tmp_path / "base.safetensors")
    model = _lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RestoreError, match=r"none of the model's 8 tensors is in the file under the name the restore"
                                           r" looks for, so strict=False would restore nothing .*key_map"):
        fsdp_restore.restore_model(model, tmp_path / "base.safetensors", strict=False)  # (no key_map for `.base`)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    report = fsdp_restore.restore_model(model, tmp_path / "base.safetensors", strict=False,
                                        key_map=[(r"^(\d+)\.base\.(weight|bias)$", r"\1.\2")])
    assert report.tensors == 4 and sorted(report.missing) == ["0.lora_A", "0.lora_B", "1.lora_A", "1.lora_B"]
    full = base.state_dict()  # the oracle: the source model itself
    assert all(torch.equal(model.state_dict()[f"{i}.base.{w}"], full[f"{i}.{w}"]) for i in (0, 1) for w in ("weight", "bias"))
    assert torch.equal(model[0].lora_A, before["0.lora_A"])  # the adapters as built


@pytest.mark.parametrize("key_map, said", [
    ([(r"^(\d+)\.bsae\.(weight|bias)$", r"\1.\2"), (r"^(\d+)\.base\.weight$", r"\1.weight")],
     r"its entries '\^\(\\d\+\)\\.bsae\\.\(weight\|bias\)\$' match no model name"),
    ({"0.base.weight": "0.weight", "1.base.weight": "1.wieght"}, r"it sent 1.base.weight -> '1.wieght' to names the file"),
])
def test_a_map_that_leaves_names_of_a_non_strict_restore_unread_is_warned_of(tmp_path, key_map, said):
    """A typo in a key_map under strict=False restored part of the model, silently."""
    import warnings

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    fsdp_restore.save({"model": base.state_dict()}, tmp_path / "base.safetensors")
    with pytest.warns(UserWarning, match=rf"strict=False left \d+ of the model's tensors as built .*key_map may be"
                                         rf" why: .*{said}"):
        fsdp_restore.restore_model(_lora_model(), tmp_path / "base.safetensors", strict=False, key_map=key_map)
    with pytest.raises(RestoreError, match="match no model name, so they rename nothing" if isinstance(key_map, list)
                       else r"1.base.weight \(as '1.wieght'\)"):
        fsdp_restore.restore_model(_lora_model(), tmp_path / "base.safetensors", key_map=key_map)
    good = [(r"^(\d+)\.base\.(weight|bias)$", r"\1.\2")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # adapters left as built, as asked, and every entry used: nothing to say
        fsdp_restore.restore_model(_lora_model(), tmp_path / "base.safetensors", strict=False, key_map=good)


def _restore_nothing_sharded(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard

    model = _lora_model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(model, path, strict=False)
    untouched = all(torch.equal(v.full_tensor(), before[k]) for k, v in model.state_dict().items())
    return str(info.value), untouched


def test_a_non_strict_restore_that_would_restore_nothing_fails_on_every_rank_alike(tmp_path):
    """The same error on both ranks of an FSDP2 model, the model untouched on each."""
    torch.manual_seed(0)
    fsdp_restore.save({"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)).state_dict()},
                      tmp_path / "base.safetensors")
    results = run_ranks(_restore_nothing_sharded, 2, str(tmp_path / "base.safetensors"))
    assert all(untouched for _, untouched in results)
    assert results[0][0] == results[1][0] and "strict=False would restore nothing" in results[0][0]
