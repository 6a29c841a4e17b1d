"""Replacing a checkpoint is atomic for its readers (issue 20, item 3): a reader sees one version whole
(header and data through one open, a sharded set through one directory), never a mix; a writer killed
while replacing leaves the old or the new checkpoint under the final name, and nothing the next run keeps."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import fsdp_restore
from fsdp_restore.convert import save
from fsdp_restore import FormatError
from fsdp_restore.read import Checkpoint


def _version(i: int) -> dict:
    """Version ``i``: its number in the structure (the header) and in every tensor (the data)."""
    return {"step": i, "a": torch.full((64, 256), float(i)), "b": torch.full((300,), i, dtype=torch.int64),
            "c": torch.full((50, 50), float(i), dtype=torch.bfloat16)}


def _consistent(obj: dict) -> bool:
    return all(bool((obj[k] == obj["step"]).all()) for k in ("a", "b", "c"))


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_readers_never_see_a_mix_while_a_writer_replaces(tmp_path, sharded):
    dst = tmp_path / ("ck" if sharded else "ck.safetensors")
    shard = 60_000 if sharded else None  # one tensor per shard
    save(_version(0), dst, max_shard_size=shard)
    stop, failures, errors = threading.Event(), [], []

    def write() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                save(_version(i % 2), dst, max_shard_size=shard, thread_count=1)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(f"writer: {e!r}")
                return

    writer = threading.Thread(target=write)
    writer.start()
    loads = 0
    deadline = time.monotonic() + 3
    try:
        while time.monotonic() < deadline and not errors:
            try:
                obj = fsdp_restore.load(dst, mmap=loads % 2 == 0)
                if not _consistent(obj):
                    failures.append({k: (v if k == "step" else float(v.float().mean())) for k, v in obj.items()})
                if loads % 5 == 0:
                    report = fsdp_restore.verify(dst, thread_count=1)
                    if not report.ok:
                        failures.append(report.problems)
            except FormatError as e:
                # a sharded set may be removed under a reader that had not opened every shard yet: that
                # is a clear error, never a mix; a single file is replaced in one rename: no error at all
                if not (sharded and "replaced" in str(e)):
                    failures.append(str(e))
            loads += 1
    finally:
        stop.set()
        writer.join()
    assert not errors, errors
    assert not failures, failures[:3]
    assert loads > 10


def _model(value: float) -> nn.Module:
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_sharded_set_replaced_mid_restore_is_one_version_or_an_error(tmp_path):
    dst = tmp_path / "ck"
    save({"model": _model(1.0).state_dict()}, dst, max_shard_size=4500)  # a shard per weight
    ckpt = Checkpoint(dst)
    assert len(ckpt.headers) > 3
    replaced = []
    read_contiguous = ckpt.read_contiguous

    def read_then_replace(parts, **options):
        result = read_contiguous(parts, **options)
        if not replaced:  # the first read done: a writer replaces the whole directory now
            save({"model": _model(2.0).state_dict()}, dst, max_shard_size=4500)
            replaced.append(True)
        return result

    ckpt.read_contiguous = read_then_replace
    model = _model(0.0)
    try:
        fsdp_restore.restore_model(model, ckpt, thread_count=1)  # reads in order: some before, some after
    except fsdp_restore.FsdpRestoreError as e:
        assert "replaced" in str(e)
    else:
        values = {float(v) for p in model.parameters() for v in p.detach().unique()}
        assert values in ({1.0}, {2.0}), values
    finally:
        ckpt.close()
    assert replaced


# A writer paused right after its n-th rename (or at the end of writing, n = 0), then killed with SIGKILL.
_PAUSING_WRITER = """
import os, sys, time
import fsdp_restore, fsdp_restore.write as w
import torch
n, calls = int(sys.argv[3]), [0]
def pause():
    print("paused", flush=True)
    time.sleep(120)
def pausing(orig):
    def call(*a, **k):
        out = orig(*a, **k)
        calls[0] += 1
        if calls[0] == n:
            pause()
        return out
    return call
os.rename, os.replace = pausing(os.rename), pausing(os.replace)
if hasattr(w, "_exchange"):
    w._exchange = pausing(w._exchange)
if n == 0:
    finish = w._FileWriter.finish
    w._FileWriter.finish = lambda self: (pause(), finish(self))
fsdp_restore.convert(sys.argv[1], sys.argv[2], force=True, thread_count=1,
                     max_shard_size=int(sys.argv[4]) if sys.argv[4] != "0" else None)
print("done", flush=True)
"""


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
@pytest.mark.parametrize("when", [0, 1, 2], ids=["writing", "after-rename-1", "after-rename-2"])
def test_a_writer_killed_while_replacing_leaves_old_or_new(tmp_path, sharded, when):
    old, new = tmp_path / "old.pt", tmp_path / "new.pt"
    torch.save(_version(1), old)
    torch.save(_version(2), new)
    dst = tmp_path / ("ck" if sharded else "ck.safetensors")
    shard = "60000" if sharded else "0"
    fsdp_restore.convert(old, dst, max_shard_size=int(shard) if sharded else None)
    proc = subprocess.Popen([sys.executable, "-c", _PAUSING_WRITER, str(new), str(dst), str(when), shard],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    proc.kill()
    _, err = proc.communicate()
    assert line in ("paused\n", "done\n"), err
    obj = fsdp_restore.load(dst)  # under the final name: one version whole
    assert _consistent(obj) and obj["step"] in (1, 2)
    assert fsdp_restore.verify(dst, against=old if obj["step"] == 1 else new).ok
    fsdp_restore.convert(new, dst, force=True, max_shard_size=int(shard) if sharded else None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["old.pt", "new.pt", dst.name])  # no orphan
    assert fsdp_restore.load(dst)["step"] == 2


def test_a_shard_of_another_write_is_refused(tmp_path):
    """Shards copied over file by file (not by our writer): the set id tells the mix apart, even where every
    layout and checksum agrees."""
    one, two = tmp_path / "one", tmp_path / "two"
    save(_version(1), one, max_shard_size=60_000)
    save(_version(2), two, max_shard_size=60_000)
    shard = "model-00002-of-00002.safetensors"
    (one / shard).write_bytes((two / shard).read_bytes())
    with pytest.raises(FormatError, match=rf"{shard}.*another write.*convert"):
        fsdp_restore.load(one)
    assert not fsdp_restore.verify(one).ok


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_version_tells_two_writes_apart(tmp_path, sharded):
    dst = tmp_path / ("ck" if sharded else "ck.safetensors")
    shard = 60_000 if sharded else None
    save(_version(1), dst, max_shard_size=shard)
    with Checkpoint(dst) as first, Checkpoint(dst) as again:
        assert first.version is not None and first.version == again.version
    save(_version(1), dst, max_shard_size=shard, force=True)  # the same content written again
    with Checkpoint(dst) as second:
        assert (second.version != first.version) if sharded else (second.version == first.version)
    save(_version(2), dst, max_shard_size=shard, force=True)
    with Checkpoint(dst) as third:
        assert third.version not in (first.version, None)


def test_without_exchange_a_killed_replacement_is_undone_by_the_next_run(tmp_path, monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) is unsupported, the old version is moved aside first; a writer killed
    before the new one is in place leaves it there, and the next writer puts it back rather than delete it."""
    import errno

    from fsdp_restore import write

    def unsupported(a, b):
        raise OSError(errno.EINVAL, "not supported here")

    monkeypatch.setattr(write, "_exchange", unsupported)
    dst = tmp_path / "ck"
    save(_version(1), dst, max_shard_size=60_000)
    save(_version(2), dst, max_shard_size=60_000)  # the fallback replaces too
    assert _consistent(fsdp_restore.load(dst)) and fsdp_restore.load(dst)["step"] == 2
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    parked = tmp_path / f".ck.tmp-{int(dead.stdout)}-old-0123abcd"
    dst.rename(parked)  # as a writer killed between its two renames leaves it
    assert write.remove_stale_temporaries(dst) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert fsdp_restore.load(dst)["step"] == 2


def _user_directory(root) -> tuple:
    run = root / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep")
    src = run / "step3.pt"
    torch.save({"w": torch.arange(6.0)}, src)
    return run, src


def test_force_never_replaces_a_directory_of_other_files_or_the_source(tmp_path):
    """--force replaces a checkpoint, not a run directory: a directory holding anything but a sharded set,
    the source itself, or a directory holding the source is refused before anything is written."""
    run, src = _user_directory(tmp_path)
    before = sorted(p.name for p in run.iterdir())
    for dst, shard, words in ((run, None, "holding the source"), (src, None, "is the source"),
                              # shards into the directory of the source (an HF model directory's pytorch_model.bin):
                              # said as what it would do, with the fix (it said the source would be deleted)
                              (run, 100, "holds the source .*two checkpoints' weights .*write the shards to another"
                                         " directory")):
        with pytest.raises(FileExistsError, match=words):
            fsdp_restore.convert(src, dst, force=True, max_shard_size=shard)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"holding more than a sharded checkpoint \(notes.txt\)"):
        fsdp_restore.convert(src, other, force=True)
    for dst in (other, src):  # without --force: the same refusal, not advice to force what forcing would not do
        with pytest.raises(FileExistsError) as info:
            fsdp_restore.convert(src, dst)
        assert "--force" not in str(info.value) and "force=True" not in str(info.value), info.value
    with pytest.raises(FileExistsError, match="notes.txt"):
        save({"w": torch.ones(2)}, other)  # save's force=True by default: still not a directory of other files
    assert sorted(p.name for p in run.iterdir()) == before and (run / "notes.txt").read_text() == "keep"
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "run"]  # no temporaries
    assert torch.equal(torch.load(src)["w"], torch.arange(6.0))


def test_force_never_replaces_a_device_or_a_pipe(tmp_path):
    """The rename put the checkpoint in place of whatever the path named: as root, `save(..., "/dev/null")` (a
    throughput test) replaced /dev/null itself."""
    _, src = _user_directory(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for call in (lambda: fsdp_restore.convert(src, fifo, force=True), lambda: save({"w": torch.ones(2)}, fifo),
                 lambda: fsdp_restore.convert(src, fifo, force=True, max_shard_size=16)):
        with pytest.raises(FileExistsError, match=r"pipe is a named pipe \(FIFO\), not a file or a directory"):
            call()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    if os.path.exists("/dev/null"):  # refused before anything is written, also where one may not write
        with pytest.raises(FileExistsError, match="/dev/null is a character device"):
            save({"w": torch.ones(2)}, "/dev/null")
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_a_name_too_long_for_the_temporary_is_refused_at_the_door(tmp_path):
    """A name the file system takes (233 bytes where names hold 255), not with the temporary's 35 bytes: it failed
    with a raw ENAMETOOLONG naming the temporary (save_sharded: masked by its own cleanup's error)."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    dst = tmp_path / ("x" * (limit - 34 - len(".safetensors")) + ".safetensors")
    model = nn.Linear(3, 2)
    for call in (lambda: save({"w": torch.ones(2)}, dst),
                 lambda: fsdp_restore.save_sharded(model, dst)):
        with pytest.raises((ValueError, fsdp_restore.SaveError),
                           match=rf"its name is {limit - 34} bytes long; .* give a name of at most {limit - 35} bytes"):
            call()
    assert os.listdir(tmp_path) == []
    save({"w": torch.ones(2)}, tmp_path / ("x" * (limit - 35 - len(".safetensors")) + ".safetensors"))  # the longest


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


@pytest.mark.parametrize("name", ["ck-old-2.safetensors", "ck.safetensors"])
def test_a_dead_writers_half_written_file_is_removed_whatever_the_destinations_name(tmp_path, name):
    """A destination named "...-old-..." made a dead writer's half-written temporary look like a moved-aside old
    version: with the destination missing, the next run renamed it into place under the final name."""
    from fsdp_restore import write

    dst = tmp_path / name
    dead = _dead_pid()
    for half in (f".{name}.tmp-{dead}-{write._node()}-0123abcd", f".{name}.tmp-{dead}-89abcdef"):  # (older names)
        (tmp_path / half).write_bytes(b"half a checkpoint")
        assert write.remove_stale_temporaries(dst) == [tmp_path / half]
        assert os.listdir(tmp_path) == []


def test_a_temporary_of_another_machine_is_kept_with_a_warning(tmp_path):
    """On a shared file system a pid says nothing of another machine's writer: its temporary is kept, said once;
    this machine's dead writers' temporaries are removed as before."""
    from fsdp_restore import write

    dst = tmp_path / "ck.safetensors"
    dead = _dead_pid()
    other = "0" * 8 if write._node() != "0" * 8 else "1" * 8
    theirs = [tmp_path / f".ck.safetensors.tmp-{dead}-{other}-0123abcd",
              tmp_path / f".ck.safetensors.tmp-{dead}-{other}-old-0123abcd"]
    ours = tmp_path / f".ck.safetensors.tmp-{dead}-{write._node()}-0123abcd"
    for p in [*theirs, ours]:
        p.write_bytes(b"x")
    with pytest.warns(UserWarning, match=r"kept \.ck\.safetensors\.tmp-\d+-0{8}-0123abcd, \S+-old-0123abcd: written for"
                                         r" ck.safetensors on another machine, .* delete them if"):
        assert write.remove_stale_temporaries(dst) == [ours]
    assert sorted(tmp_path.iterdir()) == sorted(theirs)
    with pytest.warns(UserWarning, match="on another machine"):
        save({"w": torch.ones(2)}, dst)  # a conversion beside them: written, and they are still there
    assert sorted(p for p in tmp_path.iterdir() if p != dst) == sorted(theirs)


def test_temporaries_of_other_destinations_whose_names_start_alike_are_left_alone(tmp_path):
    """The glob for ck.safetensors's temporaries also finds those of ck.safetensors.tmp-5 and ck.safetensors.old-1:
    the first was warned of as another machine's, the second taken for a moved-aside old version of ck.safetensors
    (renamed into its place when it was missing)."""
    from fsdp_restore import write

    dst = tmp_path / "ck.safetensors"
    others = [tmp_path / f".ck.safetensors.tmp-5.tmp-{os.getpid()}-{write._node()}-0123abcd",
              tmp_path / f".ck.safetensors.old-1.tmp-{_dead_pid()}-{write._node()}-0123abcd"]
    for p in others:
        p.write_bytes(b"another destination's")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert write.remove_stale_temporaries(dst) == []
    assert sorted(tmp_path.iterdir()) == sorted(others) and not dst.exists()


def test_the_temporaries_names_fit_what_the_door_allows():
    from pathlib import Path

    from fsdp_restore import write

    dst = Path("ck.safetensors")
    for old in (False, True):
        name = write.temporary_name(dst, old=old)
        assert len(name) - len(dst.name) + (7 - len(str(os.getpid()))) <= write._TEMPORARY_NAME_EXTRA
        assert write._writer_of(Path(name), dst) == (str(os.getpid()), write._node(), old)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_failure_after_the_rename_says_the_new_version_is_in_place(tmp_path, monkeypatch, sharded):
    """The directory's fsync after the rename failed (EIO on a network file system): the error said only that the
    save failed, and save_sharded's that the old checkpoint was untouched, with the new one in place."""
    import errno

    import fsdp_restore.write as write

    path = tmp_path / ("ck" if sharded else "ck.safetensors")
    model = nn.Linear(30, 20)
    options = {"max_shard_size": 2000} if sharded else {}
    fsdp_restore.save_sharded(model, path, extra={"step": 1}, **options)
    real = write._fsync_dir

    def failing(directory):
        if os.path.samefile(directory, tmp_path):
            raise OSError(errno.EIO, "Input/output error")
        return real(directory)

    monkeypatch.setattr(write, "_fsync_dir", failing)
    for step, call in ((2, lambda: fsdp_restore.save_sharded(model, path, extra={"step": 2}, **options)),
                       (3, lambda: save({"step": 3, "w": torch.ones(2)}, path, **options))):
        with pytest.raises(OSError if step == 3 else fsdp_restore.SaveError,
                           match=f"{path}: the new version is in place, but syncing its directory to disk failed"):
            call()
        assert fsdp_restore.load(path)["step"] == step and os.listdir(tmp_path) == [path.name]


def test_a_symbolic_link_is_written_through(tmp_path):
    """As torch.save writes through a link: the link was replaced by a file, leaving `latest` apart from the step it
    named; to a model directory, by a new directory without its config.json and tokenizer."""
    model = nn.Linear(30, 20)
    (tmp_path / "latest.safetensors").symlink_to("step1.safetensors")
    (tmp_path / "model").symlink_to("model_real")
    for step, call in enumerate((lambda s: fsdp_restore.save_sharded(model, tmp_path / "latest.safetensors",
                                                                     extra={"step": s}),
                                 lambda s: save({"step": s}, tmp_path / "latest.safetensors"),
                                 lambda s: save({"step": s}, str(tmp_path / "model") + "/", max_shard_size=16))):
        if step == 2:
            (tmp_path / "model_real").mkdir()
            (tmp_path / "model_real" / "config.json").write_text("{}")
        call(step)
    assert (tmp_path / "latest.safetensors").is_symlink() and (tmp_path / "model").is_symlink()
    assert fsdp_restore.load(tmp_path / "step1.safetensors")["step"] == 1
    assert fsdp_restore.load(tmp_path / "model")["step"] == 2 and (tmp_path / "model_real" / "config.json").exists()
    torch.save({"step": 3}, tmp_path / "s.pt")
    fsdp_restore.convert(tmp_path / "s.pt", tmp_path / "latest.safetensors", force=True)
    assert fsdp_restore.load(tmp_path / "step1.safetensors")["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.safetensors", "model", "model_real", "s.pt",
                                                          "step1.safetensors"]


def test_force_replaces_a_sharded_set_with_a_file_and_back(tmp_path):
    _, src = _user_directory(tmp_path)
    dst = tmp_path / "out"
    fsdp_restore.convert(src, dst, max_shard_size=16)
    assert (dst / "model.safetensors.index.json").exists()
    fsdp_restore.convert(src, dst, force=True)  # a set of shards and its index: ours to replace
    assert dst.is_file() and torch.equal(fsdp_restore.load(dst)["w"], torch.arange(6.0))
    fsdp_restore.convert(src, dst, force=True, max_shard_size=16)
    assert dst.is_dir() and torch.equal(fsdp_restore.load(dst)["w"], torch.arange(6.0))


def test_force_never_replaces_a_file_inside_a_directory_source(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=src)
    inside = sorted(p for p in src.iterdir() if p.suffix == ".distcp")[0]
    before = inside.read_bytes()
    with pytest.raises(FileExistsError, match="inside the source directory"):
        fsdp_restore.convert(src, inside, force=True)
    assert inside.read_bytes() == before
    fsdp_restore.convert(src, tmp_path / "out.safetensors")  # the source is whole
    assert torch.equal(fsdp_restore.load(tmp_path / "out.safetensors")["w"], torch.arange(8.0))


def test_a_file_put_in_the_destination_during_the_write_is_not_deleted(tmp_path):
    """The directory is checked again just before the new version replaces it: a file a set of shards keeps (notes)
    is carried into it; one it would lose or leave to contradict it (another checkpoint's weights) is refused."""
    _, src = _user_directory(tmp_path)
    dst = tmp_path / "out"
    fsdp_restore.convert(src, dst, max_shard_size=16)
    old = sorted(p.name for p in dst.iterdir())

    def meanwhile(name: str):
        def progress(done: int, total: int) -> None:
            (dst / name).write_text("written during the conversion")
        return progress

    fsdp_restore.convert(src, dst, force=True, max_shard_size=16, progress=meanwhile("notes.txt"))
    assert sorted(p.name for p in dst.iterdir()) == sorted([*old, "notes.txt"])
    assert (dst / "notes.txt").read_text() == "written during the conversion"
    before = fsdp_restore.load(dst)["w"]
    with pytest.raises(FileExistsError, match=r"holds other.safetensors, which a new set of shards would"):
        fsdp_restore.convert(src, dst, force=True, max_shard_size=16, progress=meanwhile("other.safetensors"))
    assert sorted(p.name for p in dst.iterdir()) == sorted([*old, "notes.txt", "other.safetensors"])
    assert torch.equal(fsdp_restore.load(dst)["w"], before)  # the old version, still whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no temporaries left


def test_a_set_of_shards_keeps_a_model_directorys_other_files(tmp_path):
    """A Hugging Face model directory (config.json beside the shards) was refused as a destination of shards
    (replacing the directory would have deleted the config); its files are now carried into the new version, and
    transformers loads the result. Another checkpoint's weights or a directory inside are still refused, and a
    single file never replaces such a directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    hf = tmp_path / "hf"
    config.save_pretrained(hf)
    (hf / "tokenizer.json").write_text("{}")
    before = sorted(p.name for p in hf.iterdir())
    config_bytes = (hf / "config.json").read_bytes()
    fsdp_restore.convert(tmp_path / "weights.pt", hf, force=True, max_shard_size="100KB")
    names = sorted(p.name for p in hf.iterdir())
    assert set(before) <= set(names) and "model.safetensors.index.json" in names, names
    assert (hf / "config.json").read_bytes() == config_bytes
    loaded = LlamaForCausalLM.from_pretrained(hf)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    hf.chmod(0o2750)  # a group's directory: its mode stays with it (the new version's directory is another one)
    fsdp_restore.convert(tmp_path / "weights.pt", hf, force=True, max_shard_size="200KB")  # and again: kept again
    assert set(before) <= {p.name for p in hf.iterdir()} and (hf / "config.json").read_bytes() == config_bytes
    assert hf.stat().st_mode & 0o7777 == 0o2750, oct(hf.stat().st_mode)
    for intruder in ("model.safetensors", "pytorch_model.bin", "checkpoint-500"):
        path = hf / intruder
        path.mkdir() if "." not in intruder else path.write_bytes(b"x")
        with pytest.raises(FileExistsError, match=f"holds {intruder}, which a new set of shards"):
            fsdp_restore.convert(tmp_path / "weights.pt", hf, force=True, max_shard_size="100KB")
        path.rmdir() if path.is_dir() else path.unlink()
    with pytest.raises(FileExistsError, match="holding more than a sharded checkpoint"):
        fsdp_restore.convert(tmp_path / "weights.pt", hf, force=True)  # one file would take the directory's place
    assert (hf / "config.json").read_bytes() == config_bytes