// LayerNorm and the fused blocks around it on the GPU, one warp per row running the row math the
// CPU tests check (kernels/row_math.h): plain LayerNorm, dropout + residual + LayerNorm, the
// embedding sum + LayerNorm + dropout, and their backward. The parameter gradients (and the
// projection's bias gradient before a residual block) come from a column kernel over all rows
// (deterministic: chunks of rows added in order, column_tickets.cuh).
#include "kernels/cuda/column_tickets.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/lanes.cuh"

namespace bertrain::cuda {

namespace rm = kernels::row_math;

namespace {

// Optionally x = dropout(x) + residual in place first (residual non-null); out16 (may be null)
// out rounded to `o`'s 16 bits, each lane the columns it wrote.
__global__ void layernorm_forward_kernel(float* out, uint16_t* out16, Precision o, float* mean,
                                         float* rstd, float* x, const float* residual,
                                         const float* gamma, const float* beta, int64_t N,
                                         int64_t C, float eps, float p, uint64_t key,
                                         uint64_t offset, const int32_t* rows) {
  const int64_t i = warp_row();
  if (i >= N) return;
  const WarpLanes l = warp_lanes();
  if (residual)
    rm::dropout_residual(x + i * C, residual + i * C, C, p, key, row_index0(offset, rows, i, C), l);
  rm::layernorm(out + i * C, mean + i, rstd + i, x + i * C, gamma, beta, C, eps, l);
  if (out16)
    for (int64_t c = l.lane; c < C; c += l.count) out16[i * C + c] = to_16(o, out[i * C + c]);
}

__global__ void embedding_layernorm_kernel(float* out, float* sum, float* mean, float* rstd,
                                           const int32_t* ids, const int32_t* segment,
                                           const int32_t* positions, const float* word,
                                           const float* position, const float* token_type,
                                           const float* gamma, const float* beta, int64_t N,
                                           int64_t T, int64_t C, float eps, float p, uint64_t key,
                                           uint64_t offset, const int32_t* rows) {
  const int64_t i = warp_row();
  if (i >= N) return;
  const WarpLanes l = warp_lanes();
  rm::embedding_sum(sum + i * C, ids[i], segment[i], positions ? positions[i] : i % T, word,
                    position, token_type, C, l);
  rm::layernorm(out + i * C, mean + i, rstd + i, sum + i * C, gamma, beta, C, eps, l);
  rm::dropout_row(out + i * C, C, p, key, row_index0(offset, rows, i, C), l);
}

// (ddropped16: ddropped rounded to `o`'s 16 bits, each lane the columns it wrote; may be null)
__global__ void layernorm_backward_kernel(float* dinp, float* ddropped, uint16_t* ddropped16,
                                          Precision o, const float* dout, const float* in,
                                          const float* gamma, const float* mean, const float* rstd,
                                          int64_t N, int64_t C, bool accumulate, float p,
                                          uint64_t key, uint64_t offset, const int32_t* rows) {
  const int64_t i = warp_row();
  if (i >= N) return;
  const WarpLanes l = warp_lanes();
  rm::layernorm_backward(dinp + i * C, ddropped ? ddropped + i * C : nullptr, dout + i * C,
                         in + i * C, gamma, mean[i], rstd[i], C, accumulate, p, key,
                         row_index0(offset, rows, i, C), l);
  if (ddropped16)
    for (int64_t c = l.lane; c < C; c += l.count)
      ddropped16[i * C + c] = to_16(o, ddropped[i * C + c]);
}

// Chunk blockIdx.y of the rows (`per` rows each), a column per thread: its partial sums into
// partial[chunk * C + c] (dgamma), partial[(chunks + chunk) * C + c] (dbeta) and, where dbias is
// given, partial[(2 chunks + chunk) * C + c] (ddropped's: the projection's bias gradient); the
// tile's last block adds the chunks in order onto them (column_tickets.cuh). The bias gradient's
// chunks and order are column_sums' (matmul.cu): linear_backward's, bit for bit.
__global__ void layernorm_param_grads_kernel(float* dgamma, float* dbeta, float* dbias,
                                             float* partial, unsigned* tickets, const float* dout,
                                             const float* in, const float* mean, const float* rstd,
                                             const float* ddropped, int64_t N, int64_t C,
                                             int64_t per) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.y, chunks = gridDim.y;
  if (c < C) {
    float* g = partial + chunk * C;
    float* b = partial + (chunks + chunk) * C;
    g[c] = 0.0f;
    b[c] = 0.0f;
    const int64_t r0 = chunk * per, end = r0 + per < N ? r0 + per : N;
    rm::layernorm_param_grads(g, b, dout, in, mean, rstd, r0, end, C, c);
    if (dbias) {
      float* d = partial + (2 * chunks + chunk) * C;
      d[c] = 0.0f;
      rm::column_sum(d, ddropped, r0, end, C, c);
    }
  }
  if (last_chunk_of_tile(tickets) && c < C) {
    add_chunks(dgamma, partial, chunks, C, c);
    add_chunks(dbeta, partial + chunks * C, chunks, C, c);
    if (dbias) add_chunks(dbias, partial + 2 * chunks * C, chunks, C, c);
  }
}

// Over chunks of rows in parallel (a column per thread over all N rows would leave most of the
// GPU idle: C threads), then the chunks added in order, in one launch; dbias (may be null): the
// column sums of ddropped in the same launch.
void param_grads(float* dgamma, float* dbeta, float* dbias, const float* dout, const float* in,
                 const float* mean, const float* rstd, const float* ddropped, int64_t N, int64_t C,
                 cudaStream_t s) {
  const int64_t chunks = column_chunks(N), per = (N + chunks - 1) / chunks;
  const unsigned tiles = blocks_for(C, kColumnTile);
  const int64_t sums = dbias ? 3 : 2;
  auto* partial = static_cast<float*>(scratch(kColumnSumsSlot, sums * chunks * C * sizeof(float)));
  BT_LAUNCH(layernorm_param_grads_kernel, dim3(tiles, static_cast<unsigned>(chunks)), kColumnTile,
            0, s)
  (dgamma, dbeta, dbias, partial, column_tickets(tiles), dout, in, mean, rstd, ddropped, N, C, per);
  BT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps, void* stream) {
  if (N == 0) return;
  BT_LAUNCH(layernorm_forward_kernel, row_blocks(N), kRowThreads, 0, as_stream(stream))
  (out, nullptr, Precision::FP32, mean, rstd, const_cast<float*>(inp), nullptr, gamma, beta, N, C,
   eps, 0.0f, 0, 0, nullptr);
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
                                void* stream) {
  if (N == 0) return;
  uint16_t* bits = p != Precision::FP32 ? out.bits : nullptr;
  BT_LAUNCH(layernorm_forward_kernel, row_blocks(N), kRowThreads, 0, as_stream(stream))
  (out.f32, bits, p, mean, rstd, x, residual, gamma, beta, N, C, eps, d.p, d.key, d.offset, d.rows);
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
   C, eps, d.p, d.key, d.offset, d.rows);
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
  uint16_t* bits = p != Precision::FP32 && ddropped.f32 ? ddropped.bits : nullptr;
  BT_LAUNCH(layernorm_backward_kernel, row_blocks(N), kRowThreads, 0, as_stream(stream))
  (dinp, ddropped.f32, bits, p, dout, in, gamma, mean, rstd, N, C, accumulate_dinp, d.p, d.key,
   d.offset, d.rows);
  BT_CUDA_CHECK(cudaGetLastError());
  BT_CHECK(!dbias || ddropped.f32, "layernorm_dropout_backward: a bias gradient without ddropped");
  param_grads(dgamma, dbeta, dbias, dout, in, mean, rstd, ddropped.f32, N, C, as_stream(stream));
}

}  // namespace bertrain::cuda
