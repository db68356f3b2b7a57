#include "comm/launcher.h"

#include <cstdlib>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace bertrain::comm {

namespace {

// The variable as a non-negative integer, or -1 when unset or not a number; read ones are added
// to `evidence`.
int64_t number(const char* name, std::string& evidence) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  evidence += str(evidence.empty() ? "" : " ", name, "=", v);
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return (end && *end == '\0' && x >= 0) ? x : -1;
}

// Slurm's compressed per-node task counts, "2(x3),1" -> 2 2 2 1; empty on a malformed value.
std::vector<int64_t> tasks_per_node(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long long n = std::strtoll(item.c_str(), &end, 10);
    if (end == item.c_str() || n < 0) return {};
    long long times = 1;
    if (*end == '(') {
      if (end[1] != 'x') return {};
      char* close = nullptr;
      times = std::strtoll(end + 2, &close, 10);
      if (!close || *close != ')' || close[1] != '\0' || times < 1) return {};
    } else if (*end != '\0') {
      return {};
    }
    for (long long t = 0; t < times; ++t) out.push_back(n);
  }
  return out;
}

}  // namespace

LauncherEnv launcher_env() {
  LauncherEnv e;
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) {
    e.launcher = "Open MPI";
    e.ranks = number("OMPI_COMM_WORLD_SIZE", e.evidence);
    e.rank = number("OMPI_COMM_WORLD_RANK", e.evidence);
    e.local_size = number("OMPI_COMM_WORLD_LOCAL_SIZE", e.evidence);
    e.local_rank = number("OMPI_COMM_WORLD_LOCAL_RANK", e.evidence);
  } else if (std::getenv("SLURM_STEP_NUM_TASKS") && std::getenv("SLURM_PROCID")) {
    e.launcher = "Slurm";
    e.ranks = number("SLURM_STEP_NUM_TASKS", e.evidence);
    e.rank = number("SLURM_PROCID", e.evidence);
    e.local_rank = number("SLURM_LOCALID", e.evidence);
    e.hosts = number("SLURM_STEP_NUM_NODES", e.evidence);
    const int64_t node = number("SLURM_NODEID", e.evidence);
    if (const char* per = std::getenv("SLURM_STEP_TASKS_PER_NODE")) {
      e.evidence += str(" SLURM_STEP_TASKS_PER_NODE=", per);
      const std::vector<int64_t> counts = tasks_per_node(per);
      if (node >= 0 && node < static_cast<int64_t>(counts.size())) e.local_size = counts[node];
    }
  } else if (std::getenv("PMIX_RANK")) {
    e.launcher = "PMIx";
    e.rank = number("PMIX_RANK", e.evidence);
  }
  return e;
}

void check_launcher_agrees(const LauncherEnv& e, int rank, int size, int local_rank,
                           int local_size) {
  if (e.launcher.empty()) return;
  if (e.ranks > 1 && size == 1)
    fail(e.launcher, " started ", e.ranks, " ranks (", e.evidence,
         ") but MPI sees this process alone: the ranks were started without MPI's process "
         "wiring and each would train by itself into the same output. ",
         e.launcher == "Slurm"
             ? "Start them with srun --mpi=pmix (srun --mpi=list shows the plugins this Slurm has)"
             : "Start them with the mpirun of the MPI bertrain was built with",
         ", or run one process");
  auto differ = [&](const char* what, int64_t said, int64_t mpi) {
    if (said >= 0 && said != mpi)
      fail(e.launcher, " says ", what, " ", said, " (", e.evidence, "), MPI says ", mpi,
           ": the launcher and the MPI library disagree (a launcher of another MPI?); start the "
           "ranks with the launcher of the MPI bertrain was built with");
  };
  differ("the job has ranks:", e.ranks, size);
  differ("this is rank", e.rank, rank);
  // Slurm's node ids and MPI's shared-memory nodes are the same hosts; BERTRAIN_LOCAL_SIZE
  // pretends smaller nodes on purpose, so the local numbers are not compared then.
  if (!std::getenv("BERTRAIN_LOCAL_SIZE")) {
    differ("ranks on this host:", e.local_size, local_size);
    differ("the local rank is", e.local_rank, local_rank);
  }
}

void check_job_shape(const std::string& job, const LauncherEnv& e, int size, int local_size) {
  if (job.empty()) return;
  std::stringstream in(job);
  std::string name, item;
  in >> name;
  int64_t ranks = -1, per_host = -1;
  while (in >> item) {
    if (item.rfind("ranks=", 0) == 0) ranks = std::atoll(item.c_str() + 6);
    if (item.rfind("per_host=", 0) == 0) per_host = std::atoll(item.c_str() + 9);
  }
  if (name.empty() || ranks <= 0 || per_host <= 0)
    fail("BERTRAIN_JOB='", job, "' is not 'NAME ranks=N per_host=S' (bertrain launch sets it)");
  const std::string by =
      e.launcher.empty() ? std::string("this start") : str(e.launcher, " (", e.evidence, ")");
  if (size != ranks)
    fail("job '", name, "' was described with ", ranks, " ranks (", ranks / per_host, " workers x ",
         per_host, " slots), but ", by, " started ", size,
         ": submit the script bertrain launch wrote unchanged, or change workers/slots_per_worker "
         "in the job spec and emit it again");
  if (local_size != per_host && !std::getenv("BERTRAIN_LOCAL_SIZE"))
    fail("job '", name, "' was described with ", per_host, " ranks per host, but ", by, " placed ",
         local_size,
         " on this host: the ranks share GPUs or leave some idle; use the spec's placement "
         "(mpirun --map-by ppr:",
         per_host, ":node, sbatch --ntasks-per-node=", per_host, ")");
}

}  // namespace bertrain::comm
