// A job description (job.yaml) and what each launcher needs to run it: an mpirun command line
// with its hostfile, a Slurm sbatch script, a Kubernetes MPIJob (kubeflow.org/v2beta1)
// manifest, a PAI-DLC job (the CreateJob body of `pai dlc job submit --body-json`).
//
//   name: bert-large-128            # letters, digits, '-' (a Kubernetes name)
//   workers: 32                     # hosts / pods
//   slots_per_worker: 4             # ranks per worker (one per GPU)
//   resources: {cpu: 48, gpu: 4, gpu_type: V100, memory: 368Gi, shared_memory: 64Gi}
//   image: registry/bertrain:0.1.0  # containers (MPIJob, DLC); default bertrain:<this version>
//   hosts: [node-0, node-1]         # mpirun's hostfile (default: worker-0 ... worker-N-1)
//   env: {NCCL_ALGO: Ring}
//   command: train                  # a bertrain command
//   flags: {model-config: configs/bert-large.json, data: /data/*.tfrecord, output: /out/run}
//   elastic: {min_workers: 24, max_workers: 32, max_restarts: 10}   # launch --run supervises
//
// Unknown keys and bad values are errors that name the key.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace bertrain::launch {

struct Resources {
  int64_t cpu = 0, gpu = 0;                     // per worker; 0: not asked for
  std::string gpu_type, memory, shared_memory;  // memory as Kubernetes writes it: 64Gi, 512Mi
};

// An elastic job (launch/elastic.h): restarted from its last checkpoint on the hosts that answer
// when one is lost, never on fewer than min_workers, at most max_restarts times; grown again
// (up to max_workers) when hosts come back.
struct Elastic {
  bool on = false;
  int64_t min_workers = 1, max_workers = 0, max_restarts = 3;  // max_workers 0: `workers`
};

struct JobSpec {
  std::string name, image;
  int64_t workers = 1, slots_per_worker = 1;
  Resources resources;
  std::vector<std::string> hosts;
  std::vector<std::pair<std::string, std::string>> env;    // in the file's order
  std::string command;                                     // train, finetune, eval, ...
  std::vector<std::pair<std::string, std::string>> flags;  // flag (without --) and value; "" for
                                                           // a switch
  Elastic elastic;
  std::string text;     // the spec as written (YAML)
  std::string source;   // the file, for messages
  std::string made_by;  // "bertrain 0.1.0 (commit ..., Release build)": written into the specs
  // The containers' image: the file's, else the one scripts/package.sh builds of this version.
  std::string image_name() const;
  int64_t ranks() const { return workers * slots_per_worker; }
  // The same job on fewer or other hosts (an elastic restart): workers and BERTRAIN_JOB follow.
  JobSpec on_hosts(const std::vector<std::string>& hosts) const;
  // "bertrain train --model-config ... ": the command every rank runs (shell-quoted).
  std::string bertrain_command(const std::string& binary = "bertrain") const;
};

// bertrain:<version>: the image scripts/package.sh --image builds from this version's package.
std::string default_image();

JobSpec read_job(const std::string& path);
JobSpec parse_job(const std::string& yaml, const std::string& source);

// mpirun: the command line (hostfile named `hostfile`) and the hostfile ("host slots=N" lines).
std::string emit_mpirun(const JobSpec& j, const std::string& hostfile,
                        const std::string& binary = "bertrain");
std::string emit_hostfile(const JobSpec& j);
// One srun step of the job on its hosts (a Slurm allocation's nodes): the spec's environment
// exported, --mpi=pmix, --kill-on-bad-exit (the elastic supervisor's attempt under Slurm).
std::string emit_srun_step(const JobSpec& j, const std::string& binary = "bertrain");
std::string emit_slurm(const JobSpec& j);  // an sbatch script (srun --mpi=pmix)
// YAML. An elastic job's launcher runs the supervisor (`bertrain launch --run` on the spec,
// written out by the command, over the operator's /etc/mpi/hostfile); its workers are
// restarted by Kubernetes and join again.
std::string emit_mpijob(const JobSpec& j);
std::string emit_dlc(const JobSpec& j);  // JSON (an elastic job: as the MPIJob's launcher)
// The shell command that writes the spec to `path` and runs the elastic supervisor on it over
// `hostfile` (a container's launcher).
std::string elastic_launcher_command(const JobSpec& j, const std::string& path,
                                     const std::string& hostfile);

// Single-quoted for a POSIX shell where it needs quoting.
std::string shell_quote(const std::string& s);

}  // namespace bertrain::launch
