"""The GPU restore's pinned staging pool (pinned.py): one registered region, made on a thread of its own, cut
into buffers that start NaN; given back whole. The restore's use of it is covered by test_gpu.py (host memory
within the pool) and the GPU fault-injection cases of test_faults.py (a read that writes nothing into a pool
buffer leaves NaN for the check)."""

from __future__ import annotations

import pytest
import torch
from dist import gpu_count

from fsdp_restore import execute
from fsdp_restore.pinned import PinnedPool


def test_no_pool_off_the_gpu():
    assert execute.pinned_pool(torch.device("cpu"), 4) is None


@pytest.mark.skipif(gpu_count() == 0, reason="no GPU")
def test_pool_buffers_are_pinned_poisoned_and_given_back():
    pool = PinnedPool.start(torch.device("cuda", 0), 3, 1 << 20)
    assert pool.take((1 << 20) + 1) is None  # larger than a slot: the caller pins its own
    taken = [pool.take(1000) for _ in range(3)]
    assert all(t is not None and t.numel() == 1 << 20 and t.is_pinned() for t in taken)
    assert all(bool((t == 0xFF).all()) for t in taken)  # NaN in every float dtype until a read fills it
    assert len({t.data_ptr() for t in taken}) == 3
    assert pool.take(1000) is None  # all taken
    dest = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    taken[0][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    dest.copy_(taken[0], non_blocking=True)
    pool.close()  # waits for the copy before the memory is unregistered
    assert dest[:5].tolist() == [1, 2, 3, 4, 0xFF]
    assert not taken[1].is_pinned()  # unregistered: the pages are ordinary memory again
    pool.close()  # twice: nothing more to give back
