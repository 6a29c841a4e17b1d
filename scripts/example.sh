#!/usr/bin/env bash
# The main job on the built-in example: make a training checkpoint (.pt), convert it to safetensors,
# inspect and verify it against the source, then restore it on 2 ranks with FSDP2 (model + optimizer,
# NaN-fill check), keep training and save from the shards (every rank writes its own bytes of one file);
# verify that file, and restore it under FSDP1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
CLI=.venv/bin/fsdp-restore
OUT=example_run
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
echo "== 1. a training checkpoint, as large runs save them"
$PY scripts/make_example_checkpoint.py "$OUT/step3.pt" --steps 3
echo "== 2. convert (streaming, pickle-free safetensors)"
$CLI convert "$OUT/step3.pt" "$OUT/step3.safetensors" --force
echo "== 3. inspect"
$CLI inspect "$OUT/step3.safetensors" --depth 2
echo "== 4. verify against the source, bit for bit"
$CLI verify "$OUT/step3.safetensors" --against "$OUT/step3.pt"
RUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2 scripts/train_resume.py"
QUIET='^W\|OMP_NUM_THREADS\|^\*\*\*\*'
echo "== 5. restore on 2 ranks (FSDP2, gloo on CPU), train 3 steps, save from the shards (and read it back)"
$RUN --ckpt "$OUT/step3.safetensors" --fsdp fsdp2 --steps 3 --save "$OUT/step6.safetensors" --verify-save 2>&1 | grep -v "$QUIET"
echo "== 6. verify the saved checkpoint (every tensor's checksum and the header's)"
$CLI verify "$OUT/step6.safetensors"
echo "== 7. restore the saved step 6 under FSDP1 and continue"
$RUN --ckpt "$OUT/step6.safetensors" --fsdp fsdp1 --steps 2 2>&1 | grep -v "$QUIET"
echo "== done: step 3 restored and trained under FSDP2, saved from its shards, restored under FSDP1 at step 6"
