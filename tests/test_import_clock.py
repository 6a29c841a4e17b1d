"""The import clock times a package's first import where it happens, and nothing else."""

import subprocess
import sys
import textwrap

import pytest


def _in_fresh_interpreter(tmp_path, body: str) -> str:
    """Run ``body`` in a new interpreter with a package ``slowpkg`` (its import sleeps 0.3 s, its submodule's 0.2 s)
    on the path: the clock's subject must not be imported yet."""
    pkg = tmp_path / "slowpkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("import time\ntime.sleep(0.3)\nfrom . import part\n")
    (pkg / "part.py").write_text("import time\ntime.sleep(0.2)\n")
    script = textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("where", ["directly", "inside another call"])
def test_the_first_import_is_timed_with_its_own_imports_and_the_clock_leaves(tmp_path, where):
    out = _in_fresh_interpreter(tmp_path, f"""
        import sys, time
        from fsdp_restore.import_clock import timing_import
        finders = list(sys.meta_path)
        def work():
            import slowpkg
        started = time.perf_counter()
        with timing_import("slowpkg") as clock:
            {"import slowpkg" if where == "directly" else "work()"}
            time.sleep(0.2)  # not an import: not counted
        import slowpkg
        print(clock.seconds, time.perf_counter() - started, sys.meta_path == finders, "slowpkg.part" in sys.modules,
              "exec_module" in vars(slowpkg.__spec__.loader))
    """)
    seconds, whole, restored, submodule, wrapped = out.split()
    assert 0.5 <= float(seconds) < float(whole) - 0.15  # the package and its submodule, not the sleep after
    assert restored == "True" and submodule == "True"  # the finder gone; the import itself whole
    assert wrapped == "False"  # the package's loader has its own exec_module back


def test_a_package_already_imported_or_never_imported_costs_nothing(tmp_path):
    out = _in_fresh_interpreter(tmp_path, """
        import slowpkg
        from fsdp_restore.import_clock import timing_import
        with timing_import("slowpkg") as again, timing_import("json.tool") as other:
            import slowpkg
            import email.utils
        print(again.seconds, other.seconds)
    """)
    assert out.split() == ["0.0", "0.0"]


def test_an_import_that_fails_is_timed_and_raises_and_no_loader_stays_wrapped(tmp_path):
    """The failure propagates as it would; the clock is off ``sys.meta_path`` and the package's loader has its own
    ``exec_module`` back; a built-in module's loader (shared by every built-in module) is never wrapped."""
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text(  # leaves its loader where the test finds it
        "import builtins, time\nbuiltins.used_loader = __spec__.loader\ntime.sleep(0.2)\nraise RuntimeError('broken')\n")
    out = _in_fresh_interpreter(tmp_path, """
        import builtins, importlib.machinery, sys
        from fsdp_restore.import_clock import timing_import
        builtin = [n for n in sys.builtin_module_names if n not in sys.modules][0]
        with timing_import("brokenpkg") as clock, timing_import(builtin) as other:
            try:
                import brokenpkg
            except RuntimeError as e:
                print("raised", e)
            __import__(builtin)
        print(clock.seconds, other.seconds, any(isinstance(f, type(clock)) for f in sys.meta_path))
        print("exec_module" in vars(builtins.used_loader), isinstance(
            vars(importlib.machinery.BuiltinImporter)["exec_module"], (classmethod, staticmethod)))
    """)
    raised, seconds, other, finder, wrapped, builtin_kept = out.replace("raised broken", "raised").split()
    assert raised == "raised" and float(seconds) >= 0.2 and other == "0.0" and finder == "False"
    assert wrapped == "False" and builtin_kept == "True"
