// Attention's six matrix products (QK^T and PV forward; dV, dP, dQ and dK backward) as the CUDA
// backend runs them: each over every (sequence, head) pair at once, one cuBLAS call with the
// pairs' matrices read in place out of the QKV rows [B, T, 3C], the [B, NH, T, T] probability
// buffers and the context rows [B, T, C]; and the blocked kernel's, a block of query rows at a
// time, with its row passes and their order (blocked_forward_schedule and _backward_schedule).
// Plain C++ (no CUDA types), compiled in every build: the host tests run these very descriptions
// through a reference GEMM against the CPU's attention, so on a GPU only cuBLAS's side is new.
#pragma once

#include <array>
#include <cstdint>

#include "core/host_device.h"
#include "kernels/backend.h"
#include "kernels/row_math.h"
#include "kernels/types.h"

namespace bertrain::cuda {

// One operand over the pairs: pair k = b * NH + h reads the matrix at
// base + (b * per_sequence + h * per_head) elements of `bytes` bytes each.
struct PairOperand {
  const void* base = nullptr;
  int64_t per_sequence = 0, per_head = 0, bytes = 4;
  BT_HOST_DEVICE const void* of(int64_t k, int64_t NH) const {
    return static_cast<const char*>(base) + ((k / NH) * per_sequence + (k % NH) * per_head) * bytes;
  }
};

// The most products whose pointer arrays are made at once (cuda.h, pair_pointers): backward's
// four.
constexpr int64_t kMaxPairProducts = 4;
// The pointer tables kept (cuda.h, pair_pointers), each of 3 x kMaxPairProducts pointers a
// pair: two a layer (forward's, backward's), so BERT-Large's 24 layers make none after the
// first step.
constexpr int64_t kPairTables = 64;

// Row-major C_k = alpha op(A_k) op(B_k) for every pair k (fp32 C, or the 16-bit operands' type
// where c.bytes is 2; overwritten, or added to with accumulate).
struct PairProduct {
  bool trans_a, trans_b;
  int64_t M, N, K;
  float alpha;
  PairOperand a, b, c;
  int64_t lda, ldb, ldc;
  bool accumulate = false;
};

// Forward: scores = scale Q K^T into `scores` [B, NH, T, T] (fp32), then ctx = dropped V into
// the context rows (elements of ctx_bytes: fp32, or 2 for the operands' 16-bit type). qkv and
// dropped hold elements of `bytes` (the products' operands: bf16 bits or fp32 values).
std::array<PairProduct, 2> attention_forward_products(const kernels::AttentionShape& s,
                                                      int64_t bytes, const void* qkv, float* scores,
                                                      const void* dropped, void* ctx,
                                                      int64_t ctx_bytes = 4);
// Backward: dV = dropped^T dctx and dd = dctx V^T (into dd [B, NH, T, T], fp32; the softmax
// backward's input), then from ds (dd's pass, `bytes` elements) dQ = scale ds K and
// dK = scale ds^T Q, all into dqkv [B, T, 3C] (fp32).
std::array<PairProduct, 4> attention_backward_products(const kernels::AttentionShape& s,
                                                       int64_t bytes, const void* qkv,
                                                       const void* dropped, const void* dctx,
                                                       float* dd, const void* ds, float* dqkv);

// ---- The blocked (flash-style) kernel: kernels/cpu/attention_blocked.cpp's algorithm with every
// (sequence, head) pair at once. Query rows in blocks of at most kBlockRows; a block's scores
// for every pair ([pairs, n, T], compact: pair k's row i at (k * n + i) * T) live only in the
// block buffers, so no [B, NH, T, T] buffer exists, and only the row log-sum-exp lse [B, NH, T]
// is kept for backward, which recomputes the block's scores from it.

constexpr int64_t kBlockRows = 128;

// The block buffers, each of block_values(s) elements: the scores and dd in fp32; the products'
// operands (the dropped probabilities, then dS) in `bytes`-byte elements (fp32, or 16-bit bits).
struct BlockBuffers {
  float* scores = nullptr;
  float* dd = nullptr;
  void* dropped = nullptr;
  void* ds = nullptr;
};
inline int64_t block_rows(const kernels::AttentionShape& s) {
  return s.T < kBlockRows ? s.T : kBlockRows;
}
inline int64_t block_values(const kernels::AttentionShape& s) {
  return s.B * s.NH * block_rows(s) * s.T;
}
// Bytes of one operand buffer of `el`-byte elements, rounded up to 256 (the second one's start).
inline int64_t block_operand_bytes(const kernels::AttentionShape& s, int64_t el) {
  return (block_values(s) * el + 255) / 256 * 256;
}

// Block [i0, i0 + n): S = scale Q_blk K^T into b.scores, then ctx_blk = dropped V (b.dropped,
// written by the row pass between them).
std::array<PairProduct, 2> blocked_forward_products(const kernels::AttentionShape& s, int64_t bytes,
                                                    int64_t i0, int64_t n, const void* qkv,
                                                    const BlockBuffers& b, float* ctx);
// Block [i0, i0 + n) backward: S again; dd = dctx_blk V^T; then, after the row pass,
// dV (+)= dropped^T dctx_blk, dQ_blk = scale dS K, dK (+)= scale dS^T Q_blk (into dqkv [B, T, 3C],
// fp32; dV and dK overwritten by the first block, added to by the others). dctx in `bytes`.
std::array<PairProduct, 5> blocked_backward_products(const kernels::AttentionShape& s,
                                                     int64_t bytes, int64_t i0, int64_t n,
                                                     const void* qkv, const void* dctx,
                                                     const BlockBuffers& b, float* dqkv);

// The row passes of block [i0, i0 + n): row w of the block buffers is query i0 + w % n of pair
// w / n (sequence (w / n) / NH). The GPU runs a warp per row, the host tests a lane or a host
// warp: the same calls.
struct BlockRows {
  kernels::AttentionShape s;
  int64_t i0, n;
  const int32_t* mask;  // [B, T]
  kernels::Dropout d;
  BT_HOST_DEVICE int64_t rows() const { return s.B * s.NH * n; }
  // Row w's query and its index in lse, mask row and first dropout index.
  BT_HOST_DEVICE int64_t pair(int64_t w) const { return w / n; }
  BT_HOST_DEVICE int64_t query(int64_t w) const { return i0 + w % n; }
  BT_HOST_DEVICE const int32_t* mask_row(int64_t w) const { return mask + (pair(w) / s.NH) * s.T; }
  BT_HOST_DEVICE uint64_t index0(int64_t w) const {
    return d.offset + s.dropout_row(pair(w), query(w));
  }
  // Forward: the dropped probabilities of row w (X: float or 16-bit bits) and its lse.
  template <class X, class Lanes>
  BT_HOST_DEVICE void forward(int64_t w, X* dropped, float* lse, const float* scores,
                              const Lanes& l) const {
    const int64_t T = s.T;
    const float v = kernels::row_math::attention_softmax_lse(
        dropped + w * T, scores + w * T, mask_row(w), T, d.p, d.key, index0(w), l);
    if (l.lane == 0) lse[pair(w) * T + query(w)] = v;
  }
  template <class X, class Lanes>
  BT_HOST_DEVICE void backward(int64_t w, X* dropped, X* ds, float* scores, float* dd,
                               const float* lse, const Lanes& l) const {
    const int64_t T = s.T;
    kernels::row_math::attention_softmax_backward_lse(
        dropped + w * T, ds + w * T, scores + w * T, dd + w * T, mask_row(w), T,
        lse[pair(w) * T + query(w)], d.p, d.key, index0(w), l);
  }
};

// f(i0, n) for each block [i0, i0 + n) of query rows, in order.
template <class F>
void for_each_block(const kernels::AttentionShape& s, F&& f) {
  for (int64_t i0 = 0; i0 < s.T; i0 += kBlockRows)
    f(i0, s.T - i0 < kBlockRows ? s.T - i0 : kBlockRows);
}

// The blocks in the order the GPU runs them: gemm(product) runs a PairProduct over every pair,
// rows(BlockRows) the row pass of a block (BlockRows::forward / backward on every row).
template <class Gemm, class Rows>
void blocked_forward_schedule(const kernels::AttentionShape& s, int64_t bytes, const void* qkv,
                              const int32_t* mask, const kernels::Dropout& d, const BlockBuffers& b,
                              float* ctx, Gemm&& gemm, Rows&& rows) {
  for_each_block(s, [&](int64_t i0, int64_t n) {
    const auto p = blocked_forward_products(s, bytes, i0, n, qkv, b, ctx);
    gemm(p[0]);
    rows(BlockRows{s, i0, n, mask, d});
    gemm(p[1]);
  });
}
template <class Gemm, class Rows>
void blocked_backward_schedule(const kernels::AttentionShape& s, int64_t bytes, const void* qkv,
                               const void* dctx, const int32_t* mask, const kernels::Dropout& d,
                               const BlockBuffers& b, float* dqkv, Gemm&& gemm, Rows&& rows) {
  for_each_block(s, [&](int64_t i0, int64_t n) {
    const auto p = blocked_backward_products(s, bytes, i0, n, qkv, dctx, b, dqkv);
    gemm(p[0]);  // S
    gemm(p[1]);  // dd
    rows(BlockRows{s, i0, n, mask, d});
    gemm(p[2]);  // dV
    gemm(p[3]);  // dQ
    gemm(p[4]);  // dK
  });
}

}  // namespace bertrain::cuda
