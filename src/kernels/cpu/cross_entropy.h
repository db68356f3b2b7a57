// Softmax cross-entropy over c.V classes for N rows of c.stride values (types.h Classes), fused
// with its gradient.
// loss[i] = logsumexp(logits[i]) - logits[i, target[i]]. Rows with weight 0 contribute nothing.
// If dlogits is non-null: dlogits[i] = (softmax(logits[i]) - onehot(target[i])) * weight[i] *
// dscale (dlogits may alias logits; its columns past c.V, the padding, written 0). weights may
// be null (all ones). Returns sum_i weight[i] *
// loss[i]; correct[i] (optional) = argmax == target.
#pragma once

#include <cstdint>

#include "kernels/types.h"

namespace bertrain::kernels {

double cross_entropy_forward_backward(float* dlogits, float* losses, int32_t* correct,
                                      const float* logits, const int32_t* targets,
                                      const float* weights, int64_t N, Classes c, float dscale);

}  // namespace bertrain::kernels
