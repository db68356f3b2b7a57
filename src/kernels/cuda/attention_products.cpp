#include "kernels/cuda/attention_products.h"

#include <cmath>

namespace bertrain::cuda {

namespace {

struct Layout {
  int64_t T, C, C3, NH, HD, TT;
  explicit Layout(const kernels::AttentionShape& s)
      : T(s.T), C(s.C), C3(3 * s.C), NH(s.NH), HD(s.C / s.NH), TT(s.T * s.T) {}
  // Q, K or V (part 0, 1, 2) of the QKV rows; a [B, NH, T, T] buffer; the context rows.
  PairOperand qkv(const void* base, int part, int64_t bytes) const {
    return {static_cast<const char*>(base) + part * C * bytes, T * C3, HD, bytes};
  }
  PairOperand probs(const void* base, int64_t bytes) const { return {base, NH * TT, TT, bytes}; }
  PairOperand rows(const void* base, int64_t bytes) const { return {base, T * C, HD, bytes}; }
  // A block buffer of n query rows a pair ([pairs, n, T], compact).
  PairOperand block(const void* base, int64_t n, int64_t bytes) const {
    return {base, NH * n * T, n * T, bytes};
  }
  // Query row i0 of a row-major [B, T, width] tensor of `bytes` elements.
  static const void* at_row(const void* base, int64_t i0, int64_t width, int64_t bytes) {
    return static_cast<const char*>(base) + i0 * width * bytes;
  }
};

}  // namespace

std::array<PairProduct, 2> attention_forward_products(const kernels::AttentionShape& s,
                                                      int64_t bytes, const void* qkv, float* scores,
                                                      const void* dropped, void* ctx,
                                                      int64_t ctx_bytes) {
  const Layout l(s);
  const float scale = 1.0f / std::sqrt(static_cast<float>(l.HD));
  const int64_t T = l.T, HD = l.HD;
  return {{
      {false, true, T, T, HD, scale, l.qkv(qkv, 0, bytes), l.qkv(qkv, 1, bytes), l.probs(scores, 4),
       l.C3, l.C3, T},
      {false, false, T, HD, T, 1.0f, l.probs(dropped, bytes), l.qkv(qkv, 2, bytes),
       l.rows(ctx, ctx_bytes), T, l.C3, l.C},
  }};
}

std::array<PairProduct, 4> attention_backward_products(const kernels::AttentionShape& s,
                                                       int64_t bytes, const void* qkv,
                                                       const void* dropped, const void* dctx,
                                                       float* dd, const void* ds, float* dqkv) {
  const Layout l(s);
  const float scale = 1.0f / std::sqrt(static_cast<float>(l.HD));
  const int64_t T = l.T, HD = l.HD;
  return {{
      // dV = dropped^T dctx
      {true, false, T, HD, T, 1.0f, l.probs(dropped, bytes), l.rows(dctx, bytes), l.qkv(dqkv, 2, 4),
       T, l.C, l.C3},
      // dd = dctx V^T
      {false, true, T, T, HD, 1.0f, l.rows(dctx, bytes), l.qkv(qkv, 2, bytes), l.probs(dd, 4), l.C,
       l.C3, T},
      // dQ = scale ds K
      {false, false, T, HD, T, scale, l.probs(ds, bytes), l.qkv(qkv, 1, bytes), l.qkv(dqkv, 0, 4),
       T, l.C3, l.C3},
      // dK = scale ds^T Q
      {true, false, T, HD, T, scale, l.probs(ds, bytes), l.qkv(qkv, 0, bytes), l.qkv(dqkv, 1, 4), T,
       l.C3, l.C3},
  }};
}

std::array<PairProduct, 2> blocked_forward_products(const kernels::AttentionShape& s, int64_t bytes,
                                                    int64_t i0, int64_t n, const void* qkv,
                                                    const BlockBuffers& b, float* ctx) {
  const Layout l(s);
  const float scale = 1.0f / std::sqrt(static_cast<float>(l.HD));
  const int64_t T = l.T, HD = l.HD;
  const void* q_blk = Layout::at_row(qkv, i0, l.C3, bytes);
  return {{
      // S = scale Q_blk K^T
      {false, true, n, T, HD, scale, l.qkv(q_blk, 0, bytes), l.qkv(qkv, 1, bytes),
       l.block(b.scores, n, 4), l.C3, l.C3, T},
      // ctx_blk = dropped V
      {false, false, n, HD, T, 1.0f, l.block(b.dropped, n, bytes), l.qkv(qkv, 2, bytes),
       l.rows(ctx + i0 * l.C, 4), T, l.C3, l.C},
  }};
}

std::array<PairProduct, 5> blocked_backward_products(const kernels::AttentionShape& s,
                                                     int64_t bytes, int64_t i0, int64_t n,
                                                     const void* qkv, const void* dctx,
                                                     const BlockBuffers& b, float* dqkv) {
  const Layout l(s);
  const float scale = 1.0f / std::sqrt(static_cast<float>(l.HD));
  const int64_t T = l.T, HD = l.HD;
  const void* q_blk = Layout::at_row(qkv, i0, l.C3, bytes);
  const void* dctx_blk = Layout::at_row(dctx, i0, l.C, bytes);
  const bool later = i0 > 0;  // dV and dK: the first block writes, the others add
  return {{
      // S = scale Q_blk K^T (forward's scores again)
      {false, true, n, T, HD, scale, l.qkv(q_blk, 0, bytes), l.qkv(qkv, 1, bytes),
       l.block(b.scores, n, 4), l.C3, l.C3, T},
      // dd = dctx_blk V^T
      {false, true, n, T, HD, 1.0f, l.rows(dctx_blk, bytes), l.qkv(qkv, 2, bytes),
       l.block(b.dd, n, 4), l.C, l.C3, T},
      // dV (+)= dropped^T dctx_blk
      {true, false, T, HD, n, 1.0f, l.block(b.dropped, n, bytes), l.rows(dctx_blk, bytes),
       l.qkv(dqkv, 2, 4), T, l.C, l.C3, later},
      // dQ_blk = scale dS K
      {false, false, n, HD, T, scale, l.block(b.ds, n, bytes), l.qkv(qkv, 1, bytes),
       l.qkv(dqkv + i0 * l.C3, 0, 4), T, l.C3, l.C3},
      // dK (+)= scale dS^T Q_blk
      {true, false, T, HD, n, scale, l.block(b.ds, n, bytes), l.qkv(q_blk, 0, bytes),
       l.qkv(dqkv, 1, 4), T, l.C3, l.C3, later},
  }};
}

}  // namespace bertrain::cuda
