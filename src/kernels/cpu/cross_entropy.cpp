#include "kernels/cpu/cross_entropy.h"

#include <cmath>

namespace bertrain::kernels {

double cross_entropy_forward_backward(float* dlogits, float* losses, int32_t* correct,
                                      const float* logits, const int32_t* targets,
                                      const float* weights, int64_t N, int64_t V, float dscale) {
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = logits + i * V;
    const float w = weights ? weights[i] : 1.0f;
    float mx = -INFINITY;
    int64_t arg = 0;
    for (int64_t v = 0; v < V; ++v)
      if (x[v] > mx) {
        mx = x[v];
        arg = v;
      }
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(x[v] - mx));
    const int32_t y = targets[i];
    const double loss = std::log(sum) + mx - x[y];
    if (losses) losses[i] = static_cast<float>(loss);
    if (correct) correct[i] = arg == y;
    total += w * loss;
    if (dlogits) {
      float* d = dlogits + i * V;
      const float inv = static_cast<float>(1.0 / sum);
      const float g = w * dscale;
      for (int64_t v = 0; v < V; ++v) d[v] = std::exp(x[v] - mx) * inv * g;
      d[y] -= g;
    }
  }
  return total;
}

}  // namespace bertrain::kernels
