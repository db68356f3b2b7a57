// bertrain report: one self-contained HTML page of one or more runs (obs/report.h).
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "obs/report.h"

namespace bertrain::cli {

void add_report(CLI::App& app) {
  struct Opts {
    std::vector<std::string> runs;
    std::string output;
  };
  auto o = std::make_shared<Opts>();
  auto* c = app.add_subcommand(
      "report",
      "An HTML page of runs (loss and accuracy curves overlaid, throughput, step-time breakdown, "
      "per-rank step times, memory, settings) from their metrics.jsonl; self-contained, offline");
  c->add_option("runs", o->runs, "Run directories (train --output, finetune --output)")->required();
  c->add_option("--output", o->output, "The HTML file (default: report.html in the first run)");
  c->callback([o] {
    std::vector<obs::RunMetrics> runs;
    for (const auto& d : o->runs) runs.push_back(obs::load_run(d));
    const std::string out = o->output.empty()
                                ? (std::filesystem::path(o->runs[0]) / "report.html").string()
                                : o->output;
    write_file_atomic(out, obs::render_report(runs));
    std::printf("report: %s (%zu run%s; open it in a browser, it needs no network)\n", out.c_str(),
                runs.size(), runs.size() == 1 ? "" : "s");
  });
}

}  // namespace bertrain::cli
