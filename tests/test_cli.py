"""The command line: exit codes, one-line errors, config layering."""

import re
import subprocess
import sys

import pytest
import torch

from fsdp_restore.cli import CONVERT_DEFAULTS, build_config, main


def run(*args):
    return subprocess.run([sys.executable, "-m", "fsdp_restore", *map(str, args)], capture_output=True, text=True)


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "ck.pt"
    torch.save({"model": {"w": torch.randn(8, 4)}, "optim": {"m": torch.randn(8, 4)}, "step": 1}, path)
    return path


def test_a_command_that_imports_torch_still_exits_with_its_code_and_all_its_output(src, tmp_path):
    """`python -m fsdp_restore` ends a command that imported torch without the interpreter's teardown
    (`cli.run`): its output is still whole and flushed, its exit code is main's, and what it wrote is complete
    (read back by safetensors' own reader)."""
    from safetensors.torch import load_file

    dst = tmp_path / "ck.safetensors"
    ok = run("convert", src, dst)
    assert ok.returncode == 0, ok.stderr
    assert "converted" in ok.stdout and ok.stdout.rstrip().endswith("┘"), ok.stdout  # the report's last line
    assert f"converted {src} -> {dst}\n" in ok.stdout  # the paths whole, on one line
    # a cast from fp64 to bf16 imports torch (plain_cast leaves it to torch: it may round twice) in the middle of
    # the conversion, which reads and casts without torch: the import row counts it (torch's import takes a
    # second or so, never under 0.3 s; what the command imports besides, ~0.1 s), the seconds do not (import_clock):
    # they are what converting 256 bytes through torch takes, less than importing it
    torch.save({"model": {"w": torch.randn(8, 4, dtype=torch.float64)}}, tmp_path / "f64.pt")
    cast = run("convert", tmp_path / "f64.pt", tmp_path / "bf16.safetensors", "--dtype", "bf16")
    imported = re.search(r"importing libraries \(torch\.\.\.\), not in seconds\s*│\s*([0-9.]+) s", cast.stdout)
    seconds = re.search(r"│ seconds\s*│\s*([0-9.]+) ", cast.stdout)
    assert cast.returncode == 0 and imported and seconds, cast.stdout
    assert float(imported.group(1)) >= 0.3 and float(seconds.group(1)) < float(imported.group(1)), cast.stdout
    assert torch.equal(load_file(dst)["model.w"], torch.load(src)["model"]["w"])
    bad = run("convert", tmp_path / "missing.pt", tmp_path / "out.safetensors")
    assert bad.returncode == 1 and "error:" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert not (tmp_path / "out.safetensors").exists()
    checked = run("verify", dst, "--against", src)
    assert checked.returncode == 0 and checked.stdout.strip(), checked.stderr


def test_convert_verify_inspect(src, tmp_path):
    dst = tmp_path / "ck.safetensors"
    res = run("convert", src, dst, "--dtype", "bf16", "cast_exclude=[optim.*]")
    assert res.returncode == 0, res.stderr
    import fsdp_restore

    back = fsdp_restore.load(dst)
    assert back["model"]["w"].dtype == torch.bfloat16 and back["optim"]["m"].dtype == torch.float32
    assert run("verify", dst, "--against", src).returncode == 0
    other = tmp_path / "other.pt"
    torch.save({"model": {"w": torch.zeros(8, 4)}, "optim": {"m": torch.zeros(8, 4)}, "step": 1}, other)
    wrong = run("verify", dst, "--against", other)  # the failure's likely cause, from what the file records
    assert wrong.returncode == 1 and "\nhint: other.pt is not the source ck.safetensors records: that was"\
        f" {src.name}" in wrong.stdout, wrong.stdout
    res = run("inspect", dst, "--json")
    assert res.returncode == 0 and '"tensors": 2' in res.stdout


@pytest.mark.parametrize("command", [["convert", "{src}", "{dir}/piped.safetensors"], ["inspect", "{dst}"],
                                     ["inspect", "{dst}", "--json"], ["verify", "{dst}", "--against", "{src}"]],
                         ids=["convert", "inspect", "inspect-json", "verify"])
def test_a_reader_that_stops_early_does_not_fail_the_command(src, tmp_path, command):
    """`fsdp-restore ... | head -1`: the reader closes the pipe before the command is done writing. The command
    still did its work and exits 0 without a word (it exited 1, under `set -o pipefail` a failed conversion or
    verification; --json printed 'error: [Errno 32] Broken pipe')."""
    dst = tmp_path / "ck.safetensors"
    assert run("convert", src, dst).returncode == 0
    args = [a.format(src=src, dst=dst, dir=tmp_path) for a in command]
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_restore", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command writes its first line
    errors = proc.stderr.read()
    assert proc.wait() == 0 and errors == "", errors
    if command[0] == "convert":
        import fsdp_restore

        assert torch.equal(fsdp_restore.load(tmp_path / "piped.safetensors")["model"]["w"], torch.load(src)["model"]["w"])


def test_errors_are_one_line_and_nonzero(tmp_path, src):
    res = run("convert", tmp_path / "missing.pt", tmp_path / "x.safetensors")
    assert res.returncode == 1 and "missing.pt" in res.stderr and "Traceback" not in res.stderr
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00")
    res = run("inspect", bad)
    assert res.returncode == 1 and "too short" in res.stderr and "Traceback" not in res.stderr
    res = run("convert", src, tmp_path / "y.safetensors", "nonsense=1")
    assert res.returncode == 2 and "unknown option" in res.stderr  # a usage error
    for args in (("--debug", "inspect", bad), ("inspect", bad, "--debug")):  # before or after the command
        res = run(*args)
        assert res.returncode != 0 and "Traceback" in res.stderr, args
    run_dir = tmp_path / "run"  # --force replaces a checkpoint, never a directory of the user's files
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep")
    res = run("convert", src, run_dir, "--force")
    assert res.returncode == 1 and "Traceback" not in res.stderr and "notes.txt" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and (run_dir / "notes.txt").read_text() == "keep"


def test_verify_fails_with_exit_1_on_damage(src, tmp_path):
    dst = tmp_path / "ck.safetensors"
    assert run("convert", src, dst).returncode == 0
    data = bytearray(dst.read_bytes())
    data[-3] ^= 0xFF
    dst.write_bytes(bytes(data))
    res = run("verify", dst)
    assert res.returncode == 1 and "checksum mismatch" in res.stdout


def test_config_layering(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("dtype: fp16\nthread_count: 3\n")
    cfg = build_config(CONVERT_DEFAULTS, str(cfg_file), {"thread_count": 5}, ["select=model"])
    assert cfg.dtype == "fp16" and cfg.thread_count == 5 and cfg.select == "model"


def test_configs_file_matches_builtin_defaults():
    from pathlib import Path

    from omegaconf import OmegaConf

    path = Path(__file__).parent.parent / "configs" / "convert.yaml"
    assert OmegaConf.to_container(OmegaConf.load(path)) == CONVERT_DEFAULTS


def test_main_returns_exit_code(tmp_path):
    assert main(["inspect", str(tmp_path / "nope.safetensors")]) == 1


# ---- arguments are checked at the door: one line naming the option and the fix, non-zero exit --------------


def _main(argv):
    """`main`'s exit code, usage errors (argparse's SystemExit) included."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _one_line_error(code, stderr):
    """A refused command: non-zero exit, no traceback, exactly one line on stderr."""
    assert code != 0, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    return stderr


@pytest.mark.parametrize("argv,names", [
    (["thread_count=abc"], ["thread_count", "abc"]),
    (["thread_count=0"], ["thread_count"]),
    (["thread_count=2.5"], ["thread_count"]),
    (["thread_count=true"], ["thread_count"]),
    (["--thread-count", "-2"], ["--thread-count"]),
    (["--thread-count", "abc"], ["--thread-count"]),
    (["--threads", "-2"], ["--threads"]),  # the old name: refused as the new one (argparse names the flag given)
    (["--threads", "abc"], ["--threads"]),
    (["max_shard_size=-5"], ["max_shard_size", "-5"]),
    (["max_shard_size=0"], ["max_shard_size"]),
    (["max_shard_size=5XB"], ["5XB"]),
    (["--max-shard-size=-5"], ["-5"]),
    (["on_unsupported=maybe"], ["on_unsupported", "skip"]),
    (["force=maybe"], ["force"]),
    (["trust_pickle=1"], ["trust_pickle"]),
    (["select=[a, b]"], ["select"]),
    (["cast_exclude={a: 1}"], ["cast_exclude"]),
    (["cast_include=[[model.*]]"], ["cast_include"]),
    (["allow_globals=[nodots]"], ["allow_globals", "module.Name"]),
    (["dtype=int8"], ["dtype"]),
    (["dtype=[bf16]"], ["dtype"]),
    (["tag=[a]"], ["tag"]),
    (["cast_exclude=[optim.*"], ["cast_exclude=[optim.*", "YAML"]),  # a YAML typo in an override
    (["thread_count=${nowhere}"], ["thread_count"]),
])
def test_bad_convert_options_are_one_line(src, tmp_path, capsys, argv, names):
    dst = tmp_path / "out.safetensors"
    code = _main(["convert", str(src), str(dst), *argv])
    err = _one_line_error(code, capsys.readouterr().err)
    assert code == 2, (code, err)  # a usage error, whether argparse or the options check finds it
    for name in names:
        assert name in err, err
    assert not dst.exists()


@pytest.mark.parametrize("text,names", [
    ("dtype: bf16\nthread_count: [3\n", ["line 3", "YAML"]),  # the typo: an unclosed list
    ("dtype: bf16\n  thread_count: 3\n", ["line 2", "YAML"]),  # bad indentation
    ("- dtype\n- bf16\n", ["mapping"]),  # a list, not options
    ("thread_count: abc\n", ["thread_count", "abc"]),  # valid YAML, wrong type
    ("threads: 2\nthread_count: 3\n", ["threads", "thread_count"]),  # the old name and the new one at once
    ("max_shard_size: -5\n", ["max_shard_size"]),
])
def test_bad_config_file_is_one_line_naming_it(src, tmp_path, capsys, text, names):
    cfg = tmp_path / "opts.yaml"
    cfg.write_text(text)
    code = main(["convert", str(src), str(tmp_path / "out.safetensors"), "--config", str(cfg)])
    err = _one_line_error(code, capsys.readouterr().err)
    assert code == 2, (code, err)
    for name in [*names, "opts.yaml"]:
        assert name in err, err


def test_missing_config_file_is_one_line(src, tmp_path, capsys):
    code = main(["convert", str(src), str(tmp_path / "out.safetensors"), "--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in _one_line_error(code, capsys.readouterr().err)


def test_a_config_that_is_a_directory_is_one_line_naming_it(src, tmp_path, capsys):
    """``--config /tmp`` printed "[Errno 21] Is a directory" with exit 1; a config error is exit 2, naming it."""
    (tmp_path / "configs").mkdir()
    code = main(["convert", str(src), str(tmp_path / "out.safetensors"), "--config", str(tmp_path / "configs")])
    line = _one_line_error(code, capsys.readouterr().err)
    assert code == 2 and f"--config {tmp_path / 'configs'}: cannot read it" in line


def test_a_single_pattern_is_a_list_of_one(src, tmp_path):
    """``cast_exclude=model.w`` (no brackets) is the pattern model.w, not the patterns m, o, d, e, l, ..."""
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(dst), "--dtype", "bf16", "cast_exclude=model.w"]) == 0
    import fsdp_restore

    assert fsdp_restore.load(dst)["model"]["w"].dtype == torch.float32


def test_good_options_still_convert(src, tmp_path):
    dst = tmp_path / "out"
    assert main(["convert", str(src), str(dst), "max_shard_size=1KB", "thread_count=1", "on_unsupported=skip",
                 "tag=null", "cast_exclude=[]"]) == 0
    assert (dst / "model.safetensors.index.json").exists()


def test_check_restore_refuses_nproc_0(src, tmp_path, capsys):
    code = _main(["check-restore", str(src), "--model", "tests.models:build", "--nproc", "0"])
    err = _one_line_error(code, capsys.readouterr().err)
    assert "--nproc" in err and "passed" not in err


@pytest.mark.parametrize("flags", [["--model", "no_such_module_here:build"], ["--model", "tests.models:no_such"],
                                   ["--model", "tests.models:build", "--key-map", "no_such_map.yaml"]],
                         ids=["module", "function", "key-map"])
def test_check_restore_bad_option_values_are_usage_errors(src, tmp_path, capsys, flags):
    """A --model or --key-map that cannot be loaded is a bad option value: exit 2, as the README says (it was 1)."""
    dst = tmp_path / "ck.safetensors"
    assert main(["convert", str(src), str(dst)]) == 0
    capsys.readouterr()
    code = _main(["check-restore", str(dst), *flags])
    assert code == 2 and flags[-1].split(":")[0] in _one_line_error(code, capsys.readouterr().err)


def test_run_check_restore_refuses_nproc_0(tmp_path):
    from fsdp_restore.check_restore import run_check_restore

    with pytest.raises(ValueError, match="nproc"):
        run_check_restore(str(tmp_path / "x.safetensors"), "tests.models:build", nproc=0)


def test_version():
    from importlib.metadata import version

    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"fsdp-restore {version('fsdp_restore')}", res


def test_help_and_version_do_not_convert_anything(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("fsdp-restore ")


def test_verify_missing_file_is_one_line(tmp_path, capsys, src):
    code = main(["verify", str(tmp_path / "missing.safetensors")])
    captured = capsys.readouterr()
    assert "missing.safetensors" in _one_line_error(code, captured.err) and captured.out == ""
    dst = tmp_path / "ok.safetensors"
    assert main(["convert", str(src), str(dst)]) == 0
    capsys.readouterr()
    code = main(["verify", str(dst), "--against", str(tmp_path / "gone.pt")])
    captured = capsys.readouterr()
    assert "gone.pt" in _one_line_error(code, captured.err) and captured.out == ""


@pytest.mark.parametrize("argv", [["inspect", "x", "--depth", "-1"], ["verify", "x", "--threads", "0"],
                                  ["verify", "x", "--thread-count", "0"], ["verify", "x", "--thread-count", "true"],
                                  ["nonsense"], ["convert", "a"]])
def test_usage_errors_are_one_line(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    _one_line_error(info.value.code, capsys.readouterr().err)


@pytest.mark.parametrize("argv,expected", [
    (["convert", "dtype=bf16", "a.pt", "b.safetensors"], "dtype=bf16 was taken for a path: key=value overrides go after"),
    (["convert", "a.pt", "dtype=bf16", "b.safetensors"], "dtype=bf16 was taken for a path"),
    (["convert", "a.pt", "b.safetensors", "--on-unsupported", "skip"], "(see fsdp-restore convert --help)"),
    (["inspect", "x", "dtype=bf16"], "unrecognized arguments: dtype=bf16 (see fsdp-restore inspect --help)")])
def test_a_misplaced_override_or_flag_is_named_with_the_commands_help(capsys, argv, expected):
    """An override before SRC or DST was reported as 'unrecognized arguments: b.safetensors', pointing at the
    top-level help; an unknown flag pointed at the top-level help too."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert expected in _one_line_error(info.value.code, capsys.readouterr().err)


def test_defaults_pass_the_checks():
    from fsdp_restore.cli import check_convert_options

    assert check_convert_options(dict(CONVERT_DEFAULTS)) == CONVERT_DEFAULTS


# ---- --thread-count / thread_count: the one name of the option (--threads / threads: its deprecated old name) -----


def _spy(monkeypatch, module, name):
    """Record the keyword arguments each call of ``module.name`` gets (and still call it)."""
    import importlib

    module = importlib.import_module(f"fsdp_restore.{module}")  # the module, not the package's function of that name
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(k) or real(*a, **k))
    return calls


@pytest.mark.parametrize("argv,config,old", [
    (["--thread-count", "2"], None, False),
    (["--threads", "2"], None, True),
    (["thread_count=2"], None, False),
    (["threads=2"], None, True),
    ([], "thread_count: 2\n", False),
    ([], "threads: 2\n", True),
    (["thread_count=2"], "threads: 3\n", True),  # an override beats the file, whichever name each uses
    (["--thread-count", "2"], "thread_count: 3\n", False),
])
def test_convert_thread_count_and_its_old_names(src, tmp_path, capsys, monkeypatch, argv, config, old):
    calls = _spy(monkeypatch, "convert", "convert")
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        argv = [*argv, "--config", str(tmp_path / "c.yaml")]
    assert main(["convert", str(src), str(tmp_path / "out.safetensors"), *argv]) == 0
    captured = capsys.readouterr()
    assert calls[0]["thread_count"] == 2 and "threads" not in calls[0]
    assert ("is renamed" in captured.err) == old, captured.err  # a deprecation note for the old name only
    if old:
        assert "thread_count" in captured.err or "--thread-count" in captured.err


@pytest.mark.parametrize("argv", [["--threads", "2", "--thread-count", "3"], ["--thread-count", "3", "--threads", "2"]])
def test_both_names_of_the_thread_count_flag_are_a_usage_error(src, tmp_path, capsys, argv):
    """As in the API (both names: TypeError) and the config (both keys: an error), not the last one silently."""
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), str(tmp_path / "out.safetensors"), *argv])
    assert e.value.code == 2
    assert "--threads and --thread-count name one option" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


def test_the_same_flag_twice_keeps_the_last(src, tmp_path, monkeypatch):
    calls = _spy(monkeypatch, "convert", "convert")
    assert main(["convert", str(src), str(tmp_path / "out.safetensors"), "--thread-count", "3", "--thread-count", "2"]) == 0
    assert calls[0]["thread_count"] == 2


@pytest.mark.parametrize("argv,config", [(["--select", "model"], None), (["select=model", "tag=t1"], None),
                                         ([], "select: model\ntag: t1\n")])
def test_the_read_ahead_gets_select_and_tag_from_every_layer(src, tmp_path, monkeypatch, argv, config):
    """The read-ahead starts before the options are checked (that imports torch), from the same merged options
    convert gets: a flag, an override or the config file."""
    calls = _spy(monkeypatch, "prefetch", "start_prefetch")
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        argv = [*argv, "--config", str(tmp_path / "c.yaml")]
    main(["convert", str(src), str(tmp_path / "out.safetensors"), *argv])  # its outcome is not the point here
    assert calls and calls[0]["select"] == "model"
    assert calls[0]["tag"] == (None if argv[:1] == ["--select"] else "t1")


def test_convert_default_thread_count_is_left_to_convert(src, tmp_path, monkeypatch):
    calls = _spy(monkeypatch, "convert", "convert")
    assert main(["convert", str(src), str(tmp_path / "out.safetensors")]) == 0
    assert calls[0]["thread_count"] is None  # convert's default: every core, at least 4


@pytest.mark.parametrize("flag,old", [("--thread-count", False), ("--threads", True)])
def test_verify_thread_count_and_its_old_flag(src, tmp_path, capsys, monkeypatch, flag, old):
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(dst)]) == 0
    calls = _spy(monkeypatch, "verify", "verify")
    capsys.readouterr()
    assert main(["verify", str(dst), "--against", str(src), flag, "2"]) == 0
    assert calls[0]["thread_count"] == 2 and "threads" not in calls[0]
    err = capsys.readouterr().err
    assert ("--threads is renamed --thread-count" in err) == old, err


def test_help_shows_thread_count_not_its_old_name(capsys):
    for command in ("convert", "verify"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "--thread-count" in text and "--threads" not in text


def test_verify_takes_the_classes_convert_was_allowed(tmp_path, capsys):
    import datetime

    src, dst = tmp_path / "run.pt", tmp_path / "run.safetensors"
    torch.save({"w": torch.ones(2), "warmup": datetime.timedelta(seconds=9)}, src)
    assert main(["convert", str(src), str(dst), "--allow-global", "datetime.timedelta", "on_unsupported=skip"]) == 0
    assert main(["verify", str(dst), "--against", str(src)]) == 1
    assert main(["verify", str(dst), "--against", str(src), "--allow-global", "datetime.timedelta"]) == 0
    assert "identical up to the declared changes" in capsys.readouterr().out


@pytest.mark.parametrize("flag,old", [("--model-prefix", False), ("--prefix", True)])
def test_check_restore_model_prefix_and_its_old_name(monkeypatch, capsys, flag, old):
    calls = []
    import fsdp_restore.check_restore as check_restore

    class Report:
        ok = True

        def summary(self):
            return "ok"

    monkeypatch.setattr(check_restore, "run_check_restore", lambda *a, **k: calls.append(k) or Report())
    assert main(["check-restore", "x.safetensors", "--model", "m:build", flag, "weights"]) == 0
    assert calls[0]["model_prefix"] == "weights" and "prefix" not in calls[0]
    assert ("--prefix is renamed --model-prefix" in capsys.readouterr().err) == old


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_pipe_or_a_device_is_refused_at_once_naming_what_it_is(tmp_path, command, kind):
    """A FIFO given as the checkpoint made `inspect` wait for a writer forever (its open blocked), and `convert`
    said "no such file" of /dev/zero: each is now one error naming what the path is, exit 1, no traceback."""
    import os

    if kind == "fifo":
        path = tmp_path / "ckpt.safetensors"
        os.mkfifo(path)
    else:
        path = "/dev/zero"
    args = [command, path] + ([tmp_path / "out.safetensors"] if command == "convert" else [])
    proc = subprocess.run([sys.executable, "-m", "fsdp_restore", *map(str, args)], capture_output=True, text=True,
                          timeout=60)
    what = "a pipe (FIFO)" if kind == "fifo" else "a device"
    assert proc.returncode == 1, proc
    assert f"{path}: is {what}, not a regular file" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out.safetensors").exists()


def test_a_pipe_given_to_a_restore_is_refused_at_once(tmp_path):
    import os

    import fsdp_restore

    os.mkfifo(tmp_path / "ckpt.safetensors")
    with pytest.raises(fsdp_restore.RestoreError, match=r"is a pipe \(FIFO\), not a regular file"):
        fsdp_restore.restore_model(torch.nn.Linear(2, 2), tmp_path / "ckpt.safetensors")
