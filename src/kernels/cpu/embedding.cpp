#include "kernels/cpu/embedding.h"

#include <algorithm>

namespace bertrain::kernels {

void embedding_forward(float* out, const int32_t* ids, const int32_t* segment, const float* word,
                       const float* position, const float* token_type, int64_t B, int64_t T,
                       int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt)
    embedding_sum_row(out + bt * C, ids[bt], segment[bt], bt % T, word, position, token_type, C);
}

void embedding_backward(float* dword, float* dposition, float* dtoken_type, const float* dout,
                        const int32_t* ids, const int32_t* segment, const int32_t* positions,
                        int64_t B, int64_t T, int64_t C) {
  constexpr int64_t kBlock = 64;
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
    int64_t c1 = std::min(C, c0 + kBlock);
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const float* g = dout + bt * C;
      float* w = dword + static_cast<int64_t>(ids[bt]) * C;
      float* p = dposition + static_cast<int64_t>(positions ? positions[bt] : bt % T) * C;
      float* s = dtoken_type + static_cast<int64_t>(segment[bt]) * C;
      for (int64_t c = c0; c < c1; ++c) {
        w[c] += g[c];
        p[c] += g[c];
        s[c] += g[c];
      }
    }
  }
}

}  // namespace bertrain::kernels
