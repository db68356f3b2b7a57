// LayerNorm over the last dimension C of N rows: out = (x - mean) * rstd * gamma + beta.
// Forward saves mean and rstd [N] for backward. Backward writes dinp (= or += with accumulate)
// and accumulates dgamma, dbeta (+=).
#pragma once

#include <cstdint>

namespace bertrain::kernels {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps);

void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                        const float* inp, const float* gamma, const float* mean, const float* rstd,
                        int64_t N, int64_t C, bool accumulate_dinp = false);

}  // namespace bertrain::kernels
