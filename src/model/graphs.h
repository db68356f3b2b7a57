// CUDA graphs of a backend's operations (kernels/backend.h begin_capture, end_capture,
// launch_graph), kept by what their launches hold: the model's forward and backward
// (BertModel), the optimizer's update (train::Step). What changes from launch to launch must be
// read by the kernels from the backend's memory, sent before the launch (Backend::send,
// stage_update); a graph replays its launches with the arguments they were captured with.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "core/error.h"
#include "kernels/backend.h"

namespace bertrain::model {

// --cuda-graphs: off; auto (where the work can, and back to launching kernel by kernel, with a
// note, should a capture fail); on (a failed capture is an error).
enum class GraphMode { Off, Auto, On };
GraphMode parse_graph_mode(const std::string& s);
const char* graph_mode_name(GraphMode m);

// Graphs by key (Key: ordered by operator<; what a graph's launches hold besides the memory they
// point at). run() launches the key's graph, captured first from what issue() issues where the
// key is new. At most `most` are kept: past that the device runs the launches already issued and
// the graph used longest ago goes (a loss scale the host keeps keys graphs of its own each
// value: a long fp16 run meets a few dozen; an unpadded batch's rows key one each bucket).
template <class Key>
class GraphCache {
 public:
  explicit GraphCache(size_t most = 16) : most_(most) {}
  // Whether run() is capturing now (code that issues for any batch of a shape asks).
  bool capturing() const { return capturing_; }
  // `mode` auto: a capture that fails prints a note naming `what` and sets `mode` off, nothing
  // of the capture having run, and issue() runs kernel by kernel; on: the failure is rethrown.
  void run(const kernels::Backend& be, GraphMode& mode, const Key& key, const char* what,
           const std::function<void()>& issue) {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      std::shared_ptr<void> g;
      be.begin_capture();
      capturing_ = true;
      try {
        issue();
        capturing_ = false;
        g = be.end_capture();
      } catch (const Error& e) {
        if (capturing_) {
          capturing_ = false;
          try {
            be.end_capture();
          } catch (const Error&) {  // (the first error is the one to report)
          }
        }
        if (mode == GraphMode::On) throw;
        std::fprintf(stderr,
                     "bertrain: CUDA graphs off for this run (--cuda-graphs auto): the %s's "
                     "capture failed: %s\n",
                     what, e.what());
        mode = GraphMode::Off;
        graphs_.clear();
        return issue();
      }
      if (graphs_.size() >= most_) {
        be.synchronize();
        auto oldest = graphs_.begin();
        for (auto o = graphs_.begin(); o != graphs_.end(); ++o)
          if (o->second.used < oldest->second.used) oldest = o;
        graphs_.erase(oldest);
      }
      it = graphs_.emplace(key, Kept{std::move(g), 0}).first;
      ++captures_;
    }
    it->second.used = ++uses_;
    be.launch_graph(it->second.graph);
  }
  void clear() { graphs_.clear(); }
  // Graphs captured so far (evicted ones captured again counted again), and kept now.
  int64_t captures() const { return captures_; }
  size_t size() const { return graphs_.size(); }

 private:
  struct Kept {
    std::shared_ptr<void> graph;
    uint64_t used;  // (the uses_ count at its last launch)
  };
  std::map<Key, Kept> graphs_;
  size_t most_;
  uint64_t uses_ = 0;
  int64_t captures_ = 0;
  bool capturing_ = false;
};

}  // namespace bertrain::model
