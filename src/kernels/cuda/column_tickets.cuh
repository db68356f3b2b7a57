// One-launch column reductions (a linear layer's bias gradient, LayerNorm's parameter
// gradients): a grid of (column tiles, chunks of rows), each block writing its chunk's partial
// sums, and the last block of a tile to finish adding the tile's chunks in chunk order: the sums
// of a partials pass followed by a summing pass, bit for bit, in one launch. A ticket per tile
// (scratch's column-tickets part, zero when allocated and again after every launch) says which
// block is last; every block fences its partials before it takes its ticket (CUDA's
// threadFenceReduction pattern).
#pragma once

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"

namespace bertrain::cuda {

// Every thread of the block calls it after writing its partial sums: true in the block that
// took the last of `count` tickets (it then reads every block's partials through volatile loads
// and adds them); that block has put the ticket back to zero for the next launch.
__device__ inline bool last_ticket(unsigned* ticket, unsigned count) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(ticket, 1u) == count - 1;
    if (last) *ticket = 0;  // (every other block has taken its ticket)
  }
  __syncthreads();
  return last;
}

// A grid of (column tiles, chunks of rows): whether this block is its tile's last.
__device__ inline bool last_chunk_of_tile(unsigned* tickets) {
  return last_ticket(tickets + blockIdx.x, gridDim.y);
}

// out[c] += the chunks' partials partial[k * stride + c] added in order (as row_math's
// column_sum over the partial rows).
__device__ inline void add_chunks(float* out, const float* partial, int64_t chunks, int64_t stride,
                                  int64_t c) {
  const volatile float* p = partial;
  float s = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) s += p[k * stride + c];
  out[c] += s;
}

// The tickets for `tiles` column tiles.
inline unsigned* column_tickets(int64_t tiles) {
  return static_cast<unsigned*>(scratch(kColumnTicketsSlot, tiles * sizeof(unsigned)));
}

}  // namespace bertrain::cuda
