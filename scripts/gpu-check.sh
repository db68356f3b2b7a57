#!/usr/bin/env bash
# The GPU check (#16), for a session lent the device machine (one H200, CUDA 13, none of our
# Debian libraries): build here, run there.
#   scripts/gpu-check.sh pack   here: the CUDA build (build-cuda/), its test binary and the CLI
#                               stripped, with every shared library they load except glibc's and
#                               cuBLAS's (the device has CUDA 13), packed into gpu-pack.tar.xz
#                               (ignored; carry it: run's `carry: ["gpu-pack.tar.xz"]`)
#   scripts/gpu-check.sh run    there (or here, where the GPU tests skip): unpacks it and runs
#                               every GPU test (Cuda.*: each CUDA kernel against the CPU kernel;
#                               CudaBackend.*: the CUDA backend against the CPU backend in every
#                               precision) and the host tests of the row math the kernels share
#                               (RowMath); the log goes to $OUT/gpu-check.log.
# What it does not check yet, because it does not exist yet: a whole training step on the GPU
# (the model's memory on the device), NCCL, and the BERT-base/Large benchmark against PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=gpu-pack
case "${1:-}" in
  pack)
    NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
    [ -n "$NVCC" ] || { echo "gpu-check: nvcc not found (the CUDA toolkit builds the pack)"; exit 2; }
    cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA=ON -DBERTRAIN_BENCH=OFF \
      -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
    cmake --build build-cuda -j"$(nproc)" --target bertrain_tests bertrain
    rm -rf "$PACK" gpu-pack.tar.xz
    mkdir -p "$PACK/bin" "$PACK/lib"
    cp build-cuda/tests/bertrain_tests build-cuda/bertrain "$PACK/bin/"
    strip "$PACK"/bin/*
    ldd build-cuda/tests/bertrain_tests build-cuda/bertrain | awk '/=> \//{print $3}' | sort -u |
      while read -r lib; do
        case "$(basename "$lib")" in
          libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | ld-linux* | libcublas* | \
            libcuda.so*) ;;
          *) cp -L "$lib" "$PACK/lib/" ;;
        esac
      done
    tar -C "$PACK" -cf - . | xz -T0 -6 >gpu-pack.tar.xz
    echo "gpu-check: gpu-pack.tar.xz $(du -h gpu-pack.tar.xz | cut -f1) ($(ls "$PACK/lib" | wc -l) libraries);" \
      "on the device: scripts/gpu-check.sh run, carrying gpu-pack.tar.xz"
    ;;
  run)
    if [ -f gpu-pack.tar.xz ]; then
      rm -rf "$PACK" && mkdir -p "$PACK" && xz -dc gpu-pack.tar.xz | tar -C "$PACK" -xf -
    fi
    [ -x "$PACK/bin/bertrain_tests" ] ||
      { echo "gpu-check: no $PACK/bin/bertrain_tests: run 'scripts/gpu-check.sh pack' first"; exit 2; }
    # cuBLAS: the toolkit's, else the one PyTorch's wheels bring.
    CUBLAS=""
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [ -d "$d" ] && CUBLAS="$CUBLAS:$d"; done
    PYCUBLAS=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)
    [ -n "$PYCUBLAS" ] && CUBLAS="$CUBLAS:$PYCUBLAS"
    export LD_LIBRARY_PATH="$PWD/$PACK/lib$CUBLAS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    LOG=${OUT:-.}/gpu-check.log
    {
      echo "== gpu-check $(date -u +%FT%TZ) on $(hostname)"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
      if ldd "$PACK/bin/bertrain_tests" | grep "not found"; then echo "gpu-check: libraries missing (above)"; fi
      set +e
      OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} "$PACK/bin/bertrain_tests" --gtest_filter='Cuda*:*RowMath*'
      echo "gpu-check: tests exit $?"
    } 2>&1 | tee "$LOG"
    grep -q "tests exit 0" "$LOG"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh pack|run"
    exit 2
    ;;
esac
