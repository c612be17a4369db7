#!/usr/bin/env bash
# The GPU checks, on a machine with MLX's CUDA backend's requirements (x86-64 Linux, Python
# 3.12, CUDA 13, an NVIDIA GPU) and no package registry. Pack here first: scripts/gpu_pack.sh.
#
#   1st call, carrying .gpu/part1:  bash scripts/gpu_check.sh stage
#   2nd call at once, carrying .gpu/part2:  bash scripts/gpu_check.sh run
#
# "run" installs MLX (CUDA) and the missing packages into that machine's Python, then, each
# under its own time limit, writes to $OUT (default ./gpu-out): doctor.txt; gpu.json / gpu.md
# (the paged kernels against the gather path, greedy agreement with mlx-lm, where a decode
# step's time goes at 1-64 rows: python -m mlx_parallm_provider.bench.gpu); sweep.json /
# sweep.md (mlx-parallm bench, engine vs mlx-lm's batch generation and its server over HTTP,
# ~1B 4-bit random model, chat, 64 new tokens, EOS ignored, 1/2/4/8/32/64 concurrent, the
# engine with its weights kept quantized and dequantized at load; sweep.json holds the runs
# done should the time limit cut it short); tests.txt (pytest -m gpu, float32 matmuls without
# TF32); summary.txt (with the attention path the sweep's engine ran with); with the time
# left, profile.txt.gz (py-spy over the engine serving 64 concurrent requests; its summary by
# thread is printed: python -m mlx_parallm_provider.bench.spy_summary). 8 files: as many as
# come back from the device.
# Budget: $BUDGET seconds (default 570, under one device call's 10 minutes) from the start of
# "run": each stage's time limit is cut to what is left, keeping the later stages' shares, so a
# slow stage shortens the next rather than losing the summary at the end. Python: $PYTHON
# (default python3); the random models are built in $MODELS (default /tmp/parallm-models). A
# rehearsal on a CPU (see gpu_pack.sh) takes a smaller model and fewer levels: SHAPE=135m
# LEVELS=1,2 ROWS=1,2 (and BUDGET=900: MLX's CPU is slow at bfloat16).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STAGE=/tmp/parallm-gpu
OUT=${OUT:-$PWD/gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$STAGE"

case "${1:-}" in
  stage)
    cp .gpu/part1/* "$STAGE/" && ls -la "$STAGE" && exit 0
    exit 1 ;;
  run) ;;
  *) echo "usage: $0 stage|run" >&2; exit 2 ;;
esac

[ -f "$STAGE/mlx-cuda.part.aa" ] || { echo "no $STAGE/mlx-cuda.part.aa: run 'stage' first (carrying .gpu/part1)" >&2; exit 1; }
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# MLX's backend comes as its wheel's files (xz-compressed, in two parts), MLX itself as its wheel
cat "$STAGE/mlx-cuda.part.aa" $(ls .gpu/part2/mlx-cuda.part.a[b-z] 2>/dev/null) | tar -C "$SITE" -xJ || exit 1
"$PY" -m pip install -q --no-index --no-deps --no-compile .gpu/part2/mlx-*.whl || exit 1
tar -C "$SITE" -xJf .gpu/part2/site.tar.xz || exit 1
# MLX compiles its CUDA kernels at run time (NVRTC) against the CUDA runtime's headers: where
# pip's package does not put them beside it, it takes $CUDA_HOME, else /usr/local/cuda.
if [ -z "${CUDA_HOME:-}${CUDA_PATH:-}" ]; then
  NVCC=$(command -v nvcc || true)
  for c in "$SITE/nvidia/cu13" "$SITE/nvidia/cuda_runtime" /usr/local/cuda ${NVCC:+"$(dirname "$(dirname "$NVCC")")"}; do
    [ -f "$c/include/cuda_runtime.h" ] && export CUDA_HOME=$c && break
  done
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TOK=$PWD/.gpu/part2/tokenizer
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
BUDGET=${BUDGET:-570}
# limit CAP KEEP: CAP seconds, or fewer so that KEEP seconds remain for the stages after it
limit() { local l=$((BUDGET - SECONDS - $2)); [ $l -lt $1 ] || l=$1; [ $l -gt 10 ] || l=10; echo $l; }

summary "# GPU check $(date -u +%F) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
summary "CUDA_HOME=${CUDA_HOME:-${CUDA_PATH:-unset}}; installed in $SECONDS s"
# a kernel compiled here (a fused elementwise one): a missing header shows now, in one line
timeout "$(limit 60 400)" "$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available(),
  'compiled kernel', mx.compile(lambda x: mx.exp(x) * 2 + 1)(mx.zeros(4)).tolist())" 2>&1 | tail -3 | tee -a "$OUT/summary.txt"

T=$SECONDS; timeout "$(limit 45 400)" "$PY" -m mlx_parallm_provider.cli doctor > "$OUT/doctor.txt" 2>&1
summary "doctor rc=$? in $((SECONDS - T)) s ($(grep -E '^(device|CUDA headers|backend|paged attention|KV pool at most) ' "$OUT/doctor.txt" | tr -s ' ' | tr '\n' ';'))"

SHAPE=${SHAPE:-1b}
MODELS=${MODELS:-/tmp/parallm-models}
# float32 in full float32 (MLX multiplies it in TF32 on a GPU by default): the agreement of the
# float32 model with mlx-lm compares what the CPU would; the bfloat16 timings are the same either way
# the breakdown's row counts 1, 8 and 64 first: each is written as it ends, should the time limit cut the rest
T=$SECONDS; MLX_ENABLE_TF32=0 NVIDIA_TF32_OVERRIDE=0 timeout "$(limit 150 300)" "$PY" -m mlx_parallm_provider.bench.gpu --tokenizer "$TOK" --shape "$SHAPE" --rows "${ROWS:-1,8,64,2,4,32}" \
  --work "$MODELS" --json "$OUT/gpu.json" > "$OUT/gpu.md" 2>&1
summary "bench.gpu rc=$? in $((SECONDS - T)) s"

[ -f "$MODELS/$SHAPE-4bit/config.json" ] || "$PY" -m mlx_parallm_provider.bench.random_model --shape "$SHAPE" --bits 4 \
  --tokenizer "$TOK" --out "$MODELS/$SHAPE-4bit" > /dev/null
# 32 and 64 first: the levels the targets name are measured should the time limit cut the rest
T=$SECONDS; timeout "$(limit 200 110)" "$PY" -m mlx_parallm_provider.cli bench --model "$MODELS/$SHAPE-4bit" --systems engine,mlx-lm-batch,mlx-lm-server \
  --workload chat --max-tokens 64 --ignore-eos --concurrency "${LEVELS:-32,64,1,2,4,8}" --sweep dequantize=false,true \
  --output-dir /tmp/parallm-sweep --no-progress > "$OUT/sweep.md" 2>&1
rc=$?
cp /tmp/parallm-sweep/results.json "$OUT/sweep.json" 2>/dev/null
summary "sweep rc=$rc in $((SECONDS - T)) s"
[ $rc = 0 ] || [ ! -f "$OUT/sweep.json" ] || "$PY" -c "import json, sys; from mlx_parallm_provider.bench import report
rows = json.load(open(sys.argv[1]))['rows']; print(report.markdown_table(rows, False))
print(''.join(f'- {line}\n' for line in report.attention_lines(rows)))" "$OUT/sweep.json" | tee -a "$OUT/sweep.md"  # the runs done
grep -E '^- engine \(.*attention: ' "$OUT/sweep.md" | sort -u | tee -a "$OUT/summary.txt"  # kernels used, or why not

# one line per test as it ends (-v): a run the time limit cuts short still says which passed;
# a module that cannot be imported there (a package the image lacks) skips itself alone; LangSmith's
# pytest plugin (installed with langchain-core) is left out: no test needs it, and it imports xxhash.
# $TEST_WORKERS processes (default half the cores, 2 to 8: 8 on the device's 16) share the GPU
# where pytest-xdist and its execnet are there (the image has the one, gpu_pack.sh carries the
# other): the tests' tiny models leave it idle between launches, each worker compiles MLX's
# kernels for itself, and the suite must end within its limit
CORES=$(nproc 2>/dev/null || echo 4); HALF=$((CORES / 2)); [ $HALF -ge 2 ] || HALF=2; [ $HALF -le 8 ] || HALF=8
WORKERS=$("$PY" -c "import xdist, execnet" 2>/dev/null && echo "-n ${TEST_WORKERS:-$HALF}")
T=$SECONDS; MLX_ENABLE_TF32=0 NVIDIA_TF32_OVERRIDE=0 timeout "$(limit 150 5)" "$PY" -m pytest $WORKERS -m gpu -v -p no:cacheprovider -p no:langsmith_plugin --continue-on-collection-errors \
  --tokenizer-dir "$TOK" -o addopts="-rfE" tests/integration tests/unit/test_batched_draws.py tests/unit/test_penalties.py tests/unit/test_verify_penalties.py \
  tests/unit/test_kv_storage_writes.py tests/unit/test_token_bans.py > "$OUT/tests.txt" 2>&1
summary "pytest -m gpu ${WORKERS:-(one process)} rc=$? in $((SECONDS - T)) s: $(tail -1 "$OUT/tests.txt"); $(grep -c ' PASSED' "$OUT/tests.txt") passed, $(grep -c ' FAILED' "$OUT/tests.txt") failed"
# Where the engine's time goes, with the time left only: py-spy over the engine serving
# $PROFILE_LEVEL (64) concurrent requests, every thread, its waits on the GPU included
SPY_WHEEL=$(ls .gpu/part2/py_spy-*.whl 2>/dev/null | head -1)
left=$((BUDGET - SECONDS))
if [ -n "$SPY_WHEEL" ] && [ $left -ge 40 ] && "$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1])
open(sys.argv[2], 'wb').write(z.read(next(n for n in z.namelist() if n.endswith('/scripts/py-spy'))))" "$SPY_WHEEL" "$STAGE/py-spy"; then
  chmod +x "$STAGE/py-spy"
  LEVEL=${PROFILE_LEVEL:-64}
  T=$SECONDS; timeout -s INT -k 10 $((left - 15)) "$STAGE/py-spy" record --idle --threads --nonblocking --format raw -o "$STAGE/profile.txt" -- \
    "$PY" -m mlx_parallm_provider.cli bench --model "$MODELS/$SHAPE-4bit" --systems engine --workload chat --max-tokens 128 --ignore-eos \
    --concurrency "$LEVEL" --num-prompts $((3 * LEVEL)) --output-dir /tmp/parallm-profile --no-progress > "$STAGE/profile.log" 2>&1
  rc=$?  # the engine's row, or why py-spy or the run failed
  summary "profile rc=$rc in $((SECONDS - T)) s: $(grep -m1 -E '^\| engine \|' "$STAGE/profile.log" || grep -v '^py-spy>' "$STAGE/profile.log" | grep . | tail -1)"
  if [ -s "$STAGE/profile.txt" ]; then
    "$PY" -m mlx_parallm_provider.bench.spy_summary "$STAGE/profile.txt" > "$STAGE/profile.md" 2>&1
    gzip -c "$STAGE/profile.txt" > "$OUT/profile.txt.gz"  # (at most 8 files come back: profile.md is made from it)
  fi
fi
cat "$OUT/summary.txt"
tail -40 "$OUT/gpu.md"
tail -20 "$OUT/sweep.md"
head -60 "$STAGE/profile.md" 2>/dev/null
