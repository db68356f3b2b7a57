// Elementwise kernels: GELU (erf form, as BERT; tanh form for "gelu_new"), ReLU, tanh,
// residual add, dropout. Backward writes dinp (=); dinp may alias dout.
// Dropout is keyed: element i is kept iff rng_uniform(key, offset + i) >= p, so backward (and a
// resumed run) regenerates the same mask instead of storing it.
#pragma once

#include <cstdint>

#include "kernels/types.h"

namespace bertrain::kernels {

void activation_forward(Activation a, float* out, const float* inp, int64_t n);
// dinp = dout * act'(inp)
void activation_backward(Activation a, float* dinp, const float* inp, const float* dout, int64_t n);

// Backend::activation_forward / activation_backward (kernels/backend.h) in precision p, the one
// place the CPU's activations dispatch on it:
//   FP32  out.f32 = act(in.f32).
//   BF16  out.bits = act(in.f32) rounded to bf16 in the same pass (the next matmul's operand);
//         in.bits (optional) gets the input's bf16 rounding, what backward reads (bf16 training
//         saves the pre-activation in bf16, as PyTorch's autocast does: half the memory; the
//         derivative moves by about one bf16 rounding).
//   FP16  one pass: in.f32 rounded to fp16 (bits in in.bits), the activation of the rounded
//         values rounded to fp16 (bits in out.bits, the value in out.f32; out may alias in);
//         equals round_to_f16, activation_forward, round_to_f16 bit for bit.
// Backward: dinp = dout * act'(x) at the kept input: in.f32 in FP32, the 16-bit in.bits
// widened otherwise.
void activation_forward(Precision p, Activation a, Kept out, Kept in, int64_t n);
void activation_backward(Precision p, Activation a, float* dinp, Kept in, const float* dout,
                         int64_t n);
// Backend::keep: BF16 writes x's bf16 copy to x.bits; FP16 rounds x.f32 in place and writes
// the fp16 bits; FP32 does nothing. Backend::copy_weights: BF16's bf16 copy of the master.
void keep(Precision p, Kept x, int64_t n);
void copy_weights(Precision p, const float* master, uint16_t* copy, int64_t n);

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

// x = x * keep / (1 - d.p), in place, element i keyed at d.offset + i (d.rows is for the row
// kernels: an error here). d.p == 0 is the identity.
void dropout_forward(float* x, int64_t n, const Dropout& d);
// dx = dy * keep / (1 - d.p) with the same mask (dx may alias dy).
void dropout_backward(float* dx, const float* dy, int64_t n, const Dropout& d);
// The same over N rows of C values with d.rows (may be null) mapping row r to the row it draws
// as: element (r, c) keyed at d.offset + d.rows[r] C + c (Backend::dropout_forward's rows).
void dropout_forward(float* x, int64_t N, int64_t C, const Dropout& d);
void dropout_backward(float* dx, const float* dy, int64_t N, int64_t C, const Dropout& d);
inline bool dropout_keep(float p, uint64_t key, uint64_t index);

}  // namespace bertrain::kernels

#include "core/rng.h"

inline bool bertrain::kernels::dropout_keep(float p, uint64_t key, uint64_t index) {
  return rng_uniform(key, index) >= p;
}
