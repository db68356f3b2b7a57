// Softmax cross-entropy over V classes for N rows, fused with its gradient.
// loss[i] = logsumexp(logits[i]) - logits[i, target[i]]. Rows with weight 0 contribute nothing.
// If dlogits is non-null: dlogits[i] = (softmax(logits[i]) - onehot(target[i])) * weight[i] *
// dscale (dlogits may alias logits). weights may be null (all ones). Returns sum_i weight[i] *
// loss[i]; correct[i] (optional) = argmax == target.
#pragma once

#include <cstdint>

namespace bertrain::kernels {

double cross_entropy_forward_backward(float* dlogits, float* losses, int32_t* correct,
                                      const float* logits, const int32_t* targets,
                                      const float* weights, int64_t N, int64_t V, float dscale);

}  // namespace bertrain::kernels
