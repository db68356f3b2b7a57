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

struct JobSpec {
  std::string name, image;
  int64_t workers = 1, slots_per_worker = 1;
  Resources resources;
  std::vector<std::string> hosts;
  std::vector<std::pair<std::string, std::string>> env;    // in the file's order
  std::string command;                                     // train, finetune, eval, ...
  std::vector<std::pair<std::string, std::string>> flags;  // flag (without --) and value; "" for
                                                           // a switch
  std::string source;                                      // the file, for messages
  std::string made_by;  // "bertrain 0.1.0 (commit ..., Release build)": written into the specs
  // The containers' image: the file's, else the one scripts/package.sh builds of this version.
  std::string image_name() const;
  int64_t ranks() const { return workers * slots_per_worker; }
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
std::string emit_slurm(const JobSpec& j);   // an sbatch script (srun --mpi=pmix)
std::string emit_mpijob(const JobSpec& j);  // YAML
std::string emit_dlc(const JobSpec& j);     // JSON

// Single-quoted for a POSIX shell where it needs quoting.
std::string shell_quote(const std::string& s);

}  // namespace bertrain::launch
