// Types shared by the kernel interface (kernels/backend.h) and every backend's kernels.
#pragma once

#include <cstdint>

namespace bertrain::kernels {

// What the model keeps and its matmuls read (kernels/backend.h): fp32; bf16 matmul operands
// with fp32 master weights and accumulation; fp16 storage of the kept activations.
enum class Precision : uint8_t { FP32, BF16, FP16 };

enum class Activation { GeluErf, GeluTanh, Relu };

// Attention dimensions: batch, tokens, hidden, heads.
struct AttentionShape {
  int64_t B, T, C, NH;
};

// torch.optim.AdamW with g * gscale: p = p * decay - step_size * m / (sqrt(v) / sqrt_bc2 + eps)
// where decay = 1 - lr * wd, step_size = lr / bc1.
struct AdamwStep {
  float gscale, beta1, beta2, step_size, sqrt_bc2, eps, decay;
};

// LAMB with g * gscale: u = m / bc1 / (sqrt(v / bc2) + eps) + wd p (ibc = 1 / bc), then
// p -= lr * trust * u with trust = ||p|| / ||u|| when wd != 0 and both norms are positive.
struct LambStep {
  float gscale, beta1, beta2, ibc1, ibc2, eps, wd, lr;
};

}  // namespace bertrain::kernels
