// Attention's core on the GPU (Backend::attention_forward / attention_backward): the full kernel
// (the products over every (sequence, head) pair read straight out of the QKV rows, and the row
// passes over all rows) and the blocked (flash-style) one, in each precision: the one place the
// GPU's attention dispatches on the precision and the kernel.
#include <cuda_fp16.h>

#include <type_traits>

#include "core/error.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/lanes.cuh"

namespace bertrain::cuda {

namespace rm = kernels::row_math;
using kernels::AttentionShape;
using kernels::Dropout;
using kernels::Kept;

namespace {

// Backward's dropped probabilities from the kept ones, element e of [B, NH, T, T] keyed as its
// row: fp32, or 16-bit (rm::Bf16Bits / rm::F16Bits) into the same format.
template <class H>
__global__ void attention_dropped_kernel(H* dropped, const H* probs, AttentionShape s, float dp,
                                         uint64_t key, uint64_t offset, const uint64_t* at) {
  BT_FOR_EACH(s.B * s.NH * s.T * s.T);
  step_key(key, offset, at);
  const int64_t r = i / s.T, j = i % s.T;
  const uint64_t idx = offset + s.dropout_row(r / s.T, r % s.T) + j;
  rm::store(dropped + i, rm::dropout(rm::widen(probs[i]), dp, rm::keep_scale_of(dp), key, idx));
}

// Rows [first, first + rows) of the softmax backward (one sequence's heads); ds in fp32 or,
// for 16-bit products, rounded to their format as it is written.
template <class P, class D>
__global__ void softmax_backward_rows_kernel(D* ds, const float* dd, const P* probs,
                                             AttentionShape s, int64_t first, int64_t rows,
                                             float dp, uint64_t key, uint64_t offset,
                                             const uint64_t* at) {
  step_key(key, offset, at);
  const int64_t w = warp_row();
  if (w >= rows) return;
  const int64_t r = first + w, T = s.T;
  rm::attention_softmax_backward(ds + w * T, dd + w * T, probs + r * T, T, dp, key,
                                 offset + s.dropout_row(r / T, r % T), warp_lanes());
}

// The blocked kernel's row passes (attention_products.h, BlockRows): a warp per row of the block;
// X the block operands' type (fp32, rm::Bf16Bits or rm::F16Bits).
template <class X>
__global__ void blocked_rows_forward_kernel(BlockRows r, X* dropped, float* lse,
                                            const float* scores) {
  const int64_t w = warp_row();
  if (w >= r.rows()) return;
  r.d = kernels::resolved(r.d);  // (the step's arguments: Dropout::at)
  r.forward(w, dropped, lse, scores, warp_lanes());
}
template <class X>
__global__ void blocked_rows_backward_kernel(BlockRows r, X* dropped, X* ds, float* scores,
                                             float* dd, const float* lse) {
  const int64_t w = warp_row();
  if (w >= r.rows()) return;
  r.d = kernels::resolved(r.d);
  r.backward(w, dropped, ds, scores, dd, lse, warp_lanes());
}

// f(X*) with a null pointer of the precision's operand type: float, rm::Bf16Bits, rm::F16Bits.
template <class F>
void with_operand_type(Precision p, F&& f) {
  switch (p) {
    case Precision::BF16:
      return f(static_cast<rm::Bf16Bits*>(nullptr));
    case Precision::FP16:
      return f(static_cast<rm::F16Bits*>(nullptr));
    default:
      return f(static_cast<float*>(nullptr));
  }
}

// The blocked kernel's buffers, parts of the kernels' scratch (scratch.h plans them): the block's
// scores and dd in fp32, its two operand buffers in `el`-byte elements.
BlockBuffers block_buffers(const AttentionShape& s, int64_t el) {
  const int64_t n = block_values(s), op = block_operand_bytes(s, el);
  BlockBuffers b;
  b.scores = static_cast<float*>(scratch(kAttentionScoresSlot, n * int64_t{sizeof(float)}));
  b.dd = static_cast<float*>(scratch(kAttentionGradSlot, n * int64_t{sizeof(float)}));
  auto* operands = static_cast<char*>(scratch(kAttentionDroppedSlot, 2 * op));
  b.dropped = operands;
  b.ds = operands + op;
  return b;
}

// Attention's sizes and operands: the products read the precision's elements (16-bit bits in
// BF16 and FP16, fp32 values in FP32: `el` bytes).
struct AttentionDims {
  int64_t n_probs;
  Precision o;
  int64_t el;
  AttentionDims(Precision p, const AttentionShape& s)
      : n_probs(s.B * s.NH * s.T * s.T), o(p), el(precision_bytes(p)) {}
};

// QKV as attention's products read it: BF16 and FP16 round it into its kept bits first (unless
// its product wrote the bits alone: no fp32 values given).
const void* attention_qkv(Precision p, Kept qkv, const AttentionShape& s) {
  const int64_t n = (s.starts ? s.rows : s.B * s.T) * 3 * s.C;
  if (qkv.f32) cuda::keep(p, qkv, n);
  return p == Precision::FP32 ? static_cast<const void*>(qkv.f32) : qkv.bits;
}

// The blocked (flash-style) kernel, from 512 tokens: attention_products.h's
// blocked_forward_schedule and blocked_backward_schedule (what the host tests run), the block
// buffers from the kernels' scratch, only the row log-sum-exp kept. q: QKV as the products read
// it; dc: dctx likewise.
void blocked_forward(Precision p, float* ctx, float* lse, const void* q, const int32_t* mask,
                     const AttentionShape& s, const Dropout& d) {
  const AttentionDims g(p, s);
  const BlockBuffers b = block_buffers(s, g.el);
  with_operand_type(p, [&](auto* type) {
    using X = std::remove_pointer_t<decltype(type)>;
    blocked_forward_schedule(
        s, g.el, q, mask, d, b, ctx,
        [&](const PairProduct& m) { gemm_pairs(g.o, s.B * s.NH, s.NH, m); },
        [&](const BlockRows& r) {
          BT_LAUNCH(blocked_rows_forward_kernel<X>, row_blocks(r.rows()), kRowThreads, 0,
                    compute_stream())
          (r, static_cast<X*>(b.dropped), lse, b.scores);
          check_launch();
        });
  });
}
void blocked_backward(Precision p, float* dqkv, const void* dc, const void* q, const float* lse,
                      const int32_t* mask, const AttentionShape& s, const Dropout& d) {
  const AttentionDims g(p, s);
  const BlockBuffers b = block_buffers(s, g.el);
  with_operand_type(p, [&](auto* type) {
    using X = std::remove_pointer_t<decltype(type)>;
    blocked_backward_schedule(
        s, g.el, q, dc, mask, d, b, dqkv,
        [&](const PairProduct& m) { gemm_pairs(g.o, s.B * s.NH, s.NH, m); },
        [&](const BlockRows& r) {
          BT_LAUNCH(blocked_rows_backward_kernel<X>, row_blocks(r.rows()), kRowThreads, 0,
                    compute_stream())
          (r, static_cast<X*>(b.dropped), static_cast<X*>(b.ds), b.scores, b.dd, lse);
          check_launch();
        });
  });
}

// The products' attention, full or blocked (where `saved` keeps the row log-sum-exp:
// blocked_forward / _backward above). Full: the products over every (sequence, head) pair read
// straight out of the QKV rows, and the row passes over all rows. FP32 keeps probs; BF16 and
// FP16 keep probs16 with 16-bit operands for the products (QKV's kept bits, the dropped
// probabilities and dS rounded as the row passes write them, dctx rounded). The full kernel's
// context product writes the context's 16-bit copy directly where one is kept (BF16, FP16: its
// fp32 values are left unwritten; nothing on the GPU reads them), else the fp32 context.
void attention_products_forward(Precision p, Kept ctx, kernels::AttentionSaved saved, Kept qkv,
                                const int32_t* mask, const AttentionShape& s, const Dropout& d,
                                const kernels::Workspace& ws) {
  const AttentionDims g(p, s);
  const void* q = attention_qkv(p, qkv, s);
  if (saved.blocked()) {
    blocked_forward(p, ctx.f32, saved.lse, q, mask, s, d);
    if (ctx.bits) cuda::keep(p, ctx, s.B * s.T * s.C);
    return;
  }
  const int64_t n_probs = g.n_probs;
  const bool half = p != Precision::FP32;
  // scores (scaled) in fp32: the kept probs in FP32, a buffer of our own otherwise; what
  // multiplies V: the dropped probabilities (16-bit in BF16 and FP16), or the probabilities
  // without dropout
  float* scores =
      half ? static_cast<float*>(scratch(kAttentionScoresSlot, n_probs * 4)) : saved.probs;
  float* dr = !half && d.p > 0.0f ? ws.attn_work : nullptr;
  const void* dropped = half ? static_cast<const void*>(ws.attn_probs16) : dr ? dr : scores;
  const bool ctx16 = half && ctx.bits;
  const auto products = attention_forward_products(
      s, g.el, q, scores, dropped, ctx16 ? static_cast<void*>(ctx.bits) : ctx.f32, ctx16 ? 2 : 4);
  const PairPointers at = pair_pointers(s.B * s.NH, s.NH, products.data(), 2);
  gemm_pairs(g.o, at, 0, products[0]);
  if (half)  // softmax and the 16-bit rounding in one pass
    attention_softmax_forward_16(p, saved.probs16, ws.attn_probs16, scores, mask, s, d);
  else
    attention_softmax_forward(scores, dr, scores, mask, s, d);
  gemm_pairs(g.o, at, 1, products[1]);
}

// The blocked kernel's products, or the full kernel's: dqkv (=).
void products_backward(Precision p, float* dqkv, kernels::KeptIn dctx, Kept qkv,
                       kernels::AttentionSaved saved, const int32_t* mask, const AttentionShape& s,
                       const Dropout& d, const kernels::Workspace& ws) {
  const AttentionDims g(p, s);
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, n_probs = g.n_probs;
  const bool half = p != Precision::FP32, f16 = p == Precision::FP16;
  // Q, K, V as forward used them; dctx rounded to the 16-bit operands (unless its copy is made).
  const void* q = half ? static_cast<const void*>(qkv.bits) : qkv.f32;
  const void* dc = dctx.f32;
  if (half && dctx.bits) {
    dc = dctx.bits;
  } else if (half) {
    BT_CHECK(ws.attn_dctx16,
             "attention_backward: the blocked products need dctx's 16-bit "
             "scratch, which a model plans only where the fused kernel does not "
             "run (BT_CUDA_FUSED_ATTENTION changed after the model was built?)");
    round_to_16(p, ws.attn_dctx16, dctx.f32, B * T * C);
    dc = ws.attn_dctx16;
  }
  if (saved.blocked()) return blocked_backward(p, dqkv, dc, q, saved.lse, mask, s, d);
  // The dropped probabilities again (forward's are gone with its scratch).
  const void* dropped = saved.probs;
  if (half) {
    if (f16)
      BT_EACH(attention_dropped_kernel<rm::F16Bits>, n_probs,
              reinterpret_cast<rm::F16Bits*>(ws.attn_probs16),
              reinterpret_cast<const rm::F16Bits*>(saved.probs16), s, d.p, d.key, d.offset, d.at);
    else
      BT_EACH(attention_dropped_kernel<rm::Bf16Bits>, n_probs,
              reinterpret_cast<rm::Bf16Bits*>(ws.attn_probs16),
              reinterpret_cast<const rm::Bf16Bits*>(saved.probs16), s, d.p, d.key, d.offset, d.at);
    dropped = ws.attn_probs16;
  } else if (d.p > 0.0f) {
    float* dr = static_cast<float*>(scratch(kAttentionDroppedSlot, n_probs * 4));
    BT_EACH(attention_dropped_kernel<float>, n_probs, dr, static_cast<const float*>(saved.probs), s,
            d.p, d.key, d.offset, d.at);
    dropped = dr;
  }
  // dd (then ds) for every pair in a [B, NH, T, T] buffer; the 16-bit precisions' ds rounded
  // over the dropped probabilities once dV has used them.
  float* dd = static_cast<float*>(scratch(kAttentionGradSlot, n_probs * 4));
  const void* ds = half ? static_cast<const void*>(ws.attn_probs16) : dd;
  const auto products = attention_backward_products(s, g.el, q, dropped, dc, dd, ds, dqkv);
  const PairPointers at = pair_pointers(B * NH, NH, products.data(), 4);
  gemm_pairs(g.o, at, 0, products[0]);  // dV
  gemm_pairs(g.o, at, 1, products[1]);  // dd
  const int64_t rows = B * NH * T;
  auto backward_rows = [&](auto* out, const auto* probs) {
    BT_LAUNCH(softmax_backward_rows_kernel, row_blocks(rows), kRowThreads, 0, compute_stream())
    (out, dd, probs, s, 0, rows, d.p, d.key, d.offset, d.at);
  };
  if (f16)
    backward_rows(reinterpret_cast<rm::F16Bits*>(ws.attn_probs16),
                  reinterpret_cast<const rm::F16Bits*>(saved.probs16));
  else if (half)
    backward_rows(reinterpret_cast<rm::Bf16Bits*>(ws.attn_probs16),
                  reinterpret_cast<const rm::Bf16Bits*>(saved.probs16));
  else
    backward_rows(dd, static_cast<const float*>(saved.probs));
  check_launch();
  gemm_pairs(g.o, at, 2, products[2]);  // dQ
  gemm_pairs(g.o, at, 3, products[3]);  // dK
}
}  // namespace

void attention_forward(Precision p, Kept kept_ctx, kernels::AttentionSaved saved, Kept qkv,
                       const int32_t* mask, const AttentionShape& s, const Dropout& d,
                       const kernels::Workspace& ws) {
  if (saved.blocked() && fused_attention_runs(p, s)) {  // (QKV and ctx kept as they are written)
    BT_CHECK(saved.ctx16 && (!kept_ctx.bits || kept_ctx.bits == saved.ctx16),
             "attention_forward: the fused kernel writes the context's 16-bit copy where its "
             "backward reads it (AttentionSaved::ctx16: the context's kept bits, where kept)");
    return fused_attention_forward(p, {kept_ctx.f32, saved.ctx16}, saved.lse, qkv, mask, s, d);
  }
  BT_CHECK(!s.starts, "attention_forward: variable lengths need the fused kernel");
  attention_products_forward(p, kept_ctx, saved, qkv, mask, s, d, ws);
}

void attention_backward(Precision p, Kept dqkv, float* dbias, kernels::KeptIn dctx, Kept qkv,
                        kernels::AttentionSaved saved, const int32_t* mask, const AttentionShape& s,
                        const Dropout& d, const kernels::Workspace& ws) {
  BT_CHECK(dctx.f32 || (dctx.bits && p != Precision::FP32),
           "attention_backward: no dctx (neither its fp32 values nor a 16-bit copy)");
  if (saved.blocked() && fused_attention_runs(p, s))  // (dctx's fp32 values rounded as read)
    return fused_attention_backward(p, dqkv, dbias, dctx, qkv.bits, saved.ctx16, saved.lse, mask, s,
                                    d);
  BT_CHECK(!s.starts, "attention_backward: variable lengths need the fused kernel");
  BT_CHECK(dqkv.f32,
           "attention_backward: the attention's products write dQKV's fp32 values (its "
           "16-bit copy alone is the fused kernel's)");
  products_backward(p, dqkv.f32, dctx, qkv, saved, mask, s, d, ws);
  // (the 16-bit copy and the bias gradient in one pass over dqkv)
  rounded_column_sums(p, dbias, dqkv.f32, p != Precision::FP32 ? dqkv.bits : nullptr, s.B * s.T,
                      3 * s.C);
}

}  // namespace bertrain::cuda
