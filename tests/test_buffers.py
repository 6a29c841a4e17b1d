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
