#include "comm/gpu_placement.h"

#include <map>
#include <utility>

#include "core/error.h"
#include "core/host.h"
#include "kernels/backend.h"

namespace bertrain::comm {

int gpu_for_local_rank(int local_rank, int visible) {
  BT_CHECK(visible > 0, "no GPU visible to choose from");
  return local_rank % visible;
}

int rank_gpu(const Communicator& job) {
  const int gpus = kernels::gpu_count();
  if (gpus == 0)
    fail("rank ", job.rank(), " on host ", host_name(),
         kernels::gpu_built()
             ? " sees no GPU (nvidia-smi lists them; check CUDA_VISIBLE_DEVICES)"
             : " has no GPU backend: this bertrain is built without CUDA (-DBERTRAIN_CUDA=ON)");
  return gpu_for_local_rank(job.local_rank(), gpus);
}

std::string shared_gpu(const std::vector<GpuPlacement>& ranks) {
  std::map<std::pair<std::string, std::string>, size_t> first;  // (host, bus id) -> rank
  for (size_t r = 0; r < ranks.size(); ++r) {
    const GpuPlacement& p = ranks[r];
    const auto [it, fresh] = first.emplace(std::pair{p.host, p.bus_id}, r);
    if (fresh) continue;
    int on_host = 0;
    for (const GpuPlacement& q : ranks) on_host += q.host == p.host;
    return str("ranks ", it->second, " and ", r, " on host ", p.host, " both use GPU ", p.bus_id,
               " (device ", p.device, " of the ", p.visible, " rank ", r,
               " sees), and NCCL needs a GPU per rank: run as many ranks on ", p.host,
               " as it has GPUs (", on_host, " ranks for ", p.visible,
               " visible: mpirun --npernode ", p.visible,
               ", or the job's GPUs per node), or let the scheduler give each rank a GPU of its "
               "own (Slurm --gpus-per-task=1)");
  }
  return "";
}

}  // namespace bertrain::comm
