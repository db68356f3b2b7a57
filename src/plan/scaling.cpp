#include "plan/scaling.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace bertrain::plan {

GradientLayout gradient_layout(const model::ParamTable& table, int64_t layers) {
  GradientLayout g;
  g.total = table.total();
  int64_t in_layers = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const auto [b, e] = table.layer_range(l);
    g.layers.push_back(e - b);
    in_layers += e - b;
  }
  g.rest = g.total - in_layers;
  for (const auto& [b, e] : table.fp32_read_ranges()) g.fp32_read += e - b;
  return g;
}

namespace {
std::string resolve(const ClusterSpec& c, const std::string& algo) {
  if (algo == "auto") return c.hosts > 1 ? "hierarchical" : "shm";
  if (algo == "mpi") return "ring";
  if (algo == "shm" && c.hosts > 1) return "hierarchical";  // what --allreduce shm does then
  if (algo == "hierarchical" && c.hosts == 1) return "shm";
  if (algo != "shm" && algo != "ring" && algo != "hierarchical")
    fail("--allreduce must be auto, shm, ring, hierarchical or mpi, got '", algo, "'");
  return algo;
}
}  // namespace

double allreduce_ms(int64_t n, const ClusterSpec& c, const CommSpec& s, const std::string& algo,
                    bool half) {
  const double R = static_cast<double>(c.ranks_per_host), H = static_cast<double>(c.hosts);
  const double P = R * H, bytes = 4.0 * static_cast<double>(n);
  const double link = c.link_gbit * 1e9 / 8.0, mem = c.host_gbyte_s * 1e9;
  const double lat = c.latency_us * 1e-6, local = c.local_latency_us * 1e-6;
  const double part = half ? 0.5 : 1.0;
  double t = 0;
  // Within one host: R ranks each move 2 n 4 B (read its share from R buffers, write it into R;
  // half for a reduce-scatter or an allgather) through memory they share, plus two barriers.
  auto shm = [&] { return R > 1 ? part * 2.0 * bytes * R / mem + 2.0 * local : 0.0; };
  // A ring over p members whose slowest hop moves `rate` bytes/s.
  auto ring = [&](double p, double rate, double wire, double l) {
    if (p <= 1) return 0.0;
    return part * (2.0 * (p - 1.0) / p * bytes * wire / 4.0 / rate + 2.0 * (p - 1.0) * l);
  };
  if (algo == "shm") {
    t = shm();
  } else if (algo == "ring") {
    // Consecutive ranks share a host: one hop per host crosses the link (wire dtype there),
    // the others copy through memory.
    t = H > 1 ? ring(P, link, s.wire_bytes, lat) : ring(P, mem / R, 4.0, local);
  } else {  // hierarchical
    t = shm() + ring(H, link, s.wire_bytes, lat) +
        (R > 1 ? part * bytes * (R - 1) / mem + 2.0 * local : 0.0);
  }
  return 1e3 * t;
}

ScalingRow predict_step(const GradientLayout& g, const StepCompute& compute, const ClusterSpec& c,
                        const CommSpec& s) {
  ScalingRow r;
  r.hosts = c.hosts;
  r.ranks = c.hosts * c.ranks_per_host;
  r.algorithm = resolve(c, s.algorithm);
  const bool multi = r.ranks > 1;
  const double opt_ms =
      s.shard_optimizer && multi ? compute.optimizer_ms / r.ranks : compute.optimizer_ms;
  r.compute_ms = compute.forward_ms + compute.backward_ms + opt_ms;
  if (!multi) {
    r.step_ms = r.compute_ms;
    r.efficiency = 1.0;
    return r;
  }
  const bool half = s.shard_optimizer;  // the gradients' half is a reduce-scatter
  auto cost = [&](int64_t n) { return allreduce_ms(n, c, s, r.algorithm, half); };
  const int64_t L = static_cast<int64_t>(g.layers.size());
  // The reducer's buckets: layers L-1, L-2, ... fused up to bucket_mb.
  struct Bucket {
    int64_t lo, floats;
  };
  std::vector<Bucket> buckets;
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(s.bucket_mb * 1048576.0 / 4.0));
  for (int64_t hi = L - 1; hi >= 0;) {
    int64_t lo = hi, floats = g.layers[hi];
    while (lo > 0 && floats + g.layers[lo - 1] <= cap) floats += g.layers[--lo];
    buckets.push_back({lo, floats});
    hi = lo - 1;
  }
  const double k = static_cast<double>(std::max<int64_t>(1, compute.accumulation));
  const double last_start = compute.backward_ms * (k - 1.0) / k;  // the last micro-batch's
  const double per_layer = L > 0 ? compute.backward_ms / k / static_cast<double>(L) : 0.0;
  double comm_end = 0, comm_total = 0;
  if (s.overlap) {
    // Bucket ready when backward has finished its lowest layer; one at a time.
    for (const Bucket& b : buckets) {
      const double ready = last_start + static_cast<double>(L - b.lo) * per_layer;
      const double t = cost(b.floats);
      comm_end = std::max(comm_end, ready) + t;
      comm_total += t;
    }
    const double t = cost(g.rest);  // embeddings and heads: when backward returns
    comm_end = std::max(comm_end, compute.backward_ms) + t;
    comm_total += t;
  } else {
    comm_total = cost(g.total);
    comm_end = compute.backward_ms + comm_total;
  }
  double exposed = std::max(0.0, comm_end - compute.backward_ms);
  if (s.shard_optimizer) {  // the parameters' allgather after the optimizer: never hidden
    // A sharded master sends the bf16 copy (the bytes of half as many floats) and the fp32-read
    // tensors.
    const int64_t floats = s.sharded_master ? (g.total + 1) / 2 + g.fp32_read : g.total;
    const double t =
        allreduce_ms(floats, c, CommSpec{s.algorithm, 4, s.bucket_mb, s.overlap, true, false},
                     r.algorithm, true);
    exposed += t;
    comm_total += t;
  }
  // The step's statistics (a few doubles): one small allreduce's latencies.
  const double hop_us = c.hosts > 1 ? c.latency_us : c.local_latency_us;
  const double stats = 1e-3 * 2.0 * hop_us * std::ceil(std::log2(static_cast<double>(r.ranks)));
  exposed += stats;
  r.comm_ms = comm_total;
  r.exposed_ms = exposed;
  r.step_ms = r.compute_ms + exposed;
  // Against one rank alone (its whole optimizer, no communication): ideal scaling is 1.
  r.efficiency = (compute.forward_ms + compute.backward_ms + compute.optimizer_ms) / r.step_ms;
  return r;
}

}  // namespace bertrain::plan
