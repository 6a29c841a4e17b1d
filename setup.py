"""The package's two C extensions: the check's read of host memory (fsdp_restore/_screened.c) and a folded crc32
(fsdp_restore/_crc32.c); everything else is in pyproject.toml. Both optional: where they cannot be built (no C
compiler), the install goes on and the restore uses the same check in Python (fsdp_restore/screened_read.py), the
writers zlib's crc32 (fsdp_restore/checksum.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("fsdp_restore._screened", ["fsdp_restore/_screened.c"], extra_compile_args=["-O3", "-funroll-loops"],
                             optional=True),
                   Extension("fsdp_restore._crc32", ["fsdp_restore/_crc32.c"], extra_compile_args=["-O3"], optional=True)])
