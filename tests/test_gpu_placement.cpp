// Which GPU each rank of a job takes (comm/gpu_placement.h), for the ways jobs are placed: every
// rank of a host seeing every GPU (mpirun, a pod of several ranks), and a scheduler giving each
// rank a GPU of its own (Slurm's --gpus-per-task=1: each rank sees one GPU, its "device 0").
// What the GPU says of itself (its PCI bus id) is the CUDA side's; the choice and the check are
// these.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/gpu_placement.h"

namespace bertrain::comm {
namespace {

// Ranks placed as a launcher places them: `hosts` hosts of `per_host` consecutive ranks; each
// rank sees `visible` GPUs, those of its host from `first_gpu(local rank)` on, bus ids by host.
std::vector<GpuPlacement> place(int hosts, int per_host, int visible, int (*first_gpu)(int)) {
  std::vector<GpuPlacement> ranks;
  for (int h = 0; h < hosts; ++h)
    for (int local = 0; local < per_host; ++local) {
      GpuPlacement p;
      p.host = "node" + std::to_string(h);
      p.visible = visible;
      p.device = gpu_for_local_rank(local, visible);
      p.bus_id = "00000000:" + std::to_string(10 + first_gpu(local) + p.device) + ":00.0";
      ranks.push_back(p);
    }
  return ranks;
}

int all_gpus(int) {
  return 0;  // every rank sees the host's GPUs from its first
}
int own_gpu(int local) {
  return local;  // the scheduler's binding: rank `local` sees the host's GPU `local` only
}

TEST(GpuPlacement, EveryRankOfAHostSeeingEveryGpuTakesItsLocalRanks) {
  EXPECT_EQ(gpu_for_local_rank(0, 4), 0);
  EXPECT_EQ(gpu_for_local_rank(3, 4), 3);
  EXPECT_EQ(shared_gpu(place(2, 4, 4, all_gpus)), "");  // 2 hosts x 4 ranks x 4 GPUs
  EXPECT_EQ(shared_gpu(place(3, 2, 8, all_gpus)), "");  // fewer ranks than GPUs
}

// Slurm --gpus-per-task=1: four ranks on a host, each seeing one GPU, its own: every rank takes
// its "device 0", four different GPUs (this used to be refused as four ranks for one GPU).
TEST(GpuPlacement, RanksGivenAGpuOfTheirOwnEachTakeTheirs) {
  EXPECT_EQ(gpu_for_local_rank(3, 1), 0);
  const std::vector<GpuPlacement> ranks = place(2, 4, 1, own_gpu);
  for (const GpuPlacement& p : ranks) EXPECT_EQ(p.device, 0);
  EXPECT_EQ(shared_gpu(ranks), "");
}

// More ranks on a host than the GPUs they all see: ranks 0 and 2 of the second host share its
// first GPU; the message names them, the GPU, and both fixes. The same bus id on two hosts is two
// GPUs.
TEST(GpuPlacement, TwoRanksOnOneGpuAreNamedWithTheFix) {
  const std::string e = shared_gpu(place(2, 4, 2, all_gpus));
  EXPECT_EQ(e,
            "ranks 0 and 2 on host node0 both use GPU 00000000:10:00.0 (device 0 of the 2 rank 2 "
            "sees), and NCCL needs a GPU per rank: run as many ranks on node0 as it has GPUs (4 "
            "ranks for 2 visible: mpirun --npernode 2, or the job's GPUs per node), or let the "
            "scheduler give each rank a GPU of its own (Slurm --gpus-per-task=1)");
  std::vector<GpuPlacement> two_hosts = place(1, 1, 1, all_gpus);
  two_hosts.push_back(two_hosts[0]);
  two_hosts[1].host = "node1";
  EXPECT_EQ(shared_gpu(two_hosts), "");
}

}  // namespace
}  // namespace bertrain::comm
