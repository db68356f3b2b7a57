// LayerNorm over the last dimension C of N rows: out = (x - mean) * rstd * gamma + beta.
// Forward saves mean and rstd [N] for backward. Backward writes dinp (= or += with accumulate)
// and accumulates dgamma, dbeta (+=).
#pragma once

#include <cstdint>

#include "kernels/types.h"

namespace bertrain::kernels {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps);

// Fused residual block: x = dropout(x) + residual in place (x: the projection's output; dropout
// element i*C + c keyed at d.offset + i*C + c, as dropout_forward, or at d.offset + d.rows[i]*C
// + c where d.rows is given: a packed row keyed as its padded row), then out = LayerNorm(x), in
// one pass per row.
void residual_layernorm_forward(float* out, float* mean, float* rstd, float* x,
                                const float* residual, const float* gamma, const float* beta,
                                int64_t N, int64_t C, float eps, const Dropout& d);

// BERT's embedding block in one pass per token: sum = word[id] + position[t] +
// token_type[segment] (saved for backward), out = dropout(LayerNorm(sum)), dropout keyed as
// dropout_forward on out. Ids are validated by the caller. Row i's position is positions[i], or
// i % T where positions is null.
void embedding_layernorm_forward(float* out, float* sum, float* mean, float* rstd,
                                 const int32_t* ids, const int32_t* segment,
                                 const int32_t* positions, const float* word, const float* position,
                                 const float* token_type, const float* gamma, const float* beta,
                                 int64_t B, int64_t T, int64_t C, float eps, const Dropout& d);

void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                        const float* inp, const float* gamma, const float* mean, const float* rstd,
                        int64_t N, int64_t C, bool accumulate_dinp = false);

// The residual block's backward in one pass: LayerNorm backward into dinp (= or +=, the
// gradient of x = dropout(y) + residual, hence also the residual's), and ddropped =
// dropout_backward(dinp) (the gradient of y) with the forward's key, offset and rows.
void layernorm_dropout_backward(float* dinp, float* ddropped, float* dgamma, float* dbeta,
                                const float* dout, const float* inp, const float* gamma,
                                const float* mean, const float* rstd, int64_t N, int64_t C,
                                bool accumulate_dinp, const Dropout& d);

}  // namespace bertrain::kernels
