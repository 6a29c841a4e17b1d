"""The multi-rank launcher: results by rank, every failure reported, a dead rank stops the others."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_restore.launch import RankFailure, run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item()}


def _rank_dies(rank, world_size, survivors_block):
    dist.barrier()  # every rank is past its process-group setup (a death during setup fails it instead)
    if rank == 1:
        os._exit(3)  # no exception, no report: as a segfault or an OOM kill
    if survivors_block:
        time.sleep(600)  # as in an NCCL collective, which does not notice a dead peer until its timeout
    dist.barrier()  # gloo notices: the peer's socket closes
    return rank


def _rank_raises(rank, world_size):
    if rank == 2:
        raise ValueError("bad things on rank 2")
    return rank


@pytest.mark.parametrize("world_size", [1, 3])
def test_results_come_back_by_rank(world_size):
    results = run_ranks(_sum_ranks, world_size, backend="gloo")
    total = world_size * (world_size + 1) / 2
    assert results == [{"rank": r, "sum": total} for r in range(world_size)]


def test_dead_rank_stops_blocked_ranks_instead_of_waiting_for_the_timeout():
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_dies, 3, True, timeout=300, backend="gloo")
    errors = info.value.errors
    assert "died with exit code 3" in errors[1]
    for r in (0, 2):  # stopped after the grace period, not "did not finish within 300s"
        assert "stopped: rank 1 died" in errors[r], errors[r]


def test_dead_rank_seen_by_gloo_peers():
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_dies, 3, False, timeout=300, backend="gloo")
    errors = info.value.errors
    assert "died with exit code 3" in errors[1] and set(errors) == {0, 1, 2}
    assert not any("did not finish" in e for e in errors.values())


def test_raising_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_raises, 3, backend="gloo")
    assert set(info.value.errors) == {2} and "bad things on rank 2" in info.value.errors[2]


def _one_finishes_one_dies_one_blocks(rank, world_size):
    dist.barrier()
    if rank == 0:
        return "done"  # reports its result (bytes) before the others are judged
    if rank == 1:
        time.sleep(0.5)
        os._exit(4)
    time.sleep(600)


def test_finished_dead_and_running_ranks_at_once():
    """A finished rank's result is bytes: judging the dead rank must not trip over it (was a TypeError)."""
    with pytest.raises(RankFailure) as info:
        run_ranks(_one_finishes_one_dies_one_blocks, 3, timeout=300, backend="gloo")
    errors = info.value.errors
    assert set(errors) == {1, 2} and "died with exit code 4" in errors[1] and "stopped: rank 1 died" in errors[2]


@pytest.mark.parametrize("world_size", [0, -1])
def test_no_ranks_is_refused(world_size):
    """Zero ranks ran nothing and returned [] (so `check-restore --nproc 0` said "passed")."""
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_sum_ranks, world_size, backend="gloo")
