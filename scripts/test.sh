#!/usr/bin/env bash
# The test command: sets up (installs what is missing, builds), checks formatting, runs every
# test with ctest. No network beyond Debian's packages and, for the object storage test, PyPI's
# moto (an S3 server; that test skips when PyPI is unreachable); no GPU needed. Where nvcc is
# installed, the CUDA backend is built too (build-cuda/) and its tests run (they skip without a
# GPU), so CUDA code that stops compiling fails here. The Debian package is built, installed into
# a clean Debian root and used there, and so is the container image (tests/package/).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# Each stage's wall time as it ends (the whole run should stay well under 30 minutes on 2 cores).
lap_start=$SECONDS
lap() {
  echo "test: [time] $1: $((SECONDS - lap_start)) s (run so far: $((SECONDS / 60)) min $((SECONDS % 60)) s)"
  lap_start=$SECONDS
}
# On a fresh clone: the README's first command timed as a new user meets it, compiling cold
# (ccache recompiles and stores anew; what follows reuses it): scripts/setup.sh, the packages and
# the bertrain binary the demo runs. (An existing build directory would time nothing.)
if [ ! -e "$BUILD_DIR" ]; then
  t0=$(date +%s)
  CCACHE_RECACHE=1 scripts/setup.sh > /dev/null
  echo "test: scripts/setup.sh on a fresh clone, compiling cold: $(($(date +%s) - t0)) s on $(nproc) cores" |
    tee "$BUILD_DIR/setup-seconds.txt"
  lap "setup on a fresh clone"
fi
scripts/setup.sh --tests
scripts/format.sh --check
lap "setup --tests and format"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 600
lap "ctest ($BUILD_DIR)"

# A short coverage-guided fuzz of the parsers (records, checkpoints, configs, vocabularies)
# under ASan/UBSan (clang's libFuzzer).
if command -v clang++ >/dev/null && [ "${BERTRAIN_SKIP_FUZZ:-0}" != 1 ]; then
  cmake -S tests/fuzz -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-fuzz -j"$(nproc)" >/dev/null
  mkdir -p build-fuzz/corpus
  build-fuzz/fuzz_example -max_total_time="${BERTRAIN_FUZZ_SECONDS:-30}" -max_len=4096 \
    -artifact_prefix=build-fuzz/ build-fuzz/corpus tests/fuzz/corpus 2>&1 | tail -1
  echo "fuzz: record parsers, no crash in ${BERTRAIN_FUZZ_SECONDS:-30} s"
  # safetensors headers, config.json and vocab files
  mkdir -p build-fuzz/corpus_files
  build-fuzz/fuzz_files -max_total_time="${BERTRAIN_FUZZ_SECONDS:-30}" -max_len=8192 \
    -artifact_prefix=build-fuzz/ build-fuzz/corpus_files tests/fuzz/corpus_files 2>&1 | tail -1
  echo "fuzz: checkpoint, config and vocab parsers, no crash in ${BERTRAIN_FUZZ_SECONDS:-30} s"
  lap "fuzz"
fi

# The fault-injection suite once more on an AddressSanitizer + UBSan build of bertrain (our code
# instrumented; oneDNN, Open MPI and the C++ runtime as Debian ships them), without the
# two-rank kill cases the plain run covers. BERTRAIN_SKIP_ASAN=1 skips it.
if [ "${BERTRAIN_SKIP_ASAN:-0}" != 1 ]; then
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1" \
    -DBERTRAIN_SANITIZE=ON -DBERTRAIN_TESTS=OFF -DBERTRAIN_BENCH=OFF >/dev/null
  cmake --build build-asan -j"$(nproc)" --target bertrain >/dev/null
  FAULT_KINDS="sigterm diskfull ckpt input" tests/faults/run.sh build-asan/bertrain
  lap "faults under ASan"
fi

NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$NVCC" ] && [ "${BERTRAIN_SKIP_CUDA:-0}" != 1 ]; then
  echo "test: building the CUDA backend with $NVCC"
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA=ON -DBERTRAIN_BENCH=OFF \
    -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
  cmake --build build-cuda -j"$(nproc)"
  ctest --test-dir build-cuda --output-on-failure -R '^(Cuda(Backend|Model|Counts)?|Nccl|NcclDeathTest)\.' --timeout 600
  lap "CUDA build (nvcc) and its tests"
else
  echo "test: nvcc not found; CUDA backend not built"
fi

# The CUDA code without a GPU (cuda_emu/README.md): the same .cu files built for the emulated
# device, and every GPU test run on it (each CUDA kernel against the CPU's, the CUDA backend in
# every precision, BertModel and train::Step on it, NCCL between two emulated GPUs); then again
# with the kernels and the emulator under AddressSanitizer + UBSan, so an out-of-bounds access in
# a kernel fails with a stack (all but the two long training runs, whose kernels the others run,
# the two counts of the pages a step touches, a fault a page: minutes each under ASan; the
# emulator's own touch test stays; two counts of launches and waits over BERT-tiny steps whose
# kernels the model tests run at the same shapes; and the fine-tuning runs with and without
# graphs, whose kernels the heads' graph test runs), and the device running its streams' work as early as it may
# instead of as late.
# BERTRAIN_SKIP_CUDA_EMU=1 skips both.
if [ "${BERTRAIN_SKIP_CUDA_EMU:-0}" != 1 ]; then
  GPU_TESTS='^(Cuda(Backend|Model|Emu|Counts)?|Nccl|NcclDeathTest)\.'
  echo "test: the CUDA kernels on the emulated device (build-emu)"
  cmake -S . -B build-emu -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA_EMU=ON -DBERTRAIN_BENCH=OFF \
    >/dev/null
  cmake --build build-emu -j"$(nproc)" --target bertrain_tests >/dev/null
  ctest --test-dir build-emu --output-on-failure -j"$(nproc)" -R "$GPU_TESTS" --timeout 600
  lap "emulated device"
  echo "test: the CUDA kernels on the emulated device under ASan + UBSan (build-emu-asan)"
  cmake -S . -B build-emu-asan -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA_EMU=ON \
    -DBERTRAIN_SANITIZE_KERNELS=ON -DBERTRAIN_BENCH=OFF >/dev/null
  cmake --build build-emu-asan -j"$(nproc)" --target bertrain_tests >/dev/null
  # (with the other schedule: each operation as early as its stream allows; cuda_emu/README.md)
  CUDA_EMU_SCHEDULE=eager UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ctest \
    --test-dir build-emu-asan \
    --output-on-failure -j"$(nproc)" -R "$GPU_TESTS" \
    -E 'LossCurveTracksTheCpu|ReduceBucketsWhileBackwardRuns|TheBytesTheUpdateTouches|TheBytesEachKernel|NoHostSyncBetweenLoggedSteps|BenchPrintsThem|FineTuningAsGraphs' \
    --timeout 600
  lap "emulated device under ASan"
fi

# The Debian package installed into a clean Debian 12 root and used there, purged; the container
# image built from it and a 2-rank job run in it (tests/package/package_test.sh says what it
# checks). Needs root and Debian's mirror. BERTRAIN_SKIP_PACKAGE=1 skips it.
if [ "${BERTRAIN_SKIP_PACKAGE:-0}" != 1 ]; then
  rc=0
  tests/package/package_test.sh || rc=$?
  [ "$rc" = 77 ] && echo "test: package test skipped (above)"
  [ "$rc" = 0 ] || [ "$rc" = 77 ] || exit "$rc"
  lap "package"
fi

# Every Debian package that configure and the builds above read must be installed by setup.sh
# (a package installed by hand would otherwise hide a missing line until a fresh machine fails).
# The self-test: the same trace without oneDNN's OpenCL packages in the list must fail (both:
# ocl-icd-opencl-dev depends on the headers, so either alone keeps the other in the closure).
scripts/check-packages.sh --demo
scripts/check-packages.sh
if scripts/check-packages.sh --reuse --without ocl-icd-opencl-dev --without opencl-c-headers \
  >/dev/null 2>&1; then
  echo "test: check-packages passed with oneDNN's OpenCL packages removed from the list" >&2
  exit 1
fi
echo "check-packages: self-test ok (without the OpenCL packages in the list it fails)"
lap "check-packages"
