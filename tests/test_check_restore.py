"""check-restore: restores into the user's model on N ranks and gives the verdict as the exit code."""

import subprocess
import sys

import pytest
import torch

import fsdp_restore
from fsdp_restore.check_restore import run_check_restore

FACTORY = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 6)
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.embed.weight

def build():
    torch.manual_seed(0)
    return Net()
'''


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "mymodel.py").write_text(FACTORY)
    sys.path.insert(0, str(tmp_path))
    import mymodel

    torch.save({"model": mymodel.build().state_dict(), "step": 5}, tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("mymodel", None)


@pytest.mark.parametrize("fsdp,nproc", [("fsdp2", 3), ("fsdp1", 2)])
def test_good_checkpoint_passes(setup, fsdp, nproc):
    report = run_check_restore(str(setup / "ck.safetensors"), f"{setup / 'mymodel.py'}:build", nproc=nproc, fsdp=fsdp)
    assert report.ok, report.problems
    assert len(report.ranks) == nproc and all(r["compared"] > 0 for r in report.ranks)
    assert sum(r["tensors"] for r in report.ranks) == nproc * 7  # embed + 3 x (weight, bias); tied head once


@pytest.mark.slow  # whole torchrun processes, one per exit code: 14 s on 2 cores
def test_cli_exit_codes(setup):
    cmd = [sys.executable, "-m", "fsdp_restore", "check-restore", "ck.safetensors", "--model", "mymodel:build",
           "--nproc", "2"]
    res = subprocess.run(cmd, cwd=setup, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "restore check passed" in res.stdout
    state = fsdp_restore.load(setup / "ck.safetensors")
    del state["model"]["layers.1.bias"]
    fsdp_restore.save(state, setup / "bad.safetensors")
    res = subprocess.run(cmd[:4] + ["bad.safetensors"] + cmd[5:], cwd=setup, capture_output=True, text=True)
    assert res.returncode == 1 and "layers.1.bias" in res.stdout
    res = subprocess.run(cmd[:6] + ["nomodule:build"] + cmd[7:], cwd=setup, capture_output=True, text=True)
    assert res.returncode == 2 and "cannot import nomodule" in res.stderr and "Traceback" not in res.stderr  # bad value


@pytest.mark.slow  # five CLI processes: 11-14 s on 2 cores
def test_a_model_or_key_map_that_fails_to_load_is_one_line(setup):
    """A --model file with a syntax error, a module that raises at import, or a --key-map attribute that is not a
    map printed a Python traceback with exit 1; other bad values of these options are one line with exit 2."""
    (setup / "broken.py").write_text("def build(:\n")
    (setup / "raises.py").write_text("raise RuntimeError('no GPU here')\ndef build(): pass\n")
    (setup / "maps.py").write_text("X = 3\n")
    base = [sys.executable, "-m", "fsdp_restore", "check-restore", "ck.safetensors", "--nproc", "1"]
    for extra, said in [(["--model", "broken.py:build"], "SyntaxError"), (["--model", "raises:build"], "no GPU here"),
                        (["--model", "raises.py:build"], "no GPU here"),
                        (["--model", "mymodel:build", "--key-map", "maps:X"], "not int 3"),
                        (["--model", "mymodel:build", "--key-map", "raises:build"], "no GPU here")]:
        res = subprocess.run(base + extra, cwd=setup, capture_output=True, text=True)
        assert res.returncode == 2 and said in res.stderr and "Traceback" not in res.stderr, (extra, res.stderr)


def test_a_factory_that_returns_no_model_is_named(setup):
    """A --model function returning something else failed deep in the sharding ("AttributeError: 'int' object has
    no attribute 'modules'"), naming nothing of the user's."""
    (setup / "notmodel.py").write_text("def build():\n    return 3\n")
    report = run_check_restore(str(setup / "ck.safetensors"), f"{setup / 'notmodel.py'}:build", nproc=1)
    assert not report.ok
    text = " ".join(report.problems)
    assert "notmodel.py:build returned int, not a torch.nn.Module" in text and "AttributeError" not in text, text


LLAMA_FACTORY = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def build():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=30, intermediate_size=46, num_hidden_layers=2,
                                        num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=32))
'''


def test_meta_built_llama_gets_its_rotary_buffers(tmp_path):
    """check-restore builds FSDP2 models on the meta device: the rotary inv_freq (in no checkpoint) is rebuilt,
    and the restore's buffer check would refuse it otherwise."""
    (tmp_path / "llama_factory.py").write_text(LLAMA_FACTORY)
    namespace: dict = {}
    exec(LLAMA_FACTORY, namespace)
    torch.save({"model": namespace["build"]().state_dict()}, tmp_path / "l.pt")
    fsdp_restore.convert(tmp_path / "l.pt", tmp_path / "l.safetensors")
    report = run_check_restore(str(tmp_path / "l.safetensors"), f"{tmp_path / 'llama_factory.py'}:build", nproc=2)
    assert report.ok, report.problems


def _swapped_worker(rank, world_size, path, spec):
    """check-restore on a rank whose plan reads two same-shaped weights into each other's memory: every
    element is written once, so the NaN check and the coverage digest cannot see it."""
    import importlib

    restore = importlib.import_module("fsdp_restore.restore")
    real_build = restore.build_plan

    def swapped(*args, **kwargs):
        plan = real_build(*args, **kwargs)
        a = [i for i in plan.items if i.name == "layers.0.weight"]
        b = [i for i in plan.items if i.name == "layers.1.weight"]
        for x, y in zip(a, b):
            x.key, y.key = y.key, x.key
        return plan

    restore.build_plan = swapped
    from fsdp_restore.check_restore import _worker

    return _worker(rank, world_size, path, spec, "fsdp2", None)


def test_the_oracle_catches_what_the_nan_check_cannot(setup):
    from dist import run_ranks

    results = run_ranks(_swapped_worker, 2, str(setup / "ck.safetensors"), f"{setup / 'mymodel.py'}:build")
    assert all(r["error"] is None for r in results)  # the restore itself passed its check
    mismatched = sorted({m for r in results for m in r["mismatches"]})
    assert mismatched == ["layers.0.weight", "layers.1.weight"]


RENAMED_FACTORY = FACTORY.replace("self.embed", "self.tok").replace("self.layers", "self.blocks")


@pytest.mark.slow  # whole torchrun processes: 13 s on 2 cores
def test_cli_key_map_file(setup):
    """A model whose names differ from the checkpoint's passes with --key-map (a YAML file of regex pairs),
    fails naming the missing keys without it, and a malformed map is one line, no traceback."""
    (setup / "renamed.py").write_text(RENAMED_FACTORY)
    (setup / "map.yaml").write_text(r"""
- ['^tok\.', 'embed.']
- ['^blocks\.', 'layers.']
""")
    cmd = [sys.executable, "-m", "fsdp_restore", "check-restore", "ck.safetensors", "--model", "renamed:build",
           "--nproc", "2"]
    res = subprocess.run(cmd + ["--key-map", "map.yaml"], cwd=setup, capture_output=True, text=True)
    assert res.returncode == 0 and "restore check passed" in res.stdout, res.stdout + res.stderr
    res = subprocess.run(cmd, cwd=setup, capture_output=True, text=True)
    assert res.returncode == 1 and "blocks.0.weight" in res.stdout, res.stdout + res.stderr
    (setup / "bad.yaml").write_text("- ['(', 'x']\n")
    res = subprocess.run(cmd + ["--key-map", "bad.yaml"], cwd=setup, capture_output=True, text=True)
    assert res.returncode == 2 and "bad regex" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_compiled_models_checkpoint_is_compared_tensor_by_tensor(setup):
    """A checkpoint saved from a torch.compile'd model (every name under ``_orig_mod.``): the restore renames
    them, and the comparison, renaming on its own, compares every tensor instead of none."""
    state = torch.load(setup / "ck.pt")
    state["model"] = {f"_orig_mod.{k}": v for k, v in state["model"].items()}
    torch.save(state, setup / "compiled.pt")
    fsdp_restore.convert(setup / "compiled.pt", setup / "compiled.safetensors")
    report = run_check_restore(str(setup / "compiled.safetensors"), f"{setup / 'mymodel.py'}:build", nproc=2)
    assert report.ok, report.problems
    assert sum(r["compared"] for r in report.ranks) == 7  # every tensor once over the ranks; tied head once


def _blind_oracle_worker(rank, world_size, path, spec):
    """check-restore whose comparison cannot find the file's tensors under the model's names."""
    import fsdp_restore.check_restore as check_restore

    check_restore._unwrapped_names = lambda state: state  # the comparison's renaming broken
    return check_restore._worker(rank, world_size, path, spec, "fsdp2", None)


def test_a_comparison_that_finds_nothing_fails(setup):
    """Where the comparison finds no stored tensor for a name the restore restored, the check fails naming it:
    before, such names were skipped, and a comparison of 0 tensors passed."""
    from dist import run_ranks

    state = torch.load(setup / "ck.pt")
    state["model"] = {f"_orig_mod.{k}": v for k, v in state["model"].items()}
    torch.save(state, setup / "compiled.pt")
    fsdp_restore.convert(setup / "compiled.pt", setup / "compiled.safetensors")
    results = run_ranks(_blind_oracle_worker, 2, str(setup / "compiled.safetensors"), f"{setup / 'mymodel.py'}:build")
    assert all(r["error"] is None and r["compared"] == 0 for r in results)  # the restore itself passed
    assert sorted(n for r in results for n in r["not_found"]) == sorted(
        ["embed.weight"] + [f"layers.{i}.{p}" for i in range(3) for p in ("weight", "bias")])


@pytest.mark.parametrize("fsdp", ["fsdp1", "fsdp2"])
def test_a_tied_weight_stored_under_one_name_is_compared(setup, fsdp):
    """transformers' save_pretrained stores a tied head under the embedding's name only, with no alias: FSDP1's
    comparison looked for it under the head's name alone and failed a good restore."""
    from safetensors.torch import save_file

    import mymodel

    state = {k: v.clone() for k, v in mymodel.build().state_dict().items() if k != "head.weight"}
    save_file(state, setup / "hf.safetensors")
    report = run_check_restore(str(setup / "hf.safetensors"), f"{setup / 'mymodel.py'}:build", nproc=2, fsdp=fsdp)
    assert report.ok, report.problems
    assert sum(r["compared"] for r in report.ranks) == 7


def _swapped_reads_worker(rank, world_size, path, spec):
    """A reader bug, injected: the file's index read with two same-shaped tensors' entries swapped, so the restore
    reads each one's bytes for the other."""
    import fsdp_restore.check_restore as check_restore
    import fsdp_restore.read as read

    real = read.Checkpoint._index

    def swapped(self, *args, **kwargs):
        real(self, *args, **kwargs)
        a, b = "model.layers.0.weight", "model.layers.1.weight"
        if a in self.entries and b in self.entries:
            self.entries[a], self.entries[b] = self.entries[b], self.entries[a]

    read.Checkpoint._index = swapped
    out = check_restore._worker(rank, world_size, path, spec, "fsdp2", None)
    return out["error"], out["mismatches"]


def test_the_comparison_does_not_share_the_restores_reader(setup):
    """The expected values came through this package's own reader (`load`), so a reader bug the restore had was
    blessed by the comparison: they are now read by safetensors itself."""
    from dist import run_ranks

    results = run_ranks(_swapped_reads_worker, 2, str(setup / "ck.safetensors"), f"{setup / 'mymodel.py'}:build")
    assert all(error is None for error, _ in results)  # the restore itself passed: every element was written
    assert sorted(n for _, bad in results for n in bad) == ["layers.0.weight", "layers.1.weight"]


def test_every_path_the_restore_takes_is_checked(setup):
    """The comparison opened the path itself with safetensors: a directory holding one model.safetensors, an index
    of another name, the index's own path and a .pt beside its conversion all failed check-restore, which the
    restore accepts. Each tensor is read once (a membership test read it too)."""
    import os
    import shutil

    from safetensors.torch import save_file

    import fsdp_restore.check_restore as check_restore
    import mymodel

    state = mymodel.build().state_dict()
    (setup / "hf").mkdir()
    save_file({k: v.clone() for k, v in state.items() if k != "head.weight"}, setup / "hf" / "model.safetensors")
    fsdp_restore.save(dict(state), setup / "sharded", max_shard_size=300)
    shutil.copytree(setup / "sharded", setup / "renamed")
    os.rename(setup / "renamed" / "model.safetensors.index.json",
              setup / "renamed" / "diffusion_pytorch_model.safetensors.index.json")
    for path in [setup / "hf", setup / "renamed", setup / "sharded" / "model.safetensors.index.json",
                 setup / "ck.pt"]:
        report = run_check_restore(str(path), f"{setup / 'mymodel.py'}:build", nproc=1, fsdp="fsdp2")
        assert report.ok, (path, report.problems)
    expected = check_restore._expected_tensors(str(setup / "ck.safetensors"), "model")
    reads: list[str] = []
    expected._handle_of = {k: _Counted(h, reads) for k, h in expected._handle_of.items()}
    assert "embed.weight" in expected and not reads
    assert torch.equal(expected["embed.weight"], state["embed.weight"]) and reads == ["model.embed.weight"]


@pytest.mark.parametrize("holder", ["dict", "Namespace"])
def test_a_view_inside_a_nested_model_subtree_is_compared(setup, holder):
    """A tensor stored as a view of another, in a model subtree of nested dicts (and under --model-prefix, in a dict
    or an argparse.Namespace): the comparison looked it up by its dotted name in the loaded object and failed in the
    middle of the gathers."""
    import argparse

    import mymodel

    state = mymodel.build().state_dict()
    base = torch.zeros(state["embed.weight"].numel() + 7)
    base[7:] = state["embed.weight"].reshape(-1)
    nested: dict = {}
    for name, value in state.items():
        node = nested
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = base[7:].view(value.shape) if name == "embed.weight" else value
    ema = {"model": nested} if holder == "dict" else argparse.Namespace(model=nested)
    fsdp_restore.save({"base": base, "ema": ema}, setup / "nested.safetensors")
    report = run_check_restore(str(setup / "nested.safetensors"), f"{setup / 'mymodel.py'}:build", nproc=2,
                               fsdp="fsdp2", model_prefix="ema.model")
    assert report.ok, report.problems


class _Counted:
    def __init__(self, handle, reads):
        self.handle, self.reads = handle, reads

    def get_tensor(self, key):
        self.reads.append(key)
        return self.handle.get_tensor(key)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)


class _EmaWrapper(torch.nn.Module):  # timm's ModelEmaV2 style: the model's own child is called `module`
    def __init__(self):
        super().__init__()
        self.module = torch.nn.Linear(3, 2)


@pytest.mark.parametrize("case", ["block-compiled", "child-called-module", "ddp"])
def test_the_comparison_finds_what_the_restore_restored(tmp_path, case):
    """Names the restore renames (a block compiled on its own: `layers.0._orig_mod.lin.weight`; DDP's `module.`),
    and one it must not (a model whose child is called `module`): the comparison finds every tensor."""
    from fsdp_restore.check_restore import _expected_tensors, compare_with_file

    torch.manual_seed(0)
    if case == "block-compiled":
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([_Block(), _Block()])
        state = {k.replace("layers.0.", "layers.0._orig_mod."): v for k, v in model.state_dict().items()}
    elif case == "child-called-module":
        model = _EmaWrapper()
        state = model.state_dict()
    else:
        model = _Block()
        state = {f"module.{k}": v for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "ck.pt")
    fsdp_restore.convert(tmp_path / "ck.pt", tmp_path / "ck.safetensors")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fsdp_restore.restore_model(model, tmp_path / "ck.safetensors")
    compared, differ, not_found = compare_with_file(model, _expected_tensors(str(tmp_path / "ck.safetensors"), ""))
    assert (compared, differ, not_found) == (len(state), [], [])


LORA_FACTORY = '''
import torch
from torch import nn

class LoRALinear(nn.Module):
    def __init__(self, n, r=2):
        super().__init__()
        self.base = nn.Linear(n, n)
        self.lora_A = nn.Parameter(torch.randn(r, n))
        self.lora_B = nn.Parameter(torch.zeros(n, r))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([LoRALinear(6) for _ in range(3)])

def build():
    torch.manual_seed(0)
    return Net()
'''


def test_no_strict_checks_what_an_adapter_file_holds_and_lists_the_rest(tmp_path):
    """A LoRA adapter's file holds a few of the model's tensors: strict fails naming the base weights; --no-strict
    restores and compares the adapter's, and lists what it left as built and what the file has beyond the model."""
    (tmp_path / "lora_model.py").write_text(LORA_FACTORY)
    torch.manual_seed(3)
    adapter = {f"layers.{i}.{name}": torch.randn(*shape) for i in range(3)
               for name, shape in (("lora_A", (2, 6)), ("lora_B", (6, 2)))}
    fsdp_restore.save({"model": {**adapter, "extra.scale": torch.ones(1)}}, tmp_path / "adapter.safetensors")
    spec = f"{tmp_path / 'lora_model.py'}:build"
    strict = run_check_restore(str(tmp_path / "adapter.safetensors"), spec, nproc=1)
    assert not strict.ok and "layers.0.base.weight" in " ".join(strict.problems)
    report = run_check_restore(str(tmp_path / "adapter.safetensors"), spec, nproc=2, strict=False)
    assert report.ok, report.problems
    assert sum(r["compared"] for r in report.ranks) == 6  # the six adapter tensors, each compared on one rank
    assert report.left_as_built == sorted(f"layers.{i}.base.{w}" for i in range(3) for w in ("weight", "bias"))
    assert report.unexpected == ["extra.scale"]
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report.summary())
    text = console.export_text()
    assert "every element of the tensors the file holds" in text and "left as the model was built (6)" in text
    # a file that holds none of the model's tensors under the names looked for passes nothing
    fsdp_restore.save({"model": {"other.weight": torch.ones(2)}}, tmp_path / "none.safetensors")
    nothing = run_check_restore(str(tmp_path / "none.safetensors"), spec, nproc=1, strict=False)
    assert not nothing.ok and any("none of the model's tensors" in p or "nothing" in p for p in nothing.problems), \
        nothing.problems
    with pytest.raises(TypeError, match="strict"):
        run_check_restore(str(tmp_path / "adapter.safetensors"), spec, strict="no")
