#include "kernels/cpu/layernorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <omp.h>

namespace bertrain::kernels {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* gamma,
                       const float* beta, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    // Two passes in float with a double sum: stable for the magnitudes BERT sees.
    double s = 0.0;
    for (int64_t c = 0; c < C; ++c) s += x[c];
    float m = static_cast<float>(s / C);
    double v = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      float d = x[c] - m;
      v += static_cast<double>(d) * d;
    }
    float r = static_cast<float>(1.0 / std::sqrt(v / C + eps));
    float* o = out + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * r * gamma[c] + beta[c];
    mean[i] = m;
    rstd[i] = r;
  }
}

void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                        const float* inp, const float* gamma, const float* mean, const float* rstd,
                        int64_t N, int64_t C, bool accumulate_dinp) {
  // dx = rstd * (g*dy - mean(g*dy) - xhat * mean(g*dy*xhat)), xhat = (x - mean) * rstd
  int nthreads = omp_get_max_threads();
  std::vector<float> partial(static_cast<size_t>(nthreads) * 2 * C, 0.0f);
#pragma omp parallel
  {
    float* pg = partial.data() + static_cast<size_t>(omp_get_thread_num()) * 2 * C;
    float* pb = pg + C;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* x = inp + i * C;
      const float* dy = dout + i * C;
      float m = mean[i], r = rstd[i];
      float sum_gdy = 0.0f, sum_gdy_xhat = 0.0f;
      for (int64_t c = 0; c < C; ++c) {
        float xhat = (x[c] - m) * r;
        float gdy = gamma[c] * dy[c];
        sum_gdy += gdy;
        sum_gdy_xhat += gdy * xhat;
        pg[c] += dy[c] * xhat;
        pb[c] += dy[c];
      }
      float a = sum_gdy / C, b = sum_gdy_xhat / C;
      float* dx = dinp + i * C;
      for (int64_t c = 0; c < C; ++c) {
        float xhat = (x[c] - m) * r;
        float g = r * (gamma[c] * dy[c] - a - xhat * b);
        dx[c] = accumulate_dinp ? dx[c] + g : g;
      }
    }
  }
  for (int t = 0; t < nthreads; ++t) {
    const float* pg = partial.data() + static_cast<size_t>(t) * 2 * C;
    for (int64_t c = 0; c < C; ++c) {
      dgamma[c] += pg[c];
      dbeta[c] += pg[C + c];
    }
  }
}

}  // namespace bertrain::kernels
