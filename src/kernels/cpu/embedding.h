// BERT embeddings: out[b,t,:] = word[ids[b,t]] + position[t] + token_type[segment[b,t]].
// Ids are validated by the caller (model/) so that a bad id is reported with its tensor name.
// Backward scatters (+=) into the three tables; threads split the channels, so no atomics.
#pragma once

#include <cstdint>

namespace bertrain::kernels {

void embedding_forward(float* out, const int32_t* ids, const int32_t* segment, const float* word,
                       const float* position, const float* token_type, int64_t B, int64_t T,
                       int64_t C);

// One token's row: out[c] = word[id, c] + position[t, c] + token_type[segment, c] (the forward
// above and the fused embedding + LayerNorm kernel share it).
inline void embedding_sum_row(float* out, int32_t id, int32_t segment, int64_t t, const float* word,
                              const float* position, const float* token_type, int64_t C) {
  const float* w = word + static_cast<int64_t>(id) * C;
  const float* p = position + t * C;
  const float* s = token_type + static_cast<int64_t>(segment) * C;
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) out[c] = w[c] + p[c] + s[c];
}

// Row i's position is positions[i], or i % T where positions is null.
void embedding_backward(float* dword, float* dposition, float* dtoken_type, const float* dout,
                        const int32_t* ids, const int32_t* segment, const int32_t* positions,
                        int64_t B, int64_t T, int64_t C);

}  // namespace bertrain::kernels
