// NCCL between GPUs (comm/nccl.h). The ranks are threads of this process, one GPU each, their
// bootstrap an in-process communicator (what MPI is to a job's processes): the collectives
// against sums made on the host, a model on two GPUs at half the batch against one GPU at the
// whole batch (with and without overlap), buckets reduced while backward runs, and a rank that
// never joins a collective ending the job with a message instead of a hang. One-rank tests need one
// GPU; the rest skip with fewer than two. NCCL is loaded at run time: without libnccl.so.2 the
// tests skip saying so.
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "comm/nccl.h"
#include "kernels/cuda/cuda.h"
#include "model/bert.h"
#include "obs/timeline.h"
#include "test_util.h"
#include "train/loss_scaler.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace bertrain {
namespace {

// Threads as ranks: broadcast through a shared buffer between barriers.
struct ThreadGroup {
  explicit ThreadGroup(int n) : size(n), sync(n) {}
  int size;
  std::barrier<> sync;
  std::vector<char> buffer;
};

class ThreadRank final : public comm::Communicator {
 public:
  ThreadRank(ThreadGroup& g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size; }
  void allreduce_sum(float*, int64_t) override { fail("ThreadRank: bootstrap only"); }
  void allreduce_sum(double*, int64_t) override { fail("ThreadRank: bootstrap only"); }
  void broadcast(void* data, int64_t bytes, int root) override {
    g_.sync.arrive_and_wait();
    if (rank_ == root) g_.buffer.assign(static_cast<char*>(data), static_cast<char*>(data) + bytes);
    g_.sync.arrive_and_wait();
    std::memcpy(data, g_.buffer.data(), static_cast<size_t>(bytes));
    g_.sync.arrive_and_wait();
  }
  void barrier() override { g_.sync.arrive_and_wait(); }
  std::string name() const override { return "threads"; }

 private:
  ThreadGroup& g_;
  int rank_;
};

// Runs f(rank, communicator) on `ranks` threads, each with a NCCL communicator of its own GPU.
void on_gpus(int ranks, const std::function<void(int, comm::Communicator&)>& f,
             double stall_s = 60.0, Precision wire = Precision::FP32) {
  ThreadGroup g(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      ThreadRank boot(g, r);
      auto nccl = comm::make_nccl_communicator(boot, stall_s, wire);
      f(r, *nccl);
    });
  for (auto& t : threads) t.join();
}

// Skips without `gpus` GPUs or without NCCL.
#define SKIP_WITHOUT(gpus)                                                                \
  do {                                                                                    \
    if (cuda::device_count() < (gpus))                                                    \
      GTEST_SKIP() << (gpus) << " GPU(s) needed, " << cuda::device_count() << " visible"; \
    comm::SingleProcess one;                                                              \
    try {                                                                                 \
      comm::make_nccl_communicator(one);                                                  \
    } catch (const Error& e) {                                                            \
      if (std::string(e.what()).find("cannot be loaded") != std::string::npos)            \
        GTEST_SKIP() << e.what();                                                         \
      throw;                                                                              \
    }                                                                                     \
  } while (0)

std::vector<float> download(const cuda::DeviceBuffer& b, int64_t n) {
  std::vector<float> h(static_cast<size_t>(n));
  b.download(h.data(), h.size() * 4);
  return h;
}

// Without a GPU, asking for NCCL names the rank and the host that see none.
TEST(Nccl, WithoutAGpuSaysSo) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "a GPU is visible here";
  comm::SingleProcess one;
  const std::string e = test::error_of([&] { comm::make_nccl_communicator(one); });
  EXPECT_NE(e.find("rank 0 on host "), std::string::npos) << e;
  EXPECT_NE(e.find(" sees no GPU (nvidia-smi lists them; check CUDA_VISIBLE_DEVICES)"),
            std::string::npos)
      << e;
}

TEST(Nccl, OneRankCollectivesOnOneGpu) {
  SKIP_WITHOUT(1);
  comm::SingleProcess one;
  auto c = comm::make_nccl_communicator(one);
  EXPECT_TRUE(c->device_memory());
  EXPECT_NE(c->name().find("NCCL"), std::string::npos) << c->name();
  const std::vector<float> x = {1, 2, 3, 4, 5};
  cuda::DeviceBuffer d(x.size() * 4);
  d.upload(x.data(), x.size() * 4);
  c->allreduce_sum(d.f32(), 5);
  EXPECT_EQ(download(d, 5), x);
  c->scale(d.f32(), 5, 0.5f);
  EXPECT_EQ(download(d, 5), (std::vector<float>{0.5f, 1, 1.5f, 2, 2.5f}));
  double stats[2] = {3.0, -1.0};  // host memory: staged through the device
  c->allreduce_sum(stats, 2);
  EXPECT_EQ(stats[0], 3.0);
  EXPECT_TRUE(c->all(true));
  EXPECT_FALSE(c->all(false));
}

TEST(Nccl, TwoGpusSumGatherAndScatter) {
  SKIP_WITHOUT(2);
  const int64_t n = 1000;
  const std::vector<int64_t> uneven = {384, 616}, even = {500, 500};
  on_gpus(2, [&](int r, comm::Communicator& c) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 7 + r * 1000);
    cuda::DeviceBuffer d(n * 4);
    d.upload(x.data(), n * 4);
    c.allreduce_sum(d.f32(), n);
    std::vector<float> sum = download(d, n);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(sum[i], 2 * (i % 7) + 1000) << i;
    for (const auto& counts : {uneven, even}) {
      d.upload(x.data(), n * 4);
      c.reduce_scatter_sum(d.f32(), n, counts);
      const int64_t b = r == 0 ? 0 : counts[0], e = b + counts[r];
      sum = download(d, n);
      for (int64_t i = b; i < e; ++i) EXPECT_EQ(sum[i], 2 * (i % 7) + 1000) << i;
      d.upload(x.data(), n * 4);
      c.allgather(d.f32(), n, counts);
      const std::vector<float> all = download(d, n);
      for (int64_t i = 0; i < n; ++i)
        EXPECT_EQ(all[i], static_cast<float>(i % 7 + (i < counts[0] ? 0 : 1000))) << i;
    }
    double flags[1] = {r == 1 ? 1.0 : 0.0};
    c.allreduce_sum(flags, 1);
    EXPECT_EQ(flags[0], 1.0);
  });
}

// 16 bits on the wire: small integers (exact in fp16 and bf16) sum exactly; the statistics in
// host memory stay doubles.
TEST(Nccl, TwoGpusSumIn16BitsOnTheWire) {
  SKIP_WITHOUT(2);
  const int64_t n = 5000;
  for (Precision w : {Precision::FP16, Precision::BF16})
    on_gpus(
        2,
        [&](int r, comm::Communicator& c) {
          EXPECT_NE(c.name().find(" on the wire"), std::string::npos) << c.name();
          std::vector<float> x(n);
          for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 7 + r);
          cuda::DeviceBuffer d(n * 4);
          d.upload(x.data(), n * 4);
          c.allreduce_sum(d.f32(), n);
          const std::vector<float> sum = download(d, n);
          for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sum[i], 2 * (i % 7) + 1) << i;
          double exact[1] = {0.1 + r};
          c.allreduce_sum(exact, 1);
          EXPECT_EQ(exact[0], 0.1 + 1.1);
        },
        60.0, w);
}

// `steps` AdamW steps (learning rate 1e-3, dropout seed 9) of a pretraining model on this
// thread's GPU from the parameters of seed 11, on batch b each step, through comm; each step's
// report to `seen`. Returns the parameters after.
std::vector<float> train_on_gpu(const model::BertConfig& c, const model::Batch& b,
                                comm::Communicator& comm, train::StepSettings ss, int64_t steps,
                                obs::Timeline* tl = nullptr,
                                const std::function<void(const train::StepReport&)>& seen = {}) {
  model::BertModel m(c, model::Head::Pretraining, {b.B, b.T, b.P}, cuda::cuda_backend());
  m.init_params(11);
  train::Optimizer opt(train::param_slices(m.table()), m.table().total(), {}, cuda::cuda_backend());
  train::LossScaler scaler{train::LossScaler::Config{}};
  ss.seed = 9;
  train::Step step(m, opt, scaler, comm, ss, tl);
  for (int64_t k = 0; k < steps; ++k) {
    const train::StepReport r = step.run(k, 1e-3, [&](model::Batch& into) {
      into = b;
      return true;
    });
    if (seen) seen(r);
  }
  std::vector<float> p(static_cast<size_t>(m.table().total()));
  cuda::cuda_backend().to_host(p.data(), m.params(), p.size() * 4);
  return p;
}

// Three AdamW steps: two GPUs at half the batch each (overlapped with backward or not, a
// predivide factor of 2) against one GPU at the whole batch. Only the summation order differs:
// fp32 rounding carried through three Adam steps, 2e-6 (as the MPI tests' bound).
TEST(Nccl, TwoGpusAtHalfTheBatchEqualOneAtTheWhole) {
  SKIP_WITHOUT(2);
  const model::BertConfig c = test::small_bert(300, 64, 2, 4, 256, 64);
  const model::Batch full = test::random_batch(c, 8, 32, 5);
  auto train = [&](comm::Communicator& comm, const model::Batch& b, bool overlap) {
    train::StepSettings ss;
    ss.overlap = overlap;
    ss.bucket_bytes = 64 << 10;
    ss.predivide = 2.0;
    return train_on_gpu(c, b, comm, ss, 3);
  };
  comm::SingleProcess single;
  const std::vector<float> one = train(single, full, false);
  for (bool overlap : {false, true}) {
    std::vector<float> two[2];
    on_gpus(2, [&](int r, comm::Communicator& comm) {
      two[r] = train(comm, test::slice_batch(full, r * 4, 4), overlap);
    });
    EXPECT_EQ(two[0], two[1]) << "the GPUs disagree";
    double worst = 0;
    for (size_t i = 0; i < one.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(one[i] - two[0][i])));
    EXPECT_LE(worst, 2e-6) << (overlap ? "overlapped" : "after backward");
  }
}

// Overlap on the GPUs: a bucket's allreduce runs on NCCL's stream once the GPU has computed its
// layers, while backward computes the layers below (comm::Reducer, Communicator::ready_point).
// Eight encoder layers of 256, a bucket each: in the steps after the first, some bucket's
// timeline span (timed from when the GPU reached the bucket's point) begins before the step's
// backward span ends (backward ends when its kernels have run), and the steps report
// communication hidden behind backward.
TEST(Nccl, TwoGpusReduceBucketsWhileBackwardRuns) {
  SKIP_WITHOUT(2);
  const model::BertConfig c = test::small_bert(1000, 256, 8, 4, 1024, 128);
  const model::Batch b = test::random_batch(c, 16, 128, 20);
  on_gpus(2, [&](int r, comm::Communicator& comm) {
    obs::Timeline tl;
    tl.enable(r);
    train::StepSettings ss;
    ss.bucket_bytes = 1 << 20;
    int64_t k = 0;
    double hidden = 0;  // after the first step
    train_on_gpu(c, b, comm, ss, 4, &tl,
                 [&](const train::StepReport& rep) { hidden += k++ > 0 ? rep.t_hidden : 0.0; });
    EXPECT_GT(hidden, 0.0) << "rank " << r;
    std::vector<std::pair<int64_t, int64_t>> backward;  // [begin, end) of each step's backward
    std::vector<int64_t> buckets;                       // each bucket span's begin
    for (const obs::Timeline::Event& e : tl.events()) {
      if (e.name == "backward") backward.push_back({e.ts, e.ts + e.dur});
      if (e.name.rfind("allreduce bucket", 0) == 0) buckets.push_back(e.ts);
    }
    ASSERT_EQ(backward.size(), 4u);
    int overlapped = 0;
    for (size_t k = 1; k < backward.size(); ++k)
      for (int64_t t : buckets) overlapped += t >= backward[k].first && t < backward[k].second;
    EXPECT_GT(overlapped, 0) << "rank " << r << ": no bucket began while backward ran ("
                             << buckets.size() << " bucket spans)";
  });
}

// A rank that never joins: the other's collective times out and ends the process with a message
// naming the rank, the GPU, the collective's label and NCCL's settings.
TEST(NcclDeathTest, ARankThatNeverJoinsEndsTheJobWithAMessage) {
  SKIP_WITHOUT(2);
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: CUDA does not survive fork
  EXPECT_EXIT(
      on_gpus(
          2,
          [](int r, comm::Communicator& c) {
            if (r == 1) std::this_thread::sleep_for(std::chrono::seconds(30));
            cuda::DeviceBuffer d(4096);
            c.set_label("gradient bucket 3");
            c.allreduce_sum(d.f32(), 1024);
          },
          2.0),
      testing::ExitedWithCode(3),
      "rank 0 on host .* \\(GPU 0\\): allreduce has not completed in .* of gradient bucket 3 .* "
      "NCCL_SOCKET_IFNAME=");
}

// The same for a collective on host memory (a step's statistics): its copies go through
// page-locked memory, so the host is not stuck in a copy behind the collective and the watchdog
// ends it (a copy into pageable memory would block until the other rank came, 30 s later).
TEST(NcclDeathTest, ARankThatNeverJoinsAHostCollectiveEndsTheJobWithAMessage) {
  SKIP_WITHOUT(2);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      on_gpus(
          2,
          [](int r, comm::Communicator& c) {
            if (r == 1) std::this_thread::sleep_for(std::chrono::seconds(30));
            std::vector<double> stats(11, 1.0);
            c.set_label("the step's statistics");
            c.allreduce_sum(stats.data(), static_cast<int64_t>(stats.size()));
          },
          2.0),
      testing::ExitedWithCode(3),
      "rank 0 on host .* \\(GPU 0\\): allreduce has not completed in .* of the step's statistics "
      "\\(88 bytes\\)");
}

// A collective NCCL refuses to enqueue (the emulator's CUDA_EMU_NCCL_REFUSE) ends the rank as
// a failed one does: the communicator aborted, the rank, GPU, label and settings named, exit 3.
TEST(NcclDeathTest, ACollectiveNcclRefusesEndsTheJobWithAMessage) {
  SKIP_WITHOUT(1);
#if !__has_include("cuda_emu/counts.h")
  GTEST_SKIP() << "a refused collective is the emulator's (build-emu)";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: CUDA does not survive fork
  EXPECT_EXIT(
      {
        comm::SingleProcess one;
        auto c = comm::make_nccl_communicator(one);
        ::setenv("CUDA_EMU_NCCL_REFUSE", "1", 1);
        cuda::DeviceBuffer d(4096);
        c->set_label("gradient bucket 2");
        c->allreduce_sum(d.f32(), 1024);
      },
      testing::ExitedWithCode(3),
      "rank 0 on host .* \\(GPU 0\\): allreduce could not be enqueued: NCCL error .* \\(refused "
      "\\(CUDA_EMU_NCCL_REFUSE=1\\)\\) of gradient bucket 2 \\(4096 bytes\\).*NCCL_SOCKET_IFNAME=");
#endif
}

// NCCL's initialisation waits for every rank: a rank that never joins it (died after the id's
// broadcast; the emulator's CUDA_EMU_NCCL_ABSENT_RANK) ends the others within the stall timeout,
// the communicator aborted, with the rank, GPU, ranks and settings named: not a hang.
TEST(Nccl, ARankThatNeverInitialisesEndsTheOthersWithAMessage) {
  SKIP_WITHOUT(2);
#if !__has_include("cuda_emu/counts.h")
  GTEST_SKIP() << "a rank kept out of NCCL's initialisation is the emulator's (build-emu)";
#else
  ::setenv("CUDA_EMU_NCCL_ABSENT_RANK", "1", 1);
  std::vector<std::string> errors(2);
  ThreadGroup g(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      ThreadRank boot(g, r);
      // (the absent rank waits longer: rank 0's timeout comes first, its abort ends rank 1's wait)
      errors[r] = test::error_of([&] { comm::make_nccl_communicator(boot, r == 0 ? 1.0 : 60.0); });
    });
  for (auto& t : threads) t.join();
  ::unsetenv("CUDA_EMU_NCCL_ABSENT_RANK");
  EXPECT_NE(errors[0].find("rank 0 on host "), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("(GPU 0): NCCL's initialisation of 2 ranks has not completed in 1 s "
                           "(stall_timeout 1 s): a rank died before joining"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("NCCL_SOCKET_IFNAME="), std::string::npos) << errors[0];
  std::printf("rank 0: %s\nrank 1: %s\n", errors[0].c_str(), errors[1].c_str());
  EXPECT_NE(errors[1].find("rank 1 on host "), std::string::npos)
      << "the absent rank is not left waiting either: " << errors[1];
#endif
}

}  // namespace
}  // namespace bertrain
