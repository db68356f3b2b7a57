// Test helpers: tolerance checks that report the worst element (STYLE.md §6, §7), finite
// differences, temp directories.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/isa.h"
#include "core/rng.h"
#include "kernels/cpu/matmul.h"
#include "model/batch.h"
#include "model/bert.h"
#include "model/config.h"

namespace bertrain::test {

#ifdef BERTRAIN_BINARY
// `bertrain bench --json <args>` run as a user runs it: its JSON line (the command must succeed).
// The binary the build made, or $BERTRAIN_BIN where it was moved (scripts/gpu-check.sh's pack).
inline nlohmann::json bench_json(const std::string& args) {
  const char* moved = std::getenv("BERTRAIN_BIN");
  const std::string cmd =
      std::string(moved && *moved ? moved : BERTRAIN_BINARY) + " bench --json " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  EXPECT_EQ(pclose(p), 0) << out;
  const size_t json = out.find('{');
  if (json == std::string::npos) {
    ADD_FAILURE() << cmd << " printed no JSON: " << out;
    return nlohmann::json::object();
  }
  return nlohmann::json::parse(out.substr(json));
}
#endif

// A small BERT of the given sizes (everything else BERT's defaults).
inline model::BertConfig small_bert(int64_t vocab, int64_t hidden, int64_t layers, int64_t heads,
                                    int64_t intermediate, int64_t max_positions) {
  model::BertConfig c;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.intermediate_size = intermediate;
  c.max_position_embeddings = max_positions;
  return c;
}

// A pretraining batch of B x T tokens with P masked positions, ids spread over the vocabulary,
// the last 2 tokens of each row padding.
inline model::Batch random_batch(const model::BertConfig& c, int64_t B, int64_t T, int64_t P) {
  model::Batch b;
  b.resize(B, T, P);
  for (int64_t i = 0; i < B * T; ++i) {
    b.input_ids[i] = static_cast<int32_t>((i * 7919) % c.vocab_size);
    b.input_mask[i] = i % T < T - 2 ? 1 : 0;
    b.segment_ids[i] = i % T < T / 2 ? 0 : 1;
  }
  for (int64_t i = 0; i < B * P; ++i) {
    b.masked_lm_positions[i] = static_cast<int32_t>(1 + (i * 3) % (T - 3));
    b.masked_lm_ids[i] = static_cast<int32_t>((i * 104729) % c.vocab_size);
    b.masked_lm_weights[i] = 1.0f;
  }
  for (int64_t i = 0; i < B; ++i) b.next_sentence_labels[i] = static_cast<int32_t>(i % 2);
  return b;
}

// One training forward + backward (dropout on) of a fresh model (init seed 11) on a backend,
// its losses, gradients and parameters read back to the host.
struct BackendStep {
  model::Losses losses;
  std::vector<float> grads, params;
};
inline BackendStep backend_step(const kernels::Backend& be, const model::BertConfig& c,
                                model::Head head, const model::ModelDims& d,
                                const model::Batch& b) {
  model::BertModel m(c, head, d, be);
  m.init_params(11);
  m.zero_grads();
  const model::StepOptions opt{true, 5, 3, 0};
  BackendStep r;
  r.losses = m.forward(b, opt);
  m.backward(b, opt, 1.0f);
  const size_t n = static_cast<size_t>(m.table().total());
  r.grads.resize(n);
  r.params.resize(n);
  be.to_host(r.grads.data(), m.grads(), n * sizeof(float));
  be.to_host(r.params.data(), m.params(), n * sizeof(float));
  return r;
}

// A batch source (train::Step's next_batch) handing out `batch` every time; `batch` outlives it.
inline std::function<bool(model::Batch&)> same_batch(const model::Batch& batch) {
  return [&batch](model::Batch& b) {
    b = batch;
    return true;
  };
}

// Sequences [b0, b0 + n) of a pretraining batch (a rank's part of the global batch).
inline model::Batch slice_batch(const model::Batch& full, int64_t b0, int64_t n) {
  const int64_t T = full.T, P = full.P;
  model::Batch s;
  s.resize(n, T, P);
  std::copy_n(full.input_ids.begin() + b0 * T, n * T, s.input_ids.begin());
  std::copy_n(full.input_mask.begin() + b0 * T, n * T, s.input_mask.begin());
  std::copy_n(full.segment_ids.begin() + b0 * T, n * T, s.segment_ids.begin());
  std::copy_n(full.masked_lm_positions.begin() + b0 * P, n * P, s.masked_lm_positions.begin());
  std::copy_n(full.masked_lm_ids.begin() + b0 * P, n * P, s.masked_lm_ids.begin());
  std::copy_n(full.masked_lm_weights.begin() + b0 * P, n * P, s.masked_lm_weights.begin());
  std::copy_n(full.next_sentence_labels.begin() + b0, n, s.next_sentence_labels.begin());
  return s;
}

// Batch k of a stream a small model learns steadily (test::small_bert's vocabulary of 300, 4 x
// 32 tokens, 5 predictions): ids from their position and a hash of (k, i), the masked tokens
// those at their positions, so the loss falls (measured on the CPU: 6.47 -> 1.70 over 300
// AdamW steps) instead of collapsing on a memorised batch, where relative differences say
// nothing.
inline model::Batch learnable_batch(const model::BertConfig& c, int64_t k) {
  model::Batch b = random_batch(c, 4, 32, 5);
  for (size_t i = 0; i < b.input_ids.size(); ++i)
    b.input_ids[i] = static_cast<int32_t>(mix64(k * 1000003 + i) % 50 + (i % 32) * 8);
  for (size_t i = 0; i < b.masked_lm_ids.size(); ++i)
    b.masked_lm_ids[i] = b.input_ids[(i / 5) * 32 + b.masked_lm_positions[i]];
  return b;
}

// random_batch of 4 x 32 (5 predictions) with every task head's labels too: classes of 3, a
// label for each token (every third one another), and one answer span per sequence.
inline model::Batch task_batch(const model::BertConfig& c) {
  model::Batch b = random_batch(c, 4, 32, 5);
  b.label_ids = {0, 2, 1, 2};
  b.token_label_ids.assign(b.B * b.T, 1);
  b.token_label_weights.assign(b.B * b.T, 1.0f);
  for (int64_t i = 0; i < b.B * b.T; i += 3) b.token_label_ids[i] = 2;
  b.span_positions = {3, 7, 1, 20, 5, 9, 0, 0};  // the 4 sequences' starts, then their ends
  return b;
}

// A file under tests/: where BERTRAIN_TEST_DATA (the environment's) says, for a test binary run
// away from the checkout it was built in (scripts/gpu-check.sh on the GPU machine), else the
// checkout's.
inline std::string data_path(const std::string& rel) {
  const char* dir = std::getenv("BERTRAIN_TEST_DATA");
  return std::string(dir && *dir ? dir : BERTRAIN_TEST_DATA) + "/" + rel;
}

// Passes iff every |got - ref| <= atol + rtol * |ref|, with atol = atol_rel * max|ref| (errors
// of fp32 arithmetic scale with the tensor's magnitude, not each element's).
template <typename G, typename R>
::testing::AssertionResult all_close(const std::string& name, const G* got, const R* ref, size_t n,
                                     double rtol, double atol_rel, double atol_floor = 0) {
  double max_ref = 0;
  for (size_t i = 0; i < n; ++i)
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
  const double atol = std::max(atol_rel * max_ref, atol_floor) + 1e-30;
  double worst = -1;
  size_t wi = 0;
  for (size_t i = 0; i < n; ++i) {
    double g = got[i], r = ref[i];
    double excess = std::fabs(g - r) / (atol + rtol * std::fabs(r));
    if (!std::isfinite(g)) excess = INFINITY;
    if (excess > worst) {
      worst = excess;
      wi = i;
    }
  }
  if (n == 0 || worst <= 1.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << name << ": worst element " << wi << " of " << n << ": got " << got[wi] << ", ref "
         << ref[wi] << " (|diff| " << std::fabs(got[wi] - ref[wi]) << " is " << worst
         << "x the bound; rtol " << rtol << ", atol " << atol << ")";
}

// Each parameter tensor's gradient of `got` against `ref` (flat buffers in the table's layout)
// at rtol and atol `tol` of the tensor's largest value, but never below tol times a thousandth
// of the whole gradient's largest: a tensor whose exact gradient vanishes (the attention key's
// bias: softmax ignores a shift shared by a row's scores) holds only the rounding noise of the
// others, and is compared at their scale, not at its own noise's.
inline ::testing::AssertionResult grads_close(const model::ParamTable& table, const float* got,
                                              const float* ref, double tol) {
  double largest = 0;
  for (int64_t i = 0; i < table.total(); ++i)
    largest = std::max(largest, std::fabs(static_cast<double>(ref[i])));
  for (const auto& p : table.params()) {
    auto r = all_close(p.name, got + p.offset, ref + p.offset, static_cast<size_t>(p.numel()), tol,
                       tol, tol * 1e-3 * largest);
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

// Empty where oneDNN runs bf16 matmuls on this CPU; otherwise the reason, naming the missing ISA,
// for GTEST_SKIP (AVX2-only CPUs such as AMD Zen 2/3, or BERTRAIN_ISA=avx2|portable).
inline std::string bf16_unavailable() {
  if (kernels::gemm_bf16_available()) return "";
  return std::string(
             "needs oneDNN's bf16 matmul, which needs AVX-512 (F, BW, DQ, VL); this "
             "CPU runs our kernels at ") +
         isa_name(cpu_isa()) + " and oneDNN at " + kernels::gemm_isa_name() +
         (isa_capped_by_env() ? " (capped by BERTRAIN_ISA)" : "");
}
#define BT_SKIP_WITHOUT_BF16()                                                      \
  do {                                                                              \
    if (const std::string why = ::bertrain::test::bf16_unavailable(); !why.empty()) \
      GTEST_SKIP() << why;                                                          \
  } while (0)

// The kernel bodies this CPU can run, best first: AVX-512, AVX2, portable (as far as it goes).
inline std::vector<Isa> isa_levels() {
  std::vector<Isa> levels;
  for (int i = static_cast<int>(cpu_isa()); i >= 0; --i) levels.push_back(static_cast<Isa>(i));
  return levels;
}

// Runs f() with our kernels capped at `isa` (oneDNN is not affected).
template <typename F>
auto with_isa(Isa isa, F&& f) {
  set_isa_override(isa);
  auto r = f();
  reset_isa_override();
  return r;
}

// sqrt(sum (a - b)^2 / sum b^2), in double.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

inline std::vector<float> random_vector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Central finite difference of a scalar function at every element of x (x restored after).
inline std::vector<double> numeric_grad(std::vector<float>& x, const std::function<double()>& f,
                                        float eps) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float orig = x[i];
    x[i] = orig + eps;
    const double fp = f();
    x[i] = orig - eps;
    const double fm = f();
    x[i] = orig;
    g[i] = (fp - fm) / (2.0 * static_cast<double>(eps));
  }
  return g;
}

inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// The message of the bertrain::Error that f throws ("" if none).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A file's bytes ("" if it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("bertrain_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "_" + std::to_string(std::random_device{}()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string operator/(const std::string& f) const { return (path / f).string(); }
};

}  // namespace bertrain::test
