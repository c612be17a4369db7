#!/usr/bin/env bash
# Pack what scripts/gpu_check.sh needs on a GPU machine that reaches no package registry
# (Python 3.12, x86-64 Linux, CUDA 13): MLX's CUDA build and the packages that machine lacks,
# in two folders of at most ~58 MB each, sent there in two calls back to back:
#   .gpu/part1/  the first part of the mlx-cuda-13 wheel's files (one tar.xz);
#   .gpu/part2/  its rest, MLX's own wheel, the rest as one site-packages tarball,
#                py-spy's wheel (a profiler: one binary), and the default model's tokenizer
#                (the tiny test models and the random ~1B model are built from it there).
# Versions are this checkout's (.venv's). Run scripts/setup.sh --dev first.
# A rehearsal on a CPU machine packs for its Python with MLX's CPU build instead:
#   PACK_PYTHON=3.12 PACK_MLX_BACKEND=mlx-cpu bash scripts/gpu_pack.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
OUT=.gpu
rm -rf "$OUT" && mkdir -p "$OUT/wheels" "$OUT/part1" "$OUT/part2" "$OUT/site"
# .gpu/ is in .gitignore: the device tool carries it as an ignored path

# What the GPU machine's image already holds (scripts/gpu_image.txt): not carried.
PRESENT=$(sed -e '/^#/d' -e 's/[=<>].*//' scripts/gpu_image.txt)
BACKEND=${PACK_MLX_BACKEND:-mlx-cuda-13}
PLATFORM=(--only-binary=:all: --python-version "${PACK_PYTHON:-3.12}" --implementation cp --platform any)
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORM+=(--platform "${tag}_x86_64")
done
"$PY" -m pip freeze --exclude-editable | grep -v ' @ ' > "$OUT/constraints.txt"
MLX=$("$PY" -c "import importlib.metadata as m; print(m.version('mlx'))")
"$PY" -m pip download -q "${PLATFORM[@]}" -c "$OUT/constraints.txt" -d "$OUT/wheels" \
  "mlx==$MLX" mlx-lm litellm langchain-core llguidance gguf pytest-xdist hypothesis  # (the last two: their dependencies)
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT/cuda" "$BACKEND==$MLX"
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -c "$OUT/constraints.txt" -d "$OUT/part2" py-spy

norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
for wheel in "$OUT"/wheels/*.whl; do
  name=$(norm "$(basename "$wheel" | cut -d- -f1)")
  # and what no code run there imports (LiteLLM's AWS clients, langsmith's compression, transformers' kernels)
  case " $(echo $PRESENT) boto3 botocore s3transfer jmespath zstandard kernels " in *" $name "*) rm "$wheel" ;; esac
done
# mlx goes as a wheel (installed beside mlx-cuda-13); the rest as one tarball of their files.
mv "$OUT"/wheels/mlx-*.whl "$OUT/part2/"
"$PY" -m pip install -q --no-deps --no-compile --no-index "${PLATFORM[@]}" --target "$OUT/site" "$OUT"/wheels/*.whl
rm -rf "$OUT/site/litellm/proxy/_experimental/out" "$OUT/site/bin"  # the proxy's web UI: not served there
find "$OUT/site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$OUT/site" -cJf "$OUT/part2/site.tar.xz" .

# MLX's backend goes as the files its wheel installs, xz-compressed: 75 MB where the wheel (zip)
# is 90 MB. Split in two, so that each call, with the checkout, keeps ~8 MB below the 64 MiB.
"$PY" -m pip install -q --no-deps --no-compile --no-index "${PLATFORM[@]}" --target "$OUT/backend" "$OUT"/cuda/*.whl
rm -rf "$OUT/backend/bin"
tar -C "$OUT/backend" -cf - . | xz -T0 -9 | split -b 56000000 - "$OUT/mlx-cuda.part."
mv "$OUT/mlx-cuda.part.aa" "$OUT/part1/"
mv "$OUT"/mlx-cuda.part.a[b-z] "$OUT/part2/" 2>/dev/null || true  # (a small backend is one part)

"$PY" - "$OUT/part2/tokenizer" <<'EOF'
import sys
from mlx_parallm_provider.models.gguf import read_gguf_tokenizer
from mlx_parallm_provider.models.registry import default_gguf_path
read_gguf_tokenizer(default_gguf_path(), sys.argv[1])
EOF
rm -rf "$OUT/site" "$OUT/wheels" "$OUT/cuda" "$OUT/backend"
# each call carries one part and the checkout (tracked and untracked files git does not ignore)
tree=$(git ls-files -co --exclude-standard -z | du --files0-from=- -cb | tail -1 | cut -f1)
for part in part1 part2; do
  size=$(( $(du -sb "$OUT/$part" | cut -f1) + tree ))
  echo "$part with the checkout: $size bytes (a call carries at most 67108864)"
  [ "$size" -le 67108864 ] || { echo "$part is too large to carry with the checkout" >&2; exit 1; }
done
