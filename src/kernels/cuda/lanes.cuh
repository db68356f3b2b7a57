// A warp as row_math's lanes (kernels/row_math.h): lane = the thread's lane, combinations by
// butterfly shuffles (every lane ends with the same total: each step adds the same two values),
// kernels launched with blocks of whole warps, one row per warp.
#pragma once

#include <cstdint>

#include "kernels/row_math.h"

namespace bertrain::cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr unsigned kRowThreads = 128, kRowsPerBlock = kRowThreads / 32;

struct WarpLanes {
  int lane;
  static constexpr int count = 32;
  __device__ float sum(float v) const {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
    return v;
  }
  __device__ float max(float v) const {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
  }
  __device__ int64_t min(int64_t v) const {
    for (int o = 16; o > 0; o >>= 1) {
      const auto w = static_cast<int64_t>(__shfl_xor_sync(kFullMask, static_cast<long long>(v), o));
      v = w < v ? w : v;
    }
    return v;
  }
};

// A block of Threads (whole warps) as row_math's lanes, a row per block: for rows too wide for a
// warp (the masked-LM cross-entropy's 30522 columns: a warp per row leaves most of a GPU idle at
// a few thousand rows). A combination is the warps' shuffles, then the warps' totals in warp
// order through shared memory, so every lane ends with the same total, summed in the same order
// every time. Every thread of the block takes part in every combination (no early return).
template <unsigned Threads>
struct BlockLanes {
  static_assert(Threads % 32 == 0 && Threads <= 1024);
  int lane;
  static constexpr int count = Threads;
  __device__ float sum(float v) const { return across_warps(WarpLanes{lane % 32}.sum(v), Add{}); }
  __device__ float max(float v) const { return across_warps(WarpLanes{lane % 32}.max(v), Max{}); }
  __device__ int64_t min(int64_t v) const {
    return across_warps(WarpLanes{lane % 32}.min(v), Min{});
  }

 private:
  struct Add {
    __device__ float operator()(float a, float b) const { return a + b; }
  };
  struct Max {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
  };
  struct Min {
    __device__ int64_t operator()(int64_t a, int64_t b) const { return b < a ? b : a; }
  };
  // The warps' totals (each warp's lanes hold its own) combined in warp order.
  template <class T, class Op>
  __device__ T across_warps(T warp_total, Op op) const {
    __shared__ T part[Threads / 32];
    __syncthreads();  // (the previous combination's readers are done with part)
    if (lane % 32 == 0) part[lane / 32] = warp_total;
    __syncthreads();
    T t = part[0];
    for (unsigned w = 1; w < Threads / 32; ++w) t = op(t, part[w]);
    return t;
  }
};

// This thread's row (one per warp; rows >= N return) and its lanes.
__device__ inline int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
}
__device__ inline WarpLanes warp_lanes() {
  return WarpLanes{static_cast<int>(threadIdx.x % 32)};
}

inline unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

// The dropout index of row i's first element: offset + rows[i] * C (a packed row keyed as its
// padded row) or offset + i * C.
__device__ inline uint64_t row_index0(uint64_t offset, const int32_t* rows, int64_t i, int64_t C) {
  return offset + static_cast<uint64_t>((rows ? rows[i] : i) * C);
}

}  // namespace bertrain::cuda
