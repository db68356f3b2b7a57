#!/usr/bin/env bash
# The test command: sets up (installs what is missing, builds), checks formatting, runs every
# test with ctest. No Python, no network beyond Debian's packages, no GPU needed. Where nvcc is
# installed, the CUDA backend is built too (build-cuda/) and its tests run (they skip without a
# GPU), so CUDA code that stops compiling fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/format.sh --check
BUILD_DIR=${BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 600

NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$NVCC" ] && [ "${BERTRAIN_SKIP_CUDA:-0}" != 1 ]; then
  echo "test: building the CUDA backend with $NVCC"
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA=ON -DBERTRAIN_BENCH=OFF \
    -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
  cmake --build build-cuda -j"$(nproc)"
  ctest --test-dir build-cuda --output-on-failure -R '^Cuda\.' --timeout 600
else
  echo "test: nvcc not found; CUDA backend not built"
fi
