#include "train/run_mirror.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "data/object_store.h"
#include "data/sigv4.h"
#include "train/run_state.h"

namespace bertrain::train {

namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read ", path, " to upload it");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

data::ObjectStore& store_of(const std::string& url) {
  return data::ObjectStore::of(data::parse_object_url(url).scheme);
}

void put(const std::string& url, std::string body) {
  store_of(url).put(data::parse_object_url(url), std::move(body));
}

bool is_log(const std::string& name) {
  return name == "metrics.jsonl" || name == "incidents.log" ||
         name.rfind("events.out.tfevents.", 0) == 0;
}

}  // namespace

RunMirror::RunMirror(const std::string& url, const std::string& stage) : url_(url), stage_(stage) {
  while (url_.size() > 1 && url_.back() == '/') url_.pop_back();
  const data::ObjectUrl u = data::parse_object_url(url_);
  if (u.key.empty())
    fail("--output ", url, ": name a prefix in the bucket for the run (", u.scheme, "://", u.bucket,
         "/runs/my-run), not the bucket alone");
  fs::create_directories(stage_);
}

std::string RunMirror::object(const std::string& name) const {
  return url_ + "/" + name;
}

namespace {

// The files of `dir` under url/name/, each whole (one PUT: nothing of it is visible before it
// is complete); returns them with their sizes and digests.
std::vector<nlohmann::ordered_json> upload_files(const std::string& url, const std::string& dir,
                                                 const std::string& name) {
  std::vector<fs::path> paths;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  std::vector<nlohmann::ordered_json> files;
  for (const fs::path& p : paths) {
    std::string body = slurp(p.string());
    files.push_back({{"name", p.filename().string()},
                     {"size", body.size()},
                     {"sha256", data::sha256_hex(body)}});
    put(url + "/" + name + "/" + p.filename().string(), std::move(body));
  }
  return files;
}

}  // namespace

void RunMirror::publish_checkpoint(const std::string& dir, int keep, const HostParts& parts) {
  const std::string name = fs::path(dir).filename().string();
  // The files first, this host's and the other hosts' ...
  std::vector<nlohmann::ordered_json> all = upload_files(url_, dir, name);
  std::vector<std::string> manifests;
  for (const nlohmann::ordered_json& f : wait_for_parts(name, parts, manifests)) all.push_back(f);
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return a.at("name").template get<std::string>() < b.at("name").template get<std::string>();
  });
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  for (auto& f : all) files.push_back(std::move(f));
  // ... then the commit object that makes them a checkpoint, then `latest`.
  const nlohmann::ordered_json commit = {{"checkpoint", name}, {"files", files}};
  put(object(name + "/COMMIT"), commit.dump(1) + "\n");
  put(object("latest"), name + "\n");
  // (the manifests served: the commit names the hosts' files)
  const data::ObjectUrl base = data::parse_object_url(url_);
  for (const std::string& key : manifests) store_of(url_).remove({base.scheme, base.bucket, key});
  prune(name, keep);
}

void RunMirror::publish_shards(const std::string& dir, const std::string& name,
                               const std::string& attempt, int first_rank) {
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  for (auto& f : upload_files(url_, dir, name)) files.push_back(std::move(f));
  char manifest[32];
  std::snprintf(manifest, sizeof manifest, "PARTS-rank-%05d", first_rank);
  const nlohmann::ordered_json j = {{"attempt", attempt}, {"files", files}};
  put(object(name + "/" + manifest), j.dump(1) + "\n");
}

std::vector<nlohmann::ordered_json> RunMirror::wait_for_parts(const std::string& name,
                                                              const HostParts& parts,
                                                              std::vector<std::string>& manifests) {
  std::vector<nlohmann::ordered_json> files;
  if (parts.hosts <= 0) return files;
  const data::ObjectUrl base = data::parse_object_url(url_);
  data::ObjectStore& store = data::ObjectStore::of(base.scheme);
  const std::string prefix = base.key + "/" + name + "/PARTS-";
  std::map<std::string, bool> read;  // manifest key -> ours
  const auto start = Clock::now();
  for (int ours = 0;;) {
    for (const data::ObjectInfo& o : store.list(base.bucket, prefix)) {
      if (read.count(o.key)) continue;
      manifests.push_back(o.key);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(store.read({base.scheme, base.bucket, o.key}));
      } catch (const nlohmann::json::exception& e) {
        fail(url_, "/", o.key.substr(base.key.size() + 1), " is not a shard manifest (", e.what(),
             ")");
      }
      read[o.key] = j.value("attempt", "") == parts.attempt;
      if (!read[o.key]) continue;  // an earlier job's, at the same step
      ++ours;
      for (const auto& f : j.at("files"))
        files.push_back(
            {{"name", f.at("name")}, {"size", f.at("size")}, {"sha256", f.at("sha256")}});
    }
    if (ours >= parts.hosts) return files;
    if (seconds_since(start) > parts.timeout_s)
      fail("the shards of ", parts.hosts - ours, " of the other ", parts.hosts, " hosts of ", name,
           " did not reach ", url_, "/", name, "/ within ", static_cast<int>(parts.timeout_s),
           " s (each host's first rank uploads its ranks' shards, then PARTS-rank-R): the "
           "checkpoint is not committed; is a host unable to reach the store?");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

void RunMirror::publish_model(const std::vector<std::string>& names) {
  const data::ObjectUrl commit_url = data::parse_object_url(object("COMMIT"));
  store_of(url_).remove(commit_url);
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  for (const std::string& name : names) {
    std::string body = slurp((fs::path(stage_) / name).string());
    files.push_back({{"name", name}, {"size", body.size()}, {"sha256", data::sha256_hex(body)}});
    put(object(name), std::move(body));
  }
  const nlohmann::ordered_json commit = {{"model", url_}, {"files", files}};
  put(object("COMMIT"), commit.dump(1) + "\n");
}

// Deletes the committed checkpoints older than the newest `keep` (COMMIT first: a checkpoint
// half deleted is invisible), and the objects of older checkpoints that were never committed
// (an upload cut by a crash or an outage: invisible, but bytes in the bucket).
void RunMirror::prune(const std::string& newest, int keep) {
  const data::ObjectUrl base = data::parse_object_url(url_);
  data::ObjectStore& store = data::ObjectStore::of(base.scheme);
  std::map<std::string, std::vector<std::string>> objects;  // checkpoint -> its keys
  std::vector<std::string> commits;
  for (const data::ObjectInfo& o : store.list(base.bucket, base.key + "/checkpoint-")) {
    const std::string rest = o.key.substr(base.key.size() + 1);  // checkpoint-N/file
    const size_t slash = rest.find('/');
    if (slash == std::string::npos) continue;
    const std::string ck = rest.substr(0, slash);
    if (rest.substr(slash + 1) == "COMMIT")
      commits.push_back(ck);
    else
      objects[ck].push_back(o.key);
  }
  std::sort(commits.begin(), commits.end());
  std::vector<std::string> drop;
  for (size_t i = 0; keep > 0 && i + keep < commits.size(); ++i) drop.push_back(commits[i]);
  for (const auto& [ck, keys] : objects)
    if (ck < newest && !std::binary_search(commits.begin(), commits.end(), ck)) drop.push_back(ck);
  for (const std::string& ck : drop) {
    if (std::binary_search(commits.begin(), commits.end(), ck))
      store.remove(data::parse_object_url(object(ck + "/COMMIT")));
    for (const std::string& key : objects[ck]) store.remove({base.scheme, base.bucket, key});
  }
}

void RunMirror::sync_logs(bool force, double min_interval_s) {
  if (!force && synced_ && seconds_since(last_sync_) < min_interval_s) return;
  synced_ = true;
  last_sync_ = Clock::now();
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(stage_, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || !is_log(name)) continue;
    const uint64_t size = e.file_size(ec);
    if (ec || uploaded_sizes_[name] == size) continue;
    // (S3 has no append: the whole file again; logs are small beside checkpoints)
    put(object(name), slurp(e.path().string()));
    uploaded_sizes_[name] = size;
  }
}

std::string RunMirror::fetch_latest() {
  const data::ObjectUrl latest = data::parse_object_url(object("latest"));
  data::ObjectStore& store = data::ObjectStore::of(latest.scheme);
  const data::ObjectUrl base = data::parse_object_url(url_);
  bool any = false;
  for (const data::ObjectInfo& o : store.list(base.bucket, base.key + "/latest"))
    any |= o.key == latest.key;
  if (!any) return "";
  std::string name = store.read(latest);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  nlohmann::json commit;
  try {
    commit = nlohmann::json::parse(store.read(data::parse_object_url(object(name + "/COMMIT"))));
  } catch (const nlohmann::json::exception& e) {
    fail(object(name + "/COMMIT"), " is not a commit object (", e.what(),
         "): the bucket's run was not written by bertrain, or was changed by hand");
  }
  const fs::path dir = fs::path(stage_) / name;
  // A stage that holds this commit already (another host on a shared stage fetched it, or this
  // host staged it) keeps it; checked file by file, size and digest.
  auto holds_commit = [&](const fs::path& d) {
    for (const auto& f : commit.at("files")) {
      std::error_code ec;
      const fs::path p = d / f.at("name").get<std::string>();
      if (fs::file_size(p, ec) != f.at("size").get<uint64_t>() || ec) return false;
      std::ifstream in(p, std::ios::binary);
      const std::string body((std::istreambuf_iterator<char>(in)), {});
      if (data::sha256_hex(body) != f.at("sha256").get<std::string>()) return false;
    }
    return true;
  };
  if (!holds_commit(dir)) {
    // (one temporary directory per process: hosts that share a stage fetch side by side)
    const fs::path tmp = fs::path(stage_) / str(".", name, ".fetch-", ::getpid());
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    for (const auto& f : commit.at("files")) {
      const std::string file = f.at("name");
      const std::string body = store.read(data::parse_object_url(object(name + "/" + file)));
      if (body.size() != f.at("size").get<uint64_t>() ||
          data::sha256_hex(body) != f.at("sha256").get<std::string>())
        fail(object(name + "/" + file), " is not the file its COMMIT names (", body.size(),
             " bytes, ", f.at("size").get<uint64_t>(), " committed; or another SHA-256): ",
             "the checkpoint was changed after it was committed; resume from an older one");
      std::ofstream out(tmp / file, std::ios::binary);
      out.write(body.data(), static_cast<std::streamsize>(body.size()));
      if (!out) fail("cannot write ", (tmp / file).string(), " (the staging directory's disk?)");
    }
    // Into place. A directory there that holds the commit is another host's copy (a shared
    // stage), kept: removing it could pull it from under that host's ranks. One that does not
    // (an older or partial one) is moved aside first, by one process only (rename).
    std::error_code ec;
    fs::rename(tmp, dir, ec);
    if (ec && !holds_commit(dir)) {
      const fs::path aside = fs::path(stage_) / str(".", name, ".stale-", ::getpid());
      std::error_code ignored;
      fs::rename(dir, aside, ignored);
      fs::remove_all(aside, ignored);
      fs::rename(tmp, dir, ec);
    }
    if (ec) {
      std::error_code ignored;
      fs::remove_all(tmp, ignored);
      if (!holds_commit(dir))
        fail("cannot move the fetched ", name, " into ", dir.string(), ": ", ec.message());
    }
  }
  std::ofstream(fs::path(stage_) / "latest") << name << "\n";
  // The run's logs as the bucket has them, where this stage has less (another host, or a fresh
  // stage): they grow on from there instead of replacing the bucket's with the new part alone.
  for (const data::ObjectInfo& o : store.list(base.bucket, base.key + "/")) {
    const std::string file = o.key.substr(base.key.size() + 1);
    if (file.find('/') != std::string::npos || !is_log(file)) continue;
    std::error_code ec;
    const fs::path local = fs::path(stage_) / file;
    const uint64_t have = fs::exists(local, ec) ? fs::file_size(local, ec) : 0;
    if (have >= o.size) continue;
    const std::string body = store.read(data::parse_object_url(object(file)));
    std::ofstream out(local, std::ios::binary | std::ios::trunc);
    out.write(body.data(), static_cast<std::streamsize>(body.size()));
    if (!out) fail("cannot write ", local.string(), " (the staging directory's disk?)");
    uploaded_sizes_[file] = body.size();
  }
  return dir.string();
}

namespace {

std::string utc(double t) {
  const std::time_t s = static_cast<std::time_t>(t);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&s));
  return buf;
}

}  // namespace

RunLease::RunLease(const std::string& url, double ttl_s) : ttl_s_(ttl_s) {
  std::string base = url;
  while (!base.empty() && base.back() == '/') base.pop_back();
  url_ = base + "/bertrain.lock";
  holder_ = job_holder();
  if (const char* job = std::getenv("BERTRAIN_ELASTIC_JOB")) job_ = job;
  std::random_device rd;
  nonce_ = data::sha256_hex(str(holder_, rd(), rd(), rd())).substr(0, 16);
  const data::ObjectUrl u = data::parse_object_url(url_);
  data::ObjectStore& store = data::ObjectStore::of(u.scheme);
  std::string current;
  for (int attempt = 0; attempt < 3 && etag_.empty(); ++attempt) {
    if (store.put_if(u, body(unix_seconds() + ttl_s_), true, "", &etag_)) break;
    // Held, or ours already (a PUT that succeeded but whose reply was lost, then retried).
    bool exists = false;
    for (const data::ObjectInfo& o : store.list(u.bucket, u.key)) exists |= o.key == u.key;
    if (!exists) continue;  // released meanwhile: try again
    const data::ObjectInfo info = store.head(u);
    current = store.read(u);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(current);
    } catch (const nlohmann::json::exception&) {
      fail(url_, " is not a bertrain lease (", current.substr(0, 80),
           "): remove it if no job uses the run");
    }
    if (j.value("nonce", "") == nonce_) {
      etag_ = info.etag;
      break;
    }
    const double expires = j.value("expires", 0.0);
    const std::string who = j.value("holder", std::string("?"));
    // An earlier attempt of the same elastic job (launch/elastic.h names every attempt's job
    // alike): the supervisor ended it before starting this one, so its lease passes at once
    // (were it still running somewhere, cut off, its next renewal finds the lease taken and it
    // stops).
    if (!job_.empty() && j.value("job", std::string()) == job_ &&
        store.put_if(u, body(unix_seconds() + ttl_s_), false, info.etag, &etag_)) {
      note_ =
          str("took over ", url_, " from an earlier attempt of elastic job ", job_, " (", who, ")");
      break;
    }
    if (expires > unix_seconds())
      fail(base, " is in use by another job (", who, "; its lease runs to ", utc(expires),
           " and is renewed while it runs): one job per run. Use another --output, or stop that "
           "job first (its lease, ",
           url_, ", goes when it ends, or ", static_cast<int>(ttl_s_),
           " s after it stops renewing)");
    // Expired: its holder is gone. Taken over that version, so only one job can.
    if (store.put_if(u, body(unix_seconds() + ttl_s_), false, info.etag, &etag_)) {
      note_ = str("took over ", url_, " from a job that is gone (", who, "; its lease expired ",
                  utc(expires), ")");
      break;
    }
  }
  if (etag_.empty())
    fail("cannot take the lease ", url_, ": other jobs took and released it 3 times meanwhile");
  renewer_ = std::thread([this] { renew_loop(); });
}

std::string RunLease::body(double expires) const {
  nlohmann::json j = {{"holder", holder_}, {"nonce", nonce_}, {"expires", expires}};
  if (!job_.empty()) j["job"] = job_;
  return j.dump() + "\n";
}

void RunLease::renew_loop() {
  const data::ObjectUrl u = data::parse_object_url(url_);
  data::ObjectStore& store = data::ObjectStore::of(u.scheme);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::duration<double>(ttl_s_ / 3), [&] { return stop_; })) {
    const std::string etag = etag_;
    lock.unlock();
    std::string next;
    bool renewed = false, taken = false;
    try {
      renewed = store.put_if(u, body(unix_seconds() + ttl_s_), false, etag, &next);
      taken = !renewed;
    } catch (const std::exception&) {
      // The store is unreachable: tried again at the next renewal (the lease holds for ttl_s).
    }
    lock.lock();
    if (renewed) etag_ = next;
    if (taken) {
      std::string who = "?";
      try {
        who = nlohmann::json::parse(store.read(u)).value("holder", who);
      } catch (const std::exception&) {
      }
      lost_to_ = who;
      lost_ = true;
      return;
    }
  }
}

void RunLease::check() const {
  if (!lost_) return;
  std::lock_guard<std::mutex> lock(mu_);
  fail(url_, " was taken over by another job (", lost_to_,
       ") after this one could not renew it for ", static_cast<int>(ttl_s_),
       " s: stopping, so that two jobs do not write one run. The bucket's latest commit stands");
}

RunLease::~RunLease() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (renewer_.joinable()) renewer_.join();
  if (lost_) return;
  try {  // (only ours: a lease another job took stays)
    const data::ObjectUrl u = data::parse_object_url(url_);
    data::ObjectStore& store = data::ObjectStore::of(u.scheme);
    if (nlohmann::json::parse(store.read(u)).value("nonce", "") == nonce_) store.remove(u);
  } catch (const std::exception&) {
    // Unreachable now: the lease expires by itself.
  }
}

std::string default_stage_dir(const std::string& url) {
  const data::ObjectUrl u = data::parse_object_url(url);
  const char* tmp = std::getenv("TMPDIR");
  fs::path p = fs::path(tmp && *tmp ? tmp : "/tmp") / "bertrain-stage" / u.scheme / u.bucket;
  std::string key = u.key;
  while (!key.empty() && key.back() == '/') key.pop_back();
  return (p / key).string();
}

}  // namespace bertrain::train
