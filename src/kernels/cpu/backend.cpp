// The CPU backend: kernels/backend.h's table filled with this directory's kernels, which take the
// interface's own operands and dispatch, each in one place, on the precision and on the CPU's
// ISA; oneDNN's matmuls.
#include "kernels/backend.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/isa.h"
#include "core/parallel.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/scratch.h"

namespace bertrain::kernels {

namespace {

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }

  ScratchLayout scratch_layout(const KernelShapes& k) const override {
    ScratchLayout l;
    l.threads = omp_get_max_threads();
    const bool bf16 = k.precision == Precision::BF16;
    // oneDNN's scratchpad for each product the model makes, from the kernels' own calls (their
    // primitives made now and cached for the run). Without a bf16 matmul on this CPU no bf16
    // product can run (an error of its own, kernels/cpu/matmul.cpp): nothing to plan for them.
    const bool products = !bf16 || gemm_bf16_available();
    for (int64_t i = 0; products && i < k.num_linears; ++i) {
      const LinearShape& x = k.linears[i];
      l.caller = std::max(l.caller, linear_scratch_bytes(bf16, x.M, x.N, x.K));
    }
    AttentionScratch a;
    if (k.attention.B > 0) {  // (fp32 rows without a bf16 matmul: larger, and never run)
      a = attention_scratch(k.attention, bf16 && products, k.blocked_attention);
      l.caller = std::max(l.caller, a.caller_gemm);
    }
    auto part = [&](ScratchPart p) -> int64_t& { return l.part[static_cast<int>(p)]; };
    part(ScratchPart::Gemm) = a.thread_gemm;
    part(ScratchPart::AttentionRows) = a.rows;
    part(ScratchPart::MaskRow) = a.mask_row;
    part(ScratchPart::LayerNorm) = 2 * k.layernorm_width * int64_t{sizeof(float)};
    part(ScratchPart::Optimizer) = 2 * int64_t{sizeof(double)};  // LAMB's two norms
    return l;
  }

  void bind_scratch(void* region, const ScratchLayout& layout) const override {
    kernels::bind_scratch(static_cast<std::byte*>(region), layout);
  }
  int64_t unplanned_scratch_bytes() const override { return kernels::unplanned_scratch_bytes(); }

  std::string description() const override { return cpu_description(); }
  std::string device_name() const override { return cpu_model_name(); }
  bool runs(Precision p) const override { return p != Precision::BF16 || gemm_bf16_available(); }
  std::string precision_note(Precision p) const override {
    return p == Precision::BF16 ? bf16_speed_note() : "";
  }
  // The fastest run of the product (a ceiling: noise from the rest of the machine must not lower
  // it), bf16 operands in BF16, fp32 otherwise (the CPU's FP16 computes in fp32).
  double gemm_peak_gflops(Precision p, int64_t M, int64_t N, int64_t K,
                          double seconds) const override {
    const bool bf16 = p == Precision::BF16;
    std::vector<float> a(M * K, 0.01f), w(N * K, 0.02f), c(M * N);
    std::vector<uint16_t> a16(bf16 ? M * K : 0, 0x3c23), w16(bf16 ? N * K : 0, 0x3ca3);
    auto run = [&] {
      if (bf16)
        gemm(false, true, M, N, K, a16.data(), K, w16.data(), K, c.data(), N, nullptr, false);
      else
        kernels::linear_forward(c.data(), a.data(), w.data(), nullptr, M, N, K);
    };
    using Clock = std::chrono::steady_clock;
    auto since = [](Clock::time_point t) {
      return std::chrono::duration<double>(Clock::now() - t).count();
    };
    run();  // create the primitive
    double best = 1e30;
    const auto start = Clock::now();
    do {
      const auto t0 = Clock::now();
      run();
      best = std::min(best, since(t0));
    } while (since(start) < seconds);
    return 2.0 * M * N * K / best / 1e9;
  }

  void round_to_16(Precision p, uint16_t* dst, const float* src, int64_t n,
                   void* /*queue*/) const override {
    BT_CHECK(p != Precision::FP32, "round_to_16: fp32 is not a 16-bit precision");
    (p == Precision::FP16 ? convert_f32_to_f16 : convert_f32_to_bf16)(src, dst, n);
  }
  void widen_from_16(Precision p, float* dst, const uint16_t* src, int64_t n,
                     void* /*queue*/) const override {
    BT_CHECK(p != Precision::FP32, "widen_from_16: fp32 is not a 16-bit precision");
    (p == Precision::FP16 ? convert_f16_to_f32 : convert_bf16_to_f32)(src, dst, n);
  }
  void scale_on(float* x, int64_t n, float s, void* /*queue*/) const override {
    scale_inplace(x, n, s);
  }

  void linear_forward(Precision p, float* out, Kept in, Weight w, const float* bias, int64_t M,
                      int64_t N, int64_t K, const Workspace& ws) const override {
    kernels::linear_forward(p, out, in, w, bias, M, N, K, ws);
  }
  void linear_backward(Precision p, float* dinp, float* dw, float* db, KeptIn dout, Kept in,
                       Weight w, int64_t M, int64_t N, int64_t K, bool accumulate_dinp,
                       const Workspace& ws) const override {
    kernels::linear_backward(p, dinp, dw, db, dout, in, w, M, N, K, accumulate_dinp, ws);
  }
  void keep(Precision p, Kept x, int64_t n) const override { kernels::keep(p, x, n); }
  void copy_weights(Precision p, const float* master, uint16_t* copy, int64_t n) const override {
    kernels::copy_weights(p, master, copy, n);
  }
  void attention_forward(Precision p, Kept ctx, AttentionSaved saved, Kept qkv, const int32_t* mask,
                         const AttentionShape& s, const Dropout& d,
                         const Workspace& ws) const override {
    kernels::attention_forward(p, ctx.f32, saved, qkv, mask, s, d, ws);
    if (ctx.bits) keep(p, ctx, s.B * s.T * s.C);
  }
  void attention_backward(Precision p, float* dqkv, const float* dctx, Kept qkv,
                          AttentionSaved saved, const int32_t* mask, const AttentionShape& s,
                          const Dropout& d, const Workspace& ws) const override {
    kernels::attention_backward(p, dqkv, dctx, qkv, saved, mask, s, d, ws);
  }
  void activation_forward(Precision p, Activation a, Kept out, Kept in, int64_t n) const override {
    kernels::activation_forward(p, a, out, in, n);
  }
  void activation_backward(Precision p, Activation a, float* dinp, Kept in, const float* dout,
                           int64_t n) const override {
    kernels::activation_backward(p, a, dinp, in, dout, n);
  }

  void tanh_forward(float* out, const float* in, int64_t n) const override {
    kernels::tanh_forward(out, in, n);
  }
  void tanh_backward(float* dinp, const float* out, const float* dout, int64_t n) const override {
    kernels::tanh_backward(dinp, out, dout, n);
  }

  void embedding_layernorm_forward(float* out, float* sum, float* mean, float* rstd,
                                   const int32_t* ids, const int32_t* segment,
                                   const int32_t* positions, const float* word,
                                   const float* position, const float* token_type,
                                   const float* gamma, const float* beta, int64_t B, int64_t T,
                                   int64_t C, float eps, const Dropout& d) const override {
    kernels::embedding_layernorm_forward(out, sum, mean, rstd, ids, segment, positions, word,
                                         position, token_type, gamma, beta, B, T, C, eps, d);
  }
  void embedding_backward(
      float* dword, float* dposition, float* dtoken_type, const float* dout, const int32_t* ids,
      const int32_t* segment, const int32_t* positions, int64_t B, int64_t T, int64_t C,
      const EmbeddingRuns* /*runs: channels over threads instead*/) const override {
    kernels::embedding_backward(dword, dposition, dtoken_type, dout, ids, segment, positions, B, T,
                                C);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* in, const float* gamma,
                         const float* beta, int64_t N, int64_t C, float eps) const override {
    kernels::layernorm_forward(out, mean, rstd, in, gamma, beta, N, C, eps);
  }
  void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                          const float* in, const float* gamma, const float* mean, const float* rstd,
                          int64_t N, int64_t C) const override {
    kernels::layernorm_backward(dinp, dgamma, dbeta, dout, in, gamma, mean, rstd, N, C);
  }
  void residual_layernorm_forward(Precision p, Kept out, float* mean, float* rstd, float* x,
                                  const float* residual, const float* gamma, const float* beta,
                                  int64_t N, int64_t C, float eps,
                                  const Dropout& d) const override {
    kernels::residual_layernorm_forward(out.f32, mean, rstd, x, residual, gamma, beta, N, C, eps,
                                        d);
    if (out.bits && p != Precision::FP32) round_to_16(p, out.bits, out.f32, N * C, nullptr);
  }
  void layernorm_dropout_backward(Precision p, float* dinp, Kept ddropped, float* dgamma,
                                  float* dbeta, float* dbias, const float* dout, const float* in,
                                  const float* gamma, const float* mean, const float* rstd,
                                  int64_t N, int64_t C, bool accumulate_dinp,
                                  const Dropout& d) const override {
    BT_CHECK(!dbias || ddropped.f32,
             "layernorm_dropout_backward: a bias gradient without ddropped");
    kernels::layernorm_dropout_backward(dinp, ddropped.f32, dgamma, dbeta, dout, in, gamma, mean,
                                        rstd, N, C, accumulate_dinp, d);
    rounded_column_sums(p, dbias, ddropped, N, C);
  }

  void dropout_forward(float* x, int64_t N, int64_t C, const Dropout& d) const override {
    kernels::dropout_forward(x, N, C, d);
  }
  void dropout_backward(float* dx, const float* dy, int64_t N, int64_t C,
                        const Dropout& d) const override {
    kernels::dropout_backward(dx, dy, N, C, d);
  }
  void add_inplace(float* out, const float* a, int64_t n) const override {
    kernels::add_inplace(out, a, n);
  }
  void scale_inplace(float* x, int64_t n, Multiplier s) const override {
    const float f = s.value();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) x[i] *= f;
  }
  void zero(void* p, int64_t bytes) const override {
    // Every thread clears its share (BERT-base gradients: 420 MiB every step, 9 ms on one thread
    // of our 2-core machines, 5.5 ms on two).
    std::byte* b = static_cast<std::byte*>(p);
    parallel_chunks(bytes, [&](int64_t lo, int64_t hi) {
      std::memset(b + lo, 0, static_cast<size_t>(hi - lo));
    });
  }

  CrossEntropySums cross_entropy(float* dlogits, float* losses, int32_t* correct,
                                 const float* logits, const int32_t* targets, const float* weights,
                                 int64_t N, Classes c, Multiplier dscale) const override {
    CrossEntropySums s;
    const double loss = cross_entropy_forward_backward(dlogits, losses, correct, logits, targets,
                                                       weights, N, c, dscale.value());
    if (!losses) return s;  // (a gradient-only call: no sums, as on a GPU)
    s.loss = loss;
    if (correct)
      for (int64_t i = 0; i < N; ++i) s.correct += (weights ? weights[i] : 1.0) * correct[i];
    return s;
  }

  double squared_error(float* dpred, const float* pred, const float* target, int64_t N,
                       Multiplier dscale) const override {
    double sum = 0;
    const float f = dscale.value();
    for (int64_t i = 0; i < N; ++i) {
      const float d = pred[i] - target[i];
      sum += static_cast<double>(d) * d;
      if (dpred) dpred[i] = f * 2.0f * d;
    }
    return sum;
  }

  void copy(float* dst, const float* src, int64_t n) const override {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }

  void gather_rows(float* out, const float* seq, const int32_t* positions, int64_t B, int64_t P,
                   int64_t T, int64_t C) const override {
    for (int64_t r = 0; r < B * P; ++r)
      std::memcpy(out + r * C, seq + ((r / P) * T + (positions ? positions[r] : 0)) * C,
                  static_cast<size_t>(C) * sizeof(float));
  }

  void scatter_add_rows(float* dseq, const float* d, const int32_t* positions, int64_t B, int64_t P,
                        int64_t T, int64_t C) const override {
    // One sequence per thread: its rows are its own, so repeated positions add in order.
#pragma omp parallel for schedule(static) if (B * P * C > 65536)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < P; ++j) {
        const int64_t r = b * P + j;
        float* dst = dseq + (b * T + (positions ? positions[r] : 0)) * C;
        const float* src = d + r * C;
        for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
      }
  }

  void add_sum_squares(double& sum, const float* g, int64_t n, double scale) const override {
    kernels::add_sum_squares(sum, g, n, scale);
  }
  void adamw_update(const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m, float* v,
                    int64_t n) const override {
    kernels::adamw_update(a, p, p16, g, m, v, n);
  }
  void lamb_update(const LambStep& a, float* p, uint16_t* p16, const float* g, float* m, float* v,
                   int64_t n) const override {
    kernels::lamb_update(a, p, p16, g, m, v, n);
  }
  void lamb_moments(const LambStep& a, const float* p, const float* g, float* m, float* v,
                    int64_t n, double& pn, double& un) const override {
    kernels::lamb_moments(a, p, g, m, v, n, pn, un);
  }
  void lamb_apply(const LambStep& a, float* p, uint16_t* p16, const float* m, const float* v,
                  int64_t n, float step) const override {
    kernels::lamb_apply(a, p, p16, m, v, n, step);
  }
};

}  // namespace

void* Backend::allocate(size_t bytes) const {
  fail("the ", name(), " backend reads host memory: its models allocate their own arenas (", bytes,
       " bytes asked for)");
}

void* Backend::allocate_for(size_t bytes, const std::string& what) const {
  try {
    return allocate(bytes);
  } catch (const Error& e) {
    fail(what, " on the ", name(), " device: ", e.what(), "; `bertrain estimate --device ", name(),
         "` prints the plan and the largest batch that fits");
  }
}

void Backend::release(void*) const {}

void* Backend::allocate_host(size_t bytes) const {
  return ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{256});
}

void Backend::release_host(void* p) const {
  ::operator delete (p, std::align_val_t{256});
}

namespace {
// A loss's sums added where `into` says (a backend's memory, through to_host / to_device): the
// defaults of cross_entropy_into and squared_error_into.
void add_sums(const Backend& be, const SumsInto& into, double loss, double hits) {
  auto add = [&](double* to, double v) {
    if (!to) return;
    double h = 0;
    be.to_host(&h, to, sizeof h);
    h += v;
    be.to_device(to, &h, sizeof h);
  };
  double divisor = into.loss_divisor;  // (the step's arguments' where given: its memory's)
  if (into.divisor_at) be.to_host(&divisor, into.divisor_at, sizeof divisor);
  add(into.loss, loss / divisor);
  add(into.hits, hits);
  if (!std::isfinite(loss)) add(into.nonfinite, 1.0);
}
}  // namespace

void Backend::cross_entropy_into(const SumsInto& into, float* dlogits, float* losses,
                                 int32_t* correct, const float* logits, const int32_t* targets,
                                 const float* weights, int64_t N, Classes c,
                                 Multiplier dscale) const {
  const CrossEntropySums s =
      cross_entropy(dlogits, losses, correct, logits, targets, weights, N, c, dscale);
  add_sums(*this, into, s.loss, s.correct);
}

void Backend::squared_error_into(const SumsInto& into, float* dpred, const float* pred,
                                 const float* target, int64_t N, Multiplier dscale) const {
  SumsInto loss_only = into;
  loss_only.hits = nullptr;
  add_sums(*this, loss_only, squared_error(dpred, pred, target, N, dscale), 0.0);
}

void Backend::linear_forward_16(Precision, uint16_t*, Kept, Weight, const uint16_t*, int64_t,
                                int64_t, int64_t, const Workspace&) const {
  fail("linear_forward_16: the ", name(),
       " backend writes no 16-bit product outputs (Target::writes_16bit_outputs)");
}

void Backend::residual_layernorm_forward_16(Precision, Kept, float*, float*, float*,
                                            const uint16_t*, const float*, const float*,
                                            const float*, int64_t, int64_t, float,
                                            const Dropout&) const {
  fail("residual_layernorm_forward_16: the ", name(),
       " backend writes no 16-bit product outputs (Target::writes_16bit_outputs)");
}

void Backend::activation_bias_backward(Precision p, Activation a, Kept dinp, float* db, Kept in,
                                       KeptIn dout, int64_t M, int64_t N) const {
  BT_CHECK(dout.f32, "activation_bias_backward: the ", name(),
           " backend reads dout's fp32 values (given only its 16-bit copy)");
  activation_backward(p, a, dinp.f32, in, dout.f32, M * N);
  rounded_column_sums(p, db, dinp, M, N);
}

void Backend::linear_backward_16(Precision, uint16_t*, float*, float*, KeptIn, Kept, Weight,
                                 int64_t, int64_t, int64_t, const Workspace&) const {
  fail("linear_backward_16: the ", name(),
       " backend writes no 16-bit product outputs (Target::writes_16bit_outputs)");
}

void Backend::attention_bias_backward(Precision p, Kept dqkv, float* dbias, KeptIn dctx, Kept qkv,
                                      AttentionSaved saved, const int32_t* mask,
                                      const AttentionShape& s, const Dropout& d,
                                      const Workspace& ws) const {
  BT_CHECK(dctx.f32, "attention_bias_backward: the ", name(),
           " backend reads dctx's fp32 values (given only its 16-bit copy)");
  attention_backward(p, dqkv.f32, dctx.f32, qkv, saved, mask, s, d, ws);
  if (!dbias && !dqkv.bits) return;
  BT_CHECK(!s.starts,
           "attention_bias_backward: variable lengths (AttentionShape::starts) leave rows "
           "between the sequences, which only a fused kernel's own sums skip");
  rounded_column_sums(p, dbias, dqkv, s.B * s.T, 3 * s.C);
}

void Backend::bias_gradient(float* db, const float* dout, int64_t M, int64_t N) const {
  // (fp32's bias gradient alone: the column sums every precision's linear_backward adds)
  linear_backward(Precision::FP32, nullptr, nullptr, db, KeptIn{dout}, Kept{}, Weight{}, M, N, 0,
                  false, Workspace{});
}

void Backend::rounded_column_sums(Precision p, float* db, Kept x, int64_t M, int64_t N) const {
  if (db) bias_gradient(db, x.f32, M, N);
  if (x.bits && p != Precision::FP32) round_to_16(p, x.bits, x.f32, M * N, nullptr);
}

void Backend::begin_capture() const {
  fail("the ", name(), " backend has no graphs to capture (Backend::graphs)");
}
std::shared_ptr<void> Backend::end_capture() const {
  fail("the ", name(), " backend has no graphs to capture (Backend::graphs)");
}
void Backend::launch_graph(const std::shared_ptr<void>&) const {
  fail("the ", name(), " backend has no graphs to launch (Backend::graphs)");
}

int64_t Backend::mark() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Backend::seconds_between(int64_t a, int64_t b) const {
  return static_cast<double>(b - a) * 1e-9;
}

void Backend::add_sum_squares(double& sum, const float* g, const TensorSpan* t, int64_t count,
                              double scale) const {
  for (int64_t i = 0; i < count; ++i) add_sum_squares(sum, g + t[i].offset, t[i].n, scale);
}

namespace {

// An update over the spans (Backend::adamw_update, lamb_update): each span's step as given
// without a gate; with one, read from the backend's memory: nothing when it skips the update,
// else each step under it (types.h gated: the gate's factor and update count).
template <class StepArgs, class Update>
void gated_update(const Backend& be, const StepArgs* a, int64_t count, const GradientGate* gate,
                  const Update& update) {
  GradientGate h;
  if (gate && be.host_memory())
    h = *gate;
  else if (gate)
    be.to_host(&h, gate, sizeof h);
  if (!h.apply) return;
  for (int64_t i = 0; i < count; ++i) update(i, gate ? gated(a[i], h) : a[i]);
}

}  // namespace

void Backend::adamw_update(const AdamwStep* a, float* p, uint16_t* p16, const float* g, float* m,
                           float* v, const TensorSpan* t, int64_t count,
                           const GradientGate* gate) const {
  gated_update(*this, a, count, gate, [&](int64_t i, const AdamwStep& s) {
    adamw_update(s, p + t[i].offset, p16 ? p16 + t[i].offset : nullptr, g + t[i].offset,
                 m + t[i].state, v + t[i].state, t[i].n);
  });
}

void Backend::lamb_update(const LambStep* a, float* p, uint16_t* p16, const float* g, float* m,
                          float* v, const TensorSpan* t, int64_t count,
                          const GradientGate* gate) const {
  gated_update(*this, a, count, gate, [&](int64_t i, const LambStep& s) {
    lamb_update(s, p + t[i].offset, p16 ? p16 + t[i].offset : nullptr, g + t[i].offset,
                m + t[i].state, v + t[i].state, t[i].n);
  });
}

void Backend::gate_gradients(GradientGate* gate, const float* g, const TensorSpan* t, int64_t count,
                             float unscale, float max_norm) const {
  GradientGate prev;
  if (host_memory())
    prev = *gate;
  else
    to_host(&prev, gate, sizeof prev);
  double sum = 0;
  add_sum_squares(sum, g, t, count, unscale_by(unscale, prev.scale));
  const GradientGate h = next_gate(prev, sum, unscale, max_norm);
  if (host_memory())
    *gate = h;
  else
    to_device(gate, &h, sizeof h);
}

void Backend::lamb_moments(const LambStep* a, const float* p, const float* g, float* m, float* v,
                           const TensorSpan* t, int64_t count, double* pn, double* un) const {
  for (int64_t i = 0; i < count; ++i)
    lamb_moments(a[i], p + t[i].offset, g + t[i].offset, m + t[i].state, v + t[i].state, t[i].n,
                 pn[i], un[i]);
}

void Backend::lamb_apply(const LambStep* a, float* p, uint16_t* p16, const float* m, const float* v,
                         const TensorSpan* t, int64_t count, const float* step) const {
  for (int64_t i = 0; i < count; ++i)
    lamb_apply(a[i], p + t[i].offset, p16 ? p16 + t[i].offset : nullptr, m + t[i].state,
               v + t[i].state, t[i].n, step[i]);
}

const Backend& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

}  // namespace bertrain::kernels
