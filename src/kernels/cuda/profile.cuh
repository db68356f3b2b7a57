// Where the GPU's time goes (BERTRAIN_CUDA_PROFILE=1): each CUDA backend operation's device
// time, from events recorded around what it queues on the kernels' stream, summed by name
// (Backend::op_profile; bench prints it). A profiled run is slower end to end (the events are
// read back every few thousand operations); its per-operation times are the GPU's. Off, an
// operation pays one branch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace bertrain::cuda {

bool profile_on();
// The operations' device time per step of `steps` since the last call, largest first; the sums
// start again. Empty when profiling is off.
std::string profile_table(int64_t steps);

// One operation's span, from its construction to the end of its scope.
class Op {
 public:
  explicit Op(const char* name);
  ~Op();
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;

 private:
  const char* name_;
  cudaEvent_t start_ = nullptr;
};

}  // namespace bertrain::cuda
