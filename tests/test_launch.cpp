// Job specs (launch/job.h): every launcher's files for the BERT-Large 128-GPU example equal the
// reviewed goldens under tests/golden/launch/ (bash -n checks the scripts; the manifest parses
// back with every command item a string), and every bad key or value is named.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>

#include "core/error.h"
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

}  // namespace
}  // namespace bertrain::launch
