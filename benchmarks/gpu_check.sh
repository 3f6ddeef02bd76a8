#!/usr/bin/env bash
# GPU check of the backend on one GPU (target: one H200, under ten minutes; about three expected).
#
#   bash benchmarks/gpu_check.sh            # from anywhere; results under $OUT (default ./gpu_check_out)
#
# 0. the GPU tests (tests/test_backend_grads.py -m gpu: NCCL, bf16, GEMM layout tuning, CUDA events);
# 1. bf16 GEMM peak for reference (`backend bench`: 8192^3 in three layouts, plus the model's shapes);
# 2. `backend run` of gpt-1b on grid 1x1x1x1 (bf16 compute, fp32 master weights), with activation
#    recomputation (the AxoNN setting) and without;
# 3. `backend replay` of the same program (GEMMs alone, traced) for calibrating the twin;
# 4. `twin calibrate` of step 1's measurement into a profile (profile/h200.toml) and, where the
#    simulator's packages are installed, `twin validate` of the two runs against it (else the command
#    to run on the returned files). Commit measurement, profile and report under calibration/;
# 5. one JSON summary: tokens/s, achieved flop/s (reference formula of twin.program.model.ModelSpec, with and
#    without the recomputed forward counted) and the fraction of the measured GEMM peak.
#
# $OUT receives three files: gpu_check.json (the summary), gpu_check.log (everything printed) and
# gpu_check_files.tar.gz (every log, step log, trace and table). Needs python3 with torch, numpy,
# typer and rich; not plotly or networkx (the twin's simulation is not used here).
#
# With this workplace's device tool (the copy there may have no .git: name the commit):
#   run(command="GIT_COMMIT=<sha> bash benchmarks/gpu_check.sh", timeout_s=540); the
# H200 image has python3 3.12 with torch 2.11, numpy, typer and rich, and lacks simpy and plotly.
# Overrides for a dry run on a CPU: MODEL=gpt-tiny DEVICE=cpu DTYPE=fp32 SQUARE=512 STEPS=4.
# To keep the result (on a machine with the repository): the summary's last line extracts the
# summary, the bench measurement, the fitted profile and the validation report from the tarball into
# calibration/measurements/gpu-<gpu>-<yyyy-mm-dd>/ and commits them.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu_check_out}
MODEL=${MODEL:-gpt-1b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
SQUARE=${SQUARE:-8192}
STEPS=${STEPS:-25}
RUN_TIMEOUT=${RUN_TIMEOUT:-200}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT  # what is kept is in $OUT: the log, the summary and a tarball of $WORK
cd "$(dirname "$0")/.."

{
echo "== environment"
{ date -u +%Y-%m-%dT%H:%M:%SZ; hostname
  echo "commit ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"; nvidia-smi 2>/dev/null | head -15
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} 2>&1 | tee "$WORK/environment.txt"
if ! $PY -c "import torch, typer, numpy, rich" 2>/dev/null; then
  echo "error: python needs torch, typer, numpy and rich (pip install -e . from the repository root)"; exit 2
fi
if [ "$DEVICE" = cuda ] && ! $PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "error: no CUDA device visible to PyTorch"; exit 2
fi

if [ "$DEVICE" = cuda ]; then
  echo "== 0. GPU tests"
  timeout 180 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_backend_grads.py tests/test_moe_grids.py 2>&1 | tee "$WORK/pytest_gpu.log"
  echo "${PIPESTATUS[0]}" > "$WORK/pytest_gpu.rc"
fi

echo "== 1. GEMM peak ($DTYPE, ${SQUARE}^3 and the shapes of $MODEL)"
timeout 150 $PY -m backend.cli bench --model "$MODEL" --grid 1x1x1x1 --squares "$SQUARE" --no-comm --train-steps 0 \
  --min-time 0.5 --device "$DEVICE" --dtype "$DTYPE" --out "$WORK/gemm.json" 2>&1 | tee "$WORK/gemm.log"

echo "== 2a. backend run $MODEL 1x1x1x1, recomputation on"
timeout "$RUN_TIMEOUT" $PY -m backend.cli run --model "$MODEL" --grid 1x1x1x1 --device "$DEVICE" \
  --steps "$STEPS" --warmup 5 --lr 3e-4 --min-lr 3e-5 --out "$WORK/run_recompute" 2>&1 | tee "$WORK/run_recompute.log"

echo "== 2b. backend run $MODEL 1x1x1x1, recomputation off"
timeout "$RUN_TIMEOUT" $PY -m backend.cli run --model "$MODEL" --grid 1x1x1x1 --device "$DEVICE" \
  --steps "$STEPS" --warmup 5 --lr 3e-4 --min-lr 3e-5 --no-recompute --out "$WORK/run_no_recompute" 2>&1 \
  | tee "$WORK/run_no_recompute.log"

echo "== 3. backend replay $MODEL 1x1x1x1 (GEMMs of the program, traced)"
timeout 120 $PY -m backend.cli replay --model "$MODEL" --grid 1x1x1x1 --device "$DEVICE" --steps 3 \
  --out "$WORK/replay_trace" 2>&1 | tee "$WORK/replay.log"

echo "== 4. calibrate and validate (the bench of step 1 -> a profile -> the runs of step 2)"
case "$DEVICE" in cuda) BASE=${BASE:-h200}; PROFILE=h200 ;; *) BASE=${BASE:-calibration/base/cpu.toml}; PROFILE=cpu ;; esac
mkdir -p "$WORK/profile"
timeout 120 $PY -m twin.cli calibrate "$WORK/gemm.json" --base "$BASE" --out "$WORK/profile/$PROFILE.toml" 2>&1 \
  | tee "$WORK/calibrate.log"
if $PY -c "import plotly, networkx" 2>/dev/null; then
  timeout 300 $PY -m twin.cli validate "$WORK/run_recompute" "$WORK/run_no_recompute" --system "${SYSTEM:-$PROFILE}" \
    --profile "$WORK/profile/$PROFILE.toml" --json "$WORK/validate.json" 2>&1 | tee "$WORK/validate.log"
else  # the H200 image lacks the simulator's packages: validate where the files come back
  echo "twin validate skipped (no plotly/networkx here); on a machine with the repository, unpack"
  echo "gpu_check_files.tar.gz into DIR and run: twin validate DIR/run_recompute DIR/run_no_recompute \\"
  echo "  --system h200 --profile DIR/profile/$PROFILE.toml --json DIR/validate.json --html DIR/validate.html"
fi

echo "== 5. summary"
$PY benchmarks/gpu_check_summary.py "$WORK" "$OUT" 2>&1 | tee "$WORK/summary.txt"
cp "$WORK/gpu_check.json" "$OUT/" 2>/dev/null
tar czf "$OUT/gpu_check_files.tar.gz" -C "$WORK" .
echo "files: $OUT/gpu_check.json, $OUT/gpu_check_files.tar.gz, $OUT/gpu_check.log"
} 2>&1 | tee "$OUT/gpu_check.log"
