#include "obs/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace bertrain::obs {

namespace fs = std::filesystem;

namespace {
// The last "step N" span of rank 0 (pid 0) in a Chrome trace and rank 0's spans inside it.
void load_trace(RunMetrics& r, const fs::path& path) {
  std::ifstream in(path);
  if (!in) return;
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded())
    fail(path.string(), " is not a Chrome trace (JSON); write it with train --timeline");
  const nlohmann::json& ev = j.is_object() ? j.value("traceEvents", nlohmann::json::array()) : j;
  auto span_of = [](const nlohmann::json& e) {
    return e.is_object() && e.value("ph", "") == "X" && e.value("pid", -1) == 0 &&
           e.contains("ts") && e.contains("dur");
  };
  const nlohmann::json* step = nullptr;
  for (const auto& e : ev)
    if (span_of(e) && e.value("cat", "") == "step" &&
        (!step || e["ts"].get<double>() > (*step)["ts"].get<double>()))
      step = &e;
  if (!step) return;
  const double t0 = (*step)["ts"].get<double>(), t1 = t0 + (*step)["dur"].get<double>();
  r.trace_step = step->value("name", "step");
  r.trace_step_ms = (t1 - t0) / 1e3;
  for (const auto& e : ev) {
    if (!span_of(e) || &e == step) continue;
    const double ts = e["ts"].get<double>();
    if (ts < t0 || ts > t1) continue;
    r.trace.push_back({e.value("name", ""), e.value("cat", ""), (ts - t0) / 1e3,
                       e["dur"].get<double>() / 1e3, e.value("tid", int64_t{0})});
  }
}
}  // namespace

RunMetrics load_run(const std::string& dir) {
  RunMetrics r;
  r.dir = dir;
  r.name = fs::path(dir).filename().string();
  if (r.name.empty()) r.name = fs::path(dir).parent_path().filename().string();
  const std::string path = (fs::path(dir) / "metrics.jsonl").string();
  if (!fs::exists(path))
    fail("no metrics.jsonl in ", dir, " (train and finetune write it to their run directory)");
  auto read_rows = [](const fs::path& p) {
    std::vector<nlohmann::json> rows;
    std::ifstream in(p);
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
      if (!row.is_discarded() && row.contains("step")) rows.push_back(row);  // torn: skipped
    }
    std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
      return a["step"].template get<int64_t>() < b["step"].template get<int64_t>();
    });
    return rows;
  };
  for (nlohmann::json& row : read_rows(path))
    (row.contains("event") ? r.events : r.rows).push_back(std::move(row));
  std::stable_sort(r.events.begin(), r.events.end(), [](const auto& a, const auto& b) {
    return a.value("wall_time", 0.0) < b.value("wall_time", 0.0);
  });
  if (r.rows.empty()) fail(path, " has no logged steps yet");
  r.evals = read_rows(fs::path(dir) / "eval.jsonl");
  std::ifstream latest(fs::path(dir) / "latest");
  std::string ck;
  if (latest && std::getline(latest, ck)) {
    std::ifstream st(fs::path(dir) / ck / "trainer_state.json");
    if (st) {
      const nlohmann::json j = nlohmann::json::parse(st, nullptr, false);
      if (!j.is_discarded() && j.contains("settings")) r.settings = j["settings"];
    }
  }
  load_trace(r, fs::path(dir) / "timeline.json");
  return r;
}

namespace {

const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                         "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

struct Series {
  std::string name, color;
  std::vector<double> x, y;
};

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else if (c == '"')
      o += "&quot;";
    else
      o += c;
  }
  return o;
}

std::string num(double v) {
  char b[32];
  const double a = std::abs(v);
  std::snprintf(b, sizeof b, a != 0 && (a < 1e-3 || a >= 1e6) ? "%.2g" : "%.4g", v);
  return b;
}

// Round tick spacing: 1, 2 or 5 times a power of ten, about `n` ticks over [lo, hi].
double tick_step(double lo, double hi, int n) {
  const double raw = (hi - lo) / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * p) return m * p;
  return 10 * p;
}

// A chart frame: axes with ticks over [x0,x1] x [y0,y1]; returns the SVG and the mapping.
struct Frame {
  double x0, x1, y0, y1;
  static constexpr double W = 560, H = 260, L = 62, R = 12, T = 44, B = 36;
  double px(double x) const { return L + (x - x0) / (x1 - x0) * (W - L - R); }
  double py(double y) const { return H - B - (y - y0) / (y1 - y0) * (H - T - B); }
};

std::string frame_svg(const Frame& f, const std::string& title, const std::string& ylabel) {
  std::string s =
      "<svg xmlns='http://www.w3.org/2000/svg' width='560' height='260' "
      "viewBox='0 0 560 260' font-family='sans-serif' font-size='11'>";
  s += "<text x='280' y='16' text-anchor='middle' font-size='13' font-weight='bold'>" + esc(title) +
       "</text>";
  s += "<rect x='62' y='44' width='486' height='180' fill='none' stroke='#999'/>";
  const double ys = tick_step(f.y0, f.y1, 5);
  for (double y = std::ceil(f.y0 / ys) * ys; y <= f.y1 + 1e-9 * ys; y += ys) {
    const double p = f.py(y);
    s += "<line x1='62' x2='548' y1='" + num(p) + "' y2='" + num(p) + "' stroke='#eee'/>";
    s += "<text x='58' y='" + num(p + 4) + "' text-anchor='end'>" + num(y) + "</text>";
  }
  const double xs = tick_step(f.x0, f.x1, 6);
  for (double x = std::ceil(f.x0 / xs) * xs; x <= f.x1 + 1e-9 * xs; x += xs) {
    const double p = f.px(x);
    s += "<text x='" + num(p) + "' y='238' text-anchor='middle'>" + num(x) + "</text>";
  }
  s += "<text x='305' y='256' text-anchor='middle'>step</text>";
  s += "<text x='12' y='134' text-anchor='middle' transform='rotate(-90 12 134)'>" + esc(ylabel) +
       "</text>";
  return s;
}

Frame fit(const std::vector<Series>& all, bool from_zero) {
  Frame f{1e300, -1e300, 1e300, -1e300};
  for (const auto& s : all)
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      f.x0 = std::min(f.x0, s.x[i]);
      f.x1 = std::max(f.x1, s.x[i]);
      f.y0 = std::min(f.y0, s.y[i]);
      f.y1 = std::max(f.y1, s.y[i]);
    }
  if (f.x0 > f.x1) f = {0, 1, 0, 1};
  if (from_zero) f.y0 = std::min(f.y0, 0.0);
  if (f.x1 == f.x0) f.x1 = f.x0 + 1;
  if (f.y1 == f.y0) f.y1 = f.y0 + (f.y0 == 0 ? 1 : std::abs(f.y0) * 0.1);
  const double pad = 0.05 * (f.y1 - f.y0);
  f.y1 += pad;
  if (!from_zero || f.y0 < 0) f.y0 -= pad;
  return f;
}

std::string legend(const std::vector<Series>& all) {
  std::string s;
  double x = 70;
  for (const auto& e : all) {
    s += "<rect x='" + num(x) + "' y='25' width='10' height='10' fill='" + e.color + "'/>";
    s += "<text x='" + num(x + 14) + "' y='34'>" + esc(e.name) + "</text>";
    x += 24 + 6.5 * static_cast<double>(e.name.size());
  }
  return s;
}

// A step marked on a chart: a dashed line, its label above the frame, the text as its tooltip.
struct Mark {
  double step;
  std::string label, text;
};

std::string line_chart(const std::string& title, const std::string& ylabel,
                       const std::vector<Series>& all, bool from_zero = false,
                       const std::vector<Mark>& marks = {}) {
  if (all.empty()) return "";
  const Frame f = fit(all, from_zero);
  std::string s = frame_svg(f, title, ylabel);
  for (const Mark& m : marks) {
    if (m.step < f.x0 || m.step > f.x1) continue;
    const std::string x = num(f.px(m.step));
    s += "<g><title>" + esc(m.text) + "</title><line x1='" + x + "' x2='" + x + "' y1='" +
         num(Frame::T) + "' y2='" + num(Frame::H - Frame::B) +
         "' stroke='#555' stroke-dasharray='4 3'/><text x='" + x + "' y='" + num(Frame::T - 3) +
         "' text-anchor='middle' font-size='10' fill='#555'>" + esc(m.label) + "</text></g>";
  }
  for (const auto& e : all) {
    std::string pts;
    for (size_t i = 0; i < e.x.size(); ++i)
      if (std::isfinite(e.y[i])) pts += num(f.px(e.x[i])) + "," + num(f.py(e.y[i])) + " ";
    s += "<polyline fill='none' stroke-width='1.8' stroke='" + e.color + "' points='" + pts + "'/>";
    if (e.x.size() <= 40)
      for (size_t i = 0; i < e.x.size(); ++i)
        if (std::isfinite(e.y[i]))
          s += "<circle r='2.5' fill='" + e.color + "' cx='" + num(f.px(e.x[i])) + "' cy='" +
               num(f.py(e.y[i])) + "'/>";
  }
  return s + legend(all) + "</svg>";
}

// Layers stacked from the bottom: each band is the sum of the layers below plus its own.
std::string stacked_chart(const std::string& title, const std::string& ylabel,
                          const std::vector<Series>& layers) {
  if (layers.empty() || layers[0].x.empty()) return "";
  std::vector<Series> tops = layers;
  for (size_t l = 1; l < tops.size(); ++l)
    for (size_t i = 0; i < tops[l].y.size(); ++i) tops[l].y[i] += tops[l - 1].y[i];
  const Frame f = fit({tops.back()}, true);
  std::string s = frame_svg(f, title, ylabel);
  for (size_t l = tops.size(); l-- > 0;) {
    std::string pts = num(f.px(tops[l].x.front())) + "," + num(f.py(0)) + " ";
    for (size_t i = 0; i < tops[l].x.size(); ++i)
      pts += num(f.px(tops[l].x[i])) + "," + num(f.py(tops[l].y[i])) + " ";
    pts += num(f.px(tops[l].x.back())) + "," + num(f.py(0));
    s += "<polygon fill-opacity='0.85' fill='" + tops[l].color + "' points='" + pts + "'/>";
  }
  return s + legend(layers) + "</svg>";
}

Series series(const RunMetrics& r, const std::string& key, const std::string& name,
              const std::string& color, double scale = 1.0) {
  Series s{name, color, {}, {}};
  for (const auto& row : key.rfind("eval/", 0) == 0 ? r.evals : r.rows) {
    if (!row.contains(key) || !row[key].is_number()) continue;
    s.x.push_back(row["step"].get<double>());
    s.y.push_back(row[key].get<double>() * scale);
  }
  return s;
}

// One series per run for `key` (runs without it are left out).
std::vector<Series> per_run(const std::vector<RunMetrics>& runs, const std::string& key) {
  std::vector<Series> out;
  for (size_t i = 0; i < runs.size(); ++i) {
    Series s = series(runs[i], key, runs[i].name, kColors[i % 10]);
    if (!s.x.empty()) out.push_back(std::move(s));
  }
  return out;
}

// One step of rank 0 from the timeline: a lane per thread (the training thread; the reducer's
// allreduce buckets), spans drawn longest first so a layer sits on its forward/backward, each
// with its name and duration as a tooltip; below, how much of the allreduce ran during
// backward and how long the step waited for it.
std::string trace_chart(const RunMetrics& r) {
  if (r.trace.empty()) return "";
  const double W = 1140, L = 150, R = 16, T = 44, lane_h = 30, B = 58;
  int64_t lanes = 1;
  for (const auto& sp : r.trace) lanes = std::max(lanes, sp.thread + 1);
  const double H = T + lanes * (lane_h + 8) + B, span = std::max(r.trace_step_ms, 1e-3);
  auto px = [&](double ms) { return L + ms / span * (W - L - R); };
  std::string s = "<svg xmlns='http://www.w3.org/2000/svg' width='" + num(W) + "' height='" +
                  num(H) + "' style='background:#fff;border:1px solid #ddd'>";
  s += "<text x='" + num(L) + "' y='20' font-size='14' font-weight='bold'>" +
       esc("one step on rank 0 (" + r.trace_step + ", " + num(r.trace_step_ms) + " ms), " + r.name +
           ": compute and communication from the timeline") +
       "</text>";
  for (int64_t l = 0; l < lanes; ++l)
    s += "<text x='8' y='" + num(T + l * (lane_h + 8) + lane_h * 0.65) + "' font-size='12'>" +
         (l == 0 ? std::string("training thread") : std::string("reducer thread")) + "</text>";
  auto color = [](const TraceSpan& sp) -> std::string {
    if (sp.cat == "input") return "#ff7f0e";
    if (sp.cat == "communication") return "#d62728";
    if (sp.cat == "optimizer") return "#9467bd";
    if (sp.name.rfind("backward", 0) == 0) return "#2ca02c";
    if (sp.name.rfind("forward", 0) == 0) return "#1f77b4";
    return "#7f7f7f";
  };
  std::vector<TraceSpan> order = r.trace;
  std::stable_sort(order.begin(), order.end(),
                   [](const TraceSpan& a, const TraceSpan& b) { return a.dur_ms > b.dur_ms; });
  for (const auto& sp : order) {
    const bool parent = sp.name == "forward" || sp.name == "backward";
    const double y = T + sp.thread * (lane_h + 8) + (parent ? 0 : 3);
    s += "<rect x='" + num(px(sp.start_ms)) + "' y='" + num(y) + "' width='" +
         num(std::max(px(sp.start_ms + sp.dur_ms) - px(sp.start_ms), 0.8)) + "' height='" +
         num(parent ? lane_h : lane_h - 6) + "' fill='" + color(sp) + "' fill-opacity='" +
         (parent ? "0.35" : "0.9") + "' stroke='#fff' stroke-width='0.5'><title>" +
         esc(sp.name + ": " + num(sp.dur_ms) + " ms at " + num(sp.start_ms) + " ms") +
         "</title></rect>";
  }
  const double axis = T + lanes * (lane_h + 8) + 4, tick = tick_step(0, span, 8);
  for (double t = 0; t <= span + 1e-9; t += tick)
    s += "<line x1='" + num(px(t)) + "' x2='" + num(px(t)) + "' y1='" + num(axis) + "' y2='" +
         num(axis + 4) + "' stroke='#333'/><text x='" + num(px(t)) + "' y='" + num(axis + 16) +
         "' font-size='10' text-anchor='middle'>" + num(t) + "</text>";
  const TraceOverlap o = trace_overlap(r);
  s += "<text x='" + num(L) + "' y='" + num(axis + 34) + "' font-size='12'>" +
       esc("ms from the step's start. Allreduce buckets " + num(o.comm) + " ms, " + num(o.hidden) +
           " ms of it during backward (hidden); the step waited " + num(o.exposed) +
           " ms for the sum (exposed).") +
       "</text><text x='" + num(L) + "' y='" + num(axis + 50) + "' font-size='11' fill='#555'>" +
       "blue forward, green backward (pale: outside the layers), red communication, purple "
       "optimizer, orange input wait</text>";
  return s + "</svg>";
}

}  // namespace

TraceOverlap trace_overlap(const RunMetrics& r) {
  TraceOverlap o;
  for (const auto& sp : r.trace) {
    if (sp.thread == 0 && sp.cat == "communication") o.exposed += sp.dur_ms;
    if (sp.thread == 0 || sp.cat != "communication") continue;
    o.comm += sp.dur_ms;
    for (const auto& b : r.trace)
      if (b.thread == 0 && b.name == "backward")
        o.hidden += std::max(0.0, std::min(sp.start_ms + sp.dur_ms, b.start_ms + b.dur_ms) -
                                      std::max(sp.start_ms, b.start_ms));
  }
  return o;
}

std::string render_report(const std::vector<RunMetrics>& runs) {
  std::string h =
      "<!DOCTYPE html><html><head><meta charset='utf-8'><title>bertrain report</title><style>"
      "body{font-family:sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;"
      "margin-top:28px}.grid{display:flex;flex-wrap:wrap;gap:12px}table{border-collapse:collapse;"
      "font-size:12px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
      "</style></head><body><h1>bertrain report</h1><p>";
  for (const auto& r : runs)
    h += "<b>" + esc(r.name) + "</b>: " + esc(r.dir) + ", " + std::to_string(r.rows.size()) +
         " logged steps (" + std::to_string(r.rows.front()["step"].get<int64_t>()) + ".." +
         std::to_string(r.rows.back()["step"].get<int64_t>()) + ")<br>";
  // Elastic restarts and growths, on the loss and world-size curves.
  std::vector<Mark> marks;
  for (const auto& r : runs)
    for (const auto& e : r.events) {
      const std::string kind = e.value("event", "");
      marks.push_back(
          {e.value("step", 0.0), kind == "grow" ? "grow" : "restart",
           str(runs.size() > 1 ? r.name + ": " : "", kind, " ", e.value("count", ""), " at step ",
               e.value("step", int64_t{0}), " on ", e.value("world_size", 0), " ranks (was ",
               e.value("from_world_size", 0), "): ", e.value("reason", ""), "; ",
               num(e.value("lost_s", 0.0)), " s to the first step after, ",
               e.value("recomputed_steps", int64_t{0}), " steps done again")});
    }
  h += "</p>";
  if (!marks.empty()) {
    h += "<h2>Elastic restarts</h2><table><tr><th>what</th></tr>";
    for (const Mark& m : marks) h += "<tr><td>" + esc(m.text) + "</td></tr>";
    h += "</table>";
  }
  h += "<h2>Training</h2><div class='grid'>";
  h += line_chart("loss", "nats", per_run(runs, "train/loss"), false, marks);
  if (!marks.empty())
    h += line_chart("world size", "ranks", per_run(runs, "cluster/world_size"), true, marks);
  h += line_chart("masked LM accuracy", "accuracy", per_run(runs, "train/mlm_accuracy"), true);
  h += line_chart("next sentence accuracy", "accuracy", per_run(runs, "train/nsp_accuracy"), true);
  h += line_chart("fine-tuning dev accuracy", "accuracy", per_run(runs, "finetune/dev_accuracy"),
                  true);
  h += line_chart("fine-tuning dev Pearson (regression)", "Pearson r",
                  per_run(runs, "finetune/dev_pearson"), true);
  h += line_chart("fine-tuning dev entity F1 (tagging)", "F1", per_run(runs, "finetune/dev_f1"),
                  true);
  h += line_chart("fine-tuning dev F1 (question answering)", "F1 %",
                  per_run(runs, "finetune/dev_qa_f1"), true);
  h += line_chart("fine-tuning train loss", "loss", per_run(runs, "finetune/train_loss"));
  h += line_chart("eval masked LM accuracy", "accuracy", per_run(runs, "eval/mlm_accuracy"), true);
  h += line_chart("learning rate", "lr", per_run(runs, "train/learning_rate"), true);
  h += line_chart("loss scale (fp16)", "scale", per_run(runs, "train/loss_scale"), true);
  h += "</div><h2>Speed</h2><div class='grid'>";
  h += line_chart("throughput", "real tokens/s", per_run(runs, "throughput/tokens_per_s"), true);
  for (const auto& r : runs) {
    const std::vector<Series> layers = {
        series(r, "time/input_wait_ms", "input wait", "#ff7f0e"),
        series(r, "time/forward_ms", "forward", "#1f77b4"),
        series(r, "time/backward_ms", "backward", "#2ca02c"),
        series(r, "time/communication_exposed_ms", "communication (exposed)", "#d62728"),
        series(r, "time/optimizer_ms", "optimizer", "#9467bd")};
    bool complete = true;
    for (const auto& l : layers) complete = complete && l.x.size() == layers[0].x.size();
    if (complete) h += stacked_chart("step time, " + r.name, "ms per step", layers);
    // Every rank's mean step time per logged window: a straggler stands out.
    std::vector<Series> ranks;
    for (const auto& row : r.rows) {
      if (!row.contains("rank_step_ms")) continue;
      const auto& v = row["rank_step_ms"];
      for (size_t k = 0; k < v.size(); ++k) {
        if (ranks.size() <= k)
          ranks.push_back({"rank " + std::to_string(k), kColors[k % 10], {}, {}});
        ranks[k].x.push_back(row["step"].get<double>());
        ranks[k].y.push_back(v[k].get<double>());
      }
    }
    if (!ranks.empty()) h += line_chart("step time per rank, " + r.name, "ms", ranks, true);
    // The allreduce behind backward (hidden) and what the step still waited for (exposed).
    const Series hidden =
        series(r, "time/communication_hidden_ms", "hidden behind backward", "#2ca02c");
    const Series exposed = series(r, "time/communication_exposed_ms", "exposed", "#d62728");
    bool any = false;
    for (double v : hidden.y) any = any || v > 0;
    if (any) h += stacked_chart("communication, " + r.name, "ms per step", {hidden, exposed});
  }
  for (const auto& r : runs) h += trace_chart(r);
  h += "</div><h2>Memory</h2><div class='grid'>";
  std::vector<Series> mem;
  for (size_t i = 0; i < runs.size(); ++i) {
    Series p = series(runs[i], "memory/peak_rss_mib", runs[i].name + " peak RSS", kColors[i % 10]);
    Series q = series(runs[i], "memory/plan_mib", runs[i].name + " plan", kColors[(i + 5) % 10]);
    if (!p.x.empty()) mem.push_back(std::move(p));
    if (!q.x.empty()) mem.push_back(std::move(q));
  }
  h += line_chart("memory per rank", "MiB", mem, true);
  h += "</div><h2>Settings</h2><table><tr><th>setting</th>";
  for (const auto& r : runs) h += "<th>" + esc(r.name) + "</th>";
  h += "</tr>";
  std::vector<std::string> keys;
  for (const auto& r : runs)
    if (r.settings.is_object())
      for (const auto& [k, _] : r.settings.items())
        if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  for (const auto& k : keys) {
    h += "<tr><td>" + esc(k) + "</td>";
    for (const auto& r : runs)
      h += "<td>" +
           (r.settings.is_object() && r.settings.contains(k) ? esc(r.settings[k].dump())
                                                             : std::string()) +
           "</td>";
    h += "</tr>";
  }
  h += "</table></body></html>\n";
  return h;
}

}  // namespace bertrain::obs
