// Multi-head self-attention core (the part between the QKV and output projections).
// qkv[B,T,3C]: Q in columns [0,C), K in [C,2C), V in [2C,3C); head h owns columns h*HD..h*HD+HD.
// scores = Q K^T / sqrt(HD) + (mask ? 0 : -10000)  (BERT's additive mask from input_mask)
// probs = softmax(scores) saved [B,NH,T,T] before dropout; ctx[B,T,C] = dropout(probs) V.
// Dropout element (b,h,i,j) has index ((b*NH+h)*T+i)*T+j + offset; backward regenerates it.
#pragma once

#include <cstdint>

#include "kernels/types.h"

namespace bertrain::kernels {

// bf16 operands for the four matmuls (fp32 accumulation): QKV [B,T,3C] (written by the
// forward), scratch for the dropped probabilities / dS [B,NH,T,T] and dctx [B,T,C], as raw
// bf16 bits.
// saved (optional): the softmax output kept for backward in bf16 [B,NH,T,T] instead of the fp32
// probs (which may then be null; the scores pass through work): half that memory, and the
// dropped probabilities are made from the rounded values in forward and backward alike.
struct AttentionBf16 {
  uint16_t *qkv, *probs, *dctx;
  uint16_t* saved = nullptr;
};

// work: scratch of B*NH*T*T floats (fp32: the dropped probabilities; unused when dropout_p == 0
// and in bf16). Batched oneDNN matmuls over the heads + one fused mask/softmax/dropout pass per
// row. bf16 (optional): matmuls on bf16 operands; scores and row sums stay fp32, probs too
// unless bf16->saved is given. saved_f16 (optional, fp32 operands): the softmax output kept for
// backward in fp16 [B,NH,T,T] (raw bits) instead of probs (which may then be null), the dropped
// probabilities made from the rounded values as with bf16->saved (fp16 training).
void attention_forward(float* ctx, float* probs, float* work, const float* qkv, const int32_t* mask,
                       const AttentionShape& s, float dropout_p, uint64_t key, uint64_t offset,
                       const AttentionBf16* bf16 = nullptr, uint16_t* saved_f16 = nullptr);

// dqkv[B,T,3C] is overwritten; work and bf16 as in forward. With bf16, qkv may be null: then
// bf16->qkv still holds what the forward rounded (the model keeps it per layer instead of the
// fp32 QKV). probs_f16: forward's saved_f16 (then probs is not read).
void attention_backward(float* dqkv, float* work, const float* dctx, const float* qkv,
                        const float* probs, const AttentionShape& s, float dropout_p, uint64_t key,
                        uint64_t offset, const AttentionBf16* bf16 = nullptr,
                        const uint16_t* probs_f16 = nullptr);

// Blocked (flash-style) variant (attention_blocked.cpp): one (sequence, head) per thread, query
// rows in blocks of 128; nothing of size [B,NH,T,T] exists: only the row log-sum-exp lse
// [B,NH,T] is kept, and backward recomputes Q K^T from it (one more product). The same dropout
// mask as the kernels above; bf16 as above (no work buffer, no bf16->probs; qkv may be null in
// backward when bf16->qkv holds the forward's rounding). Same speed as the full kernel at T = 512
// on our machines (bench/bench_attention_blocked.cpp), a fraction of its memory: the model takes
// it for long sequences.
void attention_blocked_forward(float* ctx, float* lse, const float* qkv, const int32_t* mask,
                               const AttentionShape& s, float dropout_p, uint64_t key,
                               uint64_t offset, const AttentionBf16* bf16 = nullptr);
// dqkv[B,T,3C] is overwritten; mask as in forward.
void attention_blocked_backward(float* dqkv, const float* dctx, const float* qkv, const float* lse,
                                const int32_t* mask, const AttentionShape& s, float dropout_p,
                                uint64_t key, uint64_t offset, const AttentionBf16* bf16 = nullptr);

// Backend::attention_forward / attention_backward (kernels/backend.h) in precision p, the one
// place the CPU's attention dispatches on it and on the kernel (the blocked one where `saved`
// keeps only the row log-sum-exp). FP32: the kernels above on fp32 operands. BF16: their bf16
// operands (qkv.bits: QKV rounded by forward, read by backward; ws's probs and dctx scratch),
// the probabilities kept in bf16 (saved.probs16). FP16: QKV rounded to fp16 in place first (its
// bits in qkv.bits, widened into ws.wide for backward), the probabilities kept in fp16, fp32
// products.
void attention_forward(Precision p, float* ctx, AttentionSaved saved, Kept qkv, const int32_t* mask,
                       const AttentionShape& s, const Dropout& d, const Workspace& ws);
void attention_backward(Precision p, float* dqkv, const float* dctx, Kept qkv, AttentionSaved saved,
                        const int32_t* mask, const AttentionShape& s, const Dropout& d,
                        const Workspace& ws);

// The attention kernels' kernel scratch (scratch.h) for this shape: oneDNN's scratchpad for
// their products (from the products themselves, matmul.h's GemmScratchQuery) — made by the
// caller (full kernel) or on every thread (blocked) — and per thread the blocked kernel's
// row-block buffers and the mask row.
struct AttentionScratch {
  int64_t caller_gemm = 0, thread_gemm = 0, rows = 0, mask_row = 0;
};
AttentionScratch attention_scratch(const AttentionShape& s, bool bf16, bool blocked);

// attention_scratch's part for the blocked kernel.
AttentionScratch attention_blocked_scratch(const AttentionShape& s, bool bf16);

// Plain loops, one (sequence, head) per thread: the oracle the fast kernels are tested against.
void attention_forward_reference(float* ctx, float* probs, const float* qkv, const int32_t* mask,
                                 const AttentionShape& s, float dropout_p, uint64_t key,
                                 uint64_t offset);
void attention_backward_reference(float* dqkv, const float* dctx, const float* qkv,
                                  const float* probs, const AttentionShape& s, float dropout_p,
                                  uint64_t key, uint64_t offset);

}  // namespace bertrain::kernels
