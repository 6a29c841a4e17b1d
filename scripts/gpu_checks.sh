#!/usr/bin/env bash
# Every GPU measurement and test of the suite, in one run, on a machine with an NVIDIA GPU and torch installed:
#   OUT=gpu-out bash scripts/gpu_checks.sh [steps...]     (steps: warm tests llama cold rest; default: all)
# Also, by name only: staging (what pinning, registering, pageable copies and GDS cost here), variants (ours with
# smaller reads beside the default).
# Each step has a time limit and writes its log and JSON under $OUT as it goes, so a run cut short keeps what
# it measured. The numbers go to BENCHMARKS.md ("GPU").
set -u
OUT=$(realpath -m "${OUT:-gpu-out}")  # from the caller's directory
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/fsdp_restore_gpu}
THREADS=${THREADS:-4 8 16}  # the sweep of read threads (ours and the bare read)
BEST=${BEST:-}  # the thread count of the other rows; default: ours' fastest in the warm sweep
STEPS=${*:-warm tests llama cold rest}
TESTS_K=${TESTS_K:-nccl or cuda or gpu}  # which tests (pytest -k): by default the suite's GPU cases
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo "cpus: $(nproc)"; free -g
  $PY -c 'import torch, safetensors; print("torch", torch.__version__, "cuda", torch.version.cuda, "safetensors", safetensors.__version__)'
  $PY - <<'PY'
import time, torch
torch.empty(1, pin_memory=True)
for mb in (16, 64, 256):  # what pinning host memory costs (a first restore allocates its staging buffers)
    torch._C._host_emptyCache()
    t0 = time.perf_counter(); b = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True); t = time.perf_counter() - t0
    print(f"pin {mb} MB: {t * 1e3:.1f} ms ({mb / 1024 / t:.1f} GB/s)"); del b
PY
  df -h /tmp | tail -1; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1  # (-k: a rank that ignores SIGTERM is killed)
  echo "== $name: exit $?, $((SECONDS - t0)) s"
  tail -25 "$OUT/$name.log"
}

best() {  # ours' fastest thread count in the warm sweep
  $PY -c 'import json, sys; rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["method"] == "ours"]
print(max(rows, key=lambda r: r["gbps"])["threads"] if rows else 4)' "$OUT/warm-sweep.json" 2>/dev/null || echo 4
}

for s in $STEPS; do
  [ -z "$BEST" ] && [ -f "$OUT/warm-sweep.json" ] && BEST=$(best) && echo "== threads for the other rows: $BEST"
  case $s in
    warm)
      rm -f "$OUT/warm-sweep.json"  # not an earlier run's
      # shellcheck disable=SC2086
      step warm-sweep ${WARM_LIMIT:-110} $PY scripts/benchmark_gpu.py --restore-mb 4096 --cache warm --methods h2d read ours \
        --threads $THREADS --repeat 3 --workdir "$WORK" --out "$OUT/warm-sweep.json" ;;
    rest)
      step warm-rest 70 $PY scripts/benchmark_gpu.py --restore-mb 4096 --cache warm --methods ours-nocheck ours-profile \
        dcp broadcast --threads "${BEST:-4}" --repeat 3 --workdir "$WORK" --out "$OUT/warm-rest.json" ;;
    tests)  # the suite's GPU cases: NCCL and gloo with GPU tensors (on a machine without a GPU they skip)
      parallel=$($PY -c 'import xdist' 2>/dev/null && echo "-n 8")  # pytest-xdist where installed
      # shellcheck disable=SC2086
      step tests ${TESTS_LIMIT:-200} $PY -m pytest -q $parallel -m "not slow" -k "$TESTS_K" -p no:cacheprovider \
        --ignore=tests/test_cli.py --junitxml="$OUT/tests.xml" tests ;;  # (the CLI has no GPU case)
    cold)
      # shellcheck disable=SC2086
      step cold ${COLD_LIMIT:-70} $PY scripts/benchmark_gpu.py --restore-mb 4096 --cache cold \
        --methods ${COLD_METHODS:-read ours ours-nocheck} \
        --threads "${BEST:-4}" --repeat 2 --workdir "$WORK" --out "$OUT/cold.json" ;;
    llama)
      step llama ${LLAMA_LIMIT:-100} $PY scripts/benchmark_gpu.py --model llama --restore-mb 4096 --cache warm \
        --methods ${LLAMA_METHODS:-h2d read ours ours-nocheck dcp} --threads "${BEST:-4}" \
        --repeat 3 --workdir "$WORK-llama" \
        --out "$OUT/llama.json" ;;
    staging)
      step staging 60 $PY scripts/gpu_staging.py --out "$OUT/staging.json"
      [ -f "$WORK/model.safetensors" ] && step gds 40 $PY scripts/gpu_staging.py --gds "$WORK/model.safetensors" \
        --out "$OUT/gds.json" ;;
    variants)
      # shellcheck disable=SC2086
      step variants ${VARIANTS_LIMIT:-90} $PY scripts/benchmark_gpu.py --restore-mb 4096 --cache warm --methods ours \
        --threads $THREADS --chunk-mb 0 8 --repeat 3 --workdir "$WORK" --out "$OUT/variants.json" ;;
    *) echo "unknown step $s (warm tests llama cold rest staging variants)"; exit 2 ;;
  esac
done
