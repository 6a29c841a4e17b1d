"""A conversion on several ranks (`convert(..., process_group=...)`, share.py): the one output file is byte for
byte what one process writes, each rank writes only its share of the blocks, and a failure on any rank is the
same `ConvertError` on every rank with nothing left behind."""

from __future__ import annotations

import os
import re

import pytest
import torch
from dist import run_ranks

import fsdp_restore
from fsdp_restore import ConvertError

BLOCK = 64 * 1024  # the writer's block, made small so that a small file has many blocks for the ranks to share


def _source(path: str) -> None:
    g = torch.Generator().manual_seed(0)
    torch.save({"model": {f"layer{i}.weight": torch.randn(97 + i, 61, generator=g) for i in range(12)},
                "optim": {"state": {0: {"exp_avg": torch.randn(300, 41, generator=g), "step": torch.tensor(7.0)}}},
                "step": 7, "note": "several ranks"}, path)


def _convert_on_ranks(rank: int, world_size: int, src: str, dst: str, shard: int | None) -> dict:
    import torch.distributed as dist

    import fsdp_restore.write as write

    write.BLOCK_BYTES = BLOCK
    written = [0]

    def progress(done: int, total: int) -> None:
        written[0] = max(written[0], done)

    report = fsdp_restore.convert(src, dst, process_group=dist.group.WORLD, max_shard_size=shard, force=True,
                                  progress=progress)
    return {"written": written[0], "nbytes": report.nbytes, "checksums": report.checksums}


def _files(path):
    return sorted(p for p in path.iterdir()) if path.is_dir() else [path]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shard", [None, 40_000], ids=["file", "sharded"])
def test_the_ranks_write_one_file_byte_for_byte_as_one_process_does(tmp_path, monkeypatch, world_size, shard):
    src, dst, ref = tmp_path / "src.pt", tmp_path / "out", tmp_path / "ref"
    _source(str(src))
    results = run_ranks(_convert_on_ranks, world_size, str(src), str(dst), shard)
    import fsdp_restore.write as write

    monkeypatch.setattr(write, "BLOCK_BYTES", BLOCK)
    single = fsdp_restore.convert(src, ref, max_shard_size=shard)
    assert all(r["checksums"] == single.checksums for r in results)  # every rank reports the joined checksums
    total = sum(r["written"] for r in results)
    assert total == single.nbytes and all(r["nbytes"] == single.nbytes for r in results)
    share = single.nbytes / world_size
    assert all(abs(r["written"] - share) <= 2 * BLOCK for r in results), [r["written"] for r in results]
    if shard is None:  # one file: the same bytes (the header included: same source, same metadata)
        assert dst.read_bytes() == ref.read_bytes()
    else:  # the same shards (each set has its own id, so their headers differ there)
        assert [p.name for p in _files(dst)] == [p.name for p in _files(ref)] and len(_files(dst)) > 2
    assert fsdp_restore.verify(dst, against=src).ok  # torch.load's oracle, every checksum
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref", "src.pt"]  # no temporaries


def _fail_on_rank_1(rank: int, world_size: int, src: str, dst: str) -> str:
    import torch.distributed as dist

    import fsdp_restore.write as write

    write.BLOCK_BYTES = BLOCK
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError(5, "Input/output error (injected)")

        write.pread_exactly = write.preadv_exactly = broken  # this rank cannot read its blocks' source bytes
    with pytest.raises(ConvertError) as info:
        fsdp_restore.convert(src, dst, process_group=dist.group.WORLD)
    return str(info.value)


def test_a_failure_on_one_rank_is_the_same_error_everywhere_and_leaves_nothing(tmp_path):
    src, dst = tmp_path / "src.pt", tmp_path / "out.safetensors"
    _source(str(src))
    texts = run_ranks(_fail_on_rank_1, 3, str(src), str(dst))
    assert len(set(texts)) == 1, texts
    assert "convert (write) failed on rank(s) 1 of 3" in texts[0] and "injected" in texts[0], texts[0]
    assert sorted(os.listdir(tmp_path)) == ["src.pt"]  # no destination, no temporary


def _different_sources(rank: int, world_size: int, srcs: list[str], dst: str) -> str:
    import torch.distributed as dist

    with pytest.raises(ConvertError) as info:
        fsdp_restore.convert(srcs[rank], dst, process_group=dist.group.WORLD)
    return str(info.value)


def test_ranks_that_read_different_sources_are_refused(tmp_path):
    srcs = [str(tmp_path / f"src{r}.pt") for r in range(2)]
    torch.save({"w": torch.ones(10)}, srcs[0])
    torch.save({"w": torch.ones(11)}, srcs[1])
    texts = run_ranks(_different_sources, 2, srcs, str(tmp_path / "out.safetensors"))
    assert texts[0] == texts[1] and "read different sources" in texts[0], texts
    assert sorted(os.listdir(tmp_path)) == ["src0.pt", "src1.pt"]


def test_a_process_group_needs_torch_distributed(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    with pytest.raises(TypeError, match="ProcessGroup"):
        fsdp_restore.convert(tmp_path / "a.pt", tmp_path / "a.safetensors", process_group="world")
    assert not (tmp_path / "a.safetensors").exists()


@pytest.mark.slow  # whole torchrun processes: 9-12 s on 2 cores (the API's shared conversion is in the default suite)
def test_the_command_under_torchrun_converts_on_every_rank(tmp_path):
    import socket
    import subprocess
    import sys

    def torchrun(*args: str) -> subprocess.CompletedProcess:
        with socket.socket() as s:  # a free port for the rendezvous (torchrun's port 0 waits forever)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", str(port), "-m", "fsdp_restore", *args], capture_output=True,
                              text=True, timeout=180)

    src, dst = tmp_path / "src.pt", tmp_path / "out.safetensors"
    _source(str(src))
    res = torchrun("convert", str(src), str(dst), "--ranks")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("converted ") == 1  # rank 0 reports
    # torch imported for the ranks' group, before the conversion: in the imports row, not taken from its seconds
    # (a 350 KB file: anything faster than GB/s would be seconds taken down to nothing)
    imported = re.search(r"importing libraries \(torch\.\.\.\), not in seconds\s*│\s*([0-9.]+) s", res.stdout)
    rate = re.search(r"throughput\s*│\s*[0-9.]+ (\w+)/s", res.stdout)
    assert imported and float(imported.group(1)) >= 0.3 and rate and rate.group(1) in ("B", "KB", "MB"), res.stdout
    assert fsdp_restore.verify(dst, against=src).ok
    bad = torchrun("convert", str(src), str(dst), "--ranks")
    assert bad.returncode != 0 and bad.stderr.count("error: convert (read the source) failed on rank(s) 0, 1 of 2:"
                                                    " FileExistsError") == 2, bad.stderr[-3000:]  # every rank, no hang


def _convert_dir_on_ranks(rank: int, world_size: int, src: str, dst: str) -> dict:
    import torch.distributed as dist

    import fsdp_restore.write as write

    write.BLOCK_BYTES = BLOCK
    return fsdp_restore.convert(src, dst, process_group=dist.group.WORLD).checksums


def test_a_sharded_source_too(tmp_path, monkeypatch):
    """A DCP directory in: each rank assembles only its blocks' tensors from the source's pieces."""
    import torch.distributed.checkpoint as dcp

    import fsdp_restore.write as write

    g = torch.Generator().manual_seed(1)
    dcp.save({"model": {f"w{i}": torch.randn(211, 53, generator=g) for i in range(8)}, "step": 3},
             checkpoint_id=tmp_path / "dcp")
    sums = run_ranks(_convert_dir_on_ranks, 2, str(tmp_path / "dcp"), str(tmp_path / "out.safetensors"))
    monkeypatch.setattr(write, "BLOCK_BYTES", BLOCK)
    single = fsdp_restore.convert(tmp_path / "dcp", tmp_path / "ref.safetensors")
    assert sums[0] == sums[1] == single.checksums
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert fsdp_restore.verify(tmp_path / "out.safetensors", against=tmp_path / "dcp").ok



def test_ranks_is_opt_in(tmp_path):
    """A command that inherits a torchrun rank's environment (a subprocess of a training job) converts in one
    process unless --ranks is given; --ranks outside torchrun is a usage error."""
    import subprocess
    import sys

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(3)}, src)
    env = dict(os.environ, WORLD_SIZE="4", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    res = subprocess.run([sys.executable, "-m", "fsdp_restore", "convert", str(src), str(tmp_path / "a.safetensors")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and fsdp_restore.verify(tmp_path / "a.safetensors", against=src).ok, res.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    res = subprocess.run([sys.executable, "-m", "fsdp_restore", "convert", str(src), str(tmp_path / "b.safetensors"),
                          "--ranks"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--ranks: run under torchrun" in res.stderr, res.stderr
    assert not (tmp_path / "b.safetensors").exists()


def _two_directories(rank: int, world_size: int, srcs: list[str], dst: str) -> str:
    import torch.distributed as dist

    with pytest.raises(ConvertError) as info:
        fsdp_restore.convert(srcs[rank], dst, process_group=dist.group.WORLD)
    return str(info.value)


def test_ranks_that_read_different_directories_of_the_same_shapes_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    srcs = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        dcp.save({"w": torch.randn(64, 64, generator=g)}, checkpoint_id=tmp_path / f"dcp{seed}")
        srcs.append(str(tmp_path / f"dcp{seed}"))
    texts = run_ranks(_two_directories, 2, srcs, str(tmp_path / "out.safetensors"))
    assert texts[0] == texts[1] and "read different sources" in texts[0], texts
    assert not (tmp_path / "out.safetensors").exists()


def _different_options(rank: int, world_size: int, src: str, dst: str) -> str:
    import torch.distributed as dist

    with pytest.raises(ConvertError) as info:
        fsdp_restore.convert(src, dst, process_group=dist.group.WORLD, dtype="bf16" if rank else None)
    return str(info.value)


def test_ranks_given_different_options_are_refused(tmp_path):
    src = tmp_path / "src.pt"
    _source(str(src))
    texts = run_ranks(_different_options, 2, str(src), str(tmp_path / "out.safetensors"))
    assert texts[0] == texts[1] and "laid the output out differently" in texts[0], texts
    assert sorted(os.listdir(tmp_path)) == ["src.pt"]


def _bad_argument_on_rank_1(rank: int, world_size: int, src: str, dst: str, bad: dict) -> str:
    import torch.distributed as dist

    with pytest.raises(ConvertError) as info:
        fsdp_restore.convert(src, dst, process_group=dist.group.WORLD, **(bad if rank else {}))
    return str(info.value)


@pytest.mark.parametrize("bad,expected", [({"thread_count": 0}, "thread_count must be a positive int, not 0"),
                                          ({"max_shard_size": "lots"}, "cannot parse size 'lots'")],
                         ids=["thread_count", "max_shard_size"])
def test_a_bad_argument_on_one_rank_is_the_same_error_everywhere(tmp_path, bad, expected):
    """Rank 1 raised its ValueError at the door (or, for a size, once it had read the source) and left; rank 0
    waited for it in the next exchange until the process group's timeout."""
    src = tmp_path / "src.pt"
    _source(str(src))
    texts = run_ranks(_bad_argument_on_rank_1, 2, str(src), str(tmp_path / "out.safetensors"), bad, pg_timeout=60)
    assert texts[0] == texts[1] and "(check the arguments) failed on rank(s) 1 of 2" in texts[0], texts
    assert expected in texts[0], texts
    assert sorted(os.listdir(tmp_path)) == ["src.pt"]


def _cannot_map_on_rank_1(rank: int, world_size: int, src: str, dst: str) -> str:
    import importlib

    import torch.distributed as dist

    if rank == 1:
        def refuse(path):
            raise OSError(24, "Too many open files (injected)")

        importlib.import_module("fsdp_restore.mapped").MappedFile = refuse
    with pytest.raises(ConvertError) as info:
        fsdp_restore.convert(src, dst, process_group=dist.group.WORLD)
    return str(info.value)


def test_a_failure_while_opening_the_source_for_reading_is_the_same_error_everywhere(tmp_path):
    src = tmp_path / "src.pt"
    _source(str(src))
    texts = run_ranks(_cannot_map_on_rank_1, 2, str(src), str(tmp_path / "out.safetensors"), pg_timeout=60)
    assert texts[0] == texts[1] and "read the source) failed on rank(s) 1 of 2" in texts[0], texts
    assert sorted(os.listdir(tmp_path)) == ["src.pt"]


def _own_destination(rank: int, world_size: int, src: str, dsts: list[str]) -> str:
    import torch.distributed as dist

    with pytest.raises(ConvertError) as info:
        fsdp_restore.convert(src, dsts[rank], process_group=dist.group.WORLD)
    return str(info.value)


def test_ranks_given_different_destinations_are_refused(tmp_path):
    """Rank 1's destination was never written (its blocks went into rank 0's file) and it reported success."""
    src = tmp_path / "src.pt"
    _source(str(src))
    dsts = [str(tmp_path / "out.safetensors"), str(tmp_path / "out.safetensors.rank1")]
    texts = run_ranks(_own_destination, 2, str(src), dsts)
    assert texts[0] == texts[1] and "different destinations" in texts[0], texts
    assert sorted(os.listdir(tmp_path)) == ["src.pt"]


def _dies_at(rank: int, world_size: int, src: str, dst: str, when: str) -> None:
    """Rank 1 dies (no exception, no goodbye) between two steps: before the checksums are gathered, or once
    rank 0 has renamed the output into place; rank 0 writes what it raised to a file (the run fails on rank 1)."""
    import time

    import torch.distributed as dist

    import fsdp_restore.share as share
    import fsdp_restore.write as write

    write.BLOCK_BYTES = BLOCK
    if rank == 1:
        real_gather = share.Share.gather

        def dies(self, value, what="exchange"):
            if what == "checksums" and when == "checksums":
                os._exit(3)
            if what == "commit" and when == "renamed":
                while not os.path.exists(dst):  # rank 0 renames, then agrees
                    time.sleep(0.01)
                os._exit(3)
            return real_gather(self, value, what)

        share.Share.gather = dies
    try:
        fsdp_restore.convert(src, dst, process_group=dist.group.WORLD)
        text = "no error"
    except Exception as e:  # noqa: BLE001 - what it raised, whatever it is, is the point
        text = f"{type(e).__name__}: {e}"
    with open(f"{dst}.rank{rank}.txt", "w") as f:
        f.write(text)


@pytest.mark.parametrize("when", ["checksums", "renamed"])
def test_a_rank_dying_between_steps_is_a_convert_error_saying_where_the_output_is(tmp_path, when):
    """Every exchange outside a step fails as the step's do (torch's RuntimeError about sockets came out); a
    rank that dies once the output is in place is not reported as 'nothing was put at the destination'."""
    src, dst = tmp_path / "src.pt", tmp_path / "out.safetensors"
    _source(str(src))
    with pytest.raises(AssertionError, match="died with exit code 3"):
        run_ranks(_dies_at, 2, str(src), str(dst), when, pg_timeout=10, timeout=90)
    text = (tmp_path / "out.safetensors.rank0.txt").read_text()
    assert text.startswith("ConvertError: convert (") and "a rank died or lost its connection" in text, text
    if when == "checksums":
        assert "nothing was put at the destination" in text and not dst.exists()
    else:
        assert "the output is in place and whole" in text and fsdp_restore.verify(dst, against=src).ok
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def _overflowing_casts(rank: int, world_size: int, src: str, dst: str) -> str:
    import torch.distributed as dist

    import fsdp_restore.write as write

    write.BLOCK_BYTES = 8192  # 'a' and 'b' in blocks of different ranks
    with pytest.raises(ConvertError) as info:
        fsdp_restore.convert(src, dst, process_group=dist.group.WORLD, dtype="fp16")
    return str(info.value)


def test_casts_that_overflow_on_several_ranks_are_all_named_on_every_rank(tmp_path):
    """Each rank knows only the blocks it wrote: the error named the first failing rank's tensors only, and
    following its cast_exclude advice failed again on the next. The same for whole numbers the cast rounds, where
    a tensor is judged whole (c) or not (d: one value of it, in another rank's block, is not whole)."""
    a, b, c = torch.zeros(4096), torch.zeros(4096), torch.zeros(8192)
    a[0], b[100] = 1e6, -1e6
    c[4096:] = torch.arange(3001.0, 3001.0 + 4096)  # fp16 rounds odd whole numbers past 2048
    d = c.clone()
    d[0] = 0.5
    torch.save({"a": a, "b": b, "c": c, "d": d}, tmp_path / "x.pt")
    texts = run_ranks(_overflowing_casts, 2, str(tmp_path / "x.pt"), str(tmp_path / "out.safetensors"))
    assert texts[0] == texts[1] and "a (1 values), b (1 values)" in texts[0] and "['a', 'b', 'c']" in texts[0], texts
    assert "c (whole numbers, by up to 2)" in texts[0] and "d (" not in texts[0], texts[0]
    assert sorted(os.listdir(tmp_path)) == ["x.pt"]
