// `bertrain doctor`'s run diagnosis: rules over a run's metrics.jsonl rows (obs/events.h), each
// finding with the evidence and the fix (the flags to change). The environment checks (CPU,
// precisions, MPI, /dev/shm, disk, GPU) live with the command (cli/cmd_doctor.cpp).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "obs/report.h"

namespace bertrain::obs {

struct Finding {
  std::string rule;  // "input-bound", "communication-bound", "straggler", "load-imbalance",
                     // "loss-spike", "fp16-skips", "memory", "late-allreduce" (timeline),
                     // "incident" (incidents.log), "elastic" (restarts)
  std::string what;  // the evidence, with numbers
  std::string fix;   // what to change
};

struct DiagnoseLimits {
  double input_share = 0.10;      // input wait above this share of the step: input-bound
  double comm_share = 0.20;       // exposed communication above this share: communication-bound
  double straggler_ratio = 1.25;  // slowest rank / median rank step time, median over the run
  double spike_ratio = 1.5;       // loss above this multiple of the previous rows' median
  double memory_share = 0.90;     // peak RSS above this share of the machine's memory
};

// memory_bytes: the machine's memory (0: unknown, no memory rule).
std::vector<Finding> diagnose(const std::vector<nlohmann::json>& rows, double memory_bytes,
                              const DiagnoseLimits& limits = {});

// The run's timeline (RunMetrics::trace, train --timeline RUN/timeline.json): "late-allreduce"
// when the step waits for the gradient sum while little of the reducer's allreduce ran during
// backward (the buckets start too late to hide).
std::vector<Finding> diagnose_timeline(const RunMetrics& run, const DiagnoseLimits& limits = {});

// The run's incidents.log (what ranks saw when a job ended: a stall, a lost host, a signal
// in a collective): "incident" with the hosts named there, and how to go on.
std::vector<Finding> diagnose_incidents(const std::string& run_dir);

// An elastic run's restarts and growths (RunMetrics::events): how many, the time each cost (from
// the failure the supervisor saw to the first step after), the steps done again, and the
// checkpoint interval that minimises the expected loss for the failure rate measured over the
// run (Daly's higher-order form of Young's sqrt(2 x checkpoint time x time between failures)).
std::vector<Finding> diagnose_elastic(const RunMetrics& run);
// Daly's optimum checkpoint interval in seconds for a checkpoint costing delta_s and a mean time
// between failures of mtbf_s (J. T. Daly, "A higher order estimate of the optimum checkpoint
// interval for restart dumps", FGCS 22, 2006, eq. 37): sqrt(2dM)(1 + sqrt(d/2M)/3 + d/18M) - d
// for d < 2M, else M.
double daly_interval(double delta_s, double mtbf_s);

// The GPU software stack as the dynamic loader finds it (dlopen, nothing linked, so every build
// reports it): the CUDA runtime, the CUDA version the driver supports, NCCL. 0 and an empty name
// where a library is not found or does not answer.
struct GpuStack {
  int cuda_runtime = 0;  // CUDART_VERSION form: 1000 x major + 10 x minor
  int cuda_driver = 0;   // cuDriverGetVersion: the newest CUDA the driver runs
  int nccl = 0;          // NCCL_VERSION_CODE form (10000 x major + 100 x minor + patch from 2.9)
  std::string runtime_lib, driver_lib, nccl_lib;  // the files loaded
};
GpuStack gpu_stack();
std::string cuda_version_name(int v);  // 13000 -> "13.0"
std::string nccl_version_name(int v);  // 22809 -> "2.28.9"

}  // namespace bertrain::obs
