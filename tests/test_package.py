"""The package's public names: each the function it documents, whatever was imported first; the command
line's --help and --version answer without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE_NAMES = """
import importlib, sys
for sub in {subs!r}:
    importlib.import_module("fsdp_restore." + sub)  # a submodule first: it binds its name on the package
import fsdp_restore
bad = [n for n in fsdp_restore.__all__ if type(getattr(fsdp_restore, n)).__name__ == "module"]
print(bad)
"""


@pytest.mark.parametrize("subs", [[], ["convert", "flatten", "restore", "verify", "cli", "sharded_save"]])
def test_public_names_are_never_modules(subs):
    out = subprocess.run([sys.executable, "-c", CODE_NAMES.format(subs=subs)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves():
    import fsdp_restore

    for name in fsdp_restore.__all__:
        assert getattr(fsdp_restore, name) is not None, name
    assert callable(fsdp_restore.save) and callable(fsdp_restore.restore) and callable(fsdp_restore.verify)


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_help_and_version_do_not_import_torch(flag):
    code = ("import sys; from fsdp_restore.cli import main\n"
            f"try:\n    main([{flag!r}])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_every_public_function_names_its_threads_thread_count():
    """One name for one option: every public function with a thread count takes it as ``thread_count``,
    keyword-only, default None; ``threads`` (its old name, deprecated) only beside it, keyword-only too."""
    import inspect

    import fsdp_restore

    takers = []
    for name in fsdp_restore.__all__:
        obj = getattr(fsdp_restore, name)
        if not inspect.isfunction(obj):
            continue
        params = inspect.signature(obj).parameters
        if "thread_count" in params or "threads" in params:
            takers.append(name)
            assert params["thread_count"].kind is inspect.Parameter.KEYWORD_ONLY, name
            assert params["thread_count"].default is None, name
            if "threads" in params:
                assert params["threads"].kind is inspect.Parameter.KEYWORD_ONLY and params["threads"].default is None
    assert sorted(takers) == ["convert", "restore", "restore_model", "restore_optimizer", "save", "save_sharded",
                              "verify"]
