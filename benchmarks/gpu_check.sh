#!/usr/bin/env bash
# GPU check of the backend on one GPU (target: one H200, under ten minutes).
#
#   bash benchmarks/gpu_check.sh            # from the repository root; results under $OUT
#
# 1. bf16 GEMM peak for reference (`backend bench`: 8192^3 in three layouts, plus the model's shapes);
# 2. `backend run` of gpt-1b on grid 1x1x1x1 (bf16 compute, fp32 master weights), with activation
#    recomputation (the AxoNN setting) and without;
# 3. one JSON summary: tokens/s, achieved flop/s (reference formula of twin.model.ModelSpec, with and
#    without the recomputed forward counted) and the fraction of the measured GEMM peak.
#
# Overrides for a dry run on a CPU: MODEL=gpt-tiny DEVICE=cpu DTYPE=fp32 SQUARE=512 STEPS=4.
# To keep the result (on a machine with the repository):
#   cp $OUT/gpu_check.json calibration/measurements/gpu-check-<gpu>-<yyyy-mm-dd>.json
#   git add calibration/measurements/gpu-check-*.json && git commit -m "GPU check on <machine>, <date>"
set -u
OUT=${OUT:-$PWD/gpu_check_out}
MODEL=${MODEL:-gpt-1b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
SQUARE=${SQUARE:-8192}
STEPS=${STEPS:-25}
RUN_TIMEOUT=${RUN_TIMEOUT:-200}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

echo "== environment" | tee "$OUT/environment.txt"
{ date -u +%Y-%m-%dT%H:%M:%SZ; hostname; git rev-parse HEAD 2>/dev/null; nvidia-smi 2>/dev/null | head -15
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} 2>&1 | tee -a "$OUT/environment.txt"
if ! $PY -c "import torch, typer, numpy, rich" 2>/dev/null; then
  echo "error: python needs torch, typer, numpy and rich (pip install -e . from the repository root)"; exit 2
fi
if [ "$DEVICE" = cuda ] && ! $PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "error: no CUDA device visible to PyTorch"; exit 2
fi

echo "== 1. GEMM peak ($DTYPE, ${SQUARE}^3 and the shapes of $MODEL)"
timeout 150 $PY -m backend.cli bench --model "$MODEL" --grid 1x1x1x1 --squares "$SQUARE" --no-comm \
  --min-time 0.5 --device "$DEVICE" --dtype "$DTYPE" --out "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log"

echo "== 2a. backend run $MODEL 1x1x1x1, recomputation on"
timeout "$RUN_TIMEOUT" $PY -m backend.cli run --model "$MODEL" --grid 1x1x1x1 --device "$DEVICE" \
  --steps "$STEPS" --warmup 5 --lr 3e-4 --min-lr 3e-5 --out "$OUT/run_recompute" 2>&1 | tee "$OUT/run_recompute.log"

echo "== 2b. backend run $MODEL 1x1x1x1, recomputation off"
timeout "$RUN_TIMEOUT" $PY -m backend.cli run --model "$MODEL" --grid 1x1x1x1 --device "$DEVICE" \
  --steps "$STEPS" --warmup 5 --lr 3e-4 --min-lr 3e-5 --no-recompute --out "$OUT/run_no_recompute" 2>&1 \
  | tee "$OUT/run_no_recompute.log"

echo "== 3. summary"
$PY benchmarks/gpu_check_summary.py "$OUT" | tee "$OUT/summary.txt"
