"""A part of a torch.save file (``select``) loaded while the rest of the file names globals the weights-only unpickler
refuses: a training script's own config class, an omegaconf DictConfig, an enum, and a call that would leave a
marker file behind if anything ran it. The weights are compared bit for bit with what the saving script wrote
through safetensors' own writer, read with safetensors' own reader."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fsdp_restore
from fsdp_restore.errors import UnsafePickleError
from fsdp_restore.inert import inert_aliases, inert_within

DEFINITIONS = """
import collections, dataclasses, enum, os, sys
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

out, marker = sys.argv[1], sys.argv[2]

@dataclasses.dataclass
class Cfg:
    lr: float = 3e-4
    layers: int = 2

class Stage(enum.Enum):
    PRETRAIN = 1

def touch(path):  # what a hostile pickle would run
    open(path, "w").write("ran")

class Trap:
    def __reduce__(self):
        return (touch, (marker,))

class AttrDict(dict):  # Lightning's AttributeDict, a dict subclass the pickle fills item by item
    pass

class History(list):
    pass
"""
SAVING = DEFINITIONS + """
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
model = net.state_dict()  # an OrderedDict with its _metadata, as people save it
model["emb"] = torch.randn(7, 4).to(torch.bfloat16)
model["steps"] = torch.tensor(12, dtype=torch.int64)
run = {"model": model, "optimizer": {"state": {0: {"exp_avg": torch.randn(3, 5)}}, "param_groups": [{"lr": 0.1}]},
       "config": Cfg(), "hydra": OmegaConf.create({"model": {"dim": 8, "sizes": [1, 2]}}),
       "stage": Stage.PRETRAIN, "trap": Trap(), "epoch": 3, "hparams": AttrDict(lr=0.1, cfg=Cfg()),
       "cache": collections.defaultdict(list, {"now": [1]}), "history": History([1, 2])}
torch.save(run, out)
torch.save(run, out + ".legacy", _use_new_zipfile_serialization=False)
torch.save({"model": AttrDict(model), "config": Cfg()}, out + ".inside")  # a dict subclass holding the weights
torch.save({"model": model, "run": os.system}, out + ".blocked")  # a global torch never loads, even unused
save_file({k: v.contiguous() for k, v in model.items()}, out + ".oracle.safetensors")
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("inert")
    src, marker = d / "run.pt", d / "marker"
    subprocess.run([sys.executable, "-c", SAVING, str(src), str(marker)], check=True)
    assert not marker.exists()
    return src, marker, load_file(f"{src}.oracle.safetensors")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                     b.view(-1).view(torch.uint8))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_restore", *args], capture_output=True, text=True)


def test_the_weights_convert_while_the_rest_names_refused_globals_and_nothing_of_it_runs(saved, tmp_path):
    src, marker, oracle = saved
    fsdp_restore.convert(src, tmp_path / "py.safetensors", select="model")
    res = _cli("convert", str(src), str(tmp_path / "cli.safetensors"), "--select", "model")
    assert res.returncode == 0, res.stderr
    for name in ("py", "cli"):
        out = load_file(tmp_path / f"{name}.safetensors")
        assert sorted(out) == sorted(oracle)
        assert all(_same_bits(out[k], oracle[k]) for k in oracle)
    res = _cli("verify", str(tmp_path / "cli.safetensors"), "--against", str(src), "--select", "model")
    assert res.returncode == 0 and "identical" in res.stdout, res.stdout + res.stderr
    fsdp_restore.convert(src, tmp_path / "optim.safetensors", select="optimizer")  # another part, the same way
    assert not marker.exists()  # nothing the pickle names outside the part was imported or called
    # the trap is live: loading the file trusted, where its classes are defined, runs it (so the check above can fail)
    subprocess.run([sys.executable, "-c", DEFINITIONS + "torch.load(out, weights_only=False)\n", str(src), str(marker)],
                   check=True)
    assert marker.read_text() == "ran"
    marker.unlink()


@pytest.mark.parametrize("on_unsupported", ["error", "skip"])
def test_a_part_that_holds_a_refused_global_is_refused_naming_each_inside_it(saved, tmp_path, on_unsupported):
    """Even with on_unsupported='skip': a stand-in is not the value (a DictConfig would have been stored as the
    mapping it is, with the class allowed), so dropping it would write another file than the allowed load does."""
    src, marker, _ = saved
    with pytest.raises(UnsafePickleError) as e:
        fsdp_restore.convert(src, tmp_path / "o.safetensors", select="hydra", on_unsupported=on_unsupported)
    text = str(e.value)
    assert "the part 'hydra' holds objects of" in text
    # the config's own class and the ones its state names, nested in it; not those of the other parts
    assert "omegaconf.dictconfig.DictConfig" in text and "omegaconf.nodes.AnyNode" in text
    assert "__main__.Cfg" not in text and "__main__.touch" not in text
    assert "--allow-global " in text and "--trust-pickle" in text
    assert not (tmp_path / "o.safetensors").exists() and not marker.exists()
    res = _cli("convert", str(src), str(tmp_path / "o.safetensors"), "--select", "trap")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "the part 'trap' holds objects of __main__.touch" in res.stderr
    res = _cli("verify", str(tmp_path / "o.safetensors"), "--against", str(src), "--select", "config")
    assert res.returncode != 0
    assert not marker.exists()


def test_the_refusal_of_the_whole_file_offers_the_parts_that_would_load(saved, tmp_path):
    src, marker, _ = saved
    res = _cli("convert", str(src), str(tmp_path / "o.safetensors"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    text = " ".join(res.stderr.split())
    assert "the pickle references __main__.AttrDict, __main__.Cfg, __main__.History, __main__.Stage" in text
    assert "The file's 'model', 'optimizer' hold tensors and none of them: select one (--select model" in text
    assert "'hydra'" not in text and "'epoch'" not in text  # (a part with a refused global, or without tensors)
    assert not (tmp_path / "o.safetensors").exists() and not marker.exists()


def test_stand_ins_are_found_wherever_they_are_kept():
    (cls, name), = inert_aliases(["mylib.Config"])
    assert name == "mylib.Config"
    inner = cls(1, key="x")
    outer = cls()
    outer.__setstate__({"inner": [inner]})
    objects = np.empty(2, dtype=object)
    objects[0] = cls()
    assert inert_within({"a": [torch.ones(1), {"b": (outer,)}]}) == ["mylib.Config"]
    assert inert_within({"a": {1, 2}, "t": torch.ones(2), "s": "mylib.Config"}) == []
    assert inert_within([cls]) == ["mylib.Config"]  # the class itself, as a value
    assert inert_within({"arr": objects}) == ["mylib.Config"]
    filled = inert_aliases(["x.Y"], {"x.Y": "mapping"})
    held = filled[0][0]()  # a dict subclass's stand-in: a plain dict, filled as the pickle fills it
    assert type(held) is dict
    held["k"] = inner
    assert inert_within({"a": held}, filled) == ["mylib.Config", "x.Y"]
    assert inert_within({"a": {"k": 1}}, filled) == []  # another dict is not one of its


def test_dict_and_list_subclasses_and_a_legacy_file_around_the_part_leave_it_loadable(saved, tmp_path):
    """A dict or list subclass (Lightning's AttributeDict, a defaultdict as OmegaConf's resolver cache keeps) is
    filled item by item, which torch's unpickler does only for dicts and lists: their stand-ins are plain ones. A
    legacy (non-zip) file names its globals one refusal at a time."""
    src, marker, oracle = saved
    for name, source in (("zip", src), ("legacy", f"{src}.legacy")):
        fsdp_restore.convert(source, tmp_path / f"{name}.safetensors", select="model")
        out = load_file(tmp_path / f"{name}.safetensors")
        assert sorted(out) == sorted(oracle) and all(_same_bits(out[k], oracle[k]) for k in oracle), name
        res = _cli("verify", str(tmp_path / f"{name}.safetensors"), "--against", str(source), "--select", "model")
        assert res.returncode == 0 and "identical" in res.stdout, res.stdout + res.stderr
    res = _cli("convert", f"{src}.legacy", str(tmp_path / "l.safetensors"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "(--select model" in res.stderr and "__main__.AttrDict" in res.stderr, res.stderr
    assert not marker.exists()


def test_a_dict_subclass_holding_the_part_and_a_blocked_module_are_refused_by_name(saved, tmp_path):
    src, marker, _ = saved
    with pytest.raises(UnsafePickleError, match="the part 'model' holds objects of __main__.AttrDict"):
        fsdp_restore.convert(f"{src}.inside", tmp_path / "o.safetensors", select="model")
    res = _cli("verify", str(tmp_path / "o.safetensors"), "--against", f"{src}.inside", "--select", "model")
    assert res.returncode != 0  # (nothing to verify: the part is refused there too)
    with pytest.raises(UnsafePickleError) as e:
        fsdp_restore.convert(f"{src}.blocked", tmp_path / "o.safetensors", select="model")
    text = str(e.value)
    assert "posix.system" in text and "--select cannot leave them unloaded in this file" in text, text
    assert "\x1b[" not in text and "blocked" in text
    assert not (tmp_path / "o.safetensors").exists() and not marker.exists()


def test_inspect_shows_a_torch_save_file_with_what_was_not_loaded(saved):
    """inspect of a .pt (no converted sibling): the tree as torch's weights-only unpickler builds it, each refused
    global a stand-in named where it stands, and nothing of the pickle run: what to --select."""
    import json

    src, marker, oracle = saved
    for source in (src, f"{src}.legacy"):
        res = _cli("inspect", str(source), "--json")
        assert res.returncode == 0, res.stderr
        info = json.loads(res.stdout)
        parts = {c["name"]: c for c in info["tree"]["children"]}
        assert parts["model"]["tensors"] == len(oracle)
        assert parts["model"]["bytes"] == sum(t.numel() * t.element_size() for t in oracle.values())
        assert {c["name"]: c["shape"] for c in parts["model"]["children"]} == {k: list(v.shape) for k, v in
                                                                             oracle.items()}
        assert parts["config"] == {"name": "config", "kind": "__main__.Cfg", "value": "not loaded", "bytes": 0,
                                   "tensors": 0}
        assert parts["hparams"]["kind"] == "__main__.AttrDict (not loaded: its items)" and parts["epoch"]["value"] == 3
        assert "omegaconf.dictconfig.DictConfig" in info["not_loaded"]
    res = _cli("inspect", str(src))
    assert res.returncode == 0 and "config __main__.Cfg = not loaded" in res.stdout, res.stdout
    assert "--select a part that holds none of them" in " ".join(res.stdout.split())
    assert not marker.exists()
