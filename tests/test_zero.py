"""DeepSpeed ZeRO checkpoints in: consolidated bit for bit against DeepSpeed's own view, optimizer state
included, and resumed into FSDP2 as the DeepSpeed run went on (real DeepSpeed, CPU, gloo)."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from dist import run_ranks, slow
from helpers import through_torch

import fsdp_restore
from fsdp_restore import FormatError
from fsdp_restore.source_crc import describe_rest

deepspeed = pytest.importorskip("deepspeed")

COMBOS = [(stage, dtype) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]


@pytest.fixture(autouse=True)
def _convert_through_torch():
    """`convert` here reads through torch, as the oracle of the torch-free reads (called directly: `_lane`)."""
    with through_torch():
        yield


def _params(world_size):
    return [pytest.param(world_size, s, d, id=f"ws{world_size}-z{s}-{d}") for s, d in COMBOS]


@pytest.fixture(scope="module")
def zero_root(tmp_path_factory):
    return tmp_path_factory.mktemp("zero")


_made: set[int] = set()


def _checkpoint(root, world_size, stage, dtype):
    from zero_checkpoints import generate

    if world_size not in _made:  # every combination of a world size in one launch (DeepSpeed's import is slow)
        generate(root, world_size, COMBOS)
        _made.add(world_size)
    return root / f"z{stage}-{dtype}-ws{world_size}"


def _oracles(ckpt_dir, world_size):
    return [torch.load(ckpt_dir / f"oracle-rank{r}.pt") for r in range(world_size)]


@pytest.mark.parametrize("world_size,stage,dtype", _params(2) + _params(3))
def test_consolidation_equals_deepspeeds_own_state(zero_root, tmp_path, world_size, stage, dtype):
    src = _checkpoint(zero_root, world_size, stage, dtype)
    report = fsdp_restore.convert(src, tmp_path / "c.safetensors")
    assert report.peak_anon_bytes >= 0 and report.tensors > 0
    oracle = _oracles(src, world_size)[0]
    back = fsdp_restore.load(tmp_path / "c.safetensors")
    model = back["model"]
    for name, weight in oracle["weights"].items():  # the fp32 masters, bit for bit
        assert model[name].dtype == torch.float32 and torch.equal(model[name], weight), name
    for name, weight in oracle["frozen"].items():  # frozen: the module's weights (stage 1 included)
        assert torch.equal(model[name], weight), name
    assert torch.equal(model["scale"], oracle["scale"]) and "scratch" not in model  # buffers: persistent only
    assert model["head.weight"] is model["embed.weight"]  # tied: one tensor under both names
    optim = back["optim"]
    names = [n for g in optim["param_groups"] for n in g["param_names"]]
    assert set(names) == set(oracle["weights"])  # frozen parameters have no optimizer state
    for pid, name in enumerate(names):
        st = optim["state"][pid]
        assert float(st["step"]) == 2
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], oracle["optim"][name][key]), (name, key)
    assert optim["param_groups"][0]["lr"] == 1e-2 and optim["param_groups"][0]["betas"] == (0.8, 0.9)
    assert back["epoch"] == 3 and back["global_steps"] == 2  # the run's own state comes along


def _resume(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard
    from zero_checkpoints import STEPS_AFTER, STEPS_BEFORE, Net, batch, loss_of, make_optimizer

    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    model = Net()
    fully_shard(model)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    fsdp_restore.restore(model, path, optimizer=opt)
    losses = []
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        loss = loss_of(model, batch(rank, step))
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fsdp2_resume_continues_like_the_deepspeed_run(zero_root, tmp_path, stage):
    """fp32 ZeRO run -> our format -> FSDP2 on 2 ranks with AdamW: the next steps' losses are the DeepSpeed
    run's own (documented tolerance: 1e-5 relative, the order of the gradient reduction differs)."""
    src = _checkpoint(zero_root, 2, stage, "fp32")
    fsdp_restore.convert(src, tmp_path / "c.safetensors")
    losses = run_ranks(_resume, 2, tmp_path / "c.safetensors")
    for rank, oracle in enumerate(_oracles(src, 2)):
        assert losses[rank] == pytest.approx(oracle["losses"], rel=1e-5), rank


def test_select_model_is_a_plain_weights_file(zero_root, tmp_path):
    src = _checkpoint(zero_root, 2, 2, "fp32")
    fsdp_restore.convert(src, tmp_path / "m.safetensors", select="model")
    state = fsdp_restore.load(tmp_path / "m.safetensors")
    from zero_checkpoints import Net

    net = Net()
    assert set(state) == set(net.state_dict())
    net.load_state_dict(state)


def test_reads_without_deepspeed_and_a_tag_can_be_picked(zero_root, tmp_path):
    src = _checkpoint(zero_root, 2, 3, "bf16")
    script = (f"import sys; sys.modules['deepspeed'] = None; import fsdp_restore;"
              f"fsdp_restore.convert({str(src)!r}, {str(tmp_path / 'a.safetensors')!r}, tag='global_step2');"
              f"fsdp_restore.convert({str(src)!r}, {str(tmp_path / 't.safetensors')!r}, trust_pickle=True)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    with pytest.raises(FormatError, match=r"has no tag 'global_step9' \(its tags: global_step2\)"):
        fsdp_restore.convert(src, tmp_path / "b.safetensors", tag="global_step9")


def test_an_fp16_runs_loss_scaler_and_any_tag_name_convert_without_deepspeed(zero_root, tmp_path):
    """An fp16 run with dynamic loss scaling (DeepSpeed's fp16 default) saves a DynamicLossScaler object, which
    needed DeepSpeed installed (with --trust-pickle too); a tag of any name (save_checkpoint(tag="best") without
    'latest') converts with --tag, and a tag directory may be named by its own tag."""
    import shutil

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    src = _checkpoint(zero_root, 2, 2, "bf16")
    ck = tmp_path / "ck"
    shutil.copytree(src / "global_step2", ck / "best")
    for f in (ck / "best").glob("*optim_states.pt"):  # CPU DeepSpeed cannot train in fp16: its object, put in
        state = torch.load(f, weights_only=False)
        state["optimizer_state_dict"]["loss_scaler"] = DynamicLossScaler(init_scale=2**16, scale_window=1000,
                                                                         min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
        torch.save(state, f)
    out = tmp_path / "out.safetensors"
    for options in ("tag='best'", "tag='best', trust_pickle=True"):
        script = (f"import sys; sys.modules['deepspeed'] = None; import fsdp_restore;"
                  f"fsdp_restore.convert({str(ck)!r}, {str(out)!r}, {options}, force=True)")
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert res.returncode == 0, (options, res.stderr[-2000:])
    oracle = _oracles(src, 2)[0]
    back = fsdp_restore.load(out)["model"]
    assert all(torch.equal(back[name], w) for name, w in oracle["weights"].items())
    fsdp_restore.convert(ck / "best", tmp_path / "own.safetensors", tag="best")  # the tag directory itself
    with pytest.raises(FormatError, match=r"has no tag 'worst' \(its tags: best\)"):
        fsdp_restore.convert(ck, tmp_path / "x.safetensors", tag="worst")


def test_a_missing_rank_file_is_named(zero_root, tmp_path):
    import shutil

    src = _checkpoint(zero_root, 2, 2, "fp32")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    next((broken / "global_step2").glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    with pytest.raises(FormatError, match="2 ranks but 1 files"):
        fsdp_restore.convert(broken, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_a_pickle_naming_other_code_is_refused(tmp_path):
    tag = tmp_path / "ck" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ck" / "latest").write_text("global_step1")
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "hook": subprocess.Popen}},  # any callable import
               tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(fsdp_restore.UnsafePickleError, match=r"names \S*Popen, .*--trust-pickle"):
        fsdp_restore.convert(tmp_path / "ck", tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_a_runs_own_state_converts_as_from_a_pt(zero_root, tmp_path):
    """A run's client_state with numpy RNG states and an argparse Namespace (Megatron-DeepSpeed saves its args
    there): built as a .pt conversion builds them (they were refused, and --allow-global / --trust-pickle were
    ignored for directories); compared with torch.load of the file. A legacy (non-zip) file and a truncated one
    are named as what they are."""
    import argparse
    import shutil

    import numpy as np

    src = _checkpoint(zero_root, 2, 2, "fp32")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    states = ck / "global_step2" / "mp_rank_00_model_states.pt"
    head = torch.load(states, weights_only=False)
    head["args"], head["np_rng"] = argparse.Namespace(lr=0.1, seq=128), np.random.RandomState(3).get_state()
    torch.save(head, states)
    fsdp_restore.convert(ck, tmp_path / "c.safetensors")
    back = fsdp_restore.load(tmp_path / "c.safetensors")
    assert back["args"] == head["args"]
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(back["np_rng"], head["np_rng"]))
    optim_file = next((ck / "global_step2").glob("*rank_1_*optim_states.pt"))
    torch.save(torch.load(optim_file, weights_only=False), optim_file, _use_new_zipfile_serialization=False)
    with pytest.raises(FormatError, match=r"zero_pp_rank_1_.*a legacy \(non-zip\) torch.save file"):
        fsdp_restore.convert(ck, tmp_path / "t.safetensors")
    torch.save(torch.load(src / "global_step2" / optim_file.name, weights_only=False), optim_file)
    os.truncate(optim_file, optim_file.stat().st_size // 2)
    with pytest.raises(FormatError, match=r"zero_pp_rank_1_.*truncated or corrupt"):
        fsdp_restore.convert(ck, tmp_path / "t.safetensors")


def test_damage_is_caught_through_torchs_path_too(zero_root, tmp_path):
    """A ZeRO checkpoint the torch-free read declines, or converted with trust_pickle / allow_globals / on several
    ranks, goes through torch's loader, which checks no crc32: its rank files' pickles are checked before it, and
    with verify_checksums every record read again (verify_checksums was dropped there, and the damage converted
    without a word). Found by an independent review."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(_checkpoint(zero_root, 2, 2, "bf16"), src)
    tag = next(p for p in src.iterdir() if p.is_dir())
    optim = sorted(tag.glob("*optim_states.pt"))[1]
    state = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    master = state["single_partition_of_fp32_groups"][0]
    _flip(optim, _found_in(optim, master) + master.numel() * 2)
    with pytest.raises(FormatError, match=rf"{optim.name}:[^ ]*data/"):
        fsdp_restore.convert(src, tmp_path / "t.safetensors", verify_checksums=True)  # (through torch: the fixture)
    assert not (tmp_path / "t.safetensors").exists()
    report = fsdp_restore.convert(src, tmp_path / "u.safetensors")  # without: its storages not checked, and said
    assert report.source_crcs.skipped > 0 and "rank files (read through torch) not checked" in describe_rest(
        report.source_crcs)


def test_a_record_written_unchanged_is_checked_by_default(zero_root, tmp_path):
    """A record the output holds unchanged as one tensor (a buffer in the model states file) is checked from that
    tensor's checksum without --verify-checksums, as a .pt's are (it was counted among the partitions to check at
    the cost of a pass, and its damage converted silently). Found by an independent review."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(_checkpoint(zero_root, 2, 2, "bf16"), src)
    states = next(p for p in src.iterdir() if p.is_dir()) / "mp_rank_00_model_states.pt"
    scale = torch.load(states, map_location="cpu", weights_only=False)["module"]["scale"]
    clean = _lane(src, tmp_path / "clean.safetensors")
    assert clean.source_crcs.checked > 0
    _flip(states, _found_in(states, scale) + 2)
    with pytest.raises(FormatError, match=r"mp_rank_00_model_states\.pt:[^ ]*data/.*scale"):
        _lane(src, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("stage", [1, 3])
def test_verify_against_the_zero_directory(zero_root, tmp_path, stage):
    src = _checkpoint(zero_root, 2, stage, "bf16")
    fsdp_restore.convert(src, tmp_path / "c.safetensors")
    report = fsdp_restore.verify(tmp_path / "c.safetensors", against=src)
    assert report.verdict == "identical", report.problems
    whole = fsdp_restore.verify(tmp_path / "c.safetensors", against=src, select="model")  # the whole file, a subtree
    assert any("it was converted without --select. Drop --select" in m for _, m in whole.problems), whole.problems
    fsdp_restore.convert(src, tmp_path / "b.safetensors", dtype="bf16")
    assert fsdp_restore.verify(tmp_path / "b.safetensors", against=src).verdict == "identical up to the declared cast"


def test_verify_against_the_tag_that_was_converted(zero_root, tmp_path):
    """convert --tag X, then verify --against the directory --tag X: the same tag's tensors, not 'latest''s."""
    from fsdp_restore.cli import main

    src = _checkpoint(zero_root, 2, 2, "fp32")
    fsdp_restore.convert(src, tmp_path / "t.safetensors", tag="global_step2")
    assert main(["verify", str(tmp_path / "t.safetensors"), "--against", str(src), "--tag", "global_step2"]) == 0
    report = fsdp_restore.verify(tmp_path / "t.safetensors", against=src, tag="global_step9")
    assert not report.ok and "global_step9" in str(report.problems)


def test_stage_3_sub_groups_keep_their_param_groups(zero_root, tmp_path):
    """ZeRO-3 splits each param group into flat sub-groups (``sub_group_size``, 1e9 by default: every run of a
    model over ~1B parameters) with one state entry each: two decay groups split into several sub-groups come
    back as the two groups, each parameter with its own group's hyperparameters and DeepSpeed's own moments (the
    state of the later sub-groups was dropped, and the groups' hyperparameters taken by sub-group index)."""
    from zero_checkpoints import Net, decay_groups, generate, make_optimizer

    generate(zero_root, 2, [(3, "fp32")], sub_group_size=40)
    src = zero_root / "z3-fp32-ws2-sub40"
    optim_file = next((src / "global_step2").glob("*rank_0_*optim_states.pt"))
    saved = torch.load(optim_file, weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]
    assert len(saved["state"]) > len(saved["param_groups"]) == 2  # the case: more sub-groups than groups
    fsdp_restore.convert(src, tmp_path / "c.safetensors")
    oracle = _oracles(src, 2)[0]
    optim = fsdp_restore.load(tmp_path / "c.safetensors")["optim"]
    decay = {n for n, p in Net().named_parameters() if p.requires_grad and p.dim() >= 2}
    assert [g["weight_decay"] for g in optim["param_groups"]] == [0.1, 0.0]
    for g, group in enumerate(optim["param_groups"]):
        assert set(group["param_names"]) == (decay if g == 0 else set(oracle["weights"]) - decay)
    names = [n for g in optim["param_groups"] for n in g["param_names"]]
    for pid, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim["state"][pid][key], oracle["optim"][name][key]), (name, key)
    model = Net()  # and it resumes into the run's own two groups
    opt = make_optimizer(decay_groups(model))
    fsdp_restore.restore(model, tmp_path / "c.safetensors", optimizer=opt)
    by_name = dict(model.named_parameters())
    for name in names:
        assert torch.equal(opt.state[by_name[name]]["exp_avg"], oracle["optim"][name]["exp_avg"]), name


def _mixed_tag(zero_root, tmp_path, world_size, other_world_size, stage, dtype):
    """A copy of the world-size-``world_size`` tag with rank 1's optimizer file taken from another run."""
    import shutil

    src = _checkpoint(zero_root, world_size, stage, dtype)
    other = _checkpoint(zero_root, other_world_size, stage, dtype)
    mixed = tmp_path / "mixed"
    shutil.copytree(src, mixed)
    name = next((mixed / "global_step2").glob("*zero_pp_rank_1_*optim_states.pt")).name
    shutil.copy(other / "global_step2" / name, mixed / "global_step2" / name)
    return mixed


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_files_of_another_world_size_are_refused(zero_root, tmp_path, stage):
    """Rank 1's file from a 2-rank run among a 3-rank run's files: converted to wrong weights without a word,
    as every file's partition count was not read (DeepSpeed's own zero_to_fp32 misses it for stage 3)."""
    mixed = _mixed_tag(zero_root, tmp_path, 3, 2, stage, "fp32")
    with pytest.raises(FormatError, match=r"zero_pp_rank_1_.*2 ranks.*3"):
        fsdp_restore.convert(mixed, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_model_parallel_ranks_are_refused(zero_root, tmp_path):
    """A tensor- or pipeline-parallel ZeRO checkpoint (mp_rank_01 files beside mp_rank_00's) held only model-parallel
    rank 0's slices in the conversion; it is refused, naming the files."""
    import shutil

    src = _checkpoint(zero_root, 2, 2, "fp32")
    mp = tmp_path / "mp"
    shutil.copytree(src, mp)
    for f in list((mp / "global_step2").glob("*mp_rank_00*")):
        shutil.copy(f, f.with_name(f.name.replace("mp_rank_00", "mp_rank_01")))
    with pytest.raises(FormatError, match="mp_rank_01.*model-parallel"):
        fsdp_restore.convert(mp, tmp_path / "x.safetensors")
    stray = tmp_path / "stray"  # files that only look alike: a log, a backup, model-parallel rank 0's
    shutil.copytree(src, stray)
    for name in ("tmp_rank_1.log", "mp_rank_01_model_states.pt.bak", "layer_01-model_00-model_states.pt"):
        (stray / "global_step2" / name).write_bytes(b"")
    fsdp_restore.convert(stray, tmp_path / "y.safetensors")


# ---- what a weights-only conversion reads from disk -----------------------------------------------------

PAGE = mmap.PAGESIZE


def _resident_pages(path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (mincore(2) on a fresh mapping: nothing of ours)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value)
        pages = ctypes.create_string_buffer(-(-size // PAGE))
        assert libc.mincore(ctypes.c_void_p(address), size, pages) == 0, ctypes.get_errno()
        libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)
    return [bool(b & 1) for b in pages.raw]


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages can be dropped without privileges
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _byte_ranges(path) -> dict[str, list[tuple[int, int]]]:
    """Where Adam's moments and the fp32 masters lie in an optimizer file, found by their bytes (DeepSpeed's
    own unpickling: these files were made by this test)."""
    raw = path.read_bytes()
    ranges: dict[str, list[tuple[int, int]]] = {"moments": [], "masters": []}

    def add(kind, t):
        data = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
        at = raw.find(data)
        assert at >= 0 and raw.find(data, at + 1) < 0, f"{path.name}: a {kind} tensor's bytes not found once"
        ranges[kind].append((at, at + len(data)))

    def walk(node, key=""):
        if isinstance(node, torch.Tensor) and node.numel() > 1:
            if key in ("exp_avg", "exp_avg_sq"):
                add("moments", node)
            elif key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
                add("masters", node)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, k if isinstance(k, str) else key)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, key)

    walk(torch.load(path, weights_only=False, mmap=True, map_location="cpu")["optimizer_state_dict"])
    return ranges


@pytest.fixture(scope="module")
def wide_root(tmp_path_factory):
    from zero_checkpoints import generate_wide

    root = tmp_path_factory.mktemp("zero-wide")
    generate_wide(root, 2, [1, 2, 3])
    return root


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore: Linux")
@pytest.mark.parametrize("how", ["through torch", "without torch"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_select_model_reads_the_masters_and_not_the_moments(wide_root, tmp_path, stage, how):
    """--select model needs the fp32 masters, a third of each optimizer file: Adam's moments, stored just
    before them, stay on disk (they were read when the masters were copied out of the mapping: the kernel's
    read-around of each page fault pulled in the end of exp_avg_sq); and so without torch (`zero_plain`)."""
    tag = wide_root / f"wide-z{stage}" / "global_step1"
    files = sorted(tag.glob("*.pt"))
    for f in files:
        _evict(f)
    if any(any(_resident_pages(f)) for f in files):
        pytest.skip("this file system keeps the pages cached despite POSIX_FADV_DONTNEED")
    if how == "through torch":
        fsdp_restore.convert(tag.parent, tmp_path / "m.safetensors", select="model")
    else:
        assert _lane(tag.parent, tmp_path / "m.safetensors") is not None, "declined"
    resident = {f: _resident_pages(f) for f in files}
    optim_files = [f for f in files if f.name.endswith("optim_states.pt")]
    assert len(optim_files) == 2
    for f in optim_files:
        ranges, pages = _byte_ranges(f), resident[f]
        assert ranges["masters"] and len(ranges["moments"]) >= 2
        for lo, hi in ranges["masters"]:  # read, and still cached: what mincore says is what was read
            if not all(pages[-(-lo // PAGE):hi // PAGE]):
                pytest.skip("the page cache lost pages the conversion read (memory pressure, or a drop_caches)")
        for lo, hi in ranges["moments"]:
            # torch.load reads each record's zip header, just before its data, and the kernel reads ahead of that
            # read (the moment's first pages); the next record's header shares the moment's last page
            inner = pages[-(-(lo + (hi - lo) // 4) // PAGE):hi // PAGE - 1]
            assert len(inner) > 256 and not any(inner), (
                f"{f.name}: {sum(inner)} of {len(inner)} pages of Adam's moments read for --select model")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore: Linux")
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("select", ["model", None])
def test_the_cli_reads_ahead_what_the_conversion_reads(wide_root, stage, select):
    """While torch is imported the CLI asks the kernel for the optimizer files' bytes the conversion will read:
    for ``--select model`` the fp32 masters and none of Adam's moments, for a full conversion both."""
    from fsdp_restore.prefetch import start_prefetch

    tag = wide_root / f"wide-z{stage}" / "global_step1"
    optim_files = sorted(tag.glob("*optim_states.pt"))
    where = {f: _byte_ranges(f) for f in optim_files}  # read whole: before the eviction
    wanted = {f: where[f]["masters"] + ([] if select == "model" else where[f]["moments"]) for f in optim_files}
    for f in tag.glob("*.pt"):
        _evict(f)
    if any(any(_resident_pages(f)) for f in optim_files):
        pytest.skip("this file system keeps the pages cached despite POSIX_FADV_DONTNEED")
    thread = start_prefetch(tag.parent, select=select)
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive()

    def share_cached(pages, ranges):
        wanted_pages = [pages[i] for lo, hi in ranges for i in range(-(-lo // PAGE), hi // PAGE)]
        return sum(wanted_pages) / len(wanted_pages)

    # POSIX_FADV_WILLNEED only queues the reads, and is a hint: the kernel's readahead allocates its pages without
    # retrying, and here skipped ~2% of them in some runs (scattered single pages); the conversion reads those
    deadline = time.monotonic() + 30
    while True:
        resident = {f: _resident_pages(f) for f in optim_files}
        if all(share_cached(resident[f], wanted[f]) > 0.9 for f in optim_files) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for f in optim_files:
        pages = resident[f]
        assert share_cached(pages, wanted[f]) > 0.9, f"{f.name}: not read ahead"
        if select == "model":
            for lo, hi in where[f]["moments"]:
                inner = pages[-(-lo // PAGE):hi // PAGE]
                assert not any(inner[1:-1]), f"{f.name}: {sum(inner)} pages of Adam's moments read ahead"


def _lane(src, dst, select="model", tag=None, max_shard_size=None, dtype=None, verify_checksums=False):
    """The conversion of a ZeRO checkpoint without torch (`zero_plain`; by default its weights), as the CLI runs it."""
    import importlib

    convert_module = importlib.import_module("fsdp_restore.convert")
    return convert_module._convert_zero_plain(src, dst, select=select, tag=tag, on_unsupported="error", threads=3,
                                              max_shard_size=max_shard_size, force=False, progress=None, dtype=dtype,
                                              verify_checksums=verify_checksums)


def _found_in(path, tensor):
    """Where ``tensor``'s bytes start in ``path``, found by the bytes themselves (no reader of ours)."""
    data, probe = path.read_bytes(), tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:64]
    at = data.find(probe)
    assert at >= 0 and data.find(probe, at + 1) < 0
    return at


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _first(obj, key):
    """The first value under ``key`` anywhere in a nested dict/list."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        values = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    else:
        return None
    for v in values:
        found = _first(v, key)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("stage", [2, 3])
def test_damaged_partitions_of_a_zero_checkpoint_are_named_with_verify_checksums(zero_root, tmp_path, stage):
    """Each file of a ZeRO checkpoint is a torch.save archive with a crc32 per record, which neither DeepSpeed nor
    torch.load checks. `verify_checksums=True` checks every record the conversion reads (the fp32 partitions,
    from the crc32s of the runs as they were read, the padding read again); a flipped bit is a `FormatError`
    naming the file and the record, with nothing written. Records the conversion does not read (the moments,
    under ``--select model``) are left alone; a damaged pickle is caught by default. Oracles: `torch.load` for
    where the tensors lie, DeepSpeed's own files for what is damaged."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(_checkpoint(zero_root, 2, stage, "bf16"), src)
    tag = next(p for p in src.iterdir() if p.is_dir())
    optim = sorted(tag.glob("*optim_states.pt"))[1]  # rank 1's
    state = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    master = state["single_partition_of_fp32_groups" if stage < 3 else "fp32_flat_groups"][0]
    moment = _first(state, "exp_avg")
    master_at, moment_at = _found_in(optim, master), _found_in(optim, moment)

    clean = _lane(src, tmp_path / "clean.safetensors", verify_checksums=True)
    crcs = clean.source_crcs
    assert crcs.skipped == 0 and crcs.checked > 2 * 2  # (small records and partitions)
    assert crcs.reread_bytes < master.numel() * 4  # the partitions' crc32s from the bytes as read, not read again
    by_default = _lane(src, tmp_path / "default.safetensors")
    assert by_default.source_crcs.skipped > 0
    assert "partitions read in runs not checked" in describe_rest(by_default.source_crcs)
    assert (tmp_path / "clean.safetensors").read_bytes() == (tmp_path / "default.safetensors").read_bytes()

    _flip(optim, master_at + master.numel() * 2)  # a weight in the middle of rank 1's partition
    assert _lane(src, tmp_path / "unchecked.safetensors") is not None  # (said in the report: not checked)
    with pytest.raises(FormatError, match=rf"{optim.name}:.*data/.*differ|differ.*{optim.name}:[^ ]*data/"):
        _lane(src, tmp_path / "out.safetensors", verify_checksums=True)
    assert not (tmp_path / "out.safetensors").exists()
    _flip(optim, master_at + master.numel() * 2)  # (undone)

    _flip(optim, moment_at + 8)
    assert _lane(src, tmp_path / "weights.safetensors", verify_checksums=True) is not None  # not read: not checked
    with pytest.raises(FormatError, match=optim.name):
        _lane(src, tmp_path / "all.safetensors", select=None, verify_checksums=True)
    assert not (tmp_path / "all.safetensors").exists()
    _flip(optim, moment_at + 8)

    data = optim.read_bytes()
    pickle_at = data.index(b"data.pkl") + len(b"data.pkl")  # the pickle's bytes follow its local header's name
    pickle_at = data.index(b"\x80", pickle_at)  # (its first opcode, PROTO, after the header's extra field)
    _flip(optim, pickle_at + 40)
    with pytest.raises(FormatError, match=r"data\.pkl.*differ|differ.*data\.pkl"):
        _lane(src, tmp_path / "pickle.safetensors")
    assert not (tmp_path / "pickle.safetensors").exists()
    cli = subprocess.run([sys.executable, "-m", "fsdp_restore", "convert", str(src), str(tmp_path / "cli.safetensors")],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and "data.pkl" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
    assert not (tmp_path / "cli.safetensors").exists()


@pytest.mark.parametrize("world_size,stage,dtype", _params(2) + slow(_params(3)))  # (3 ranks: the slow suite)
def test_the_weights_without_torch_are_the_torch_paths_file(zero_root, tmp_path, world_size, stage, dtype):
    """`--select model` read without torch (the ZeRO layout as byte runs of the rank files, written by pread): the
    torch path's file byte for byte, for every stage, both dtypes, even and uneven partitions, in shards too."""
    src = _checkpoint(zero_root, world_size, stage, dtype)
    assert _lane(src, tmp_path / "lane.safetensors") is not None, "declined"
    fsdp_restore.convert(src, tmp_path / "torch.safetensors", select="model")
    assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
    oracle = _oracles(src, world_size)[0]  # and the weights are DeepSpeed's own
    back = fsdp_restore.load(tmp_path / "lane.safetensors")
    assert all(torch.equal(back[name], w) for name, w in oracle["weights"].items())
    lane = _lane(src, tmp_path / "lane-shards", max_shard_size=300)
    theirs = fsdp_restore.convert(src, tmp_path / "torch-shards", select="model", max_shard_size=300)
    assert len(lane.files) == len(theirs.files) > 2
    for a, b in zip(lane.files, theirs.files):  # the same but for each set's own id (and the header's crc32)
        ours, expected = Path(a).read_bytes(), Path(b).read_bytes()
        for field in (b'"fsdp_restore.set_id":"', b'"fsdp_restore.header_crc32":"'):
            at, their_at = ours.index(field) + len(field), expected.index(field) + len(field)
            end = ours.index(b'"', at)
            ours = ours[:at] + expected[their_at:their_at + end - at] + ours[end:]
        assert Path(a).name == Path(b).name and ours == expected, Path(a).name


@pytest.mark.parametrize("world_size,stage,dtype", _params(2) + slow(_params(3)))  # (3 ranks: the slow suite)
def test_the_whole_checkpoint_without_torch_is_the_torch_paths_file(zero_root, tmp_path, world_size, stage, dtype):
    """The full conversion (weights, the optimizer's state per parameter, the rest of the run's state) and
    ``--select optim`` read without torch: the torch path's file byte for byte, and the moments DeepSpeed's own."""
    src = _checkpoint(zero_root, world_size, stage, dtype)
    for select in (None, "optim"):
        for name in ("lane.safetensors", "torch.safetensors"):
            (tmp_path / name).unlink(missing_ok=True)
        assert _lane(src, tmp_path / "lane.safetensors", select=select) is not None, "declined"
        fsdp_restore.convert(src, tmp_path / "torch.safetensors", select=select)
        assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes(), select
    oracle = _oracles(src, world_size)[0]
    optim = fsdp_restore.load(tmp_path / "lane.safetensors")  # (--select optim)
    names = [n for g in optim["param_groups"] for n in g["param_names"]]
    assert set(names) == set(oracle["weights"])
    for pid, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim["state"][pid][key], oracle["optim"][name][key]), (name, key)


def test_the_whole_checkpoint_of_stage_3_sub_groups_without_torch(zero_root, tmp_path):
    """Several flat groups per rank (sub_group_size): each field of the optimizer's state follows them as the
    weights do; the torch path's file, byte for byte."""
    from zero_checkpoints import generate

    src = zero_root / "z3-fp32-ws2-sub40"
    if not src.exists():
        generate(zero_root, 2, [(3, "fp32")], sub_group_size=40)
    assert _lane(src, tmp_path / "lane.safetensors", select=None) is not None, "declined"
    fsdp_restore.convert(src, tmp_path / "torch.safetensors")
    assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()


@pytest.mark.parametrize("stage,change", [
    (3, "a moment shorter than the weights"), (2, "a moment shorter than the weights"), (2, "a moment in 2-D"),
    (2, "no moment in one rank"), (2, "a step that requires grad"), (3, "a step that requires grad"),
    (2, "one rank's moment in bf16"), (3, "one rank's moment in bf16")])
def test_optimizer_state_the_torch_path_reads_otherwise_is_read_as_it_reads_it_or_declined(zero_root, tmp_path,
                                                                                           stage, change):
    """State partitions that do not follow the weights' layout: stage 3 leaves such a field out, and so does any
    stage for a field a rank lacks (the lane too: the same file); stages 1/2 cut each rank's part to its weights'
    length, so a shorter or 2-D part is left to the torch path (declined, nothing written). A step saved requiring
    grad is copied so (as torch's clone() copies it). Ranks whose parts of one field differ in dtype: the torch path
    read one rank's bf16 bytes as fp32 (wrong values, no error); it now refuses, and the lane declines."""
    def edit(optim):
        base = optim["optimizer_state_dict" if stage == 3 else "base_optimizer_state"]
        for group in base["state"].values():
            if change == "a moment in 2-D":
                group["exp_avg"] = group["exp_avg"].reshape(1, -1)
            elif change == "a moment shorter than the weights":
                group["exp_avg_sq"] = group["exp_avg_sq"][:-3].clone()
            elif change == "a step that requires grad":
                group["step"] = group["step"].clone().requires_grad_(True)
        if optim is edited[0] and change in ("no moment in one rank", "one rank's moment in bf16"):
            for group in base["state"].values():
                if change == "no moment in one rank":
                    del group["exp_avg"]
                else:
                    group["exp_avg"] = group["exp_avg"].bfloat16()

    edited: list = []

    def change_once(optim):
        edited.append(optim) if not edited else None
        edit(optim)

    ck = _rewritten_optim_files(_checkpoint(zero_root, 2, stage, "fp32"), tmp_path / "ck", change_once)
    lane = _lane(ck, tmp_path / "lane.safetensors", select=None)
    if change == "one rank's moment in bf16":
        assert lane is None and not (tmp_path / "lane.safetensors").exists()
        with pytest.raises(FormatError, match="several dtypes"):
            fsdp_restore.convert(ck, tmp_path / "torch.safetensors")
    elif change == "a step that requires grad":
        assert lane is not None, "declined"
        fsdp_restore.convert(ck, tmp_path / "torch.safetensors")
        assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
        assert fsdp_restore.load(tmp_path / "lane.safetensors")["optim"]["state"][0]["step"].requires_grad
    elif stage == 3 or change == "no moment in one rank":
        assert lane is not None, "declined"
        fsdp_restore.convert(ck, tmp_path / "torch.safetensors")
        assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
        dropped = "exp_avg_sq" if stage == 3 else "exp_avg"
        assert dropped not in fsdp_restore.load(tmp_path / "lane.safetensors")["optim"]["state"][0]
    else:
        assert lane is None and not (tmp_path / "lane.safetensors").exists()


def test_an_fp16_runs_loss_scaler_does_not_send_the_conversion_through_torch(zero_root, tmp_path):
    """An fp16 run's optimizer files hold DeepSpeed's DynamicLossScaler, whose state names ``torch.float16`` (a
    global the lane refused: every fp16 checkpoint went through torch): read as an inert value now, and the file is
    the torch path's; a dtype in the output itself (here in the run's client state) is still left to torch."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    def fp16_scaler(optim):
        optim["loss_scaler"] = DynamicLossScaler(init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2,
                                                 consecutive_hysteresis=False)
        assert optim["loss_scaler"].__dict__.get("dtype") == torch.float16  # what an fp16 run's file holds

    ck = _rewritten_optim_files(_checkpoint(zero_root, 2, 2, "fp32"), tmp_path / "ck", fp16_scaler)
    for select in (None, "model"):
        for name in ("lane.safetensors", "torch.safetensors"):
            (tmp_path / name).unlink(missing_ok=True)
        assert _lane(ck, tmp_path / "lane.safetensors", select=select) is not None, ("declined", select)
        fsdp_restore.convert(ck, tmp_path / "torch.safetensors", select=select)
        assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes(), select
    states = ck / "global_step2" / "mp_rank_00_model_states.pt"
    head = torch.load(states, weights_only=False)
    head["epoch_dtype"] = torch.bfloat16
    torch.save(head, states)
    assert _lane(ck, tmp_path / "x.safetensors", select=None) is None
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("world_size,stage,dtype", [pytest.param(2, 3, "bf16", id="ws2-z3-bf16"),
                                                     pytest.param(3, 2, "fp32", id="ws3-z2-fp32")])
def test_a_cast_of_the_weights_without_torchs_unpickler(zero_root, tmp_path, world_size, stage, dtype):
    """``--select model --dtype``: the weights read without torch's unpickler are cast from the rank files' byte runs
    (a parameter's run may cross from one rank's file to the next) into DeepSpeed's own weights cast by torch, bit for
    bit (as safetensors' reader reads them), and the file is the torch path's."""
    src = _checkpoint(zero_root, world_size, stage, dtype)
    for target in (torch.float16, torch.bfloat16):
        for name in ("lane.safetensors", "torch.safetensors"):
            (tmp_path / name).unlink(missing_ok=True)
        assert _lane(src, tmp_path / "lane.safetensors", dtype=target) is not None, "declined"
        fsdp_restore.convert(src, tmp_path / "torch.safetensors", select="model", dtype=target)
        assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
        written = safetensors.torch.load_file(tmp_path / "lane.safetensors")
        for name, w in _oracles(src, world_size)[0]["weights"].items():
            expected = w.to(target) if w.is_floating_point() and w.dim() else w
            assert written[name].dtype == expected.dtype, name
            assert torch.equal(written[name].view(torch.int16), expected.view(torch.int16)), name


def test_the_weights_of_stage_3_sub_groups_without_torch(zero_root, tmp_path):
    """Several flat groups per rank (sub_group_size): a parameter's bytes in each rank are found across them."""
    from zero_checkpoints import generate

    src = zero_root / "z3-fp32-ws2-sub40"
    if not src.exists():
        generate(zero_root, 2, [(3, "fp32")], sub_group_size=40)
    assert _lane(src, tmp_path / "lane.safetensors") is not None, "declined"
    fsdp_restore.convert(src, tmp_path / "torch.safetensors", select="model")
    assert (tmp_path / "lane.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()


@pytest.mark.parametrize("args", [["--select", "model"], ["--select", "model", "--dtype", "bf16"],
                                  ["--select", "model", "--dtype", "fp16"], []],
                         ids=["weights", "weights cast to bf16", "weights cast to fp16", "the whole checkpoint"])
def test_the_cli_converts_without_importing_torch(zero_root, tmp_path, args):
    """``--select model``, with ``--dtype bf16`` or ``fp16`` (the fp32 masters cast without torch: `plain_cast`),
    and the whole checkpoint: torch is never imported, and the file is the torch path's, byte for byte."""
    src = _checkpoint(zero_root, 3, 3, "bf16")
    code = ("import sys; from fsdp_restore.cli import main; rc = main(['convert', *sys.argv[1:]]);"
            " assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "cli.safetensors"), *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    fsdp_restore.convert(src, tmp_path / "torch.safetensors", select="model" if args else None,
                         dtype=args[args.index("--dtype") + 1] if "--dtype" in args else None)
    assert (tmp_path / "cli.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()


def test_what_the_torch_path_must_decide_is_left_to_it(zero_root, tmp_path):
    """The lane declines, writing nothing, what torch's path refuses or builds otherwise: a run's own classes in its
    state, a rank file of another run, model-parallel files, a truncated rank file; the torch path then decides."""
    import argparse
    import shutil

    src = _checkpoint(zero_root, 2, 2, "fp32")
    cases = {}
    ck = cases["a run's own class"] = tmp_path / "own"
    shutil.copytree(src, ck)
    states = ck / "global_step2" / "mp_rank_00_model_states.pt"
    head = torch.load(states, weights_only=False)
    head["args"] = argparse.Namespace(lr=0.1)
    torch.save(head, states)
    cases["another run's rank file"] = _mixed_tag(zero_root, tmp_path, 3, 2, 2, "fp32")
    ck = cases["model-parallel files"] = tmp_path / "mp"
    shutil.copytree(src, ck)
    for f in list((ck / "global_step2").glob("*mp_rank_00*")):
        shutil.copy(f, f.with_name(f.name.replace("mp_rank_00", "mp_rank_01")))
    ck = cases["a truncated rank file"] = tmp_path / "cut"
    shutil.copytree(src, ck)
    optim_file = next((ck / "global_step2").glob("*rank_1_*optim_states.pt"))
    os.truncate(optim_file, optim_file.stat().st_size - 300)  # its data intact, the zip directory cut
    for what, ck in cases.items():
        for select in ("model", None):
            assert _lane(ck, tmp_path / "x.safetensors", select=select) is None, (what, select)
            assert not (tmp_path / "x.safetensors").exists(), what


def _rewritten_optim_files(src, dst, change):
    """A copy of the tag ``src`` with ``change(optimizer_state_dict)`` applied to every rank's optimizer file."""
    import shutil

    shutil.copytree(src, dst)
    for f in (dst / "global_step2").glob("*optim_states.pt"):
        state = torch.load(f, weights_only=False)
        change(state["optimizer_state_dict"])
        torch.save(state, f)
    return dst


@pytest.mark.parametrize("shape", ["an extra entry", "a dict"])
def test_partitions_the_torch_path_cannot_read_are_declined(zero_root, tmp_path, shape):
    """Stage 1/2 masters with an entry past the param groups (None), or as a dict {0: t0, ...}: the torch path
    reads every entry (and fails), so the lane must not convert them (it read only the entries it indexed)."""
    def change(optim):
        parts = optim["single_partition_of_fp32_groups"]
        optim["single_partition_of_fp32_groups"] = parts + [None] if shape == "an extra entry" else dict(enumerate(parts))

    ck = _rewritten_optim_files(_checkpoint(zero_root, 2, 2, "fp32"), tmp_path / "ck", change)
    assert _lane(ck, tmp_path / "x.safetensors") is None
    assert not (tmp_path / "x.safetensors").exists()


def test_an_empty_parameter_held_in_pieces_is_declined(zero_root, tmp_path):
    """A trainable parameter of no elements (not something DeepSpeed saves): declined by the lane, not reported as a
    truncated file (an empty piece ran past the runs' loop as an EOFError); the torch path, which failed on it
    (an IndexError: no piece to take the dtype from), converts it as an empty tensor."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(_checkpoint(zero_root, 2, 2, "fp32"), ck)
    states = ck / "global_step2" / "mp_rank_00_model_states.pt"
    head = torch.load(states, weights_only=False)
    head["module"]["empty"] = torch.zeros(0)
    head["param_shapes"][-1]["empty"] = torch.Size([0])
    torch.save(head, states)
    for f in (ck / "global_step2").glob("*optim_states.pt"):
        state = torch.load(f, weights_only=False)
        paddings = state["optimizer_state_dict"].get("param_alignment_paddings")
        if paddings:
            paddings[-1].append(0)
        torch.save(state, f)
    assert _lane(ck, tmp_path / "x.safetensors") is None
    fsdp_restore.convert(ck, tmp_path / "x.safetensors", select="model")
    back = fsdp_restore.load(tmp_path / "x.safetensors")
    assert back["empty"].shape == (0,) and back["empty"].dtype == torch.float32
    oracle = _oracles(_checkpoint(zero_root, 2, 2, "fp32"), 2)[0]
    assert all(torch.equal(back[name], w) for name, w in oracle["weights"].items())


def test_a_fifo_in_a_files_place_is_declined_at_once(zero_root, tmp_path):
    """The model states replaced by a FIFO: the lane's open blocked until a writer came (the CLI hung where the
    API says the file is missing); it now declines, and the torch path says what is wrong."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(_checkpoint(zero_root, 2, 2, "fp32"), ck)
    states = ck / "global_step2" / "mp_rank_00_model_states.pt"
    states.unlink()
    os.mkfifo(states)
    code = ("import sys, importlib; c = importlib.import_module('fsdp_restore.convert'); print(c._convert_zero_plain("
            "sys.argv[1], sys.argv[2], select='model', tag=None, on_unsupported='error', threads=2,"
            " max_shard_size=None, force=False, progress=None))")
    try:
        run = subprocess.run([sys.executable, "-c", code, str(ck), str(tmp_path / "x.safetensors")],
                             capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        fd = os.open(states, os.O_WRONLY | os.O_NONBLOCK)  # let the blocked open go, so the child ends
        os.close(fd)
        pytest.fail("the lane blocked on the FIFO")
    assert run.returncode == 0 and run.stdout.strip() == "None", run.stderr[-2000:]
    with pytest.raises(FormatError, match="model_states.pt"):
        fsdp_restore.convert(ck, tmp_path / "x.safetensors", select="model")


def test_a_rank_file_renamed_over_while_it_is_read_is_not_read_at_its_offsets(zero_root, tmp_path, monkeypatch):
    """The torch reader found torch.load's mapping of a rank file, then opened the path again for its reads: a file
    renamed over it in between (the same layout, other values) was read at the first file's offsets."""
    import shutil

    import importlib

    zero_module = importlib.import_module("fsdp_restore.zero")
    src = _checkpoint(zero_root, 2, 3, "fp32")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    target = next((ck / "global_step2").glob("*rank_0_*optim_states.pt"))
    other = tmp_path / "other.pt"
    state = torch.load(target, weights_only=False)
    for group in state["optimizer_state_dict"]["fp32_flat_groups"]:
        group.data.neg_()
    torch.save(state, other)
    real = zero_module.MappedFile

    def racing(path, *args, **kwargs):
        found = real(path, *args, **kwargs)
        if Path(path).resolve() == target.resolve() and other.exists():
            os.replace(other, target)
        return found

    monkeypatch.setattr(zero_module, "MappedFile", racing)
    fsdp_restore.convert(ck, tmp_path / "c.safetensors", select="model")
    back = fsdp_restore.load(tmp_path / "c.safetensors")
    oracle = _oracles(src, 2)[0]
    assert all(torch.equal(back[name], w) for name, w in oracle["weights"].items())
