"""Layouts: what each rank holds, described compactly, restored exactly under every parallelism.

The oracle is the source model itself (built again from its seed), gathered back with DTensor's own
``full_tensor()``: neither shares the plan's layout arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from dist import GLOO, GPU, NCCL, cases, run_ranks, slow
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdp_restore
from fsdp_restore import RestoreError, restore, restore_model
from fsdp_restore.shards import block_rows


@st.composite
def blocks(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    offset = tuple(draw(st.integers(0, n - 1)) for n in shape)
    local = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offset))
    return shape, local, offset


@settings(max_examples=300, deadline=None)
@given(blocks())
def test_block_rows_are_exactly_the_blocks_elements(block):
    shape, local, offset = block
    expected = torch.arange(torch.Size(shape).numel()).view(shape)[
        tuple(slice(o, o + n) for o, n in zip(offset, local))].reshape(-1).tolist()
    row_blocks, run = block_rows(shape, local, offset)
    got = [b.start + i * b.stride + j for b in row_blocks for i in range(b.rows) for j in range(run)]
    assert got == expected
    # compact: one block per index of the dims before the second-to-last partial dim, never one per row
    partial = [d for d in range(len(shape)) if local[d] != shape[d]]
    assert len(row_blocks) <= max(1, torch.Size(local[:partial[-2]] if len(partial) > 1 else ()).numel())


# ---- tensor parallel, 2-D meshes, offload: real ranks ------------------------------------------------


def _restore_parallel(rank, world_size, path, how):
    from models import _full_tensor, build, wrap

    model = wrap(build("llama", seed=1234), how, world_size)
    placements = {type(p).__name__ for param in model.parameters() for p in getattr(param, "placements", ())}
    report = restore_model(model, path)
    source = build("llama", seed=0, device="cpu").state_dict()  # the checkpoint's model, rebuilt: the oracle
    for name, param in model.state_dict().items():  # gathered by DTensor itself
        assert torch.equal(_full_tensor(param), source[name]), f"{name} differs after restore"
    return {"bytes": report.bytes_read, "placements": placements}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from models import converted

    return converted(tmp_path_factory.mktemp("layouts"), "llama")


# (FSDP2 + TP at 4 ranks, 10-12 s: in the slow suite; the optimizer's test below restores that layout by default)
@pytest.mark.parametrize("how,world_size,backend", cases(2, "tp") + cases(3, "tp", only=GLOO)
                         + slow(cases(4, "fsdp2+tp", only=GLOO)) + cases(4, "fsdp2+tp", only=GPU))
def test_tensor_parallel_restores_exactly(llama, how, world_size, backend):
    results = run_ranks(_restore_parallel, world_size, llama, how, backend=backend)
    placements = set().union(*(r["placements"] for r in results))
    assert {"Shard", "Replicate"} <= placements, placements  # Shard(0), Shard(1) and Replicate were all there
    if how == "fsdp2+tp":
        assert "_StridedShard" in placements, placements  # FSDP2 over a TP Shard(0): the strided layout
    from models import build

    state = build("llama").state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    # Replicate parameters (norms, not parallelized ones) are read by every TP rank; everything else once
    replicated = sum(t.numel() * t.element_size() for n, t in state.items() if "norm" in n or "rotary" in n)
    tp = world_size if how == "tp" else world_size // 2
    assert sum(r["bytes"] for r in results) <= (world_size // tp) * (total + (tp - 1) * replicated)


def _restore_partial(rank, world_size, path):
    from models import build
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    import models

    model = build("mlp", seed=3)
    mesh = init_device_mesh(models.DEVICE.type, (world_size,))
    # a pending sum: each rank holds an addend, and no file value can be split into addends exactly
    local = model.blocks[0].weight.detach() / world_size
    model.blocks[0].weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Partial()], run_check=False))
    with pytest.raises(RestoreError) as info:
        restore_model(model, path)
    return str(info.value)


def test_partial_placement_is_refused_naming_the_parameter(tmp_path):
    from models import converted

    path = converted(tmp_path, "mlp")
    messages = run_ranks(_restore_partial, 2, path)
    assert messages[0] == messages[1]
    assert "blocks.0.weight" in messages[0] and "Partial" in messages[0], messages[0]
    print(messages[0])


def _restore_after_data_swap(rank, world_size, root):
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    # `.data =` a DTensor of another shape: the parameter's shape is (5, 3), its spec and local shard stay (4, 3)
    model.w.data = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)])
    messages = []
    for rows in (4, 5):
        path = f"{root}/w{rows}.safetensors"
        if rank == 0:
            save_file({"w": torch.ones(rows, 3)}, path)
        torch.distributed.barrier()
        with pytest.raises((RestoreError, ValueError)) as info:
            restore_model(model, path)
        messages.append(str(info.value))
    assert not model.w._local_tensor.any()  # nothing written into the stale shard
    return messages


def test_a_dtensor_whose_shape_and_spec_disagree_is_refused(tmp_path):
    """A DTensor's shape, not its spec's: read from the spec, a (4, 3) file went silently into the stale (4, 3)
    shard of a parameter whose shape is (5, 3), and the (5, 3) file was refused as a shape mismatch."""
    for messages in run_ranks(_restore_after_data_swap, 1, str(tmp_path)):
        assert all("local shard shape (4, 3) differs from the layout's (5, 3)" in m for m in messages), messages


def _restore_offloaded(rank, world_size, path, how):
    from models import build, full_state

    import models

    model = build("llama", seed=1234)
    if how == "fsdp1-offload":
        from torch.distributed.fsdp import CPUOffload
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer_type = type(model.model.layers[0])
        model = FSDP(model, cpu_offload=CPUOffload(offload_params=True), auto_wrap_policy=ModuleWrapPolicy({layer_type}),
                     device_id=models.DEVICE, use_orig_params=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh(models.DEVICE.type, (world_size,))
        policy = CPUOffloadPolicy(pin_memory=models.DEVICE.type == "cuda")  # pinning needs a GPU
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
    restore_model(model, path)
    source = build("llama", seed=0, device="cpu").state_dict()
    got = full_state(model, "fsdp1" if how.startswith("fsdp1") else "fsdp2")
    return [name for name, tensor in source.items() if not torch.equal(got[name].cpu(), tensor)]


# FSDP1 pins offloaded parameters at its lazy init, which needs a GPU; FSDP2 pins only when asked.
@pytest.mark.parametrize("how,world_size,backend", cases(2, "fsdp2-offload") + cases(1, "fsdp1-offload", only=NCCL)
                         + cases(2, "fsdp1-offload", only=NCCL))
def test_cpu_offloaded_parameters_restore_exactly(llama, how, world_size, backend):
    assert run_ranks(_restore_offloaded, world_size, llama, how, backend=backend) == [[]] * world_size


def _restore_parallel_optimizer(rank, world_size, path, how):
    from models import build, wrap

    model = wrap(build("llama", seed=1234), how, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    restore(model, path, optimizer=opt)
    # the oracle: torch's own reader of the source (written by this test: its numpy RNG state needs pickle)
    saved = torch.load(str(path).replace(".safetensors", ".pt"), weights_only=False)
    names = [n for n, _ in build("llama", seed=0).named_parameters()]
    wrong = []
    for name, param in model.named_parameters():
        state = opt.state[param]
        expected = saved["optim"]["state"][names.index(name)]
        for field in ("exp_avg", "exp_avg_sq"):
            value = state[field]
            if not torch.equal((value.full_tensor() if hasattr(value, "full_tensor") else value).cpu(), expected[field]):
                wrong.append(f"{name}.{field}")
    return wrong


@pytest.mark.parametrize("how,world_size", [("tp", 3), ("fsdp2+tp", 4)])
def test_tensor_parallel_optimizer_state_restores_exactly(tmp_path, how, world_size):
    from helpers import tiny_llama, training_checkpoint

    torch.save(training_checkpoint(tiny_llama(0)), tmp_path / "train.pt")
    fsdp_restore.convert(tmp_path / "train.pt", tmp_path / "train.safetensors")
    assert run_ranks(_restore_parallel_optimizer, world_size, tmp_path / "train.safetensors", how) == [[]] * world_size


class _WithEmpty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 12))  # (FSDP2 shards dim 1 only evenly)
        self.empty = torch.nn.Parameter(torch.randn(0, 12))


def _empty_column_shards(rank, world_size, path, out):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(1)
    model = _WithEmpty()
    fully_shard(model, shard_placement_fn=lambda p: Shard(1))
    report = restore_model(model, path)
    torch.manual_seed(0)
    source = _WithEmpty()  # the checkpoint's model, rebuilt: the oracle
    assert torch.equal(model.w.full_tensor(), source.w.detach()) and model.empty.shape == (0, 12)
    fsdp_restore.save_sharded(model, out)
    return report.tensors


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_empty_parameter_sharded_by_columns_is_restored_and_saved(tmp_path, world_size):
    """FSDP2 gives a (0, 12) parameter sharded on dim 1 a (0, 0) shard where its layout says (0, 12 / ranks): it has
    no element to read or write, and was refused ("local shard shape differs from the layout's")."""
    import safetensors.torch

    torch.manual_seed(0)
    torch.save(_WithEmpty().state_dict(), tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    tensors = run_ranks(_empty_column_shards, world_size, str(tmp_path / "m.safetensors"),
                        str(tmp_path / "out.safetensors"))
    assert tensors == [2] * world_size
    saved, loaded = safetensors.torch.load_file(tmp_path / "out.safetensors"), torch.load(tmp_path / "m.pt")
    assert set(saved) == {"w", "empty"} and torch.equal(saved["w"], loaded["w"]) and saved["empty"].shape == (0, 12)


class _Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.norm = torch.nn.BatchNorm2d(8)


def test_a_channels_last_model_is_refused_with_the_way_round_it(tmp_path):
    """A convolution's weight in channels_last memory order is not row-major: the restore and the save refuse it by
    name and layout and say what to do; doing that restores it exactly (oracle: torch.load of the source)."""
    torch.manual_seed(0)
    torch.save({"model": _Conv().state_dict()}, tmp_path / "cnn.pt")
    fsdp_restore.convert(tmp_path / "cnn.pt", tmp_path / "cnn.safetensors")
    model = _Conv().to(memory_format=torch.channels_last)
    with pytest.raises(fsdp_restore.RestoreError, match=r"conv\.weight: a param laid out with strides .*"
                       r"\(channels_last\) is not supported.*model\.to\(memory_format=torch\.channels_last\) after"):
        fsdp_restore.restore_model(model, tmp_path / "cnn.safetensors")
    with pytest.raises(fsdp_restore.FsdpRestoreError, match=r"conv\.weight: .*\(channels_last\).*contiguous_format"
                       r"\) before a save"):
        fsdp_restore.save_sharded(model, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    model = _Conv()  # the way round: restore while contiguous, then change the layout
    fsdp_restore.restore_model(model, tmp_path / "cnn.safetensors")
    model = model.to(memory_format=torch.channels_last)
    source = torch.load(tmp_path / "cnn.pt", weights_only=True)["model"]
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(t, source[k]) for k, t in model.state_dict().items())


def test_a_transposed_parameter_is_told_to_be_made_contiguous(tmp_path):
    model = torch.nn.Linear(3, 4)
    save = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    torch.save(save, tmp_path / "l.pt")
    fsdp_restore.convert(tmp_path / "l.pt", tmp_path / "l.safetensors")
    model.weight = torch.nn.Parameter(torch.randn(3, 4).t())  # (4, 3), column-major
    with pytest.raises(RestoreError, match=r"weight: a param laid out with strides \(1, 4\) is not supported.*Make it"
                       r" contiguous first") as info:
        restore_model(model, tmp_path / "l.safetensors")
    assert "channels_last" not in str(info.value)
