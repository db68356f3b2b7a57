// Reducer: gradient allreduce overlapped with backward (Horovod's tensor fusion, llm.c's
// overlap). Gradient buckets are contiguous slices of the flat gradient buffer in reverse layer
// order, each about `bucket_bytes` (no copy: the slice is reduced in place). backward reports
// each finished encoder layer; when the lowest layer of a bucket is done, the bucket goes to a
// background communication thread, which reduces it while backward continues below (on a GPU,
// after the work queued when the bucket's layers were done: Communicator::ready_point). finish()
// hands over the rest (embeddings, pooler, heads: final only when backward returns) and waits:
// that wait is the exposed communication; the rest was hidden behind compute. With a sharded
// optimizer each bucket is reduce-scattered instead: each rank receives the sum of the part of
// the bucket whose optimizer state it holds (the same bytes on the wire as half an allreduce).
// MPI needs MPI_THREAD_SERIALIZED for this: during backward only the communication thread
// calls MPI.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "obs/timeline.h"

namespace bertrain::comm {

class Reducer {
 public:
  // layers[l] = [begin, end) of layer l's gradients; offsets increase with l.
  // owners (optional, size + 1 cuts of [0, total)): rank r owns the sum of
  // [owners[r], owners[r + 1]) only (the sharded optimizer): buckets are reduce-scattered to
  // their owners instead of allreduced.
  Reducer(Communicator& comm, float* grads, int64_t total,
          std::vector<std::pair<int64_t, int64_t>> layers, int64_t bucket_bytes,
          obs::Timeline* timeline, std::vector<int64_t> owners = {});
  // Factor applied to each bucket before its sum (1 / the predivide factor; train::Step sets
  // it, as it owns the gradient scale). Call between steps.
  void set_prescale(float s) { prescale_ = s; }
  ~Reducer();
  void layer_done(int64_t layer);  // from backward (main thread)
  double finish();                 // seconds the caller waited (exposed communication)
  double busy_seconds() const { return last_busy_s_; }  // communication-thread time, last step
  size_t buckets() const { return buckets_.size(); }

 private:
  void loop();
  void enqueue(int64_t begin, int64_t end);  // with the communicator's ready point, now
  Communicator& comm_;
  float* grads_;
  int64_t total_;
  float prescale_ = 1.0f;
  obs::Timeline* tl_;
  std::vector<int64_t> owners_;
  std::vector<int64_t> counts_;  // the communication thread's per-rank parts of one bucket
  struct Bucket {
    int64_t lo_layer, begin, end;
  };
  std::vector<Bucket> buckets_;  // in reverse layer order
  std::vector<std::pair<int64_t, int64_t>> rest_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct Job {
    int64_t begin, end, ready_point;
  };
  std::deque<Job> queue_;
  int64_t enqueued_ = 0, done_ = 0;
  bool stop_ = false;
  double busy_s_ = 0, last_busy_s_ = 0;
  int bucket_counter_ = 0;
  std::thread thread_;
};

}  // namespace bertrain::comm
