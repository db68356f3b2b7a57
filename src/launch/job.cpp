#include "launch/job.h"

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"

namespace bertrain::launch {

namespace {

const std::set<std::string> kCommands = {"train", "finetune",    "eval",   "predict", "prepare",
                                         "bench", "bench-input", "doctor", "estimate"};

std::string where(const JobSpec& j, const std::string& key) {
  return str(j.source, ": ", key);
}

void check_keys(const YAML::Node& n, const std::set<std::string>& known, const JobSpec& j,
                const std::string& prefix) {
  for (const auto& kv : n) {
    const std::string k = kv.first.as<std::string>();
    if (!known.count(k)) {
      std::string list;
      for (const auto& x : known) list += (list.empty() ? "" : ", ") + x;
      fail(where(j, prefix + k), ": unknown key (known: ", list, ")");
    }
  }
}

std::string scalar(const YAML::Node& n, const JobSpec& j, const std::string& key) {
  if (!n.IsScalar()) fail(where(j, key), ": must be a single value, not a list or a map");
  return n.as<std::string>();
}

int64_t count(const YAML::Node& n, const JobSpec& j, const std::string& key, int64_t least) {
  const std::string s = scalar(n, j, key);
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || s.empty() || v < least)
    fail(where(j, key), ": '", s, "' must be a whole number >= ", least);
  return v;
}

// Kubernetes quantities of memory: 512Mi, 64Gi, 1Ti (binary) or plain bytes.
std::string memory(const YAML::Node& n, const JobSpec& j, const std::string& key) {
  const std::string s = scalar(n, j, key);
  size_t i = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
  const std::string unit = s.substr(i);
  if (i == 0 || !(unit.empty() || unit == "Ki" || unit == "Mi" || unit == "Gi" || unit == "Ti"))
    fail(where(j, key), ": '", s, "' is not a memory size (e.g. 64Gi, 512Mi)");
  return s;
}

bool valid_name(const std::string& s) {
  if (s.empty() || s.size() > 63 || s.front() == '-' || s.back() == '-') return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  return true;
}

bool valid_env(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

// Slurm's --mem takes K/M/G/T (powers of 1024): 64Gi -> 64G.
std::string slurm_memory(const std::string& k8s) {
  if (k8s.size() > 2 && k8s.back() == 'i') return k8s.substr(0, k8s.size() - 1);
  return std::to_string(std::stoll(k8s) / (1024 * 1024)) + "M";
}

}  // namespace

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789_-./:=,+@%") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string default_image() {
  return std::string("bertrain:") + BERTRAIN_VERSION;
}

std::string JobSpec::image_name() const {
  return image.empty() ? default_image() : image;
}

std::string JobSpec::bertrain_command(const std::string& binary) const {
  std::string out = shell_quote(binary) + " " + command;
  for (const auto& [flag, value] : flags) {
    out.append(" --").append(flag);
    if (!value.empty()) out.append(" ").append(shell_quote(value));
  }
  return out;
}

JobSpec parse_job(const std::string& yaml, const std::string& source) {
  JobSpec j;
  j.source = source;
  j.text = yaml;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    fail(source, ": not YAML: ", e.what());
  }
  if (!root.IsMap()) fail(source, ": a job spec is a YAML map (name, workers, command, ...)");
  check_keys(root,
             {"name", "image", "workers", "slots_per_worker", "resources", "hosts", "env",
              "command", "flags", "elastic"},
             j, "");
  if (!root["name"]) fail(where(j, "name"), ": missing (the job's name)");
  j.name = scalar(root["name"], j, "name");
  if (!valid_name(j.name))
    fail(where(j, "name"), ": '", j.name,
         "' must be lower-case letters, digits and '-', at most 63 (a Kubernetes name)");
  if (root["image"]) j.image = scalar(root["image"], j, "image");
  if (root["workers"]) j.workers = count(root["workers"], j, "workers", 1);
  if (root["slots_per_worker"])
    j.slots_per_worker = count(root["slots_per_worker"], j, "slots_per_worker", 1);
  if (const YAML::Node r = root["resources"]) {
    if (!r.IsMap()) fail(where(j, "resources"), ": must be a map (cpu, gpu, memory, ...)");
    check_keys(r, {"cpu", "gpu", "gpu_type", "memory", "shared_memory"}, j, "resources.");
    if (r["cpu"]) j.resources.cpu = count(r["cpu"], j, "resources.cpu", 1);
    if (r["gpu"]) j.resources.gpu = count(r["gpu"], j, "resources.gpu", 0);
    if (r["gpu_type"]) j.resources.gpu_type = scalar(r["gpu_type"], j, "resources.gpu_type");
    if (r["memory"]) j.resources.memory = memory(r["memory"], j, "resources.memory");
    if (r["shared_memory"])
      j.resources.shared_memory = memory(r["shared_memory"], j, "resources.shared_memory");
    if (j.resources.gpu && j.resources.gpu != j.slots_per_worker)
      fail(where(j, "resources.gpu"), ": ", j.resources.gpu, " GPUs per worker but ",
           j.slots_per_worker, " slots_per_worker: one rank per GPU");
  }
  if (const YAML::Node h = root["hosts"]) {
    if (!h.IsSequence()) fail(where(j, "hosts"), ": must be a list of host names");
    for (size_t i = 0; i < h.size(); ++i) j.hosts.push_back(scalar(h[i], j, str("hosts[", i, "]")));
    if (static_cast<int64_t>(j.hosts.size()) != j.workers)
      fail(where(j, "hosts"), ": ", j.hosts.size(), " hosts for ", j.workers, " workers");
  }
  if (const YAML::Node e = root["env"]) {
    if (!e.IsMap()) fail(where(j, "env"), ": must be a map of NAME: value");
    for (const auto& kv : e) {
      const std::string k = kv.first.as<std::string>();
      if (!valid_env(k)) fail(where(j, "env." + k), ": not an environment variable name");
      if (k == "BERTRAIN_JOB")
        fail(where(j, "env." + k), ": set by bertrain launch from workers and slots_per_worker");
      j.env.emplace_back(k, scalar(kv.second, j, "env." + k));
    }
  }
  if (!root["command"]) fail(where(j, "command"), ": missing (the bertrain command: train, ...)");
  j.command = scalar(root["command"], j, "command");
  if (!kCommands.count(j.command)) {
    std::string list;
    for (const auto& c : kCommands) list += (list.empty() ? "" : ", ") + c;
    fail(where(j, "command"), ": '", j.command, "' is not a bertrain command (", list, ")");
  }
  if (const YAML::Node f = root["flags"]) {
    if (!f.IsMap()) fail(where(j, "flags"), ": must be a map of flag: value");
    for (const auto& kv : f) {
      std::string k = kv.first.as<std::string>();
      if (k.rfind("--", 0) == 0) k = k.substr(2);
      const std::string v = scalar(kv.second, j, "flags." + k);
      if (v == "false") continue;                     // a switch left off
      j.flags.emplace_back(k, v == "true" ? "" : v);  // a switch, or a value
    }
  }
  if (const YAML::Node e = root["elastic"]) {
    if (!e.IsMap()) fail(where(j, "elastic"), ": must be a map (min_workers, max_workers, ...)");
    check_keys(e, {"min_workers", "max_workers", "max_restarts"}, j, "elastic.");
    j.elastic.on = true;
    if (e["min_workers"])
      j.elastic.min_workers = count(e["min_workers"], j, "elastic.min_workers", 1);
    if (e["max_workers"])
      j.elastic.max_workers = count(e["max_workers"], j, "elastic.max_workers", 1);
    if (e["max_restarts"])
      j.elastic.max_restarts = count(e["max_restarts"], j, "elastic.max_restarts", 0);
    const int64_t most = j.elastic.max_workers ? j.elastic.max_workers : j.workers;
    if (j.elastic.min_workers > most)
      fail(where(j, "elastic.min_workers"), ": ", j.elastic.min_workers, " is more than the ", most,
           j.elastic.max_workers ? " of elastic.max_workers" : " workers");
    if (j.command != "train")
      fail(where(j, "elastic"), ": only train resumes from a checkpoint on other hosts; `",
           j.command, "` cannot be restarted elastically");
  }
  // Every rank learns the shape it was described with and checks what its launcher started
  // against it (comm/launcher.h).
  j.env.emplace_back("BERTRAIN_JOB",
                     str(j.name, " ranks=", j.ranks(), " per_host=", j.slots_per_worker));
  return j;
}

JobSpec JobSpec::on_hosts(const std::vector<std::string>& list) const {
  JobSpec j = *this;
  j.hosts = list;
  j.workers = static_cast<int64_t>(list.size());
  for (auto& [k, v] : j.env)
    if (k == "BERTRAIN_JOB")
      v = str(j.name, " ranks=", j.ranks(), " per_host=", j.slots_per_worker);
  return j;
}

JobSpec read_job(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("cannot open job spec ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_job(ss.str(), path);
}

std::string emit_hostfile(const JobSpec& j) {
  std::string out;
  for (int64_t w = 0; w < j.workers; ++w)
    out += str(j.hosts.empty() ? "worker-" + std::to_string(w) : j.hosts[w],
               " slots=", j.slots_per_worker, "\n");
  return out;
}

namespace {
// Open MPI's launcher notices a lost host through TCP keepalive on its daemon connections:
// by default after 300 s idle + 9 x 20 s, here after 10 + 3 x 5 s. (The ranks end within
// --stall-timeout anyway; this ends mpirun too instead of leaving it waiting minutes.)
const std::vector<std::pair<std::string, std::string>> kLostHostMca = {
    {"oob_tcp_keepalive_time", "10"},
    {"oob_tcp_keepalive_intvl", "5"},
    {"oob_tcp_keepalive_probes", "3"}};

std::string lost_host_mca() {
  std::string out;
  for (const auto& [k, v] : kLostHostMca) out += " --mca " + k + " " + v;
  return out;
}
}  // namespace

std::string emit_mpirun(const JobSpec& j, const std::string& hostfile, const std::string& binary) {
  std::string out =
      str("mpirun -np ", j.ranks(), " --hostfile ", shell_quote(hostfile),
          " --map-by ppr:", j.slots_per_worker, ":node --bind-to none", lost_host_mca());
  for (const auto& [k, v] : j.env) out += " -x " + shell_quote(k + "=" + v);
  return out + " " + j.bertrain_command(binary) + "\n";
}

std::string elastic_launcher_command(const JobSpec& j, const std::string& path,
                                     const std::string& hostfile) {
  std::string text = j.text;
  if (!text.empty() && text.back() != '\n') text += '\n';
  return str("cat > ", path, " << 'BERTRAIN_JOB_SPEC'\n", text,
             "BERTRAIN_JOB_SPEC\nexec bertrain launch ", path, " --run --hostfile ", hostfile);
}

std::string emit_srun_step(const JobSpec& j, const std::string& binary) {
  std::string out = "env";
  for (const auto& [k, v] : j.env) out += " " + shell_quote(k + "=" + v);
  std::string nodes;
  for (const auto& h : j.hosts) nodes += (nodes.empty() ? "" : ",") + h;
  // --ntasks too: the allocation's SLURM_NTASKS would otherwise ask the whole job's tasks of the
  // nodes left. --overlap: a step that ran on a lost node stays "running" in Slurm until that
  // node answers (it cannot acknowledge the kill) and holds its CPUs on the nodes left, where
  // its processes are gone; the next step shares them instead of waiting for it forever.
  out +=
      str(" srun --nodes=", j.workers, " --nodelist=", shell_quote(nodes),
          " --ntasks=", j.workers * j.slots_per_worker, " --ntasks-per-node=", j.slots_per_worker,
          " --overlap --mpi=pmix --kill-on-bad-exit=1 ", j.bertrain_command(binary));
  return out + "\n";
}

std::string emit_slurm(const JobSpec& j) {
  std::string out = "#!/bin/bash\n";
  if (!j.made_by.empty()) out += "# made by " + j.made_by + "\n";
  out += "#SBATCH --job-name=" + j.name + "\n";
  out += str("#SBATCH --nodes=",
             j.elastic.on && j.elastic.max_workers ? j.elastic.max_workers : j.workers, "\n");
  out += str("#SBATCH --ntasks-per-node=", j.slots_per_worker, "\n");
  if (j.resources.cpu)
    out +=
        str("#SBATCH --cpus-per-task=", std::max<int64_t>(1, j.resources.cpu / j.slots_per_worker),
            "\n");
  if (!j.resources.memory.empty())
    out += "#SBATCH --mem=" + slurm_memory(j.resources.memory) + "\n";
  if (j.resources.gpu)
    out +=
        str("#SBATCH --gres=gpu:", j.resources.gpu_type.empty() ? "" : j.resources.gpu_type + ":",
            j.resources.gpu, "\n");
  out += "#SBATCH --output=" + j.name + "-%j.out\n";
  if (j.elastic.on)  // a node lost leaves the allocation running: the supervisor goes on
    out += "#SBATCH --no-kill\n";
  out += "set -euo pipefail\n";
  bool threads_set = false;
  for (const auto& [k, v] : j.env) {
    out += "export " + k + "=" + shell_quote(v) + "\n";
    threads_set |= k == "OMP_NUM_THREADS";
  }
  // The spec's thread count wins; otherwise one thread per CPU Slurm gives a task.
  if (!threads_set) out += "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}\n";
  if (j.elastic.on) {
    // The supervisor in the allocation: srun steps on the nodes that answer, restarted and
    // grown as they come and go.
    std::string text = j.text;
    if (!text.empty() && text.back() != '\n') text += '\n';
    out += "spec=$(mktemp)\ncat > \"$spec\" << 'BERTRAIN_JOB_SPEC'\n" + text +
           "BERTRAIN_JOB_SPEC\nexec bertrain launch \"$spec\" --run\n";
    return out;
  }
  // One task per rank, placed by Slurm; Open MPI's ranks come from PMIx.
  out += "srun --mpi=pmix " + j.bertrain_command() + "\n";
  return out;
}

std::string emit_mpijob(const JobSpec& j) {
  YAML::Emitter y;
  auto container = [&](const std::string& role, bool launcher) {
    y << YAML::BeginMap << YAML::Key << "name" << YAML::Value << role;
    y << YAML::Key << "image" << YAML::Value << j.image_name();
    if (launcher) {
      // The operator mounts the hostfile and sets OMPI_MCA_orte_default_hostfile.
      // Every item a string (Kubernetes' command is a list of strings: "128", not 128).
      std::vector<std::string> cmd = {"mpirun",
                                      "-np",
                                      std::to_string(j.ranks()),
                                      "--bind-to",
                                      "none",
                                      "--map-by",
                                      str("ppr:", j.slots_per_worker, ":node")};
      for (const auto& [k, v] : kLostHostMca) cmd.insert(cmd.end(), {"--mca", k, v});
      for (const auto& [k, v] : j.env) cmd.insert(cmd.end(), {"-x", k});
      cmd.insert(cmd.end(), {"bertrain", j.command});
      for (const auto& [flag, value] : j.flags) {
        cmd.push_back("--" + flag);
        if (!value.empty()) cmd.push_back(value);
      }
      // An elastic job: the supervisor instead, over the hostfile the operator mounts.
      if (j.elastic.on)
        cmd = {"sh", "-c",
               elastic_launcher_command(j, "/tmp/bertrain-job.yaml", "/etc/mpi/hostfile")};
      y << YAML::Key << "command" << YAML::Value << YAML::BeginSeq;
      for (const auto& x : cmd) y << YAML::DoubleQuoted << x;
      y << YAML::EndSeq;
    }
    if (!j.env.empty()) {
      y << YAML::Key << "env" << YAML::Value << YAML::BeginSeq;
      for (const auto& [k, v] : j.env)
        y << YAML::BeginMap << YAML::Key << "name" << YAML::Value << k << YAML::Key << "value"
          << YAML::Value << YAML::DoubleQuoted << v << YAML::EndMap;
      y << YAML::EndSeq;
    }
    if (!launcher) {
      y << YAML::Key << "resources" << YAML::Value << YAML::BeginMap << YAML::Key << "limits"
        << YAML::Value << YAML::BeginMap;
      if (j.resources.cpu) y << YAML::Key << "cpu" << YAML::Value << j.resources.cpu;
      if (!j.resources.memory.empty())
        y << YAML::Key << "memory" << YAML::Value << j.resources.memory;
      if (j.resources.gpu) y << YAML::Key << "nvidia.com/gpu" << YAML::Value << j.resources.gpu;
      y << YAML::EndMap << YAML::EndMap;
    }
    y << YAML::EndMap;
  };
  auto replica = [&](const std::string& role, int64_t replicas, bool launcher) {
    y << YAML::Key << role << YAML::Value << YAML::BeginMap;
    y << YAML::Key << "replicas" << YAML::Value << replicas;
    y << YAML::Key << "template" << YAML::Value << YAML::BeginMap << YAML::Key << "spec"
      << YAML::Value << YAML::BeginMap << YAML::Key << "containers" << YAML::Value
      << YAML::BeginSeq;
    container(launcher ? "launcher" : "worker", launcher);
    y << YAML::EndSeq;
    // A lost worker's pod comes back under its name (the operator recreates it; a container
    // that died is restarted): the elastic supervisor sees it answer and grows the job.
    if (!launcher && j.elastic.on) y << YAML::Key << "restartPolicy" << YAML::Value << "Always";
    if (!launcher && !j.resources.shared_memory.empty()) {  // /dev/shm for the shm allreduce
      y << YAML::Key << "volumes" << YAML::Value << YAML::BeginSeq << YAML::BeginMap << YAML::Key
        << "name" << YAML::Value << "dshm" << YAML::Key << "emptyDir" << YAML::Value
        << YAML::BeginMap << YAML::Key << "medium" << YAML::Value << "Memory" << YAML::Key
        << "sizeLimit" << YAML::Value << j.resources.shared_memory << YAML::EndMap << YAML::EndMap
        << YAML::EndSeq;
    }
    y << YAML::EndMap << YAML::EndMap << YAML::EndMap;
  };
  y << YAML::BeginMap;
  y << YAML::Key << "apiVersion" << YAML::Value << "kubeflow.org/v2beta1";
  y << YAML::Key << "kind" << YAML::Value << "MPIJob";
  y << YAML::Key << "metadata" << YAML::Value << YAML::BeginMap << YAML::Key << "name"
    << YAML::Value << j.name;
  if (!j.made_by.empty())
    y << YAML::Key << "annotations" << YAML::Value << YAML::BeginMap << YAML::Key
      << "bertrain/made-by" << YAML::Value << YAML::DoubleQuoted << j.made_by << YAML::EndMap;
  y << YAML::EndMap;
  y << YAML::Key << "spec" << YAML::Value << YAML::BeginMap;
  y << YAML::Key << "slotsPerWorker" << YAML::Value << j.slots_per_worker;
  y << YAML::Key << "mpiImplementation" << YAML::Value << "OpenMPI";
  y << YAML::Key << "runPolicy" << YAML::Value << YAML::BeginMap << YAML::Key << "cleanPodPolicy"
    << YAML::Value << "Running" << YAML::EndMap;
  y << YAML::Key << "mpiReplicaSpecs" << YAML::Value << YAML::BeginMap;
  replica("Launcher", 1, true);
  replica("Worker", j.elastic.on && j.elastic.max_workers ? j.elastic.max_workers : j.workers,
          false);
  y << YAML::EndMap << YAML::EndMap << YAML::EndMap;
  return std::string(y.c_str()) + "\n";
}

std::string emit_dlc(const JobSpec& j) {
  nlohmann::ordered_json spec = {
      {"Type", "Worker"}, {"Image", j.image_name()}, {"PodCount", j.workers}};
  nlohmann::ordered_json res = nlohmann::ordered_json::object();
  if (j.resources.cpu) res["CPU"] = std::to_string(j.resources.cpu);
  if (j.resources.gpu) res["GPU"] = std::to_string(j.resources.gpu);
  if (!j.resources.gpu_type.empty()) res["GPUType"] = j.resources.gpu_type;
  if (!j.resources.memory.empty()) res["Memory"] = j.resources.memory;
  if (!j.resources.shared_memory.empty()) res["SharedMemory"] = j.resources.shared_memory;
  spec["ResourceConfig"] = res;
  nlohmann::ordered_json envs = nlohmann::ordered_json::object();
  for (const auto& [k, v] : j.env) envs[k] = v;
  if (!j.made_by.empty()) envs["BERTRAIN_MADE_BY"] = j.made_by;  // (the launcher's, not -x'ed)
  // DLC's MPIJob runs the command on the launcher with the workers' hostfile in place.
  std::string cmd = str("mpirun -np ", j.ranks(),
                        " --allow-run-as-root --bind-to none --map-by ppr:", j.slots_per_worker,
                        ":node", lost_host_mca());
  for (const auto& [k, v] : j.env) cmd.append(" -x ").append(k);
  cmd.append(" ").append(j.bertrain_command());
  if (j.elastic.on)  // DLC's MPIJob mounts the workers' hostfile as the MPI Operator does
    cmd = elastic_launcher_command(j, "/tmp/bertrain-job.yaml", "/etc/mpi/hostfile");
  const nlohmann::ordered_json body = {{"DisplayName", j.name},
                                       {"JobType", "MPIJob"},
                                       {"JobSpecs", {spec}},
                                       {"Envs", envs},
                                       {"UserCommand", cmd}};
  return body.dump(2) + "\n";
}

}  // namespace bertrain::launch
