// BERT embeddings: out[b,t,:] = word[ids[b,t]] + position[t] + token_type[segment[b,t]].
// Ids are validated by the caller (model/) so that a bad id is reported with its tensor name.
// Backward scatters (+=) into the three tables; threads split the channels, so no atomics.
#pragma once

#include <cstdint>

namespace bertrain::kernels {

void embedding_forward(float* out, const int32_t* ids, const int32_t* segment, const float* word,
                       const float* position, const float* token_type, int64_t B, int64_t T,
                       int64_t C);

void embedding_backward(float* dword, float* dposition, float* dtoken_type, const float* dout,
                        const int32_t* ids, const int32_t* segment, int64_t B, int64_t T,
                        int64_t C);

}  // namespace bertrain::kernels
