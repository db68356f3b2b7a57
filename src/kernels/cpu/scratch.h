// Kernel scratch on the CPU: the parts of kernels/types.h's ScratchLayout and where a kernel
// finds its own. A model binds the region its memory plan holds for them (BertModel, through
// Backend::bind_scratch) before it runs kernels; a kernel then takes thread t's part of that
// region. A kernel run with no region bound (a unit test, a benchmark of one kernel) or needing
// more than its part (more threads than planned, a shape the plan did not list) takes a buffer of
// the calling thread instead, kept between calls, and unplanned_scratch_bytes() counts it: a
// planned training step leaves it at 0 (tests/test_memory.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/types.h"

namespace bertrain::kernels {

enum class ScratchPart : int {
  Gemm = 0,           // oneDNN's matmul scratchpad for products made on a team's threads
  AttentionRows = 1,  // the blocked attention's row-block buffers
  MaskRow = 2,        // the additive mask row of one sequence
  LayerNorm = 3,      // LayerNorm backward's gamma / beta partial sums
  Optimizer = 4,      // the optimizer's reductions' partial sums
};

// Thread t's part starts at base + t * stride.
struct ScratchBlock {
  std::byte* base = nullptr;
  int64_t stride = 0;
  std::byte* at(int t) const { return base + t * stride; }
  template <typename T>
  T* as(int t) const {
    return reinterpret_cast<T*>(at(t));
  }
};

// `bytes` of `part` for each of `threads` threads (thread numbers 0 .. threads-1 of the OpenMP
// team the caller runs or starts): the bound region's, or the calling thread's own buffer.
ScratchBlock scratch_block(ScratchPart part, int64_t bytes, int threads);

// `bytes` for the calling thread outside parallel regions (oneDNN's scratchpad for the
// products it makes): the bound region's caller part, or the thread's own buffer.
std::byte* caller_scratch(int64_t bytes);

// Binds `region` (layout.total() bytes, 64-byte aligned) for the kernels that follow; null
// unbinds. A model binds its own before each forward, backward and optimizer step.
void bind_scratch(std::byte* region, const ScratchLayout& layout);

// Bytes of kernel scratch taken outside a bound region since the process started.
int64_t unplanned_scratch_bytes();

}  // namespace bertrain::kernels
