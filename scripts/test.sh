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

# The later stages' builds, each configured and built the same way wherever it runs.
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
want() {  # STAGE: whether this run has that stage
  case $1 in
    fuzz) command -v clang++ >/dev/null && [ "${BERTRAIN_SKIP_FUZZ:-0}" != 1 ] ;;
    asan) [ "${BERTRAIN_SKIP_ASAN:-0}" != 1 ] ;;
    cuda) [ -n "$NVCC" ] && [ "${BERTRAIN_SKIP_CUDA:-0}" != 1 ] ;;
    emu | emu-asan) [ "${BERTRAIN_SKIP_CUDA_EMU:-0}" != 1 ] ;;
  esac
}
build() {  # STAGE
  case $1 in
    fuzz)
      cmake -S tests/fuzz -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
      cmake --build build-fuzz -j"$(nproc)" >/dev/null ;;
    asan)
      cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1" \
        -DBERTRAIN_SANITIZE=ON -DBERTRAIN_TESTS=OFF -DBERTRAIN_BENCH=OFF >/dev/null
      cmake --build build-asan -j"$(nproc)" --target bertrain >/dev/null ;;
    cuda)
      cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA=ON -DBERTRAIN_BENCH=OFF \
        -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
      cmake --build build-cuda -j"$(nproc)" ;;
    emu)
      cmake -S . -B build-emu -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA_EMU=ON -DBERTRAIN_BENCH=OFF \
        >/dev/null
      cmake --build build-emu -j"$(nproc)" --target bertrain_tests >/dev/null ;;
    emu-asan)
      cmake -S . -B build-emu-asan -DCMAKE_BUILD_TYPE=Release -DBERTRAIN_CUDA_EMU=ON \
        -DBERTRAIN_SANITIZE_KERNELS=ON -DBERTRAIN_BENCH=OFF >/dev/null
      cmake --build build-emu-asan -j"$(nproc)" --target bertrain_tests >/dev/null ;;
  esac
}
STAGES="fuzz asan cuda emu emu-asan"

# From here on those builds run in the background, in the stages' order, at the lowest priority
# the kernel has (SCHED_IDLE, and the idle I/O class): on a core only while no test wants it, a
# test that wakes taking the core back at once. ctest's multi-rank tests run one at a time and
# mostly wait (its last minutes keep a core of two idle), and so do the fault cases, so the
# builds fill that time instead of following it. Each stage waits for its own build there, then
# builds again (nothing left to do; a build that failed there fails here with its message).
# BERTRAIN_PREBUILD=0 builds each where its stage runs.
prebuild_pid=""
if [ "${BERTRAIN_PREBUILD:-1}" != 0 ] && command -v chrt >/dev/null && command -v ionice >/dev/null; then
  rm -f "$BUILD_DIR/prebuild.txt"
  set -m  # (its own process group: ended with it should this script stop early)
  (
    # (the subshell's own policy first: what it starts inherits it)
    chrt -i -p 0 "$BASHPID" >/dev/null && ionice -c 3 -p "$BASHPID" || exit 0
    for stage in $STAGES; do
      want "$stage" || continue
      t0=$SECONDS
      if build "$stage" > "$BUILD_DIR/prebuild-$stage.log" 2>&1; then r=built; else r=failed; fi
      echo "$stage $r $((SECONDS - t0))" >> "$BUILD_DIR/prebuild.txt"
    done
  ) &
  prebuild_pid=$!
  set +m
  trap 'kill -- -"$prebuild_pid" 2>/dev/null || true' EXIT
fi
await_build() {  # STAGE: until the background build has done it (or has ended)
  [ -n "$prebuild_pid" ] || return 0
  while kill -0 "$prebuild_pid" 2>/dev/null &&
    ! grep -q "^$1 " "$BUILD_DIR/prebuild.txt" 2>/dev/null; do
    sleep 1
  done
}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 600
lap "ctest ($BUILD_DIR)"

# A short coverage-guided fuzz of the parsers (records, checkpoints, configs, vocabularies)
# under ASan/UBSan (clang's libFuzzer).
if want fuzz; then
  await_build fuzz
  build fuzz
  # The two at once, a core each: the records' parsers; safetensors headers, config.json and
  # vocab files.
  fuzz() {  # TARGET MAX_LEN CORPUS
    mkdir -p "build-fuzz/$3"
    build-fuzz/"$1" -max_total_time="${BERTRAIN_FUZZ_SECONDS:-30}" -max_len="$2" \
      -artifact_prefix=build-fuzz/ "build-fuzz/$3" "tests/fuzz/$3" > "build-fuzz/$1.log" 2>&1
  }
  fuzz fuzz_example 4096 corpus &
  records=$!
  fuzz fuzz_files 8192 corpus_files &
  files=$!
  rc_records=0 rc_files=0
  wait $records || rc_records=$?
  wait $files || rc_files=$?
  for f in "fuzz_example:$rc_records:record parsers" \
    "fuzz_files:$rc_files:checkpoint, config and vocab parsers"; do
    IFS=: read -r target rc what <<< "$f"
    if [ "$rc" != 0 ]; then
      tail -n 40 "build-fuzz/$target.log"
      echo "fuzz: $target failed (exit $rc; its input in build-fuzz/, the log above)" >&2
      exit 1
    fi
    tail -n 1 "build-fuzz/$target.log"
    echo "fuzz: $what, no crash in ${BERTRAIN_FUZZ_SECONDS:-30} s"
  done
  lap "fuzz"
fi

# The fault-injection suite once more on an AddressSanitizer + UBSan build of bertrain (our code
# instrumented; oneDNN, Open MPI and the C++ runtime as Debian ships them), without the
# two-rank kill cases the plain run covers. BERTRAIN_SKIP_ASAN=1 skips it.
if want asan; then
  await_build asan
  build asan
  FAULT_KINDS="sigterm diskfull ckpt input" tests/faults/run.sh build-asan/bertrain
  lap "faults under ASan"
fi

if want cuda; then
  echo "test: building the CUDA backend with $NVCC"
  await_build cuda
  build cuda
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
# graphs and with the padding skipped, whose kernels the heads' graph test runs), and the device running its streams' work as early as it may
# instead of as late.
# BERTRAIN_SKIP_CUDA_EMU=1 skips both.
if want emu; then
  GPU_TESTS='^(Cuda(Backend|Model|Emu|Counts)?|Nccl|NcclDeathTest)\.'
  echo "test: the CUDA kernels on the emulated device (build-emu)"
  await_build emu
  build emu
  ctest --test-dir build-emu --output-on-failure -j"$(nproc)" -R "$GPU_TESTS" --timeout 600
  lap "emulated device"
  echo "test: the CUDA kernels on the emulated device under ASan + UBSan (build-emu-asan)"
  await_build emu-asan
  build emu-asan
  # (with the other schedule: each operation as early as its stream allows; cuda_emu/README.md)
  CUDA_EMU_SCHEDULE=eager UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ctest \
    --test-dir build-emu-asan \
    --output-on-failure -j"$(nproc)" -R "$GPU_TESTS" \
    -E 'LossCurveTracksTheCpu|ReduceBucketsWhileBackwardRuns|TheBytesTheUpdateTouches|TheBytesEachKernel|NoHostSyncBetweenLoggedSteps|BenchPrintsThem|FineTuningAsGraphs|FineTuningSkipsThePadding' \
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
if [ -n "$prebuild_pid" ]; then
  wait "$prebuild_pid" || true
  echo "test: built in the background (stage, result, seconds at idle priority):" \
    "$(tr '\n' ';' < "$BUILD_DIR/prebuild.txt" 2>/dev/null)"
fi
