// TensorBoard event files and metrics.jsonl (obs/events.h). The golden
// tests/golden/tensorboard/tiny_run.json is what TensorBoard's own reader (EventAccumulator) saw
// in the event file of a small training run (tools/check_tensorboard_events.py, which also
// checked it against that run's metrics.jsonl); here the same run's files, read with
// TensorFlow's Event proto, must hold the same tags, steps and values.
#include <gtest/gtest.h>
#if __has_include(<nccl.h>)
#include <nccl.h>
#endif

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "data/tfrecord.h"
#include "obs/doctor.h"
#include "obs/events.h"
#include "obs/report.h"
#include "obs/timeline.h"
#include "tensorflow/core/util/event.pb.h"
#include "test_util.h"

namespace bertrain {
namespace {

namespace fs = std::filesystem;

std::vector<tensorflow::Event> read_events(const std::string& path) {
  std::vector<tensorflow::Event> out;
  data::TFRecordReader r(path, data::Compression::None);  // CRCs checked as for any TFRecord
  std::string rec;
  while (r.next(rec)) {
    tensorflow::Event e;
    EXPECT_TRUE(e.ParseFromString(rec)) << path << " record " << out.size();
    out.push_back(e);
  }
  return out;
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
      files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// Values that depend only on the model's arithmetic (not on timing): compared with the golden
// within 2e-3 relative (the golden run and this one may take other ISA paths, AVX-512 or AVX2,
// whose fp32 sums differ in the last bits; six steps keep the drift far below this).
bool deterministic(const std::string& tag) {
  return tag.rfind("train/", 0) == 0;
}

TEST(Events, TensorBoardReadsWhatBertrainWrites) {
  test::TempDir tmp;
  const std::string run = (tmp.path / "run").string();
  const std::string cmd =
      std::string(BERTRAIN_BINARY) + " train --model-config " +
      test::data_path("../configs/bert-tiny.json") + " --data " +
      test::data_path("data/tfrecord/bert_pretrain_sample_text.tfrecord") + " --output " + run +
      " --steps 6 --log-every 2 --batch-size 4 --seq-len 128 --max-predictions 20 --threads 1"
      " --seed 7 --optimizer adamw --lr 1e-4 > " +
      (tmp.path / "log.txt").string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;

  const auto files = event_files(run);
  ASSERT_EQ(files.size(), 1u);
  const auto events = read_events(files[0]);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_EQ(events[1].session_log().status(), tensorflow::SessionLog::START);  // fresh: step 0
  EXPECT_EQ(events[1].step(), 0);
  std::map<std::string, std::vector<std::pair<int64_t, float>>> seen;
  for (const auto& e : events)
    for (const auto& v : e.summary().value()) seen[v.tag()].push_back({e.step(), v.simple_value()});

  std::ifstream gin(test::data_path("golden/tensorboard/tiny_run.json"));
  const nlohmann::json golden = nlohmann::json::parse(gin);
  std::vector<std::string> tags;
  for (const auto& [tag, _] : seen) tags.push_back(tag);
  EXPECT_EQ(tags, golden["tags"].get<std::vector<std::string>>());
  const auto rows = read_jsonl(run + "/metrics.jsonl");
  ASSERT_EQ(rows.size(), 3u);
  for (const auto& [tag, points] : seen) {
    if (!golden["steps"].contains(tag)) continue;
    const auto steps = golden["steps"][tag].get<std::vector<int64_t>>();
    const auto values = golden["values"][tag].get<std::vector<double>>();
    ASSERT_EQ(points.size(), steps.size()) << tag;
    for (size_t i = 0; i < points.size(); ++i) {
      EXPECT_EQ(points[i].first, steps[i]) << tag;
      // metrics.jsonl holds the same value (in double; the event in float32).
      EXPECT_EQ(rows[i]["step"].get<int64_t>(), points[i].first);
      EXPECT_EQ(static_cast<float>(rows[i][tag].get<double>()), points[i].second) << tag;
      if (tag == "memory/plan_mib")  // the kernel scratch in it depends on the CPU's ISA (oneDNN's
                                     // GEMM scratchpad): under 4 MiB at one thread
        EXPECT_NEAR(points[i].second, values[i], 4.0) << tag << " at step " << steps[i];
      else if (deterministic(tag))
        EXPECT_NEAR(points[i].second, values[i], 2e-3 * std::abs(values[i]) + 1e-7)
            << tag << " at step " << steps[i];
      else
        EXPECT_TRUE(std::isfinite(points[i].second)) << tag;
    }
  }
  EXPECT_EQ(rows[0]["rank_step_ms"].size(), 1u);
}

// `bertrain eval` of a run directory adds its metrics to the run's TensorBoard events at the
// checkpoint's step (a file of its own, without a SessionLog START that would hide the training
// curves) and to eval.jsonl, which the report reads.
TEST(Events, EvalOfARunJoinsItsEvents) {
  test::TempDir tmp;
  const std::string run = (tmp.path / "run").string();
  const std::string data = test::data_path("data/tfrecord/bert_pretrain_sample_text.tfrecord");
  const std::string quiet = " > " + (tmp.path / "log.txt").string() + " 2>&1";
  ASSERT_EQ(std::system(
                (std::string(BERTRAIN_BINARY) + " train --model-config " +
                 test::data_path("../configs/bert-tiny.json") + " --data " + data + " --output " +
                 run + " --steps 2 --log-every 1 --batch-size 4 --seq-len 128 --threads 1" + quiet)
                    .c_str()),
            0);
  ASSERT_EQ(std::system((std::string(BERTRAIN_BINARY) + " eval --checkpoint " + run + " --data " +
                         data + " --batch-size 8 --seq-len 128 --threads 1" + quiet)
                            .c_str()),
            0);
  const auto rows = read_jsonl(run + "/eval.jsonl");
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0]["step"], 2);
  EXPECT_EQ(rows[0]["examples"], 60);
  EXPECT_GT(rows[0]["eval/mlm_loss"].get<double>(), 0.0);
  const auto files = event_files(run);
  ASSERT_EQ(files.size(), 2u);
  bool found = false;
  for (const auto& f : files)
    for (const auto& e : read_events(f)) {
      EXPECT_FALSE(e.has_session_log() && f == files.back()) << "eval must not restart the run";
      for (const auto& v : e.summary().value())
        if (v.tag() == "eval/mlm_accuracy") found = e.step() == 2;
    }
  EXPECT_TRUE(found);
  // The report shows it.
  ASSERT_EQ(std::system((std::string(BERTRAIN_BINARY) + " report " + run + quiet).c_str()), 0);
  std::ifstream in(run + "/report.html");
  const std::string html((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(html.find("eval masked LM accuracy"), std::string::npos);
}

// A resumed run drops what it will repeat: metrics.jsonl loses the rows past the resumed step,
// and the new event file starts with a SessionLog START there (TensorBoard then ignores the
// older files' events from that step on).
TEST(Events, ResumeDropsTheStepsItRepeats) {
  test::TempDir tmp;
  const std::string dir = tmp.path.string();
  {
    obs::EventWriter ev(dir, 0);
    obs::MetricsLog ml(dir, 0);
    for (int64_t s : {2, 4, 6}) {
      ev.scalars(s, {{"train/loss", 10.0 + s}});
      ml.write({{"step", s}, {"train/loss", 10.0 + s}});
    }
  }
  {
    std::ofstream(dir + "/metrics.jsonl", std::ios::app) << "{\"step\": 8, \"train/lo";  // torn
  }
  obs::EventWriter ev(dir, 3);  // the checkpoint was at step 3: steps 4 and 6 run again
  obs::MetricsLog ml(dir, 3);
  for (int64_t s : {4, 6}) {
    ev.scalars(s, {{"train/loss", 20.0 + s}});
    ml.write({{"step", s}, {"train/loss", 20.0 + s}});
  }
  const auto rows = read_jsonl(dir + "/metrics.jsonl");
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0]["train/loss"], 12.0);
  EXPECT_EQ(rows[1]["train/loss"], 24.0);
  EXPECT_EQ(rows[2]["train/loss"], 26.0);
  const auto files = event_files(dir);
  ASSERT_EQ(files.size(), 2u);
  const auto second = read_events(ev.path());
  ASSERT_EQ(second.size(), 4u);
  EXPECT_EQ(second[1].session_log().status(), tensorflow::SessionLog::START);
  EXPECT_EQ(second[1].step(), 3);
  EXPECT_EQ(second[2].summary().value(0).simple_value(), 24.0f);
}

}  // namespace
}  // namespace bertrain

namespace bertrain {
namespace {

// The report: one HTML file, plots as inline SVG, nothing fetched (no scripts, no links, no
// external images), both runs overlaid, every rank's step times, the settings.
// A run's timeline (train --timeline RUN/timeline.json, written by obs::Timeline) becomes a
// chart of its last step on rank 0: the training thread's spans and the reducer's allreduce
// buckets, with the allreduce time inside backward (hidden) and the step's wait (exposed).
TEST(Report, LastStepOfTheTimeline) {
  test::TempDir tmp;
  const std::string dir = (tmp.path / "run").string();
  obs::MetricsLog ml(dir, 0);
  ml.write({{"step", 2}, {"train/loss", 9.0}});
  obs::Timeline tl;
  tl.enable(0);
  for (int64_t step = 0; step < 2; ++step) {  // microseconds; step 1 is the one drawn
    const int64_t t = 1000 * step * 100;
    tl.add("step " + std::to_string(step), "step", t, t + 90000);
    tl.add("forward", "compute", t + 1000, t + 31000);
    tl.add("backward", "compute", t + 31000, t + 71000);
    tl.add("allreduce bucket 0 (64 KiB)", "communication", t + 50000, t + 65000, 1);
    tl.add("allreduce bucket 1 (64 KiB)", "communication", t + 70000, t + 80000, 1);
    tl.add("allreduce gradients", "communication", t + 71000, t + 80000);
    tl.add("optimizer", "optimizer", t + 80000, t + 90000);
  }
  tl.write(dir + "/timeline.json", 1);
  const obs::RunMetrics r = obs::load_run(dir);
  EXPECT_EQ(r.trace_step, "step 1");
  EXPECT_DOUBLE_EQ(r.trace_step_ms, 90.0);
  ASSERT_EQ(r.trace.size(), 6u);
  const std::string html = obs::render_report({r});
  EXPECT_NE(html.find("one step on rank 0 (step 1, 90 ms)"), std::string::npos);
  EXPECT_NE(html.find("<title>allreduce bucket 0 (64 KiB): 15 ms at 50 ms</title>"),
            std::string::npos);
  // Bucket 0 lies inside backward (15 ms), bucket 1 overlaps its last 1 ms; the step waited 9.
  EXPECT_NE(html.find("Allreduce buckets 25 ms, 16 ms of it during backward (hidden); the step "
                      "waited 9 ms for the sum (exposed)"),
            std::string::npos)
      << html.substr(html.find("Allreduce buckets"), 160);
}

TEST(Report, SelfContainedPageOfTwoRuns) {
  test::TempDir tmp;
  for (int run = 0; run < 2; ++run) {
    const std::string dir = (tmp.path / ("run" + std::to_string(run))).string();
    obs::MetricsLog ml(dir, 0);
    for (int64_t s = 10; s <= 50; s += 10)
      ml.write({{"step", s},
                {"train/loss", 10.0 - s * 0.1 * (run + 1)},
                {"throughput/tokens_per_s", 1000.0 + run},
                {"time/input_wait_ms", 1.0},
                {"time/forward_ms", 10.0},
                {"time/backward_ms", 20.0},
                {"time/communication_exposed_ms", 2.0},
                {"time/optimizer_ms", 3.0},
                {"rank_step_ms", {36.0, 40.0 + s}}});
    std::filesystem::create_directories(dir + "/checkpoint-000050");
    std::ofstream(dir + "/latest") << "checkpoint-000050\n";
    std::ofstream(dir + "/checkpoint-000050/trainer_state.json")
        << R"({"step": 50, "settings": {"batch_size": )" << 8 * (run + 1) << "}}";
  }
  const std::string out = (tmp.path / "r.html").string();
  const std::string cmd = std::string(BERTRAIN_BINARY) + " report " + (tmp.path / "run0").string() +
                          " " + (tmp.path / "run1").string() + " --output " + out + " > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(out);
  const std::string html((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  for (const char* external : {"<script", "src=", "href=", "@import", "url("})
    EXPECT_EQ(html.find(external), std::string::npos) << external;
  // The only URL is the SVG namespace (a name, never fetched).
  size_t urls = 0;
  for (size_t p = html.find("http"); p != std::string::npos; p = html.find("http", p + 1)) {
    EXPECT_EQ(html.compare(p, 26, "http://www.w3.org/2000/svg"), 0) << html.substr(p, 40);
    ++urls;
  }
  EXPECT_GT(urls, 0u);
  for (const char* title : {"loss", "throughput", "step time, run0", "step time per rank, run1",
                            "rank 1", "batch_size", "communication (exposed)"})
    EXPECT_NE(html.find(title), std::string::npos) << title;
  // The loss chart overlays both runs: two polylines before the next chart.
  const size_t loss = html.find(">loss<"), next = html.find("</svg>", loss);
  size_t lines = 0;
  for (size_t p = html.find("<polyline", loss); p < next; p = html.find("<polyline", p + 1))
    ++lines;
  EXPECT_EQ(lines, 2u);
  // A directory without metrics is an error naming it.
  const std::string bad = std::string(BERTRAIN_BINARY) + " report " + tmp.path.string() + " > " +
                          (tmp.path / "err.txt").string() + " 2>&1";
  EXPECT_NE(std::system(bad.c_str()), 0);
  std::ifstream err(tmp.path / "err.txt");
  const std::string msg((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  EXPECT_NE(msg.find("no metrics.jsonl in"), std::string::npos) << msg;
}

}  // namespace
}  // namespace bertrain

namespace bertrain {
namespace {

std::vector<nlohmann::json> healthy_rows(int n = 8) {
  std::vector<nlohmann::json> rows;
  for (int i = 1; i <= n; ++i)
    rows.push_back({{"step", 10 * i},
                    {"train/loss", 8.0 - 0.1 * i},
                    {"train/skipped_steps", 0},
                    {"train/loss_scale", 1},
                    {"time/step_ms", 100.0},
                    {"time/input_wait_ms", 2.0},
                    {"time/communication_exposed_ms", 5.0},
                    {"memory/peak_rss_mib", 1024.0},
                    {"rank_step_ms", {95.0, 96.0, 94.0, 95.5}}});
  return rows;
}

std::vector<std::string> rules(const std::vector<obs::Finding>& f) {
  std::vector<std::string> r;
  for (const auto& x : f) r.push_back(x.rule);
  return r;
}

// Each rule fires on the symptom it names, with the numbers and a fix, and not on a healthy run.
// The GPU stack doctor reports comes from the libraries the loader finds, and agrees with NCCL's
// own header where one is installed (the header and the library of one NCCL release).
TEST(Doctor, GpuStackVersionsAreTheLibraries) {
  EXPECT_EQ(obs::cuda_version_name(13000), "13.0");
  EXPECT_EQ(obs::cuda_version_name(12040), "12.4");
  EXPECT_EQ(obs::nccl_version_name(22809), "2.28.9");
  EXPECT_EQ(obs::nccl_version_name(2804), "2.8.4");  // the code before NCCL 2.9
  const obs::GpuStack g = obs::gpu_stack();
  std::printf("cuda runtime %d (%s), driver %d (%s), nccl %d (%s)\n", g.cuda_runtime,
              g.runtime_lib.c_str(), g.cuda_driver, g.driver_lib.c_str(), g.nccl,
              g.nccl_lib.c_str());
#if __has_include(<nccl.h>)
  if (g.nccl == 0) GTEST_SKIP() << "nccl.h is installed but no libnccl.so.2 loads";
  EXPECT_EQ(g.nccl, NCCL_VERSION_CODE) << g.nccl_lib;
#else
  GTEST_SKIP() << "no nccl.h to compare with (versions read: nccl " << g.nccl << ")";
#endif
}

// The timeline rule: the step waits for the sum while the reducer's buckets ran after backward
// (late-allreduce); the same buckets inside backward are fine.
TEST(Doctor, LateAllreduceFromTheTimeline) {
  auto run_with_buckets_at = [](double at_ms) {
    obs::RunMetrics r;
    r.trace_step = "step 9";
    r.trace_step_ms = 100;
    r.trace = {{"forward", "compute", 0, 30, 0},
               {"backward", "compute", 30, 40, 0},
               {"allreduce bucket 0 (64 KiB)", "communication", at_ms, 20, 1},
               {"allreduce gradients", "communication", 70, at_ms > 50 ? 25.0 : 5.0, 0},
               {"optimizer", "optimizer", 90, 10, 0}};
    return r;
  };
  const auto late = obs::diagnose_timeline(run_with_buckets_at(70));
  ASSERT_EQ(rules(late), std::vector<std::string>{"late-allreduce"});
  EXPECT_NE(late[0].what.find("waits 25 ms"), std::string::npos) << late[0].what;
  EXPECT_NE(late[0].fix.find("--bucket-mb"), std::string::npos) << late[0].fix;
  EXPECT_TRUE(obs::diagnose_timeline(run_with_buckets_at(45)).empty());
  EXPECT_TRUE(obs::diagnose_timeline(obs::RunMetrics{}).empty());
}

// incidents.log as the MPI watchdog writes it (lines from the 2-host cluster test): the finding
// names the hosts the ranks waited for or found gone, not the reporting ranks' own.
TEST(Doctor, IncidentsNameTheLostHost) {
  test::TempDir dir;
  EXPECT_TRUE(obs::diagnose_incidents(dir.path.string()).empty());
  std::ofstream(dir / "incidents.log")
      << "bertrain: rank 1 on host h0: signal 15 while collective 'allreduce' waited 1.1 s for the "
         "ranks on h1 (ranks 2-3); probe: ranks 2-3 on host h1: process gone (connection refused)\n"
         "bertrain: rank 0 on host h0: signal 15 while collective 'allreduce' waited 1.1 s for "
         "rank 2 on host h1 (ranks 2-3); probe: ranks 2-3 on host h1: process gone (connection "
         "refused)\n";
  const auto f = obs::diagnose_incidents(dir.path.string());
  ASSERT_EQ(rules(f), std::vector<std::string>{"incident"});
  EXPECT_NE(f[0].what.find("2 message(s)"), std::string::npos) << f[0].what;
  EXPECT_NE(f[0].what.find("(waiting for or probing: h1)"), std::string::npos) << f[0].what;
  EXPECT_NE(f[0].fix.find("--resume"), std::string::npos) << f[0].fix;
}

TEST(Doctor, EachRuleFiresOnItsSymptomOnly) {
  const double memory = 64.0 * 1073741824.0;
  EXPECT_TRUE(obs::diagnose(healthy_rows(), memory).empty());
  auto rows = healthy_rows();
  for (auto& r : rows) r["time/input_wait_ms"] = 30.0;
  auto f = obs::diagnose(rows, memory);
  ASSERT_EQ(rules(f), std::vector<std::string>{"input-bound"});
  EXPECT_NE(f[0].what.find("30%"), std::string::npos) << f[0].what;
  EXPECT_NE(f[0].fix.find("--readers"), std::string::npos);
  rows = healthy_rows();
  for (auto& r : rows) r["time/communication_exposed_ms"] = 35.0;
  f = obs::diagnose(rows, memory);
  ASSERT_EQ(rules(f), std::vector<std::string>{"communication-bound"});
  EXPECT_NE(f[0].fix.find("--accumulation-steps"), std::string::npos);
  rows = healthy_rows();
  for (auto& r : rows) r["rank_step_ms"][2] = 150.0;  // rank 2 is 1.57x the median
  f = obs::diagnose(rows, memory);
  ASSERT_EQ(rules(f), std::vector<std::string>{"straggler"});
  EXPECT_NE(f[0].what.find("rank 2 takes 1.57x"), std::string::npos) << f[0].what;
  rows = healthy_rows();  // a different rank slow in each window: no straggler, an imbalance
  for (size_t i = 0; i < rows.size(); ++i) rows[i]["rank_step_ms"][i % 4] = 150.0;
  f = obs::diagnose(rows, memory);
  ASSERT_EQ(rules(f), std::vector<std::string>{"load-imbalance"});
  EXPECT_NE(f[0].what.find("takes 1.5"), std::string::npos) << f[0].what;
  EXPECT_NE(f[0].fix.find("--bind-to core"), std::string::npos) << f[0].fix;
  rows = healthy_rows();
  rows[6]["train/loss"] = 20.0;
  f = obs::diagnose(rows, memory);
  ASSERT_EQ(rules(f), std::vector<std::string>{"loss-spike"});
  EXPECT_NE(f[0].what.find("at step 70"), std::string::npos) << f[0].what;
  rows = healthy_rows();
  rows.back()["train/skipped_steps"] = 9;
  f = obs::diagnose(rows, memory);
  ASSERT_EQ(rules(f), std::vector<std::string>{"fp16-skips"});
  EXPECT_NE(f[0].fix.find("--precision bf16"), std::string::npos) << f[0].fix;
  rows = healthy_rows();
  rows.back()["memory/peak_rss_mib"] = 62.0 * 1024;
  f = obs::diagnose(rows, memory);
  ASSERT_EQ(rules(f), std::vector<std::string>{"memory"});
  EXPECT_NE(f[0].fix.find("--batch-size"), std::string::npos);
  // The first logged window (warm-up) does not count when there are later ones.
  rows = healthy_rows();
  rows[0]["time/input_wait_ms"] = 90.0;
  EXPECT_TRUE(obs::diagnose(rows, memory).empty());
}

}  // namespace
}  // namespace bertrain
