// CUDA kernels against the CPU kernels (the oracle). Built with -DBERTRAIN_CUDA=ON; every test
// skips when no GPU is present, so the CUDA build passes on CPU-only CI.
#include <gtest/gtest.h>

#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cuda/cuda.h"
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
  const int64_t N = 37, C = 768;
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
  kernels::dropout_forward(ones.data(), n, 0.1f, 1234, 77);
  cuda::dropout_forward(d.f32(), n, 0.1f, 1234, 77);
  cuda::synchronize();
  EXPECT_EQ(to_host(d, n), ones);  // bit-identical masks on both backends
}

}  // namespace
}  // namespace bertrain
