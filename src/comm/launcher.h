// What the launcher that started this process says about the job, read from its environment,
// and the checks that turn a mis-launched job into a clear error before any work is done:
//   Open MPI's mpirun/prterun  OMPI_COMM_WORLD_SIZE, _RANK, _LOCAL_SIZE, _LOCAL_RANK
//   Slurm's srun               SLURM_STEP_NUM_TASKS, SLURM_PROCID, SLURM_LOCALID,
//                              SLURM_STEP_NUM_NODES, SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE
//                              ("2(x3),1": tasks on each node of the step)
//   a PMIx launcher            PMIX_RANK (the size only through MPI)
// (Open MPI first: mpirun inside an sbatch allocation also sees the allocation's SLURM_*.)
// `bertrain launch` puts the job spec's shape into the environment of every rank it starts
// (BERTRAIN_JOB="NAME ranks=N per_host=S"), so the ranks can check they are the job the spec
// describes.
#pragma once

#include <cstdint>
#include <string>

namespace bertrain::comm {

struct LauncherEnv {
  std::string launcher;  // "Open MPI", "Slurm", "PMIx"; empty when no launcher's variables are set
  int64_t ranks = -1, rank = -1, local_size = -1, local_rank = -1;  // -1: not said
  int64_t hosts = -1;                                               // Slurm's node count
  std::string evidence;  // the variables read, "SLURM_STEP_NUM_TASKS=4 SLURM_PROCID=1 ..."
};

LauncherEnv launcher_env();

// The launcher's numbers against MPI's. ranks > 1 with an MPI world of one process is the
// classic mis-launch (srun without an MPI plugin, another MPI's mpirun): every rank would train
// alone into the same output. A disagreement names both and the fix.
void check_launcher_agrees(const LauncherEnv& env, int rank, int size, int local_rank,
                           int local_size);

// The job spec's shape (BERTRAIN_JOB, from `bertrain launch`) against the ranks MPI has and the
// ranks on this host; empty `job` checks nothing.
void check_job_shape(const std::string& job, const LauncherEnv& env, int size, int local_size);

}  // namespace bertrain::comm
