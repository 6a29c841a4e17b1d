#!/usr/bin/env bash
# Create .venv with everything fsdp_restore and its tests need. torch is pinned to the CPU build
# first (a bare `torch` requirement would pull a multi-GB CUDA build on a machine with nothing installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
# DeepSpeed (tests only: real ZeRO checkpoints) as pure Python: no C++/CUDA ops are built
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, safetensors, fsdp_restore; print('fsdp_restore', fsdp_restore.__version__, 'torch', torch.__version__)"
