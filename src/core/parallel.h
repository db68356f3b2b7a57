// Splits [0, n) into one contiguous range per OpenMP thread, each a multiple of 16 elements
// (one AVX-512 vector of floats) except the last; small n runs on the calling thread alone.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace bertrain {

template <typename F>
void parallel_chunks(int64_t n, F&& body, int64_t serial_below = 65536) {
#pragma omp parallel if (n >= serial_below)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = (n / nt + 15) / 16 * 16;
    const int64_t b = std::min(n, t * per), e = std::min(n, b + per);
    if (b < e) body(b, e);
  }
}

}  // namespace bertrain
