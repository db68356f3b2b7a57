// The Reducer's hand-over of device work (comm/reducer.h, Communicator::ready_point): each
// bucket's operations wait for the point the thread running backward had reached when the
// bucket's lowest layer was done, not for everything queued by the time the communication
// thread issues them. On a GPU, backward is queued far ahead of the device: a bucket that waited
// for the work queued at its issue would wait for most of backward, and the overlap would be
// the first bucket's only. Here a communicator records what each operation would wait for.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/reducer.h"
#include "obs/timeline.h"

namespace bertrain::comm {
namespace {

// Two ranks that never communicate: ready points are the count of layers backward has
// finished when each was taken (on the thread that took it); every operation records the point
// it waits for (-1: all queued work).
class RecordingDevice final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string name() const override { return "recording"; }
  bool device_memory() const override { return true; }
  void allreduce_sum(float* data, int64_t n) override { record("allreduce", data, n); }
  void allreduce_sum(double*, int64_t) override {}
  void broadcast(void*, int64_t, int) override {}
  void barrier() override {}
  void reduce_scatter_sum(float* data, int64_t n, std::span<const int64_t>) override {
    record("reduce-scatter", data, n);
  }
  void scale(float* data, int64_t n, float) override { record("scale", data, n); }
  int64_t ready_point() override {
    std::lock_guard<std::mutex> lock(mu_);
    points.push_back({std::this_thread::get_id(), layers_done});
    return static_cast<int64_t>(points.size()) - 1;
  }
  void ready_after(int64_t point) override { ready_ = point; }

  struct Point {
    std::thread::id thread;
    int layers_done;
  };
  struct Op {
    std::string what;
    const float* data;
    int64_t n, waits_for;
  };
  std::vector<Point> points;
  std::vector<Op> ops;
  int layers_done = 0;

 private:
  void record(const char* what, float* data, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    ops.push_back({what, data, n, ready_});
  }
  std::mutex mu_;
  int64_t ready_ = -1;
};

TEST(Reducer, EachBucketWaitsForTheWorkQueuedWhenItsLayersWereDone) {
  for (bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "reduce-scatter" : "allreduce");
    RecordingDevice dev;
    std::vector<float> grads(100);
    // Four layers of 20 values after 10 of embeddings, 10 of heads; a bucket a layer.
    const std::vector<std::pair<int64_t, int64_t>> layers = {
        {10, 30}, {30, 50}, {50, 70}, {70, 90}};
    std::vector<int64_t> owners;
    if (sharded) owners = {0, 50, 100};
    Reducer r(dev, grads.data(), 100, layers, 20 * 4, nullptr, owners);
    r.set_prescale(0.5f);
    ASSERT_EQ(r.buckets(), 4u);
    for (int64_t l = 3; l >= 0; --l) {
      r.layer_done(l);
      ++dev.layers_done;  // backward goes on queuing (the next layer) at once
    }
    r.finish();
    const std::thread::id main = std::this_thread::get_id();
    ASSERT_EQ(dev.points.size(), 6u);  // 4 buckets, then the heads and the embeddings
    for (size_t k = 0; k < dev.points.size(); ++k) {
      EXPECT_EQ(dev.points[k].thread, main) << k;  // taken where the gradients were written
      EXPECT_EQ(dev.points[k].layers_done, std::min<int>(static_cast<int>(k), 4)) << k;
    }
    // Each bucket: the prescale, then its collective, both after its own point only.
    ASSERT_EQ(dev.ops.size(), 12u);
    const int64_t begins[6] = {70, 50, 30, 10, 90, 0};
    for (size_t k = 0; k < 6; ++k) {
      const auto& s = dev.ops[2 * k];
      const auto& c = dev.ops[2 * k + 1];
      EXPECT_EQ(s.what, "scale");
      EXPECT_EQ(c.what, sharded ? "reduce-scatter" : "allreduce");
      EXPECT_EQ(c.data, grads.data() + begins[k]) << k;
      EXPECT_EQ(s.waits_for, static_cast<int64_t>(k)) << k;
      EXPECT_EQ(c.waits_for, static_cast<int64_t>(k)) << k;
    }
    // After the buckets, a collective of the step waits for all queued work again.
    dev.allreduce_sum(grads.data(), 1);
    EXPECT_EQ(dev.ops.back().waits_for, -1);
  }
}

// A device that reaches each ready point `lag` after the communication thread starts waiting for
// it (a GPU still running the backward queued before the point); its collectives take no time.
class LaggingDevice final : public Communicator {
 public:
  LaggingDevice(const obs::Timeline& tl, std::chrono::milliseconds lag) : tl_(tl), lag_(lag) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string name() const override { return "lagging"; }
  bool device_memory() const override { return true; }
  void allreduce_sum(float*, int64_t) override {}
  void allreduce_sum(double*, int64_t) override {}
  void broadcast(void*, int64_t, int) override {}
  void barrier() override {}
  void scale(float*, int64_t, float) override {}
  int64_t ready_point() override { return next_++; }
  void wait_point(int64_t point) override {
    if (point < 0) return;
    std::this_thread::sleep_for(lag_);
    reached_us.push_back(tl_.now_us());  // the communication thread only
  }
  std::vector<int64_t> reached_us;

 private:
  const obs::Timeline& tl_;
  std::chrono::milliseconds lag_;
  int64_t next_ = 0;
};

// A bucket's communication starts when the device has computed its gradients, not when the
// communication thread took it: the wait before is backward's compute, which neither the busy
// time (train::Step reports busy minus exposed as hidden communication) nor the bucket's timeline
// span may count. Six buckets wait 150 ms each for their points; the collectives take
// microseconds, so the busy time stays far below one wait (counting the waits, it is 0.9 s).
TEST(Reducer, ABucketIsTimedFromWhenTheDeviceReachedItsPoint) {
  obs::Timeline tl;
  tl.enable(0);
  LaggingDevice dev(tl, std::chrono::milliseconds(150));
  std::vector<float> grads(100);
  const std::vector<std::pair<int64_t, int64_t>> layers = {{10, 30}, {30, 50}, {50, 70}, {70, 90}};
  Reducer r(dev, grads.data(), 100, layers, 20 * 4, &tl);
  for (int64_t l = 3; l >= 0; --l) r.layer_done(l);
  const double exposed = r.finish();
  ASSERT_EQ(dev.reached_us.size(), 6u);
  EXPECT_GE(exposed, 0.9);
  EXPECT_LT(r.busy_seconds(), 0.45) << "the waits for the device were counted as communication";

  size_t k = 0;
  for (const obs::Timeline::Event& e : tl.events()) {
    if (std::string(e.cat) != "communication") continue;
    ASSERT_LT(k, dev.reached_us.size());
    EXPECT_GE(e.ts, dev.reached_us[k]) << e.name;
    ++k;
  }
  EXPECT_EQ(k, 6u);
}

}  // namespace
}  // namespace bertrain::comm
