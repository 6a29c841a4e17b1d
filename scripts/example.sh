#!/usr/bin/env bash
# The main job on the built-in example: make a training checkpoint (.pt), convert it to safetensors,
# inspect and verify it against the source, then restore it on 2 ranks with FSDP2 and FSDP1
# (model + optimizer, NaN-fill check) and keep training.
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
for fsdp in fsdp2 fsdp1; do
  echo "== 5. restore on 2 ranks ($fsdp, gloo on CPU) and continue training"
  $PY -m torch.distributed.run --standalone --nproc-per-node 2 scripts/train_resume.py \
      --ckpt "$OUT/step3.safetensors" --fsdp "$fsdp" --steps 3 2>&1 | grep -v "^W\|OMP_NUM_THREADS\|^\*\*\*\*"
done
echo "== done: the restored runs above continue from step 3"
