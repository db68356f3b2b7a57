// The emulated device's warp matrix operations (<mma.h>, nvcuda::wmma; cuda_emu/README.md): the
// m16n16k16 shape with half or bf16 operands and fp32 accumulators. A fragment is the warp's and
// its element layout unspecified; here every lane holds the whole tile. Each operation is a warp
// collective (every lane of the warp must reach it, as on a GPU: __syncwarp checks), then each
// lane does the whole operation on its copy. mma_sync adds the products along k in order to the
// accumulator in fp32, without contraction (a tensor core's order is its own). Pointers and leading
// dimensions are checked as the hardware requires: 256-bit aligned, ldm a multiple of 8 (16-bit) or
// 4 (fp32) elements.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_emu/counts.h"
#include "cuda_emu/kernel.h"
#include "cuda_fp16.h"

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
inline float widen(float x) {
  return x;
}
inline float widen(__half x) {
  return __half2float(x);
}
inline float widen(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <class T>
void check(const T* p, unsigned ldm) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0)
    cuda_emu::kernel_fault("a wmma load or store at a pointer not 256-bit aligned");
  if (ldm % (16 / sizeof(T)) != 0)
    cuda_emu::kernel_fault("a wmma load or store whose ldm is not a multiple of 16 bytes");
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulated wmma has the m16n16k16 shape only");
  static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
  static constexpr int num_elements = rows * cols;
  T x[num_elements];
  T& at(int r, int c) { return x[r * cols + c]; }
  const T& at(int r, int c) const { return x[r * cols + c]; }
};

template <class Use, int M, int N, int K, class T, class Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T v) {
  __syncwarp();
  for (T& e : f.x) e = v;
}

// Operands: element (r, c) at p[r * ldm + c] (row_major) or p[c * ldm + r] (col_major).
template <class Use, int M, int N, int K, class T, class Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator's load names its layout");
  __syncwarp();
  detail::check(p, ldm);
  using F = fragment<Use, M, N, K, T, Layout>;
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c)
      f.at(r, c) = std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r];
}
template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm,
                      layout_t layout) {
  __syncwarp();
  detail::check(p, ldm);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      f.at(r, c) = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}
template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout) {
  __syncwarp();
  detail::check(p, ldm);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.at(r, c);
}

// d = a b + c (d may be c).
template <int M, int N, int K, class T, class LA, class LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  __syncwarp();
  // (one operation of the warp's tensor cores: counted once, by its first lane)
  const cuda_emu::ThreadIndex& t = cuda_emu::current();
  if ((t.thread.x + t.block_dim.x * (t.thread.y + t.block_dim.y * t.thread.z)) % 32 == 0)
    cuda_emu::count_products(2.0 * M * N * K);
  // (the operands widened once, not once a product: the same values, a 16th of the conversions)
  float wa[M][K], wb[K][N];
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) wa[m][k] = detail::widen(a.at(m, k));
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < N; ++n) wb[k][n] = detail::widen(b.at(k, n));
  fragment<accumulator, M, N, K, float> out;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc = c.at(m, n);
      for (int k = 0; k < K; ++k) acc = acc + wa[m][k] * wb[k][n];
      out.at(m, n) = acc;
    }
  d = out;
}

}  // namespace nvcuda::wmma
