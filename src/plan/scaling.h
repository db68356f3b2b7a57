// `bertrain plan`: a model of one data-parallel training step on a cluster, before renting it.
// Inputs: one rank's compute per step (forward, backward, optimizer: measured with `bertrain
// bench` here or given for another device), the gradients' layout (from the model config),
// hosts x ranks per host, the link between hosts (bandwidth, latency), the memory bandwidth
// within a host, and the communication settings (allreduce algorithm, wire dtype, bucket size,
// overlap, sharded optimizer). It replays what comm::Reducer does: buckets of encoder layers in
// reverse order, each reduced when backward has finished its lowest layer, one at a time on the
// communication thread; the embeddings and heads when backward returns. Exposed communication
// is what is left after backward. Cost of one reduction of n floats:
//   shm (one host, R ranks)  every rank reads its 1/R share from R buffers and writes it into R:
//                            2 n 4 B through the host's memory per rank, R ranks at once
//   ring over P ranks         2 (P-1)/P n w B on the slowest hop (the link between hosts, or
//                            memory within one host) + 2 (P-1) latencies
//   hierarchical              shm in the host, ring among the H host leaders over the link,
//                            then the host's ranks copy the result (n 4 B each)
// (w: 4 bytes, 2 with fp16/bf16 compression on the wire between hosts.) A sharded optimizer
// reduce-scatters (half) while backward runs and all-gathers the parameters (the other half,
// fp32, exposed) after its 1/P share of the optimizer; with a sharded master (bf16) the
// allgather moves the bf16 weights (2 B each) and the tensors read in fp32 (4 B each).
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "model/params.h"

namespace bertrain::plan {

struct ClusterSpec {
  int64_t hosts = 1, ranks_per_host = 1;
  double link_gbit = 25;        // between hosts, each direction, per host
  double latency_us = 20;       // one message between hosts
  double host_gbyte_s = 20;     // memory bandwidth a host's ranks share for the shm reduction
  double local_latency_us = 2;  // a barrier or message within a host
};

struct CommSpec {
  std::string algorithm = "auto";  // auto (shm in a host, hierarchical across), shm, ring,
                                   // hierarchical, mpi (modelled as ring)
  int wire_bytes = 4;              // 2: fp16/bf16 compression between hosts
  double bucket_mb = 64;
  bool overlap = true;
  bool shard_optimizer = false;
  bool sharded_master = false;  // bf16 compute with shard_optimizer (ModelDims::master_shard)
};

struct StepCompute {  // one rank, one step (all its micro-batches)
  double forward_ms = 0, backward_ms = 0, optimizer_ms = 0;
  int64_t accumulation = 1;  // micro-batches: only the last one's backward hides buckets
};

// The gradients as the reducer sees them: encoder layers' sizes (floats) and the rest
// (embeddings, pooler, heads), all in floats.
struct GradientLayout {
  std::vector<int64_t> layers;  // layer l's floats, l = 0 .. L-1
  int64_t rest = 0, total = 0;
  int64_t fp32_read = 0;  // the parameters read in fp32 (all but the matmul weights)
};
GradientLayout gradient_layout(const model::ParamTable& table, int64_t layers);

struct ScalingRow {
  int64_t hosts = 0, ranks = 0;
  double step_ms = 0, comm_ms = 0, exposed_ms = 0, compute_ms = 0;
  double efficiency = 0;  // one rank's step alone / this step: the share of ideal scaling
  std::string algorithm;  // as resolved (auto -> shm or hierarchical)
};

// Milliseconds to sum n floats over the cluster with the resolved algorithm ("shm", "ring",
// "hierarchical"); half: a reduce-scatter or an allgather alone.
double allreduce_ms(int64_t n, const ClusterSpec& c, const CommSpec& s, const std::string& algo,
                    bool half = false);

ScalingRow predict_step(const GradientLayout& g, const StepCompute& compute, const ClusterSpec& c,
                        const CommSpec& s);

}  // namespace bertrain::plan
