// LayerNorm and the fused blocks around it on the GPU, one warp per row running the row math the
// CPU tests check (kernels/row_math.h): plain LayerNorm, dropout + residual + LayerNorm, the
// embedding sum + LayerNorm + dropout, and their backward. Backward sums the parameter gradients
// (and the projection's bias gradient before a residual block) in the rows' launch
// (deterministic: chunks of rows added in order, column_tickets.cuh).
#include "kernels/cuda/column_tickets.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/lanes.cuh"

namespace bertrain::cuda {

namespace rm = kernels::row_math;

namespace {

// Optionally x = dropout(x) + residual in place first (residual non-null; where y16 is given,
// x = dropout(y16 widened from `o`'s 16 bits) + residual written); out16 (may be null) out
// rounded to `o`'s 16 bits, each lane the columns it wrote.
__global__ void layernorm_forward_kernel(float* out, uint16_t* out16, Precision o, float* mean,
                                         float* rstd, float* x, const uint16_t* y16,
                                         const float* residual, const float* gamma,
                                         const float* beta, int64_t N, int64_t C, float eps,
                                         float p, uint64_t key, uint64_t offset,
                                         const int32_t* rows, const uint64_t* at) {
  step_key(key, offset, at);
  const int64_t i = warp_row();
  if (i >= N) return;
  const WarpLanes l = warp_lanes();
  if (y16) {  // (row_math's dropout_residual, the projection's values widened as they are read)
    const float ks = rm::keep_scale_of(p);
    const uint64_t index0 = row_index0(offset, rows, i, C);
    for (int64_t c = l.lane; c < C; c += l.count)
      x[i * C + c] =
          rm::dropout(from_16(o, y16[i * C + c]), p, ks, key, index0 + c) + residual[i * C + c];
  } else if (residual) {
    rm::dropout_residual(x + i * C, residual + i * C, C, p, key, row_index0(offset, rows, i, C), l);
  }
  rm::layernorm(out + i * C, mean + i, rstd + i, x + i * C, gamma, beta, C, eps, l);
  if (out16)
    for (int64_t c = l.lane; c < C; c += l.count) out16[i * C + c] = to_16(o, out[i * C + c]);
}

__global__ void embedding_layernorm_kernel(
    float* out, float* sum, float* mean, float* rstd, const int32_t* ids, const int32_t* segment,
    const int32_t* positions, const float* word, const float* position, const float* token_type,
    const float* gamma, const float* beta, int64_t N, int64_t T, int64_t C, float eps, float p,
    uint64_t key, uint64_t offset, const int32_t* rows, const uint64_t* at) {
  step_key(key, offset, at);
  const int64_t i = warp_row();
  if (i >= N) return;
  const WarpLanes l = warp_lanes();
  rm::embedding_sum(sum + i * C, ids[i], segment[i], positions ? positions[i] : i % T, word,
                    position, token_type, C, l);
  rm::layernorm(out + i * C, mean + i, rstd + i, sum + i * C, gamma, beta, C, eps, l);
  rm::dropout_row(out + i * C, C, p, key, row_index0(offset, rows, i, C), l);
}

// A LayerNorm's backward in one launch, the parameter gradients in the rows' pass: block k takes
// chunk k of the rows (column_chunks: `per` rows each), its warps a row each in turn (dinp, and
// ddropped, its dropout's gradient: the projection's output gradient; ddropped16 its copy rounded
// to `o`'s 16 bits, may be null), then, after the block's barrier (what its warps wrote is the
// block's to read), its threads a column each over the chunk's rows in order: the partial sums
// of dgamma into partial[chunk * C + c], of dbeta into partial[(chunks + chunk) * C + c] and,
// where dbias is given, of ddropped into partial[(2 chunks + chunk) * C + c]. The last block to
// finish with a tile of columns (column_tickets.cuh: a ticket a tile) adds the tile's chunks in
// order onto the gradients.
// The chunks and their order are column_sums' (matmul.cu): dbias is linear_backward's bias
// gradient of ddropped bit for bit.
// - The column pass reads the rows the block has just read and written (its chunk's 32 rows,
//   more past 8192 rows: from the L2 cache on a GPU).
// - The tail adds 3 x chunks x C partial sums (1.5 MB at BERT-Large's 4096 rows, 128 chunks),
//   a tile's by one block: up to 4 blocks at once for 1024 columns, where blocks finish
//   together; the price of one launch, where NVIDIA's Apex LayerNorm takes a second kernel for
//   the columns (issue 44 counts launches; no GPU has timed the two yet).
// - ddropped null with ddropped16 given: the copy alone is written (where nothing reads
//   ddropped's fp32 values), dbias summing the dropout's gradient recomputed from dinp (the same
//   values, the same bits).
// 32 warps: a row each of a 32-row chunk, then a column each of BERT-Large's 1024.
constexpr unsigned kBackwardThreads = 1024;

__global__ void __launch_bounds__(kBackwardThreads)
    layernorm_backward_kernel(float* dinp, float* ddropped, uint16_t* ddropped16, Precision o,
                              float* dgamma, float* dbeta, float* dbias, float* partial,
                              unsigned* tickets, const float* dout, const float* in,
                              const float* gamma, const float* mean, const float* rstd, int64_t N,
                              int64_t C, int64_t per, bool accumulate, float p, uint64_t key,
                              uint64_t offset, const int32_t* rows, const uint64_t* at) {
  step_key(key, offset, at);
  const int64_t chunk = blockIdx.x, chunks = gridDim.x;
  const int64_t r0 = chunk * per, end = r0 + per < N ? r0 + per : N;
  const int64_t warps = blockDim.x / 32;
  const WarpLanes l = warp_lanes();
  const float ks = rm::keep_scale_of(p);
  // (the dropout's gradient of dinp's element c of row r: what ddropped holds)
  const auto dropped = [&](int64_t r, int64_t c) {
    return rm::dropout(dinp[r * C + c], p, ks, key, row_index0(offset, rows, r, C) + c);
  };
  for (int64_t i = r0 + threadIdx.x / 32; i < end; i += warps) {
    rm::layernorm_backward(dinp + i * C, ddropped ? ddropped + i * C : nullptr, dout + i * C,
                           in + i * C, gamma, mean[i], rstd[i], C, accumulate, p, key,
                           row_index0(offset, rows, i, C), l);
    if (ddropped16)  // (each lane the columns it wrote)
      for (int64_t c = l.lane; c < C; c += l.count)
        ddropped16[i * C + c] = to_16(o, ddropped ? ddropped[i * C + c] : dropped(i, c));
  }
  __syncthreads();
  float* g = partial + chunk * C;
  float* b = partial + (chunks + chunk) * C;
  float* d = partial + (2 * chunks + chunk) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    g[c] = 0.0f;
    b[c] = 0.0f;
    rm::layernorm_param_grads(g, b, dout, in, mean, rstd, r0, end, C, c);
    if (dbias && ddropped) {
      d[c] = 0.0f;
      rm::column_sum(d, ddropped, r0, end, C, c);
    } else if (dbias) {  // (column_sum's order)
      float sum = 0.0f;
      for (int64_t r = r0; r < end; ++r) sum += dropped(r, c);
      d[c] = sum;
    }
  }
  // The tail, a tile of kColumnTile columns at a time: the block takes every tile's ticket, from
  // tile (chunk mod tiles) on, so that blocks finishing together take the last tickets of
  // different tiles, and adds the chunks of each tile whose last ticket it took (a thread a
  // (gradient, column) pair).
  const int64_t tiles = (C + kColumnTile - 1) / kColumnTile, grads = dbias ? 3 : 2;
  for (int64_t j = 0; j < tiles; ++j) {
    const int64_t tile = (chunk + j) % tiles;
    if (!last_ticket(tickets + tile, static_cast<unsigned>(chunks))) continue;
    const int64_t c0 = tile * kColumnTile, width = C - c0 < kColumnTile ? C - c0 : kColumnTile;
    for (int64_t q = threadIdx.x; q < grads * width; q += blockDim.x) {
      const int64_t which = q / width, c = c0 + q % width;
      float* out = which == 0 ? dgamma : which == 1 ? dbeta : dbias;
      add_chunks(out, partial + which * chunks * C, chunks, C, c);
    }
  }
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps, void* stream) {
  if (N == 0) return;
  BT_LAUNCH(layernorm_forward_kernel, row_blocks(N), kRowThreads, 0, as_stream(stream))
  (out, nullptr, Precision::FP32, mean, rstd, const_cast<float*>(inp), nullptr, nullptr, gamma,
   beta, N, C, eps, 0.0f, 0, 0, nullptr, nullptr);
  BT_CUDA_CHECK(cudaGetLastError());
}

void residual_layernorm_forward(float* out, float* mean, float* rstd, float* x,
                                const float* residual, const float* gamma, const float* beta,
                                int64_t N, int64_t C, float eps, const kernels::Dropout& d,
                                void* stream) {
  residual_layernorm_forward(Precision::FP32, kernels::Kept{out}, mean, rstd, x, residual, gamma,
                             beta, N, C, eps, d, stream);
}

void residual_layernorm_forward(Precision p, kernels::Kept out, float* mean, float* rstd, float* x,
                                const float* residual, const float* gamma, const float* beta,
                                int64_t N, int64_t C, float eps, const kernels::Dropout& d,
                                void* stream, const uint16_t* y16) {
  if (N == 0) return;
  uint16_t* bits = p != Precision::FP32 ? out.bits : nullptr;
  BT_LAUNCH(layernorm_forward_kernel, row_blocks(N), kRowThreads, 0, as_stream(stream))
  (out.f32, bits, p, mean, rstd, x, y16, residual, gamma, beta, N, C, eps, d.p, d.key, d.offset,
   d.rows, d.at);
  BT_CUDA_CHECK(cudaGetLastError());
}

void embedding_layernorm_forward(float* out, float* sum, float* mean, float* rstd,
                                 const int32_t* ids, const int32_t* segment,
                                 const int32_t* positions, const float* word, const float* position,
                                 const float* token_type, const float* gamma, const float* beta,
                                 int64_t B, int64_t T, int64_t C, float eps,
                                 const kernels::Dropout& d, void* stream) {
  if (B * T == 0) return;
  BT_LAUNCH(embedding_layernorm_kernel, row_blocks(B * T), kRowThreads, 0, as_stream(stream))
  (out, sum, mean, rstd, ids, segment, positions, word, position, token_type, gamma, beta, B * T, T,
   C, eps, d.p, d.key, d.offset, d.rows, d.at);
  BT_CUDA_CHECK(cudaGetLastError());
}

void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                        const float* inp, const float* gamma, const float* mean, const float* rstd,
                        int64_t N, int64_t C, void* stream) {
  layernorm_dropout_backward(Precision::FP32, dinp, kernels::Kept{}, dgamma, dbeta, nullptr, dout,
                             inp, gamma, mean, rstd, N, C, false, kernels::Dropout{}, stream);
}

void layernorm_dropout_backward(Precision p, float* dinp, kernels::Kept ddropped, float* dgamma,
                                float* dbeta, float* dbias, const float* dout, const float* in,
                                const float* gamma, const float* mean, const float* rstd, int64_t N,
                                int64_t C, bool accumulate_dinp, const kernels::Dropout& d,
                                void* stream) {
  if (N == 0) return;
  uint16_t* bits = p != Precision::FP32 ? ddropped.bits : nullptr;
  BT_CHECK(!dbias || ddropped.f32 || bits,
           "layernorm_dropout_backward: a bias gradient without ddropped or its 16-bit copy");
  const int64_t chunks = column_chunks(N), per = (N + chunks - 1) / chunks;
  const int64_t sums = dbias ? 3 : 2;
  auto* partial = static_cast<float*>(scratch(kColumnSumsSlot, sums * chunks * C * sizeof(float)));
  BT_LAUNCH(layernorm_backward_kernel, static_cast<unsigned>(chunks), kBackwardThreads, 0,
            as_stream(stream))
  (dinp, ddropped.f32, bits, p, dgamma, dbeta, dbias, partial,
   column_tickets(blocks_for(C, kColumnTile)), dout, in, gamma, mean, rstd, N, C, per,
   accumulate_dinp, d.p, d.key, d.offset, d.rows, d.at);
  BT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace bertrain::cuda
