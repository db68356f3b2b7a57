// The elastic supervisor (`bertrain launch JOB --run` with an `elastic:` section, or
// `--elastic`): starts the job with mpirun on the hosts that answer (in a Slurm allocation: srun
// steps on its nodes), watches it, and restarts it without a person when a host is lost, and
// grows it when hosts come back.
//
//   - Every `probe_s` it asks each host to run `true` (through Open MPI's launch agent:
//     OMPI_MCA_plm_rsh_agent, else ssh in batch mode), in parallel, each within
//     `probe_timeout_s`. A host of the running job that does not answer ends the attempt at once
//     (mpirun is stopped: its ranks are waiting in collectives; the last complete checkpoint is
//     what counts); so does the job ending with an error.
//   - A failed attempt is restarted (`--resume`, which re-divides the input and keeps the global
//     batch on another number of ranks) on the hosts that answer now, in the listed order, at
//     most max_workers of them, up to max_restarts times. Fewer than min_workers answering, or
//     a failure with every host answering and no checkpoint written since the attempt began
//     (the job fails by itself, not by a host), stops the supervisor with the reason.
//   - A listed host not in the job that answers (one back, or one added to --hostfile, re-read
//     at every probe) grows the job: SIGUSR1 to mpirun (forwarded to every rank) makes the
//     ranks finish the step, checkpoint and exit; the next attempt runs on the larger set. No
//     step is recomputed and it does not count as a restart.
//   - Every attempt's ranks get BERTRAIN_ELASTIC_JOB (one name for all attempts: a bucket run's
//     lease passes from one attempt to the next), and after the first BERTRAIN_ELASTIC_KIND
//     (restart or grow), _COUNT, _REASON and _AT (unix milliseconds, when the supervisor saw
//     it): the trainer writes the restart into incidents.log, metrics.jsonl and TensorBoard
//     (the doctor reads them).
// SIGTERM/SIGINT to the supervisor stop the job the same way (checkpoint, exit) and end it; a
// second one ends it at once (SIGTERM to mpirun or srun).
#pragma once

#include <string>
#include <vector>

#include "launch/job.h"

namespace bertrain::launch {

struct ElasticOptions {
  std::string binary = "bertrain";  // bertrain on every host
  std::string hostfile;             // re-read at every probe ("": the spec's hosts)
  double probe_s = 5, probe_timeout_s = 10;
  std::string agent;  // "": OMPI_MCA_plm_rsh_agent, else ssh -o BatchMode=yes
  // Inside a Slurm allocation (SLURM_JOB_ID set, no hostfile): the hosts are the allocation's
  // nodes (scontrol show hostnames), a host is asked with a one-task step that overlaps the
  // job's (srun --overlap -w HOST true), and each attempt is an srun step on the nodes that
  // answer (--mpi=pmix, --kill-on-bad-exit); the allocation must survive a node's loss
  // (sbatch --no-kill, as launch --emit slurm writes for an elastic spec).
  bool slurm = false;
};

// Hosts of an Open MPI hostfile ("name [slots=N]" per line, '#' comments); slots other than the
// spec's slots_per_worker are an error naming the line.
std::vector<std::string> read_hostfile(const std::string& path, int64_t slots_per_worker);

// Which of `hosts` answer now (in their order): each probed in parallel.
std::vector<std::string> answering(const std::vector<std::string>& hosts, const ElasticOptions& o);

// Runs the job to its end (returns normally) or stops naming why (Error).
void run_elastic(const JobSpec& job, const ElasticOptions& o);

}  // namespace bertrain::launch
