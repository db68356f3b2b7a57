// A backend with memory of its own, on the CPU: it runs the CPU's kernels but says its memory
// is not the host's (Backend::host_memory), hands out its own blocks, and fails the test on any
// kernel call given a pointer outside them. Its blocks are inaccessible (PROT_NONE) except while
// one of its calls runs, so host code that reads or writes them directly faults, as it would on
// a GPU. What a model, its optimizer and the trainer do on a GPU then runs here: every pointer
// they hand a kernel is backend memory, and they touch that memory only through the backend.
#pragma once

#include <gtest/gtest.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "gpu_attention_16.h"
#include "kernels/backend.h"
#include "kernels/row_math.h"

namespace bertrain::kernels {

// Grouping `runs` lists tokens [0, tokens) once each, by table row (key(n)), in token order
// within a row, in chunks of at most kEmbeddingChunk; rows of several chunks sum their
// consecutive partial rows.
template <class Key>
void check_runs(const char* table, const RowRuns& r, int64_t tokens, Key key) {
  SCOPED_TRACE(table);
  std::vector<int> seen(static_cast<size_t>(tokens), 0);
  int64_t prev_row = -1, prev_token = -1, partials = 0, at = 0;
  for (int64_t i = 0; i < r.num_chunks; ++i) {
    const EmbeddingChunk& k = r.chunks[i];
    ASSERT_EQ(k.begin, at);
    ASSERT_GT(k.end, k.begin);
    ASSERT_LE(k.end - k.begin, kEmbeddingChunk);
    ASSERT_GE(k.row, prev_row);
    if (k.row != prev_row) prev_token = -1;
    for (int32_t j = k.begin; j < k.end; ++j) {
      const int32_t n = r.order[j];
      ASSERT_TRUE(n >= 0 && n < tokens);
      ASSERT_EQ(key(n), k.row) << "token " << n;
      ASSERT_GT(n, prev_token);
      prev_token = n;
      ++seen[static_cast<size_t>(n)];
    }
    if (k.partial >= 0) {
      ASSERT_EQ(k.partial, partials++);
    }
    prev_row = k.row;
    at = k.end;
  }
  ASSERT_EQ(at, tokens);
  for (int64_t n = 0; n < tokens; ++n) ASSERT_EQ(seen[static_cast<size_t>(n)], 1) << n;
  ASSERT_EQ(r.partials, partials);
  int64_t summed = 0;
  for (int64_t i = 0; i < r.num_sums; ++i) {
    ASSERT_EQ(r.sums[i].first, summed);
    summed += r.sums[i].count;
  }
  ASSERT_EQ(summed, partials);
}

class OwnMemoryBackend final : public Backend {
 public:
  // capacity > 0: a device of that many bytes (device_memory says what is free; an allocation
  // past it fails as a GPU's cudaMalloc does). 0: unbounded, and no device_memory.
  // fp16_operands: FP16's products take fp16 operands, as a GPU's do (Target::fp16_operands):
  // the model plans the fp16 weight copy and operand scratch, the optimizer writes the copy,
  // and the linear layers multiply what a GPU's would (the kept fp16 inputs, the fp16 weight
  // copy, the other operands rounded to fp16) with the CPU's fp32 kernel, and attention runs the
  // GPU's fp16 flow on the host (gpu_attention_16.h: fp16 operands, the dropped probabilities
  // and dS rounded to fp16 as the row passes write them).
  explicit OwnMemoryBackend(size_t capacity = 0, bool fp16_operands = false)
      : capacity_(capacity), fp16_operands_(fp16_operands) {}
  const char* name() const override { return "own-memory"; }
  bool host_memory() const override { return false; }
  bool fp16_operands() const override { return fp16_operands_; }
  void* allocate(size_t bytes) const override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (capacity_ && in_use_ + bytes > capacity_)
        fail("out of own-memory device memory: ", bytes, " bytes asked for, ", capacity_ - in_use_,
             " of ", capacity_, " free");
    }
    const size_t n = (bytes + 4095) / 4096 * 4096;  // zero pages
    void* p = ::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back({static_cast<const char*>(p), n});
    sizes_.push_back(bytes);
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    if (open_ > 0) ::mprotect(p, n, PROT_READ | PROT_WRITE);
    return p;
  }
  void release(void* p) const override {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < blocks_.size(); ++i)
      if (blocks_[i].first == p) {
        ::munmap(p, blocks_[i].second);
        blocks_.erase(blocks_.begin() + static_cast<int64_t>(i));
        in_use_ -= sizes_[i];
        sizes_.erase(sizes_.begin() + static_cast<int64_t>(i));
        return;
      }
  }
  std::optional<DeviceMemory> device_memory() const override {
    if (!capacity_) return std::nullopt;
    std::lock_guard<std::mutex> lock(mu_);
    return DeviceMemory{capacity_ - in_use_, capacity_};
  }
  // Bytes allocated now, and the most at once.
  size_t in_use() const {
    std::lock_guard<std::mutex> lock(mu_);
    return in_use_;
  }
  size_t peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  // The blocks readable and writable while one of this backend's calls runs (nested: counted).
  class Open {
   public:
    explicit Open(const OwnMemoryBackend& b) : b_(b) { b_.protect(+1); }
    ~Open() { b_.protect(-1); }
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;

   private:
    const OwnMemoryBackend& b_;
  };
  void protect(int change) const {
    std::lock_guard<std::mutex> lock(mu_);
    const int was = open_;
    open_ += change;
    if ((was == 0) == (open_ == 0)) return;
    for (const auto& [b, n] : blocks_)
      ::mprotect(const_cast<char*>(b), n, open_ > 0 ? PROT_READ | PROT_WRITE : PROT_NONE);
  }
  void to_device(void* dst, const void* src, size_t bytes) const override {
    const Open open(*this);
    own(dst, "to_device's destination");
    std::memcpy(dst, src, bytes);
  }
  void to_host(void* dst, const void* src, size_t bytes) const override {
    const Open open(*this);
    own(src, "to_host's source");
    std::memcpy(dst, src, bytes);
  }
  // Staging memory (a GPU's page-locked host memory) is ordinary host memory here, but an
  // upload must come from it, into one block. Uploads run late, as a GPU's copy stream may run
  // them: at the slot's use_input (or wait_upload). The test fails on an upload into a slot the
  // kernels may still read (used since its last release_input), on one from staging memory
  // whose earlier upload was not waited for (wait_upload: the host wrote it again before that
  // copy surely ran), and on staging memory released with a copy out of it not waited for.
  void* allocate_host(size_t bytes) const override {
    void* p = Backend::allocate_host(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    host_blocks_.push_back({static_cast<const char*>(p), bytes});
    return p;
  }
  void release_host(void* p) const override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = std::find_if(host_blocks_.begin(), host_blocks_.end(),
                             [&](const auto& b) { return b.first == p; });
      EXPECT_NE(it, host_blocks_.end()) << "release_host of memory allocate_host did not give";
      if (it != host_blocks_.end()) {
        for (const auto& [slot, s] : sources_)
          EXPECT_FALSE(s.src >= it->first && s.src < it->first + it->second)
              << "staging memory released before its upload was waited for";
        host_blocks_.erase(it);
      }
    }
    Backend::release_host(p);
  }
  void upload(void* slot, const void* src, size_t bytes) const override {
    own(slot, "an input slot");
    run_upload(slot);  // (a slot's copies run in order)
    std::lock_guard<std::mutex> lock(mu_);
    auto* from = static_cast<const char*>(src);
    EXPECT_TRUE(std::any_of(host_blocks_.begin(), host_blocks_.end(), [&](const auto& b) {
      return from >= b.first && from + bytes <= b.first + b.second;
    })) << "an upload's source is not allocate_host's memory";
    EXPECT_FALSE(reading_.count(slot))
        << "an upload into an input slot the kernels may still read (no release_input)";
    for (const auto& [other, s] : sources_)
      EXPECT_TRUE(from + bytes <= s.src || s.src + s.bytes <= from)
          << "an upload from staging memory written again before its last upload was waited for";
    sources_[slot] = {from, bytes};
    ++uploads_;
    if (in_backward_) ++uploads_in_backward_;
    pending_[slot] = {from, bytes};
  }
  void use_input(const void* slot) const override {
    run_upload(slot);
    std::lock_guard<std::mutex> lock(mu_);
    reading_.insert(slot);
  }
  void release_input(const void* slot) const override {
    std::lock_guard<std::mutex> lock(mu_);
    reading_.erase(slot);
  }
  void wait_upload(const void* slot) const override {
    run_upload(slot);
    std::lock_guard<std::mutex> lock(mu_);
    sources_.erase(slot);
  }
  void synchronize() const override {
    std::lock_guard<std::mutex> lock(mu_);
    in_backward_ = false;
  }
  // A device that always runs behind the host: busy from a backward's last kernel until the
  // next synchronize.
  bool busy() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return in_backward_;
  }
  // Uploads, and those issued while a backward's kernels may still run (after its last kernel,
  // embedding_backward, before the next synchronize): the next batch's copy beside them.
  int64_t uploads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return uploads_;
  }
  int64_t uploads_in_backward() const {
    std::lock_guard<std::mutex> lock(mu_);
    return uploads_in_backward_;
  }
  // Fails unless p is null or inside a block this backend handed out.
  void own(const void* p, const char* what) const {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [b, n] : blocks_)
      if (static_cast<const char*>(p) >= b && static_cast<const char*>(p) < b + n) return;
    ADD_FAILURE() << what << " is not the backend's memory";
  }
  void own(const Kept& k, const char* what) const {
    own(k.f32, what);
    own(k.bits, what);
  }

  ScratchLayout scratch_layout(const KernelShapes& s) const override {
    const Open open(*this);
    return cpu().scratch_layout(s);
  }
  void bind_scratch(void* region, const ScratchLayout& l) const override {
    const Open open(*this);
    own(region, "kernel scratch");
    cpu().bind_scratch(region, l);
  }
  // The device it stands for is the host's: the CPU's facts, ceiling and conversions.
  int64_t unplanned_scratch_bytes() const override { return cpu().unplanned_scratch_bytes(); }
  std::string description() const override { return "own memory on " + cpu().description(); }
  std::string device_name() const override { return cpu().device_name(); }
  double gemm_peak_gflops(Precision p, int64_t M, int64_t N, int64_t K,
                          double seconds) const override {
    return cpu().gemm_peak_gflops(p, M, N, K, seconds);
  }
  void round_to_16(Precision p, uint16_t* dst, const float* src, int64_t n,
                   void* queue) const override {
    const Open open(*this);
    cpu().round_to_16(p, dst, src, n, queue);
  }
  void widen_from_16(Precision p, float* dst, const uint16_t* src, int64_t n,
                     void* queue) const override {
    const Open open(*this);
    cpu().widen_from_16(p, dst, src, n, queue);
  }
  void scale_on(float* x, int64_t n, float s, void* queue) const override {
    const Open open(*this);
    cpu().scale_on(x, n, s, queue);
  }
  void linear_forward(Precision p, float* out, Kept in, Weight w, const float* bias, int64_t M,
                      int64_t N, int64_t K, const Workspace& ws) const override {
    const Open open(*this);
    own(out, "linear out");
    own(in, "linear in");
    own(w.f32, "weight");
    own(w.bits, "16-bit weight");
    own(bias, "bias");
    if (fp16_products(p, w, ws)) {
      const auto x = fp16_values(in.bits, in.f32, M * K), wv = fp16_values(w.bits, nullptr, N * K);
      return cpu().linear_forward(Precision::FP32, out, Kept{const_cast<float*>(x.data())},
                                  Weight{wv.data()}, bias, M, N, K, ws);
    }
    cpu().linear_forward(p, out, in, w, bias, M, N, K, ws);
  }
  void linear_backward(Precision p, float* dinp, float* dw, float* db, KeptIn dout, Kept in,
                       Weight w, int64_t M, int64_t N, int64_t K, bool acc,
                       const Workspace& ws) const override {
    const Open open(*this);
    for (const void* x : {static_cast<const void*>(dinp), static_cast<const void*>(dw),
                          static_cast<const void*>(db), static_cast<const void*>(dout.f32),
                          static_cast<const void*>(dout.bits)})
      own(x, "linear backward operand");
    own(in, "linear backward input");
    // A 16-bit copy of dout is its values rounded (what the products read instead of rounding).
    if (dout.bits) expect_rounded(p, dout.bits, dout.f32, M * N, "linear backward's dout");
    if (fp16_products(p, w, ws)) {  // the bias gradient from the fp32 output gradient
      const auto d = fp16_values(dout.bits, dout.f32, M * N),
                 x = fp16_values(in.bits, in.f32, M * K), wv = fp16_values(w.bits, nullptr, N * K);
      cpu().linear_backward(Precision::FP32, dinp, dw, nullptr, d.data(),
                            Kept{const_cast<float*>(x.data())}, Weight{wv.data()}, M, N, K, acc,
                            ws);
      if (db)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) db[n] += dout.f32[m * N + n];
      return;
    }
    cpu().linear_backward(p, dinp, dw, db, dout, in, w, M, N, K, acc, ws);
  }
  // Fails the test where bits are not x rounded to p's 16 bits.
  static void expect_rounded(Precision p, const uint16_t* bits, const float* x, int64_t n,
                             const char* what) {
    if (p == Precision::FP32) return;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = p == Precision::BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
      if (bits[i] != want) {
        ADD_FAILURE() << what << ": its 16-bit copy is not its values rounded at " << i;
        return;
      }
    }
  }
  // Whether a linear layer multiplies fp16 operands here; then its weight has the fp16 copy and
  // the operand scratch is planned (as a GPU's products need them).
  bool fp16_products(Precision p, const Weight& w, const Workspace& ws) const {
    if (p != Precision::FP16 || !fp16_operands_) return false;
    EXPECT_NE(w.bits, nullptr) << "an fp16 product without the weights' fp16 copy";
    own(ws.half_a, "16-bit operand scratch");
    own(ws.half_b, "16-bit operand scratch");
    EXPECT_NE(ws.half_a, nullptr);
    EXPECT_NE(ws.half_b, nullptr);
    return true;
  }
  template <class T>
  static auto* f16(T* bits) {
    using H = std::conditional_t<std::is_const_v<T>, const row_math::F16Bits, row_math::F16Bits>;
    return reinterpret_cast<H*>(bits);
  }
  static constexpr auto one_lane = [](int64_t rows, const auto& f) {
    for (int64_t r = 0; r < rows; ++r) f(r, row_math::OneLane{});
  };
  // n fp16 values in fp32: bits widened, or f32 rounded to fp16 and widened.
  static std::vector<float> fp16_values(const uint16_t* bits, const float* f32, int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    std::vector<uint16_t> b;
    if (!bits) {
      b.resize(v.size());
      convert_f32_to_f16(f32, b.data(), v.size());
      bits = b.data();
    }
    convert_f16_to_f32(bits, v.data(), v.size());
    return v;
  }
  void keep(Precision p, Kept x, int64_t n) const override {
    const Open open(*this);
    own(x, "kept tensor");
    cpu().keep(p, x, n);
  }
  void copy_weights(Precision p, const float* master, uint16_t* copy, int64_t n) const override {
    const Open open(*this);
    own(master, "master weights");
    own(copy, "weights' copy");
    if (p == Precision::FP16 && fp16_operands_)
      return convert_f32_to_f16(master, copy, static_cast<size_t>(n));
    cpu().copy_weights(p, master, copy, n);
  }
  void attention_forward(Precision p, Kept kept_ctx, AttentionSaved saved, Kept qkv,
                         const int32_t* mask, const AttentionShape& s, const Dropout& d,
                         const Workspace& ws) const override {
    const Open open(*this);
    own(kept_ctx.bits, "ctx bits");
    attention_core(p, kept_ctx.f32, saved, qkv, mask, s, d, ws);
    if (kept_ctx.bits) cpu().keep(p, kept_ctx, s.B * s.T * s.C);
  }
  void attention_core(Precision p, float* ctx, AttentionSaved saved, Kept qkv, const int32_t* mask,
                      const AttentionShape& s, const Dropout& d, const Workspace& ws) const {
    own(ctx, "ctx");
    own(qkv, "qkv");
    own(mask, "attention mask");
    if (p == Precision::FP16 && fp16_operands_) {
      cpu().keep(p, qkv, s.B * s.T * 3 * s.C);  // QKV rounded in place, its bits kept
      if (saved.blocked()) {
        own(saved.lse, "row log-sum-exp");
        return test::gpu_attention_blocked_forward(ctx, saved.lse, f16(qkv.bits), mask, s, d,
                                                   one_lane);
      }
      own(saved.probs16, "kept probabilities");
      own(ws.attn_probs16, "attention's 16-bit operands");
      return test::gpu_attention_16_forward(ctx, f16(saved.probs16), f16(ws.attn_probs16),
                                            f16(qkv.bits), mask, s, d, one_lane);
    }
    cpu().attention_forward(p, ctx, saved, qkv, mask, s, d, ws);
  }
  void attention_backward(Precision p, float* dqkv, const float* dctx, Kept qkv,
                          AttentionSaved saved, const int32_t* mask, const AttentionShape& s,
                          const Dropout& d, const Workspace& ws) const override {
    const Open open(*this);
    own(dqkv, "dqkv");
    own(mask, "attention mask");
    if (p == Precision::FP16 && fp16_operands_) {  // dctx rounded into its operand buffer
      own(ws.attn_dctx16, "attention's 16-bit operands");
      convert_f32_to_f16(dctx, ws.attn_dctx16, static_cast<size_t>(s.B * s.T * s.C));
      if (saved.blocked())
        return test::gpu_attention_blocked_backward(dqkv, f16(ws.attn_dctx16), f16(qkv.bits),
                                                    saved.lse, mask, s, d, one_lane);
      own(ws.attn_probs16, "attention's 16-bit operands");
      return test::gpu_attention_16_backward(dqkv, f16(ws.attn_dctx16), f16(qkv.bits),
                                             f16(saved.probs16), f16(ws.attn_probs16), s, d,
                                             one_lane);
    }
    cpu().attention_backward(p, dqkv, dctx, qkv, saved, mask, s, d, ws);
  }
  void activation_forward(Precision p, Activation a, Kept out, Kept in, int64_t n) const override {
    const Open open(*this);
    own(out, "activation out");
    own(in, "activation in");
    cpu().activation_forward(p, a, out, in, n);
  }
  void activation_backward(Precision p, Activation a, float* dinp, Kept in, const float* dout,
                           int64_t n) const override {
    const Open open(*this);
    own(dinp, "activation dinp");
    cpu().activation_backward(p, a, dinp, in, dout, n);
  }
  void tanh_forward(float* out, const float* in, int64_t n) const override {
    const Open open(*this);
    own(in, "tanh in");
    cpu().tanh_forward(out, in, n);
  }
  void tanh_backward(float* dinp, const float* out, const float* dout, int64_t n) const override {
    const Open open(*this);
    own(dinp, "tanh dinp");
    cpu().tanh_backward(dinp, out, dout, n);
  }
  void embedding_layernorm_forward(float* out, float* sum, float* mean, float* rstd,
                                   const int32_t* ids, const int32_t* segment,
                                   const int32_t* positions, const float* word,
                                   const float* position, const float* token_type,
                                   const float* gamma, const float* beta, int64_t B, int64_t T,
                                   int64_t C, float eps, const Dropout& d) const override {
    const Open open(*this);
    own(ids, "input ids");
    own(segment, "segment ids");
    own(positions, "positions");
    own(d.rows, "dropout rows");
    own(word, "word embeddings");
    cpu().embedding_layernorm_forward(out, sum, mean, rstd, ids, segment, positions, word, position,
                                      token_type, gamma, beta, B, T, C, eps, d);
  }
  void embedding_backward(float* dword, float* dposition, float* dtoken_type, const float* dout,
                          const int32_t* ids, const int32_t* segment, const int32_t* positions,
                          int64_t B, int64_t T, int64_t C,
                          const EmbeddingRuns* runs) const override {
    const Open open(*this);
    own(ids, "input ids");
    own(segment, "segment ids");
    own(positions, "positions");
    own(dword, "word embeddings' gradient");
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_backward_ = true;
    }
    // The grouping a GPU sums by (RowMathEmbedding tests its sums): staged, and exactly the
    // tokens' table rows.
    EXPECT_NE(runs, nullptr) << "a backend with memory of its own is given the grouped tokens";
    if (runs) {
      for (const RowRuns* r : {&runs->word, &runs->position, &runs->token_type}) {
        own(r->order, "grouped tokens");
        own(r->chunks, "grouped tokens' chunks");
        own(r->sums, "grouped tokens' sums");
      }
      check_runs("word", runs->word, B * T, [&](int64_t n) { return ids[n]; });
      check_runs("position", runs->position, B * T,
                 [&](int64_t n) { return positions ? positions[n] : n % T; });
      check_runs("token type", runs->token_type, B * T, [&](int64_t n) { return segment[n]; });
    }
    cpu().embedding_backward(dword, dposition, dtoken_type, dout, ids, segment, positions, B, T, C,
                             nullptr);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* in, const float* gamma,
                         const float* beta, int64_t N, int64_t C, float eps) const override {
    const Open open(*this);
    own(in, "layernorm in");
    cpu().layernorm_forward(out, mean, rstd, in, gamma, beta, N, C, eps);
  }
  void layernorm_backward(float* dinp, float* dgamma, float* dbeta, const float* dout,
                          const float* in, const float* gamma, const float* mean, const float* rstd,
                          int64_t N, int64_t C) const override {
    const Open open(*this);
    own(dinp, "layernorm dinp");
    cpu().layernorm_backward(dinp, dgamma, dbeta, dout, in, gamma, mean, rstd, N, C);
  }
  void residual_layernorm_forward(Precision p, Kept out, float* mean, float* rstd, float* x,
                                  const float* residual, const float* gamma, const float* beta,
                                  int64_t N, int64_t C, float eps,
                                  const Dropout& d) const override {
    const Open open(*this);
    own(x, "residual block x");
    own(out.bits, "residual block output bits");
    own(d.rows, "dropout rows");
    cpu().residual_layernorm_forward(p, out, mean, rstd, x, residual, gamma, beta, N, C, eps, d);
  }
  void layernorm_dropout_backward(Precision p, float* dinp, Kept ddropped, float* dgamma,
                                  float* dbeta, float* dbias, const float* dout, const float* in,
                                  const float* gamma, const float* mean, const float* rstd,
                                  int64_t N, int64_t C, bool acc, const Dropout& d) const override {
    const Open open(*this);
    own(dinp, "residual block dinp");
    own(ddropped.bits, "residual block ddropped bits");
    own(d.rows, "dropout rows");
    cpu().layernorm_dropout_backward(p, dinp, ddropped, dgamma, dbeta, dbias, dout, in, gamma, mean,
                                     rstd, N, C, acc, d);
  }
  void dropout_forward(float* x, int64_t N, int64_t C, const Dropout& d) const override {
    const Open open(*this);
    own(x, "dropout x");
    own(d.rows, "dropout rows");
    cpu().dropout_forward(x, N, C, d);
  }
  void dropout_backward(float* dx, const float* dy, int64_t N, int64_t C,
                        const Dropout& d) const override {
    const Open open(*this);
    own(dx, "dropout dx");
    own(d.rows, "dropout rows");
    cpu().dropout_backward(dx, dy, N, C, d);
  }
  void add_inplace(float* out, const float* a, int64_t n) const override {
    const Open open(*this);
    own(out, "add out");
    own(a, "add a");
    cpu().add_inplace(out, a, n);
  }
  void copy(float* dst, const float* src, int64_t n) const override {
    const Open open(*this);
    own(dst, "copy dst");
    own(src, "copy src");
    cpu().copy(dst, src, n);
  }
  void gather_rows(float* out, const float* seq, const int32_t* positions, int64_t B, int64_t P,
                   int64_t T, int64_t C) const override {
    const Open open(*this);
    own(positions, "gathered positions");
    own(seq, "gathered sequence");
    cpu().gather_rows(out, seq, positions, B, P, T, C);
  }
  void scatter_add_rows(float* dseq, const float* d, const int32_t* positions, int64_t B, int64_t P,
                        int64_t T, int64_t C) const override {
    const Open open(*this);
    own(positions, "scattered positions");
    cpu().scatter_add_rows(dseq, d, positions, B, P, T, C);
  }
  void scale_inplace(float* x, int64_t n, Multiplier s) const override {
    const Open open(*this);
    own(x, "scaled");
    own(s.times, "scale factor");
    cpu().scale_inplace(x, n, s);
  }
  void zero(void* p, int64_t bytes) const override {
    const Open open(*this);
    own(p, "zeroed");
    cpu().zero(p, bytes);
  }
  CrossEntropySums cross_entropy(float* dlogits, float* losses, int32_t* correct,
                                 const float* logits, const int32_t* targets, const float* weights,
                                 int64_t N, Classes c, Multiplier dscale) const override {
    const Open open(*this);
    own(logits, "logits");
    own(targets, "targets");
    own(weights, "weights");
    own(losses, "row losses");
    own(correct, "row hits");
    own(dscale.times, "gradient factor");
    return cpu().cross_entropy(dlogits, losses, correct, logits, targets, weights, N, c, dscale);
  }
  double squared_error(float* dpred, const float* pred, const float* target, int64_t N,
                       Multiplier dscale) const override {
    const Open open(*this);
    own(pred, "predictions");
    own(target, "regression targets");
    own(dscale.times, "gradient factor");
    return cpu().squared_error(dpred, pred, target, N, dscale);
  }
  void add_sum_squares(double& sum, const float* g, int64_t n, double scale) const override {
    const Open open(*this);
    own(g, "gradient");
    cpu().add_sum_squares(sum, g, n, scale);
  }
  void own_update(const void* p, const void* p16, const void* g, const void* m,
                  const void* v) const {
    own(p, "parameters");
    own(p16, "bf16 parameters");
    own(g, "gradients");
    own(m, "first moments");
    own(v, "second moments");
  }
  void adamw_update(const AdamwStep& a, float* p, uint16_t* p16, const float* g, float* m, float* v,
                    int64_t n) const override {
    const Open open(*this);
    own_update(p, p16, g, m, v);
    cpu().adamw_update(a, p, p16, g, m, v, n);
  }
  void lamb_update(const LambStep& a, float* p, uint16_t* p16, const float* g, float* m, float* v,
                   int64_t n) const override {
    const Open open(*this);
    own_update(p, p16, g, m, v);
    cpu().lamb_update(a, p, p16, g, m, v, n);
  }
  void lamb_moments(const LambStep& a, const float* p, const float* g, float* m, float* v,
                    int64_t n, double& pn, double& un) const override {
    const Open open(*this);
    own_update(p, nullptr, g, m, v);
    cpu().lamb_moments(a, p, g, m, v, n, pn, un);
  }
  void lamb_apply(const LambStep& a, float* p, uint16_t* p16, const float* m, const float* v,
                  int64_t n, float step) const override {
    const Open open(*this);
    own_update(p, p16, nullptr, m, v);
    cpu().lamb_apply(a, p, p16, m, v, n, step);
  }

  size_t blocks() const {
    std::lock_guard<std::mutex> lock(mu_);
    return blocks_.size();
  }

 private:
  static const Backend& cpu() { return cpu_backend(); }
  mutable std::mutex mu_;
  mutable std::vector<std::pair<const char*, size_t>> blocks_;
  mutable std::vector<size_t> sizes_;  // the bytes asked for each block
  mutable int open_ = 0;
  mutable std::vector<std::pair<const char*, size_t>> host_blocks_;  // allocate_host's
  struct Copy {
    const char* src;
    size_t bytes;
  };
  // Runs the slot's pending upload, if any.
  void run_upload(const void* slot) const {
    Copy c{nullptr, 0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = pending_.find(slot);
      if (it == pending_.end()) return;
      c = it->second;
      pending_.erase(it);
    }
    to_device(const_cast<void*>(slot), c.src, c.bytes);
  }
  mutable std::map<const void*, Copy> pending_;  // the input slots' uploads not yet run
  mutable std::map<const void*, Copy> sources_;  // the slots' uploads not waited for
  mutable std::set<const void*> reading_;        // slots used since their last release_input
  mutable int64_t uploads_ = 0, uploads_in_backward_ = 0;
  mutable bool in_backward_ = false;
  const size_t capacity_;
  const bool fp16_operands_;
  mutable size_t in_use_ = 0, peak_ = 0;
};

}  // namespace bertrain::kernels

namespace bertrain::test {
using kernels::OwnMemoryBackend;
}  // namespace bertrain::test
