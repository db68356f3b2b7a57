// The CUDA backend's cuBLASLt and cuBLAS calls (kernels/cuda/blas_calls.h) on the host: each
// column-major call run through a reference GEMM written from BLAS's definition (column-major,
// op(A) m x k, leading dimensions) must compute the row-major product it stands for, and every
// leading dimension must hold the stored matrix it describes (cuBLAS refuses one that does
// not). The linear layers' three products, and every attention product over (sequence, head)
// pairs: the full kernel's six and the blocked kernel's seven, for a first and a later block.
// Tolerance: the same sums in another order, rtol 1e-5 of the tensor max.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gpu_attention_16.h"
#include "kernels/cuda/blas_calls.h"
#include "test_util.h"

namespace bertrain::cuda {
namespace {

using test::all_close;
using test::random_vector;

// C (m x n) = alpha op(A) op(B) + beta C, column-major, from BLAS's definition.
void column_major_gemm(const ColumnMajorCall& g, float alpha, const float* A, const float* B,
                       float beta, float* C) {
  for (int64_t j = 0; j < g.n; ++j)
    for (int64_t i = 0; i < g.m; ++i) {
      double s = 0;
      for (int64_t l = 0; l < g.k; ++l) {
        const float a = g.trans_a ? A[l + i * g.lda] : A[i + l * g.lda];
        const float b = g.trans_b ? B[j + l * g.ldb] : B[l + j * g.ldb];
        s += static_cast<double>(a) * b;
      }
      float& c = C[i + j * g.ldc];
      c = alpha * static_cast<float>(s) + (beta != 0.0f ? beta * c : 0.0f);
    }
}

TEST(BlasCalls, LinearLayersComputeTheRowMajorProducts) {
  const int64_t M = 7, N = 5, K = 3;  // all different: a swapped size or ld shows
  const auto in = random_vector(M * K, 1), w = random_vector(N * K, 2),
             dout = random_vector(M * N, 3), bias = random_vector(N, 4),
             dw0 = random_vector(N * K, 5);
  std::vector<float> out_ref(M * N), dinp_ref(M * K), dw_ref = dw0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      double s = bias[n];
      for (int64_t k = 0; k < K; ++k) s += double(in[i * K + k]) * w[n * K + k];
      out_ref[i * N + n] = static_cast<float>(s);
    }
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += double(dout[i * N + n]) * w[n * K + k];
      dinp_ref[i * K + k] = static_cast<float>(s);
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t i = 0; i < M; ++i) s += double(dout[i * N + n]) * in[i * K + k];
      dw_ref[n * K + k] += static_cast<float>(s);
    }
  const ColumnMajorCall f = linear_forward_call(M, N, K), di = linear_dinp_call(M, N, K),
                        dw_call = linear_dw_call(M, N, K);
  for (const ColumnMajorCall& g : {f, di, dw_call}) EXPECT_TRUE(g.valid());
  // Each stored matrix within its buffer (the last column's start plus its rows).
  auto fits = [](int64_t rows, int64_t cols, int64_t ld, size_t n) {
    return (cols - 1) * ld + rows <= static_cast<int64_t>(n);
  };
  auto within = [&](const ColumnMajorCall& g, size_t a, size_t b, size_t c) {
    return fits(g.a_rows(), g.a_cols(), g.lda, a) && fits(g.b_rows(), g.b_cols(), g.ldb, b) &&
           fits(g.m, g.n, g.ldc, c);
  };
  ASSERT_TRUE(within(f, w.size(), in.size(), out_ref.size()));
  ASSERT_TRUE(within(di, w.size(), dout.size(), dinp_ref.size()));
  ASSERT_TRUE(within(dw_call, in.size(), dout.size(), dw_ref.size()));
  // cuBLASLt's bias epilogue adds bias[i] to row i of the column-major output: one per feature.
  ASSERT_EQ(f.m, N);
  std::vector<float> out(M * N), dinp(M * K), dw = dw0;
  column_major_gemm(f, 1.0f, w.data(), in.data(), 0.0f, out.data());
  for (int64_t j = 0; j < f.n; ++j)
    for (int64_t i = 0; i < f.m; ++i) out[i + j * f.ldc] += bias[i];
  column_major_gemm(di, 1.0f, w.data(), dout.data(), 0.0f, dinp.data());
  column_major_gemm(dw_call, 1.0f, in.data(), dout.data(), 1.0f, dw.data());
  EXPECT_TRUE(all_close("out", out.data(), out_ref.data(), out.size(), 1e-5, 1e-6));
  EXPECT_TRUE(all_close("dinp", dinp.data(), dinp_ref.data(), dinp.size(), 1e-5, 1e-6));
  EXPECT_TRUE(all_close("dw", dw.data(), dw_ref.data(), dw.size(), 1e-5, 1e-6));
}

// Every attention product: its cuBLAS call over every pair (A = the product's b, B = its a)
// against the row-major product (test::run_pairs, the reference the attention tests use).
TEST(BlasCalls, AttentionProductsComputeTheRowMajorProducts) {
  kernels::AttentionShape s{2, 150, 32, 2};
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, pairs = B * NH, n_p = pairs * T * T,
                nb = block_values(s);
  // Every buffer a product reads or writes, filled at random.
  std::vector<std::vector<float>> buffers = {random_vector(B * T * 3 * C, 1),
                                             random_vector(B * T * 3 * C, 2),
                                             random_vector(B * T * C, 3),
                                             random_vector(B * T * C, 4),
                                             random_vector(n_p, 5),
                                             random_vector(n_p, 6),
                                             random_vector(n_p, 7),
                                             random_vector(nb, 8),
                                             random_vector(nb, 9),
                                             random_vector(nb, 10),
                                             random_vector(nb, 11)};
  float *qkv = buffers[0].data(), *dqkv = buffers[1].data(), *ctx = buffers[2].data(),
        *dctx = buffers[3].data(), *probs = buffers[4].data(), *dropped = buffers[5].data(),
        *dd = buffers[6].data();
  const BlockBuffers blk{buffers[7].data(), buffers[8].data(), buffers[9].data(),
                         buffers[10].data()};
  std::vector<std::pair<std::string, PairProduct>> products;
  auto add = [&](const std::string& what, const auto& list) {
    for (size_t i = 0; i < list.size(); ++i)
      products.emplace_back(what + std::to_string(i), list[i]);
  };
  add("full forward ", attention_forward_products(s, 4, qkv, probs, dropped, ctx));
  add("full backward ", attention_backward_products(s, 4, qkv, dropped, dctx, dd, probs, dqkv));
  for (int64_t i0 : {0, 128}) {
    const int64_t n = i0 == 0 ? 128 : 22;
    add("blocked forward at " + std::to_string(i0) + " ",
        blocked_forward_products(s, 4, i0, n, qkv, blk, ctx));
    add("blocked backward at " + std::to_string(i0) + " ",
        blocked_backward_products(s, 4, i0, n, qkv, dctx, blk, dqkv));
  }
  ASSERT_EQ(products.size(), 2u + 4u + 2 * (2u + 5u));
  for (const auto& [what, p] : products) {
    SCOPED_TRACE(what);
    const ColumnMajorCall g = pair_call(p);
    EXPECT_TRUE(g.valid()) << g.m << "x" << g.n << "x" << g.k << " lda " << g.lda << " ldb "
                           << g.ldb << " ldc " << g.ldc;
    // (restored in place: the products' pointers are into these vectors' storage)
    auto restore = [&](const std::vector<std::vector<float>>& from) {
      for (size_t b = 0; b < buffers.size(); ++b)
        std::copy(from[b].begin(), from[b].end(), buffers[b].begin());
    };
    const auto before = buffers;
    test::run_pairs(p, pairs, NH);
    const auto want = buffers;
    restore(before);
    for (int64_t k = 0; k < pairs; ++k)
      column_major_gemm(g, p.alpha, static_cast<const float*>(p.b.of(k, NH)),
                        static_cast<const float*>(p.a.of(k, NH)), p.accumulate ? 1.0f : 0.0f,
                        static_cast<float*>(const_cast<void*>(p.c.of(k, NH))));
    for (size_t b = 0; b < buffers.size(); ++b)
      EXPECT_TRUE(all_close("buffer " + std::to_string(b), buffers[b].data(), want[b].data(),
                            want[b].size(), 1e-5, 1e-6));
    restore(before);
  }
}

}  // namespace
}  // namespace bertrain::cuda
