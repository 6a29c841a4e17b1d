"""The GPU path's resource bounds (skipped without a GPU): host memory within the pinned pool, device
memory within the model plus the pool's cast buffers, whatever the checkpoint's size."""

from __future__ import annotations

import pytest
import torch
from dist import gpu_count, run_ranks

import fsdp_restore

pytestmark = pytest.mark.skipif(gpu_count() == 0, reason="no GPU")


class Stack(torch.nn.Module):
    def __init__(self, layers: int = 24, dim: int = 2047):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(dim, dim + 1) for _ in range(layers)])  # ~400 MB


def _bounds_worker(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard

    from fsdp_restore.execute import DEFAULT_READ_THREADS, PINNED_BUFFERS_PER_THREAD, READ_CHUNK_BYTES
    from fsdp_restore.measure import PeakAnonMemory

    with torch.device("meta"):
        model = Stack()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cuda")
    fsdp_restore.restore_model(model, path)  # warm-up: CUDA context, kernels, first pinned allocations
    torch.cuda.synchronize()
    torch._C._host_emptyCache()  # the pool's pinned buffers go back: the measured restore allocates them anew
    model_bytes = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with PeakAnonMemory(interval=0.002, field="VmRSS") as host:
        report = fsdp_restore.restore_model(model, path)
    device_extra = torch.cuda.max_memory_allocated() - model_bytes
    pool = DEFAULT_READ_THREADS * PINNED_BUFFERS_PER_THREAD * READ_CHUNK_BYTES
    ones = DEFAULT_READ_THREADS * READ_CHUNK_BYTES  # each worker's 0xFF source that re-poisons its pinned buffers
    return host.peak - host.start, device_extra, pool, ones, report.bytes_read


@pytest.mark.parametrize("dtype", ["same", "bf16-file"])
def test_memory_stays_within_the_pool(tmp_path, dtype):
    torch.manual_seed(0)
    torch.save({"model": Stack().state_dict()}, tmp_path / "s.pt")
    fsdp_restore.convert(tmp_path / "s.pt", tmp_path / "s.safetensors", dtype="bf16" if dtype == "bf16-file" else None)
    host, device_extra, pool, ones, read = run_ranks(_bounds_worker, 1, tmp_path / "s.safetensors", backend="nccl")[0]
    assert host <= pool + 32 * 2**20, (host, pool)  # the pinned pool, plus thread stacks and the verdict
    # same dtype: straight from pinned memory into the parameters; a cast adds one device buffer per pinned one
    assert device_extra <= ones + (pool if dtype == "bf16-file" else 0) + 8 * 2**20, device_extra
    assert read > 100 * 2**20


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("check", [True, False])
def test_a_cast_on_the_device_beyond_the_models_range_fails_naming_every_tensor(tmp_path, dtype, check):
    """On the GPU the cast into the model's dtype is made on the device, after the upload: an fp32 value beyond
    fp16's 65504 became inf there, unscreened (the CPU path and the apply route refused it). Values the file
    holds as inf are not the cast's doing, and values in range restore."""
    from models import build

    state = build("mlp").state_dict()
    state["inp.weight"][0, 0] = 1e6
    state["out.weight"][1, 2] = -1e6
    if dtype == torch.float16:
        state["blocks.0.bias"][0] = float("inf")
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    model = build("mlp").to(device="cuda", dtype=dtype)
    with pytest.raises(fsdp_restore.RestoreError) as info:
        fsdp_restore.restore_model(model, tmp_path / "m.safetensors", check=check)
    text = str(info.value)
    assert "'model.inp.weight' (1 values), 'model.out.weight' (1 values)" in text and "bias" not in text, text
    state["inp.weight"][0, 0], state["out.weight"][1, 2] = 1.0, 2.0
    torch.save({"model": state}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors", force=True)
    fsdp_restore.restore_model(model, tmp_path / "m.safetensors", check=check)
    assert torch.equal(model.inp.weight.detach().cpu(), state["inp.weight"].to(dtype))
