// Job specs (launch/job.h): every launcher's files for the BERT-Large 128-GPU example equal the
// reviewed goldens under tests/golden/launch/ (bash -n checks the scripts; the manifest parses
// back with every command item a string), and every bad key or value is named.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>

#include "comm/launcher.h"
#include "core/error.h"
#include "launch/elastic.h"
#include "launch/job.h"
#include "test_util.h"

namespace bertrain::launch {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

JobSpec example() {
  return read_job(test::data_path("../configs/jobs/bert-large-128.yaml"));
}

TEST(Launch, EmittersMatchTheGoldens) {
  const JobSpec j = example();
  EXPECT_EQ(j.ranks(), 128);
  const std::string g = test::data_path("golden/launch/");
  EXPECT_EQ(emit_hostfile(j), slurp(g + "hostfile"));
  EXPECT_EQ("#!/bin/bash\n" + emit_mpirun(j, "hostfile"), slurp(g + "run.sh"));
  EXPECT_EQ(emit_slurm(j), slurp(g + "bert-large-128.sbatch"));
  EXPECT_EQ(emit_mpijob(j), slurp(g + "bert-large-128-mpijob.yaml"));
  EXPECT_EQ(emit_dlc(j), slurp(g + "bert-large-128-dlc.json"));
  for (const char* script : {"run.sh", "bert-large-128.sbatch"})
    EXPECT_EQ(std::system(("bash -n " + g + script).c_str()), 0) << script;
}

TEST(Launch, MpiJobManifestIsWellFormed) {
  const YAML::Node m = YAML::Load(emit_mpijob(example()));
  EXPECT_EQ(m["apiVersion"].as<std::string>(), "kubeflow.org/v2beta1");
  EXPECT_EQ(m["spec"]["slotsPerWorker"].as<int>(), 4);
  EXPECT_EQ(m["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"].as<int>(), 32);
  const YAML::Node cmd =
      m["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"];
  ASSERT_TRUE(cmd.IsSequence());
  for (const auto& item : cmd) EXPECT_EQ(item.Tag(), "!") << item.as<std::string>();  // quoted
  const YAML::Node limits = m["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
                             [0]["resources"]["limits"];
  EXPECT_EQ(limits["nvidia.com/gpu"].as<int>(), 4);
}

// The launcher's environment (comm/launcher.h): what Slurm, Open MPI and PMIx say, checked
// against MPI's view and against the job spec's shape.
struct ScopedEnv {
  std::vector<std::string> names;
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [k, v] : vars) {
      ::setenv(k, v, 1);
      names.push_back(k);
    }
  }
  ~ScopedEnv() {
    for (const auto& k : names) ::unsetenv(k.c_str());
  }
};

TEST(Launch, LauncherEnvironmentIsReadAndChecked) {
  {
    const ScopedEnv slurm{{"SLURM_STEP_NUM_TASKS", "7"}, {"SLURM_PROCID", "6"},
                          {"SLURM_LOCALID", "0"},        {"SLURM_STEP_NUM_NODES", "4"},
                          {"SLURM_NODEID", "3"},         {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}};
    const comm::LauncherEnv e = comm::launcher_env();
    EXPECT_EQ(e.launcher, "Slurm");
    EXPECT_EQ(e.ranks, 7);
    EXPECT_EQ(e.rank, 6);
    EXPECT_EQ(e.local_size, 1);  // the fourth node's count
    EXPECT_EQ(e.hosts, 4);
    EXPECT_EQ(test::error_of([&] { comm::check_launcher_agrees(e, 6, 7, 0, 1); }), "");
    // srun without an MPI plugin: MPI sees one process.
    std::string err = test::error_of([&] { comm::check_launcher_agrees(e, 0, 1, 0, 1); });
    EXPECT_NE(err.find("Slurm started 7 ranks (SLURM_STEP_NUM_TASKS=7"), std::string::npos) << err;
    EXPECT_NE(err.find("srun --mpi=pmix"), std::string::npos) << err;
    err = test::error_of([&] { comm::check_launcher_agrees(e, 5, 7, 0, 1); });
    EXPECT_NE(err.find("this is rank 6"), std::string::npos) << err;
    EXPECT_NE(err.find("MPI says 5"), std::string::npos) << err;
    // The job spec's shape.
    EXPECT_EQ(test::error_of([&] { comm::check_job_shape("j ranks=7 per_host=1", e, 7, 1); }), "");
    err = test::error_of([&] { comm::check_job_shape("bert ranks=8 per_host=2", e, 7, 1); });
    EXPECT_NE(err.find("job 'bert' was described with 8 ranks (4 workers x 2 slots), but Slurm "
                       "(SLURM_STEP_NUM_TASKS=7"),
              std::string::npos)
        << err;
    err = test::error_of([&] { comm::check_job_shape("bert ranks=7 per_host=2", e, 7, 1); });
    EXPECT_NE(err.find("2 ranks per host"), std::string::npos) << err;
    EXPECT_NE(err.find("--ntasks-per-node=2"), std::string::npos) << err;
    err = test::error_of([&] { comm::check_job_shape("garbage", e, 7, 1); });
    EXPECT_NE(err.find("is not 'NAME ranks=N per_host=S'"), std::string::npos) << err;
  }
  {
    // mpirun inside a Slurm allocation: Open MPI's numbers count.
    const ScopedEnv both{{"SLURM_STEP_NUM_TASKS", "1"},       {"SLURM_PROCID", "0"},
                         {"OMPI_COMM_WORLD_SIZE", "4"},       {"OMPI_COMM_WORLD_RANK", "2"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}};
    const comm::LauncherEnv e = comm::launcher_env();
    EXPECT_EQ(e.launcher, "Open MPI");
    EXPECT_EQ(e.ranks, 4);
    EXPECT_EQ(e.local_size, 2);
    EXPECT_EQ(test::error_of([&] { comm::check_launcher_agrees(e, 2, 4, 0, 2); }), "");
  }
  EXPECT_EQ(comm::launcher_env().launcher, "");  // nothing set: a plain process
}

// Every emitted launcher carries the spec's shape to the ranks, and a spec cannot set it.
TEST(Launch, EveryLauncherCarriesTheJobShape) {
  const JobSpec j = example();
  for (const std::string& out :
       {emit_mpirun(j, "hostfile"), emit_slurm(j), emit_mpijob(j), emit_dlc(j)})
    EXPECT_NE(out.find("bert-large-128 ranks=128 per_host=4"), std::string::npos) << out;
  const std::string err = test::error_of(
      [] { parse_job("name: a\ncommand: train\nenv: {BERTRAIN_JOB: x}\n", "job.yaml"); });
  EXPECT_NE(err.find("env.BERTRAIN_JOB"), std::string::npos) << err;
}

TEST(Launch, BadSpecsNameTheKey) {
  auto error = [](const std::string& yaml) {
    return test::error_of([&] { parse_job(yaml, "job.yaml"); });
  };
  const std::string ok = "name: a\ncommand: train\n";
  EXPECT_EQ(error(ok), "");
  EXPECT_NE(error(ok + "wokers: 2\n").find("job.yaml: wokers: unknown key"), std::string::npos);
  EXPECT_NE(error(ok + "workers: two\n").find("job.yaml: workers: 'two' must be a whole number"),
            std::string::npos);
  EXPECT_NE(error(ok + "workers: 0\n").find("workers"), std::string::npos);
  EXPECT_NE(error("name: Big_Job\ncommand: train\n").find("job.yaml: name: 'Big_Job'"),
            std::string::npos);
  EXPECT_NE(error("name: a\n").find("job.yaml: command: missing"), std::string::npos);
  EXPECT_NE(error("name: a\ncommand: fly\n").find("'fly' is not a bertrain command"),
            std::string::npos);
  EXPECT_NE(error(ok + "workers: 2\nhosts: [x]\n").find("1 hosts for 2 workers"),
            std::string::npos);
  EXPECT_NE(error(ok + "env: {1X: y}\n").find("env.1X"), std::string::npos);
  EXPECT_NE(error(ok + "resources: {memory: lots}\n").find("resources.memory"), std::string::npos);
  EXPECT_NE(error(ok + "resources: {gpus: 4}\n").find("resources.gpus: unknown key"),
            std::string::npos);
  EXPECT_NE(error(ok + "slots_per_worker: 2\nresources: {gpu: 4}\n").find("one rank per GPU"),
            std::string::npos);
  EXPECT_NE(error("name: [a\n").find("job.yaml: not YAML"), std::string::npos);
  // Switches: true is the bare flag, false leaves it off; values are shell-quoted.
  const JobSpec j =
      parse_job(ok + "flags: {resume: true, overlap: false, data: 'a b/*.tfrecord'}\n", "job.yaml");
  EXPECT_EQ(j.bertrain_command(), "bertrain train --resume --data 'a b/*.tfrecord'");
}

// An elastic job: the bounds parsed and checked, the same job on fewer hosts carrying its new
// shape, the supervisor as the MPIJob's launcher, a refusal where it cannot run (Slurm).
TEST(Launch, ElasticSpecs) {
  const JobSpec j = read_job(test::data_path("../configs/jobs/bert-base-elastic.yaml"));
  EXPECT_TRUE(j.elastic.on);
  EXPECT_EQ(j.elastic.min_workers, 6);
  EXPECT_EQ(j.elastic.max_workers, 8);
  EXPECT_EQ(j.elastic.max_restarts, 10);
  const JobSpec six = j.on_hosts({"gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6"});
  EXPECT_EQ(six.ranks(), 48);
  EXPECT_NE(emit_mpirun(six, "h").find("-np 48 "), std::string::npos);
  EXPECT_NE(emit_mpirun(six, "h").find("BERTRAIN_JOB=bert-base-elastic ranks=48 per_host=8"),
            std::string::npos);
  EXPECT_EQ(emit_hostfile(six).find("gpu-3"), std::string::npos);
  // The launcher writes the spec and supervises it over the operator's hostfile.
  const YAML::Node m = YAML::Load(emit_mpijob(j));
  const YAML::Node cmd =
      m["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"];
  ASSERT_EQ(cmd.size(), 3u);
  const std::string script = cmd[2].as<std::string>();
  EXPECT_NE(script.find("exec bertrain launch /tmp/bertrain-job.yaml --run --hostfile "
                        "/etc/mpi/hostfile"),
            std::string::npos);
  const std::string spec = script.substr(
      script.find('\n') + 1, script.find("BERTRAIN_JOB_SPEC\nexec") - script.find('\n') - 1);
  const JobSpec back = parse_job(spec, "written");
  EXPECT_EQ(back.elastic.min_workers, 6);
  EXPECT_EQ(back.flags, j.flags);
  EXPECT_EQ(
      m["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["restartPolicy"].as<std::string>(),
      "Always");
  EXPECT_NE(emit_dlc(j).find("--run --hostfile /etc/mpi/hostfile"), std::string::npos);
  // Under Slurm the allocation survives a lost node and the batch script runs the supervisor,
  // whose attempts are srun steps on the nodes that answer.
  const std::string sbatch = emit_slurm(j);
  EXPECT_NE(sbatch.find("#SBATCH --no-kill\n"), std::string::npos) << sbatch;
  EXPECT_NE(sbatch.find("exec bertrain launch \"$spec\" --run\n"), std::string::npos) << sbatch;
  EXPECT_NE(sbatch.find("elastic: {min_workers: 6, max_workers: 8, max_restarts: 10}"),
            std::string::npos);
  EXPECT_EQ(
      emit_srun_step(six, "bertrain")
          .rfind("env OMP_NUM_THREADS=8 'BERTRAIN_JOB=bert-base-elastic ranks=48 per_host=8' srun "
                 "--nodes=6 --nodelist=gpu-0,gpu-1,gpu-2,gpu-4,gpu-5,gpu-6 --ntasks=48 "
                 "--ntasks-per-node=8 --overlap "
                 "--mpi=pmix --kill-on-bad-exit=1 bertrain train --model-config ",
                 0),
      0u)
      << emit_srun_step(six, "bertrain");

  auto error = [](const std::string& yaml) {
    return test::error_of([&] { parse_job(yaml, "job.yaml"); });
  };
  const std::string base = "name: a\nworkers: 4\ncommand: train\n";
  EXPECT_EQ(error(base + "elastic: {min_workers: 3}\n"), "");
  EXPECT_NE(error(base + "elastic: {min_workers: 5}\n")
                .find("elastic.min_workers: 5 is more than the 4 workers"),
            std::string::npos);
  EXPECT_NE(error(base + "elastic: {min_worker: 3}\n").find("elastic.min_worker: unknown key"),
            std::string::npos);
  EXPECT_NE(error(base + "elastic: {max_restarts: -1}\n").find("elastic.max_restarts"),
            std::string::npos);
  EXPECT_NE(error("name: a\ncommand: finetune\nelastic: {}\n")
                .find("`finetune` cannot be "
                      "restarted elastically"),
            std::string::npos);
}

TEST(Launch, ElasticHostfileAndProbe) {
  test::TempDir dir;
  const std::string path = (dir.path / "hosts").string();
  std::ofstream(path) << "# the allocation\nnode-1 slots=2\nnode-2 slots=2 # spare\n\nnode-1\n";
  EXPECT_EQ(read_hostfile(path, 2), (std::vector<std::string>{"node-1", "node-2"}));
  EXPECT_NE(test::error_of([&] {
              read_hostfile(path, 4);
            }).find(":2: 'slots=2' but the job runs 4 ranks per worker"),
            std::string::npos);
  // A probe through an agent: this host answers without one; another answers when the agent
  // runs `true` there, and does not when it fails or hangs past the timeout ("slow" would answer
  // after 30 s).
  ElasticOptions o;
  o.probe_timeout_s = 1;
  o.agent = "sh -c 'case $0 in up) exec \"$@\";; slow) sleep 30;; *) exit 255;; esac'";
  EXPECT_EQ(answering({"localhost", "up", "down", "slow"}, o),
            (std::vector<std::string>{"localhost", "up"}));
}

}  // namespace
}  // namespace bertrain::launch
