#include "kernels/cpu/matmul.h"

#include "kernels/cpu/elementwise.h"

#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <dnnl.hpp>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/isa.h"
#include "core/setting.h"
#include "kernels/cpu/scratch.h"

namespace bertrain::kernels {
namespace {

using dims = dnnl::memory::dims;
using dt = dnnl::memory::data_type;

struct GemmKey {
  bool ta, tb, acc, bias;
  int64_t M, N, K, lda, ldb, ldc;
  bool bf16 = false;                          // A and B in bf16 (fp32 accumulation and output)
  int64_t batch = 1, sa = 0, sb = 0, sc = 0;  // batched: matrix i at A + i*sa, ...
  float alpha = 1.0f;
  int64_t outer = 1, oa = 0, ob = 0, oc = 0;  // outer batch: group g at A + g*oa, ...
  auto tie() const {
    return std::tie(ta, tb, acc, bias, M, N, K, lda, ldb, ldc, bf16, batch, sa, sb, sc, alpha,
                    outer, oa, ob, oc);
  }
  bool operator<(const GemmKey& o) const { return tie() < o.tie(); }
};

struct GemmPrim {
  dnnl::matmul prim;
  dnnl::memory::desc a_md, b_md, c_md, bias_md, scratch_md;
};

dnnl::engine& cpu_engine() {
  // A BERTRAIN_ISA cap must reach oneDNN before its first primitive (later calls are ignored).
  static const bool capped = [] {
    if (!isa_capped_by_env()) return false;
    try {
      dnnl::set_max_cpu_isa(cpu_isa() == Isa::Avx2 ? dnnl::cpu_isa::avx2 : dnnl::cpu_isa::sse41);
    } catch (const dnnl::error&) {
      return false;
    }
    return true;
  }();
  (void)capped;
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

const GemmPrim& get_prim(const GemmKey& k);

}  // namespace

const char* gemm_isa_name() {
  cpu_engine();  // applies the BERTRAIN_ISA cap first
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

bool gemm_bf16_available() {
  static const bool ok = [] {
    try {
      const dnnl::memory::desc md({2, 2}, dt::bf16, dims{2, 1}), out({2, 2}, dt::f32, dims{2, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(md, md, out), cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return ok;
}

std::string bf16_speed_note() {
  if (!gemm_bf16_available() || cpu_has_avx512_bf16()) return "";
  return str(
      "note: this CPU has no AVX-512 BF16, so oneDNN emulates the bf16 matmuls, several "
      "times slower than fp32; ",
      setting("precision"), " fp16 keeps the same activation memory at fp32's speed");
}

std::string cpu_description() {
  std::string s = cpu_model_name() + "; kernels " + isa_name(cpu_isa());
  if (isa_capped_by_env()) s += " (capped by BERTRAIN_ISA)";
  s += ", oneDNN ";
  s += gemm_isa_name();
  s += ", bf16 matmul ";
  s += !gemm_bf16_available()  ? "unavailable (needs AVX-512)"
       : cpu_has_avx512_bf16() ? "native (AVX-512 BF16)"
                               : "emulated (no AVX-512 BF16)";
  return s;
}

namespace {

const GemmPrim& get_prim(const GemmKey& k) {
  static std::mutex mu;
  static std::map<GemmKey, GemmPrim> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  GemmPrim p;
  // A logical [M,K]; stored [M,K] with stride lda, or stored [K,M] (transposed) with stride lda.
  const dt in = k.bf16 ? dt::bf16 : dt::f32;
  if (k.batch == 1) {
    p.a_md = dnnl::memory::desc({k.M, k.K}, in, k.ta ? dims{1, k.lda} : dims{k.lda, 1});
    p.b_md = dnnl::memory::desc({k.K, k.N}, in, k.tb ? dims{1, k.ldb} : dims{k.ldb, 1});
    p.c_md = dnnl::memory::desc({k.M, k.N}, dt::f32, dims{k.ldc, 1});
    if (k.bias) p.bias_md = dnnl::memory::desc({1, k.N}, dt::f32, dims{k.N, 1});
  } else if (k.outer > 1) {
    p.a_md = dnnl::memory::desc({k.outer, k.batch, k.M, k.K}, in,
                                k.ta ? dims{k.oa, k.sa, 1, k.lda} : dims{k.oa, k.sa, k.lda, 1});
    p.b_md = dnnl::memory::desc({k.outer, k.batch, k.K, k.N}, in,
                                k.tb ? dims{k.ob, k.sb, 1, k.ldb} : dims{k.ob, k.sb, k.ldb, 1});
    p.c_md = dnnl::memory::desc({k.outer, k.batch, k.M, k.N}, dt::f32, dims{k.oc, k.sc, k.ldc, 1});
  } else {
    p.a_md = dnnl::memory::desc({k.batch, k.M, k.K}, in,
                                k.ta ? dims{k.sa, 1, k.lda} : dims{k.sa, k.lda, 1});
    p.b_md = dnnl::memory::desc({k.batch, k.K, k.N}, in,
                                k.tb ? dims{k.sb, 1, k.ldb} : dims{k.sb, k.ldb, 1});
    p.c_md = dnnl::memory::desc({k.batch, k.M, k.N}, dt::f32, dims{k.sc, k.ldc, 1});
  }
  dnnl::primitive_attr attr;
  // The caller's scratchpad (gemm_any: one per thread), so the same primitive may run on several
  // threads at once (the blocked attention runs one head per thread); oneDNN's own library
  // scratchpad is shared and ties a primitive to the thread that created it.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (k.alpha != 1.0f) attr.set_output_scales(0, {k.alpha});
  if (k.acc) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  auto desc = k.bias ? dnnl::matmul::desc(p.a_md, p.b_md, p.bias_md, p.c_md)
                     : dnnl::matmul::desc(p.a_md, p.b_md, p.c_md);
  try {
    const dnnl::matmul::primitive_desc pd(desc, attr, cpu_engine());
    p.prim = dnnl::matmul(pd);
    p.scratch_md = pd.scratchpad_desc();
  } catch (const dnnl::error& e) {
    if (k.bf16)
      fail("this CPU has no bf16 matrix multiply in oneDNN (it needs AVX-512; ISA in use: ",
           isa_name(cpu_isa()), "); run with ", setting("precision"), " fp32");
    fail("oneDNN could not create a matmul for [", k.M, "x", k.K, "]x[", k.K, "x", k.N, "] (batch ",
         k.batch, "): ", e.what());
  }
  return cache.emplace(k, std::move(p)).first->second;
}

}  // namespace

namespace {
// The calling thread's open GemmScratchQuery (matmul.h), if any.
thread_local int64_t* t_query = nullptr;

void gemm_any(bool bf16, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A,
              int64_t lda, const void* B, int64_t ldb, float* C, int64_t ldc, const float* bias,
              bool accumulate, int64_t batch = 1, int64_t sa = 0, int64_t sb = 0, int64_t sc = 0,
              float alpha = 1.0f, const OuterBatch& outer = {}) {
  BT_CHECK(!(accumulate && bias), "gemm: bias with accumulate is not supported");
  if (M == 0 || N == 0 || batch == 0 || outer.count == 0) return;
  if (t_query && K == 0) return;
  BT_CHECK(K > 0 || outer.count == 1, "gemm: an outer batch needs K > 0");
  if (K == 0) {
    if (!accumulate)
      for (int64_t q = 0; q < batch; ++q)
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) C[q * sc + i * ldc + j] = bias ? bias[j] : 0.0f;
    return;
  }
  const GemmPrim& p =
      get_prim({trans_a,     trans_b, accumulate, bias != nullptr, M,  N,  K,  lda,
                ldb,         ldc,     bf16,       batch,           sa, sb, sc, alpha,
                outer.count, outer.a, outer.b,    outer.c});
  const size_t need = p.scratch_md.get_size();
  if (t_query) {
    *t_query = std::max(*t_query, static_cast<int64_t>(need));
    return;
  }
  // Per thread: one stream, and per primitive the memory objects and argument map, made once and
  // pointed at this call's buffers (no allocation per call on our side).
  struct Args {
    dnnl::memory a, b, c, bias, scratch;
    std::unordered_map<int, dnnl::memory> map;
  };
  auto& eng = cpu_engine();
  thread_local dnnl::stream s(eng);
  thread_local std::map<const GemmPrim*, Args> args_of;
  auto [it, fresh] = args_of.try_emplace(&p);
  Args& x = it->second;
  if (fresh) {
    x.a = dnnl::memory(p.a_md, eng, nullptr);
    x.b = dnnl::memory(p.b_md, eng, nullptr);
    x.c = dnnl::memory(p.c_md, eng, nullptr);
    x.map = {{DNNL_ARG_SRC, x.a}, {DNNL_ARG_WEIGHTS, x.b}, {DNNL_ARG_DST, x.c}};
    if (bias) {
      x.bias = dnnl::memory(p.bias_md, eng, nullptr);
      x.map.emplace(DNNL_ARG_BIAS, x.bias);
    }
    if (need) {
      x.scratch = dnnl::memory(p.scratch_md, eng, nullptr);
      x.map.emplace(DNNL_ARG_SCRATCHPAD, x.scratch);
    }
  }
  x.a.set_data_handle(const_cast<void*>(A));
  x.b.set_data_handle(const_cast<void*>(B));
  x.c.set_data_handle(C);
  if (bias) x.bias.set_data_handle(const_cast<float*>(bias));
  if (need) {  // the model's kernel scratch (scratch.h): the caller's part, or this thread's
    const int64_t n = static_cast<int64_t>(need);
    const int t = omp_get_thread_num();
    x.scratch.set_data_handle(omp_in_parallel() ? scratch_block(ScratchPart::Gemm, n, t + 1).at(t)
                                                : caller_scratch(n));
  }
  p.prim.execute(s, x.map);
  s.wait();
}
}  // namespace

GemmScratchQuery::GemmScratchQuery() : outer_(t_query) {
  t_query = &bytes_;
}
GemmScratchQuery::~GemmScratchQuery() {
  t_query = outer_;
  if (outer_) *outer_ = std::max(*outer_, bytes_);
}
bool GemmScratchQuery::active() {
  return t_query != nullptr;
}

int64_t linear_scratch_bytes(bool bf16, int64_t M, int64_t N, int64_t K) {
  // The products of linear_forward* (with and without bias) and linear_backward* (dinp = or +=,
  // dweight +=), on placeholders never touched.
  GemmScratchQuery q;
  float* f = q.placeholder<float>();
  uint16_t* h = q.placeholder<uint16_t>();
  for (const float* bias : {static_cast<const float*>(nullptr), static_cast<const float*>(f)}) {
    if (bf16)
      gemm(false, true, M, N, K, h, K, h, K, f, N, bias, false);
    else
      gemm(false, true, M, N, K, f, K, f, K, f, N, bias, false);
  }
  for (const bool acc : {false, true}) {
    if (bf16)
      gemm(false, false, M, K, N, h, N, h, K, f, K, nullptr, acc);
    else
      gemm(false, false, M, K, N, f, N, f, K, f, K, nullptr, acc);
  }
  if (bf16)
    gemm(true, false, N, K, M, h, N, h, K, f, K, nullptr, true);
  else
    gemm(true, false, N, K, M, f, N, f, K, f, K, nullptr, true);
  return q.bytes();
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
          const float* B, int64_t ldb, float* C, int64_t ldc, const float* bias, bool accumulate) {
  gemm_any(false, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, bias, accumulate);
}

void gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  float alpha, const float* A, int64_t lda, int64_t sa, const float* B, int64_t ldb,
                  int64_t sb, float* C, int64_t ldc, int64_t sc, const OuterBatch& outer) {
  gemm_any(false, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, nullptr, false, batch, sa, sb,
           sc, alpha, outer);
}

void gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  float alpha, const uint16_t* A, int64_t lda, int64_t sa, const uint16_t* B,
                  int64_t ldb, int64_t sb, float* C, int64_t ldc, int64_t sc,
                  const OuterBatch& outer) {
  gemm_any(true, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, nullptr, false, batch, sa, sb,
           sc, alpha, outer);
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint16_t* A,
          int64_t lda, const uint16_t* B, int64_t ldb, float* C, int64_t ldc, const float* bias,
          bool accumulate) {
  gemm_any(true, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, bias, accumulate);
}

namespace {

// BF16's backward from the bf16 input the forward multiplied (inp16 [M,K]): the output gradient
// rounded to bf16 into `scratch_out` ([M,N]), products on bf16 operands, fp32 results.
// (dout's bf16 copy where its producer wrote one, else dout rounded into scratch_out)
void linear_backward_from_bf16(float* dinp, float* dweight, float* dbias, KeptIn dout,
                               const uint16_t* inp16, const uint16_t* weight, int64_t M, int64_t N,
                               int64_t K, bool accumulate_dinp, uint16_t* scratch_out) {
  const uint16_t* d16 = dout.bits;
  if (!d16) {
    convert_f32_to_bf16(dout.f32, scratch_out, static_cast<size_t>(M * N));
    d16 = scratch_out;
  }
  if (dinp) gemm(false, false, M, K, N, d16, N, weight, K, dinp, K, nullptr, accumulate_dinp);
  if (dweight) gemm(true, false, N, K, M, d16, N, inp16, K, dweight, K, nullptr, true);
  if (dbias) linear_backward(nullptr, nullptr, dbias, dout.f32, nullptr, nullptr, M, N, K);
}

}  // namespace

void linear_forward(Precision p, float* out, Kept in, Weight w, const float* bias, int64_t M,
                    int64_t N, int64_t K, const Workspace& ws) {
  if (p != Precision::BF16) return linear_forward(out, in.f32, w.f32, bias, M, N, K);
  const uint16_t* in16 = in.bits;  // a kept tensor is rounded already
  if (!in16) {
    convert_f32_to_bf16(in.f32, ws.half_a, static_cast<size_t>(M * K));
    in16 = ws.half_a;
  }
  gemm(false, true, M, N, K, in16, K, w.bits, K, out, N, bias, false);
}

void linear_backward(Precision p, float* dinp, float* dw, float* db, KeptIn dout, Kept in, Weight w,
                     int64_t M, int64_t N, int64_t K, bool accumulate_dinp, const Workspace& ws) {
  switch (p) {
    case Precision::FP32:
      return linear_backward(dinp, dw, db, dout.f32, in.f32, w.f32, M, N, K, accumulate_dinp);
    case Precision::BF16: {
      const uint16_t* in16 = in.bits;
      if (!in16 && dw) {
        convert_f32_to_bf16(in.f32, ws.half_b, static_cast<size_t>(M * K));
        in16 = ws.half_b;
      }
      return linear_backward_from_bf16(dinp, dw, db, dout, in16, w.bits, M, N, K, accumulate_dinp,
                                       ws.half_a);
    }
    case Precision::FP16: {
      const float* x = in.f32;
      if (in.bits) {  // the fp16 value forward used, widened for the fp32 kernels
        widen_f16(ws.wide, in.bits, M * K);
        x = ws.wide;
      }
      return linear_backward(dinp, dw, db, dout.f32, x, w.f32, M, N, K, accumulate_dinp);
    }
  }
}

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t M,
                    int64_t N, int64_t K) {
  gemm(false, true, M, N, K, inp, K, weight, K, out, N, bias, false);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t M, int64_t N, int64_t K, bool accumulate_dinp) {
  if (dinp) gemm(false, false, M, K, N, dout, N, weight, K, dinp, K, nullptr, accumulate_dinp);
  if (dweight) gemm(true, false, N, K, M, dout, N, inp, K, dweight, K, nullptr, true);
  if (dbias) {
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < N; j0 += 64) {
      int64_t j1 = std::min<int64_t>(N, j0 + 64);
      float acc[64] = {0};
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = j0; j < j1; ++j) acc[j - j0] += dout[i * N + j];
      for (int64_t j = j0; j < j1; ++j) dbias[j] += acc[j - j0];
    }
  }
}

void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                    const float* bias, bool accumulate) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = bias ? bias[j] : 0.0;
      for (int64_t k = 0; k < K; ++k) {
        double a = trans_a ? A[k * lda + i] : A[i * lda + k];
        double b = trans_b ? B[j * ldb + k] : B[k * ldb + j];
        s += a * b;
      }
      C[i * ldc + j] = static_cast<float>(accumulate ? C[i * ldc + j] + s : s);
    }
}

}  // namespace bertrain::kernels
