// The GPU's 16-bit attention (cuda/backend.cu, BF16 and FP16) run on the host: the same six
// product descriptions (cuda/attention_products.h) on 2-byte operands read in place (QKV's kept
// bits, the operand buffer, dctx rounded), each through the reference GEMM on the operands'
// values with fp32 accumulation (cuBLAS's), and the same row passes in the same order: the
// softmax writing the kept and the dropped probabilities rounded; in backward the dropped
// probabilities made again into the operand buffer and dS written over them once dV has read
// them. H is row_math::Bf16Bits or row_math::F16Bits; for_rows(rows, f) runs f(r, lanes) for
// every row (one lane, or a host warp). RowMath tests it against the fp32 reference; the test
// backend with fp16 operands (own_memory_backend.h) trains through it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/attention_products.h"
#include "kernels/row_math.h"
#include "kernels/types.h"

namespace bertrain::test {

// A product over every pair through the reference GEMM, its operands fp32 values: C_k =
// alpha op(A_k) op(B_k), or C_k += that with accumulate (cuBLAS's beta = 1).
inline void run_pairs(const cuda::PairProduct& m, int64_t pairs, int64_t NH) {
  std::vector<float> t(static_cast<size_t>(m.M * m.N));
  for (int64_t k = 0; k < pairs; ++k) {
    auto* c = static_cast<float*>(const_cast<void*>(m.c.of(k, NH)));
    kernels::gemm_reference(
        m.trans_a, m.trans_b, m.M, m.N, m.K, static_cast<const float*>(m.a.of(k, NH)), m.lda,
        static_cast<const float*>(m.b.of(k, NH)), m.ldb, t.data(), m.N, nullptr, false);
    for (int64_t i = 0; i < m.M; ++i)
      for (int64_t j = 0; j < m.N; ++j) {
        float& x = c[i * m.ldc + j];
        x = (m.accumulate ? x : 0.0f) + m.alpha * t[i * m.N + j];
      }
  }
}

// The 16-bit buffers a flow's products read: an fp32 copy of each as it is when a product runs,
// a 2-byte operand mapped onto its copy at the same element offset.
template <class H>
class Operands16 {
 public:
  explicit Operands16(std::vector<std::pair<const H*, int64_t>> buffers)
      : buffers_(std::move(buffers)), wide_(buffers_.size()) {}

  // C_k (+)= alpha op(A_k) op(B_k) for every (sequence, head) pair.
  void run(const cuda::PairProduct& m, int64_t pairs, int64_t NH) {
    cuda::PairProduct w = m;
    w.a = values(m.a);
    w.b = values(m.b);
    run_pairs(w, pairs, NH);
  }

 private:
  cuda::PairOperand values(const cuda::PairOperand& o) {
    if (o.bytes == 4) return o;
    const auto* base = static_cast<const H*>(o.base);
    for (size_t b = 0; b < buffers_.size(); ++b) {
      const auto [h, n] = buffers_[b];
      if (base >= h && base < h + n) {
        wide_[b].resize(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) wide_[b][i] = kernels::row_math::widen(h[i]);
        return {wide_[b].data() + (base - h), o.per_sequence, o.per_head, 4};
      }
    }
    ADD_FAILURE() << "a 2-byte operand outside the 16-bit buffers";
    return o;
  }

  std::vector<std::pair<const H*, int64_t>> buffers_;
  std::vector<std::vector<float>> wide_;
};

// Forward: ctx (fp32) from qkv16 (the kept bits); probs16 the kept probabilities, work16 the
// operand buffer [B, NH, T, T] (the dropped probabilities).
template <class H, class ForRows>
void gpu_attention_16_forward(float* ctx, H* probs16, H* work16, const H* qkv16,
                              const int32_t* mask, const kernels::AttentionShape& s,
                              const kernels::Dropout& site, ForRows for_rows) {
  const kernels::Dropout d = kernels::resolved(site);  // (the step's arguments, where given)
  const int64_t T = s.T, NH = s.NH, pairs = s.B * NH, n_p = pairs * T * T;
  std::vector<float> scores(static_cast<size_t>(n_p));
  Operands16<H> ops({{qkv16, s.B * T * 3 * s.C}, {work16, n_p}});
  const auto fwd = cuda::attention_forward_products(s, 2, qkv16, scores.data(), work16, ctx);
  ops.run(fwd[0], pairs, NH);
  for_rows(pairs * T, [&](int64_t r, const auto& l) {
    const int64_t bh = r / T;
    kernels::row_math::attention_softmax_16(probs16 + r * T, work16 + r * T, scores.data() + r * T,
                                            mask + (bh / NH) * T, T, d.p, d.key,
                                            d.offset + s.dropout_row(bh, r % T), l);
  });
  ops.run(fwd[1], pairs, NH);
}

// Backward: dqkv (fp32, =) from dctx16 (dctx rounded), qkv16 and probs16 as forward left them;
// work16 the operand buffer (the dropped probabilities, then dS).
template <class H, class ForRows>
void gpu_attention_16_backward(float* dqkv, const H* dctx16, const H* qkv16, const H* probs16,
                               H* work16, const kernels::AttentionShape& s,
                               const kernels::Dropout& site, ForRows for_rows) {
  const kernels::Dropout d = kernels::resolved(site);  // (the step's arguments, where given)
  namespace rm = kernels::row_math;
  const int64_t T = s.T, NH = s.NH, pairs = s.B * NH, n_p = pairs * T * T;
  const float ks = rm::keep_scale_of(d.p);
  for (int64_t e = 0; e < n_p; ++e) {
    const int64_t r = e / T;
    rm::store(work16 + e, rm::dropout(rm::widen(probs16[e]), d.p, ks, d.key,
                                      d.offset + s.dropout_row(r / T, r % T) + e % T));
  }
  std::vector<float> dd(static_cast<size_t>(n_p));
  Operands16<H> ops({{qkv16, s.B * T * 3 * s.C}, {work16, n_p}, {dctx16, s.B * T * s.C}});
  const auto bwd =
      cuda::attention_backward_products(s, 2, qkv16, work16, dctx16, dd.data(), work16, dqkv);
  ops.run(bwd[0], pairs, NH);                          // dV
  ops.run(bwd[1], pairs, NH);                          // dd
  for_rows(pairs * T, [&](int64_t r, const auto& l) {  // dS over the dropped probabilities
    rm::attention_softmax_backward(work16 + r * T, dd.data() + r * T, probs16 + r * T, T, d.p,
                                   d.key, d.offset + s.dropout_row(r / T, r % T), l);
  });
  ops.run(bwd[2], pairs, NH);  // dQ
  ops.run(bwd[3], pairs, NH);  // dK
}

// The blocked kernel as the GPU runs it (cuda/attention_products.h: blocked_forward_schedule and
// blocked_backward_schedule, the CUDA backend's schedule, products and row passes) on the host. X
// is float (fp32 operands) or H (16-bit bits: QKV's kept bits, dctx rounded; the block operands
// rounded as the row passes write them). lse [B, NH, T] is all forward keeps.
template <class X>
struct BlockedFlow {
  std::vector<float> scores, dd;
  std::vector<X> dropped, ds;
  explicit BlockedFlow(const kernels::AttentionShape& s)
      : scores(static_cast<size_t>(cuda::block_values(s))),
        dd(scores.size()),
        dropped(scores.size()),
        ds(scores.size()) {}
  cuda::BlockBuffers buffers() { return {scores.data(), dd.data(), dropped.data(), ds.data()}; }
  int64_t n() const { return static_cast<int64_t>(scores.size()); }
};

template <class X, class ForRows>
void gpu_attention_blocked_forward(float* ctx, float* lse, const X* qkv, const int32_t* mask,
                                   const kernels::AttentionShape& s, const kernels::Dropout& site,
                                   ForRows for_rows) {
  const kernels::Dropout d = kernels::resolved(site);  // (the step's arguments, where given)
  BlockedFlow<X> f(s);
  Operands16<X> ops({{qkv, s.B * s.T * 3 * s.C}, {f.dropped.data(), f.n()}});
  cuda::blocked_forward_schedule(
      s, sizeof(X), qkv, mask, d, f.buffers(), ctx,
      [&](const cuda::PairProduct& m) { ops.run(m, s.B * s.NH, s.NH); },
      [&](const cuda::BlockRows& r) {
        for_rows(r.rows(), [&](int64_t w, const auto& l) {
          r.forward(w, f.dropped.data(), lse, f.scores.data(), l);
        });
      });
}

template <class X, class ForRows>
void gpu_attention_blocked_backward(float* dqkv, const X* dctx, const X* qkv, const float* lse,
                                    const int32_t* mask, const kernels::AttentionShape& s,
                                    const kernels::Dropout& site, ForRows for_rows) {
  const kernels::Dropout d = kernels::resolved(site);  // (the step's arguments, where given)
  BlockedFlow<X> f(s);
  Operands16<X> ops({{qkv, s.B * s.T * 3 * s.C},
                     {dctx, s.B * s.T * s.C},
                     {f.dropped.data(), f.n()},
                     {f.ds.data(), f.n()}});
  cuda::blocked_backward_schedule(
      s, sizeof(X), qkv, dctx, mask, d, f.buffers(), dqkv,
      [&](const cuda::PairProduct& m) { ops.run(m, s.B * s.NH, s.NH); },
      [&](const cuda::BlockRows& r) {
        for_rows(r.rows(), [&](int64_t w, const auto& l) {
          r.backward(w, f.dropped.data(), f.ds.data(), f.scores.data(), f.dd.data(), lse, l);
        });
      });
}

}  // namespace bertrain::test
