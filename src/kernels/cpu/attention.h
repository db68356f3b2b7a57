// Multi-head self-attention core (the part between the QKV and output projections).
// qkv[B,T,3C]: Q in columns [0,C), K in [C,2C), V in [2C,3C); head h owns columns h*HD..h*HD+HD.
// scores = Q K^T / sqrt(HD) + (mask ? 0 : -10000)  (BERT's additive mask from input_mask)
// probs = softmax(scores) saved [B,NH,T,T] before dropout; ctx[B,T,C] = dropout(probs) V.
// Dropout element (b,h,i,j) has index ((b*NH+h)*T+i)*T+j + offset; backward regenerates it.
#pragma once

#include <cstdint>

namespace bertrain::kernels {

struct AttentionShape {
  int64_t B, T, C, NH;
};

// work: scratch of B*NH*T*T floats (the dropped probabilities; unused when dropout_p == 0).
// Batched oneDNN matmuls over the heads + one fused mask/softmax/dropout pass per row.
void attention_forward(float* ctx, float* probs, float* work, const float* qkv, const int32_t* mask,
                       const AttentionShape& s, float dropout_p, uint64_t key, uint64_t offset);

// dqkv[B,T,3C] is overwritten; work as in forward.
void attention_backward(float* dqkv, float* work, const float* dctx, const float* qkv,
                        const float* probs, const AttentionShape& s, float dropout_p, uint64_t key,
                        uint64_t offset);

// Plain loops, one (sequence, head) per thread: the oracle the fast kernels are tested against.
void attention_forward_reference(float* ctx, float* probs, const float* qkv, const int32_t* mask,
                                 const AttentionShape& s, float dropout_p, uint64_t key,
                                 uint64_t offset);
void attention_backward_reference(float* dqkv, const float* dctx, const float* qkv,
                                  const float* probs, const AttentionShape& s, float dropout_p,
                                  uint64_t key, uint64_t offset);

}  // namespace bertrain::kernels
