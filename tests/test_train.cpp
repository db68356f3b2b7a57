// Training: the loss scaler, learning on real text, exact resume (in process and after SIGTERM
// of the CLI), and the documented errors with the previous checkpoint left intact.
#include <gtest/gtest.h>

#include <omp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "core/isa.h"
#include "core/safetensors.h"
#include "data/tfrecord.h"
#include "model/checkpoint.h"
#include "own_memory_backend.h"
#include "plan/memory.h"
#include "prep/prepare.h"
#include "test_util.h"
#include "train/autotune.h"
#include "train/evaluate.h"
#include "train/loss_scaler.h"
#include "train/run_state.h"
#include "train/session.h"
#include "train/trainer.h"

namespace bertrain::train {
namespace {

using test::error_of;
std::string root(const std::string& rel) {
  return test::data_path("../" + rel);
}

TEST(Train, WarmupFractionIsRoundedUp) {
  EXPECT_EQ(warmup_steps(0.1, 5), 1);  // was 0: no warmup at all in a short run
  EXPECT_EQ(warmup_steps(0.1, 9), 1);
  EXPECT_EQ(warmup_steps(0.1, 30), 3);
  EXPECT_EQ(warmup_steps(0.1, 300), 30);
  EXPECT_EQ(warmup_steps(0.0, 300), 0);
  EXPECT_EQ(warmup_steps(25, 300), 25);
}

TEST(LossScaler, SkipsHalvesGrowsAndGivesUp) {
  LossScaler::Config c;
  c.enabled = true;
  c.growth_interval = 3;
  c.max_consecutive_skips = 2;
  LossScaler s(c);
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_FALSE(s.update(false, 0));  // overflow injected: skip, halve
  EXPECT_EQ(s.scale(), 32768.0f);
  EXPECT_TRUE(s.update(true, 1));
  EXPECT_TRUE(s.update(true, 2));
  EXPECT_EQ(s.scale(), 32768.0f);
  EXPECT_TRUE(s.update(true, 3));  // 3 good steps: double
  EXPECT_EQ(s.scale(), 65536.0f);
  EXPECT_FALSE(s.update(false, 4));
  EXPECT_FALSE(s.update(false, 5));
  try {
    s.update(false, 6);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 6: gradients are not finite in 3 consecutive steps"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(s.skipped(), 4);
  LossScaler::Config floor = c;
  floor.min_scale = 16384.0f;
  floor.max_consecutive_skips = 100;
  LossScaler f(floor);
  for (int i = 0; i < 5; ++i) f.update(false, i);
  EXPECT_EQ(f.scale(), 16384.0f);
  LossScaler off;  // fp32: scale 1, a non-finite gradient is an error at once
  EXPECT_EQ(off.scale(), 1.0f);
  EXPECT_THROW(off.update(false, 9), Error);
}

// The session builds what train, finetune, autotune and bench train from one set of settings:
// fp16's scaler with the run's --max-skipped-steps, the optimizer over the model's parameters,
// the same parameters for the same seed, and the step once.
TEST(Session, BuildsTheModelOptimizerScalerAndStepFromTheSettings) {
  const model::BertConfig cfg = test::small_bert(64, 16, 1, 2, 32, 16);
  comm::SingleProcess one;
  SessionSettings s;
  s.dims = {2, 8, 2, Precision::FP16};
  s.max_skipped_steps = 2;
  Session a(cfg, s, one, 7);
  EXPECT_TRUE(a.scaler.enabled());
  EXPECT_EQ(a.scaler.scale(), 65536.0f);
  EXPECT_FALSE(a.scaler.update(false, 0));
  EXPECT_FALSE(a.scaler.update(false, 1));
  EXPECT_THROW(a.scaler.update(false, 2), Error);  // the third skip in a row: past 2
  EXPECT_EQ(a.opt.m().size(), static_cast<size_t>(a.m.table().total()));
  EXPECT_FALSE(a.opt.sharded());
  s.dims.precision = Precision::BF16;
  if (test::bf16_unavailable().empty()) {
    Session b(cfg, s, one, 7);
    EXPECT_FALSE(b.scaler.enabled());  // only fp16 scales the loss
    EXPECT_EQ(std::memcmp(a.m.params(), b.m.params(), a.m.table().total() * sizeof(float)), 0);
  }
  Step& st = a.start({});
  EXPECT_EQ(&a.step(), &st);
}

struct TrainEnv {
  test::TempDir dir;
  std::string data, config;
  // short_seq_prob: create_pretraining_data's share of instances with a shorter target length.
  explicit TrainEnv(double short_seq_prob = 0.1) {
    prep::PrepareConfig p;
    p.instance.short_seq_prob = short_seq_prob;
    p.input = root("data/corpus/bert_sample_text.txt") + "," +
              root("data/corpus/gutenberg/shakespeare-caesar.txt");
    p.vocab = root("data/vocab/bert-base-uncased-vocab.txt");
    p.output = dir / "data";
    p.instance.seq_len = 64;
    p.instance.max_predictions = 10;
    p.dupe_factor = 2;
    p.output_shards = 2;
    prep::prepare(p);
    data = dir / "data/*.tfrecord";
    config = dir / "tiny.json";
    std::ofstream(config) << R"({"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64})";
  }
  TrainConfig cfg(const std::string& out, int64_t steps) const {
    TrainConfig c;
    c.model_config = config;
    c.input.files = data;
    c.output = dir / out;
    c.batch_size = 8;
    c.seq_len = 64;
    c.max_predictions = 10;
    c.steps = steps;
    c.lr = 2e-3;
    c.warmup = 0.05;
    c.log_every = 0;
    c.quiet = true;
    c.optimizer.kind = OptimizerKind::AdamW;
    return c;
  }
};

// f's error with every file it writes limited to `bytes` (a full disk on save, simulated).
std::string error_with_file_limit(rlim_t bytes, const std::function<void()>& f) {
  struct rlimit old {
  }, lim{};
  getrlimit(RLIMIT_FSIZE, &old);
  lim = old;
  lim.rlim_cur = bytes;
  auto handler = std::signal(SIGXFSZ, SIG_IGN);
  setrlimit(RLIMIT_FSIZE, &lim);
  const std::string e = error_of(f);
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, handler);
  return e;
}

std::string file_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Train, LowersTheMaskedLmLossOnRealText) {
  TrainEnv env;
  comm::SingleProcess comm;
  TrainResult r = train(env.cfg("run", 150), comm);
  ASSERT_EQ(r.losses.size(), 150u);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) {
    first += r.losses[i] / 10;
    last += r.losses[140 + i] / 10;
  }
  // Starts near ln(30522) + ln(2) = 11.0; the unigram distribution alone is worth ~4 nats.
  EXPECT_GT(first, 10.0);
  EXPECT_LT(last, first - 2.5) << "first " << first << ", last " << last;
}

// The model stores the vocabulary padded to a multiple of 64 (model::vocab_rows: 300 -> 320 here):
// the word embeddings and the decoder's bias have room for the padded rows, every tensor keeps
// its real shape (checkpoints, the optimizer), and after training steps (LAMB, weight decay on)
// the padding of the parameters and of the gradients is still zero: no token reaches it and its
// logits are no class. (The finite-difference gradient checks run a vocabulary of 23 in rows of
// 64; TfCheckpoint compares mlm_logits(), rows of the real vocabulary, for 30522 in 30528.)
TEST(Train, TheVocabularyIsPaddedTo64RowsAndItsPaddingStaysZero) {
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  EXPECT_EQ(model::vocab_rows(c), 320);
  model::BertModel m(c, model::Head::Pretraining, {4, 32, 5});
  const model::ParamTable& t = m.table();
  const int64_t C = c.hidden_size;
  auto padding_of = [&](const std::string& name, int64_t stored) {
    const model::ParamInfo& p = t.at(name);
    EXPECT_EQ(p.shape[0], c.vocab_size) << name;
    const int64_t next = p.offset + stored;  // the padding ends before the next tensor
    for (const model::ParamInfo& q : t.params())
      if (q.offset > p.offset) EXPECT_GE(q.offset, next) << name << " overlaps " << q.name;
    return std::pair{p.end(), next};
  };
  const auto word = padding_of("bert.embeddings.word_embeddings.weight", 320 * C);
  const auto bias = padding_of("cls.predictions.bias", 320);
  m.init_params(5);
  train::OptimizerConfig oc;
  oc.kind = train::OptimizerKind::Lamb;
  train::Optimizer opt(train::param_slices(t), t.total(), oc, kernels::cpu_backend());
  train::LossScaler scaler{train::LossScaler::Config{}};
  comm::SingleProcess single;
  train::Step step(m, opt, scaler, single, train::StepSettings{});
  for (int64_t k = 0; k < 3; ++k)
    EXPECT_TRUE(step.run(k, 1e-2, test::same_batch(test::learnable_batch(c, k))).applied);
  for (const auto& [b, e] : {word, bias})
    for (int64_t i = b; i < e; ++i) {
      ASSERT_EQ(m.params()[i], 0.0f) << "parameter padding at " << i - b;
      ASSERT_EQ(m.grads()[i], 0.0f) << "gradient padding at " << i - b;
    }
  bool trained = false;  // (the real rows did train)
  for (int64_t i = word.first - C; i < word.first; ++i) trained |= m.grads()[i] != 0.0f;
  EXPECT_TRUE(trained);
}

// Optimizer state written before the vocabulary was padded (no "layout" in its metadata, its
// moments laid out for a parameter buffer without the padding) is refused with the way on: the
// weights, through --init-checkpoint. A file of the current layout loads.
TEST(Train, OptimizerStateOfTheUnpaddedLayoutSaysHowToGoOn) {
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::ParamTable t(c, model::Head::Pretraining);
  train::Optimizer opt(train::param_slices(t), t.total(), {}, kernels::cpu_backend());
  test::TempDir dir;
  train::save_optimizer_state(dir.path.string(), opt);
  EXPECT_NO_THROW(train::load_optimizer_state(dir.path.string(), opt));
  const int64_t unpadded = t.total() - (model::vocab_rows(c) - c.vocab_size) * c.hidden_size;
  const std::vector<float> zeros(static_cast<size_t>(unpadded), 0.0f);
  write_safetensors(
      (dir.path / "optimizer.safetensors").string(),
      {{"m", DType::F32, {unpadded}, zeros.data()}, {"v", DType::F32, {unpadded}, zeros.data()}},
      {{"format", "bertrain-optimizer"}, {"optimizer", train::optimizer_name(opt.config().kind)}});
  const std::string err = error_of([&] { train::load_optimizer_state(dir.path.string(), opt); });
  EXPECT_NE(err.find("before bertrain padded the vocabulary"), std::string::npos) << err;
  EXPECT_NE(err.find("--init-checkpoint " + dir.path.string()), std::string::npos) << err;
}

// The trainer on a backend with memory of its own (what --device cuda gives it): the model, its
// gradients and the optimizer's moments in that memory, every kernel handed only that memory
// (OwnMemoryBackend fails the test otherwise), checkpoints written and read through to_host /
// to_device. The same run as on the CPU, bit for bit: losses, and the checkpoint's model and
// optimizer files; and a run stopped and resumed on it continues the same losses.
TEST(Train, OnABackendWithItsOwnMemoryEqualsTheCpu) {
  TrainEnv env;
  comm::SingleProcess comm;
  const test::OwnMemoryBackend own;
  for (Precision p : {Precision::FP32, Precision::BF16}) {
    if (p == Precision::BF16 && !kernels::gemm_bf16_available()) continue;
    SCOPED_TRACE(precision_name(p));
    TrainConfig a = env.cfg(std::string("cpu-") + precision_name(p), 12);
    TrainConfig b = env.cfg(std::string("own-") + precision_name(p), 12);
    a.precision = b.precision = p;
    a.save_every = b.save_every = 6;
    b.backend = &own;
    // --trace-input: each batch under the step that trains on it, the batches the device's
    // steps read ahead too.
    a.trace_input = a.output + ".trace";
    b.trace_input = b.output + ".trace";
    const TrainResult ra = train(a, comm), rb = train(b, comm);
    EXPECT_EQ(ra.losses, rb.losses);
    const std::string trace = file_bytes(a.trace_input + ".rank-0");
    EXPECT_EQ(std::count(trace.begin(), trace.end(), '\n'), 12 * 8);  // 12 steps of 8 rows
    EXPECT_EQ(trace, file_bytes(b.trace_input + ".rank-0"));
    for (const char* f : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_EQ(file_bytes(a.output + "/checkpoint-000012/" + f),
                file_bytes(b.output + "/checkpoint-000012/" + f))
          << f;
    // Stopped after 6 steps and resumed there: the moments come back through to_device.
    TrainConfig c = b;
    c.output = b.output + "-resumed";
    c.stop_after = 6;
    train(c, comm);
    c.stop_after = 0;
    c.resume = true;
    const TrainResult rc = train(c, comm);
    ASSERT_EQ(rc.losses.size(), 6u);
    EXPECT_EQ(std::vector<double>(rb.losses.begin() + 6, rb.losses.end()), rc.losses);
    // Resumed from the checkpoint saved at step 6 of the whole run, when the device's step had
    // already read step 7's batch (Step::holds_next): the input position saved is the one before
    // that read, so the resumed run reads it again.
    TrainConfig mid = b;
    mid.output = b.output + "-mid";
    std::filesystem::copy(b.output, mid.output, std::filesystem::copy_options::recursive);
    std::filesystem::remove_all(mid.output + "/checkpoint-000012");
    std::ofstream(mid.output + "/latest") << "checkpoint-000006\n";
    mid.resume = true;
    EXPECT_EQ(std::vector<double>(rb.losses.begin() + 6, rb.losses.end()), train(mid, comm).losses);
    // Stopped on the device and resumed on the CPU, and the other way round (what
    // CudaModel.ARunMovesBetweenTheGpuAndTheCpu does with a GPU): the same losses.
    for (bool device_first : {true, false}) {
      TrainConfig m = b;
      m.output = b.output + (device_first ? "-to-cpu" : "-from-cpu");
      m.backend = device_first ? &own : nullptr;
      m.stop_after = 6;
      train(m, comm);
      m.backend = device_first ? nullptr : &own;
      m.stop_after = 0;
      m.resume = true;
      EXPECT_EQ(std::vector<double>(rb.losses.begin() + 6, rb.losses.end()), train(m, comm).losses)
          << (device_first ? "device, then CPU" : "CPU, then device");
    }
  }
  // What it cannot do yet says so.
  TrainConfig t = env.cfg("own-autotune", 2);
  t.backend = &own;
  t.autotune = true;
  EXPECT_NE(test::error_of([&] { train(t, comm); }).find("on the own-memory backend run without"),
            std::string::npos);
  // A device with room for 4 sequences, asked for 8: the run stops before it allocates anything,
  // naming the largest batch that fits.
  TrainConfig four = env.cfg("own-small", 2);
  four.batch_size = 4;
  const test::OwnMemoryBackend small(plan::training_plan(model::BertConfig::load(env.config),
                                                         model::Head::Pretraining,
                                                         model_dims(four, 0, 1), 2, 1, own)
                                         .total_bytes() +
                                     static_cast<size_t>(plan::kDeviceHeadroom) + 1000);
  TrainConfig eight = env.cfg("own-small", 2);
  eight.backend = &small;
  const std::string e = test::error_of([&] { train(eight, comm); });
  EXPECT_NE(e.find("batch 8 x 64 tokens needs"), std::string::npos) << e;
  EXPECT_NE(e.find("the largest batch that fits is 4 (--batch-size 4)"), std::string::npos) << e;
  EXPECT_EQ(small.peak(), 0u);
  four.backend = &small;
  EXPECT_EQ(train(four, comm).losses.size(), 2u);
}

// 300 steps in a 16-bit precision against the same run in fp32: windows of 50 steps agree
// within `band` nats (the rounding perturbs every step; the curves drift apart only as two seeds
// of the same run would), and the run really used that precision (the losses differ from the
// first step on).
void expect_tracks_fp32(Precision p, double band) {
  TrainEnv env;
  comm::SingleProcess comm;
  const int steps = 300, window = 50;
  TrainConfig a = env.cfg("fp32", steps), b = env.cfg(precision_name(p), steps);
  b.precision = p;
  TrainResult ra = train(a, comm), rb = train(b, comm);
  double worst = 0;
  for (int w = 0; w < steps / window; ++w) {
    double la = 0, lb = 0;
    for (int i = 0; i < window; ++i) {
      la += ra.losses[window * w + i] / window;
      lb += rb.losses[window * w + i] / window;
    }
    EXPECT_NEAR(la, lb, band) << "steps " << window * w << ".." << window * (w + 1) - 1;
    worst = std::max(worst, std::fabs(la - lb));
  }
  EXPECT_NE(ra.losses[0], rb.losses[0]);
  std::printf("%s vs fp32: largest difference of %d-step mean losses %.1e nats (band %.2f)\n",
              precision_name(p), window, worst, band);
}

// bf16 rounds every matmul operand (~1e-2 relative per step).
TEST(Train, Bf16TracksTheFp32LossCurve) {
  BT_SKIP_WITHOUT_BF16();
  expect_tracks_fp32(Precision::BF16, 0.15);  // measured 2e-3
}

// fp16 storage rounds only the kept activations (~5e-4 relative, fp32 weights and arithmetic).
TEST(Train, Fp16TracksTheFp32LossCurve) {
  expect_tracks_fp32(Precision::FP16, 0.02);  // measured < 1e-4
}

// Evaluation counts every example once, whatever the batch size (the last batch partial), and
// its metrics do not depend on the batching (sums of per-example terms, to float rounding);
// in fp16 and bf16 they move by about their precision (same loss within 1e-2 nats).
TEST(Evaluate, EveryExampleOnceAndBatchingDoesNotMatter) {
  TrainEnv env;
  comm::SingleProcess comm;
  TrainConfig c = env.cfg("ev", 30);
  const TrainResult tr = train(c, comm);
  int64_t records = 0;
  for (const auto& f : data::list_files(env.data)) {
    data::TFRecordReader rd(f, data::Compression::None);
    while (rd.skip()) ++records;
  }
  ASSERT_GT(records, 20);
  const model::BertConfig cfg = model::BertConfig::load(env.config);
  auto eval = [&](int64_t batch, Precision p) {
    model::BertModel m(cfg, model::Head::Pretraining, with_precision({batch, 64, 10}, p));
    model::load_safetensors_into(m, model::checkpoint_weights_path(tr.last_checkpoint));
    return evaluate(m, env.data, batch, 0, comm);
  };
  const EvalResult a = eval(7, Precision::FP32), b = eval(16, Precision::FP32);
  EXPECT_EQ(a.examples, records);
  EXPECT_EQ(b.examples, records);
  EXPECT_EQ(a.predictions, b.predictions);
  EXPECT_GT(a.predictions, records);  // several masked positions per example
  EXPECT_NEAR(a.mlm_loss, b.mlm_loss, 1e-5 * a.mlm_loss);
  EXPECT_NEAR(a.mlm_accuracy, b.mlm_accuracy, 1e-9);
  EXPECT_NEAR(a.nsp_loss, b.nsp_loss, 1e-5);
  EXPECT_NEAR(a.nsp_accuracy, b.nsp_accuracy, 1e-9);
  EXPECT_LT(a.mlm_loss, std::log(30522.0));  // trained 30 steps: below the uniform guess
  std::vector<Precision> half = {Precision::FP16};
  if (test::bf16_unavailable().empty()) half.push_back(Precision::BF16);
  for (Precision p : half) {
    const EvalResult h = eval(16, p);
    EXPECT_EQ(h.examples, records) << precision_name(p);
    EXPECT_NEAR(h.mlm_loss, a.mlm_loss, 1e-2) << precision_name(p);
    EXPECT_NE(h.mlm_loss, b.mlm_loss) << precision_name(p);  // really ran in that precision
    EXPECT_NEAR(h.nsp_loss, a.nsp_loss, 1e-2) << precision_name(p);
  }
}

// Every precision this CPU runs: fp32 and fp16 everywhere, bf16 where oneDNN has bf16 matmuls.
class ResumeTest : public ::testing::TestWithParam<Precision> {};

TEST_P(ResumeTest, InterruptedAndResumedRunEqualsUninterrupted) {
  const Precision p = GetParam();
  if (p == Precision::BF16) BT_SKIP_WITHOUT_BF16();
  TrainEnv env;
  comm::SingleProcess comm;
  TrainConfig full = env.cfg(std::string("full") + precision_name(p), 24);
  full.precision = p;
  full.accumulation = 2;
  TrainResult a = train(full, comm);
  TrainConfig part = full;
  part.output = env.dir / (std::string("part") + precision_name(p));
  part.stop_after = 10;
  TrainResult b1 = train(part, comm);
  EXPECT_TRUE(b1.interrupted);
  EXPECT_EQ(b1.steps_done, 10);
  part.stop_after = 0;
  part.resume = true;
  TrainResult b2 = train(part, comm);
  std::vector<double> losses = b1.losses;
  losses.insert(losses.end(), b2.losses.begin(), b2.losses.end());
  ASSERT_EQ(losses, a.losses) << precision_name(p);  // bitwise, every step
  EXPECT_EQ(file_bytes(a.last_checkpoint + "/model.safetensors"),
            file_bytes(b2.last_checkpoint + "/model.safetensors"));
  EXPECT_EQ(file_bytes(a.last_checkpoint + "/optimizer.safetensors"),
            file_bytes(b2.last_checkpoint + "/optimizer.safetensors"));
}

// --autotune: the trials run on a throwaway model, so the run equals, bit for bit, a run given
// the chosen settings as flags; the choice is in the checkpoint, and a resume keeps it (and
// continues bit for bit) without measuring again.
TEST(Train, AutotuneChoosesWithoutTouchingTheRun) {
  TrainEnv env;
  comm::SingleProcess comm;
  const int threads = omp_get_max_threads();
  TrainConfig tuned = env.cfg("tuned", 8);
  tuned.autotune = true;
  tuned.save_every = 4;
  TrainResult a = train(tuned, comm);
  const nlohmann::json st =
      nlohmann::json::parse(file_bytes(a.last_checkpoint + "/trainer_state.json"));
  ASSERT_TRUE(st["settings"].contains("autotune")) << st.dump();
  const Tuning choice = Tuning::from_json(st["settings"]["autotune"]);
  // Both kernels timed (the run asked for none), and fewer threads where there were several.
  std::set<std::string> tried;
  for (const auto& t : choice.trials) {
    tried.insert(t.knob + "=" + t.value);
    EXPECT_GT(t.step_ms, 0.0) << t.knob << " " << t.value;
  }
  EXPECT_TRUE(tried.count("attention=full") && tried.count("attention=blocked"));
  if (threads > 1) {
    EXPECT_TRUE(tried.count("threads=" + std::to_string(threads / 2)));
  }
  EXPECT_NE(choice.attention, model::ModelDims::Attention::Auto);

  omp_set_num_threads(threads);
  TrainConfig fixed = env.cfg("fixed", 8);
  fixed.attention = choice.attention;
  fixed.bucket_mb = choice.bucket_mb;
  omp_set_num_threads(choice.threads);
  TrainResult b = train(fixed, comm);
  EXPECT_EQ(a.losses, b.losses);  // bitwise: the trials left the run alone

  // Resumed from step 4 (its checkpoint holds the same choice): no new trials, the same steps.
  omp_set_num_threads(threads);
  TrainConfig part = env.cfg("part", 8);
  part.autotune = true;
  part.stop_after = 4;
  TrainResult c1 = train(part, comm);
  omp_set_num_threads(threads);
  part.stop_after = 0;
  part.resume = true;
  part.autotune = false;  // kept from the checkpoint all the same
  Tuning kept;
  ASSERT_TRUE(stored_tuning(part, kept));
  EXPECT_NE(kept.source.find("checkpoint-000004"), std::string::npos) << kept.source;
  TrainResult c2 = train(part, comm);
  const nlohmann::json st2 =
      nlohmann::json::parse(file_bytes(c2.last_checkpoint + "/trainer_state.json"));
  EXPECT_EQ(st2["settings"]["autotune"],
            nlohmann::json::parse(
                file_bytes(c1.last_checkpoint + "/trainer_state.json"))["settings"]["autotune"]);
  EXPECT_EQ(c2.losses.size(), 4u);
  EXPECT_EQ(omp_get_max_threads(), kept.threads);  // the stored thread count applied
  omp_set_num_threads(threads);
}

// --pack: batches of packed rows train, a resumed run equals the uninterrupted one bit for bit
// (the packed batches replayed to the position), the positions count the instances read, and
// a resume with another packing is refused.
TEST(Train, PackedRunResumesExactly) {
  TrainEnv env(0.5);  // half the instances shorter than 64 tokens: some share rows
  comm::SingleProcess comm;
  TrainConfig full = env.cfg("packed", 12);
  full.input.pack_per_row = 3;
  full.save_every = 6;
  TrainResult a = train(full, comm);
  EXPECT_LT(a.losses.back(), a.losses.front());
  const nlohmann::json st =
      nlohmann::json::parse(file_bytes(a.last_checkpoint + "/trainer_state.json"));
  EXPECT_EQ(st["settings"]["pack"], 3);
  // 12 batches of 8 rows hold more than 12 x 8 instances.
  const auto& pos = st["pipeline"][0];
  ASSERT_EQ(pos["epoch"], 0);
  EXPECT_GT(pos["examples"].get<uint64_t>(), 12u * 8u);
  TrainConfig part = full;
  part.output = env.dir / "packed_part";
  part.stop_after = 5;
  TrainResult b1 = train(part, comm);
  part.stop_after = 0;
  part.resume = true;
  TrainResult b2 = train(part, comm);
  std::vector<double> losses = b1.losses;
  losses.insert(losses.end(), b2.losses.begin(), b2.losses.end());
  EXPECT_EQ(losses, a.losses);
  part.input.pack_per_row = 2;
  try {
    train(part, comm);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("it was trained with pack = 3, this run has 2"),
              std::string::npos)
        << e.what();
  }
}

// --pack auto with --autotune: the three pack trials on their own packed batches, compared by
// real tokens/s; the choice is the run's packing (settings.pack), and the run equals one given
// the choices as flags.
TEST(Train, AutotuneChoosesThePackingWhenAskedTo) {
  TrainEnv env(0.5);
  comm::SingleProcess comm;
  const int threads = omp_get_max_threads();
  TrainConfig tuned = env.cfg("tuned_pack", 6);
  tuned.autotune = true;
  tuned.autotune_pack = true;
  tuned.input.pack_per_row = 4;
  TrainResult a = train(tuned, comm);
  const nlohmann::json st =
      nlohmann::json::parse(file_bytes(a.last_checkpoint + "/trainer_state.json"));
  const Tuning choice = Tuning::from_json(st["settings"]["autotune"]);
  std::vector<std::string> packs;
  for (const auto& t : choice.trials)
    if (t.knob == "pack") {
      packs.push_back(t.value);
      EXPECT_GT(t.tokens_per_s, 0.0);
    }
  EXPECT_EQ(packs, (std::vector<std::string>{"3", "2", "4"}));
  ASSERT_GE(choice.pack, 2);
  ASSERT_LE(choice.pack, 4);
  EXPECT_EQ(st["settings"]["pack"], choice.pack);
  omp_set_num_threads(threads);
  TrainConfig fixed = env.cfg("fixed_pack", 6);
  fixed.input.pack_per_row = choice.pack;
  fixed.attention = choice.attention;
  fixed.bucket_mb = choice.bucket_mb;
  omp_set_num_threads(choice.threads);
  TrainResult b = train(fixed, comm);
  EXPECT_EQ(a.losses, b.losses);
  omp_set_num_threads(threads);
}

INSTANTIATE_TEST_SUITE_P(Train, ResumeTest,
                         ::testing::Values(Precision::FP32, Precision::FP16, Precision::BF16),
                         [](const auto& info) { return std::string(precision_name(info.param)); });

TEST(Train, SigtermFinishesTheStepCheckpointsAndExitsZero) {
  TrainEnv env;
  const std::string out = env.dir / "sig";
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    execl(BERTRAIN_BINARY, "bertrain", "train", "--model-config", env.config.c_str(), "--data",
          env.data.c_str(), "--output", out.c_str(), "--batch-size", "8", "--seq-len", "64",
          "--max-predictions", "10", "--steps", "100000", "--log-every", "1", "--threads", "1",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  FILE* f = fdopen(fds[0], "r");
  std::string output;
  char line[4096];
  int steps = 0;
  while (fgets(line, sizeof line, f)) {
    output += line;
    if (std::string(line).rfind("step ", 0) == 0 && ++steps == 3) kill(pid, SIGTERM);
  }
  fclose(f);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  EXPECT_NE(output.find("stopped by signal 15"), std::string::npos) << output;
  const std::string ck = resolve_checkpoint(out);
  ASSERT_FALSE(ck.empty());
  EXPECT_TRUE(std::filesystem::exists(ck + "/model.safetensors"));
}

TEST(Train, TimelineIsAChromeTraceWithLayerSpans) {
  TrainEnv env;
  comm::SingleProcess comm;
  TrainConfig c = env.cfg("tl", 3);
  c.timeline = env.dir / "trace.json";
  train(c, comm);
  std::ifstream in(c.timeline);
  auto j = nlohmann::json::parse(in);
  std::set<std::string> names;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "X") {
      names.insert(e["name"].get<std::string>());
      EXPECT_GE(e["dur"].get<int64_t>(), 0);
    }
  for (const char* n : {"input wait", "forward", "backward", "optimizer", "forward layer 1",
                        "backward layer 0", "step 2"})
    EXPECT_TRUE(names.count(n)) << n;
}

TEST(Train, DocumentedErrors) {
  TrainEnv env;
  comm::SingleProcess comm;
  TrainConfig c = env.cfg("errs", 4);
  train(c, comm);
  const std::string good = resolve_checkpoint(c.output);
  ASSERT_FALSE(good.empty());
  const std::string before = file_bytes(good + "/model.safetensors");

  // Missing data.
  TrainConfig bad = c;
  bad.input.files = env.dir / "nothing*.tfrecord";
  EXPECT_NE(error_of([&] { train(bad, comm); }).find("no files match"), std::string::npos);
  // Data of another sequence length.
  bad = c;
  bad.seq_len = 32;
  EXPECT_NE(
      error_of([&] { train(bad, comm); }).find("the data's sequence length differs from --seq-len"),
      std::string::npos);
  // Resuming with another model.
  bad = c;
  bad.resume = true;
  std::ofstream(env.dir / "other.json")
      << R"({"vocab_size": 30522, "hidden_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64})";
  bad.model_config = env.dir / "other.json";
  EXPECT_NE(error_of([&] { train(bad, comm); }).find("is of another model"), std::string::npos);
  // Resuming with another batch size.
  bad = c;
  bad.resume = true;
  bad.steps = 8;
  bad.batch_size = 4;
  EXPECT_NE(error_of([&] { train(bad, comm); }).find("batch_size = 8"), std::string::npos);
  // A diverging model (absurd initial weights): the loss is not finite -> error naming the step.
  std::ofstream(env.dir / "wild.json")
      << R"({"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64, "initializer_range": 1e30})";
  bad = env.cfg("wild", 4);
  bad.model_config = env.dir / "wild.json";
  std::string e = error_of([&] { train(bad, comm); });
  EXPECT_NE(e.find("step 0:"), std::string::npos) << e;
  // fp16: activations beyond the fp16 range (weights of scale 1e5 make QKV ~1e6) overflow at
  // any loss scale: the scaler skips and halves, then gives up naming bf16. fp32 trains it.
  std::ofstream(env.dir / "hot.json")
      << R"({"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64, "initializer_range": 1e5})";
  bad = env.cfg("hot32", 2);
  bad.model_config = env.dir / "hot.json";
  EXPECT_EQ(error_of([&] { train(bad, comm); }), "");
  bad = env.cfg("hot16", 8);
  bad.model_config = env.dir / "hot.json";
  bad.precision = Precision::FP16;
  bad.max_skipped_steps = 3;
  e = error_of([&] { train(bad, comm); });
  EXPECT_NE(e.find("step 3: gradients are not finite in 4 consecutive steps"), std::string::npos)
      << e;
  EXPECT_NE(e.find("--precision bf16"), std::string::npos) << e;
  // A full disk on save (simulated with a file size limit): a clear error, the previous
  // checkpoint untouched and still `latest`.
  bad = c;
  bad.resume = true;
  bad.steps = 6;
  e = error_with_file_limit(64 * 1024, [&] { train(bad, comm); });
  EXPECT_NE(e.find("could not save checkpoint"), std::string::npos) << e;
  EXPECT_NE(e.find("the previous checkpoint is intact"), std::string::npos) << e;
  EXPECT_EQ(resolve_checkpoint(c.output), good);
  EXPECT_EQ(file_bytes(good + "/model.safetensors"), before);
}

// Checkpoint writes cut short by SIGKILL (preemption, the OOM killer) leave their staging
// directories; the next run in that directory removes those of this host's writers that are gone
// (a bare pid: an older bertrain's), leaves another host's and a live writer's alone, and says
// so in its banner, as it says when --resume finds nothing to resume. A first checkpoint that
// cannot be written says there was none before it instead of naming an empty one.
TEST(Train, AbandonedCheckpointWritesAreRemovedAndAnEmptyResumeSaysSo) {
  TrainEnv env;
  comm::SingleProcess comm;
  TrainConfig c = env.cfg("abandoned", 2);
  c.resume = true;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);  // a pid whose process is gone
  const std::string dir = c.output, gone = std::to_string(child);
  const std::vector<std::string> removed = {dir + "/.checkpoint-4.tmp-" + host + "-" + gone,
                                            dir + "/.checkpoint-3.tmp-" + gone},
                                 kept = {dir + "/.checkpoint-5.tmp-otherhost-" + gone,
                                         dir + "/.checkpoint-6.tmp-" + host + "-" +
                                             std::to_string(getpid())};
  for (const auto& d : removed) std::filesystem::create_directories(d + "/part");
  for (const auto& d : kept) std::filesystem::create_directories(d);
  const std::string banner = Trainer(c, comm).banner();
  for (const auto& d : removed) {
    EXPECT_FALSE(std::filesystem::exists(d)) << d;
    EXPECT_NE(banner.find("removed " + d + ": a checkpoint write whose process is gone"),
              std::string::npos)
        << banner;
  }
  for (const auto& d : kept) EXPECT_TRUE(std::filesystem::exists(d)) << d;
  EXPECT_NE(banner.find("--resume: " + dir + " holds no checkpoint yet: starting fresh"),
            std::string::npos)
      << banner;
  // The first checkpoint, its file cut by a file size limit.
  c = env.cfg("first", 2);
  const std::string e = error_with_file_limit(64 * 1024, [&] { train(c, comm); });
  EXPECT_NE(e.find("could not save checkpoint"), std::string::npos) << e;
  EXPECT_NE(e.find(c.output + " holds no earlier checkpoint (this was its first)"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("intact ()"), std::string::npos) << e;
}

// One job per run directory: a second job on it stops naming the first (host, pid, command
// line), and so does a train job; another directory is free. The lock goes with its holder: a
// clean end leaves nothing to say, a killed holder (its name still in the file) is taken over,
// saying from whom.
TEST(Train, ASecondJobOnARunDirectoryStopsNamingTheFirst) {
  test::TempDir tmp;
  const std::string dir = tmp / "run";
  const auto npos = std::string::npos;
  {
    RunDirLock first(dir);
    EXPECT_EQ(first.note(), "");
    const std::string e = error_of([&] { RunDirLock second(dir); });
    EXPECT_NE(e.find(dir + " is in use by another job (host "), npos) << e;
    EXPECT_NE(e.find(", pid " + std::to_string(getpid()) + ", started "), npos) << e;
    EXPECT_NE(e.find("one job per run directory"), npos) << e;
    TrainEnv env;
    comm::SingleProcess comm;
    TrainConfig c = env.cfg("locked", 2);
    c.output = dir;
    const std::string t = error_of([&] { train(c, comm); });
    EXPECT_NE(t.find(dir + " is in use by another job"), npos) << t;
    RunDirLock other(tmp / "other");
  }
  {
    RunDirLock again(dir);
    EXPECT_EQ(again.note(), "");
  }
  const pid_t child = fork();
  if (child == 0) {
    RunDirLock held(dir);
    _exit(0);  // no destructor runs, as after a SIGKILL
  }
  waitpid(child, nullptr, 0);
  RunDirLock after(dir);
  EXPECT_NE(after.note().find("took over " + dir + "/bertrain.lock from a job that is gone (host "),
            npos)
      << after.note();
  EXPECT_NE(after.note().find(", pid " + std::to_string(child) + ", "), npos) << after.note();
}

// The sharded optimizer's state in a checkpoint loads on any number of ranks: parts saved by 4,
// 3, 2 ranks or whole, loaded into 1, 2, 3 or 4 parts (every moment lands at its parameter);
// a missing shard file or another optimizer's state is an error that says which.
TEST(ShardedCheckpoint, OptimizerStateRepartitionsOntoAnyNumberOfRanks) {
  // Tensors of odd sizes, so parts cut through them (the 16-float cuts ignore tensor bounds).
  const std::vector<ParamSlice> slices = {
      {"a", 0, 1000, true}, {"b", 1000, 37, false}, {"c", 1037, 5003, true}};
  const int64_t total = 6040;
  OptimizerConfig oc;
  test::TempDir tmp;
  for (int saved : {4, 3, 2, 1}) {
    const std::string dir = tmp / ("saved" + std::to_string(saved));
    std::filesystem::create_directories(dir);
    for (int r = 0; r < saved; ++r) {
      Optimizer o(slices, total, oc, kernels::cpu_backend(), shard_of(total, r, saved));
      for (size_t j = 0; j < o.m().size(); ++j) {
        o.m()[j] = static_cast<float>(o.shard().begin + static_cast<int64_t>(j));
        o.v()[j] = -o.m()[j];
      }
      save_optimizer_state(dir, o);
    }
    EXPECT_EQ(optimizer_state_files(dir).size(), static_cast<size_t>(saved));
    for (int world : {1, 2, 3, 4})
      for (int r = 0; r < world; ++r) {
        Optimizer o(slices, total, oc, kernels::cpu_backend(), shard_of(total, r, world));
        load_optimizer_state(dir, o);
        for (size_t j = 0; j < o.m().size(); ++j) {
          const float want = static_cast<float>(o.shard().begin + static_cast<int64_t>(j));
          ASSERT_EQ(o.m()[j], want) << saved << " -> " << world << ", rank " << r << " at " << j;
          ASSERT_EQ(o.v()[j], -want);
        }
      }
  }
  // A shard missing (a rank wrote where rank 0 cannot see): the gap is named.
  std::filesystem::remove(tmp / "saved4/optimizer.rank-00002-of-00004.safetensors");
  Optimizer whole(slices, total, oc);
  std::string e = error_of([&] { load_optimizer_state(tmp / "saved4", whole); });
  EXPECT_NE(e.find("leave out parameters [3024, 4528)"), std::string::npos) << e;
  EXPECT_NE(e.find("a shard file is missing"), std::string::npos) << e;
  // Another optimizer's state.
  OptimizerConfig lamb = oc;
  lamb.kind = OptimizerKind::Lamb;
  Optimizer other(slices, total, lamb);
  e = error_of([&] { load_optimizer_state(tmp / "saved2", other); });
  EXPECT_NE(e.find("resume with the same optimizer"), std::string::npos) << e;
  // Another model's.
  Optimizer bigger(slices, total + 16, oc);
  e = error_of([&] { load_optimizer_state(tmp / "saved3", bigger); });
  EXPECT_NE(e.find("the model needs 6056"), std::string::npos) << e;
  // The cuts: consecutive, 16-aligned, near-equal, covering everything.
  for (int world : {1, 2, 3, 4, 7}) {
    int64_t at = 0;
    for (int r = 0; r < world; ++r) {
      const Shard s = shard_of(total, r, world);
      EXPECT_EQ(s.begin, at);
      EXPECT_EQ(s.begin % 16, 0);
      EXPECT_LE(std::abs(s.size() - total / world), 16);
      at = s.end;
    }
    EXPECT_EQ(at, total);
  }
}

}  // namespace
}  // namespace bertrain::train
