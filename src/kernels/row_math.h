// The per-row and per-element math of the fused kernels, written once for the host and for CUDA
// (kernels/cuda/ runs it, the host tests check it against the CPU kernels: test_row_math.cpp),
// so that on a GPU only the thread mapping is new.
//
// A row of C values is split over `count` lanes (a warp's 32 threads on the GPU; one on the
// host): lane `lane` takes columns lane, lane + count, ... and every lane combines its partial
// values through the lanes object (sum, max, min: a warp's shuffles on the GPU, the value itself
// on the host), which returns the total to every lane. A lane reads and writes only its own
// columns between two combinations, so in-place rows need no other synchronisation.
//
// Semantics are the CPU kernels' (kernels/cpu/*.h); statistics are fp32 here (the CPU's portable
// LayerNorm sums in double), so results agree within fp32 rounding, not bit for bit — except the
// optimizer elements, which the CPU's reference loops call themselves.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/host_device.h"
#include "core/rng.h"
#include "kernels/types.h"

namespace bertrain::kernels::row_math {

// The host's lanes: one lane, nothing to combine.
struct OneLane {
  static constexpr int lane = 0, count = 1;
  BT_HOST_DEVICE float sum(float v) const { return v; }
  BT_HOST_DEVICE float max(float v) const { return v; }
  BT_HOST_DEVICE int64_t min(int64_t v) const { return v; }
};

// BERT's dropout of one element: kept iff rng_uniform(key, index) >= p, then scaled by
// keep_scale = 1 / (1 - p); p = 0 leaves x alone.
BT_HOST_DEVICE inline float dropout(float x, float p, float keep_scale, uint64_t key,
                                    uint64_t index) {
  if (p <= 0.0f) return x;
  return rng_uniform(key, index) >= p ? x * keep_scale : 0.0f;
}

BT_HOST_DEVICE inline float keep_scale_of(float p) {
  return p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
}

// o = (x - mean) * rstd * gamma + beta; mean and rstd written by lane 0. Two passes over the row
// (the variance from the centred values: stable for the magnitudes BERT sees). o may alias x.
template <class Lanes>
BT_HOST_DEVICE void layernorm(float* o, float* mean, float* rstd, const float* x,
                              const float* gamma, const float* beta, int64_t C, float eps,
                              const Lanes& l) {
  float s = 0.0f;
  for (int64_t c = l.lane; c < C; c += l.count) s += x[c];
  const float m = l.sum(s) / static_cast<float>(C);
  float v = 0.0f;
  for (int64_t c = l.lane; c < C; c += l.count) {
    const float d = x[c] - m;
    v += d * d;
  }
  const float r = 1.0f / sqrtf(l.sum(v) / static_cast<float>(C) + eps);
  for (int64_t c = l.lane; c < C; c += l.count) o[c] = (x[c] - m) * r * gamma[c] + beta[c];
  if (l.lane == 0) {
    *mean = m;
    *rstd = r;
  }
}

// The residual block's first half: x = dropout(x) + residual in place, element c keyed at
// index0 + c.
template <class Lanes>
BT_HOST_DEVICE void dropout_residual(float* x, const float* residual, int64_t C, float p,
                                     uint64_t key, uint64_t index0, const Lanes& l) {
  const float ks = keep_scale_of(p);
  for (int64_t c = l.lane; c < C; c += l.count)
    x[c] = dropout(x[c], p, ks, key, index0 + c) + residual[c];
}

// x = dropout(x) in place, element c keyed at index0 + c.
template <class Lanes>
BT_HOST_DEVICE void dropout_row(float* x, int64_t C, float p, uint64_t key, uint64_t index0,
                                const Lanes& l) {
  if (p <= 0.0f) return;
  const float ks = keep_scale_of(p);
  for (int64_t c = l.lane; c < C; c += l.count) x[c] = dropout(x[c], p, ks, key, index0 + c);
}

// One token's embedding sum: out = word[id] + position[t] + token_type[segment].
template <class Lanes>
BT_HOST_DEVICE void embedding_sum(float* out, int32_t id, int32_t segment, int64_t t,
                                  const float* word, const float* position, const float* token_type,
                                  int64_t C, const Lanes& l) {
  const float* w = word + static_cast<int64_t>(id) * C;
  const float* p = position + t * C;
  const float* s = token_type + static_cast<int64_t>(segment) * C;
  for (int64_t c = l.lane; c < C; c += l.count) out[c] = w[c] + p[c] + s[c];
}

// LayerNorm's input gradient for one row (dx = or += with accumulate), and, when dd is given, the
// gradient through the residual block's dropout: dd = dropout(dx) keyed as forward (index0 + c).
// dx = rstd * (gamma dy - mean(gamma dy) - xhat mean(gamma dy xhat)), xhat = (x - mean) * rstd.
template <class Lanes>
BT_HOST_DEVICE void layernorm_backward(float* dx, float* dd, const float* dy, const float* x,
                                       const float* gamma, float mean, float rstd, int64_t C,
                                       bool accumulate, float p, uint64_t key, uint64_t index0,
                                       const Lanes& l) {
  float a = 0.0f, b = 0.0f;
  for (int64_t c = l.lane; c < C; c += l.count) {
    const float xhat = (x[c] - mean) * rstd;
    const float gdy = gamma[c] * dy[c];
    a += gdy;
    b += gdy * xhat;
  }
  a = l.sum(a) / static_cast<float>(C);
  b = l.sum(b) / static_cast<float>(C);
  const float ks = keep_scale_of(p);
  for (int64_t c = l.lane; c < C; c += l.count) {
    const float xhat = (x[c] - mean) * rstd;
    const float g = rstd * (gamma[c] * dy[c] - a - xhat * b);
    const float v = accumulate ? dx[c] + g : g;
    dx[c] = v;
    if (dd) dd[c] = dropout(v, p, ks, key, index0 + c);
  }
}

// Column c of x[rows, N] over rows [r0, r1), summed in order and added to out[c] (a bias
// gradient: a chunk of rows, then the chunks' partial sums; a column per thread on the GPU).
BT_HOST_DEVICE inline void column_sum(float* out, const float* x, int64_t r0, int64_t r1, int64_t N,
                                      int64_t c) {
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s += x[r * N + c];
  out[c] += s;
}

// Embedding backward over grouped tokens (kernels::RowRuns), channel c of a table of C
// columns: chunk k's tokens' gradients (dout rows order[k.begin, k.end)) summed in token order,
// onto its table row (a row of one chunk: the CPU's additions, bit for bit) or into its partial
// row; then a row of several chunks adds its partial rows in order (embedding_partials_sum).
BT_HOST_DEVICE inline void embedding_chunk(float* table, float* partial, const EmbeddingChunk& k,
                                           const int32_t* order, const float* dout, int64_t C,
                                           int64_t c) {
  float* out = k.partial < 0 ? table + static_cast<int64_t>(k.row) * C
                             : partial + static_cast<int64_t>(k.partial) * C;
  float s = k.partial < 0 ? out[c] : 0.0f;
  for (int32_t i = k.begin; i < k.end; ++i) s += dout[static_cast<int64_t>(order[i]) * C + c];
  out[c] = s;
}
BT_HOST_DEVICE inline void embedding_partials_sum(float* table, const float* partial,
                                                  const EmbeddingSum& s, int64_t C, int64_t c) {
  float v = 0.0f;
  for (int32_t k = 0; k < s.count; ++k) v += partial[static_cast<int64_t>(s.first + k) * C + c];
  table[static_cast<int64_t>(s.row) * C + c] += v;
}

// LayerNorm's parameter gradients of one column c over rows [r0, r1): dgamma += sum dy * xhat,
// dbeta += sum dy (a column per thread on the GPU: no atomics, the same order every run).
BT_HOST_DEVICE inline void layernorm_param_grads(float* dgamma, float* dbeta, const float* dy,
                                                 const float* x, const float* mean,
                                                 const float* rstd, int64_t r0, int64_t r1,
                                                 int64_t C, int64_t c) {
  float g = 0.0f, b = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = dy[r * C + c];
    g += d * (x[r * C + c] - mean[r]) * rstd[r];
    b += d;
  }
  dgamma[c] += g;
  dbeta[c] += b;
}

// Attention's mask + softmax + dropout over one row of T scores (already scaled by 1/sqrt(head
// size)): s_j + (mask_j ? 0 : -10000), probs = softmax (kept for backward; may alias scores),
// dropped = dropout(probs) keyed index0 + j (what multiplies V; may be null when p = 0).
// A score of key j with BERT's additive mask.
BT_HOST_DEVICE inline float masked_score(float score, const int32_t* mask, int64_t j) {
  return score + (mask[j] ? 0.0f : -10000.0f);
}
// Score j of a row with BERT's additive mask.
BT_HOST_DEVICE inline float masked(const float* scores, const int32_t* mask, int64_t j) {
  return masked_score(scores[j], mask, j);
}
// The row's largest masked score, over every lane.
template <class Lanes>
BT_HOST_DEVICE float masked_max(const float* scores, const int32_t* mask, int64_t T,
                                const Lanes& l) {
  float mx = -INFINITY;
  for (int64_t j = l.lane; j < T; j += l.count) mx = fmaxf(mx, masked(scores, mask, j));
  return l.max(mx);
}

// The row's largest masked score and the sum of exp(masked score - that maximum), over every
// lane: a softmax's normaliser, its exponentials computed again where they are written.
struct RowExpSum {
  float mx, sum;
};
template <class Lanes>
BT_HOST_DEVICE RowExpSum masked_exp_sum(const float* scores, const int32_t* mask, int64_t T,
                                        const Lanes& l) {
  const float mx = masked_max(scores, mask, T, l);
  float sum = 0.0f;
  for (int64_t j = l.lane; j < T; j += l.count) sum += expf(masked(scores, mask, j) - mx);
  return {mx, l.sum(sum)};
}

template <class Lanes>
BT_HOST_DEVICE void attention_softmax(float* probs, float* dropped, const float* scores,
                                      const int32_t* mask, int64_t T, float p, uint64_t key,
                                      uint64_t index0, const Lanes& l) {
  const float mx = masked_max(scores, mask, T, l);
  float sum = 0.0f;
  for (int64_t j = l.lane; j < T; j += l.count) {
    const float e = expf(masked(scores, mask, j) - mx);
    probs[j] = e;
    sum += e;
  }
  const float inv = 1.0f / l.sum(sum);
  const float ks = keep_scale_of(p);
  for (int64_t j = l.lane; j < T; j += l.count) {
    probs[j] *= inv;
    if (dropped) dropped[j] = dropout(probs[j], p, ks, key, index0 + j);
  }
}

// Its backward for one row: dd the gradient of the dropped probabilities (dctx . V^T), probs as
// forward kept them; ds = probs * (dp - sum_j probs_j dp_j) with dp = dropout(dd) (ds may alias
// dd). The 1/sqrt(head size) is the products' scale.
// A kept probability: fp32, or bf16 / fp16 bits widened.
struct Bf16Bits {
  uint16_t bits;
};
struct F16Bits {
  uint16_t bits;
};
BT_HOST_DEVICE inline float widen(float x) {
  return x;
}
BT_HOST_DEVICE inline float widen(Bf16Bits x) {
  return bf16_to_f32(x.bits);
}
BT_HOST_DEVICE inline float widen(F16Bits x) {
  return f16_to_f32(x.bits);
}

// ds written as fp32, or rounded to bf16 / fp16 (the products' operand: no fp32 pass in
// between).
BT_HOST_DEVICE inline void store(float* out, float v) {
  *out = v;
}
BT_HOST_DEVICE inline void store(Bf16Bits* out, float v) {
  out->bits = f32_to_bf16(v);
}
BT_HOST_DEVICE inline void store(F16Bits* out, float v) {
  out->bits = f32_to_f16(v);
}

template <class Lanes, class P = float, class D = float>
BT_HOST_DEVICE void attention_softmax_backward(D* ds, const float* dd, const P* probs, int64_t T,
                                               float p, uint64_t key, uint64_t index0,
                                               const Lanes& l) {
  const float ks = keep_scale_of(p);
  float dot = 0.0f;
  for (int64_t j = l.lane; j < T; j += l.count)
    dot += widen(probs[j]) * dropout(dd[j], p, ks, key, index0 + j);
  dot = l.sum(dot);
  for (int64_t j = l.lane; j < T; j += l.count)
    store(ds + j, widen(probs[j]) * (dropout(dd[j], p, ks, key, index0 + j) - dot));
}

// attention_softmax with the probabilities kept in 16 bits (H: Bf16Bits, the BF16 precision's
// rule, kernels/cpu/attention.h; F16Bits, FP16's where the products take fp16 operands):
// probs16 = round(probs), dropped16 = round(dropout(widen(probs16))) (may be null when p = 0),
// the same values as attention_softmax followed by that rounding, in one pass over the row (the
// exponentials computed again instead of kept in fp32).
template <class Lanes, class H>
BT_HOST_DEVICE void attention_softmax_16(H* probs16, H* dropped16, const float* scores,
                                         const int32_t* mask, int64_t T, float p, uint64_t key,
                                         uint64_t index0, const Lanes& l) {
  const auto [mx, sum] = masked_exp_sum(scores, mask, T, l);
  const float inv = 1.0f / sum;
  const float ks = keep_scale_of(p);
  for (int64_t j = l.lane; j < T; j += l.count) {
    float e = expf(masked(scores, mask, j) - mx);
    e *= inv;
    store(probs16 + j, e);
    if (dropped16) store(dropped16 + j, dropout(widen(probs16[j]), p, ks, key, index0 + j));
  }
}

// The blocked (flash-style) kernel's rows (kernels/cpu/attention_blocked.cpp's forward_row and
// backward_row; the GPU runs them over a block of query rows at a time, cuda/attention_products.h).
// Forward: T scores (scaled) with BERT's mask; out = dropout(softmax) stored as X (fp32, or
// rounded to bf16 / fp16 bits: the product's operand, one rounding); returns the log-sum-exp of
// the masked scores to every lane, all backward keeps. out may alias scores when X is float.
template <class Lanes, class X>
BT_HOST_DEVICE float attention_softmax_lse(X* out, const float* scores, const int32_t* mask,
                                           int64_t T, float p, uint64_t key, uint64_t index0,
                                           const Lanes& l) {
  const auto [mx, sum] = masked_exp_sum(scores, mask, T, l);
  const float inv = 1.0f / sum, ks = keep_scale_of(p);
  for (int64_t j = l.lane; j < T; j += l.count)
    store(out + j, dropout(expf(masked(scores, mask, j) - mx) * inv, p, ks, key, index0 + j));
  return mx + logf(sum);
}

// Its backward for one row, from the same scores recomputed and the kept log-sum-exp:
// P = exp(masked score - lse); dropped = dropout(P) (dV's operand, as forward multiplied V);
// g = dropout(dd) with dd = dctx . V^T; ds = P * (g - sum_j P_j g_j) (dQ's and dK's operand; the
// 1/sqrt(head size) is the products' scale). scores and dd are overwritten with P and g;
// dropped and ds stored as X.
template <class Lanes, class X>
BT_HOST_DEVICE void attention_softmax_backward_lse(X* dropped, X* ds, float* scores, float* dd,
                                                   const int32_t* mask, int64_t T, float lse,
                                                   float p, uint64_t key, uint64_t index0,
                                                   const Lanes& l) {
  const float ks = keep_scale_of(p);
  float dot = 0.0f;
  for (int64_t j = l.lane; j < T; j += l.count) {
    const float P = expf(masked(scores, mask, j) - lse);
    const float k = dropout(1.0f, p, ks, key, index0 + j);
    const float g = dd[j] * k;
    store(dropped + j, P * k);
    scores[j] = P;
    dd[j] = g;
    dot += P * g;
  }
  dot = l.sum(dot);
  for (int64_t j = l.lane; j < T; j += l.count) store(ds + j, scores[j] * (dd[j] - dot));
}

// Softmax cross-entropy of one row of V logits with its gradient (kernels/cpu/cross_entropy.h):
// loss = logsumexp(x) - x[target]; hit = the first maximum is the target; when d is given,
// d = (softmax(x) - onehot(target)) * weight * dscale (d may alias x), and d[V, stride) = 0 (the
// row's padding: types.h Classes).
struct CrossEntropyRow {
  float loss;
  bool hit;
};
template <class Lanes>
BT_HOST_DEVICE CrossEntropyRow cross_entropy(float* d, const float* x, int32_t target, float weight,
                                             int64_t V, int64_t stride, float dscale,
                                             const Lanes& l) {
  float mx = -INFINITY;
  int64_t arg = INT64_MAX;
  for (int64_t v = l.lane; v < V; v += l.count)
    if (x[v] > mx) {
      mx = x[v];
      arg = v;
    }
  const float row_max = l.max(mx);
  arg = l.min(mx == row_max ? arg : INT64_MAX);
  if (row_max == -INFINITY) arg = 0;
  // Read before the last combination: after it, a lane may overwrite x[target] (d aliasing x).
  const float x_target = x[target];
  float sum = 0.0f;
  for (int64_t v = l.lane; v < V; v += l.count) sum += expf(x[v] - row_max);
  sum = l.sum(sum);
  const float loss = logf(sum) + row_max - x_target;
  if (d) {
    const float g = weight * dscale, inv = 1.0f / sum;
    for (int64_t v = l.lane; v < V; v += l.count)
      d[v] = expf(x[v] - row_max) * inv * g - (v == target ? g : 0.0f);
    for (int64_t v = V + l.lane; v < stride; v += l.count) d[v] = 0.0f;
  }
  return {loss, arg == target};
}

// -- activations (BERT's GELU in its erf form, the tanh form of "gelu_new", ReLU) --

BT_HOST_DEVICE inline float activation(Activation a, float x) {
  switch (a) {
    case Activation::GeluErf:
      return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
    case Activation::GeluTanh:
      return 0.5f * x * (1.0f + tanhf(0.79788456080286535588f * (x + 0.044715f * x * x * x)));
    default:
      return x > 0.0f ? x : 0.0f;
  }
}

// dout * act'(x).
BT_HOST_DEVICE inline float activation_grad(Activation a, float x, float dout) {
  switch (a) {
    case Activation::GeluErf:
      return dout * (0.5f * (1.0f + erff(x * 0.70710678118654752440f)) +
                     x * (0.39894228040143267794f * expf(-0.5f * x * x)));
    case Activation::GeluTanh: {
      const float k = 0.79788456080286535588f;
      const float t = tanhf(k * (x + 0.044715f * x * x * x));
      const float du = k * (1.0f + 3.0f * 0.044715f * x * x);
      return dout * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
    }
    default:
      return x > 0.0f ? dout : 0.0f;
  }
}

// -- optimizer elements (torch.optim.AdamW; LAMB as apex FusedLAMB: kernels/types.h). The CPU's
//    reference loops run these; its vector bodies do the same operations in the same order. --

// Adam's moments of one element from the scaled gradient (the _values forms: on values a pass
// loads and stores itself, the GPU's multi-tensor kernels; the same operations).
BT_HOST_DEVICE inline void adam_moment_values(float gi, float b1, float b2, float& m, float& v) {
  m = b1 * m + (1.0f - b1) * gi;
  v = b2 * v + (1.0f - b2) * gi * gi;
}
BT_HOST_DEVICE inline void adam_moments(float gi, float b1, float b2, float* m, float* v,
                                        int64_t i) {
  adam_moment_values(gi, b1, b2, m[i], v[i]);
}

// A weight's 16-bit copy (the products' operand) of its fp32 value.
BT_HOST_DEVICE inline uint16_t weight_copy_16(bool f16, float p) {
  return f16 ? f32_to_f16(p) : f32_to_bf16(p);
}

BT_HOST_DEVICE inline void adamw_values(const AdamwStep& a, float g, float& p, float& m, float& v) {
  adam_moment_values(g * a.gscale, a.beta1, a.beta2, m, v);
  p = p * a.decay - a.step_size * m / (sqrtf(v) / a.sqrt_bc2 + a.eps);
}
BT_HOST_DEVICE inline void adamw(const AdamwStep& a, float* p, uint16_t* p16, const float* g,
                                 float* m, float* v, int64_t i) {
  adamw_values(a, g[i], p[i], m[i], v[i]);
  if (p16) p16[i] = weight_copy_16(a.f16_copy, p[i]);
}

// LAMB's update direction of element i: m / bc1 / (sqrt(v / bc2) + eps) + wd p.
BT_HOST_DEVICE inline float lamb_direction(const LambStep& a, float p, float m, float v) {
  return (m * a.ibc1) / (sqrtf(v * a.ibc2) + a.eps) + a.wd * p;
}

// LAMB's first pass on element i: the moments, and the direction (returned; its square and
// p's go into the tensor's norms).
BT_HOST_DEVICE inline float lamb_moment_values(const LambStep& a, float g, float p, float& m,
                                               float& v) {
  adam_moment_values(g * a.gscale, a.beta1, a.beta2, m, v);
  return lamb_direction(a, p, m, v);
}
BT_HOST_DEVICE inline float lamb_moments(const LambStep& a, const float* p, const float* g,
                                         float* m, float* v, int64_t i) {
  return lamb_moment_values(a, g[i], p[i], m[i], v[i]);
}

// LAMB's second pass on element i: p -= step * u (step = lr x the tensor's trust ratio).
BT_HOST_DEVICE inline void lamb_apply_value(const LambStep& a, float& p, float m, float v,
                                            float step) {
  p -= step * lamb_direction(a, p, m, v);
}
BT_HOST_DEVICE inline void lamb_apply(const LambStep& a, float* p, uint16_t* p16, const float* m,
                                      const float* v, int64_t i, float step) {
  lamb_apply_value(a, p[i], m[i], v[i], step);
  if (p16) p16[i] = weight_copy_16(a.f16_copy, p[i]);
}

}  // namespace bertrain::kernels::row_math
