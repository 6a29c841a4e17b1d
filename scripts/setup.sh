#!/usr/bin/env bash
# Create .venv with everything fsdp_restore and its tests need. torch is installed first, pinned: on a
# machine without an NVIDIA GPU from PyTorch's CPU index where it can be reached (PyPI's Linux wheel is the
# multi-GB CUDA build); TORCH_INDEX=URL picks another index, TORCH_INDEX= (empty) the configured ones only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
TORCH_INDEX=${TORCH_INDEX%/}
INDEX=()
if [ -n "$TORCH_INDEX" ] && ! command -v nvidia-smi >/dev/null 2>&1 \
    && .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
       "$TORCH_INDEX" >/dev/null 2>&1; then
  INDEX=(--index-url "$TORCH_INDEX")
  echo "torch: from $TORCH_INDEX"
fi
# ${INDEX[@]+...}: an empty array under `set -u` is an error in bash before 4.4
.venv/bin/python -m pip install -q "torch==2.13.0" ${INDEX[@]+"${INDEX[@]}"} 2>&1 | grep -v "is ignored" || true
# DeepSpeed (tests only: real ZeRO checkpoints) as pure Python: no C++/CUDA ops are built
# (setuptools warns at length about every editable install of a package with a C extension: the block is dropped)
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" \
  | awk '/BuildBackendWarning: Editable installation/ {skip = 1} !skip {print} /with strategy, WheelFile/ {skip = 0}' || true
.venv/bin/python -c "import torch, safetensors, fsdp_restore, fsdp_restore.screened_read as s; print('fsdp_restore', fsdp_restore.__version__, 'torch', torch.__version__, '(the check\'s C read: ' + ('built)' if s._screened else 'not built: no C compiler, the Python one is used)'))"
