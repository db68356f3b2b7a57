#include "comm/communicator.h"

namespace bertrain::comm {

// One thread (the reducer's communication thread calls it while backward's team computes).
void Communicator::scale(float* data, int64_t n, float s) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) data[i] *= s;
}

}  // namespace bertrain::comm
