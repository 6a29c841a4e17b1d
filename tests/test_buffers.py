"""Non-persistent buffers: no checkpoint holds them, so the restore checks them and a helper rebuilds them."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from models import build, converted, wrap

import fsdp_restore
from fsdp_restore import RestoreError, init_non_persistent_buffers
from fsdp_restore.buffers import buffer_problems


def test_init_rebuilds_rotary_buffers_of_a_meta_built_llama():
    reference = build("llama", seed=0)
    model = build("llama", device="meta").to_empty(device="cpu")
    model.model.rotary_emb.inv_freq.fill_(-3.6e17)  # what uninitialised memory looked like in the bug report
    assert "model.rotary_emb.inv_freq differs from its module's own initialisation" in buffer_problems(model)[0]
    assert init_non_persistent_buffers(model) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert buffer_problems(model)[0] == []


class WithTable(torch.nn.Module):
    """A custom non-persistent buffer, rebuilt by reset_buffers()."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(8.0), persistent=False)

    def reset_buffers(self):
        self.table.copy_(torch.arange(8.0))


def test_reset_buffers_hook_is_used():
    model = WithTable()
    model.table.fill_(float("nan"))
    assert buffer_problems(model)[0] == ["table holds NaN or inf"]
    assert init_non_persistent_buffers(model) == ["table"]
    assert torch.equal(model.table, torch.arange(8.0)) and buffer_problems(model)[0] == []


class WithMask(WithTable):
    """Beside a module that rebuilds its buffer, one whose initialisation nothing says."""

    def __init__(self):
        super().__init__()
        self.masked = torch.nn.Module()
        self.masked.register_buffer("mask", torch.ones(300_000), persistent=False)


def test_init_names_the_buffers_it_cannot_rebuild():
    """Leftover memory in a buffer of unknown initialisation, finite and the same on every rank (zeros from a fresh
    allocation, or any value at one rank), passes the check: init_non_persistent_buffers said nothing of it."""
    with torch.device("meta"):
        model = WithMask()
    model.to_empty(device="cpu")
    model.masked.mask.zero_()  # (what a fresh allocation of this size held in the report)
    with pytest.warns(UserWarning, match=r"no initialisation known for the non-persistent buffer\(s\) masked.mask, .*"
                                         r"reset_buffers\(\)") as caught:
        assert init_non_persistent_buffers(model) == ["table"]
    assert len(caught) == 1 and "table" not in str(caught[0].message)
    assert buffer_problems(model)[0] == []  # what the check cannot see, which the warning says


def _differing_buffer(rank, world_size, path, check_buffers):
    model = wrap(build("mlp", seed=3), "fsdp2", world_size)
    if rank == 1:
        model.scratch.fill_(7.0)  # replicated state that is not the same on every rank
    try:
        fsdp_restore.restore_model(model, path, check_buffers=check_buffers)
    except RestoreError as e:
        return str(e)
    return "ok"


@pytest.fixture(scope="module")
def mlp_ckpt(tmp_path_factory):
    return converted(tmp_path_factory.mktemp("buffers"), "mlp")


def test_buffer_differing_between_ranks_fails_every_rank(mlp_ckpt):
    messages = run_ranks(_differing_buffer, 3, mlp_ckpt, True)
    assert len(set(messages)) == 1 and "scratch differs between ranks" in messages[0]
    assert "init_non_persistent_buffers" in messages[0]  # the fix is in the message
    assert run_ranks(_differing_buffer, 3, mlp_ckpt, False) == ["ok"] * 3  # when they are meant to differ


# ---- a model cast with model.to(torch.bfloat16): the rotary buffers are bf16 ----------------------------


def _bf16_llama(seed: int = 0, device: str | None = None) -> torch.nn.Module:
    """The tiny Llama cast as users cast it: every floating tensor, rotary ``inv_freq`` included, in bf16."""
    return build("llama", seed=seed, device=device).to(torch.bfloat16)


def test_bf16_cast_rotary_buffers_are_not_problems():
    model = _bf16_llama()
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16  # what model.to() did
    assert buffer_problems(model)[0] == []


def test_init_rebuilds_bf16_rotary_buffers_in_their_dtype():
    reference = _bf16_llama()
    model = _bf16_llama(device="meta").to_empty(device="cpu")
    model.model.rotary_emb.inv_freq.fill_(-3.6e17)
    assert buffer_problems(model)[0]  # uninitialised memory is still found in bf16
    init_non_persistent_buffers(model)
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.bfloat16 and torch.equal(inv_freq, reference.model.rotary_emb.inv_freq)
    assert model.model.rotary_emb.original_inv_freq.dtype == torch.bfloat16
    assert buffer_problems(model)[0] == []


def _restore_bf16_llama(rank, world_size, path):
    model = wrap(_bf16_llama(seed=1234), "fsdp2", world_size)
    fsdp_restore.restore_model(model, path)
    expected = fsdp_restore.load(path)["model"]
    got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return all(torch.equal(got[k], t) for k, t in expected.items()) and set(got) == set(expected)


def test_bf16_cast_llama_restores_on_real_ranks(tmp_path):
    torch.save({"model": _bf16_llama(seed=0).state_dict()}, tmp_path / "bf16.pt")
    fsdp_restore.convert(tmp_path / "bf16.pt", tmp_path / "bf16.safetensors")
    assert run_ranks(_restore_bf16_llama, 2, tmp_path / "bf16.safetensors", timeout=120) == [True, True]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz])
def test_a_float8_buffer_is_screened_too(dtype):
    """torch has no isfinite for most float8 dtypes: a float8 model's buffers failed the screen itself
    (NotImplementedError), so every checked restore into such a model failed."""
    model = WithTable().to(dtype)
    assert buffer_problems(model)[0] == []
    model.table[3] = float("nan")
    assert buffer_problems(model)[0] == ["table holds NaN or inf"]
