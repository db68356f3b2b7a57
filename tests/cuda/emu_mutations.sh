#!/usr/bin/env bash
# Proves that the emulated device (cuda_emu/) fails a kernel with a thread-mapping or stream bug:
# each mutation below is applied to the CUDA sources, the emulated build rebuilt, and the test
# that should catch it run; the table says which test failed and its first line of why. The
# sources are restored afterwards (and on any exit). Not part of CI (a rebuild per mutation):
#   tests/cuda/emu_mutations.sh [build-emu] [build-emu-asan]
# Both build directories configured as scripts/test.sh configures them.
set -euo pipefail
cd "$(dirname "$0")/../.."
PLAIN=${1:-build-emu}
ASAN=${2:-build-emu-asan}
export OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1

# name | file | text | replacement | build | schedule | test filter
MUTATIONS=(
  "grid-stride loop one past the end|src/kernels/cuda/rows.cu|i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x|i <= n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x|$ASAN|late|Cuda.OptimizerMatchesCpu"
  "grid one block short (blocks rounded down)|src/kernels/cuda/common.cuh|return static_cast<unsigned>((n + threads - 1) / threads);|return static_cast<unsigned>(n / threads);|$PLAIN|late|Cuda.ActivationsAndDropoutMatchCpu"
  "missing __syncthreads before a block reduction|src/kernels/cuda/rows.cu|  part[threadIdx.x] = v;
  __syncthreads();|  part[threadIdx.x] = v;|$PLAIN|late|Cuda.OptimizerMatchesCpu"
  "shuffle with a mask of half the warp|src/kernels/cuda/lanes.cuh|v += __shfl_xor_sync(kFullMask, v, o)|v += __shfl_xor_sync(0x0000ffffu, v, o)|$PLAIN|late|Cuda.LayerNormMatchesCpu"
  "shuffle reading a lane outside its mask|src/kernels/cuda/lanes.cuh|v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o))|v = fmaxf(v, lane < 16 ? __shfl_xor_sync(0x0000ffffu, v, o) : v)|$PLAIN|late|Cuda.AttentionRowPassesMatchHost"
  "shared buffer one element short|src/kernels/cuda/rows.cu|__shared__ double part[kThreads];|__shared__ double part[kThreads - 1];|$ASAN|late|Cuda.OptimizerMatchesCpu"
  "fused attention restaging keys under the warps still reading them|src/kernels/cuda/fused_attention.cu|    __syncthreads();
    stage(kt, hd.part(qkv, 1), hd.C3, j0, kKeys, L, HD);|    stage(kt, hd.part(qkv, 1), hd.C3, j0, kKeys, L, HD);|$PLAIN|late|CudaBackend.FusedAttentionMatchesTheBlockedProducts"
  "kernels not waiting for the input copy|src/kernels/cuda/backend.cu|BT_CUDA_CHECK(cudaStreamWaitEvent(nullptr, uploads().slot(slot).copied, 0));|(void)slot;|$PLAIN|late|CudaModel.ForwardBackwardEqualsCpu"
  "input copy not waiting for the kernels reading the slot|src/kernels/cuda/backend.cu|BT_CUDA_CHECK(cudaStreamWaitEvent(u.stream, s.released, 0));|(void)s;|$PLAIN|eager|CudaBackend.InputCopiesRunBesideTheKernels"
)

restore() { git checkout -- src/kernels/cuda; }
trap restore EXIT

printf "%-56s %-44s %s\n" mutation "test (build, schedule)" "first line of the failure"
for m in "${MUTATIONS[@]}"; do
  IFS='|' read -r name file from to build schedule filter <<<"$(printf '%s' "$m" | tr '\n' '\r')"
  from=${from//$'\r'/$'\n'} to=${to//$'\r'/$'\n'} filter=${filter//$'\r'/}
  restore
  python3 - "$file" "$from" "$to" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"{path}: the mutation's text occurs {text.count(old)} times, not once")
open(path, "w").write(text.replace(old, new))
PY
  cmake --build "$build" -j"$(nproc)" --target bertrain_tests >/dev/null 2>&1
  out=$(CUDA_EMU_SCHEDULE=$schedule timeout 300 "$build/tests/bertrain_tests" --gtest_filter="$filter" 2>&1) &&
    { printf "%-56s %-44s %s\n" "$name" "$filter" "NOT CAUGHT"; continue; }
  why=$(printf '%s\n' "$out" | grep -m1 -E "ERROR: AddressSanitizer|runtime error|cuda_emu: |Failure|Expected|exception|Which is" |
    cut -c1-150 || true)
  printf "%-56s %-44s %s\n" "$name" "$filter ($(basename "$build"), $schedule)" "$why"
done
restore
cmake --build "$PLAIN" -j"$(nproc)" --target bertrain_tests >/dev/null 2>&1
cmake --build "$ASAN" -j"$(nproc)" --target bertrain_tests >/dev/null 2>&1
