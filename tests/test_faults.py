"""Bad input and faults: every corrupt file is a FormatError naming the file and the problem; an
interrupted or failed conversion leaves nothing under the final name; a failing rank fails them all."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
from dist import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdp_restore
from fsdp_restore import FormatError, RestoreError
from fsdp_restore.format import read_header
from fsdp_restore.read import Checkpoint


def st_bytes(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I8", "shape": [4], "data_offsets": [8, 12]}}


@pytest.mark.parametrize("name,blob,message", [
    ("short", b"\x01\x00", "too short"),
    ("huge_len", struct.pack("<Q", 2**40) + b"{}", "exceeds"),
    ("len_past_end", struct.pack("<Q", 100) + b"{}", "runs past the end"),
    ("bad_json", struct.pack("<Q", 8) + b"{not js}", "not valid JSON"),
    ("not_object", st_bytes([], b""), "not a JSON object"),  # type: ignore[arg-type]
    ("bad_dtype", st_bytes({"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "unknown dtype"),
    ("bad_shape", st_bytes({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0"), "shape"),
    ("size_mismatch", st_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "need 12"),
    ("out_of_range", st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "past the data"),
    ("overlap", st_bytes({**GOOD, "b": {"dtype": "I8", "shape": [4], "data_offsets": [4, 8]}}, b"\0" * 12), "overlap"),
    ("hole", st_bytes({"a": {"dtype": "I8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 4), "hole"),
    ("trailing", st_bytes(GOOD, b"\0" * 16), "trailing"),
    ("bad_metadata", st_bytes({"__metadata__": {"x": 1}}, b""), "__metadata__"),
])
def test_corrupt_safetensors_is_a_format_error_naming_the_file(tmp_path, name, blob, message):
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(blob)
    with pytest.raises(FormatError, match=message) as info:
        Checkpoint(path)
    assert str(path) in str(info.value)


def test_good_crafted_file_opens(tmp_path):
    path = tmp_path / "good.safetensors"
    path.write_bytes(st_bytes(GOOD, struct.pack("<2f", 1.5, -2.0) + bytes([1, 2, 3, 4])))
    assert fsdp_restore.load(path)["a"].tolist() == [1.5, -2.0]


def test_structure_naming_a_missing_tensor(tmp_path):
    structure = json.dumps({"version": 1, "root": {"type": "tensor", "key": "ghost"}})
    path = tmp_path / "s.safetensors"
    path.write_bytes(st_bytes({"__metadata__": {"fsdp_restore.structure": structure}, **GOOD}, b"\0" * 12))
    with pytest.raises(FormatError, match="ghost"):
        Checkpoint(path)
    path.write_bytes(st_bytes({"__metadata__": {"fsdp_restore.structure": "{oops"}, **GOOD}, b"\0" * 12))
    with pytest.raises(FormatError, match="structure metadata is not valid JSON"):
        Checkpoint(path)


def _sharded(tmp_path):
    dst = tmp_path / "sharded"
    fsdp_restore.save({"a": torch.ones(100), "b": torch.zeros(100)}, dst, max_shard_size=500)
    return dst


def test_index_pointing_at_missing_shard(tmp_path):
    dst = _sharded(tmp_path)
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FormatError, match="missing"):
        Checkpoint(dst)


def test_index_escaping_its_directory(tmp_path):
    dst = _sharded(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes((dst / "model-00001-of-00002.safetensors").read_bytes())
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for escaping in ("../outside.safetensors", "/etc/passwd"):
        index["weight_map"]["a"] = escaping
        index_path.write_text(json.dumps(index))
        with pytest.raises(FormatError, match="outside|relative"):
            Checkpoint(dst)


def test_index_that_is_not_json(tmp_path):
    dst = _sharded(tmp_path)
    (dst / "model.safetensors.index.json").write_text("{")
    with pytest.raises(FormatError, match="index is not valid JSON"):
        Checkpoint(dst)


def _start_conversion(src, dst, extra=""):
    script = "\n".join(["import fsdp_restore, fsdp_restore.write as w", extra,
                         f"fsdp_restore.convert({str(src)!r}, {str(dst)!r}, thread_count=1)"])
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def big_pt(tmp_path):
    src = tmp_path / "big.pt"
    torch.save({f"t{i}": torch.randn(2**20) for i in range(32)}, src)  # 128 MB
    return src


def test_killed_conversion_leaves_no_destination_and_rerun_succeeds(tmp_path, big_pt):
    dst = tmp_path / "out.safetensors"
    # Slow the writer down so that the kill lands mid-write.
    proc = _start_conversion(big_pt, dst, "import time; orig = w._write_block\n"
                             "w._write_block = lambda *a: (time.sleep(1.0), orig(*a))[1]")
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.safetensors.tmp-*")) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dst.exists()
    assert list(tmp_path.glob(".out.safetensors.tmp-*"))  # the dead writer's temporary
    fsdp_restore.convert(big_pt, dst)
    assert not list(tmp_path.glob(".out.safetensors.tmp-*"))  # cleaned by the next run
    assert fsdp_restore.verify(dst, against=big_pt).ok


def test_disk_full_leaves_nothing(tmp_path, big_pt):
    dst = tmp_path / "out.safetensors"
    # RLIMIT_FSIZE makes writes past 32 MB fail with EFBIG, as a full disk would fail them.
    proc = _start_conversion(big_pt, dst, "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                             "resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 2**20, 32 * 2**20))")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "File too large" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]


def test_cli_disk_full_is_one_line(tmp_path, big_pt):
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 2**20, 32 * 2**20));"
              "from fsdp_restore.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", script, "convert", str(big_pt), str(tmp_path / "o.safetensors")],
                         capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback" not in res.stderr and "File too large" in res.stderr


def _one_rank_fails(rank, world_size, good, bad):
    from models import build, wrap

    model = wrap(build("mlp"), "fsdp2", world_size)
    t0 = time.monotonic()
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(model, bad if rank == 1 else good)
    return str(info.value), time.monotonic() - t0


def test_error_on_one_rank_fails_every_rank(tmp_path):
    from models import build

    torch.save({"model": build("mlp").state_dict()}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    results = run_ranks(_one_rank_fails, 3, tmp_path / "m.safetensors", tmp_path / "nowhere.safetensors", timeout=60)
    for message, seconds in results:
        assert "nowhere.safetensors" in message and seconds < 30


def _stepped_checkpoint(path, *, optim_key: str):
    """The mlp's weights under "model" and its AdamW state after one step (moments and step filled) under
    ``optim_key``, saved to ``path``; returns ``path``."""
    from models import build

    model = build("mlp", seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    fsdp_restore.save({"model": model.state_dict(), optim_key: opt.state_dict()}, path)
    return path


def _bad_argument_on_rank_1(rank, world_size, path, entry):
    from models import build, wrap

    model = wrap(build("mlp", seed=1), "fsdp2", world_size)
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
              for k, v in model.state_dict().items()}
    bad = {"thread_count": 0} if rank == 1 else {}
    calls = {"restore_model": lambda: fsdp_restore.restore_model(model, path, **bad),
             "restore_optimizer": lambda: fsdp_restore.restore_optimizer(opt, model, path, **bad),
             "restore": lambda: fsdp_restore.restore(model, path, opt, **bad)}
    t0 = time.monotonic()
    with pytest.raises(RestoreError) as info:
        calls[entry]()
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    assert all(torch.equal(after[k], v) for k, v in before.items()) and not opt.state  # nothing was read
    return str(info.value), time.monotonic() - t0


@pytest.mark.parametrize("entry", ["restore_model", "restore_optimizer", "restore"])
def test_a_bad_argument_on_one_rank_fails_every_rank_at_once(tmp_path, entry):
    """``thread_count=0`` on rank 1 only: it raised its ValueError at the door and left, while rank 0 waited in
    the plan's verdict for it (until its process exited, or the process group's timeout if it lingered). Now
    every rank raises the same RestoreError naming the argument, before anything is read."""
    path = _stepped_checkpoint(tmp_path / "ck.safetensors", optim_key="optim")
    results = run_ranks(_bad_argument_on_rank_1, 2, path, entry, pg_timeout=60)
    texts = [text for text, _ in results]
    assert texts[0] == texts[1] and "ValueError: thread_count must be a positive int, not 0" in texts[0], texts
    assert "[rank 1]" in texts[0] and all(seconds < 30 for _, seconds in results), results
    # the headline names the file: every rank was given the same one (the rank that left at the door too)
    assert texts[0].startswith(f"{'optimizer ' if entry == 'restore_optimizer' else ''}restore of {path} failed:"), texts


# ---- fuzzing -----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(tmp_path, blob):
    path = tmp_path / "f.safetensors"
    path.write_bytes(blob)
    try:
        read_header(path)
    except FormatError:
        pass


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fz") / "v.safetensors"
    fsdp_restore.save({"model": {"w": torch.arange(6.0).view(2, 3), "tied": None}, "step": 3, "l": [1.5, "x"]}, path)
    return path.read_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_mutated_valid_file(tmp_path, valid_file, data):
    blob = bytearray(valid_file)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    path = tmp_path / "m.safetensors"
    path.write_bytes(bytes(blob))
    try:
        fsdp_restore.load(path)
    except FormatError:
        pass


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
                         ["type", "items", "key", "value", "view", "dtype", "class", "hex"]), c, max_size=4),
                     max_leaves=12)
_types = st.sampled_from(["dict", "list", "tuple", "tensor", "ndarray", "bytes", "float", "int", "complex",
                          "np_scalar", "dtype", "Size", "device", "Namespace", "path", "set", "OrderedDict", "zzz"])


@settings(max_examples=400, deadline=None)
@given(_types, _json, _json)
def test_fuzz_unflatten_structure(kind, items, value):
    node = {"type": kind, "items": items, "value": value, "key": value, "dtype": value, "class": value, "hex": value}
    try:
        fsdp_restore.unflatten({"k": torch.ones(2)}, {"version": 1, "root": node})
    except FormatError:
        pass


# ---- a rank that dies (SIGKILL) mid-restore: the survivors raise RestoreError at once --------------------


class _Seen(Exception):
    """What a surviving rank saw (raised so that the launcher reports it next to the dead rank)."""


def _killed_mid_restore(rank, world_size, path, dies_at):
    """Rank 1 is killed (SIGKILL: no exception, no report, its sockets closed by the kernel) as it reaches
    the verdict of phase ``dies_at`` (1: open and plan; 2: read and check); the other ranks are there."""
    import importlib
    import os

    from models import build, wrap

    restore_module = importlib.import_module("fsdp_restore.restore")  # the package's `restore` is the function

    model = wrap(build("mlp"), "fsdp2", world_size)
    if rank == 1:
        calls = []
        real_agree = restore_module.agree

        def agree_or_die(*args, **kwargs):
            calls.append(1)
            if len(calls) == dies_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_agree(*args, **kwargs)

        restore_module.agree = agree_or_die
    t0 = time.monotonic()
    try:
        fsdp_restore.restore_model(model, path)
    except Exception as e:  # noqa: BLE001 - which type the survivors see is the point
        raise _Seen(f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}") from None
    raise _Seen("no error")


@pytest.mark.parametrize("dies_at,phase", [(1, "restore of"), (2, "restore check of")])
def test_rank_killed_mid_restore_fails_survivors_with_restore_error(tmp_path, dies_at, phase):
    import re

    from models import build

    from fsdp_restore.launch import RankFailure, run_ranks as launch_ranks

    torch.save({"model": build("mlp").state_dict()}, tmp_path / "m.pt")
    fsdp_restore.convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    t0 = time.monotonic()
    # a short process-group timeout: were the death not noticed, the collective would still end soon
    with pytest.raises(RankFailure) as info:
        launch_ranks(_killed_mid_restore, 3, tmp_path / "m.safetensors", dies_at, timeout=120, backend="gloo",
                     pg_timeout=30)
    errors = info.value.errors
    assert "died with exit code -9" in errors[1], errors[1]
    for r in (0, 2):  # they reported (within the launcher's grace period), not "stopped: rank 1 died"
        first = errors[r].splitlines()[0]
        m = re.match(r"_Seen: RestoreError after ([0-9.]+)s: (.*)", first)
        assert m, errors[r]
        # the headline names the phase and the file
        assert float(m.group(1)) < 10, errors[r]
        assert f"{phase} {tmp_path / 'm.safetensors'} failed:" in errors[r], errors[r]
        assert "a rank died or lost its connection" in errors[r] and "init_process_group" in errors[r], errors[r]
    assert time.monotonic() - t0 < 60


def _restore_own_file(rank: int, world_size: int, paths: list) -> str:
    from models import build, wrap

    model = wrap(build("mlp", seed=1), "fsdp2", world_size)
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(model, paths[rank])
    return str(info.value)


@pytest.mark.parametrize("writer", ["ours", "safetensors"])
def test_ranks_that_opened_different_versions_fail_together(tmp_path, writer):
    """A checkpoint replaced while the ranks open it, or a stale copy on one node: each rank reads a whole
    file, but two ranks reading two would restore a mix. The verdict compares what every rank opened: the
    version our files record, a sample of the content for other writers' files (the same header)."""
    from models import build
    from safetensors.torch import save_file

    paths = []
    for seed in (0, 1):  # the same names and shapes, other values: two versions of one checkpoint
        path = tmp_path / f"v{seed}" / "ck.safetensors"
        path.parent.mkdir()
        state = build("mlp", seed=seed).state_dict()
        fsdp_restore.save(state, path) if writer == "ours" else save_file(state, str(path))
        paths.append(path)
    messages = run_ranks(_restore_own_file, 2, paths)
    assert len(set(messages)) == 1 and "opened different versions of the checkpoint" in messages[0]
    assert messages[0].startswith("restore failed:"), messages[0]  # no one file to name: each rank had its own


def test_ranks_given_a_training_checkpoint_and_a_weights_file_are_told_both(tmp_path):
    """One rank given a training checkpoint ({"model": ...}), the other the same weights as a plain file: each finds
    its own default model_prefix ('model', '') in the file it opened, which nobody passed; the one verdict says so
    as well as that the files differ (the model_prefix line alone read as if a caller had passed two values)."""
    from models import build

    state = build("mlp", seed=0).state_dict()
    paths = [tmp_path / "training.safetensors", tmp_path / "weights.safetensors"]
    fsdp_restore.save({"model": state}, paths[0])
    fsdp_restore.save(state, paths[1])
    messages = run_ranks(_restore_own_file, 2, paths)
    assert len(set(messages)) == 1, messages
    assert "opened different versions of the checkpoint" in messages[0], messages[0]
    assert "different values of model_prefix=" in messages[0] and "were they given different files?" in messages[0]


def _restore_own_file_with_optimizer(rank: int, world_size: int, paths: list) -> str:
    from models import build, wrap

    model = wrap(build("mlp", seed=1), "fsdp2", world_size)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore(model, paths[rank], optimizer=optimizer)
    return str(info.value)


def test_ranks_given_files_of_different_structure_are_told_so_first(tmp_path):
    """Rank 1 given another run's checkpoint (one param group where rank 0's has two) failed on what differs in it
    alone ("the checkpoint's optimizer has 1 param groups ... [rank 1]"), never saying the ranks had different
    files: a rank that fails to plan now still says what it opened. A rank that cannot open its path at all says
    only that (nothing it opened differs)."""
    from models import build

    model = build("mlp", seed=0)
    paths = []
    for groups in (2, 1):
        params = list(model.parameters())
        optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}] if groups == 2 else params)
        model(torch.randn(3, 7)).sum().backward()
        optimizer.step()
        path = tmp_path / f"groups{groups}.safetensors"
        fsdp_restore.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path)
        paths.append(path)
    messages = run_ranks(_restore_own_file_with_optimizer, 2, paths)
    assert len(set(messages)) == 1, messages
    lines = messages[0].splitlines()
    assert "opened different versions of the checkpoint" in lines[1], messages[0]  # first, then rank 1's own
    assert "the checkpoint's optimizer has 1 param groups, the optimizer 2" in messages[0] and "[rank 1]" in lines[2]
    missing = run_ranks(_restore_own_file_with_optimizer, 2, [paths[0], tmp_path / "nowhere.safetensors"])
    assert len(set(missing)) == 1 and "nowhere.safetensors" in missing[0], missing
    assert "different versions" not in missing[0] and "different values" not in missing[0], missing[0]
    # both at once: the rank that opened nothing still says, word for word, what the other two differ in
    both = run_ranks(_restore_own_file_with_optimizer, 3, [paths[0], tmp_path / "nowhere.safetensors", paths[1]])
    assert len(set(both)) == 1 and "opened different versions of the checkpoint" in both[0], both
    assert "nowhere.safetensors" in both[0] and "[rank 1]" in both[0] and "a bug" not in both[0], both[0]


def _refused_at_the_door_or_given_another_file(rank: int, world_size: int, paths: list) -> str:
    from models import build, wrap

    model = wrap(build("mlp", seed=1), "fsdp2", world_size)
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(model, paths[rank], thread_count=0 if rank == 0 else None)
    return str(info.value)


def test_a_rank_refused_at_the_door_raises_the_same_text_as_ranks_given_different_files(tmp_path):
    """Rank 0 refuses its own argument at the door (it compares nothing), ranks 1 and 2 were given different files:
    the difference the two found is said only where every rank holds the same texts for it; rank 0 said "(the
    ranks compared different values: a bug)" where the others named the files."""
    from models import build

    paths = []
    for i, seed in enumerate((0, 0, 5)):
        paths.append(tmp_path / f"m{i}.safetensors")
        fsdp_restore.save(build("mlp", seed=seed).state_dict(), paths[-1])
    messages = run_ranks(_refused_at_the_door_or_given_another_file, 3, paths)
    assert len(set(messages)) == 1 and "thread_count" in messages[0] and "a bug" not in messages[0], messages


def _restore_with(rank: int, world_size: int, path, options: list) -> str:
    from models import build, wrap

    def full(v):
        return v.full_tensor() if hasattr(v, "full_tensor") else v

    model = wrap(build("mlp", seed=1), "fsdp2", world_size)
    before = {k: full(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(model, path, **options[rank])
    assert all(torch.equal(full(v), before[k]) for k, v in model.state_dict().items())  # untouched
    return str(info.value)


_SWAP = {"blocks.0.weight": "blocks.1.weight", "blocks.1.weight": "blocks.0.weight"}


@pytest.mark.parametrize("options", [[{"check": True}, {"check": False}],
                                     [{"check": True, "check_buffers": False}, {"check": False, "check_buffers": False}],
                                     [{"check_buffers": False}, {}],
                                     [{"model_prefix": "ema"}, {}],
                                     [{"strict": False}, {}],
                                     [{"key_map": {}}, {"key_map": _SWAP}]],
                         ids=["check", "check-without-buffers", "check_buffers", "model_prefix", "strict", "key_map"])
def test_ranks_called_with_different_options_fail_together_naming_it(tmp_path, options):
    """A rank whose options differ reads other bytes or checks other memory with no error of its own (here:
    the weights or their moving average, both complete): every rank refuses, naming the option, before anything
    is read (it was reported as differing buffers, or not at all)."""
    from models import build

    path = tmp_path / "ck.safetensors"
    fsdp_restore.save({"model": build("mlp", seed=0).state_dict(), "ema": build("mlp", seed=2).state_dict()}, path)
    messages = run_ranks(_restore_with, 2, path, options)
    name = next(iter(options[0])).replace("check_buffers", "check")  # check_buffers= is told of with check=
    expected = "key_map= values that name them differently" if name == "key_map" else f"different values of {name}="
    assert len(set(messages)) == 1 and expected in messages[0], messages[0]
    assert messages[0].count("different values of") == (name != "key_map"), messages[0]  # that option alone


def _restore_with_an_optimizer_on_rank_0(rank: int, world_size: int, path) -> str:
    from models import build, wrap

    model = wrap(build("mlp", seed=1), "fsdp2", world_size)
    opt = torch.optim.AdamW(model.parameters()) if rank == 0 else None
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore(model, path, optimizer=opt, optim_prefix="optimizer")
    return str(info.value)


def test_an_optimizer_on_one_rank_only_is_named_alone(tmp_path):
    """Both ranks pass optim_prefix="optimizer", one of them an optimizer: the verdict names optimizer=, not
    optim_prefix= too (which was compared only where an optimizer was given, so it read as differing)."""
    path = _stepped_checkpoint(tmp_path / "ck.safetensors", optim_key="optimizer")
    messages = run_ranks(_restore_with_an_optimizer_on_rank_0, 2, path)
    assert len(set(messages)) == 1 and "different values of optimizer=" in messages[0], messages[0]
    assert messages[0].count("different values of") == 1, messages[0]


def _restore_a_stage(rank: int, world_size: int, path, key_map) -> str:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    if rank == 1:  # a later pipeline stage: another part of the model
        model[0] = torch.nn.Identity()
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(model, path, strict=False, key_map=key_map)
    return str(info.value)


@pytest.mark.parametrize("key_map", [None, [(r"^", "net.")], {"0.weight": "net.0.weight", "0.bias": "net.0.bias",
                                                               "1.weight": "net.1.weight", "1.bias": "net.1.bias"}],
                         ids=["no-map", "pairs", "dict"])
def test_ranks_holding_different_models_are_told_so(tmp_path, key_map):
    """Pipeline stages restoring on the default group: refused (each would check its own names only), and told
    that they hold different models, with the fix (process_group=), not only that their key maps differ (none, or
    the same one, was passed)."""
    torch.manual_seed(0)
    path = tmp_path / "ck.safetensors"
    state = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)).state_dict()
    fsdp_restore.save({("net." + k if key_map else k): v for k, v in state.items()}, path)
    messages = run_ranks(_restore_a_stage, 2, path, key_map)
    assert len(set(messages)) == 1 and "hold different models" in messages[0] and "process_group=" in messages[0]
    assert "different values of key_map=" not in messages[0], messages[0]


def _read_fails_half_way(rank: int, world_size: int, path) -> str:
    from models import build, wrap

    from fsdp_restore.read import Checkpoint

    model = wrap(build("mlp", seed=1), "fsdp2", world_size)
    if rank == 1:  # the third read fails (the lowest read the check's C read and the plain one share)
        real, calls = Checkpoint.read_contiguous, [0]

        def fails_later(self, parts, **options):
            calls[0] += 1
            if calls[0] > 2:
                raise OSError(5, "Input/output error (injected)")
            return real(self, parts, **options)

        Checkpoint.read_contiguous = fails_later
    with pytest.raises(RestoreError) as info:
        fsdp_restore.restore_model(model, path, thread_count=1)
    return str(info.value)


def test_a_failure_after_the_reads_began_says_the_model_is_partly_written(tmp_path):
    """A plan that fails leaves the model untouched; a read that fails half way cannot: the error says so on
    every rank (it named only the I/O error, and a healthy rank's model had been written all through)."""
    from models import build

    path = tmp_path / "ck.safetensors"
    fsdp_restore.save(build("mlp", seed=0).state_dict(), path)
    texts = run_ranks(_read_fails_half_way, 2, path)
    assert len(set(texts)) == 1 and "injected" in texts[0] and "[rank 1]" in texts[0], texts
    assert "are now partly written: restore again into them, or rebuild them" in texts[0], texts[0]


def _restore_alike(rank: int, world_size: int, path, options: list) -> int:
    from models import build, wrap

    model = wrap(build("mlp", seed=1), "fsdp2", world_size)
    return fsdp_restore.restore_model(model, path, **options[rank]).tensors


@pytest.mark.parametrize("options", [[{"check": True, "strict": True}, {}],
                                     [{"check": False, "check_buffers": False}, {"check": False}],
                                     [{"model_prefix": "model"}, {}],
                                     [{"key_map": {}}, {}],
                                     [{"key_map": {"9.weight": "x"}}, {}],
                                     [{"key_map": [("^nothing$", "x")]}, {}]],
                         ids=["the-defaults-given", "ignored", "the-default", "a-map-that-renames-nothing",
                              "a-map-of-names-the-model-lacks", "pairs-that-match-nothing"])
def test_ranks_whose_options_mean_the_same_are_not_refused(tmp_path, options):
    from models import build

    path = tmp_path / "ck.safetensors"
    fsdp_restore.save({"model": build("mlp", seed=0).state_dict()}, path)
    assert len(set(run_ranks(_restore_alike, 2, path, options))) == 1
