"""The package's one C extension, the check's read of host memory (fsdp_restore/_screened.c); everything else is
in pyproject.toml. Optional: where it cannot be built (no C compiler), the install goes on and the restore uses
the same check in Python (fsdp_restore/screened_read.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("fsdp_restore._screened", ["fsdp_restore/_screened.c"], extra_compile_args=["-O3", "-funroll-loops"],
                             optional=True)])
