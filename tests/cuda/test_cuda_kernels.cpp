// CUDA kernels against the CPU kernels (the oracle). Built with -DBERTRAIN_CUDA=ON; every test
// skips when no GPU is present, so the CUDA build passes on CPU-only CI.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

#include "core/dtype.h"
#include "kernels/backend.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cuda/attention_products.h"
#include "kernels/cuda/cuda.h"
#include "kernels/row_math.h"
#include "test_util.h"

namespace bertrain {
namespace {

using test::all_close;
using test::random_vector;

#define SKIP_WITHOUT_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine"

cuda::DeviceBuffer to_device(const std::vector<float>& v) {
  cuda::DeviceBuffer b(v.size() * 4);
  b.upload(v.data(), v.size() * 4);
  return b;
}

std::vector<float> to_host(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<float> v(n);
  b.download(v.data(), n * 4);
  return v;
}

TEST(Cuda, DeviceCountNeverThrows) {
  EXPECT_GE(cuda::device_count(), 0);
}

TEST(Cuda, LayerNormMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 200, C = 768;  // (the parameter gradients: 4 chunks of rows, the last short)
  auto x = random_vector(N * C, 1), g = random_vector(C, 2), b = random_vector(C, 3),
       dy = random_vector(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C), dg(C, 0.0f), db(C, 0.0f);
  kernels::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), N,
                             C, 1e-12f);
  kernels::layernorm_backward(dx.data(), dg.data(), db.data(), dy.data(), x.data(), g.data(),
                              mean.data(), rstd.data(), N, C);
  auto dxd = to_device(x), dgd = to_device(g), dbd = to_device(b), ddy = to_device(dy);
  cuda::DeviceBuffer o(N * C * 4), m(N * 4), r(N * 4), ddx(N * C * 4);
  auto ddg = to_device(std::vector<float>(C, 0.0f)), ddb = to_device(std::vector<float>(C, 0.0f));
  cuda::layernorm_forward(o.f32(), m.f32(), r.f32(), dxd.f32(), dgd.f32(), dbd.f32(), N, C, 1e-12f);
  cuda::layernorm_backward(ddx.f32(), ddg.f32(), ddb.f32(), ddy.f32(), dxd.f32(), dgd.f32(),
                           m.f32(), r.f32(), N, C);
  cuda::synchronize();
  // Different summation order only: fp32 rounding, rtol 1e-5 / atol 1e-5 of the tensor max.
  EXPECT_TRUE(all_close("out", to_host(o, N * C).data(), out.data(), N * C, 1e-5, 1e-5));
  EXPECT_TRUE(all_close("dx", to_host(ddx, N * C).data(), dx.data(), N * C, 1e-4, 1e-5));
  EXPECT_TRUE(all_close("dgamma", to_host(ddg, C).data(), dg.data(), C, 1e-4, 1e-5));
  EXPECT_TRUE(all_close("dbeta", to_host(ddb, C).data(), db.data(), C, 1e-4, 1e-5));
}

TEST(Cuda, ActivationsAndDropoutMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 10000;
  auto x = random_vector(n, 5, 2.0f), dy = random_vector(n, 6);
  for (auto a :
       {kernels::Activation::GeluErf, kernels::Activation::GeluTanh, kernels::Activation::Relu}) {
    std::vector<float> y(n), dx(n);
    kernels::activation_forward(a, y.data(), x.data(), n);
    kernels::activation_backward(a, dx.data(), x.data(), dy.data(), n);
    auto dxd = to_device(x), ddy = to_device(dy);
    cuda::DeviceBuffer yd(n * 4), dxo(n * 4);
    cuda::activation_forward(a, yd.f32(), dxd.f32(), n);
    cuda::activation_backward(a, dxo.f32(), dxd.f32(), ddy.f32(), n);
    cuda::synchronize();
    EXPECT_TRUE(all_close("act", to_host(yd, n).data(), y.data(), n, 1e-6, 1e-6));
    EXPECT_TRUE(all_close("dact", to_host(dxo, n).data(), dx.data(), n, 1e-5, 1e-6));
  }
  std::vector<float> ones(n, 1.0f);
  auto d = to_device(ones);
  kernels::dropout_forward(ones.data(), n, {0.1f, 1234, 77});
  cuda::dropout_forward(d.f32(), n, 1, {0.1f, 1234, 77});
  cuda::synchronize();
  EXPECT_EQ(to_host(d, n), ones);  // bit-identical masks on both backends
}

template <typename T>
cuda::DeviceBuffer to_device_as(const std::vector<T>& v) {
  cuda::DeviceBuffer b(v.size() * sizeof(T));
  b.upload(v.data(), v.size() * sizeof(T));
  return b;
}

template <typename T>
std::vector<T> to_host_as(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  b.download(v.data(), n * sizeof(T));
  return v;
}

// The FFN's dGELU fused with its bias gradient (one launch) against the two it replaces on the
// GPU (activation_backward, then linear_backward's column sums: Backend's default), bit for
// bit, in every precision (fp32 input, the kept bf16 or fp16 bits), over rows and columns that
// leave partial chunks and tiles, dinp aliasing dout as the model calls it; and against the CPU
// backend's (a column summed in one run: fp32 rounding of sums of 700 terms, rtol 1e-5); dout
// given as its 16-bit copy alone, as the call given that copy's values.
TEST(Cuda, ActivationBiasBackwardMatchesTheTwoItFuses) {
  SKIP_WITHOUT_GPU();
  const int64_t M = 700, N = 300;
  const auto x = random_vector(M * N, 5, 2.0f), dy = random_vector(M * N, 6),
             b0 = random_vector(N, 7);
  const kernels::Backend& gpu = cuda::cuda_backend();
  const kernels::Backend& cpu = kernels::cpu_backend();
  for (int precision = 0; precision < 3; ++precision) {
    const auto p = static_cast<Precision>(precision);
    std::vector<uint16_t> bits(M * N);
    for (int64_t i = 0; i < M * N; ++i)
      bits[i] = p == Precision::FP16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
    std::vector<float> wide(x);  // the kept input as a 16-bit precision's backward reads it
    if (p != Precision::FP32)
      for (int64_t i = 0; i < M * N; ++i)
        wide[i] = p == Precision::FP16 ? f16_to_f32(bits[i]) : bf16_to_f32(bits[i]);
    const auto xd = to_device(x), bits_d = to_device_as(bits);
    const kernels::Kept in{xd.f32(),
                           p == Precision::FP32 ? nullptr : static_cast<uint16_t*>(bits_d.data())};
    auto fused = to_device(dy), two = to_device(dy), db_fused = to_device(b0),
         db_two = to_device(b0);
    // (16-bit precisions: dinp's 16-bit copy too, rounded as it is written / after)
    cuda::DeviceBuffer fused16(M * N * 2), two16(M * N * 2);
    auto copy = [&](cuda::DeviceBuffer& b) {
      return p == Precision::FP32 ? nullptr : static_cast<uint16_t*>(b.data());
    };
    gpu.activation_bias_backward(p, kernels::Activation::GeluErf, {fused.f32(), copy(fused16)},
                                 db_fused.f32(), in, fused.f32(), M, N);
    gpu.kernels::Backend::activation_bias_backward(p, kernels::Activation::GeluErf,
                                                   {two.f32(), copy(two16)}, db_two.f32(), in,
                                                   two.f32(), M, N);
    cuda::synchronize();
    SCOPED_TRACE(testing::Message() << "precision " << precision);
    EXPECT_EQ(to_host(fused, M * N), to_host(two, M * N));
    EXPECT_EQ(to_host(db_fused, N), to_host(db_two, N));
    if (p != Precision::FP32) {
      const std::vector<float> g = to_host(fused, M * N);
      const std::vector<uint16_t> got = to_host_as<uint16_t>(fused16, M * N);
      EXPECT_EQ(got, to_host_as<uint16_t>(two16, M * N));
      for (int64_t i = 0; i < M * N; ++i)
        ASSERT_EQ(got[i], p == Precision::FP16 ? f32_to_f16(g[i]) : f32_to_bf16(g[i])) << i;
    }
    std::vector<float> dx(dy), db(b0);
    cpu.activation_bias_backward(Precision::FP32, kernels::Activation::GeluErf, dx.data(),
                                 db.data(), {wide.data()}, dx.data(), M, N);
    EXPECT_TRUE(all_close("dinp", to_host(fused, M * N).data(), dx.data(), M * N, 1e-5, 1e-6));
    EXPECT_TRUE(all_close("db", to_host(db_fused, N).data(), db.data(), N, 1e-5, 1e-5));
    if (p == Precision::FP32) continue;
    // dout given as its 16-bit copy alone (what the FFN's output product writes on a GPU:
    // ModelDims::inter16_output), dinp's copy alone written: bit for bit the call given that
    // copy's values in fp32.
    std::vector<uint16_t> dy16(M * N);
    std::vector<float> dy_wide(M * N);
    for (int64_t i = 0; i < M * N; ++i) {
      dy16[i] = p == Precision::FP16 ? f32_to_f16(dy[i]) : f32_to_bf16(dy[i]);
      dy_wide[i] = p == Precision::FP16 ? f16_to_f32(dy16[i]) : bf16_to_f32(dy16[i]);
    }
    const auto dy16_d = to_device_as(dy16), dy_wide_d = to_device(dy_wide);
    auto db_copy = to_device(b0), db_values = to_device(b0);
    cuda::DeviceBuffer from_copy(M * N * 2), from_values(M * N * 2);
    gpu.activation_bias_backward(p, kernels::Activation::GeluErf, {nullptr, copy(from_copy)},
                                 db_copy.f32(), in,
                                 {nullptr, static_cast<const uint16_t*>(dy16_d.data())}, M, N);
    gpu.activation_bias_backward(p, kernels::Activation::GeluErf, {nullptr, copy(from_values)},
                                 db_values.f32(), in, dy_wide_d.f32(), M, N);
    cuda::synchronize();
    EXPECT_EQ(to_host_as<uint16_t>(from_copy, M * N), to_host_as<uint16_t>(from_values, M * N));
    EXPECT_EQ(to_host(db_copy, N), to_host(db_values, N));
  }
}

// The fused residual, embedding and backward LayerNorm blocks against the CPU kernels: masks
// bit for bit (dropout zeros in the same places), values within fp32 rounding of the row sums
// (the CPU sums in double: rtol 1e-5 / atol 1e-5 of the max, as the row math's host test).
TEST(Cuda, FusedLayerNormBlocksMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 37, C = 768, V = 50, P = 40;
  const float eps = 1e-12f;
  std::vector<int32_t> rows(N), ids(N), seg(N);
  for (int64_t i = 0; i < N; ++i) {
    rows[i] = static_cast<int32_t>((i * 7) % 41);
    ids[i] = static_cast<int32_t>((i * 13) % V);
    seg[i] = static_cast<int32_t>(i % 2);
  }
  const kernels::Dropout hd{0.1f, 7, 50, rows.data()};
  const auto y = random_vector(N * C, 1, 2.0f), res = random_vector(N * C, 2),
             g = random_vector(C, 3), b = random_vector(C, 4), dy = random_vector(N * C, 5),
             word = random_vector(V * C, 6), pos = random_vector(P * C, 7),
             type = random_vector(2 * C, 8);
  auto rows_d = to_device_as(rows);
  const kernels::Dropout dd{0.1f, 7, 50, static_cast<const int32_t*>(rows_d.data())};
  auto y_d = to_device(y), res_d = to_device(res), g_d = to_device(g), b_d = to_device(b),
       dy_d = to_device(dy);
  // dropout + residual + LayerNorm
  std::vector<float> x = y, out(N * C), mean(N), rstd(N);
  kernels::residual_layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), res.data(),
                                      g.data(), b.data(), N, C, eps, hd);
  cuda::DeviceBuffer out_d(N * C * 4), mean_d(N * 4), rstd_d(N * 4);
  cuda::residual_layernorm_forward(out_d.f32(), mean_d.f32(), rstd_d.f32(), y_d.f32(), res_d.f32(),
                                   g_d.f32(), b_d.f32(), N, C, eps, dd);
  cuda::synchronize();
  EXPECT_EQ(to_host(y_d, N * C), x);  // x = dropout(y) + residual in place: the same operations
  EXPECT_TRUE(all_close("out", to_host(out_d, N * C).data(), out.data(), N * C, 1e-5, 1e-5));
  // its backward, accumulating into dx, with the gradient through the dropout
  const auto dx0 = random_vector(N * C, 9);
  std::vector<float> dx = dx0, ddrop(N * C), dg(C, 0.0f), db(C, 0.0f);
  kernels::layernorm_dropout_backward(dx.data(), ddrop.data(), dg.data(), db.data(), dy.data(),
                                      x.data(), g.data(), mean.data(), rstd.data(), N, C, true, hd);
  auto dx_d = to_device(dx0), dg_d = to_device(std::vector<float>(C, 0.0f)),
       db_d = to_device(std::vector<float>(C, 0.0f));
  cuda::DeviceBuffer ddrop_d(N * C * 4), ddrop16_d(N * C * 2);
  // (bf16: ddropped's copy rounded in the same pass, what the projection's backward reads)
  cuda::layernorm_dropout_backward(Precision::BF16, dx_d.f32(),
                                   {ddrop_d.f32(), static_cast<uint16_t*>(ddrop16_d.data())},
                                   dg_d.f32(), db_d.f32(), nullptr, dy_d.f32(), y_d.f32(),
                                   g_d.f32(), mean_d.f32(), rstd_d.f32(), N, C, true, dd);
  cuda::synchronize();
  EXPECT_TRUE(all_close("dx", to_host(dx_d, N * C).data(), dx.data(), N * C, 1e-5, 1e-5));
  const auto ddrop_g = to_host(ddrop_d, N * C);
  const auto ddrop16 = to_host_as<uint16_t>(ddrop16_d, N * C);
  for (int64_t i = 0; i < N * C; ++i) ASSERT_EQ(ddrop16[i], f32_to_bf16(ddrop_g[i])) << i;
  EXPECT_TRUE(all_close("ddropped", ddrop_g.data(), ddrop.data(), N * C, 1e-5, 1e-5));
  for (int64_t i = 0; i < N * C; ++i) ASSERT_EQ(ddrop_g[i] == 0.0f, ddrop[i] == 0.0f) << i;
  EXPECT_TRUE(all_close("dgamma", to_host(dg_d, C).data(), dg.data(), C, 1e-4, 1e-5));
  EXPECT_TRUE(all_close("dbeta", to_host(db_d, C).data(), db.data(), C, 1e-4, 1e-5));
  // embedding sum + LayerNorm + dropout (positions from i % T)
  const int64_t B = 1, T = N;
  std::vector<float> e_out(N * C), e_sum(N * C), e_mean(N), e_rstd(N);
  kernels::embedding_layernorm_forward(e_out.data(), e_sum.data(), e_mean.data(), e_rstd.data(),
                                       ids.data(), seg.data(), nullptr, word.data(), pos.data(),
                                       type.data(), g.data(), b.data(), B, T, C, eps, hd);
  auto ids_d = to_device_as(ids), seg_d = to_device_as(seg), word_d = to_device(word),
       pos_d = to_device(pos), type_d = to_device(type);
  cuda::DeviceBuffer eo_d(N * C * 4), es_d(N * C * 4);
  cuda::embedding_layernorm_forward(
      eo_d.f32(), es_d.f32(), mean_d.f32(), rstd_d.f32(), static_cast<const int32_t*>(ids_d.data()),
      static_cast<const int32_t*>(seg_d.data()), nullptr, word_d.f32(), pos_d.f32(), type_d.f32(),
      g_d.f32(), b_d.f32(), B, T, C, eps, dd);
  cuda::synchronize();
  EXPECT_EQ(to_host(es_d, N * C), e_sum);
  EXPECT_TRUE(
      all_close("embedding out", to_host(eo_d, N * C).data(), e_out.data(), N * C, 1e-5, 1e-5));
}

// Attention's row passes on the GPU against the same row math on the host (itself checked
// against the CPU attention: test_row_math.cpp), with a padded sequence, dropout and a dropout
// row length past T.
TEST(Cuda, AttentionRowPassesMatchHost) {
  SKIP_WITHOUT_GPU();
  kernels::AttentionShape s{2, 77, 256, 4};
  s.dropout_T = 96;
  const int64_t R = s.B * s.NH * s.T, T = s.T;
  const auto scores = random_vector(R * T, 1, 3.0f), dd = random_vector(R * T, 2);
  std::vector<int32_t> mask(s.B * T, 1);
  for (int64_t t = 60; t < T; ++t) mask[T + t] = 0;
  const kernels::Dropout d{0.1f, 5, 11, nullptr};
  std::vector<float> probs(R * T), dropped(R * T), ds(R * T);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t bh = r / T, i = r % T;
    kernels::row_math::attention_softmax(probs.data() + r * T, dropped.data() + r * T,
                                         scores.data() + r * T, mask.data() + (bh / s.NH) * T, T,
                                         d.p, d.key, d.offset + s.dropout_row(bh, i),
                                         kernels::row_math::OneLane{});
    kernels::row_math::attention_softmax_backward(
        ds.data() + r * T, dd.data() + r * T, probs.data() + r * T, T, d.p, d.key,
        d.offset + s.dropout_row(bh, i), kernels::row_math::OneLane{});
  }
  auto sc_d = to_device(scores), dd_d = to_device(dd), mask_d = to_device_as(mask);
  cuda::DeviceBuffer dr_d(R * T * 4);
  cuda::attention_softmax_forward(sc_d.f32(), dr_d.f32(), sc_d.f32(),
                                  static_cast<const int32_t*>(mask_d.data()), s, d);
  cuda::attention_softmax_backward(dd_d.f32(), dd_d.f32(), sc_d.f32(), s, d);
  cuda::synchronize();
  // The same operations in another summation order: rtol 1e-5.
  EXPECT_TRUE(all_close("probs", to_host(sc_d, R * T).data(), probs.data(), R * T, 1e-5, 1e-7));
  EXPECT_TRUE(all_close("dropped", to_host(dr_d, R * T).data(), dropped.data(), R * T, 1e-5, 1e-7));
  EXPECT_TRUE(all_close("ds", to_host(dd_d, R * T).data(), ds.data(), R * T, 1e-5, 1e-6));
}

// Rows padded as the model pads its vocabulary (30522 classes in rows of 30528), the padding
// larger than any logit: neither a class nor the maximum, its gradient written 0.
TEST(Cuda, CrossEntropyMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 80, V = 30522, S = 30528;
  auto logits = random_vector(N * S, 1, 3.0f);
  for (int64_t i = 0; i < N; ++i) std::fill_n(logits.data() + i * S + V, S - V, 1e4f);
  std::vector<int32_t> targets(N);
  std::vector<float> weights(N);
  for (int64_t i = 0; i < N; ++i) {
    targets[i] = static_cast<int32_t>((i * 7919) % V);
    weights[i] = i % 5 == 0 ? 0.0f : 1.0f;
  }
  std::vector<float> d(N * S, -1.0f), loss(N);
  std::vector<int32_t> hit(N);
  const kernels::Classes c{V, S};
  const double total = kernels::cross_entropy_forward_backward(
      d.data(), loss.data(), hit.data(), logits.data(), targets.data(), weights.data(), N, c, 0.5f);
  auto x_d = to_device(logits), t_d = to_device_as(targets), w_d = to_device(weights);
  cuda::DeviceBuffer loss_d(N * 4), hit_d(N * 4);
  const auto got =
      cuda::cross_entropy(x_d.f32(), loss_d.f32(), static_cast<int32_t*>(hit_d.data()), x_d.f32(),
                          static_cast<const int32_t*>(t_d.data()), w_d.f32(), N, c, 0.5f);
  EXPECT_EQ(to_host_as<int32_t>(hit_d, N), hit);
  EXPECT_TRUE(all_close("losses", to_host(loss_d, N).data(), loss.data(), N, 1e-5, 1e-6));
  double hits = 0;
  for (int64_t i = 0; i < N; ++i) hits += weights[i] * hit[i];
  // fp32 row sums of 30522 exponentials against the CPU's double: rtol 1e-5.
  EXPECT_NEAR(got.loss, total, 1e-5 * std::fabs(total));
  EXPECT_EQ(got.correct, hits);
  const auto got_d = to_host(x_d, N * S);
  EXPECT_TRUE(all_close("dlogits", got_d.data(), d.data(), N * S, 1e-5, 1e-5));
  for (int64_t i = 0; i < N; ++i)
    EXPECT_EQ(std::vector<float>(got_d.data() + i * S + V, got_d.data() + (i + 1) * S),
              std::vector<float>(S - V, 0.0f))
        << "row " << i << "'s padding";
  // A factor read where the kernel runs (kernels::Multiplier: fp16's loss scale on the device):
  // 0.125 x 4 in device memory gives the gradient of the host's 0.5 bit for bit, and scaling
  // by 0.5 x 4 there doubles it exactly.
  const auto four = to_device(std::vector<float>{4.0f});
  auto x2_d = to_device(logits);
  cuda::cross_entropy(x2_d.f32(), nullptr, nullptr, x2_d.f32(),
                      static_cast<const int32_t*>(t_d.data()), w_d.f32(), N, c,
                      kernels::Multiplier(0.125f, four.f32()), nullptr, /*sums=*/false);
  EXPECT_EQ(to_host(x2_d, N * S), got_d);
  cuda::scale(x2_d.f32(), N * S, kernels::Multiplier(0.5f, four.f32()));
  std::vector<float> doubled = got_d;
  for (float& x : doubled) x *= 2.0f;
  EXPECT_EQ(to_host(x2_d, N * S), doubled);
}

// An optimizer test's state: parameters, their bf16 copy and the moments on the host (what the
// CPU updates) and on the device (what the GPU updates), from the same values.
struct OptimizerState {
  std::vector<float> p, m, v;
  std::vector<uint16_t> p16;
  cuda::DeviceBuffer p_d, m_d, v_d, p16_d;
  OptimizerState(const std::vector<float>& p0, const std::vector<float>& m0,
                 const std::vector<float>& v0)
      : p(p0),
        m(m0),
        v(v0),
        p16(p0.size()),
        p_d(to_device(p0)),
        m_d(to_device(m0)),
        v_d(to_device(v0)),
        p16_d(p0.size() * 2) {}
  uint16_t* p16_dev() const { return static_cast<uint16_t*>(p16_d.data()); }
};

// AdamW and LAMB (with the bf16 copy, and the fp16 one) and the gradient norm against the CPU's
// reference loops, which run the same element functions with IEEE operations and no contraction
// on either side (--fmad=false): the same bits. The norms are double sums in another order (rtol
// 1e-12).
TEST(Cuda, OptimizerMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 100003;
  const auto p0 = random_vector(n, 1), g = random_vector(n, 2), m0 = random_vector(n, 3, 0.1f);
  auto v0 = random_vector(n, 4, 0.1f);
  for (auto& x : v0) x = x * x;
  const auto g_d = to_device(g);
  for (int which = 0; which < 4; ++which) {
    const bool f16 = which >= 2;
    const kernels::AdamwStep aw{0.5f, 0.9f, 0.999f, 1e-3f, 0.3f, 1e-6f, 0.9999f, f16};
    const kernels::LambStep lb{0.5f, 0.9f, 0.999f, 1.2f, 1.1f, 1e-6f, 0.01f, 1e-3f, f16};
    OptimizerState st(p0, m0, v0);
    auto& [p, m, v, p16, p_d, m_d, v_d, p16_d] = st;
    uint16_t* p16_dev = st.p16_dev();
    if (which % 2 == 0) {
      kernels::adamw_update_reference(aw, p.data(), p16.data(), g.data(), m.data(), v.data(), n);
      cuda::adamw_update(aw, p_d.f32(), p16_dev, g_d.f32(), m_d.f32(), v_d.f32(), n);
    } else {
      double pn = 0, un = 0, pn_d = 0, un_d = 0;
      kernels::lamb_moments_reference(lb, p.data(), g.data(), m.data(), v.data(), n, pn, un);
      cuda::lamb_moments(lb, p_d.f32(), g_d.f32(), m_d.f32(), v_d.f32(), n, pn_d, un_d);
      EXPECT_NEAR(pn_d, pn, 1e-12 * pn);
      EXPECT_NEAR(un_d, un, 1e-12 * un);
      const float step = lb.lr * kernels::lamb_trust(lb, pn, un);
      kernels::lamb_apply_reference(lb, p.data(), p16.data(), m.data(), v.data(), n, step);
      cuda::lamb_apply(lb, p_d.f32(), p16_dev, m_d.f32(), v_d.f32(), n, step);
    }
    cuda::synchronize();
    const std::string name = std::string(which % 2 == 0 ? "adamw" : "lamb") + (f16 ? " fp16" : "");
    EXPECT_EQ(to_host(p_d, n), p) << name;
    EXPECT_EQ(to_host(m_d, n), m) << name;
    EXPECT_EQ(to_host(v_d, n), v) << name;
    EXPECT_EQ(to_host_as<uint16_t>(p16_d, n), p16) << name;
  }
  double sum = 0, sum_d = 0;
  kernels::add_sum_squares_reference(sum, g.data(), n, 0.5);
  cuda::add_sum_squares(sum_d, g_d.f32(), n, 0.5);
  EXPECT_NEAR(sum_d, sum, 1e-12 * sum);
}

// The optimizer over many tensors at once (a block per chunk of 64 Ki values, a span longer than a
// chunk, an empty one, the state offset from the values as a shard's) against the CPU backend's
// one tensor at a time: the same element functions, so the same bits; the norms are double sums
// in another order (rtol 1e-12), and LAMB's trust ratios come from them (the one-pass update's
// on the device, with no host synchronisation; the two-pass update's on the host).
TEST(Cuda, OptimizerOverManyTensorsMatchesCpu) {
  SKIP_WITHOUT_GPU();
  // Values (p, g) from 1000 on, their state (m, v) from 0: a shard's layout.
  const std::vector<kernels::TensorSpan> spans = {{1000, 0, 150000},
                                                  {151000, 150000, 0},
                                                  {151000, 150000, 7},
                                                  {151007, 150007, 64},
                                                  {151071, 150071, 1000}};
  const int64_t n = 152071, ns = 151071;
  const auto p0 = random_vector(n, 1), g = random_vector(n, 2), m0 = random_vector(ns, 3, 0.1f);
  auto v0 = random_vector(ns, 4, 0.1f);
  for (auto& x : v0) x = x * x;
  const int64_t T = static_cast<int64_t>(spans.size());
  std::vector<kernels::AdamwStep> aw(T, {0.5f, 0.9f, 0.999f, 1e-3f, 0.3f, 1e-6f, 0.9999f});
  std::vector<kernels::LambStep> lb(T, {0.5f, 0.9f, 0.999f, 1.2f, 1.1f, 1e-6f, 0.01f, 1e-3f});
  aw[2].decay = 1.0f;  // per-tensor steps (no weight decay on one)
  lb[2].wd = 0.0f;
  const kernels::Backend& cpu = kernels::cpu_backend();
  const kernels::Backend& gpu = cuda::cuda_backend();
  const kernels::TensorSpan* tensors = spans.data();
  const auto g_d = to_device(g);
  for (int which = 0; which < 3; ++which) {
    OptimizerState st(p0, m0, v0);
    auto& [p, m, v, p16, p_d, m_d, v_d, p16_d] = st;
    uint16_t* p16_dev = st.p16_dev();
    if (which == 0) {
      cpu.adamw_update(aw.data(), p.data(), p16.data(), g.data(), m.data(), v.data(), tensors, T,
                       nullptr);
      gpu.adamw_update(aw.data(), p_d.f32(), p16_dev, g_d.f32(), m_d.f32(), v_d.f32(), tensors, T,
                       nullptr);
    } else if (which == 1) {
      cpu.lamb_update(lb.data(), p.data(), p16.data(), g.data(), m.data(), v.data(), tensors, T,
                      nullptr);
      gpu.lamb_update(lb.data(), p_d.f32(), p16_dev, g_d.f32(), m_d.f32(), v_d.f32(), tensors, T,
                      nullptr);
    } else {  // the sharded LAMB's two passes
      std::vector<double> pn(T), un(T), pn_d(T), un_d(T);
      cpu.lamb_moments(lb.data(), p.data(), g.data(), m.data(), v.data(), tensors, T, pn.data(),
                       un.data());
      gpu.lamb_moments(lb.data(), p_d.f32(), g_d.f32(), m_d.f32(), v_d.f32(), tensors, T,
                       pn_d.data(), un_d.data());
      std::vector<float> step(T);
      for (int64_t i = 0; i < T; ++i) {
        EXPECT_NEAR(pn_d[i], pn[i], 1e-12 * pn[i]) << i;
        EXPECT_NEAR(un_d[i], un[i], 1e-12 * un[i]) << i;
        step[i] = lb[i].lr * kernels::lamb_trust(lb[i], pn[i], un[i]);
      }
      cpu.lamb_apply(lb.data(), p.data(), p16.data(), m.data(), v.data(), tensors, T, step.data());
      gpu.lamb_apply(lb.data(), p_d.f32(), p16_dev, m_d.f32(), v_d.f32(), tensors, T, step.data());
    }
    cuda::synchronize();
    const char* name = which == 0 ? "adamw" : which == 1 ? "lamb" : "lamb in two passes";
    EXPECT_EQ(to_host(p_d, n), p) << name;
    EXPECT_EQ(to_host(m_d, ns), m) << name;
    EXPECT_EQ(to_host(v_d, ns), v) << name;
    const std::vector<uint16_t> got16 = to_host_as<uint16_t>(p16_d, n);
    for (const auto& t : spans)  // (p16 outside the spans is not written)
      for (int64_t i = t.offset; i < t.offset + t.n; ++i)
        ASSERT_EQ(got16[i], p16[i]) << name << " " << i;
  }
  double sum = 0, sum_d = 0;
  cpu.add_sum_squares(sum, g.data(), spans.data(), T, 0.5);
  gpu.add_sum_squares(sum_d, g_d.f32(), spans.data(), T, 0.5);
  EXPECT_NEAR(sum_d, sum, 1e-12 * sum);
}

// The gated passes (types.h GradientGate: the norm, the finite check and clipping decided on
// the device, read by the update kernels, nothing read by the host) against the CPU backend's
// measure-then-update: the gate's sum in the host's chunk order (the same bits as the GPU's
// add_sum_squares), the factor from the same doubles, so AdamW and LAMB with clipping active
// (norm > 1) and without (max_norm 0) give the same parameters, moments and 16-bit copies bit
// for bit; a NaN gradient makes the gate skip and leaves all of them as they were. The gate
// carries fp16's loss scale and the update count from the gate before (types.h next_gate): the
// gradients carry scale 1024, which the gate divides out, and the bias corrections are those of
// update 5 after 4; the scale's rule runs (finite: one good step; NaN: backed off to 512, the
// count kept). The tables cross once: a second pass over the same spans copies nothing to the
// device (no host wait in a lagging queue either).
TEST(Cuda, GatedOptimizerEqualsTheMeasuredOne) {
  SKIP_WITHOUT_GPU();
  const std::vector<kernels::TensorSpan> spans = {
      {0, 0, 150000}, {150000, 150000, 7}, {150007, 150007, 1000}};
  const int64_t n = 151007, T = 3;
  const auto p0 = random_vector(n, 1), m0 = random_vector(n, 3, 0.1f);
  auto v0 = random_vector(n, 4, 0.1f);
  for (auto& x : v0) x = x * x;
  const kernels::Backend& cpu = kernels::cpu_backend();
  const kernels::Backend& gpu = cuda::cuda_backend();
  cuda::DeviceBuffer gate_d(sizeof(kernels::GradientGate));
  int passes = 0;
  auto* gate = static_cast<kernels::GradientGate*>(gate_d.data());
  for (float max_norm : {1.0f, 0.0f})
    for (bool lamb : {false, true})
      for (bool nan : {false, true}) {
        SCOPED_TRACE(testing::Message() << "max_norm " << max_norm << (lamb ? " lamb" : " adamw")
                                        << (nan ? " NaN gradient" : ""));
        auto g = random_vector(n, 2);
        if (nan) g[150003] = std::nanf("");
        const auto g_d = to_device(g);
        const float unscale = 0.5f;
        kernels::GradientGate before_gate;  // 4 updates applied, loss scale 1024
        before_gate.steps = 4;
        before_gate.scale.scale = 1024.0f;
        before_gate.scale.enabled = 1;
        gpu.to_device(gate, &before_gate, sizeof before_gate);
        const float unscaled = kernels::unscale_by(unscale, before_gate.scale);
        EXPECT_EQ(unscaled, 0.5f / 1024);
        // The measured path's norm: the GPU's chunk sums added on the host (the CPU's, in
        // another order, within 1e-12).
        double sum = 0, cpu_sum = 0;
        gpu.add_sum_squares(sum, g_d.f32(), spans.data(), T, unscaled);
        cpu.add_sum_squares(cpu_sum, g.data(), spans.data(), T, unscaled);
        if (!nan) {
          EXPECT_NEAR(sum, cpu_sum, 1e-12 * cpu_sum);
        }
        const kernels::GradientGate want = kernels::gradient_gate(sum, unscaled, max_norm);
        std::vector<kernels::AdamwStep> aw(T, {1.0f, 0.9f, 0.999f, 1e-3f, 0.3f, 1e-6f, 0.9999f});
        std::vector<kernels::LambStep> lb(T, {1.0f, 0.9f, 0.999f, 1.2f, 1.1f, 1e-6f, 0.01f, 1e-3f});
        for (auto& a : aw) a.lr = 1e-3f;
        aw[1].decay = 1.0f;
        lb[1].wd = 0.0f;
        OptimizerState st(p0, m0, v0);
        auto& [p, m, v, p16, p_d, m_d, v_d, p16_d] = st;
        if (want.apply) {  // the CPU: measured, then the steps with the factor, update 5
          for (auto& a : aw) {
            a.gscale = want.factor;
            kernels::bias_correct(a, 5);
          }
          for (auto& a : lb) {
            a.gscale = want.factor;
            kernels::bias_correct(a, 5);
          }
          if (lamb)
            cpu.lamb_update(lb.data(), p.data(), p16.data(), g.data(), m.data(), v.data(),
                            spans.data(), T, nullptr);
          else
            cpu.adamw_update(aw.data(), p.data(), p16.data(), g.data(), m.data(), v.data(),
                             spans.data(), T, nullptr);
        }
        if (!nan && max_norm > 0) {
          EXPECT_LT(want.factor, 0.5f * 0.1f) << "clipping is active";
        }
        for (auto& a : aw) a.gscale = 7.0f;  // (the gate's factor replaces it)
        for (auto& a : lb) a.gscale = 7.0f;
        const kernels::DeviceCounts before = cuda::device_counts();
        gpu.gate_gradients(gate, g_d.f32(), spans.data(), T, unscale, max_norm);
        if (lamb) {
          gpu.lamb_update(lb.data(), p_d.f32(), st.p16_dev(), g_d.f32(), m_d.f32(), v_d.f32(),
                          spans.data(), T, gate);
        } else {
          gpu.adamw_update(aw.data(), p_d.f32(), st.p16_dev(), g_d.f32(), m_d.f32(), v_d.f32(),
                           spans.data(), T, gate);
        }
        // (after the first pass, which sizes the scratch: a blocking allocation)
        if (passes++ > 0) {
          EXPECT_EQ(cuda::device_counts().host_syncs, before.host_syncs) << "the host waited";
        }
        kernels::GradientGate got;
        gpu.to_host(&got, gate, sizeof got);
        EXPECT_EQ(got.apply, want.apply);
        if (!nan) {
          EXPECT_EQ(got.sum_squares, sum);
          EXPECT_EQ(got.factor, want.factor);
        }
        EXPECT_EQ(got.loss_scale, 1024.0f);
        EXPECT_EQ(got.steps, nan ? 4 : 5);
        EXPECT_EQ(got.scale.scale, nan ? 512.0f : 1024.0f);
        EXPECT_EQ(got.scale.good, nan ? 0 : 1);
        EXPECT_EQ(got.scale.bad, nan ? 1 : 0);
        EXPECT_EQ(to_host(p_d, n), p);
        EXPECT_EQ(to_host(m_d, n), m);
        EXPECT_EQ(to_host(v_d, n), v);
        if (!nan) {
          const std::vector<uint16_t> got16 = to_host_as<uint16_t>(p16_d, n);
          EXPECT_EQ(got16, p16);
        }
      }
}

// The attention products' pointer tables (cuda.h, pair_pointers) are kept: the same pairs, heads
// and operands again find their table (no launch, the same pointers); other operands make
// another; a new scratch binding, or tables of another size, make them again; with more than
// kPairTables tables the least recently used is remade. Every table read back holds what
// PairOperand::of gives.
TEST(Cuda, PairPointerTablesAreKept) {
  SKIP_WITHOUT_GPU();
  kernels::ScratchLayout own;  // (a binding of this test's own)
  own.caller = 128;
  cuda::bind_scratch(nullptr, own);
  const auto product = [](uintptr_t base) {
    cuda::PairProduct p{};
    p.a = {reinterpret_cast<const void*>(base), 4096, 64, 2};
    p.b = {reinterpret_cast<const void*>(base + 0x100000), 4096, 64, 2};
    p.c = {reinterpret_cast<const void*>(base + 0x200000), 2048, 32, 4};
    return p;
  };
  const auto made = [](int64_t pairs, int64_t NH, const std::vector<cuda::PairProduct>& p) {
    const int64_t before = cuda::device_counts().launches;
    const cuda::PairPointers at =
        cuda::pair_pointers(pairs, NH, p.data(), static_cast<int64_t>(p.size()));
    const int64_t launches = cuda::device_counts().launches - before;
    std::vector<const void*> got(3 * p.size() * pairs);
    cuda::synchronize();
    EXPECT_EQ(cudaMemcpy(got.data(), at.base, got.size() * sizeof(void*), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t j = 0; j < p.size(); ++j)
      for (int64_t k = 0; k < pairs; ++k) {
        const size_t at_j = 3 * pairs * j;
        EXPECT_EQ(got[at_j + k], p[j].a.of(k, NH)) << j << " " << k;
        EXPECT_EQ(got[at_j + pairs + k], p[j].b.of(k, NH)) << j << " " << k;
        EXPECT_EQ(got[at_j + 2 * pairs + k], p[j].c.of(k, NH)) << j << " " << k;
      }
    return std::pair<void**, int64_t>{at.base, launches};
  };
  const std::vector<cuda::PairProduct> forward = {product(0x10000000), product(0x11000000)},
                                       other = {product(0x10000000), product(0x12000000)};
  const auto first = made(6, 3, forward);
  EXPECT_EQ(first.second, 1);
  EXPECT_EQ(made(6, 3, forward), std::make_pair(first.first, int64_t{0}));
  const auto second = made(6, 3, other);
  EXPECT_EQ(second.second, 1);
  EXPECT_NE(second.first, first.first);
  EXPECT_EQ(made(6, 3, forward).second, 0);
  EXPECT_EQ(made(6, 2, forward).second, 1) << "other heads: other pointers";
  cuda::bind_scratch(nullptr, own);
  EXPECT_EQ(made(6, 3, forward).second, 0) << "the same binding again (a model's every pass)";
  kernels::ScratchLayout other_layout;
  other_layout.caller = 64;
  cuda::bind_scratch(nullptr, other_layout);
  EXPECT_EQ(made(6, 3, forward).second, 1) << "another binding keeps no table";
  EXPECT_EQ(made(4, 2, forward).second, 1);
  EXPECT_EQ(made(6, 3, forward).second, 1) << "tables of another size overlap: made again";
  // kPairTables more tables: the first, the least recently used, is made again.
  for (int64_t i = 1; i <= cuda::kPairTables; ++i)
    EXPECT_EQ(made(6, 3, {product(0x20000000 + i * 0x1000000)}).second, 1);
  EXPECT_EQ(made(6, 3, forward).second, 1);
  EXPECT_EQ(made(6, 3, {product(0x20000000 + cuda::kPairTables * 0x1000000)}).second, 0);
}

// cuBLASLt's linear layers against the CPU's fp32 products. 16-bit operands: the oracle is the
// fp32 product of the operands rounded the same way (the GPU accumulates their exact products in
// fp32), so the bound is fp32 accumulation over K, not the 16-bit rounding: rtol 1e-4 / atol
// 1e-4 of the max. fp32 (no TF32): rtol 1e-5.
TEST(Cuda, LinearMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t M = 130, N = 96, K = 200;
  const auto in = random_vector(M * K, 1), w = random_vector(N * K, 2, 0.1f),
             bias = random_vector(N, 3), dout = random_vector(M * N, 4),
             dinp0 = random_vector(M * K, 5), dw0 = random_vector(N * K, 6),
             db0 = random_vector(N, 7);
  for (auto o : {Precision::FP32, Precision::BF16, Precision::FP16}) {
    const char* name = o == Precision::FP32 ? "fp32" : o == Precision::BF16 ? "bf16" : "fp16";
    // The operands as the GPU reads them, widened back to fp32 for the CPU's product.
    auto rounded = [&](const std::vector<float>& x, std::vector<uint16_t>& bits) {
      std::vector<float> r(x.size());
      bits.resize(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        if (o == Precision::BF16) {
          bits[i] = f32_to_bf16(x[i]);
          r[i] = bf16_to_f32(bits[i]);
        } else if (o == Precision::FP16) {
          bits[i] = f32_to_f16(x[i]);
          r[i] = f16_to_f32(bits[i]);
        } else {
          r[i] = x[i];
        }
      }
      return r;
    };
    std::vector<uint16_t> in16, w16, dout16;
    const auto in_r = rounded(in, in16), w_r = rounded(w, w16), dout_r = rounded(dout, dout16);
    std::vector<float> out(M * N), dinp = dinp0, dw = dw0, db = db0;
    kernels::linear_forward(out.data(), in_r.data(), w_r.data(), bias.data(), M, N, K);
    kernels::linear_backward(dinp.data(), dw.data(), nullptr, dout_r.data(), in_r.data(),
                             w_r.data(), M, N, K, true);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < N; ++c) db[c] += dout[r * N + c];
    const bool f32 = o == Precision::FP32;
    // The weight one element into its buffer, as a tensor of the flat parameter buffer may
    // start: cuBLASLt must not assume aligned operands.
    std::vector<float> w1 = w;
    std::vector<uint16_t> w16_1 = w16;
    w1.insert(w1.begin(), 0.0f);
    w16_1.insert(w16_1.begin(), 0);
    auto in_d = f32 ? to_device(in) : to_device_as(in16),
         w_d = f32 ? to_device(w1) : to_device_as(w16_1),
         dout16_d = f32 ? to_device(dout) : to_device_as(dout16);
    const void* w_at = static_cast<const char*>(w_d.data()) + (f32 ? 4 : 2);
    auto dout_d = to_device(dout), bias_d = to_device(bias), dinp_d = to_device(dinp0),
         dw_d = to_device(dw0), db_d = to_device(db0);
    cuda::DeviceBuffer out_d(M * N * 4);
    cuda::linear_forward(o, out_d.f32(), in_d.data(), w_at, bias_d.f32(), M, N, K);
    cuda::linear_backward(o, dinp_d.f32(), dw_d.f32(), db_d.f32(), dout16_d.data(), dout_d.f32(),
                          in_d.data(), w_at, M, N, K, true);
    cuda::synchronize();
    const double rtol = f32 ? 1e-5 : 1e-4;
    EXPECT_TRUE(all_close(std::string(name) + " out", to_host(out_d, M * N).data(), out.data(),
                          M * N, rtol, rtol));
    EXPECT_TRUE(all_close(std::string(name) + " dinp", to_host(dinp_d, M * K).data(), dinp.data(),
                          M * K, rtol, rtol));
    EXPECT_TRUE(all_close(std::string(name) + " dw", to_host(dw_d, N * K).data(), dw.data(), N * K,
                          rtol, rtol));
    EXPECT_TRUE(
        all_close(std::string(name) + " db", to_host(db_d, N).data(), db.data(), N, 1e-5, 1e-5));
  }
  // 16-bit copies round as the host does (nearest even), NaN and overflow included.
  std::vector<float> x = random_vector(1000, 8, 100.0f);
  x[0] = INFINITY;
  x[1] = NAN;
  x[2] = 1e6f;   // fp16 overflow: inf
  x[3] = 1e-6f;  // an fp16 subnormal
  auto x_d = to_device(x);
  cuda::DeviceBuffer b_d(2000), h_d(2000);
  cuda::round_to_16(Precision::BF16, static_cast<uint16_t*>(b_d.data()), x_d.f32(), 1000);
  cuda::round_to_16(Precision::FP16, static_cast<uint16_t*>(h_d.data()), x_d.f32(), 1000);
  cuda::synchronize();
  const auto b = to_host_as<uint16_t>(b_d, 1000), h = to_host_as<uint16_t>(h_d, 1000);
  for (int i = 0; i < 1000; ++i) {
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(b[i])) && std::isnan(f16_to_f32(h[i])));
      continue;
    }
    EXPECT_EQ(b[i], f32_to_bf16(x[i])) << x[i];
    EXPECT_EQ(h[i], f32_to_f16(x[i])) << x[i];
  }
}

}  // namespace
}  // namespace bertrain
