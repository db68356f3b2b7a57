// Blocked (flash-style) attention: one (sequence, head) per thread, query rows in blocks of
// kRows. Forward: S = Q_blk K^T over the block's full rows (T columns: the softmax needs no
// running rescale), one pass per row for scale + mask + softmax + dropout, ctx_blk = P V; only
// the row log-sum-exp leaves the kernel. Backward recomputes S and P from it, dP = dctx V^T,
// one pass per row for dropout + softmax backward, then dV += P_drop^T dctx, dQ_blk = dS K,
// dK += dS^T Q_blk. Each block's rows stay in cache; no [B,NH,T,T] buffer exists at all.
// Promoted from bench/bench_attention_blocked.cpp (see there for the measurements).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/isa.h"
#include "core/simd_avx2.h"
#include "core/simd_avx512.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_rows.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/scratch.h"

namespace bertrain::kernels {
namespace {

constexpr int64_t kRows = 128;  // query rows per block (64 measured 5-10% slower at T = 512)

using rows::put;
using rows::put16;

// ---- Forward row: s holds the unscaled scores; out gets the dropped probabilities (may be s
// itself when X is float); returns the row's log-sum-exp of the scaled, masked scores.

template <typename X>
float forward_row(isa::Portable, float* s, X* out, const float* bias, int64_t T, float scale,
                  float p, float keep_scale, uint64_t key, uint64_t idx0) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < T; ++j) {
    s[j] = s[j] * scale + bias[j];
    mx = std::max(mx, s[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < T; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  const float inv = keep_scale / sum;
  for (int64_t j = 0; j < T; ++j)
    put(out + j, p > 0.0f && !dropout_keep(p, key, idx0 + j) ? 0.0f : s[j] * inv);
  return mx + std::log(sum);
}

template <typename X>
BT_AVX512 float forward_row(isa::Avx512, float* s, X* out, const float* bias, int64_t T,
                            float scale, float p, float keep_scale, uint64_t key, uint64_t idx0) {
  using namespace simd;
  __m512 vmx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    const __m512 x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(scale),
                                     _mm512_maskz_loadu_ps(m, bias + j));
    _mm512_mask_storeu_ps(s + j, m, x);
    vmx = _mm512_mask_max_ps(vmx, m, vmx, x);
  }
  const float mx = _mm512_reduce_max_ps(vmx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(mx)));
    _mm512_mask_storeu_ps(s + j, m, e);
    vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
  const __m512 inv = _mm512_set1_ps(keep_scale / sum);
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv);
    if (p > 0.0f) y = _mm512_mul_ps(y, dropout_scale16(p, 1.0f, key, idx0 + j));
    put16(out + j, m, y);
  }
  return mx + std::log(sum);
}

BT_AVX2 float forward_row(isa::Avx2, float* s, float* out, const float* bias, int64_t T,
                          float scale, float p, float keep_scale, uint64_t key, uint64_t idx0) {
  using namespace simd;
  __m256 vmx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < T; j += 8) {
    const __m256 x = _mm256_fmadd_ps(load8_or(s + j, T - j, -INFINITY), _mm256_set1_ps(scale),
                                     load8(bias + j, T - j));
    store8(s + j, T - j, x);
    vmx = _mm256_max_ps(vmx, x);  // lanes past T hold -inf
  }
  const float mx = hmax8(vmx);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < T; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(load8_or(s + j, T - j, -INFINITY), _mm256_set1_ps(mx)));
    store8(s + j, T - j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const float sum = hsum8(vsum);
  const __m256 inv = _mm256_set1_ps(keep_scale / sum);
  for (int64_t j = 0; j < T; j += 8) {
    __m256 y = _mm256_mul_ps(load8(s + j, T - j), inv);
    if (p > 0.0f) y = _mm256_mul_ps(y, dropout_scale8(p, 1.0f, key, idx0 + j));
    store8(out + j, T - j, y);
  }
  return mx + std::log(sum);
}

// ---- Backward row: s holds the recomputed unscaled scores, g = dctx . V^T (the gradient of the
// dropped probabilities). Out: pd = the dropped probabilities, ds = dL/dS (unscaled scores).
// Two passes: P, the dropped gradient and their dot, then ds = P (g - dot) scale.

template <typename X>
void backward_row(isa::Portable, float* s, float* g, X* pd, X* ds, const float* bias, int64_t T,
                  float scale, float lse, float p, float keep_scale, uint64_t key, uint64_t idx0) {
  float dot = 0.0f;
  for (int64_t j = 0; j < T; ++j) {
    s[j] = std::exp(s[j] * scale + bias[j] - lse);
    const float m = p > 0.0f && !dropout_keep(p, key, idx0 + j) ? 0.0f : keep_scale;
    put(pd + j, s[j] * m);
    g[j] *= m;
    dot += g[j] * s[j];
  }
  for (int64_t j = 0; j < T; ++j) put(ds + j, s[j] * (g[j] - dot) * scale);
}

template <typename X>
BT_AVX512 void backward_row(isa::Avx512, float* s, float* g, X* pd, X* ds, const float* bias,
                            int64_t T, float scale, float lse, float p, float keep_scale,
                            uint64_t key, uint64_t idx0) {
  using namespace simd;
  __m512 vdot = _mm512_setzero_ps();
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    const __m512 P = exp_ps(
        _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(scale),
                        _mm512_sub_ps(_mm512_maskz_loadu_ps(m, bias + j), _mm512_set1_ps(lse))));
    const __m512 k =
        p > 0.0f ? dropout_scale16(p, keep_scale, key, idx0 + j) : _mm512_set1_ps(keep_scale);
    _mm512_mask_storeu_ps(s + j, m, P);
    put16(pd + j, m, _mm512_mul_ps(P, k));
    const __m512 gj = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, g + j), k);
    _mm512_mask_storeu_ps(g + j, m, gj);
    vdot = _mm512_mask3_fmadd_ps(gj, P, vdot, m);
  }
  const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(vdot)), vs = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < T; j += 16) {
    const __mmask16 m = tail_mask(T - j);
    put16(ds + j, m,
          _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j),
                                      _mm512_sub_ps(_mm512_maskz_loadu_ps(m, g + j), dot)),
                        vs));
  }
}

BT_AVX2 void backward_row(isa::Avx2, float* s, float* g, float* pd, float* ds, const float* bias,
                          int64_t T, float scale, float lse, float p, float keep_scale,
                          uint64_t key, uint64_t idx0) {
  using namespace simd;
  __m256 vdot = _mm256_setzero_ps();
  for (int64_t j = 0; j < T; j += 8) {
    const int64_t n = T - j;
    // Lanes past T: scores -inf, so P = 0 there and adds nothing to the dot.
    const __m256 P = exp8(_mm256_fmadd_ps(load8_or(s + j, n, -INFINITY), _mm256_set1_ps(scale),
                                          _mm256_sub_ps(load8(bias + j, n), _mm256_set1_ps(lse))));
    const __m256 k =
        p > 0.0f ? dropout_scale8(p, keep_scale, key, idx0 + j) : _mm256_set1_ps(keep_scale);
    store8(s + j, n, P);
    store8(pd + j, n, _mm256_mul_ps(P, k));
    const __m256 gj = _mm256_mul_ps(load8(g + j, n), k);
    store8(g + j, n, gj);
    vdot = _mm256_fmadd_ps(gj, P, vdot);
  }
  const __m256 dot = _mm256_set1_ps(hsum8(vdot)), vs = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < T; j += 8) {
    const int64_t n = T - j;
    store8(ds + j, n,
           _mm256_mul_ps(_mm256_mul_ps(load8(s + j, n), _mm256_sub_ps(load8(g + j, n), dot)), vs));
  }
}

// One product of a block: fp32 or bf16 operands, fp32 accumulation and output.
void block_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, nullptr, accumulate);
}
void block_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, nullptr, accumulate);
}

// One thread's row-block buffers (scores s and gradients g in fp32, a and b in the operand type)
// and its mask row: its parts of the kernel scratch (scratch.h).
template <typename X>
struct Buffers {
  float *s, *g, *bias;
  X *a, *b;
  static int64_t row_bytes(int64_t T) { return kRows * T * (2 * 4 + 2 * int64_t{sizeof(X)}); }
  Buffers(std::byte* rows, float* mask_row, int64_t T)
      : s(reinterpret_cast<float*>(rows)),
        g(s + kRows * T),
        bias(mask_row),
        a(reinterpret_cast<X*>(g + kRows * T)),
        b(a + kRows * T) {}
};

void fill_bias(float* bias, const int32_t* mask, int64_t b, int64_t T) {
  for (int64_t j = 0; j < T; ++j) bias[j] = mask[b * T + j] ? 0.0f : -10000.0f;
}

// The loop both directions share: one (sequence, head) per thread, with that thread's
// buffers (mask row filled in) and the head's Q, K, V columns; body(isa tag, buf, bh, b, h, q, k,
// v).
// Under a GemmScratchQuery (attention_blocked_scratch) body runs once, on this thread, with
// query true: it then makes its products only.
template <typename X, typename F>
void for_each_head(const AttentionShape& s, const X* qkv, const int32_t* mask, F&& body) {
  const int64_t T = s.T, C = s.C, NH = s.NH, HD = C / NH, C3 = 3 * C;
  if (GemmScratchQuery::active()) {
    Buffers<X> none(reinterpret_cast<std::byte*>(const_cast<X*>(qkv)), nullptr, 0);
    return with_isa([&](auto tag) { body(tag, true, none, 0, 0, 0, qkv, qkv, qkv); });
  }
  const int threads = omp_get_max_threads();
  const ScratchBlock rows =
      scratch_block(ScratchPart::AttentionRows, Buffers<X>::row_bytes(T), threads);
  const ScratchBlock mask_rows = scratch_block(ScratchPart::MaskRow, T * 4, threads);
  with_isa([&](auto tag) {
#pragma omp parallel
    {
      const int t = omp_get_thread_num();
      Buffers<X> buf(rows.at(t), mask_rows.as<float>(t), T);
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < s.B * NH; ++bh) {
        const int64_t b = bh / NH, h = bh % NH;
        const X* q = qkv + b * T * C3 + h * HD;
        fill_bias(buf.bias, mask, b, T);
        body(tag, false, buf, bh, b, h, q, q + C, q + 2 * C);
      }
    }
  });
}

template <typename X>
void forward_impl(float* ctx, float* lse, const X* qkv, const int32_t* mask,
                  const AttentionShape& s, float p, uint64_t key, uint64_t offset) {
  const int64_t T = s.T, C = s.C, HD = C / s.NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const float keep_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  for_each_head(s, qkv, mask,
                [&](auto tag, bool query, Buffers<X>& buf, int64_t bh, int64_t b, int64_t h,
                    const X* q, const X* k, const X* v) {
                  for (int64_t i0 = 0; i0 < T; i0 += kRows) {
                    const int64_t rows = std::min(kRows, T - i0);
                    block_gemm(false, true, rows, T, HD, q + i0 * C3, C3, k, C3, buf.s, T, false);
                    X* dropped;
                    if constexpr (std::is_same_v<X, float>)
                      dropped = buf.s;  // in place
                    else
                      dropped = buf.a;
                    for (int64_t i = 0; i < rows && !query; ++i) {
                      const int64_t r = bh * T + i0 + i;
                      lse[r] = forward_row(tag, buf.s + i * T, dropped + i * T, buf.bias, T, scale,
                                           p, keep_scale, key, offset + s.dropout_row(bh, i0 + i));
                    }
                    block_gemm(false, false, rows, HD, T, dropped, T, v, C3,
                               ctx + (b * T + i0) * C + h * HD, C, false);
                  }
                });
}

template <typename X>
void backward_impl(float* dqkv, const X* dctx, const X* qkv, const float* lse, const int32_t* mask,
                   const AttentionShape& s, float p, uint64_t key, uint64_t offset) {
  const int64_t T = s.T, C = s.C, HD = C / s.NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const float keep_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  for_each_head(s, qkv, mask,
                [&](auto tag, bool query, Buffers<X>& buf, int64_t bh, int64_t b, int64_t h,
                    const X* q, const X* k, const X* v) {
                  float* dq = dqkv + b * T * C3 + h * HD;
                  float *dk = dq + C, *dv = dq + 2 * C;
                  for (int64_t t = 0; t < T && !query; ++t)
                    for (int64_t e = 0; e < HD; ++e) dk[t * C3 + e] = dv[t * C3 + e] = 0.0f;
                  for (int64_t i0 = 0; i0 < T; i0 += kRows) {
                    const int64_t rows = std::min(kRows, T - i0);
                    const X* dout = dctx + (b * T + i0) * C + h * HD;
                    block_gemm(false, true, rows, T, HD, q + i0 * C3, C3, k, C3, buf.s, T, false);
                    block_gemm(false, true, rows, T, HD, dout, C, v, C3, buf.g, T, false);
                    for (int64_t i = 0; i < rows && !query; ++i) {
                      const int64_t r = bh * T + i0 + i;
                      backward_row(tag, buf.s + i * T, buf.g + i * T, buf.a + i * T, buf.b + i * T,
                                   buf.bias, T, scale, lse[r], p, keep_scale, key,
                                   offset + s.dropout_row(bh, i0 + i));
                    }
                    // dV += P_drop^T dctx_blk; dQ_blk = dS K; dK += dS^T Q_blk
                    block_gemm(true, false, T, HD, rows, buf.a, T, dout, C, dv, C3, true);
                    block_gemm(false, false, rows, HD, T, buf.b, T, k, C3, dq + i0 * C3, C3, false);
                    block_gemm(true, false, T, HD, rows, buf.b, T, q + i0 * C3, C3, dk, C3, true);
                  }
                });
}

}  // namespace

void attention_blocked_forward(float* ctx, float* lse, const float* qkv, const int32_t* mask,
                               const AttentionShape& s, float dropout_p, uint64_t key,
                               uint64_t offset, const AttentionBf16* bf16) {
  if (bf16) {
    convert_f32_to_bf16(qkv, bf16->qkv, static_cast<size_t>(s.B * s.T * 3 * s.C));
    return forward_impl<uint16_t>(ctx, lse, bf16->qkv, mask, s, dropout_p, key, offset);
  }
  forward_impl<float>(ctx, lse, qkv, mask, s, dropout_p, key, offset);
}

void attention_blocked_backward(float* dqkv, const float* dctx, const float* qkv, const float* lse,
                                const int32_t* mask, const AttentionShape& s, float dropout_p,
                                uint64_t key, uint64_t offset, const AttentionBf16* bf16) {
  if (bf16) {
    if (qkv) convert_f32_to_bf16(qkv, bf16->qkv, static_cast<size_t>(s.B * s.T * 3 * s.C));
    convert_f32_to_bf16(dctx, bf16->dctx, static_cast<size_t>(s.B * s.T * s.C));
    return backward_impl<uint16_t>(dqkv, bf16->dctx, bf16->qkv, lse, mask, s, dropout_p, key,
                                   offset);
  }
  backward_impl<float>(dqkv, dctx, qkv, lse, mask, s, dropout_p, key, offset);
}

AttentionScratch attention_blocked_scratch(const AttentionShape& s, bool bf16) {
  AttentionScratch a;
  a.mask_row = s.T * 4;
  a.rows = bf16 ? Buffers<uint16_t>::row_bytes(s.T) : Buffers<float>::row_bytes(s.T);
  GemmScratchQuery q;  // the kernels' own calls: products only, on placeholder operands
  float* f = q.placeholder<float>();
  uint16_t* h = q.placeholder<uint16_t>();
  const int32_t* m = q.placeholder<int32_t>();
  if (bf16) {
    forward_impl<uint16_t>(f, f, h, m, s, 0.1f, 0, 0);
    backward_impl<uint16_t>(f, h, h, f, m, s, 0.1f, 0, 0);
  } else {
    forward_impl<float>(f, f, f, m, s, 0.1f, 0, 0);
    backward_impl<float>(f, f, f, f, m, s, 0.1f, 0, 0);
  }
  a.thread_gemm = q.bytes();
  return a;
}

}  // namespace bertrain::kernels
