"""save_sharded on real gloo ranks: every rank writes its own bytes of one unsharded checkpoint.

The oracle is the gathered checkpoint: torch's own ``get_state_dict(full_state_dict=True)``, turned into
``Optimizer.state_dict()`` form (integer ids in the optimizer's order, ``param_names``), ``torch.save``-d and
converted by ``fsdp_restore.convert``; our file must be the same bytes (apart from the conversion's source
metadata). Then torch's own ``Optimizer.load_state_dict`` of an unsharded model takes ``load(path)["optim"]``,
and ``restore`` puts the state back into a freshly sharded model, exactly.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import threading

import numpy as np
import pytest
import torch
from dist import GLOO, NCCL, cases, run_ranks
from models import build, full_state, wrap

import fsdp_restore
from fsdp_restore import SaveError, save_sharded
from fsdp_restore.format import META_SOURCE

# what differs between two writes of the same state: the conversion's source identity, and what covers it or
# is new per write (the header's own crc32, a sharded set's id)
_PER_WRITE = (META_SOURCE, "fsdp_restore.header_crc32", "fsdp_restore.set_id")

# ---- training a sharded model -------------------------------------------------------------------------------


def _freeze(model: torch.nn.Module, name: str) -> None:
    """A frozen subset (before wrapping: FSDP1 needs one requires_grad per unit)."""
    frozen = {"mlp": "blocks.0.", "llama": "model.layers.0.mlp.", "llama-tied": "model.layers.0.mlp."}[name]
    for n, p in model.named_parameters():
        if n.startswith(frozen):
            p.requires_grad_(False)


def _optimizer(model: torch.nn.Module, one_group: bool = False) -> torch.optim.Optimizer:
    """AdamW with a decay and a no-decay group (one group for FSDP1 flat parameters, which are all 1-D)."""
    if one_group:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    def plain(name: str) -> bool:  # by name: FSDP1's use_orig_params views are 1-D
        return name.endswith("bias") or "norm" in name

    decay = [p for n, p in model.named_parameters() if p.requires_grad and not plain(n)]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and plain(n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2)


def _trained(name: str, how: str, world_size: int, seed: int = 0, steps: int = 2):
    model = build(name, seed=seed)
    _freeze(model, name)
    model = wrap(model, how, world_size)
    opt = _optimizer(model, how.endswith("-flat"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        if how in ("tp", "fsdp2+tp", "fsdp2cp+tp"):  # a TP plan for restores, not a forward: made-up grads
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = p.detach() * 0.5 + 0.01
            opt.step()
            sched.step()
            opt.zero_grad()
            continue
        if name == "mlp":
            loss = model(torch.randn(4, 7, generator=gen)).square().mean()
        else:
            ids = torch.randint(0, 101, (2, 8), generator=gen)
            loss = model(input_ids=ids).logits.float().square().mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    random.seed(seed)
    np.random.seed(seed)
    extra = {"step": steps, "scheduler": sched.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}
    return model, opt, extra


# ---- the oracle -----------------------------------------------------------------------------------------------------


def _tie_groups(name: str) -> list[list[str]]:
    seen: dict[int, list[str]] = {}
    for n, p in build(name, device="meta").named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(n)
    return [names for names in seen.values() if len(names) > 1]


def _gathered(model, opt, name: str, how: str, with_optim: bool, ignore_frozen_params: bool = False):
    """The unsharded checkpoint from torch's own gather, in Optimizer.state_dict() form (``ignore_frozen_params``:
    torch's option of that name: without the parameters that do not require grad)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    cpu_offload = not how.startswith("fsdp1")  # torch on CPU fails FSDP1's offloaded gather
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload,
                                                                   ignore_frozen_params=ignore_frozen_params))
    if not msd:  # offloaded gathers land on rank 0 only
        return None, None
    msd = {k: v.detach().cpu().clone() for k, v in msd.items()}
    for names in _tie_groups(name):  # an unsharded model's state dict holds a tied tensor once
        for alias in names[1:]:
            if names[0] in msd:
                msd[alias] = msd[names[0]]
    if not with_optim:
        return msd, None
    order = list(next(iter(opt.state.values())).keys())  # the optimizer's own field order
    twin = build(name, device="meta")  # the unsharded model's optimizer numbers its parameters in its order
    _freeze(twin, name)
    twin_names = {id(p): n for n, p in twin.named_parameters()}
    ids, groups = {}, []
    for g, twin_group in zip(osd["param_groups"], _optimizer(twin, how.endswith("-flat")).param_groups):
        names = [twin_names[id(p)] for p in twin_group["params"]]
        assert sorted(names) == sorted(g["params"]), (names, g["params"])
        for n in names:
            ids[n] = len(ids)
        packed = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        packed["param_names"] = names
        packed["params"] = [ids[n] for n in names]
        groups.append(packed)
    state = {ids[n]: {f: (s[f].detach().cpu().clone() if isinstance(s[f], torch.Tensor) else s[f]) for f in order}
             for n, s in sorted(osd["state"].items(), key=lambda kv: ids[kv[0]])}
    return msd, {"state": state, "param_groups": groups}


def _split(path, ignore=()) -> tuple[dict, bytes]:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    for k in (*_PER_WRITE, *ignore):
        header.get("__metadata__", {}).pop(k, None)
    return header, data[8 + n:]


def _header_difference(ours: dict, reference: dict) -> str:
    """The entries where two headers differ (the structure JSON decoded), not the first 3000 characters."""
    lines = []
    for k in sorted(set(ours) | set(reference)):
        a, b = ours.get(k), reference.get(k)
        if k == "__metadata__" and a and b:
            for m in sorted(set(a) | set(b)):
                x, y = a.get(m), b.get(m)
                if x != y and m.endswith("structure"):
                    x, y = json.dumps(json.loads(x), indent=0).splitlines(), json.dumps(json.loads(y), indent=0).splitlines()
                    i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                    lines.append(f"{m} from line {i}: ours {x[max(0, i - 5):i + 5]} reference {y[max(0, i - 5):i + 5]}")
                elif x != y:
                    lines.append(f"{m}: ours {x!r} reference {y!r}")
        elif a != b:
            lines.append(f"{k}: ours {a} reference {b}")
    return "headers differ:\n" + "\n".join(lines[:20])


def assert_same_files(ours, reference, ignore=()) -> None:
    """Byte for byte, apart from the conversion's source identity (and the header padding it shifts) and the
    metadata keys ``ignore``."""
    ours, reference = str(ours), str(reference)
    if os.path.isdir(reference):
        assert sorted(os.listdir(ours)) == sorted(os.listdir(reference))
        for f in os.listdir(reference):
            if f.endswith(".json"):
                a, b = json.load(open(os.path.join(ours, f))), json.load(open(os.path.join(reference, f)))
                for k in (*_PER_WRITE, *ignore):
                    a["metadata"].pop(k, None), b["metadata"].pop(k, None)
                assert a == b, f
            else:
                assert_same_files(os.path.join(ours, f), os.path.join(reference, f), ignore)
        return
    (h1, d1), (h2, d2) = _split(ours, ignore), _split(reference, ignore)
    assert h1 == h2, _header_difference(h1, h2)
    assert d1 == d2, "data sections differ"


def _save_and_check(rank, world_size, root, name, how, mode, max_shard_size=None):
    """Train, save_sharded, and on rank 0 compare with the converted gather; then every rank restores."""
    model, opt, extra = _trained(name, how, world_size)
    with_optim = mode == "full"
    path = os.path.join(root, "ours" + (".safetensors" if max_shard_size is None else ""))
    # extra is rank 0's: the other ranks may pass anything (here nothing)
    report = save_sharded(model, path, optimizer=opt if with_optim else None,
                          extra=extra if with_optim and rank == 0 else None, max_shard_size=max_shard_size)
    msd, osd = _gathered(model, opt, name, how, with_optim)
    if rank == 0:
        obj = {"model": msd, "optim": osd, **extra} if with_optim else msd
        torch.save(obj, os.path.join(root, "ref.pt"))
        ref = os.path.join(root, "ref" + (".safetensors" if max_shard_size is None else ""))
        fsdp_restore.convert(os.path.join(root, "ref.pt"), ref, max_shard_size=max_shard_size)
        assert_same_files(path, ref)
        fsdp_restore.verify(path)
        if with_optim:  # torch's own load_state_dict of an unsharded model takes our optimizer state
            loaded = fsdp_restore.load(path)
            plain = build(name, seed=5)
            _freeze(plain, name)
            plain_opt = _optimizer(plain, how.endswith("-flat"))
            plain_opt.load_state_dict(loaded["optim"])
            ours_state = plain_opt.state_dict()
            for pid, s in osd["state"].items():
                for f, v in s.items():
                    assert torch.equal(ours_state["state"][pid][f], v), (pid, f)
            assert loaded["step"] == extra["step"] and loaded["scheduler"] == extra["scheduler"]
            assert torch.equal(loaded["rng"]["torch"], extra["rng"]["torch"])
    torch.distributed.barrier() if world_size > 1 else None
    # the round trip: restore into a freshly sharded model (another init) and compare with the gather
    fresh, fresh_opt, _ = _trained(name, how, world_size, seed=9, steps=1)
    if with_optim:
        fsdp_restore.restore(fresh, path, fresh_opt)
    else:
        fsdp_restore.restore_model(fresh, path)
    got = full_state(fresh, how)
    for k, v in (msd if rank == 0 else {}).items():
        assert torch.equal(got[k], v), f"{k} differs after save -> restore"
    if with_optim:
        _, osd2 = _gathered(fresh, fresh_opt, name, how, True)
        for pid, s in (osd["state"] if rank == 0 else {}).items():
            for f, v in s.items():
                assert torch.equal(osd2["state"][pid][f], v), ("optimizer state after restore", pid, f)
    return report.bytes_written, report.nbytes


CORE = [("mlp", "plain", 1), ("mlp", "fsdp2", 2), ("mlp", "fsdp2", 3), ("mlp", "ddp", 2)]


@pytest.mark.parametrize("name,how,world_size", CORE, ids=[f"{n}-{h}-{w}" for n, h, w in CORE])
def test_full_checkpoint_matches_the_converted_gather(tmp_path, name, how, world_size):
    results = run_ranks(_save_and_check, world_size, str(tmp_path), name, how, "full")
    written = sum(w for w, _ in results)
    assert written == results[0][1], (written, results[0][1])  # every byte written once, by one rank


WIDE = [("mlp", "fsdp2", 4), ("mlp", "hsdp", 4), ("mlp", "fsdp1-FULL_SHARD-flat", 2),
        ("mlp", "fsdp1-FULL_SHARD-orig", 3), ("mlp", "fsdp1-HYBRID_SHARD-flat", 4), ("llama", "tp", 2),
        ("llama", "fsdp2+tp", 4), ("llama", "fsdp2cp+tp", 4), ("llama", "ddp", 3), ("llama-tied", "fsdp2", 2),
        ("llama-tied", "plain", 1),
        ("mlp", "fsdp1-NO_SHARD-flat", 2), ("mlp", "fsdp1-SHARD_GRAD_OP-orig", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name,how,world_size", WIDE, ids=[f"{n}-{h}-{w}" for n, h, w in WIDE])
def test_full_checkpoint_wider_layouts(tmp_path, name, how, world_size):
    results = run_ranks(_save_and_check, world_size, str(tmp_path), name, how, "full")
    assert sum(w for w, _ in results) == results[0][1]


def _weights_only(rank, world_size, root, name, how, max_shard_size):
    """Weights only: plain keys, the tie stored once with save_model's alias record; safetensors and
    transformers load it; it is convert's file otherwise."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, opt, _ = _trained(name, how, world_size)
    out = os.path.join(root, "hf")
    path = out if max_shard_size else os.path.join(out, "model.safetensors")
    save_sharded(model, path, max_shard_size=max_shard_size)
    msd, _ = _gathered(model, opt, name, how, False)
    if rank == 0:
        torch.save(msd, os.path.join(root, "ref.pt"))
        ref = os.path.join(root, "ref" + ("" if max_shard_size else ".safetensors"))
        fsdp_restore.convert(os.path.join(root, "ref.pt"), ref, max_shard_size=max_shard_size)
        aliases = {"lm_head.weight": "model.embed_tokens.weight"}
        assert_same_files(path, ref, ignore=aliases)
        first = path if not max_shard_size else os.path.join(path, sorted(os.listdir(path))[0])
        assert _split(first)[0]["__metadata__"]["lm_head.weight"] == "model.embed_tokens.weight"
        if max_shard_size:  # one set id in every shard and the index, whichever rank wrote their bytes
            shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
            assert len(shards) > 1
            ids = {json.loads(open(os.path.join(path, f), "rb").read()[8:8 + struct.unpack("<Q", open(
                os.path.join(path, f), "rb").read(8))[0]])["__metadata__"]["fsdp_restore.set_id"] for f in shards}
            index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
            assert ids == {index["metadata"]["fsdp_restore.set_id"]}, (ids, index["metadata"])
        fsdp_restore.verify(path)
        if not max_shard_size:
            flat = load_file(path)
            assert set(flat) == set(msd) - {"lm_head.weight"}
            for k, v in flat.items():
                assert torch.equal(v, msd[k]), k
        build(name).config.save_pretrained(out)
        hf = AutoModelForCausalLM.from_pretrained(out)
        for k, v in hf.state_dict().items():
            assert torch.equal(v, msd[k]), k
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    fresh = wrap(build(name, seed=3), how, world_size)
    fsdp_restore.restore_model(fresh, path)
    got = full_state(fresh, how)
    for k, v in (msd if rank == 0 else {}).items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("max_shard_size", [None, 20_000], ids=["file", "sharded"])
def test_weights_only_loads_with_safetensors_and_transformers(tmp_path, max_shard_size):
    run_ranks(_weights_only, 2, str(tmp_path), "llama-tied", "fsdp2", max_shard_size)


def _trained_part(rank, world_size, root, name, how, mode):
    """ignore_frozen_params=True: the file convert makes of torch's own gather with that option (buffers kept,
    frozen parameters left out), which a restore with strict=False puts back."""
    model, opt, extra = _trained(name, how, world_size)
    with_optim = mode == "full"
    path = os.path.join(root, "ours.safetensors")
    save_sharded(model, path, optimizer=opt if with_optim else None,
                 extra=extra if with_optim and rank == 0 else None, ignore_frozen_params=True)
    msd, osd = _gathered(model, opt, name, how, with_optim, ignore_frozen_params=True)
    full, _ = _gathered(model, opt, name, how, False)
    if rank == 0:
        frozen = set(full) - set(msd)
        assert frozen and all(k.startswith(("blocks.0.", "model.layers.0.mlp.")) for k in frozen), frozen
        obj = {"model": msd, "optim": osd, **extra} if with_optim else msd
        torch.save(obj, os.path.join(root, "ref.pt"))
        fsdp_restore.convert(os.path.join(root, "ref.pt"), os.path.join(root, "ref.safetensors"))
        # (a weights file records a tie it stores once, as save_model does: convert's of the gather does not)
        assert_same_files(path, os.path.join(root, "ref.safetensors"), ignore=() if with_optim else ("lm_head.weight",))
    torch.distributed.barrier() if world_size > 1 else None
    fresh, fresh_opt, _ = _trained(name, how, world_size, seed=9, steps=1)
    before = full_state(fresh, how)
    with pytest.raises(fsdp_restore.RestoreError, match="the missing: each of the .* does not require grad"):
        fsdp_restore.restore_model(fresh, path, model_prefix="model" if with_optim else "")  # strict: every rank
    if with_optim:
        fsdp_restore.restore(fresh, path, fresh_opt, strict=False)
    else:
        fsdp_restore.restore_model(fresh, path, strict=False)
    got = full_state(fresh, how)
    for k, v in (full if rank == 0 else {}).items():
        assert torch.equal(got[k], v if k in msd else before[k]), k  # the rest as the model was


PART = [("mlp", "fsdp2", 2, "full"), ("mlp", "fsdp1-FULL_SHARD-orig", 2, "weights"),
        ("mlp", "fsdp1-FULL_SHARD-flat", 2, "full"), ("llama-tied", "ddp", 2, "weights")]


@pytest.mark.parametrize("name,how,world_size,mode", PART, ids=[f"{n}-{h}-{w}-{m}" for n, h, w, m in PART])
def test_a_save_without_frozen_parameters_is_the_converted_gather_without_them(tmp_path, name, how, world_size,
                                                                               mode):
    run_ranks(_trained_part, world_size, str(tmp_path), name, how, mode)


def test_a_frozen_tied_weight_is_left_out_under_every_name(tmp_path):
    """Where torch's get_model_state_dict(ignore_frozen_params=True) differs, on purpose: it pops a frozen tied
    weight under the first name named_parameters() gives it and keeps it under the other (a LoRA run's adapter
    file would carry the whole vocabulary matrix as lm_head.weight); save_sharded leaves it out under both."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = build("llama-tied")
    model.model.embed_tokens.weight.requires_grad_(False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_sharded(model, tmp_path / "part.safetensors", ignore_frozen_params=True)
    torch_part = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    ours = load_file(tmp_path / "part.safetensors")
    assert set(torch_part) - set(ours) == {"lm_head.weight"} and set(ours) <= set(torch_part)
    assert "model.embed_tokens.weight" not in ours
    assert all(torch.equal(v, torch_part[k]) for k, v in ours.items())


def test_full_checkpoint_sharded_set_matches(tmp_path):
    run_ranks(_save_and_check, 3, str(tmp_path), "mlp", "fsdp2", "full", 300)


# ---- faults: one verdict on every rank, nothing left behind, the old checkpoint untouched -------------------


def _old_checkpoint(rank, world_size, path, how):
    model, opt, extra = _trained("mlp", how, world_size, seed=0)
    save_sharded(model, path, optimizer=opt, extra=extra)
    return _trained("mlp", how, world_size, seed=1)  # the state a second save writes


def _leftovers(path) -> list[str]:
    return [f for f in os.listdir(os.path.dirname(path)) if ".tmp-" in f or ".old-" in f]


def _fault(rank, world_size, path, how, fault):
    import time

    import fsdp_restore.save_plan as save_plan

    model, opt, extra = _old_checkpoint(rank, world_size, path, how)
    old = open(path, "rb").read() if rank == 0 else b""
    if fault == "raise mid-write" and rank == 1:
        calls = [0]
        real = os.pwrite

        def failing(fd, data, offset):
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(28, "No space left on device")
            return real(fd, data, offset)

        os.pwrite = failing
    if fault == "wrong offset" and rank == world_size - 1:
        real_plan = save_plan.build_write_plan

        def shifted(*args, **kwargs):
            plan = real_plan(*args, **kwargs)
            item = next(i for i in plan.items if i.key == "model.inp.weight" and i.data.numel())
            item.global_start += 1  # one element off
            return plan

        save_plan.build_write_plan = shifted
    if fault == "not shared" and rank == 1:
        real_open = os.open

        def local_disk(p, flags, *args, **kwargs):  # this rank's "node" does not see rank 0's temporary
            if ".tmp-" in str(p):
                raise FileNotFoundError(2, "No such file or directory", str(p))
            return real_open(p, flags, *args, **kwargs)

        os.open = local_disk
    if fault == "disk full" and rank == 0:
        import fsdp_restore.sharded_save as sharded_save

        def no_space(fd, size):
            raise OSError(28, "No space left on device")

        sharded_save.preallocate = no_space  # the preallocation finds the disk full: before any rank writes
    if fault == "different header" and rank == 1:
        opt.param_groups[0]["lr"] = 0.5  # this rank's checkpoint would say another learning rate
    if fault == "plan fails" and rank == 1:  # this rank has no header to compare: nothing said of headers
        def failing_plan(*args, **kwargs):
            raise RuntimeError("this rank's plan failed")

        save_plan.build_write_plan = failing_plan
    t0 = time.perf_counter()
    with pytest.raises(SaveError) as info:
        save_sharded(model, path, optimizer=opt, extra=extra)
    seconds = time.perf_counter() - t0
    if rank == 0:
        assert open(path, "rb").read() == old, "the old checkpoint changed"
        assert not _leftovers(path), _leftovers(path)
        fsdp_restore.verify(path)
    return str(info.value), seconds


FAULTS = [("raise mid-write", "fsdp2", 3, "OSError: [Errno 28] no space left for ckpt.safetensors in"),
          ("wrong offset", "fsdp2", 2, "do not cover these tensors exactly (a piece shifted, lost or doubled) (1):"
           " model.inp.weight"),
          ("not shared", "ddp", 2, "do not share one filesystem"),
          ("different header", "fsdp2", 3, "the ranks computed different checkpoint headers"),
          ("disk full", "fsdp2", 2, "no space left for ckpt.safetensors in "),
          ("plan fails", "fsdp2", 2, "RuntimeError: this rank's plan failed [rank 1]")]


@pytest.mark.parametrize("fault,how,world_size,expected", FAULTS, ids=[f[0].replace(" ", "-") for f in FAULTS])
def test_fault_every_rank_raises_the_same_error_and_the_old_file_stays(tmp_path, fault, how, world_size, expected):
    path = str(tmp_path / "ckpt.safetensors")
    results = run_ranks(_fault, world_size, path, how, fault)
    texts = {text for text, _ in results}
    assert len(texts) == 1, texts  # the same error on every rank
    text = texts.pop()
    assert expected in text, text
    if "no space" in expected:  # said of the destination, with what it needs (it was the bare errno text)
        assert re.search(r"\(No space left on device\): the checkpoint needs \d+\.\d MB there; free some, or give"
                         r" a destination on another disk \[rank \d\]", text), text
    if fault in ("wrong offset", "different header", "disk full", "plan fails"):
        assert "(plan)" in text, text  # found before anything was written
    if fault == "plan fails":  # (the other rank's header beside none, or the header slot's text for a destination)
        assert "different checkpoint headers" not in text and "different destinations" not in text, text
    assert max(s for _, s in results) < 30, results


def _unfaithful_storage(rank, world_size, path, fault):
    """Two saves with the same fault on the last rank (its first write lost, or put 4 bytes off, with one write
    thread so that the first write is always the same): without ``verify_checksums`` the save puts a damaged
    checkpoint in place of the good one (what differs from a faithful save, read by safetensors); with it, the save
    is refused on every rank, naming those tensors, and the file at ``path`` is left as it was."""
    import fsdp_restore.sharded_save as sharded_save

    from safetensors.torch import load_file

    model, opt, extra = _old_checkpoint(rank, world_size, path, "fsdp2")
    save_sharded(model, path + ".good", optimizer=opt, extra=extra, thread_count=1)  # the same state, written faithfully
    if rank == world_size - 1:
        real, calls = sharded_save._pwrite_all, [0]

        def unfaithful(fd, data, offset):
            calls[0] += 1
            if calls[0] != 1:
                return real(fd, data, offset)
            if fault == "misplaced":  # 4 bytes on, inside its own range: a spill into the next tensor would race
                return real(fd, memoryview(data).cast("B")[:-4], offset + 4)  # with that tensor's own write
            return None  # lost: the preallocated zeros stay

        sharded_save._pwrite_all = unfaithful
    save_sharded(model, path, optimizer=opt, extra=extra, thread_count=1)  # the default: no read-back
    damaged = []  # the tensors that differ from the faithful file's, as safetensors' own reader reads them
    if rank == 0:
        good, got = load_file(path + ".good"), load_file(path)
        damaged = sorted(key for key in good if not torch.equal(good[key], got[key]))
    before = open(path, "rb").read() if rank == 0 else b""
    if rank == world_size - 1:
        calls[0] = 0
    with pytest.raises(SaveError) as info:
        save_sharded(model, path, optimizer=opt, extra=extra, thread_count=1, verify_checksums=True)
    if rank == 0:
        assert open(path, "rb").read() == before and not _leftovers(path)
    return str(info.value), damaged


@pytest.mark.parametrize("fault", ["lost", "misplaced"])
def test_verify_checksums_refuses_a_save_the_storage_did_not_keep(tmp_path, fault):
    path = str(tmp_path / "ckpt.safetensors")
    results = run_ranks(_unfaithful_storage, 2, path, fault)
    texts = {text for text, _ in results}
    assert len(texts) == 1, texts  # the same error on every rank
    text, damaged = texts.pop(), results[0][1]
    assert damaged, "the fault did not damage the checkpoint saved without the read-back"
    assert "read back from the storage as other bytes (verify_checksums=True)" in text, text
    assert "(read back)" in text and "nothing was put at the destination" in text, text
    for key in damaged:  # the tensors damaged in the unchecked save: each named
        assert key in text, (key, text)


def _lost_at_the_commit(rank, world_size, root, what):
    """Rank 0's commit rewrites the header with the real checksums (lost: the placeholders stay), and writes a set's
    index (lost: it ends 10 bytes short)."""
    import fsdp_restore.sharded_save as sharded_save

    model, opt, extra = _trained("mlp", "fsdp2", world_size, seed=0)
    shard = 300 if what == "index" else None
    path = os.path.join(root, "ckpt" if shard else "ckpt.safetensors")
    save_sharded(model, path, optimizer=opt, extra=extra, max_shard_size=shard)
    files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if shard else [path]
    before = [open(f, "rb").read() for f in files] if rank == 0 else []
    if rank == 0 and what == "header":
        real, headers = sharded_save._pwrite_all, [0]

        def lossy(fd, data, offset):
            if offset == 0:
                headers[0] += 1
                if headers[0] == 2:  # the first is the temporary's own, with placeholders
                    return None
            return real(fd, data, offset)

        sharded_save._pwrite_all = lossy
    if rank == 0 and what == "index":
        real_small = sharded_save._write_small_file
        sharded_save._write_small_file = lambda where, data: real_small(where, data[:-10])
    with pytest.raises(SaveError) as info:
        save_sharded(model, path, optimizer=opt, extra=extra, max_shard_size=shard, verify_checksums=True)
    if rank == 0:
        assert [open(f, "rb").read() for f in files] == before and not _leftovers(path)
    return str(info.value)


@pytest.mark.parametrize("what", ["header", "index"])
def test_verify_checksums_reads_back_what_rank_0_writes_at_the_commit(tmp_path, what):
    texts = set(run_ranks(_lost_at_the_commit, 2, str(tmp_path), what))
    assert len(texts) == 1, texts
    text = texts.pop()
    assert "save_sharded (commit) failed" in text, text
    assert ("ckpt.safetensors: its header read back from the storage is not the one written" in text if what == "header"
            else "model.safetensors.index.json: read back from the storage, it is not the index written" in text), text


def _late_write_into_another_ranks_place(rank, world_size, path):
    """Rank 1 puts its (zero) half of the bias 72 bytes early, over rank 0's weight, and late: after rank 0 would
    have read its own bytes back had it not waited for every rank's writes."""
    import time

    import fsdp_restore.sharded_save as sharded_save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.bias.zero_()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    if rank == 1:
        real = sharded_save._pwrite_all

        def late_and_misplaced(fd, data, offset):
            if len(data) == 8 and not any(bytes(data)):  # this rank's half of the zero bias
                time.sleep(2.0)
                return real(fd, data, offset - 72)  # onto rank 0's first weight row
            return real(fd, data, offset)

        sharded_save._pwrite_all = late_and_misplaced
    with pytest.raises(SaveError) as info:
        save_sharded(model, path, verify_checksums=True, thread_count=1)
    return str(info.value)


def test_verify_checksums_reads_back_only_once_every_rank_has_written(tmp_path):
    path = str(tmp_path / "w.safetensors")
    texts = set(run_ranks(_late_write_into_another_ranks_place, 2, path))
    assert len(texts) == 1, texts
    text = texts.pop()
    assert "save_sharded (read back) failed" in text and "): weight [rank 0]" in text, text  # the victim names it
    assert not os.path.exists(path) and not _leftovers(path)


def _lost_tensor_in_a_set(rank, world_size, root):
    """A set of shards, 4 write threads: every write into one tensor of a later file is lost (the tensor found by
    its bytes' place in the first save's header), whichever thread makes it. A read that returns less than asked
    (half, at most) is not taken for a lost write."""
    import fsdp_restore.sharded_save as sharded_save

    model, opt, extra = _trained("mlp", "fsdp2", world_size, seed=0)
    path = os.path.join(root, "ckpt")
    save_sharded(model, path, optimizer=opt, extra=extra, max_shard_size=300)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    key, name = sorted(index.items(), key=lambda kv: (kv[1], kv[0]))[-1]  # a tensor of the last file
    raw = open(os.path.join(path, name), "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = (8 + n + b for b in json.loads(raw[8:8 + n])[key]["data_offsets"])
    before = {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))} if rank == 0 else {}
    real_write, real_read = sharded_save._pwrite_all, os.preadv

    def lossy(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name) and begin <= offset < end:
            return None
        return real_write(fd, data, offset)

    def short(fd, buffers, offset):
        (view,) = buffers
        return real_read(fd, [view[:max(1, len(view) // 2)]], offset)

    sharded_save._pwrite_all, os.preadv = lossy, short
    try:
        with pytest.raises(SaveError) as info:
            save_sharded(model, path, optimizer=opt, extra=extra, max_shard_size=300, thread_count=4,
                         verify_checksums=True)
        sharded_save._pwrite_all = real_write
        save_sharded(model, path, optimizer=opt, extra=extra, max_shard_size=300, thread_count=4,
                     verify_checksums=True)  # faithful: short reads resumed, no false alarm
    finally:
        sharded_save._pwrite_all, os.preadv = real_write, real_read
    unchanged = all(open(os.path.join(path, f), "rb").read() == b for f, b in before.items()) if rank == 0 else True
    return str(info.value), key, unchanged


def test_verify_checksums_reads_each_file_of_a_set_on_every_thread(tmp_path):
    results = run_ranks(_lost_tensor_in_a_set, 2, str(tmp_path))
    texts = {text for text, _, _ in results}
    assert len(texts) == 1, texts
    text, key = texts.pop(), results[0][1]
    assert "read back from the storage as other bytes" in text and f": {key} [rank" in text, (key, text)


def _saved_twice(rank, world_size, path, name, how):
    model, opt, extra = _trained(name, how, world_size, seed=0)
    plain = save_sharded(model, path, optimizer=opt, extra=extra)
    first = open(path, "rb").read() if rank == 0 else b""
    checked = save_sharded(model, path, optimizer=opt, extra=extra, verify_checksums=True)
    return first, open(path, "rb").read() if rank == 0 else b"", checked.checksums == plain.checksums, \
        sorted(checked.timings)


@pytest.mark.parametrize("name,how,world_size,backend", cases(3, "mlp", "fsdp2", only=GLOO)
                         + cases(2, "llama", "tp", only=GLOO) + cases(1, "mlp", "fsdp2", only=NCCL)
                         + cases(2, "mlp", "fsdp2", only=("gloo-cuda",)))
def test_verify_checksums_passes_a_faithful_save_and_writes_the_same_file(tmp_path, name, how, world_size, backend):
    """A save that reads back what it wrote (TP: column blocks, rows at a stride; on a GPU: shards staged through
    pinned host buffers) passes and writes the file the default save writes."""
    path = str(tmp_path / "ckpt.safetensors")
    results = run_ranks(_saved_twice, world_size, path, name, how, backend=backend)
    first, second, same_sums, timings = results[0]
    assert first == second  # apart from the set id of a sharded set, a save is deterministic: byte for byte
    assert all(r[2] for r in results) and "verify" in timings, timings
    with pytest.raises(SaveError, match="TypeError: verify_checksums must be True or False, not 'yes'"):
        save_sharded(torch.nn.Linear(2, 2), str(tmp_path / "x.safetensors"), verify_checksums="yes")


def _interrupted(rank, world_size, path):
    import time

    model, opt, extra = _old_checkpoint(rank, world_size, path, "fsdp2")
    if rank == 1:
        def interrupt(fd, data, offset):
            raise KeyboardInterrupt

        os.pwrite = interrupt  # Ctrl-C (or a signal handler's KeyboardInterrupt) on this rank, mid-write
    t0 = time.perf_counter()
    try:
        save_sharded(model, path, optimizer=opt, extra=extra)
    except KeyboardInterrupt as e:
        return "KeyboardInterrupt", str(e), time.perf_counter() - t0
    except SaveError as e:
        return "SaveError", str(e), time.perf_counter() - t0
    return "saved", "", time.perf_counter() - t0


def test_an_interrupted_rank_fails_every_rank_at_once(tmp_path):
    """A KeyboardInterrupt on one rank left it at once while the others waited in the verdict until the process
    group's timeout (30 minutes by default): now every rank has the verdict, and that rank is still interrupted."""
    path = str(tmp_path / "ckpt.safetensors")
    results = run_ranks(_interrupted, 2, path, pg_timeout=120)
    assert [kind for kind, _, _ in results] == ["SaveError", "KeyboardInterrupt"], results
    assert all("KeyboardInterrupt: interrupted on this rank [rank 1]" in text for _, text, _ in results), results
    assert max(seconds for _, _, seconds in results) < 30, results
    assert not _leftovers(path)


def _reader_during_replacement(rank, world_size, path):
    import hashlib

    model, opt, extra = _old_checkpoint(rank, world_size, path, "fsdp2")
    seen: list[str] = []
    stop = threading.Event()

    def read_loop():
        while not stop.is_set():
            with open(path, "rb") as f:  # what a reader opening the name gets: one whole file
                seen.append(hashlib.sha256(f.read()).hexdigest())

    old = hashlib.sha256(open(path, "rb").read()).hexdigest() if rank == 0 else ""
    reader = threading.Thread(target=read_loop)
    if rank == 0:
        reader.start()
    written = {old}
    for step in range(3):  # a few replacements while the reader reads
        save_sharded(model, path, optimizer=opt, extra=dict(extra, step=100 + step))
        if rank == 0:
            written.add(hashlib.sha256(open(path, "rb").read()).hexdigest())
    if rank == 0:
        stop.set()
        reader.join()
        assert len(written) == 4 and old in seen and len(seen) > 3, len(seen)
        assert set(seen) <= written, "a reader saw a file that is neither an old nor a new checkpoint"
        assert fsdp_restore.load(path)["step"] == 102
    return True


def test_concurrent_reader_sees_old_or_new(tmp_path):
    run_ranks(_reader_during_replacement, 2, str(tmp_path / "ckpt.safetensors"))


def _bad_arguments(rank, world_size, path):
    model = wrap(build("mlp"), "fsdp2", world_size)
    texts = []
    for kwargs in ({"thread_count": 0}, {"extra": [1, 2]}, {"max_shard_size": "lots"}):
        with pytest.raises(SaveError) as info:
            save_sharded(model, path, **kwargs)
        texts.append(str(info.value))
    for bad in (None, 3):  # the same SaveError on every rank (it was a raw TypeError before any agreement)
        with pytest.raises(SaveError, match=f"path must be a str or os.PathLike, not {type(bad).__name__}"):
            save_sharded(model, bad)
    with pytest.raises(SaveError, match=r"swapped: the call is save_sharded\(model, path, optimizer=optimizer\)"):
        save_sharded(torch.optim.SGD(model.parameters()), path, optimizer=model)  # the restore's door check too
    # torch's ZeroRedundancyOptimizer keeps its state in each rank's partition (.optim), none in .state: saved as
    # an optimizer with no state, and restored into state its steps never read, both without an error
    from torch.distributed.optim import ZeroRedundancyOptimizer

    plain = torch.nn.Linear(3, 2)
    zero = ZeroRedundancyOptimizer(plain.parameters(), optimizer_class=torch.optim.AdamW)
    for call in (lambda: save_sharded(plain, path, optimizer=zero),
                 lambda: fsdp_restore.restore(plain, path, optimizer=zero),
                 lambda: fsdp_restore.restore_optimizer(zero, plain, path)):
        with pytest.raises((SaveError, fsdp_restore.RestoreError),
                           match=r"ZeroRedundancyOptimizer is not supported: .*use the plain"):
            call()
    if os.path.isdir("/sys/kernel"):  # a directory no one may create in: said of it, not of our temporary
        with pytest.raises(SaveError, match=r"cannot create files in /sys \(.*\): .*give a destination in a"):
            save_sharded(model, "/sys/x.safetensors")
    with pytest.raises(TypeError):
        save_sharded(model, path, None)  # options are keyword-only
    # a group that is not one: said at the door, on every rank that passed it (torch's own error for "WORLD" speaks
    # of a group not registered)
    for call in (lambda: save_sharded(model, path, process_group="WORLD"),
                 lambda: fsdp_restore.restore_model(model, path, process_group="WORLD"),
                 lambda: fsdp_restore.restore(model, path, process_group="WORLD"),
                 lambda: fsdp_restore.restore_optimizer(torch.optim.SGD(model.parameters()), model, path,
                                                        process_group="WORLD")):
        with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup .* not str"):
            call()
    assert not os.path.exists(path) and not _leftovers(path)
    run_dir = os.path.join(os.path.dirname(path), "run")  # a directory of the user's files: never replaced
    if rank == 0:
        os.makedirs(run_dir)
        open(os.path.join(run_dir, "notes.txt"), "w").write("keep")
    torch.distributed.barrier()
    with pytest.raises(SaveError) as info:
        save_sharded(model, run_dir)
    texts.append(str(info.value))
    assert open(os.path.join(run_dir, "notes.txt")).read() == "keep" and os.listdir(run_dir) == ["notes.txt"]
    in_the_way = os.path.join(run_dir, "notes.txt")  # a file where the path needs a directory: named, with the fix
    with pytest.raises(SaveError, match=f"cannot create the directory {in_the_way}: {in_the_way} is a file, not a"):
        save_sharded(model, os.path.join(in_the_way, "x.safetensors"))
    return texts


def test_arguments_are_checked_at_the_door(tmp_path):
    results = run_ranks(_bad_arguments, 2, str(tmp_path / "x.safetensors"))
    assert results[0] == results[1]
    assert "thread_count" in results[0][0] and "extra must be a dict" in results[0][1] and "size" in results[0][2]
    assert "holding more than a sharded checkpoint (notes.txt)" in results[0][3]
    assert not any("could not be pickled" in text for text in results[0])  # one problem, not a false second one


def _split_replicas(rank, world_size, root, name, how):
    import fsdp_restore.save_plan as save_plan

    save_plan.SPLIT_MIN_BYTES = 0  # every replicated piece cut into one part per replica (rows for column blocks)
    return _save_and_check(rank, world_size, root, name, how, "full")


SPLIT = [("mlp", "ddp", 3), ("mlp", "hsdp", 4), ("llama", "fsdp2+tp", 4)]


@pytest.mark.parametrize("name,how,world_size", SPLIT, ids=[f"{n}-{h}-{w}" for n, h, w in SPLIT])
def test_replicas_share_the_writes_of_replicated_pieces(tmp_path, name, how, world_size):
    results = run_ranks(_split_replicas, world_size, str(tmp_path), name, how)
    written = [w for w, _ in results]
    assert sum(written) == results[0][1]
    assert min(written) > 0, written  # every replica writes its part (rank 0 also the RNG states, step...)


def _killed(rank, world_size, path, dying):
    model, opt, extra = _old_checkpoint(rank, world_size, path, "fsdp2")
    if rank == dying:
        def dies(fd, data, offset):
            os._exit(3)  # killed mid-write: no exception, no goodbye

        os.pwrite = dies
    save_sharded(model, path, optimizer=opt, extra=extra)


@pytest.mark.parametrize("dying", [1, 0])
def test_killed_rank_leaves_the_old_checkpoint(tmp_path, dying):
    """A rank killed mid-write: the survivors fail with the save's error, and the temporary is removed by a
    survivor, also when the killed rank is rank 0, which created it."""
    path = str(tmp_path / "ckpt.safetensors")
    import time

    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as info:
        run_ranks(_killed, 2, path, dying, pg_timeout=10, timeout=90)
    assert f"rank {dying}" in str(info.value)
    # the survivor's error is the save's own, saying what happened (not gloo's socket text alone)
    assert "SaveError" in str(info.value) and "a rank died or lost its connection" in str(info.value), info.value
    assert time.perf_counter() - t0 < 80
    assert not _leftovers(path), _leftovers(path)  # a survivor removed the temporary when its collective failed
    fsdp_restore.verify(path)
    assert fsdp_restore.load(path)["step"] == 2


def _dies_after_the_rename(rank, world_size, path):
    import time

    import fsdp_restore.sharded_save as sharded_save

    model, opt, extra = _old_checkpoint(rank, world_size, path, "fsdp2")
    old_version = fsdp_restore.Checkpoint(path).version
    if rank == 1:
        real_agree = sharded_save._agree

        def dies_once_renamed(problems, what, *args, **kwargs):
            if what == "save_sharded (commit)":
                while fsdp_restore.Checkpoint(path).version == old_version:  # rank 0 renames, then agrees
                    time.sleep(0.01)
                os._exit(3)
            return real_agree(problems, what, *args, **kwargs)

        sharded_save._agree = dies_once_renamed
    with pytest.raises(fsdp_restore.SaveError) as info:
        save_sharded(model, path, optimizer=opt, extra=dict(extra, step=3))
    with open(f"{path}.rank{rank}.txt", "w") as f:  # what rank 0 returns is lost: rank 1 fails the run
        f.write(str(info.value))


def test_a_rank_dying_after_the_rename_is_not_reported_as_an_untouched_checkpoint(tmp_path):
    """Rank 1 dies once rank 0 has put the new file in place: rank 0's error says the new checkpoint is there and
    whole (it said the old one was untouched), and it is."""
    path = str(tmp_path / "ckpt.safetensors")
    with pytest.raises(AssertionError) as info:
        run_ranks(_dies_after_the_rename, 2, path, pg_timeout=10, timeout=90)
    assert "rank 1 ---\ndied with exit code 3" in str(info.value), info.value
    text = open(f"{path}.rank0.txt").read()
    assert "a rank died" in text and "the new checkpoint is in place and whole" in text, text
    assert "is untouched" not in text
    assert fsdp_restore.verify(path).ok and not _leftovers(path)
    assert fsdp_restore.load(path)["step"] == 3  # the second save's, not the first's (2)


def _memory(rank, world_size, path):
    from fsdp_restore.measure import PeakAnonMemory

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])  # ~100 MB of fp32
    model = wrap(model, "ddp", world_size)
    with PeakAnonMemory(interval=0.005) as mem:
        report = save_sharded(model, path)
    return mem.peak - mem.start, report.bytes_written, report.nbytes


def test_memory_stays_flat_and_replicas_split_large_tensors(tmp_path):
    """DDP: every 4 MB weight is cut between the two replicas; no rank copies its shard or a tensor."""
    path = str(tmp_path / "big.safetensors")
    results = run_ranks(_memory, 2, path)
    total = results[0][2]
    assert sum(w for _, w, _ in results) == total
    assert all(abs(w - total / 2) < 0.01 * total for _, w, _ in results), results  # each writes half
    assert max(m for m, _, _ in results) < 24 * 2**20, results  # vs 100 MB of tensors
    torch.manual_seed(0)
    expected = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    loaded = fsdp_restore.load(path)
    for k, v in expected.state_dict().items():
        assert torch.equal(loaded[k], v), k


def _extra_memory(rank, world_size, path):
    from fsdp_restore.measure import PeakAnonMemory

    model = wrap(torch.nn.Linear(4, 4), "ddp", world_size)
    extra = {"blob": torch.arange(8 * 2**20, dtype=torch.float32)} if rank == 0 else None  # 32 MB
    with PeakAnonMemory(interval=0.002) as mem:
        save_sharded(model, path, extra=extra)
    return mem.peak - mem.start


def test_rank_0s_extra_costs_each_rank_the_same_at_any_world_size(tmp_path):
    """extra travels from rank 0 by broadcast: each rank holds it a few times over, not once per rank (an
    all-gather gives every rank a slot of rank 0's size per rank: at 1024 ranks, a 32 MB extra would be 32 GB)."""
    path = str(tmp_path / "x.safetensors")
    grown = run_ranks(_extra_memory, 4, path)
    assert max(grown) < 6 * 32 * 2**20, [g / 2**20 for g in grown]  # an all-gather of 4 slots took 8-10x here
    assert torch.equal(fsdp_restore.load(path)["blob"], torch.arange(8 * 2**20, dtype=torch.float32))


def _optimizer_on_rank_0_only(rank, world_size, path):
    model = wrap(torch.nn.Linear(4, 4), "ddp", world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        save_sharded(model, path, optimizer=opt if rank == 0 else None, verify_checksums=rank == 1)
    except SaveError as e:
        return str(e)
    return "saved"


def test_ranks_given_different_arguments_are_told_which(tmp_path):
    path = str(tmp_path / "x.safetensors")
    texts = run_ranks(_optimizer_on_rank_0_only, 3, path)
    assert len(set(texts)) == 1, texts  # the same error on every rank
    text = texts[0]
    assert "different arguments" in text and "optimizer: given on rank 0; None on ranks 1, 2" in text, text
    assert "verify_checksums: False on ranks 0, 2; True on rank 1" in text, text
    assert not os.path.exists(path) and not _leftovers(path)


def _only_rank_0_saves(rank, world_size, path):
    model = wrap(torch.nn.Linear(4, 4), "ddp", world_size)
    try:
        if rank == 0:
            save_sharded(model, path)
        else:
            torch.distributed.barrier()  # as after `if rank == 0: save_sharded(...)`
    except Exception as e:  # noqa: BLE001 - what each rank is told
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_save_that_only_some_ranks_call_says_every_rank_must_call_it(tmp_path):
    """The ranks that are not in the call wait elsewhere; the process group's timeout ends the wait, and the
    save's error says what a user most likely did, not only that a rank may have died."""
    path = str(tmp_path / "x.safetensors")
    texts = run_ranks(_only_rank_0_saves, 2, path, pg_timeout=5, timeout=120)
    assert texts[0].startswith("SaveError") and "every rank" in texts[0] and "must call" in texts[0], texts[0]
    assert not os.path.exists(path) and not _leftovers(path)


def _column_block(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 700, bias=False))  # weight [700, 16]: Shard(1), 700 rows each
    full = model[0].weight.detach().clone()
    parallelize_module(model, init_device_mesh("cpu", (world_size,)), {"0": RowwiseParallel()})
    save_sharded(model, path)
    return full


def test_a_column_block_of_many_rows_is_written_with_its_checksum(tmp_path):
    """Hundreds of rows per rank at a stride: their crc32s fold by table lookups (the restore's fold), and the
    joined checksum is zlib's of the whole tensor."""
    import zlib

    from safetensors.torch import load_file

    path = str(tmp_path / "col.safetensors")
    full = run_ranks(_column_block, 2, path)[0]
    assert torch.equal(load_file(path)["0.weight"], full)
    from fsdp_restore.read import Checkpoint

    assert Checkpoint(path).checksums["0.weight"] == f"{zlib.crc32(full.numpy().tobytes()):08x}"
    assert fsdp_restore.verify(path).ok


def test_crc_of_pieces_folded_in_any_order_is_zlibs():
    """A tensor's crc32 from the ranks' pieces (ranges and rows at a stride, folded in any order), as zlib's."""
    import zlib

    from fsdp_restore.checksum import zeros_crc
    from fsdp_restore.sharded_save import _Crc

    rng = random.Random(0)
    for n in (1, 7, 1000, 70_000):
        buf = bytes(rng.randrange(256) for _ in range(n))
        pieces = []  # (offset, row bytes, rows, stride) tiling buf
        at = 0
        while at < n:
            if n - at > 200 and rng.random() < 0.5:  # a column block: 4 rows of 20 bytes, 50 apart, plus the gaps
                pieces.append((at, 20, 4, 50))
                pieces += [(at + 20 + 50 * i, 30, 1, 0) for i in range(3)] + [(at + 170, 30, 1, 0)]
                at += 200
            else:
                step = min(n - at, rng.randrange(1, 5000))
                pieces.append((at, step, 1, 0))
                at += step
        rng.shuffle(pieces)
        folds = [_Crc() for _ in range(3)]  # three "ranks"
        for i, (o, run, rows, stride) in enumerate(pieces):
            crcs = [zlib.crc32(buf[o + r * stride:o + r * stride + run]) for r in range(rows)]
            folds[i % 3].add("t", crcs, run, stride, n - (o + (rows - 1) * stride + run))
        joined = 0
        for f in folds:
            joined ^= f.folds.get("t", 0)
        assert joined ^ zeros_crc(n) == zlib.crc32(buf), n


def test_the_package_exports():
    import inspect

    assert inspect.isfunction(fsdp_restore.save) and inspect.isfunction(fsdp_restore.save_sharded)
    assert fsdp_restore.SaveReport is not None and issubclass(SaveError, fsdp_restore.FsdpRestoreError)
    params = inspect.signature(save_sharded).parameters
    assert [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY] == [
        "optimizer", "extra", "process_group", "max_shard_size", "thread_count", "on_unsupported", "verify_checksums",
        "ignore_frozen_params"]


def test_preallocate_reserves_the_size(tmp_path):
    from fsdp_restore.sharded_save import preallocate

    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        preallocate(fd, 3 << 20)
        st = os.fstat(fd)
        assert st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20  # allocated, not sparse
    finally:
        os.close(fd)


def _unshaped_state(rank, world_size, path):
    model, opt, _ = _trained("mlp", "fsdp1-FULL_SHARD-flat", world_size)
    for state in opt.state.values():
        state["row_factor"] = torch.ones(3)  # Adafactor-like: each rank's own, not laid out like the parameter
    with pytest.raises(SaveError) as info:
        save_sharded(model, path, optimizer=opt)
    assert not os.path.exists(path) and not _leftovers(path)
    return str(info.value)


def test_state_not_laid_out_like_a_sharded_parameter_is_refused(tmp_path):
    texts = run_ranks(_unshaped_state, 2, str(tmp_path / "x.safetensors"))
    assert texts[0] == texts[1] and "row_factor" in texts[0] and "not laid out like its sharded" in texts[0]


class _PreScaled(torch.nn.Linear):
    """Holds its weight pre-scaled; state_dict() gives the true one (as quantized and packed layers do)."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight.detach() * 2


def test_a_model_whose_state_dict_is_not_what_it_holds_is_refused(tmp_path):
    """Its raw parameters were written as the state dict, without a word (the file's keys and values were not
    what state_dict() gives); torch's own hooks (FSDP's, the checkpoint wrapper's) are not refused."""
    from safetensors.torch import load_file
    from torch import nn

    renamed = nn.Linear(2, 2)
    renamed._register_state_dict_hook(lambda module, sd, prefix, local: sd.update(
        {prefix + "kernel": sd.pop(prefix + "weight")}))
    model = nn.Sequential(_PreScaled(3, 2), renamed, nn.Linear(2, 2))
    assert model.state_dict()["0.weight"].sum() != model[0].weight.sum() and "1.kernel" in model.state_dict()
    with pytest.raises(SaveError, match=r"modules whose state_dict\(\) is not what they hold \(2\): 0 \(_PreScaled"
                                        r" overrides _save_to_state_dict\); 1 \(a state_dict hook of test_save\)"):
        save_sharded(model, tmp_path / "x.safetensors")
    assert os.listdir(tmp_path) == []
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)))  # its hook strips its own prefix: names kept
    save_sharded(wrapped, tmp_path / "x.safetensors")
    assert list(load_file(tmp_path / "x.safetensors")) == list(wrapped.state_dict())


class _MetricLike(torch.nn.Module):
    """Overrides state_dict() as torchmetrics' Metric does: its states are given only where persistent ("adds"), and
    here also one that drops a buffer ("drops"); "passes" gives exactly what it holds (non-persistent states)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("total", torch.ones(3))
        self.count = torch.tensor(4)  # a metric state, not a buffer

    def state_dict(self, *, destination=None, prefix="", keep_vars=False):
        out = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.how == "drops":
            out.pop(prefix + "total")
        elif self.how == "adds":
            out[prefix + "count"] = self.count
        return out


@pytest.mark.parametrize("how", ["drops", "adds", "passes"])
def test_a_class_overriding_state_dict_is_refused_unless_it_gives_what_it_holds(tmp_path, how):
    """A module whose state_dict() drops a buffer had it written anyway, and one that adds a state had it left out:
    the file was not its state dict. Refused then; saved where its state_dict() is what it holds."""
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), _MetricLike(how))
    oracle = model.state_dict()  # torch's
    if how == "passes":
        save_sharded(model, tmp_path / "x.safetensors")
        saved = load_file(tmp_path / "x.safetensors")
        assert list(saved) == list(oracle) and all(torch.equal(saved[k], v) for k, v in oracle.items())
        return
    assert list(oracle) == (["0.weight", "0.bias"] if how == "drops" else ["0.weight", "0.bias", "1.total", "1.count"])
    with pytest.raises(SaveError, match=r"\(1\): 1 \(_MetricLike overrides state_dict\)"):
        save_sharded(model, tmp_path / "x.safetensors")
    assert os.listdir(tmp_path) == []


def _nested_state(rank, world_size, path, kind):
    model, opt, _ = _trained("mlp", "fsdp2", world_size)
    for p, state in opt.state.items():
        own = p.to_local().sum(1) if p.dim() == 2 else p.to_local().clone()  # each rank's, as a preconditioner's
        if kind == "plain":
            state["m"] = p.to_local().clone()
            continue
        state["pre"] = {"L": [own] if kind == "list" else torch.zeros_like(p) if kind == "dtensor" else own,
                        "count": torch.tensor(2)}  # (a 0-dim value is the same on every rank: written)
    with pytest.raises(SaveError) as info:
        save_sharded(model, path, optimizer=opt)
    assert not os.path.exists(path) and not _leftovers(path)
    return str(info.value)


@pytest.mark.parametrize("kind", ["dict", "list", "dtensor", "plain"])
def test_a_sharded_parameters_own_state_within_a_dict_or_list_is_refused(tmp_path, kind):
    """Each rank's own tensors one level down (Shampoo-like preconditioners) were written as rank 0's copy with no
    error, where the same tensor at the top level was refused; a DTensor there was refused as an unsupported
    object with the advice to skip it; a plain tensor shaped like the local shard as 'not laid out like' it."""
    texts = run_ranks(_nested_state, 2, str(tmp_path / "x.safetensors"), kind)
    assert texts[0] == texts[1]
    expected = {"dict": r"optim\.state\.\d+\.pre\.L \(.*\): state of shape .* is each rank's own",
                "list": r"optim\.state\.\d+\.pre\.L\.0 \(.*\): state of shape .* is each rank's own",
                "dtensor": r"optim\.state\.\d+\.pre\.L \(.*\): a DTensor within a parameter's optimizer state",
                "plain": r"optim\.state\.\d+\.m \(.*\): a plain tensor shaped like this rank's shard"}[kind]
    assert re.search(expected, texts[0]), texts[0]


def test_a_save_error_counts_what_the_ranks_reported_and_says_what_it_leaves_out():
    """The save's words for the verdict kept its own count (the texts shown) and cut the list at 20 silently."""
    from fsdp_restore.errors import RestoreError
    from fsdp_restore.sharded_save import _save_error

    names = [f"w{i}" for i in range(25)]
    error = _save_error(RestoreError("x", {"missing": names}, {"missing": (30, True)}), "save_sharded (plan)")
    text = str(error)
    assert "(30): w0, w1" in text and "w19, ... (10 more)" in text and "w20" not in text, text
    assert error.counts == {"missing": (30, True)}
    uncovered = [f"c{i} (elements written)" for i in range(30)]
    text = str(_save_error(RestoreError("x", {"coverage": uncovered}), "save_sharded (plan)"))
    assert "exactly once (30): c0, c1" in text and "c19, ... (10 more)" in text and "c20" not in text, text


def _step_counters(rank, world_size, path, optimizer, restored):
    """FSDP1 with use_orig_params: a rank holding none of a parameter's elements never steps its state; Adagrad
    makes state for every parameter up front, and a restore installs it on every rank."""
    model = wrap(build("mlp"), "fsdp1-FULL_SHARD-orig", world_size)
    opt = {"adagrad": torch.optim.Adagrad, "adamw": torch.optim.AdamW}[optimizer](model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)

    def steps(n: int) -> None:
        for _ in range(n):
            model(torch.randn(4, 7, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    steps(2)
    if restored:  # save, restore into the same model and optimizer, go on: the empty ranks' counters now exist
        save_sharded(model, path, optimizer=opt)
        fsdp_restore.restore(model, path, opt)
        steps(2)
    empty = [n for n, p in model.named_parameters() if p.numel() == 0]
    save_sharded(model, path, optimizer=opt)
    return empty


@pytest.mark.parametrize("optimizer,restored", [("adagrad", False), ("adamw", True)], ids=["adagrad", "resumed"])
def test_step_counters_come_from_a_rank_that_holds_the_parameter(tmp_path, optimizer, restored):
    """The counter was taken from the lowest rank holding the state: one holding none of the elements, whose
    counter stays where it was (0 for Adagrad; 2 after a resume that went on to 4): Adam's bias correction of
    the resumed run was silently wrong. The saved file is read with safetensors' own reader."""
    from safetensors import safe_open

    path = tmp_path / "ck.safetensors"
    empty = run_ranks(_step_counters, 3, str(path), optimizer, restored)
    assert any(empty), "no rank holds an empty parameter: the test proves nothing"
    with safe_open(str(path), "pt") as f:
        steps = {k: float(f.get_tensor(k)) for k in f.keys() if k.endswith(".step")}
    assert steps and set(steps.values()) == {4.0 if restored else 2.0}, steps


def _compiled_ddp(rank, world_size, path):
    model = torch.compile(torch.nn.parallel.DistributedDataParallel(build("mlp", seed=1)), backend="eager")
    save_sharded(model, path)
    fresh = torch.compile(torch.nn.parallel.DistributedDataParallel(build("mlp", seed=2)), backend="eager")
    fsdp_restore.restore_model(fresh, path)
    return all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_a_compiled_ddp_model_saves_its_plain_names(tmp_path):
    """torch.compile(DDP(model)) saved 'module.'-prefixed keys: from_pretrained initialised every weight afresh
    (with a warning only), a plain model's load_state_dict refused them. safetensors' own reader is the oracle."""
    from safetensors.torch import load_file

    path = tmp_path / "w.safetensors"
    assert all(run_ranks(_compiled_ddp, 2, str(path)))
    saved = load_file(str(path))
    expected = build("mlp", seed=1).state_dict()
    assert sorted(saved) == sorted(expected) and all(torch.equal(saved[k], v) for k, v in expected.items())


class _Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.register_buffer("big", torch.zeros(2**20 + 3))  # over SPLIT_MIN_BYTES: replicas used to split it


def _ddp_buffers(rank, world_size, path):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Normed())
    model.module.big.fill_(float(rank))  # each rank's own, as a forward leaves BatchNorm's statistics
    model.module.bn(torch.randn(5, 8, generator=torch.Generator().manual_seed(rank)) * (rank + 1))
    save_sharded(model, path)
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def test_replicas_of_a_buffer_that_differ_are_saved_as_rank_0s(tmp_path):
    """DDP ranks hold their own BatchNorm statistics after a forward: the save wrote running_mean from one rank
    and running_var from another (writers chosen by name), a large buffer half from each. The file now holds
    rank 0's buffers, as a gather to rank 0 would; read with safetensors' own reader."""
    from safetensors.torch import load_file

    path = tmp_path / "w.safetensors"
    states = run_ranks(_ddp_buffers, 2, str(path))
    assert not torch.equal(states[0]["bn.running_var"], states[1]["bn.running_var"])  # the ranks really differ
    saved = load_file(str(path))
    assert sorted(saved) == sorted(states[0]) and all(torch.equal(saved[k], v) for k, v in states[0].items())


def _own_name(rank, world_size, root):
    model = wrap(build("mlp"), "fsdp2", world_size)
    with pytest.raises(SaveError) as info:
        save_sharded(model, os.path.join(root, f"ck{rank}.safetensors"))
    return str(info.value)


def test_ranks_given_different_destinations_are_refused(tmp_path):
    """A path computed on each rank: one file was written, under rank 0's name, and rank 1 reported success for
    a file that does not exist."""
    texts = run_ranks(_own_name, 2, str(tmp_path))
    assert texts[0] == texts[1] and "the ranks were given different destinations" in texts[0], texts
    assert os.listdir(tmp_path) == []


def _extra_and_late_state(rank, world_size, root):
    """A parameter that gets no gradient on the first step (state created later), and an extra whose tensors share
    memory or have dtypes Python's pickle cannot carry between ranks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    plain = type(model)(*[torch.nn.Linear(m.in_features, m.out_features) for m in model])
    plain.load_state_dict(model.state_dict())
    if world_size > 1:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizers = [torch.optim.AdamW(m.named_parameters(), lr=0.1) for m in (model, plain)]
    for step in range(2):
        for m, opt in zip((model, plain), optimizers):
            m(torch.ones(2, 6)).sum().backward()
            if step == 0:
                for p in m[0].parameters():  # no gradient on the first step: its state comes after the others'
                    p.grad = None
            opt.step()
            opt.zero_grad()
    base = torch.arange(12.0)
    extra = {"flat": base, "w": base.view(3, 4), "amax": torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn),
             "ids": torch.tensor([1, 2], dtype=torch.uint16)}
    path = os.path.join(root, f"ws{world_size}.safetensors")
    save_sharded(model, path, optimizer=optimizers[0], extra=extra)
    if rank == 0:
        torch.save({"model": dict(plain.state_dict()), "optim": optimizers[1].state_dict(), **extra},
                   os.path.join(root, f"ws{world_size}.pt"))
    dist.barrier()
    return path


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_in_torchs_order_and_any_extra_torch_saves(tmp_path, world_size):
    """The optimizer's state was written in id order where torch's state_dict keeps the order its parameters first
    got state (a parameter without a gradient on the first step: an unused branch, an MoE expert), so verify found
    the keys in another order; rank 0's extra reached the other ranks by Python's pickle, which loses shared memory
    (the ranks' headers then differed) and cannot carry float8 or uint16 tensors."""
    path = run_ranks(_extra_and_late_state, world_size, str(tmp_path))[0]
    report = fsdp_restore.verify(path, against=tmp_path / f"ws{world_size}.pt")
    assert report.verdict == "identical", report.problems
    back = fsdp_restore.load(path)
    assert back["w"].data_ptr() == back["flat"].data_ptr() and list(back["optim"]["state"]) == [2, 3, 4, 5, 0, 1]


def test_an_extra_value_the_format_cannot_hold_may_be_skipped(tmp_path):
    """The error's advice (on_unsupported='skip') was an argument save_sharded did not take."""
    import datetime

    extra = {"when": datetime.date(2024, 1, 1), "step": 3}
    refused = run_ranks(_save_with_extra, 1, str(tmp_path / "a.safetensors"), extra, "error")[0]
    assert "on_unsupported='skip'" in refused and not (tmp_path / "a.safetensors").exists()
    assert run_ranks(_save_with_extra, 1, str(tmp_path / "a.safetensors"), extra, "skip")[0] == "saved"
    back = fsdp_restore.load(tmp_path / "a.safetensors")
    assert back["when"] is None and back["step"] == 3
    with pytest.raises(SaveError, match="on_unsupported must be 'error' or 'skip', not 'drop'"):
        save_sharded(torch.nn.Linear(2, 2), tmp_path / "b.safetensors", on_unsupported="drop")


def _save_with_extra(rank, world_size, path, extra, on_unsupported):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            save_sharded(torch.nn.Linear(2, 2), path, extra=extra, on_unsupported=on_unsupported)
        except SaveError as e:
            return str(e)
    assert any("skipped" in str(w.message) for w in caught)
    return "saved"



def _save_extra_returning_error(rank, world_size, path, extra):
    if extra == "unsaveable":
        extra = {"f": _Local(), "step": 1}
    try:
        save_sharded(torch.nn.Linear(2, 2), path, extra=extra)
    except SaveError as e:
        return str(e)
    return "saved"


def test_extra_is_planned_from_what_travelled_and_an_unsaveable_value_is_named(tmp_path):
    """Rank 0 planned from its own extra and the others from the copy that travelled: a set, rebuilt by unpickling,
    may iterate in another order, so the ranks' headers differed. A value torch.save cannot write (a lambda) gave
    pickle's error without the key."""
    results = run_ranks(_save_extra_returning_error, 2, str(tmp_path / "s.safetensors"), {"s": {9, 2}, "step": 1})
    assert results == ["saved", "saved"]
    assert fsdp_restore.load(tmp_path / "s.safetensors")["s"] == {9, 2}
    results = run_ranks(_save_extra_returning_error, 2, str(tmp_path / "l.safetensors"), "unsaveable")
    assert all("extra['f'] cannot be saved" in text for text in results), results


class _Local:
    def __reduce__(self):
        raise TypeError("cannot pickle this")


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4) + 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _mixed_precision_buffers(rank, world_size, path):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = FSDP(_Scaled(), device_id=torch.device("cpu"), mixed_precision=MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16))
    model(torch.randn(2, 4)).sum().backward()  # the first forward casts the buffers to bfloat16
    assert model._fsdp_wrapped_module.scale.dtype == torch.bfloat16
    save_sharded(model, path)
    expected = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            for key, value in expected.items():
                got = f.get_tensor(key)
                assert got.dtype == value.dtype and torch.equal(got, value), key


def test_fsdp1_buffers_in_mixed_precision_are_saved_as_its_state_dict_gives_them(tmp_path):
    """FSDP1 with a buffer_dtype holds its buffers in that dtype after a forward; its state dict gives them in their
    dtype before (float32 here): the save stored them as bfloat16."""
    run_ranks(_mixed_precision_buffers, 2, str(tmp_path / "mp.safetensors"))


class _WithExtraState(torch.nn.Linear):
    """A module with state beside its tensors, as TransformerEngine's FP8 modules have (their scaling history)."""

    def get_extra_state(self):
        return {"amax_history": self.history.clone(), "recipe": "delayed"}

    def set_extra_state(self, state):
        self.history = state["amax_history"].clone()
        self.loaded_extra = state


class _ExtraStateNet(torch.nn.Module):
    def __init__(self, rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fp8 = _WithExtraState(6, 6)
        self.fp8.history = torch.arange(4.0) + 10 * rank  # each rank's own: the file holds rank 0's
        self.out = torch.nn.Linear(6, 3)


def _extra_state_round_trip(rank, world_size, root, how):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def sharded(seed_rank: int) -> torch.nn.Module:
        model = _ExtraStateNet(seed_rank)
        if how == "ddp":
            return torch.nn.parallel.DistributedDataParallel(model)
        if how == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({_WithExtraState}), device_id=torch.device("cpu"))
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.fp8)
        return fully_shard(model)

    model = sharded(rank)
    path = os.path.join(root, f"{how}.safetensors")
    save_sharded(model, path, extra={"step": 7})
    if how == "fsdp1":  # torch's get_model_state_dict fails on an FSDP1 module's extra state: FSDP1's own gather
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            expected = dict(model.state_dict())  # (an OrderedDict; get_model_state_dict gives a dict)
    else:
        expected = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:  # byte for byte what a conversion of torch's own gather writes, the extra state included
        assert list(expected) == ["fp8.weight", "fp8.bias", "fp8._extra_state", "out.weight", "out.bias"]
        torch.save({"model": expected, "step": 7}, os.path.join(root, f"{how}-ref.pt"))
        fsdp_restore.convert(os.path.join(root, f"{how}-ref.pt"), os.path.join(root, f"{how}-ref.safetensors"))
        assert_same_files(path, os.path.join(root, f"{how}-ref.safetensors"))
    torch.distributed.barrier()
    # and back: every rank's module is given rank 0's state, as torch's load_state_dict gives it the stored one
    oracle = _ExtraStateNet(5)
    oracle.load_state_dict(torch.load(os.path.join(root, f"{how}-ref.pt"), weights_only=True)["model"])
    fresh = sharded(3)
    fsdp_restore.restore(fresh, path)
    inner = fresh.module if how == "ddp" else fresh
    fp8 = inner.fp8._fsdp_wrapped_module if how == "fsdp1" else inner.fp8
    assert fp8.loaded_extra["recipe"] == oracle.fp8.loaded_extra["recipe"] == "delayed"
    assert torch.equal(fp8.history, oracle.fp8.history) and torch.equal(fp8.history, torch.arange(4.0))


@pytest.mark.parametrize("how", ["fsdp2", pytest.param("fsdp1", marks=pytest.mark.slow),
                                 pytest.param("ddp", marks=pytest.mark.slow)])
def test_module_extra_state_is_saved_and_restored(tmp_path, how):
    """A module's get_extra_state() value was dropped by the save (a model with FP8 modules lost their scaling
    state without a word), and the restore refused the file torch.save of its state dict converts to."""
    run_ranks(_extra_state_round_trip, 2, str(tmp_path), how)


def _into_a_model_directory(rank, world_size, root):
    model = wrap(build("mlp"), "fsdp2", world_size)
    target = os.path.join(root, "hf")
    if rank == 0:
        os.makedirs(target)
        with open(os.path.join(target, "config.json"), "w") as f:
            f.write('{"model_type": "mlp"}')
    torch.distributed.barrier()
    save_sharded(model, target, max_shard_size=10_000)
    expected = full_state(model, "fsdp2")
    if rank == 0:
        assert open(os.path.join(target, "config.json")).read() == '{"model_type": "mlp"}'
        loaded = fsdp_restore.load(target)
        assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], v) for k, v in expected.items())
    return sorted(os.listdir(target))


def test_a_set_of_shards_saved_into_a_model_directory_keeps_its_config(tmp_path):
    """save_sharded(max_shard_size=) into a Hugging Face model directory holding its config.json was refused."""
    names = run_ranks(_into_a_model_directory, 2, str(tmp_path))[0]
    assert "config.json" in names and "model.safetensors.index.json" in names and len(names) >= 3, names


def _root_left_unsharded(rank, world_size, path, drift, how):
    """FSDP2 on the blocks only (the root's parameters stay plain tensors on every rank), or DDP."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = build("llama")
    if how == "fsdp2-blocks":
        for block in model.model.layers:
            fully_shard(block)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    core = model.module if how == "ddp" else model
    if drift:  # what training does to parameters whose gradients no rank all-reduces
        with torch.no_grad():
            core.model.norm.weight.add_(rank)
            core.lm_head.weight.mul_(1 + rank)
    try:
        save_sharded(model, path)
    except SaveError as e:
        assert not os.path.exists(path) and not _leftovers(path)
        return str(e)
    return None


@pytest.mark.parametrize("drift", [True, False], ids=["drifted", "equal"])
def test_replicated_parameters_that_differ_between_ranks_are_refused(tmp_path, drift):
    """A root left outside fully_shard keeps plain parameters on every rank that nothing keeps equal: the file took
    each from whichever rank wrote it (norm from rank 0, lm_head from rank 1: a model no rank held), without a word.
    Refused now, naming them; equal replicas save as before, and DDP (which keeps them equal) is not compared."""
    from safetensors.torch import load_file

    path = str(tmp_path / "x.safetensors")
    texts = run_ranks(_root_left_unsharded, 2, path, drift, "fsdp2-blocks")
    if drift:
        assert texts[0] == texts[1] and "differ between the ranks" in texts[0], texts[0]
        assert "model.norm.weight" in texts[0] and "lm_head.weight" in texts[0]
        assert "model.embed_tokens.weight" not in texts[0]  # equal on both ranks: not named
        return
    assert texts == [None, None]
    torch.manual_seed(0)
    oracle = build("llama").state_dict()
    saved = load_file(path)
    assert list(saved) == list(oracle) and all(torch.equal(saved[k], v) for k, v in oracle.items())
    assert run_ranks(_root_left_unsharded, 2, str(tmp_path / "d.safetensors"), False, "ddp") == [None, None]


def _doubles_weight(module, state_dict, prefix, local_metadata):  # a state-dict hook from outside torch
    if prefix + "weight" in state_dict:  # (called also where the module holds no weight of its own)
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2


def _fsdp1_with_a_hook(rank, world_size, path, use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1]._register_state_dict_hook(_doubles_weight)
    model = FSDP(model, use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    with pytest.raises(SaveError, match=r"\(1\): 1 \(a state_dict hook of test_save\)"):
        save_sharded(model, path)
    return not os.path.exists(path)


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_a_state_dict_hook_under_fsdp1_is_refused(tmp_path, use_orig_params):
    """FSDP1 takes a wrapped module's parameters out of it, so its own state_dict() gave nothing, which passed for
    "gives exactly what it holds": a hook that doubles a weight in FSDP1's state dict was then saved undoubled."""
    assert run_ranks(_fsdp1_with_a_hook, 2, str(tmp_path / "x.safetensors"), use_orig_params) == [True, True]
