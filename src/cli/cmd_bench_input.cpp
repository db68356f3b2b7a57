// bertrain bench-input: drains the input pipeline as fast as it can (no model) and reports
// examples/s, MB/s, the pipeline's settings after AUTOTUNE and its memory bound; from object
// storage also what the store did (ranged reads, their latency, retries, reader waits). The peer
// comparison with tf.data is bench/input_pipeline.sh.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/arena.h"
#include "data/pipeline.h"
#include "data/storage.h"

namespace bertrain::cli {

void add_bench_input(CLI::App& app) {
  struct Opts {
    data::PipelineOptions p;
    int64_t seq = 128, preds = 20, vocab = 30522;
    double seconds = 10;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand("bench-input",
                               "Measure the input pipeline alone: examples/s from TFRecord shards");
  c->add_option("--data", o->p.files,
                "TFRecord files: glob(s), comma-separated; s3:// and oss:// too")
      ->required();
  c->add_option("--batch-size", o->p.batch_size, "Examples per batch")->capture_default_str();
  c->add_option("--seq-len", o->seq, "Sequence length of the records")->capture_default_str();
  c->add_option("--max-predictions", o->preds, "Masked LM predictions per record")
      ->capture_default_str();
  c->add_option("--vocab-size", o->vocab, "Token ids must be below this")->capture_default_str();
  c->add_option("--cycle-length", o->p.cycle_length, "Files read in parallel (interleave)")
      ->capture_default_str();
  c->add_option("--block-length", o->p.block_length, "Records taken from a file in turn")
      ->capture_default_str();
  c->add_option("--readers", o->p.readers, "Reader threads (0: AUTOTUNE)")->capture_default_str();
  c->add_option("--prefetch", o->p.prefetch, "Batches prefetched (0: AUTOTUNE)")
      ->capture_default_str();
  c->add_option("--shuffle-buffer", o->p.shuffle_buffer, "Examples in the shuffle buffer")
      ->capture_default_str();
  c->add_option("--seconds", o->seconds, "How long to measure")->capture_default_str();
  c->add_flag("--json", o->json, "Print one JSON object");
  add_read_ahead_options(c, o->p);
  add_storage_options(c);
  c->callback([o] {
    data::Schema schema = data::Schema::pretraining(o->seq, o->preds, o->vocab);
    data::Pipeline p(o->p, schema);
    model::Batch b;
    using Clock = std::chrono::steady_clock;
    // Warm up (file cache, AUTOTUNE), then measure.
    const auto w0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - w0).count() < std::min(2.0, o->seconds / 4))
      p.next(b);
    const data::PipelineStats s0 = p.stats();
    const data::RemoteReadStats r0 = data::remote_read_stats();
    const auto t0 = Clock::now();
    double dt = 0;
    while ((dt = std::chrono::duration<double>(Clock::now() - t0).count()) < o->seconds) p.next(b);
    const data::PipelineStats s1 = p.stats();
    const data::RemoteReadStats r1 = data::remote_read_stats();
    const bool remote = r1.requests > 0;
    const uint64_t requests = r1.requests - r0.requests;
    const double fetched_mb = static_cast<double>(r1.bytes - r0.bytes) / dt / 1e6;
    const double latency_ms =
        requests ? 1e3 * (r1.request_seconds - r0.request_seconds) / requests : 0;
    const double waited = r1.reader_wait_seconds - r0.reader_wait_seconds;
    const double ex = static_cast<double>(s1.examples - s0.examples) / dt;
    const double mb = static_cast<double>(s1.bytes - s0.bytes) / dt / 1e6;
    struct rusage ru {};
    getrusage(RUSAGE_SELF, &ru);
    if (o->json) {
      nlohmann::json j = {{"examples_per_s", ex},
                          {"mb_per_s", mb},
                          {"readers", s1.readers},
                          {"prefetch", s1.prefetch},
                          {"files", p.files().size()},
                          {"memory_bound_bytes", p.memory_bound_bytes()},
                          {"peak_rss_bytes", ru.ru_maxrss * 1024.0}};
      if (remote)
        j["remote"] = {{"requests", requests},           {"retries", r1.retries - r0.retries},
                       {"mb_per_s_fetched", fetched_mb}, {"mean_request_ms", latency_ms},
                       {"reader_wait_s", waited},        {"files_opened", r1.opened - r0.opened}};
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    std::printf("bench-input: %zu files, batch %lld, seq %lld, %.1f s\n", p.files().size(),
                (long long)o->p.batch_size, (long long)o->seq, dt);
    std::printf("  %.0f examples/s, %.1f MB/s of records\n", ex, mb);
    // The sources: local files and each bucket, with how many files each holds.
    std::map<std::string, int> sources;
    for (const auto& f : p.files())
      ++sources[data::is_remote(f) ? f.substr(0, f.find('/', f.find("://") + 3)) : "local"];
    std::string names, buckets;
    for (const auto& [name, n] : sources) {
      names += str(names.empty() ? "" : ", ", name, " (", n, n == 1 ? " file)" : " files)");
      if (name != "local") buckets += (buckets.empty() ? "" : ", ") + name;
    }
    if (sources.size() > 1) std::printf("  sources: %s\n", names.c_str());
    if (remote)
      std::printf(
          "  object store (%s): %.1f MB/s fetched in %llu ranged reads (%.0f ms each on average, "
          "%llu retried), %llu files opened; reader threads waited %.2f s for data\n",
          buckets.c_str(), fetched_mb, (unsigned long long)requests, latency_ms,
          (unsigned long long)(r1.retries - r0.retries),
          (unsigned long long)(r1.opened - r0.opened), waited);
    std::printf("  after AUTOTUNE: %d reader threads, prefetch %d batches\n", s1.readers,
                s1.prefetch);
    std::printf("  memory: bound %s, peak RSS %s\n",
                human_bytes(static_cast<double>(p.memory_bound_bytes())).c_str(),
                human_bytes(ru.ru_maxrss * 1024.0).c_str());
  });
}

}  // namespace bertrain::cli
