// The CUDA backend against the CPU backend through kernels/backend.h: the same calls, the same
// inputs, in every precision, so that a model gets the same numbers on either device. Skips
// without a GPU (and its bf16 parts where this CPU has no bf16 matmul to compare with).
// Tolerances: fp32 paths differ in summation order only (rtol 2e-5 of the max); 16-bit paths
// may round a value the other way where the two accumulate in another order before rounding:
// one unit of the format in a few elements, so rtol / atol of the max at a few units (bf16
// 2^-8: 2e-2; fp16 2^-11: 4e-3; the GPU's FP16 products take fp16 operands, so its weights,
// output gradients, dropped probabilities and dS also round at 2^-11 where the CPU's multiply
// in fp32).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "core/dtype.h"
#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/scratch.h"
#include "kernels/embedding_runs.h"
#include "test_util.h"

#if __has_include("cuda_emu/counts.h")
#include "cuda_emu/counts.h"
#define BT_EMULATED_DEVICE 1
#endif

namespace bertrain {
namespace {

using kernels::Kept;
using test::all_close;
using test::random_vector;

#define SKIP_WITHOUT_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine"

// A host vector and its device copy.
template <typename T>
struct Twin {
  std::vector<T> h;
  cuda::DeviceBuffer d;
  explicit Twin(std::vector<T> v) : h(std::move(v)), d(std::max<size_t>(h.size(), 1) * sizeof(T)) {
    if (!h.empty()) d.upload(h.data(), h.size() * sizeof(T));
  }
  explicit Twin(size_t n) : Twin(std::vector<T>(n)) {}
  T* host() { return h.data(); }
  T* dev() { return static_cast<T*>(d.data()); }
  std::vector<T> back() const {
    std::vector<T> v(h.size());
    if (!v.empty()) d.download(v.data(), v.size() * sizeof(T));
    return v;
  }
};

const kernels::Backend& cpu() {
  return kernels::cpu_backend();
}
const kernels::Backend& gpu() {
  return cuda::cuda_backend();
}

const char* name_of(Precision p) {
  return p == Precision::FP32 ? "fp32" : p == Precision::BF16 ? "bf16" : "fp16";
}
double tol(Precision p) {
  return p == Precision::FP32 ? 2e-5 : p == Precision::BF16 ? 2e-2 : 4e-3;
}

// The precisions this machine can compare (bf16 needs oneDNN's bf16 matmul on the CPU side).
std::vector<Precision> precisions() {
  std::vector<Precision> v = {Precision::FP32, Precision::FP16};
  if (kernels::gemm_bf16_available()) v.push_back(Precision::BF16);
  return v;
}

TEST(CudaBackend, LinearLayersMatchCpuInEveryPrecision) {
  SKIP_WITHOUT_GPU();
  const int64_t M = 70, N = 48, K = 96;
  for (Precision p : precisions()) {
    SCOPED_TRACE(name_of(p));
    Twin<float> in(random_vector(M * K, 1)), w(random_vector(N * K, 2, 0.1f)),
        bias(random_vector(N, 3)), dout(random_vector(M * N, 4)), out(M * N),
        dinp(random_vector(M * K, 5)), dw(random_vector(N * K, 6)), db(random_vector(N, 7)),
        wide(M * K);
    Twin<uint16_t> w16(N * K), in16(M * K), a16(M * std::max(N, K)), b16(M * K);
    for (const kernels::Backend* be : {&cpu(), &gpu()}) {
      const bool g = be == &gpu();
      auto P = [&](auto& t) { return g ? t.dev() : t.host(); };
      be->copy_weights(p, P(w), P(w16), N * K);
      Kept x{P(in), p == Precision::FP32 ? nullptr : P(in16)};
      be->keep(p, x, M * K);  // the kept input: bf16 bits, or fp16 rounded in place with bits
      const kernels::Weight wt{P(w), P(w16)};
      const kernels::Workspace ws{P(a16), P(b16), P(wide)};
      be->linear_forward(p, P(out), x, wt, P(bias), M, N, K, ws);
      be->linear_backward(p, P(dinp), P(dw), P(db), P(dout), x, wt, M, N, K, true, ws);
    }
    cuda::synchronize();
    const double t = tol(p);
    EXPECT_TRUE(all_close("out", out.back().data(), out.host(), M * N, t, t));
    EXPECT_TRUE(all_close("dinp", dinp.back().data(), dinp.host(), M * K, t, t));
    EXPECT_TRUE(all_close("dw", dw.back().data(), dw.host(), N * K, t, t));
    EXPECT_TRUE(all_close("db", db.back().data(), db.host(), N, 2e-5, 2e-5));
    EXPECT_EQ(in16.back(), in16.h);  // the same rounding of the same values
  }
}

// A 16-bit output a product wrote itself against its fp32 output rounded: the same bits on the
// emulated device (one reference GEMM for both); on a GPU cuBLAS may pick another algorithm for
// the 16-bit output, whose other summation order may round an element the other way: one unit
// in the last place at most.
void expect_rounded_alike(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  ASSERT_EQ(got.size(), want.size());
#if __has_include("cuda_emu/counts.h")  // (the emulated device)
  EXPECT_EQ(got, want);
#else
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::abs(int{got[i]} - int{want[i]}), 1) << "element " << i;
#endif
}

// A product's 16-bit output written by the product itself (Backend::linear_forward_16, what
// QKV's forward uses with the full attention: ModelDims::qkv16_output): the fp32 output rounded
// to nearest even, as linear_forward then round_to_16 give it, with the bias's 16-bit copy (a
// 16-bit output's bias is of its type in cuBLASLt), in bf16 and fp16, with the bias and without,
// from an fp32 input (rounded first) or its kept bits. On the emulated device bit for bit (one
// reference GEMM for both); on a GPU cuBLASLt may pick another algorithm for the 16-bit output,
// whose other summation order may round an element the other way: one unit in the last place
// at most. The CPU backend writes no 16-bit outputs and says so.
TEST(CudaBackend, LinearForward16IsTheFp32OutputRounded) {
  SKIP_WITHOUT_GPU();
  const int64_t M = 70, N = 48, K = 96;
  for (Precision p : {Precision::BF16, Precision::FP16})
    for (bool with_bias : {true, false})
      for (bool kept : {true, false}) {
        SCOPED_TRACE(testing::Message() << name_of(p) << " bias " << with_bias << " kept " << kept);
        Twin<float> in(random_vector(M * K, 1)), w(random_vector(N * K, 2, 0.1f)),
            bias(random_vector(N, 3)), out(M * N), wide(M * K);
        Twin<uint16_t> w16(N * K), in16(M * K), a16(M * K), b16(M * K), want(M * N), got(M * N),
            bias16(N);
        Twin<float> bias_rounded(N);
        gpu().copy_weights(p, w.dev(), w16.dev(), N * K);
        gpu().round_to_16(p, bias16.dev(), bias.dev(), N, nullptr);
        gpu().widen_from_16(p, bias_rounded.dev(), bias16.dev(), N, nullptr);
        if (kept) gpu().round_to_16(p, in16.dev(), in.dev(), M * K, nullptr);
        const Kept x{in.dev(), kept ? in16.dev() : nullptr};
        const kernels::Weight wt{w.dev(), w16.dev()};
        const kernels::Workspace ws{a16.dev(), b16.dev(), wide.dev()};
        gpu().linear_forward(p, out.dev(), x, wt, with_bias ? bias_rounded.dev() : nullptr, M, N, K,
                             ws);
        gpu().round_to_16(p, want.dev(), out.dev(), M * N, nullptr);
        gpu().linear_forward_16(p, got.dev(), x, wt, with_bias ? bias16.dev() : nullptr, M, N, K,
                                ws);
        cuda::synchronize();
        expect_rounded_alike(got.back(), want.back());
      }
  EXPECT_TRUE(gpu().writes_16bit_outputs());
  EXPECT_FALSE(cpu().writes_16bit_outputs());
  const std::string e = test::error_of([] {
    cpu().linear_forward_16(Precision::BF16, nullptr, Kept{}, kernels::Weight{}, nullptr, 1, 1, 1,
                            kernels::Workspace{});
  });
  EXPECT_NE(e.find("the cpu backend writes no 16-bit product outputs"), std::string::npos) << e;
}

// Backward's 16-bit dinp written by its product (Backend::linear_backward_16, what the attention's
// output projection uses where QKV's and the context's products write their copies: dctx for the
// full kernel's products): linear_backward's fp32 dinp rounded to nearest even, dw the same
// (accumulated), in bf16 and fp16, from dout's kept copy or its fp32 values (rounded first, the
// rounding pass summing db). Bit for bit on the emulated device; on a GPU within a unit in the
// last place (cuBLASLt may pick another algorithm for the 16-bit output). The CPU backend says
// it writes no 16-bit outputs.
TEST(CudaBackend, LinearBackward16IsTheFp32DinpRounded) {
  SKIP_WITHOUT_GPU();
  const int64_t M = 70, N = 48, K = 96;
  for (Precision p : {Precision::BF16, Precision::FP16})
    for (bool kept : {true, false}) {
      SCOPED_TRACE(testing::Message() << name_of(p) << " kept " << kept);
      Twin<float> in(random_vector(M * K, 1)), w(random_vector(N * K, 2, 0.1f)),
          dout(random_vector(M * N, 3)), dinp(M * K);
      Twin<uint16_t> w16(N * K), in16(M * K), dout16(M * N), a16(M * std::max(N, K)), b16(M * K),
          want(M * K), got(M * K);
      gpu().copy_weights(p, w.dev(), w16.dev(), N * K);
      gpu().round_to_16(p, in16.dev(), in.dev(), M * K, nullptr);
      if (kept) gpu().round_to_16(p, dout16.dev(), dout.dev(), M * N, nullptr);
      const kernels::Weight wt{w.dev(), w16.dev()};
      const kernels::Workspace ws{a16.dev(), b16.dev(), nullptr};
      const kernels::KeptIn d{dout.dev(), kept ? dout16.dev() : nullptr};
      Twin<float> dw_a(random_vector(N * K, 4)), dw_b(random_vector(N * K, 4)),
          db_a(random_vector(N, 5)), db_b(random_vector(N, 5));
      gpu().linear_backward(p, dinp.dev(), dw_a.dev(), kept ? nullptr : db_a.dev(), d,
                            Kept{in.dev(), in16.dev()}, wt, M, N, K, false, ws);
      gpu().round_to_16(p, want.dev(), dinp.dev(), M * K, nullptr);
      gpu().linear_backward_16(p, got.dev(), dw_b.dev(), kept ? nullptr : db_b.dev(), d,
                               Kept{in.dev(), in16.dev()}, wt, M, N, K, ws);
      cuda::synchronize();
      EXPECT_EQ(dw_b.back(), dw_a.back());
      EXPECT_EQ(db_b.back(), db_a.back());
      expect_rounded_alike(got.back(), want.back());
    }
  const std::string e = test::error_of([] {
    cpu().linear_backward_16(Precision::BF16, nullptr, nullptr, nullptr, kernels::KeptIn{}, Kept{},
                             kernels::Weight{}, 1, 1, 1, kernels::Workspace{});
  });
  EXPECT_NE(e.find("the cpu backend writes no 16-bit product outputs"), std::string::npos) << e;
}

// The 16-bit dataflow's LayerNorm outputs: residual_layernorm_forward given out.bits writes out
// rounded there in the same pass, bit for bit round_to_16's, out, mean and rstd unchanged, on
// the GPU and on the CPU, in bf16 and fp16; what linear_forward then reads instead of rounding
// its input (the model's next product). 70 rows of 96 with dropout on.
TEST(CudaBackend, ResidualLayerNormWritesItsOutputsCopy) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 70, C = 96;
  const kernels::Dropout d{0.1f, 3, 7, nullptr};
  for (Precision p : {Precision::BF16, Precision::FP16})
    for (const kernels::Backend* be : {&cpu(), &gpu()}) {
      SCOPED_TRACE(testing::Message() << name_of(p) << (be == &gpu() ? " gpu" : " cpu"));
      const bool g = be == &gpu();
      Twin<float> gamma(random_vector(C, 3)), beta(random_vector(C, 4)),
          residual(random_vector(N * C, 5));
      struct Out {
        std::vector<float> out, mean, rstd;
        std::vector<uint16_t> bits;
      };
      auto run = [&](bool copy) {
        Twin<float> x(random_vector(N * C, 6)), out(N * C), mean(N), rstd(N);
        Twin<uint16_t> bits(N * C);
        auto P = [&](auto& t) { return g ? t.dev() : t.host(); };
        be->residual_layernorm_forward(p, {P(out), copy ? P(bits) : nullptr}, P(mean), P(rstd),
                                       P(x), P(residual), P(gamma), P(beta), N, C, 1e-12f, d);
        if (!copy) be->round_to_16(p, P(bits), P(out), N * C, nullptr);
        if (g) {
          cuda::synchronize();
          return Out{out.back(), mean.back(), rstd.back(), bits.back()};
        }
        return Out{out.h, mean.h, rstd.h, bits.h};
      };
      const Out with = run(true), rounded = run(false);
      EXPECT_EQ(with.bits, rounded.bits);
      EXPECT_EQ(with.out, rounded.out);
      EXPECT_EQ(with.mean, rounded.mean);
      EXPECT_EQ(with.rstd, rounded.rstd);
    }
}

// The projections' 16-bit outputs (ModelDims::proj16_output): residual_layernorm_forward_16
// given y's 16-bit copy alone writes the sum x = dropout(y) + residual, out, its copy, mean and
// rstd bit for bit as residual_layernorm_forward given the copy's values in fp32, in bf16 and
// fp16, 70 rows of 96 with dropout on. The CPU backend, which writes no 16-bit outputs, says so.
TEST(CudaBackend, ResidualLayerNormReadsTheProjectionsCopy) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 70, C = 96;
  const kernels::Dropout d{0.1f, 3, 7, nullptr};
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    SCOPED_TRACE(name_of(p));
    Twin<float> gamma(random_vector(C, 3)), beta(random_vector(C, 4)),
        residual(random_vector(N * C, 5)), y(random_vector(N * C, 6));
    Twin<uint16_t> y16(N * C);
    gpu().round_to_16(p, y16.dev(), y.dev(), N * C, nullptr);
    std::vector<float> widened(N * C);
    const std::vector<uint16_t> bits = y16.back();
    for (int64_t i = 0; i < N * C; ++i)
      widened[i] = p == Precision::BF16 ? bf16_to_f32(bits[i]) : f16_to_f32(bits[i]);
    struct Out {
      std::vector<float> x, out, mean, rstd;
      std::vector<uint16_t> bits;
    };
    auto run = [&](bool from_copy) {
      // (from the copy, x is written by the call: NaN before)
      Twin<float> x(from_copy ? std::vector<float>(N * C, std::nanf("")) : widened), out(N * C),
          mean(N), rstd(N);
      Twin<uint16_t> out16(N * C);
      if (from_copy)
        gpu().residual_layernorm_forward_16(p, {out.dev(), out16.dev()}, mean.dev(), rstd.dev(),
                                            x.dev(), y16.dev(), residual.dev(), gamma.dev(),
                                            beta.dev(), N, C, 1e-12f, d);
      else
        gpu().residual_layernorm_forward(p, {out.dev(), out16.dev()}, mean.dev(), rstd.dev(),
                                         x.dev(), residual.dev(), gamma.dev(), beta.dev(), N, C,
                                         1e-12f, d);
      cuda::synchronize();
      return Out{x.back(), out.back(), mean.back(), rstd.back(), out16.back()};
    };
    const Out copy = run(true), values = run(false);
    EXPECT_EQ(copy.x, values.x);
    EXPECT_EQ(copy.out, values.out);
    EXPECT_EQ(copy.bits, values.bits);
    EXPECT_EQ(copy.mean, values.mean);
    EXPECT_EQ(copy.rstd, values.rstd);
  }
  const std::string e = test::error_of([] {
    cpu().residual_layernorm_forward_16(Precision::BF16, Kept{}, nullptr, nullptr, nullptr, nullptr,
                                        nullptr, nullptr, nullptr, 1, 1, 1e-12f,
                                        kernels::Dropout{});
  });
  EXPECT_NE(e.find("the cpu backend writes no 16-bit product outputs"), std::string::npos) << e;
}

// The 16-bit dataflow's output gradients: linear_backward given dout's 16-bit copy (KeptIn, what
// its producer writes in the same pass: layernorm_dropout_backward, activation_bias_backward)
// reads it instead of rounding dout: dinp, dw and db bit for bit as without it, in bf16 and
// fp16. Without the copy, the rounding pass sums db as it reads dout (no launch of its own for
// either): the same launches; without db, the rounding's launch more.
TEST(CudaBackend, LinearBackwardReadsTheOutputGradientsCopy) {
  SKIP_WITHOUT_GPU();
  const int64_t M = 70, N = 48, K = 96;
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    SCOPED_TRACE(name_of(p));
    Twin<float> in(random_vector(M * K, 1)), w(random_vector(N * K, 2, 0.1f)),
        dout(random_vector(M * N, 4));
    Twin<uint16_t> w16(N * K), a16(M * std::max(N, K)), b16(M * K), dout16(M * N);
    gpu().copy_weights(p, w.dev(), w16.dev(), N * K);
    gpu().round_to_16(p, dout16.dev(), dout.dev(), M * N, nullptr);
    const kernels::Weight wt{w.dev(), w16.dev()};
    const kernels::Workspace ws{a16.dev(), b16.dev(), nullptr};
    struct Grads {
      std::vector<float> dinp, dw, db;
      int64_t launches;
    };
    auto backward = [&](kernels::KeptIn d, bool bias = true) {
      Twin<float> dinp(random_vector(M * K, 5)), dw(random_vector(N * K, 6)),
          db(random_vector(N, 7));
      const int64_t before = cuda::device_counts().launches;
      gpu().linear_backward(p, dinp.dev(), dw.dev(), bias ? db.dev() : nullptr, d, Kept{in.dev()},
                            wt, M, N, K, true, ws);
      const int64_t launches = cuda::device_counts().launches - before;
      cuda::synchronize();
      return Grads{dinp.back(), dw.back(), db.back(), launches};
    };
    const Grads rounded = backward(dout.dev()), copied = backward({dout.dev(), dout16.dev()});
    EXPECT_EQ(copied.dinp, rounded.dinp);
    EXPECT_EQ(copied.dw, rounded.dw);
    EXPECT_EQ(copied.db, rounded.db);
    EXPECT_EQ(copied.launches, rounded.launches);
    const Grads rounded_nb = backward(dout.dev(), false),
                copied_nb = backward({dout.dev(), dout16.dev()}, false);
    EXPECT_EQ(rounded_nb.dinp, rounded.dinp);
    EXPECT_EQ(rounded_nb.dw, rounded.dw);
    EXPECT_EQ(copied_nb.launches + 1, rounded_nb.launches);
  }
}

// The residual block's backward given the projection's bias gradient (dbias) sums it in its one
// launch (the rows, dgamma and dbeta): every output bit for bit as the call without it followed
// by linear_backward's column sums of ddropped, one launch fewer; and as the CPU's within fp32
// summation order (rtol 2e-5). 300 rows: ten chunks of 30 (scratch.h, column_chunks), a block
// each, the last to finish adding them.
TEST(CudaBackend, ResidualBackwardSumsTheProjectionsBiasGradient) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 300, C = 96;
  const kernels::Dropout d{0.1f, 3, 17, nullptr};
  Twin<float> dout(random_vector(N * C, 1)), in(random_vector(N * C, 2)),
      gamma(random_vector(C, 3)), mean(random_vector(N, 4)), rstd(std::vector<float>(N, 1.3f));
  struct Grads {
    std::vector<float> dinp, ddropped, dgamma, dbeta, dbias;
    int64_t launches;
  };
  auto backward = [&](const kernels::Backend& be, bool fused) {
    const bool g = &be == &gpu();
    Twin<float> dinp(N * C), ddropped(N * C), dgamma(random_vector(C, 5)),
        dbeta(random_vector(C, 6)), dbias(random_vector(C, 7));
    auto P = [&](Twin<float>& t) { return g ? t.dev() : t.host(); };
    const int64_t before = cuda::device_counts().launches;
    be.layernorm_dropout_backward(Precision::FP32, P(dinp), Kept{P(ddropped)}, P(dgamma), P(dbeta),
                                  fused ? P(dbias) : nullptr, P(dout), P(in), P(gamma), P(mean),
                                  P(rstd), N, C, false, d);
    if (!fused) be.bias_gradient(P(dbias), P(ddropped), N, C);
    const int64_t launches = cuda::device_counts().launches - before;
    if (!g) return Grads{dinp.h, ddropped.h, dgamma.h, dbeta.h, dbias.h, 0};
    cuda::synchronize();
    return Grads{dinp.back(), ddropped.back(), dgamma.back(), dbeta.back(), dbias.back(), launches};
  };
  const Grads fused = backward(gpu(), true), apart = backward(gpu(), false),
              host = backward(cpu(), true);
  EXPECT_EQ(fused.dinp, apart.dinp);
  EXPECT_EQ(fused.ddropped, apart.ddropped);
  EXPECT_EQ(fused.dgamma, apart.dgamma);
  EXPECT_EQ(fused.dbeta, apart.dbeta);
  EXPECT_EQ(fused.dbias, apart.dbias);
  EXPECT_EQ(fused.launches + 1, apart.launches);
  EXPECT_TRUE(all_close("dbias", fused.dbias.data(), host.dbias.data(), C, 2e-5, 2e-5));
  EXPECT_TRUE(all_close("dgamma", fused.dgamma.data(), host.dgamma.data(), C, 2e-5, 2e-5));
}

// Where the products read 16-bit operands the model asks the residual block's backward for the
// output gradient's 16-bit copy alone (Kept{nullptr, bits}: nothing reads its fp32 values on a
// GPU): the copy, dinp, dgamma, dbeta and the bias gradient (summed from the dropout's gradient
// recomputed from dinp) bit for bit as the call that writes ddropped in fp32 too, in one launch
// each, bf16 and fp16, over ten chunks of 30 rows (300, column_chunks; dinp accumulated).
TEST(CudaBackend, ResidualBackwardWritesTheOutputGradientsCopyAlone) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 300, C = 80;
  const kernels::Dropout d{0.1f, 7, 23, nullptr};
  Twin<float> dout(random_vector(N * C, 1)), in(random_vector(N * C, 2)),
      gamma(random_vector(C, 3)), mean(random_vector(N, 4)), rstd(std::vector<float>(N, 0.8f));
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    SCOPED_TRACE(name_of(p));
    struct Grads {
      std::vector<float> dinp, dgamma, dbeta, dbias;
      std::vector<uint16_t> bits;
      int64_t launches;
    };
    auto backward = [&](bool fp32_too) {
      Twin<float> dinp(random_vector(N * C, 5)), ddropped(N * C), dgamma(random_vector(C, 6)),
          dbeta(random_vector(C, 7)), dbias(random_vector(C, 8));
      Twin<uint16_t> bits(N * C);
      const int64_t before = cuda::device_counts().launches;
      gpu().layernorm_dropout_backward(
          p, dinp.dev(), Kept{fp32_too ? ddropped.dev() : nullptr, bits.dev()}, dgamma.dev(),
          dbeta.dev(), dbias.dev(), dout.dev(), in.dev(), gamma.dev(), mean.dev(), rstd.dev(), N, C,
          /*accumulate_dinp=*/true, d);
      const int64_t launches = cuda::device_counts().launches - before;
      cuda::synchronize();
      return Grads{dinp.back(), dgamma.back(), dbeta.back(), dbias.back(), bits.back(), launches};
    };
    const Grads both = backward(true), alone = backward(false);
    EXPECT_EQ(alone.bits, both.bits);
    EXPECT_EQ(alone.dinp, both.dinp);
    EXPECT_EQ(alone.dgamma, both.dgamma);
    EXPECT_EQ(alone.dbeta, both.dbeta);
    EXPECT_EQ(alone.dbias, both.dbias);
    EXPECT_EQ(both.launches, 1);
    EXPECT_EQ(alone.launches, 1);
  }
}

// Attention forward and backward, with a padded sequence and dropout: the full kernel, and the
// blocked one at 150 tokens (a block of 128 query rows and one of 22: dV and dK added across
// blocks) against the CPU's blocked kernel, the row log-sum-exp it keeps included.
TEST(CudaBackend, AttentionMatchesCpuInEveryPrecision) {
  SKIP_WITHOUT_GPU();
  for (bool blocked : {false, true})
    for (Precision p : precisions()) {
      SCOPED_TRACE(testing::Message() << (blocked ? "blocked " : "full ") << name_of(p));
      const kernels::AttentionShape s{2, blocked ? 150 : 40, 64, 4};
      const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, n_qkv = B * T * 3 * C,
                    n_p = B * NH * T * T;
      std::vector<int32_t> mask_h(B * T, 1);
      for (int64_t t = T - 9; t < T; ++t) mask_h[T + t] = 0;
      const kernels::Dropout d{0.1f, 5, 11, nullptr};
      Twin<int32_t> mask(mask_h);
      Twin<float> qkv(random_vector(n_qkv, 1)), ctx(B * T * C), dctx(random_vector(B * T * C, 2)),
          dqkv(n_qkv), probs(n_p), work(n_p), wide(n_qkv), lse(B * NH * T);
      Twin<uint16_t> qkv16(n_qkv), probs16(n_p), scratch16(n_p), dctx16(B * T * C),
          ctx16(B * T * C);
      for (const kernels::Backend* be : {&cpu(), &gpu()}) {
        const bool g = be == &gpu();
        auto P = [&](auto& t) { return g ? t.dev() : t.host(); };
        const Kept x{P(qkv), p == Precision::FP32 ? nullptr : P(qkv16)};
        kernels::AttentionSaved saved;
        if (blocked) {
          saved.lse = P(lse);
          saved.ctx16 = P(ctx16);  // (where the GPU's fused kernel runs: FP16 here)
        } else if (p == Precision::FP32) {
          saved.probs = P(probs);
        } else {
          saved.probs16 = P(probs16);
        }
        kernels::Workspace ws;
        ws.attn_work = P(work);
        ws.attn_probs16 = P(scratch16);
        ws.attn_dctx16 = P(dctx16);
        ws.wide = P(wide);
        be->attention_forward(p, P(ctx), saved, x, P(mask), s, d, ws);
        be->attention_backward(p, P(dqkv), P(dctx), x, saved, P(mask), s, d, ws);
      }
      cuda::synchronize();
      const double t = tol(p);
      EXPECT_TRUE(all_close("ctx", ctx.back().data(), ctx.host(), ctx.h.size(), t, t));
      EXPECT_TRUE(all_close("dqkv", dqkv.back().data(), dqkv.host(), n_qkv, t, t));
      if (blocked)  // the log of a row sum: its scores' error (16-bit QK^T: the operands')
        EXPECT_TRUE(all_close("lse", lse.back().data(), lse.host(), lse.h.size(),
                              p == Precision::FP32 ? 1e-5 : t, 1e-5));
      else if (p == Precision::FP32)
        EXPECT_TRUE(all_close("probs", probs.back().data(), probs.host(), n_p, 2e-5, 1e-7));
      if (p != Precision::FP32) EXPECT_EQ(qkv16.back(), qkv16.h);  // QKV rounded the same way
    }
}

// A full attention in a 16-bit precision for the 16-bit dataflow's tests: 2 sequences of 40
// tokens, 4 heads of 16, dropout on; QKV (fresh values) with its bits, the kept probabilities and
// the workspace's operand scratch.
struct FullAttention16 {
  static constexpr kernels::AttentionShape s{2, 40, 64, 4};
  static constexpr int64_t n_qkv = s.B * s.T * 3 * s.C, n_c = s.B * s.T * s.C,
                           n_p = s.B * s.NH * s.T * s.T;
  const kernels::Dropout d{0.1f, 5, 11, nullptr};
  Twin<int32_t> mask{std::vector<int32_t>(s.B * s.T, 1)};
  Twin<float> qkv{random_vector(n_qkv, 1)}, wide{std::vector<float>(n_qkv)};
  Twin<uint16_t> qkv16{std::vector<uint16_t>(n_qkv)}, probs16{std::vector<uint16_t>(n_p)},
      scratch16{std::vector<uint16_t>(n_p)};
  kernels::AttentionSaved saved() {
    kernels::AttentionSaved a;
    a.probs16 = probs16.dev();
    return a;
  }
  kernels::Workspace ws(uint16_t* dctx16 = nullptr) {
    kernels::Workspace w;
    w.attn_probs16 = scratch16.dev();
    w.attn_dctx16 = dctx16;
    w.wide = wide.dev();
    return w;
  }
};

// The full attention's 16-bit context and QKV (the 16-bit dataflow with QKV's product writing its
// copy alone, ModelDims::qkv16_output): given the context's copy (ctx.bits), the context
// product writes it directly, rounded as keep rounds the fp32 context, and its fp32 values are
// left as they were; given QKV's bits without its fp32 values, attention reads the bits as they
// are (nothing rounded again). The same bits as the fp32 path's on the emulated device; on a GPU
// cuBLAS may sum in another order for a 16-bit output: one unit in the last place at most.
TEST(CudaBackend, FullAttentionWritesTheContextsCopyAndReadsQkvsBits) {
  SKIP_WITHOUT_GPU();
  using A = FullAttention16;
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    SCOPED_TRACE(name_of(p));
    const int64_t n_c = A::n_c;
    struct Run {
      std::vector<float> ctx;
      std::vector<uint16_t> ctx16;
    };
    auto run = [&](bool copy, bool bits_only) {
      A a;
      Twin<float> ctx(std::vector<float>(n_c, 7.0f));
      Twin<uint16_t> ctx16(n_c);
      if (bits_only) gpu().keep(p, Kept{a.qkv.dev(), a.qkv16.dev()}, A::n_qkv);
      const Kept x{bits_only ? nullptr : a.qkv.dev(), a.qkv16.dev()};
      gpu().attention_forward(p, Kept{ctx.dev(), copy ? ctx16.dev() : nullptr}, a.saved(), x,
                              a.mask.dev(), A::s, a.d, a.ws());
      if (!copy) gpu().keep(p, Kept{ctx.dev(), ctx16.dev()}, n_c);
      cuda::synchronize();
      return Run{ctx.back(), ctx16.back()};
    };
    const Run direct = run(true, false), rounded = run(false, false), bits = run(true, true);
    EXPECT_EQ(direct.ctx, std::vector<float>(n_c, 7.0f)) << "the fp32 context is not written";
    expect_rounded_alike(direct.ctx16, rounded.ctx16);
    EXPECT_EQ(bits.ctx16, direct.ctx16);
  }
}

// The full attention's backward given dctx's 16-bit copy alone (KeptIn{nullptr, bits}: what
// the output projection's linear_backward_16 writes where ModelDims::qkv16_output) reads it as
// its products' operand: dQKV, its copy and QKV's bias gradient bit for bit as from dctx's fp32
// values rounded by the backward itself, one launch fewer (that rounding's), bf16 and fp16.
TEST(CudaBackend, FullAttentionBackwardReadsDctxsCopy) {
  SKIP_WITHOUT_GPU();
  using A = FullAttention16;
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    SCOPED_TRACE(name_of(p));
    const int64_t n_qkv = A::n_qkv, n_c = A::n_c;
    A a;
    Twin<float> ctx(n_c), dctx(random_vector(n_c, 2));
    Twin<uint16_t> ctx16(n_c), dctx16(n_c), made16(n_c);
    const kernels::AttentionSaved saved = a.saved();
    const kernels::Workspace ws = a.ws(dctx16.dev());
    const Kept qkv{a.qkv.dev(), a.qkv16.dev()};
    gpu().attention_forward(p, Kept{ctx.dev(), ctx16.dev()}, saved, qkv, a.mask.dev(), A::s, a.d,
                            ws);
    gpu().round_to_16(p, made16.dev(), dctx.dev(), n_c, nullptr);
    struct Grads {
      std::vector<float> dqkv, dbias;
      std::vector<uint16_t> dqkv16;
      int64_t launches;
    };
    auto backward = [&](kernels::KeptIn dc) {
      Twin<float> dqkv(n_qkv), dbias(random_vector(3 * A::s.C, 3));
      Twin<uint16_t> dqkv16(n_qkv);
      const int64_t before = cuda::device_counts().launches;
      gpu().attention_bias_backward(p, Kept{dqkv.dev(), dqkv16.dev()}, dbias.dev(), dc, qkv, saved,
                                    a.mask.dev(), A::s, a.d, ws);
      const int64_t launches = cuda::device_counts().launches - before;
      cuda::synchronize();
      return Grads{dqkv.back(), dbias.back(), dqkv16.back(), launches};
    };
    const Grads rounded = backward(dctx.dev()), copy = backward({nullptr, made16.dev()});
    EXPECT_EQ(copy.dqkv, rounded.dqkv);
    EXPECT_EQ(copy.dqkv16, rounded.dqkv16);
    EXPECT_EQ(copy.dbias, rounded.dbias);
    EXPECT_EQ(copy.launches + 1, rounded.launches);
  }
}

// The fused attention (cuda/fused_attention.cu) against the blocked kernel's products, its
// reference, both on this device in BF16 and FP16 (no CPU bf16 needed): a padded sequence and
// dropout, head sizes 16 (a tile) and 64 (4 tiles), 40 tokens (a partial tile) and 150 (the
// reference's two blocks). Tolerances: a few units of the format, the two rounding the dropped
// probabilities and dS to 16 bits after products summed in another order; the row
// log-sum-exp's error is its scores' (rtol 1e-5 of the max, a 16-bit QK^T summed otherwise).
// The fused forward rounds QKV as it reads it and writes its kept bits (equal to keep's), and
// writes ctx's 16-bit copy (keep's contract: FP16's fp32 ctx the rounded value). Launches: one
// kernel forward (the products' version rounds QKV and ctx in launches of their own), one
// backward (its D = dO . O from that copy, where the products sum P g: within the tolerance).
// Head size 128 too (keys 32 at a time forward). On the emulated device, the tensor-core
// operations each kernel did are kernels::fused_attention_flops exactly (what the traffic model
// counts), lengths that are no multiple of the tiles included.
TEST(CudaBackend, FusedAttentionMatchesTheBlockedProducts) {
  SKIP_WITHOUT_GPU();
  struct Case {
    kernels::AttentionShape s;
  };
  for (const Case c : {Case{{2, 40, 64, 4}}, Case{{2, 150, 128, 2}}, Case{{1, 40, 256, 2}}})
    for (Precision p : {Precision::BF16, Precision::FP16}) {
      const kernels::AttentionShape s = c.s;
      SCOPED_TRACE(testing::Message() << name_of(p) << " T " << s.T << " head " << s.C / s.NH);
      ASSERT_TRUE(cuda::fused_attention_runs(p, s));
      const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, n_qkv = B * T * 3 * C;
      std::vector<int32_t> mask_h(B * T, 1);
      for (int64_t t = T - 9; t < T; ++t) mask_h[T + t] = 0;
      const kernels::Dropout d{0.1f, 5, 11, nullptr};
      Twin<int32_t> mask(mask_h);
      const std::vector<float> qkv_h = random_vector(n_qkv, 1),
                               dctx_h = random_vector(B * T * C, 2);
      struct Out {
        std::vector<float> ctx, dqkv, lse;
        std::vector<uint16_t> qkv16, ctx16;
        int64_t forward_launches, backward_launches;
        double forward_flops = 0, backward_flops = 0;
      };
      auto run = [&](bool fused) {
        cuda::set_fused_attention(fused);
#ifdef BT_EMULATED_DEVICE
        cuda_emu::set_touch_counting(true);
        cuda_emu::reset_touched();
#endif
        Twin<float> qkv(qkv_h), ctx(B * T * C), dctx(dctx_h), dqkv(n_qkv), lse(B * NH * T);
        Twin<uint16_t> qkv16(n_qkv), dctx16(B * T * C), ctx16(B * T * C);
        kernels::AttentionSaved saved;
        saved.lse = lse.dev();
        saved.ctx16 = ctx16.dev();
        kernels::Workspace ws;
        ws.attn_dctx16 = dctx16.dev();
        const int64_t l0 = cuda::device_counts().launches;
        gpu().attention_forward(p, {ctx.dev(), ctx16.dev()}, saved, {qkv.dev(), qkv16.dev()},
                                mask.dev(), s, d, ws);
        const int64_t l1 = cuda::device_counts().launches;
        gpu().attention_backward(p, dqkv.dev(), dctx.dev(), {qkv.dev(), qkv16.dev()}, saved,
                                 mask.dev(), s, d, ws);
        const int64_t l2 = cuda::device_counts().launches;
        cuda::synchronize();
        cuda::set_fused_attention(true);
        Out o{ctx.back(), dqkv.back(), lse.back(), qkv16.back(), ctx16.back(), l1 - l0, l2 - l1};
#ifdef BT_EMULATED_DEVICE
        const std::map<std::string, cuda_emu::Touched> t = cuda_emu::touched();
        cuda_emu::set_touch_counting(false);
        if (t.count("attention_forward_fused"))
          o.forward_flops = t.at("attention_forward_fused").flops;
        if (t.count("attention_backward_fused"))
          o.backward_flops = t.at("attention_backward_fused").flops;
#endif
        return o;
      };
      const Out fused = run(true), reference = run(false);
      EXPECT_EQ(fused.qkv16, reference.qkv16);
      for (size_t i = 0; i < fused.ctx.size(); ++i) {
        const float v = fused.ctx[i];
        ASSERT_EQ(fused.ctx16[i], p == Precision::BF16 ? f32_to_bf16(v) : f32_to_f16(v)) << i;
        if (p == Precision::FP16) ASSERT_EQ(v, f16_to_f32(fused.ctx16[i])) << i;
      }
      const double t = tol(p);
      EXPECT_TRUE(all_close("ctx", fused.ctx.data(), reference.ctx.data(), fused.ctx.size(), t, t));
      EXPECT_TRUE(
          all_close("dqkv", fused.dqkv.data(), reference.dqkv.data(), fused.dqkv.size(), t, t));
      EXPECT_TRUE(
          all_close("lse", fused.lse.data(), reference.lse.data(), fused.lse.size(), 1e-5, 1e-5));
      EXPECT_EQ(fused.forward_launches, 1);
      EXPECT_EQ(fused.backward_launches, 1);
#ifdef BT_EMULATED_DEVICE
      EXPECT_EQ(fused.forward_flops, kernels::fused_attention_flops(B, NH, T, C / NH, true));
      EXPECT_EQ(fused.backward_flops, kernels::fused_attention_flops(B, NH, T, C / NH, false));
#endif
      EXPECT_GT(reference.backward_launches, fused.backward_launches);
    }
}

// QKV and dctx given as their 16-bit copies alone (what the model's products write on a GPU:
// ModelDims::qkv16_output), and the context's copy alone asked for: the fused kernels read them
// as they are. Forward: the context's copy and the log-sum-exp bit for bit those of the same
// call given the fp32 values (which the kernel rounds to the same bits as it stages them), no
// fp32 context written, QKV's copy left as it was. Backward: dV
// bit for bit (dropped P^T dO: the same operands), dQ and dK within the 16-bit format's few
// units (each row's D = dO . O then sums the rounded dO: a relative change of at most the
// format's unit roundoff in D, which dS = P (g - D) carries). And dQKV's copy asked for alone
// (what the model asks on a GPU, whose products read only that): the same bits as beside the
// fp32 values, no fp32 dQKV written.
TEST(CudaBackend, FusedAttentionReadsQkvAndDctxsCopies) {
  SKIP_WITHOUT_GPU();
  const kernels::AttentionShape s{2, 72, 128, 2};
  const int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, n_qkv = B * T * 3 * C;
  const kernels::Dropout d{0.1f, 5, 11, nullptr};
  std::vector<int32_t> mask_h(B * T, 1);
  for (int64_t t = T - 5; t < T; ++t) mask_h[t] = 0;
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    SCOPED_TRACE(name_of(p));
    ASSERT_TRUE(cuda::fused_attention_runs(p, s));
    auto round = [&](const std::vector<float>& v) {
      std::vector<uint16_t> b(v.size());
      for (size_t i = 0; i < v.size(); ++i)
        b[i] = p == Precision::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
      return b;
    };
    const std::vector<float> qkv_h = random_vector(n_qkv, 1), dctx_h = random_vector(B * T * C, 2);
    Twin<int32_t> mask(mask_h);
    struct Out {
      std::vector<float> ctx, dqkv, lse;
      std::vector<uint16_t> ctx16, qkv16, dqkv16;
    };
    auto run = [&](bool copies, bool dqkv16_alone = false) {
      Twin<float> qkv(qkv_h), ctx(B * T * C), dctx(dctx_h), dqkv(n_qkv), lse(B * NH * T);
      Twin<uint16_t> qkv16(round(qkv_h)), dctx16(round(dctx_h)), ctx16(B * T * C), dqkv16(n_qkv);
      kernels::AttentionSaved saved;
      saved.lse = lse.dev();
      saved.ctx16 = ctx16.dev();
      const kernels::Workspace ws;
      const Kept x{copies ? nullptr : qkv.dev(), qkv16.dev()};
      const kernels::KeptIn g{copies ? nullptr : dctx.dev(), copies ? dctx16.dev() : nullptr};
      gpu().attention_forward(p, {copies ? nullptr : ctx.dev(), ctx16.dev()}, saved, x, mask.dev(),
                              s, d, ws);
      gpu().attention_bias_backward(p, {dqkv16_alone ? nullptr : dqkv.dev(), dqkv16.dev()}, nullptr,
                                    g, x, saved, mask.dev(), s, d, ws);
      cuda::synchronize();
      return Out{ctx.back(), dqkv.back(), lse.back(), ctx16.back(), qkv16.back(), dqkv16.back()};
    };
    const Out f32 = run(false), copies = run(true), alone = run(true, true);
    EXPECT_EQ(alone.dqkv16, copies.dqkv16);
    EXPECT_EQ(copies.dqkv16, round(copies.dqkv));
    EXPECT_EQ(alone.dqkv, std::vector<float>(alone.dqkv.size(), 0.0f)) << "(dQKV's copy alone)";
    EXPECT_EQ(copies.ctx, std::vector<float>(copies.ctx.size(), 0.0f)) << "(ctx's copy alone)";
    EXPECT_EQ(copies.ctx16, f32.ctx16);
    EXPECT_EQ(copies.lse, f32.lse);
    EXPECT_EQ(copies.qkv16, f32.qkv16);
    EXPECT_EQ(copies.qkv16, round(qkv_h));
    std::vector<float> qk[2], v[2];
    for (int k = 0; k < 2; ++k) {
      const std::vector<float>& x = k ? copies.dqkv : f32.dqkv;
      for (int64_t r = 0; r < B * T; ++r) {
        qk[k].insert(qk[k].end(), x.begin() + r * 3 * C, x.begin() + r * 3 * C + 2 * C);
        v[k].insert(v[k].end(), x.begin() + r * 3 * C + 2 * C, x.begin() + (r + 1) * 3 * C);
      }
    }
    EXPECT_EQ(v[1], v[0]);
    EXPECT_NE(qk[1], qk[0]) << "(dO rounded before D: some bits differ)";
    EXPECT_TRUE(all_close("dQ, dK", qk[1].data(), qk[0].data(), qk[0].size(), tol(p), tol(p)));
  }
}

// Variable lengths (AttentionShape::starts): 4 sequences of 40, 17, 33 and 40 tokens packed
// into 130 rows (a mask 0 inside one), in one call, equal bit for bit to a call per sequence
// (the same tiles and row passes over the same values), dropout keyed as the padded batch's.
TEST(CudaBackend, FusedAttentionTakesVariableLengthsInOneCall) {
  SKIP_WITHOUT_GPU();
  const int64_t T = 40, C = 128, NH = 2;
  const std::vector<int64_t> len = {40, 17, 33, 40};
  const int64_t B = static_cast<int64_t>(len.size());
  std::vector<int32_t> starts_h = {0};
  for (int64_t l : len) starts_h.push_back(starts_h.back() + static_cast<int32_t>(l));
  // (rows past the last sequence: zero in the one call's context and dQKV with their copies,
  // AttentionShape::starts; untouched by the calls a sequence)
  const int64_t real = starts_h.back(), rows = real + 70;
  std::vector<int32_t> mask_h(rows, 1);
  mask_h[starts_h[2] + 5] = 0;
  const kernels::Dropout d{0.1f, 5, 11, nullptr};
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    SCOPED_TRACE(name_of(p));
    const kernels::AttentionShape all{B, T, C, NH, T, nullptr, rows};
    ASSERT_TRUE(gpu().fused_attention(p, all));
    Twin<int32_t> mask(mask_h), starts(starts_h);
    struct Out {
      std::vector<float> ctx, dqkv, lse;
      std::vector<uint16_t> ctx16;
    };
    auto run = [&](bool one_call) {
      Twin<float> qkv(random_vector(rows * 3 * C, 1)), ctx(random_vector(rows * C, 3)),
          dctx(random_vector(rows * C, 2)), dqkv(random_vector(rows * 3 * C, 4)),
          lse(random_vector(rows * NH, 5));
      Twin<uint16_t> qkv16(rows * 3 * C), ctx16(std::vector<uint16_t>(rows * C, 0x3c00));
      const kernels::Workspace ws;
      auto call = [&](int64_t first, int64_t count, int64_t L, const int32_t* st) {
        const int64_t r0 = starts_h[first];
        kernels::AttentionShape s{count, L, C, NH, T, st, st ? rows : 0};
        const kernels::Dropout at{d.p, d.key, d.offset + first * NH * T * T, nullptr};
        kernels::AttentionSaved saved;
        saved.lse = lse.dev() + NH * r0;
        saved.ctx16 = ctx16.dev() + r0 * C;
        const Kept x{qkv.dev() + r0 * 3 * C, qkv16.dev() + r0 * 3 * C};
        gpu().attention_forward(p, ctx.dev() + r0 * C, saved, x, mask.dev() + r0, s, at, ws);
        gpu().attention_backward(p, dqkv.dev() + r0 * 3 * C, dctx.dev() + r0 * C, x, saved,
                                 mask.dev() + r0, s, at, ws);
      };
      if (one_call) {
        const int64_t l0 = cuda::device_counts().launches;
        call(0, B, T, starts.dev());
        EXPECT_EQ(cuda::device_counts().launches - l0, 2) << "a kernel forward, one backward";
      } else {
        for (int64_t b = 0; b < B; ++b) call(b, 1, len[b], nullptr);
      }
      cuda::synchronize();
      return Out{ctx.back(), dqkv.back(), lse.back(), ctx16.back()};
    };
    const Out one = run(true);
    Out each = run(false);
    auto zero_tail = [&](auto& v, int64_t width, auto& tail) {
      tail.assign(v.begin() + real * width, v.end());
      std::fill(v.begin() + real * width, v.end(), 0);
    };
    std::vector<float> tail;
    std::vector<uint16_t> tail16;
    zero_tail(each.ctx, C, tail);
    EXPECT_NE(tail, std::vector<float>(tail.size(), 0.0f)) << "(stale values to zero)";
    zero_tail(each.dqkv, 3 * C, tail);
    zero_tail(each.ctx16, C, tail16);
    EXPECT_EQ(one.ctx16, each.ctx16);
    EXPECT_EQ(one.ctx, each.ctx);
    EXPECT_EQ(one.dqkv, each.dqkv);
    EXPECT_EQ(one.lse, each.lse);
  }
}

// QKV's bias gradient and dQKV's 16-bit copy with attention's backward (attention_bias_backward):
// the fused kernel writes both as it writes dqkv (one launch; dqkv's fp32 values bit for bit as
// without them, the copy each value rounded, the bias its column sums within fp32 summation
// order: rtol 1e-5), for padded sequences and variable lengths (the rows between sequences left
// out), twice in a row (the tickets back at zero: the second call adds the same); the products'
// version rounds and sums in one pass more.
TEST(CudaBackend, AttentionBackwardWritesQkvsBiasGradientAndCopy) {
  SKIP_WITHOUT_GPU();
  const int64_t C = 64, NH = 4, T = 40;
  const std::vector<int32_t> starts_h = {0, 40, 57, 90};  // lengths 40, 17, 33; 6 rows after
  for (bool varlen : {false, true})
    for (bool fused : {true, false}) {
      if (varlen && !fused) continue;  // (variable lengths are the fused kernel's)
      const Precision p = Precision::BF16;
      SCOPED_TRACE(testing::Message()
                   << (varlen ? "variable lengths " : "padded ") << (fused ? "fused" : "products"));
      const int64_t B = varlen ? 3 : 2, rows = varlen ? starts_h.back() + 6 : B * T;
      Twin<int32_t> starts(starts_h);
      kernels::AttentionShape s{B, T, C, NH};
      if (varlen) {
        s.starts = starts.dev();
        s.rows = rows;
      }
      std::vector<int32_t> mask_h(rows, 1);
      mask_h[rows - 9] = 0;
      const kernels::Dropout d{0.1f, 5, 11, nullptr};
      Twin<int32_t> mask(mask_h);
      Twin<float> qkv(random_vector(rows * 3 * C, 1)), ctx(rows * C),
          dctx(random_vector(rows * C, 2)), lse(rows * NH), plain(rows * 3 * C), dqkv(rows * 3 * C),
          dbias(random_vector(3 * C, 3));
      Twin<uint16_t> qkv16(rows * 3 * C), ctx16(rows * C), dctx16(rows * C), dqkv16(rows * 3 * C);
      cuda::set_fused_attention(fused);
      kernels::AttentionSaved saved;
      saved.lse = lse.dev();
      saved.ctx16 = ctx16.dev();
      kernels::Workspace ws;
      ws.attn_dctx16 = dctx16.dev();
      const Kept x{qkv.dev(), qkv16.dev()};
      gpu().attention_forward(p, {ctx.dev(), ctx16.dev()}, saved, x, mask.dev(), s, d, ws);
      gpu().attention_backward(p, plain.dev(), dctx.dev(), x, saved, mask.dev(), s, d, ws);
      const int64_t l0 = cuda::device_counts().launches;
      for (int call = 0; call < 2; ++call)
        gpu().attention_bias_backward(p, {dqkv.dev(), dqkv16.dev()}, dbias.dev(), dctx.dev(), x,
                                      saved, mask.dev(), s, d, ws);
      const int64_t launches = cuda::device_counts().launches - l0;
      cuda::synchronize();
      cuda::set_fused_attention(true);
      const std::vector<float> got = dqkv.back(), bias = dbias.back();
      const std::vector<uint16_t> bits = dqkv16.back();
      EXPECT_EQ(got, plain.back());
      const int64_t used = varlen ? starts_h.back() : rows;
      for (int64_t i = 0; i < used * 3 * C; ++i) ASSERT_EQ(bits[i], f32_to_bf16(got[i])) << i;
      std::vector<float> want(3 * C);
      for (int64_t c = 0; c < 3 * C; ++c) {
        double sum = 0.0;
        for (int64_t r = 0; r < used; ++r) sum += got[r * 3 * C + c];
        want[c] = static_cast<float>(dbias.h[c] + 2.0 * sum);
      }
      EXPECT_TRUE(all_close("dbias", bias.data(), want.data(), 3 * C, 1e-5, 1e-5));
      // (the products' backward: its launches, then one pass for the bias and the copy, a call)
      if (fused) EXPECT_EQ(launches, 2) << "one launch a call";
    }
}

// The activation given its input's 16-bit copy alone (in.f32 null: what the FFN's intermediate
// product writes on a GPU, ModelDims::inter16_output) is the activation of that copy's value:
// bit for bit the call given those values in fp32, in bf16 and fp16; the copy is only read.
TEST(CudaBackend, ActivationReadsItsInputsCopy) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 3000;
  std::vector<float> x = random_vector(n, 5);
  for (float& v : x) v *= 6.0f;  // (GELU's tails too)
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    SCOPED_TRACE(name_of(p));
    std::vector<uint16_t> bits(n);
    std::vector<float> values(n);
    for (int64_t i = 0; i < n; ++i) {
      bits[i] = p == Precision::BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
      values[i] = p == Precision::BF16 ? bf16_to_f32(bits[i]) : f16_to_f32(bits[i]);
    }
    for (auto a : {kernels::Activation::GeluErf, kernels::Activation::GeluTanh}) {
      Twin<uint16_t> copy(bits), out_copy(n), out_values(n), kept(n);
      Twin<float> in(values);
      gpu().activation_forward(p, a, {nullptr, out_copy.dev()}, {nullptr, copy.dev()}, n);
      gpu().activation_forward(p, a, {nullptr, out_values.dev()}, {in.dev(), kept.dev()}, n);
      cuda::synchronize();
      EXPECT_EQ(out_copy.back(), out_values.back());
      EXPECT_EQ(copy.back(), bits);
      EXPECT_EQ(kept.back(), bits);  // (the rounded values' copy: the same bits)
    }
  }
}

// The 16-bit activations, the elementwise ops, the row gathers and the regression loss.
TEST(CudaBackend, ElementwiseAndRowOpsMatchCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 5000;
  for (Precision p : {Precision::FP32, Precision::BF16, Precision::FP16})
    for (auto a :
         {kernels::Activation::GeluErf, kernels::Activation::GeluTanh, kernels::Activation::Relu}) {
      SCOPED_TRACE(name_of(p));
      Twin<float> in(random_vector(n, 1, 2.0f)), out(n), dout(random_vector(n, 2)), dinp(n);
      Twin<uint16_t> in16(n), out16(n);
      for (const kernels::Backend* be : {&cpu(), &gpu()}) {
        const bool g = be == &gpu();
        auto P = [&](auto& t) { return g ? t.dev() : t.host(); };
        const bool f32 = p == Precision::FP32;
        be->activation_forward(p, a, Kept{P(out), f32 ? nullptr : P(out16)},
                               Kept{P(in), f32 ? nullptr : P(in16)}, n);
        be->activation_backward(p, a, P(dinp), Kept{P(in), f32 ? nullptr : P(in16)}, P(dout), n);
      }
      cuda::synchronize();
      if (p == Precision::BF16) {
        // bf16(act(x)): a one-unit difference where the two erf/tanh differ at a rounding edge;
        // in GELU's far negative tail (x < -4, outputs under 1e-5) the CPU's polynomial erf
        // (absolute error ~1e-7) leaves 1 + erf(x) a few units off after the cancellation, so
        // there the bound is absolute, 1e-6 (what the emulated device first showed: 5 units at
        // x = -4.6, where the GPU's erff gives the correctly rounded -8.94e-6)
        const auto o = out16.back();
        for (int64_t i = 0; i < n; ++i) {
          if (std::abs(bf16_to_f32(o[i]) - bf16_to_f32(out16.h[i])) <= 1e-6f) continue;
          ASSERT_LE(std::abs(int(o[i]) - int(out16.h[i])), 1)
              << i << " x " << in.h[i] << " gpu " << bf16_to_f32(o[i]) << " cpu "
              << bf16_to_f32(out16.h[i]);
        }
      } else {
        EXPECT_TRUE(all_close("act", out.back().data(), out.host(), n, 1e-3, 1e-6));
      }
      EXPECT_TRUE(all_close("dact", dinp.back().data(), dinp.host(), n, 1e-3, 1e-5));
    }
  // rows: gather the MLM positions, scatter their gradients back (a position twice)
  const int64_t B = 3, T = 16, C = 40, Pn = 4;
  Twin<float> seq(random_vector(B * T * C, 3)), rows(B * Pn * C),
      drows(random_vector(B * Pn * C, 4)), dseq(random_vector(B * T * C, 5)),
      pred(random_vector(50, 6)), target(random_vector(50, 7)), dpred(50), x(random_vector(n, 8)),
      y(random_vector(n, 9));
  Twin<int32_t> pos(std::vector<int32_t>{1, 5, 5, 15, 0, 2, 3, 4, 9, 9, 9, 1});
  double sq[2];
  for (const kernels::Backend* be : {&cpu(), &gpu()}) {
    const bool g = be == &gpu();
    auto P = [&](auto& t) { return g ? t.dev() : t.host(); };
    be->gather_rows(P(rows), P(seq), P(pos), B, Pn, T, C);
    be->scatter_add_rows(P(dseq), P(drows), P(pos), B, Pn, T, C);
    sq[g] = be->squared_error(P(dpred), P(pred), P(target), 50, 0.5f);
    be->dropout_backward(P(x), P(x), n, 1, kernels::Dropout{0.1f, 3, 4, nullptr});
    be->add_inplace(P(x), P(y), n);
    be->scale_inplace(P(x), n, 0.25f);
    be->tanh_forward(P(y), P(x), n);
  }
  cuda::synchronize();
  EXPECT_EQ(rows.back(), rows.h);
  EXPECT_EQ(dseq.back(), dseq.h);  // the same additions in the same order
  EXPECT_NEAR(sq[1], sq[0], 1e-9 * sq[0]);
  EXPECT_EQ(dpred.back(), dpred.h);
  EXPECT_EQ(x.back(), x.h);
  EXPECT_TRUE(all_close("tanh", y.back().data(), y.host(), n, 1e-6, 1e-7));
}

// Dropout with a row map (an unpadded model's rows drawing as their padded rows, one call for
// every sequence): row r's mask is the flat mask's row rows[r], on both backends, bit for bit;
// forward and backward the same mask.
TEST(CudaBackend, DropoutDrawsMappedRowsAsTheirRows) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 6, C = 40;
  Twin<int32_t> map(std::vector<int32_t>{3, 0, 7, 7, 1, 12});
  const kernels::Dropout d{0.25f, 11, 96, map.dev()}, dh{0.25f, 11, 96, map.host()};
  std::vector<float> dy = random_vector(N * C, 1), want(N * C);
  for (int64_t r = 0; r < N; ++r) {  // the flat kernel at the mapped row's place
    std::copy(dy.begin() + r * C, dy.begin() + (r + 1) * C, want.begin() + r * C);
    kernels::dropout_backward(want.data() + r * C, want.data() + r * C, C,
                              {0.25f, 11, 96 + static_cast<uint64_t>(map.h[r] * C)});
  }
  Twin<float> dx(N * C), dyt(dy), x(dy);
  cpu().dropout_backward(dx.host(), dyt.host(), N, C, dh);
  gpu().dropout_backward(dx.dev(), dyt.dev(), N, C, d);
  cpu().dropout_forward(x.host(), N, C, dh);
  gpu().dropout_forward(x.dev(), N, C, d);
  cuda::synchronize();
  EXPECT_EQ(dx.h, want);
  EXPECT_EQ(dx.back(), want);
  EXPECT_EQ(x.h, want);
  EXPECT_EQ(x.back(), want);
  int dropped = 0;
  for (float v : want) dropped += v == 0.0f;
  EXPECT_GT(dropped, 0);  // (the mask is not all ones)
}

// Embedding backward: the three tables' gradients, summed by the tokens grouped on the host
// (kernels::RowGrouping, as BertModel stages them). Ids repeat across sequences and one id
// (the padding's, say) fills half of every sequence: the word rows of one chunk and the
// positions (4 tokens each) are the CPU's additions in token order, the same bits; the long
// rows (that id, both token types: more than kEmbeddingChunk tokens) add chunks' partial
// sums, fp32 sums in another order (rtol 1e-5 and 1e-5 of the largest).
TEST(CudaBackend, EmbeddingBackwardMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const int64_t B = 4, T = 96, C = 200, V = 50, N = B * T;
  std::vector<int32_t> ids_h(N), seg_h(N);
  for (int64_t i = 0; i < N; ++i) {
    ids_h[i] = static_cast<int32_t>(i % T >= T / 2 ? 0 : 1 + (i * 11) % (V - 1));
    seg_h[i] = static_cast<int32_t>(i % 3 == 0);
  }
  Twin<int32_t> ids(ids_h), seg(seg_h);
  Twin<float> dout(random_vector(N * C, 1)), dword(random_vector(V * C, 2)),
      dpos(random_vector(T * C, 3)), dtype(random_vector(2 * C, 4));
  kernels::RowGrouping by_word, by_position, by_type;
  by_word.build(ids_h.data(), T, N, V);
  by_position.build(nullptr, T, N, T);
  by_type.build(seg_h.data(), T, N, 2);
  std::vector<Twin<int32_t>> orders;
  std::vector<Twin<kernels::EmbeddingChunk>> chunks;
  std::vector<Twin<kernels::EmbeddingSum>> sums;
  kernels::EmbeddingRuns runs;
  for (auto [g, r] : {std::pair{&by_word, &runs.word}, std::pair{&by_position, &runs.position},
                      std::pair{&by_type, &runs.token_type}}) {
    r->order = orders.emplace_back(g->order()).dev();
    r->chunks = chunks.emplace_back(g->chunks()).dev();
    r->sums = sums.emplace_back(g->sums()).dev();
    r->num_chunks = static_cast<int64_t>(g->chunks().size());
    r->num_sums = static_cast<int64_t>(g->sums().size());
    r->partials = g->partials();
  }
  ASSERT_EQ(runs.word.num_sums, 1);        // the id filling half of each sequence
  ASSERT_EQ(runs.token_type.num_sums, 2);  // both types
  for (const kernels::Backend* be : {&cpu(), &gpu()}) {
    const bool g = be == &gpu();
    auto P = [&](auto& t) { return g ? t.dev() : t.host(); };
    be->embedding_backward(P(dword), P(dpos), P(dtype), P(dout), P(ids), P(seg), nullptr, B, T, C,
                           g ? &runs : nullptr);
  }
  cuda::synchronize();
  const std::vector<float> word = dword.back();
  for (int64_t v = 1; v < V; ++v)
    for (int64_t c = 0; c < C; ++c)
      ASSERT_EQ(word[v * C + c], dword.h[v * C + c]) << "word row " << v << " column " << c;
  EXPECT_TRUE(all_close("dword", word.data(), dword.host(), word.size(), 1e-5, 1e-5));
  EXPECT_EQ(dpos.back(), dpos.h);
  EXPECT_TRUE(all_close("dtoken_type", dtype.back().data(), dtype.host(), 2 * C, 1e-5, 1e-5));
}

// The input slots' copies (Backend::upload) run beside the kernels, on a stream of their own:
// with about 100 GiB of memsets queued ahead on the kernels' stream (tens of milliseconds on a
// GPU of a few TB/s), a 1 MiB copy into a slot has run when wait_upload returns while that
// work still runs (an order, not a time: the copy is ~1000x shorter). Kernels after use_input
// read what it copied. Once release_input marks the kernels issued so far as the slot's last
// readers, the next copy into it waits for them.
TEST(CudaBackend, InputCopiesRunBesideTheKernels) {
  SKIP_WITHOUT_GPU();
  const kernels::Backend& be = gpu();
  const size_t big = size_t{1} << 30, bytes = size_t{1} << 20;
  void* work = be.allocate(big);
  void* slot = be.allocate(bytes);
  auto* staging = static_cast<int32_t*>(be.allocate_host(bytes));
  std::vector<int32_t> v(bytes / 4);
  cudaEvent_t queued = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&queued, cudaEventDisableTiming), cudaSuccess);
  auto queue_work = [&] {
    for (int i = 0; i < 100; ++i) be.zero(work, static_cast<int64_t>(big));
    ASSERT_EQ(cudaEventRecord(queued, nullptr), cudaSuccess);
  };
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(i * 7 + 1);
  std::copy(v.begin(), v.end(), staging);
  queue_work();
  be.upload(slot, staging, bytes);
  be.wait_upload(slot);
  EXPECT_EQ(cudaEventQuery(queued), cudaErrorNotReady)
      << "the copy waited for the kernels queued before it";
  be.use_input(slot);
  std::vector<int32_t> back(v.size());
  be.to_host(back.data(), slot, bytes);
  EXPECT_EQ(back, v);
  queue_work();
  be.release_input(slot);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(i * 3 + 2);
  std::copy(v.begin(), v.end(), staging);
  be.upload(slot, staging, bytes);
  be.wait_upload(slot);
  EXPECT_EQ(cudaEventQuery(queued), cudaSuccess)
      << "the copy into a released slot ran before the kernels that last read it";
  be.use_input(slot);
  be.to_host(back.data(), slot, bytes);
  EXPECT_EQ(back, v);
  be.synchronize();
  cudaEventDestroy(queued);
  be.release_host(staging);
  be.release(slot);
  be.release(work);
}

}  // namespace
}  // namespace bertrain
