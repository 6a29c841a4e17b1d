"""`verify --against` is an oracle that shares no code with convert: it loads the source with torch.load and
compares it with `fsdp_restore.load(dst)` node by node. Each checkpoint below is written *by hand* (with
`fsdp_restore.save` or safetensors' own writer) to differ from its source in one way that convert's own
loader and flattener could not see; verify must name it."""

import zipfile

import numpy as np
import pytest
import torch

import fsdp_restore
from fsdp_restore.convert import save
from fsdp_restore.verify import verify


def _problems(tmp_path, source, stored, **kw):
    torch.save(source, tmp_path / "src.pt")
    save(stored, tmp_path / "out.safetensors")
    report = verify(tmp_path / "out.safetensors", against=tmp_path / "src.pt", **kw)
    return report, dict(report.problems)


def deflated_copy(src, dst):
    """A torch.save zip with every member DEFLATE-compressed: torch.load reads it (its mmap path does not)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)


def test_garbage_from_a_deflated_source_is_not_identical(tmp_path):
    torch.save({"w": torch.arange(10.0)}, tmp_path / "plain.pt")  # compressed, still long enough to map
    deflated_copy(tmp_path / "plain.pt", tmp_path / "src.pt")
    garbage = torch.load(tmp_path / "src.pt", mmap=True)  # raw compressed bytes taken as tensor data
    assert not torch.equal(garbage["w"], torch.arange(10.0))
    save(garbage, tmp_path / "out.safetensors")
    report = verify(tmp_path / "out.safetensors", against=tmp_path / "src.pt")
    assert not report.ok and "differ" in dict(report.problems)["w"]
    save({"w": torch.arange(10.0)}, tmp_path / "good.safetensors")
    assert verify(tmp_path / "good.safetensors", against=tmp_path / "src.pt").ok


def test_a_lost_conj_bit_is_named(tmp_path):
    c = torch.randn(4, dtype=torch.complex64)
    report, _ = _problems(tmp_path, {"c": c, "cc": c.conj()}, {"c": c, "cc": c.conj().resolve_conj()})
    assert ("cc", "conj bit False but the source has True") in report.problems


def test_a_lost_neg_bit_is_named(tmp_path):
    x = torch.randn(4)
    report, problems = _problems(tmp_path, {"n": torch._neg_view(x)}, {"n": torch._neg_view(x).resolve_neg()})
    assert not report.ok and "neg" in problems["n"]


def test_zero_dim_ndarray_shape_is_compared(tmp_path):
    report, problems = _problems(tmp_path, {"a": np.array(2.5)}, {"a": np.array([2.5])})
    assert not report.ok and "shape" in problems["a"]


def test_key_order_and_container_types_are_compared(tmp_path):
    t = torch.ones(2)
    report, problems = _problems(tmp_path, {"a": t, "b": (1, 2), "c": 1.0}, {"b": [1, 2], "a": t, "c": 1})
    assert not report.ok
    assert "order" in problems["<root>"] and "tuple" in problems["b"] and "float" in problems["c"]


def test_nan_payload_and_negative_zero_compare_bit_for_bit(tmp_path):
    src = torch.tensor([float("nan"), -0.0, 1.0])
    stored = src.clone()
    stored.view(torch.int32)[0] += 1  # another NaN payload: equal as a NaN, not as bits
    stored[1] = 0.0
    report, problems = _problems(tmp_path, {"x": src, "f": -0.0}, {"x": stored, "f": 0.0})
    assert not report.ok and "2 elements" in problems["x"] and "first at index [0]" in problems["x"]
    assert "f" in problems
    same, _ = _problems(tmp_path, {"x": src, "f": float("nan")}, {"x": src.clone(), "f": float("nan")})
    assert same.verdict == "identical", same.problems


@pytest.mark.parametrize("case", ["tied_in_source", "tied_in_checkpoint"])
def test_storage_sharing_is_compared_both_ways(tmp_path, case):
    w = torch.randn(3, 3)
    tied, untied = {"a": w, "b": w}, {"a": w, "b": w.clone()}
    source, stored = (tied, untied) if case == "tied_in_source" else (untied, tied)
    report, problems = _problems(tmp_path, source, stored)
    assert not report.ok and "storage" in problems["b"], report.problems


def test_views_keep_their_offset(tmp_path):
    x = torch.zeros(8)
    report, problems = _problems(tmp_path, {"x": x, "v": x[4:]}, {"x": x, "v": x[2:6]})
    assert not report.ok and "storage" in problems["v"]
    same, _ = _problems(tmp_path, {"x": x, "v": x[4:]}, {"x": x, "v": x[4:]})
    assert same.ok, same.problems


def test_parameters_and_requires_grad_are_compared(tmp_path):
    p = torch.nn.Parameter(torch.ones(2))
    report, problems = _problems(tmp_path, {"p": p, "g": torch.ones(2).requires_grad_()},
                                 {"p": p.detach(), "g": torch.ones(2)})
    assert not report.ok and "Parameter" in problems["p"] and "requires_grad" in problems["g"]


def test_one_name_of_a_tied_pair_is_missing_not_identical(tmp_path):
    """Issue 20 item 5: safetensors' save_model (HF save_pretrained) stores one name of a tied pair and records
    the other in its metadata; `load` returns one name, so against a source holding both it is not identical."""
    from helpers import tiny_gpt2
    from safetensors.torch import save_model

    model = tiny_gpt2()
    torch.save(model.state_dict(), tmp_path / "src.pt")
    save_model(model, str(tmp_path / "m.safetensors"))
    report = verify(tmp_path / "m.safetensors", against=tmp_path / "src.pt")
    problems = dict(report.problems)
    (dropped, why), = problems.items()  # save_model picks which name of the pair it keeps
    assert not report.ok and dropped in ("lm_head.weight", "transformer.wte.weight"), report.problems
    assert "missing from the checkpoint" in why and "alias" in why


def test_an_unreadable_source_is_one_problem(tmp_path):
    torch.save({"x": torch.ones(2)}, tmp_path / "p4.pt", pickle_protocol=4)
    save({"x": torch.ones(2)}, tmp_path / "out.safetensors")
    report = verify(tmp_path / "out.safetensors", against=tmp_path / "p4.pt")
    assert not report.ok and "--trust-pickle" in report.problems[0][1]
    assert verify(tmp_path / "out.safetensors", against=tmp_path / "p4.pt", trust_pickle=True).ok
