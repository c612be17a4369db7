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
# sweep.md (mlx-parallm bench, engine vs mlx-lm's batch generation, ~1B 4-bit random model,
# chat, 64 new tokens, EOS ignored, 1/2/4/8/32/64 concurrent); tests.txt (pytest -m gpu);
# summary.txt. Budget: under 10 minutes (one device call). Python: $PYTHON (default python3). A rehearsal on a CPU
# (see gpu_pack.sh) takes a smaller model and fewer levels: SHAPE=135m LEVELS=1,2 ROWS=1,2.
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
WHEEL="$STAGE/$(cat .gpu/part2/mlx-cuda.name)"
cat "$STAGE/mlx-cuda.part.aa" $(ls .gpu/part2/mlx-cuda.part.a[b-z] 2>/dev/null) > "$WHEEL"
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PY" -m pip install -q --no-index --no-deps --no-compile "$WHEEL" .gpu/part2/mlx-*.whl || exit 1
tar -C "$SITE" -xJf .gpu/part2/site.tar.xz || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TOK=$PWD/.gpu/part2/tokenizer
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

summary "# GPU check $(date -u +%F) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())" 2>&1 | tee -a "$OUT/summary.txt"

timeout 45 "$PY" -m mlx_parallm_provider.cli doctor > "$OUT/doctor.txt" 2>&1
summary "doctor rc=$? ($(grep -E '^(device|backend|paged attention) ' "$OUT/doctor.txt" | tr -s ' ' | tr '\n' ';'))"

SHAPE=${SHAPE:-1b}
MODELS=/tmp/parallm-models
timeout 150 "$PY" -m mlx_parallm_provider.bench.gpu --tokenizer "$TOK" --shape "$SHAPE" --rows "${ROWS:-1,2,4,8,32,64}" \
  --work "$MODELS" --json "$OUT/gpu.json" > "$OUT/gpu.md" 2>&1
summary "bench.gpu rc=$?"

[ -f "$MODELS/$SHAPE-4bit/config.json" ] || "$PY" -m mlx_parallm_provider.bench.random_model --shape "$SHAPE" --bits 4 \
  --tokenizer "$TOK" --out "$MODELS/$SHAPE-4bit" > /dev/null
timeout 170 "$PY" -m mlx_parallm_provider.cli bench --model "$MODELS/$SHAPE-4bit" --systems engine,mlx-lm-batch --workload chat \
  --max-tokens 64 --ignore-eos --concurrency "${LEVELS:-1,2,4,8,32,64}" --output-dir /tmp/parallm-sweep --no-progress > "$OUT/sweep.md" 2>&1
summary "sweep rc=$?"
cp /tmp/parallm-sweep/results.json "$OUT/sweep.json" 2>/dev/null

timeout 160 "$PY" -m pytest -m gpu -q -p no:cacheprovider --tokenizer-dir "$TOK" -o addopts="-rfE" tests/integration > "$OUT/tests.txt" 2>&1
summary "pytest -m gpu rc=$?: $(tail -1 "$OUT/tests.txt")"
cat "$OUT/summary.txt"
tail -40 "$OUT/gpu.md"
tail -20 "$OUT/sweep.md"
