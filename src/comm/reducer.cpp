#include "comm/reducer.h"

#include <algorithm>
#include <chrono>

#include "core/clock.h"
#include "core/error.h"

namespace bertrain::comm {

Reducer::Reducer(Communicator& comm, float* grads, int64_t total,
                 std::vector<std::pair<int64_t, int64_t>> layers, int64_t bucket_bytes,
                 obs::Timeline* timeline, std::vector<int64_t> owners)
    : comm_(comm), grads_(grads), total_(total), tl_(timeline), owners_(std::move(owners)) {
  BT_CHECK(owners_.empty() || (static_cast<int>(owners_.size()) == comm.size() + 1 &&
                               owners_.front() == 0 && owners_.back() == total),
           "reducer: owner cuts must cover the gradients, one part per rank");
  const int64_t L = static_cast<int64_t>(layers.size());
  BT_CHECK(L > 0, "reducer needs layers");
  const int64_t cap = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(sizeof(float)));
  // Reverse layer order: layers L-1, L-2, ... fused until a bucket reaches the threshold.
  int64_t hi = L - 1;
  while (hi >= 0) {
    int64_t lo = hi;
    while (lo > 0 && layers[hi].second - layers[lo - 1].first <= cap) --lo;
    buckets_.push_back({lo, layers[lo].first, layers[hi].second});
    hi = lo - 1;
  }
  if (layers.back().second < total) rest_.push_back({layers.back().second, total});
  if (layers.front().first > 0) rest_.push_back({0, layers.front().first});
  thread_ = std::thread([this] { loop(); });
}

Reducer::~Reducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Reducer::enqueue(int64_t begin, int64_t end) {
  // On the thread that wrote the gradients: the point its queued device work has reached.
  const int64_t ready = comm_.ready_point();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({begin, end, ready});
    ++enqueued_;
  }
  cv_.notify_all();
}

void Reducer::layer_done(int64_t layer) {
  for (const auto& b : buckets_)
    if (b.lo_layer == layer) enqueue(b.begin, b.end);
}

void Reducer::loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
      job = queue_.front();
      queue_.pop_front();
    }
    comm_.ready_after(job.ready_point);
    comm_.wait_point(job.ready_point);  // the bucket's gradients written: its communication starts
    const auto t0 = Clock::now();
    const int64_t b0 = tl_ && tl_->enabled() ? tl_->now_us() : 0;
    float* p = grads_ + job.begin;
    const int64_t n = job.end - job.begin;
    if (prescale_ != 1.0f) comm_.scale(p, n, prescale_);
    comm_.set_label(str("gradient bucket ", bucket_counter_, " (", n * 4 / 1024, " KiB at offset ",
                        job.begin, ")"));
    if (owners_.empty()) {
      comm_.allreduce_sum(p, n);
    } else {
      counts_.assign(owners_.size() - 1, 0);
      for (size_t r = 0; r + 1 < owners_.size(); ++r)
        counts_[r] = std::max<int64_t>(
            0, std::min(job.end, owners_[r + 1]) - std::max(job.begin, owners_[r]));
      comm_.reduce_scatter_sum(p, n, counts_);
    }
    comm_.ready_after(-1);
    comm_.set_label("");
    if (tl_ && tl_->enabled())
      tl_->add(str(owners_.empty() ? "allreduce" : "reduce-scatter", " bucket ", bucket_counter_++,
                   " (", n * 4 / 1024, " KiB)"),
               "communication", b0, tl_->now_us(), 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_s_ += seconds_since(t0);
      ++done_;
    }
    cv_.notify_all();
  }
}

double Reducer::finish() {
  for (const auto& r : rest_) enqueue(r.first, r.second);
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_ == enqueued_; });
  bucket_counter_ = 0;
  last_busy_s_ = busy_s_;
  busy_s_ = 0;
  return seconds_since(t0);
}

}  // namespace bertrain::comm
