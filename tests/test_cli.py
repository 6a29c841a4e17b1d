"""The command line: exit codes, one-line errors, config layering."""

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


def test_convert_verify_inspect(src, tmp_path):
    dst = tmp_path / "ck.safetensors"
    res = run("convert", src, dst, "--dtype", "bf16", "cast_exclude=[optim.*]")
    assert res.returncode == 0, res.stderr
    import fsdp_restore

    back = fsdp_restore.load(dst)
    assert back["model"]["w"].dtype == torch.bfloat16 and back["optim"]["m"].dtype == torch.float32
    assert run("verify", dst, "--against", src).returncode == 0
    res = run("inspect", dst, "--json")
    assert res.returncode == 0 and '"tensors": 2' in res.stdout


def test_errors_are_one_line_and_nonzero(tmp_path, src):
    res = run("convert", tmp_path / "missing.pt", tmp_path / "x.safetensors")
    assert res.returncode == 1 and "missing.pt" in res.stderr and "Traceback" not in res.stderr
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00")
    res = run("inspect", bad)
    assert res.returncode == 1 and "too short" in res.stderr and "Traceback" not in res.stderr
    res = run("convert", src, tmp_path / "y.safetensors", "nonsense=1")
    assert res.returncode == 1 and "unknown option" in res.stderr
    res = run("--debug", "inspect", bad)
    assert res.returncode != 0 and "Traceback" in res.stderr


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
    cfg_file.write_text("dtype: fp16\nthreads: 3\n")
    cfg = build_config(CONVERT_DEFAULTS, str(cfg_file), {"threads": 5}, ["select=model"])
    assert cfg.dtype == "fp16" and cfg.threads == 5 and cfg.select == "model"


def test_configs_file_matches_builtin_defaults():
    from pathlib import Path

    from omegaconf import OmegaConf

    path = Path(__file__).parent.parent / "configs" / "convert.yaml"
    assert OmegaConf.to_container(OmegaConf.load(path)) == CONVERT_DEFAULTS


def test_main_returns_exit_code(tmp_path):
    assert main(["inspect", str(tmp_path / "nope.safetensors")]) == 1
