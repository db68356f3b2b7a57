// `bertrain doctor`'s run diagnosis: rules over a run's metrics.jsonl rows (obs/events.h), each
// finding with the evidence and the fix (the flags to change). The environment checks (CPU,
// precisions, MPI, /dev/shm, disk, GPU) live with the command (cli/cmd_doctor.cpp).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace bertrain::obs {

struct Finding {
  std::string rule;  // "input-bound", "communication-bound", "straggler", "loss-spike",
                     // "fp16-skips", "memory"
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

}  // namespace bertrain::obs
