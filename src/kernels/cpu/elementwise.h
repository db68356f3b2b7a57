// Elementwise kernels: GELU (erf form, as BERT; tanh form for "gelu_new"), ReLU, tanh,
// residual add, dropout. Backward writes dinp (=); dinp may alias dout.
// Dropout is keyed: element i is kept iff rng_uniform(key, offset + i) >= p, so backward (and a
// resumed run) regenerates the same mask instead of storing it.
#pragma once

#include <cstdint>

#include "kernels/types.h"

namespace bertrain::kernels {

void activation_forward(Activation a, float* out, const float* inp, int64_t n);
// The activation rounded to bf16 (out16: raw bits) in the same pass: the next matmul's operand.
// inp16 (optional): the input rounded to bf16 as well, what activation_backward_bf16 reads.
void activation_forward_bf16(Activation a, uint16_t* out16, const float* inp, int64_t n,
                             uint16_t* inp16 = nullptr);
// dinp = dout * act'(inp)
void activation_backward(Activation a, float* dinp, const float* inp, const float* dout, int64_t n);
// The same at the input's bf16 rounding (bf16 training saves the pre-activation in bf16, as
// PyTorch's autocast does: half the memory; the derivative moves by about one bf16 rounding).
void activation_backward_bf16(Activation a, float* dinp, const uint16_t* inp16, const float* dout,
                              int64_t n);
// fp16 storage, one pass: inp rounded to fp16 (bits in inp16), the activation of the rounded
// values rounded to fp16 (bits in out16, the value in out; out may alias inp). Equals
// round_to_f16, activation_forward, round_to_f16 bit for bit.
void activation_forward_f16(Activation a, float* out, uint16_t* out16, const float* inp,
                            uint16_t* inp16, int64_t n);
// The backward at the fp16 input inp16 (activation_backward at the widened values).
void activation_backward_f16(Activation a, float* dinp, const uint16_t* inp16, const float* dout,
                             int64_t n);

// fp16 storage (the fp16 model): out = x rounded to fp16, widened back (out may alias x);
// bits16 (optional) receives the fp16 bits, what the model keeps for backward.
void round_to_f16(float* out, const float* x, int64_t n, uint16_t* bits16 = nullptr);
// out = the fp16 values bits16 holds, widened to fp32.
void widen_f16(float* out, const uint16_t* bits16, int64_t n);

void tanh_forward(float* out, const float* inp, int64_t n);
// dinp = dout * (1 - out^2), from the forward output.
void tanh_backward(float* dinp, const float* out, const float* dout, int64_t n);

// out = a + b (out may alias a or b).
void add(float* out, const float* a, const float* b, int64_t n);
// out += a
void add_inplace(float* out, const float* a, int64_t n);

// x = x * keep / (1 - p), in place. p == 0 is the identity.
void dropout_forward(float* x, int64_t n, float p, uint64_t key, uint64_t offset);
// dx = dy * keep / (1 - p) with the same mask (dx may alias dy).
void dropout_backward(float* dx, const float* dy, int64_t n, float p, uint64_t key,
                      uint64_t offset);
inline bool dropout_keep(float p, uint64_t key, uint64_t index);

}  // namespace bertrain::kernels

#include "core/rng.h"

inline bool bertrain::kernels::dropout_keep(float p, uint64_t key, uint64_t index) {
  return rng_uniform(key, index) >= p;
}
