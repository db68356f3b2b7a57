// Which GPU a rank of a data-parallel job takes, and the check that no two ranks share one.
// Host code without CUDA (comm/gpu/nccl.cpp asks the GPU for the facts; the GPUs visible come
// from kernels/backend.h's registry), so the rules are tested on any machine.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"

namespace bertrain::comm {

// The GPU index a rank takes among those visible to it: its local rank modulo the visible count.
// Where every rank on a host sees every GPU (mpirun, a pod with several ranks), that is one GPU
// per local rank; where the scheduler gives each rank GPUs of its own (Slurm's
// --gpus-per-task=1, --gpu-bind), each sees only those, and the ranks' "GPU 0" are different
// GPUs. Ranks that end up on the same GPU are found by shared_gpu.
int gpu_for_local_rank(int local_rank, int visible);

// The GPU a rank of `job` uses: gpu_for_local_rank of its local rank among the GPUs this process
// sees (kernels::gpu_count); an error naming the rank and its host where it sees none.
int rank_gpu(const Communicator& job);

// Where a rank runs: its host, the PCI bus id of its GPU (the same GPU has the same id for every
// rank of the host, whatever CUDA_VISIBLE_DEVICES numbers it), and its index among the visible.
struct GpuPlacement {
  std::string host, bus_id;
  int device = 0, visible = 0;
};

// The first two ranks on one GPU, as a message naming them, the GPU and the fix; empty when every
// rank has a GPU of its own. ranks[r] is rank r's placement.
std::string shared_gpu(const std::vector<GpuPlacement>& ranks);

}  // namespace bertrain::comm
