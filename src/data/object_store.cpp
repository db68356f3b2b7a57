#include "data/object_store.h"

#include <curl/curl.h>
#include <pugixml.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "core/error.h"
#include "core/setting.h"
#include "data/sigv4.h"

namespace bertrain::data {

namespace {

using Clock = std::chrono::steady_clock;

std::mutex g_overrides_mu;
ObjectStoreOverrides g_overrides;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}
std::string first_env(std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (!env(n).empty()) return env(n);
  return "";
}

const std::string kEmptySha256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

struct Config {
  std::string scheme;
  std::string proto = "https", host;  // the endpoint: proto://host[:port]
  std::string region;
  bool virtual_host = true;
  SigV4Key key;
  std::string token;
  int max_attempts = 8;
  double timeout_s = 30, backoff_base_s = 0.1, backoff_cap_s = 8;
  bool signed_requests() const { return !key.access_key.empty(); }
  std::string endpoint() const { return proto + "://" + host; }
  std::string credentials_hint() const {
    return scheme == "oss" ? "OSS_ACCESS_KEY_ID and OSS_ACCESS_KEY_SECRET (or AWS_*)"
                           : "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY";
  }
};

// One [section] of an AWS INI file (~/.aws/credentials: [name]; ~/.aws/config: [profile name]
// or [default]) as key -> value; empty when the file or the section is missing.
std::map<std::string, std::string> ini_section(const std::string& path, const std::string& name) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  std::string line;
  bool inside = false;
  auto trim = [](std::string v) {
    const size_t a = v.find_first_not_of(" \t\r"), b = v.find_last_not_of(" \t\r");
    return a == std::string::npos ? std::string() : v.substr(a, b - a + 1);
  };
  while (std::getline(in, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      inside = trim(line.substr(1, line.size() - 2)) == name;
      continue;
    }
    const size_t eq = line.find('=');
    if (inside && eq != std::string::npos)
      out[trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  return out;
}

std::string home_file(const char* env_name, const char* rel) {
  if (!env(env_name).empty()) return env(env_name);
  return env("HOME").empty() ? "" : env("HOME") + "/" + rel;
}

bool is_ip_or_localhost(const std::string& host) {
  const std::string h = host.substr(
      0, host.rfind(':') == std::string::npos || host[0] == '[' ? host.size() : host.rfind(':'));
  if (h == "localhost" || (!h.empty() && h[0] == '[')) return true;
  return !h.empty() && h.find_first_not_of("0123456789.") == std::string::npos;
}

Config make_config(const std::string& scheme) {
  ObjectStoreOverrides o;
  {
    std::lock_guard<std::mutex> lock(g_overrides_mu);
    o = g_overrides;
  }
  Config c;
  c.scheme = scheme;
  const bool oss = scheme == "oss";
  std::string endpoint = o.endpoint;
  if (endpoint.empty())
    endpoint = oss ? env("OSS_ENDPOINT") : first_env({"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"});
  // s3://: the shared files of the AWS CLI and SDKs when the variables are unset (AWS_PROFILE,
  // else "default"; AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE).
  const std::string profile = env("AWS_PROFILE").empty() ? "default" : env("AWS_PROFILE");
  const auto profile_config =
      oss ? std::map<std::string, std::string>{}
          : ini_section(home_file("AWS_CONFIG_FILE", ".aws/config"),
                        profile == "default" ? profile : "profile " + profile);
  auto config_value = [&](const char* key) {
    auto it = profile_config.find(key);
    return it == profile_config.end() ? std::string() : it->second;
  };
  c.region = !o.region.empty() ? o.region
             : oss             ? env("OSS_REGION")
                               : first_env({"AWS_REGION", "AWS_DEFAULT_REGION"});
  if (c.region.empty()) c.region = config_value("region");
  if (endpoint.empty() && !oss) endpoint = config_value("endpoint_url");
  if (oss && endpoint.empty())
    fail(
        "oss:// paths need the OSS endpoint: set OSS_ENDPOINT (e.g. oss-cn-hangzhou.aliyuncs.com) "
        "or ",
        setting("s3_endpoint"));
  const bool custom = !endpoint.empty();
  if (!custom) {
    if (c.region.empty()) c.region = "us-east-1";
    endpoint = "https://s3." + c.region + ".amazonaws.com";
  }
  if (endpoint.find("://") == std::string::npos) endpoint = "https://" + endpoint;
  c.proto = endpoint.substr(0, endpoint.find("://"));
  if (c.proto != "http" && c.proto != "https")
    fail("object store endpoint '", endpoint, "' must be http:// or https://");
  c.host = endpoint.substr(endpoint.find("://") + 3);
  c.host = c.host.substr(0, c.host.find('/'));
  if (c.host.empty()) fail("object store endpoint '", endpoint, "' names no host");
  // curl leaves a scheme's default port out of the Host header, so the signature must too.
  const std::string default_port = c.proto == "https" ? ":443" : ":80";
  if (c.host.ends_with(default_port)) c.host.resize(c.host.size() - default_port.size());
  if (c.region.empty()) {
    // OSS: oss-cn-hangzhou.aliyuncs.com signs as region oss-cn-hangzhou.
    c.region = oss && c.host.starts_with("oss-") ? c.host.substr(0, c.host.find('.')) : "us-east-1";
  }
  const std::string addressing = o.addressing.empty() ? "auto" : o.addressing;
  if (addressing == "path")
    c.virtual_host = false;
  else if (addressing == "virtual")
    c.virtual_host = true;
  else if (addressing == "auto")
    // AWS and OSS address buckets as hosts (OSS requires it); other S3-compatible servers
    // (MinIO, Ceph, a test server on an address) by path, as boto3 does with an endpoint URL.
    c.virtual_host = !custom || (oss && !is_ip_or_localhost(c.host));
  else
    fail(setting("s3_addressing"), " must be auto, path or virtual, got '", addressing, "'");
  c.key.access_key =
      oss ? first_env({"OSS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"}) : env("AWS_ACCESS_KEY_ID");
  c.key.secret_key = oss ? first_env({"OSS_ACCESS_KEY_SECRET", "AWS_SECRET_ACCESS_KEY"})
                         : env("AWS_SECRET_ACCESS_KEY");
  c.token = oss ? first_env({"OSS_SESSION_TOKEN", "AWS_SESSION_TOKEN"}) : env("AWS_SESSION_TOKEN");
  if (!oss && c.key.access_key.empty() && c.key.secret_key.empty()) {
    const auto creds =
        ini_section(home_file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"), profile);
    auto value = [&](const char* key) {
      auto it = creds.find(key);
      return it == creds.end() ? std::string() : it->second;
    };
    c.key.access_key = value("aws_access_key_id");
    c.key.secret_key = value("aws_secret_access_key");
    c.token = value("aws_session_token");
    if (c.key.access_key.empty() && env("AWS_PROFILE").size())
      fail("AWS_PROFILE=", profile, " but ",
           home_file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"),
           " has no aws_access_key_id for it; add the profile or set AWS_ACCESS_KEY_ID");
  }
  if (c.key.access_key.empty() != c.key.secret_key.empty())
    fail("object store credentials are half set: give both ", c.credentials_hint());
  c.key.region = c.region;
  if (o.max_attempts > 0) c.max_attempts = o.max_attempts;
  if (o.timeout_s > 0) c.timeout_s = o.timeout_s;
  return c;
}

struct Reply {
  long status = 0;
  std::string body, etag, bucket_region;
  uint64_t content_length = 0;
};

using Done = std::function<void(Reply&&, std::exception_ptr)>;

// One request, through all its attempts.
struct Op {
  std::string method = "GET";
  ObjectUrl url;  // key empty: the bucket (listing)
  std::vector<std::pair<std::string, std::string>> query;
  bool ranged = false;
  uint64_t begin = 0, end = 0;
  std::string if_match, body;
  bool if_none_match = false;    // PUT only where no object is
  bool precondition_ok = false;  // a 412 is an answer (a conditional PUT not done), not an error
  Done done;
  std::string what;  // "s3://b/k bytes 0-1023" for messages

  int attempt = 0;
  Clock::time_point due, first_start, attempt_start;
  std::string last_failure;
  // The attempt in flight.
  CURL* easy = nullptr;
  curl_slist* headers = nullptr;
  Reply reply;
  size_t upload_pos = 0;
  char errbuf[CURL_ERROR_SIZE] = {0};
};

size_t on_body(char* p, size_t size, size_t n, void* user) {
  static_cast<Op*>(user)->reply.body.append(p, size * n);
  return size * n;
}

size_t on_upload(char* p, size_t size, size_t n, void* user) {
  Op& op = *static_cast<Op*>(user);
  const size_t take = std::min(size * n, op.body.size() - op.upload_pos);
  std::memcpy(p, op.body.data() + op.upload_pos, take);
  op.upload_pos += take;
  return take;
}

std::string header_value(const std::string& line, const char* name) {
  const size_t n = std::strlen(name);
  if (line.size() <= n || strncasecmp(line.c_str(), name, n) != 0 || line[n] != ':') return "";
  std::string v = line.substr(n + 1);
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.erase(v.begin());
  while (!v.empty() && (v.back() == '\r' || v.back() == '\n' || v.back() == ' ')) v.pop_back();
  return v;
}

size_t on_header(char* p, size_t size, size_t n, void* user) {
  Reply& r = static_cast<Op*>(user)->reply;
  const std::string line(p, size * n);
  if (line.starts_with("HTTP/")) {  // a new response (after 100 Continue or a redirect)
    r.etag.clear();
    r.bucket_region.clear();
    r.content_length = 0;
  }
  if (std::string v = header_value(line, "etag"); !v.empty()) r.etag = v;
  if (std::string v = header_value(line, "x-amz-bucket-region"); !v.empty()) r.bucket_region = v;
  if (std::string v = header_value(line, "content-length"); !v.empty())
    r.content_length = std::strtoull(v.c_str(), nullptr, 10);
  return size * n;
}

// S3's error document: <Error><Code>NoSuchKey</Code><Message>...</Message>...</Error>.
struct S3Error {
  std::string code, message, region;
};
S3Error parse_error(const std::string& body) {
  S3Error e;
  pugi::xml_document doc;
  if (!doc.load_buffer(body.data(), body.size())) return e;
  const pugi::xml_node n = doc.child("Error");
  e.code = n.child_value("Code");
  e.message = n.child_value("Message");
  e.region = n.child_value("Region");
  return e;
}

bool retryable_curl(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_PARTIAL_FILE:
    case CURLE_GOT_NOTHING:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_BAD_CONTENT_ENCODING:
      return true;
    default:
      return false;
  }
}

bool retryable_status(long status, const std::string& code) {
  if (status >= 500 || status == 429) return true;
  return code == "SlowDown" || code == "RequestTimeout" || code == "Throttling" ||
         code == "ThrottlingException";
}

}  // namespace

void set_object_store_overrides(const ObjectStoreOverrides& o) {
  std::lock_guard<std::mutex> lock(g_overrides_mu);
  g_overrides = o;
}

bool is_object_url(const std::string& path) {
  return path.starts_with("s3://") || path.starts_with("oss://");
}

ObjectUrl parse_object_url(const std::string& path) {
  ObjectUrl u;
  const size_t sep = path.find("://");
  if (sep == std::string::npos || !is_object_url(path))
    fail("'", path, "' is not an object URL (s3://bucket/key or oss://bucket/key)");
  u.scheme = path.substr(0, sep);
  const std::string rest = path.substr(sep + 3);
  const size_t slash = rest.find('/');
  u.bucket = rest.substr(0, slash);
  u.key = slash == std::string::npos ? "" : rest.substr(slash + 1);
  if (u.bucket.empty()) fail("'", path, "' names no bucket (s3://bucket/key)");
  return u;
}

struct ObjectStore::Impl {
  Config cfg;
  CURLM* multi = nullptr;
  std::thread io;
  std::mutex mu;
  std::deque<Op*> waiting;  // submitted or backing off, by due time when started
  bool stop = false;
  std::map<CURL*, Op*> active;
  std::mt19937_64 rng{std::random_device{}()};
  std::atomic<uint64_t> requests{0}, retries{0}, bytes{0};
  std::atomic<int64_t> request_us{0};

  explicit Impl(const std::string& scheme) : cfg(make_config(scheme)) {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    multi = curl_multi_init();
    BT_CHECK(multi, "curl_multi_init failed");
    curl_multi_setopt(multi, CURLMOPT_MAX_HOST_CONNECTIONS, 64L);
    io = std::thread([this] { loop(); });
  }
  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    curl_multi_wakeup(multi);
    io.join();
    curl_multi_cleanup(multi);
  }

  void submit(Op* op) {
    op->first_start = op->due = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mu);
      waiting.push_back(op);
    }
    curl_multi_wakeup(multi);
  }

  std::string url_of(const Op& op, std::string* canonical_path, std::string* host) const {
    const std::string key = uri_encode(op.url.key, true);
    if (cfg.virtual_host) {
      *host = op.url.bucket + "." + cfg.host;
      *canonical_path = "/" + key;
    } else {
      *host = cfg.host;
      *canonical_path = "/" + op.url.bucket + "/" + key;
    }
    std::string url = cfg.proto + "://" + *host + *canonical_path;
    const std::string q = canonical_query(op.query);
    if (!q.empty()) url += "?" + q;
    return url;
  }

  void start(Op& op) {
    op.reply = Reply();
    op.upload_pos = 0;
    op.errbuf[0] = 0;
    op.attempt_start = Clock::now();
    std::string path, host;
    const std::string url = url_of(op, &path, &host);
    CURL* e = curl_easy_init();
    BT_CHECK(e, "curl_easy_init failed");
    curl_easy_setopt(e, CURLOPT_URL, url.c_str());
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PRIVATE, &op);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, op.errbuf);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &op);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, &op);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(std::min(cfg.timeout_s, 10.0) * 1000));
    // A transfer that moves nothing for timeout_s is cut (and retried): a stalled connection.
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::max(1.0, cfg.timeout_s)));
    curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
    std::vector<std::pair<std::string, std::string>> sign = {{"host", host}};
    std::string payload_hash = kEmptySha256;
    if (op.method == "PUT") {
      payload_hash = sha256_hex(op.body);
      curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(e, CURLOPT_READFUNCTION, on_upload);
      curl_easy_setopt(e, CURLOPT_READDATA, &op);
      curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(op.body.size()));
    } else if (op.method == "HEAD") {
      curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    } else if (op.method == "DELETE") {
      curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, "DELETE");
    }
    const std::string date = amz_date(std::time(nullptr));
    sign.push_back({"x-amz-content-sha256", payload_hash});
    sign.push_back({"x-amz-date", date});
    if (!cfg.token.empty()) sign.push_back({"x-amz-security-token", cfg.token});
    curl_slist* h = nullptr;
    for (const auto& [n, v] : sign)
      if (n != "host") h = curl_slist_append(h, (n + ": " + v).c_str());
    if (cfg.signed_requests()) {
      SigV4Request req{op.method, path, op.query, sign, payload_hash};
      h = curl_slist_append(h,
                            ("Authorization: " + sigv4_authorization(req, cfg.key, date)).c_str());
    }
    if (op.ranged) {
      h = curl_slist_append(h, str("Range: bytes=", op.begin, "-", op.end - 1).c_str());
      op.reply.body.reserve(op.end - op.begin);
    }
    if (!op.if_match.empty()) h = curl_slist_append(h, ("If-Match: " + op.if_match).c_str());
    if (op.if_none_match) h = curl_slist_append(h, "If-None-Match: *");
    h = curl_slist_append(h, "Expect:");  // no 100-continue round trip before a PUT's body
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
    op.easy = e;
    op.headers = h;
    active[e] = &op;
    ++requests;
    curl_multi_add_handle(multi, e);
  }

  // After an attempt: success (done), a failure that passes (again after a backoff) or one that
  // does not (done with an Error).
  void finish(Op& op, CURLcode rc) {
    long status = 0;
    curl_easy_getinfo(op.easy, CURLINFO_RESPONSE_CODE, &status);
    op.reply.status = status;
    curl_multi_remove_handle(multi, op.easy);
    active.erase(op.easy);
    curl_easy_cleanup(op.easy);
    curl_slist_free_all(op.headers);
    op.easy = nullptr;
    op.headers = nullptr;
    request_us +=
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - op.attempt_start)
            .count();
    bytes += op.reply.body.size();

    std::string failure;
    bool again = false;
    if (rc != CURLE_OK) {
      failure = str(curl_easy_strerror(rc), op.errbuf[0] ? str(" (", op.errbuf, ")") : "");
      again = retryable_curl(rc);
    } else if (status >= 200 && status < 300) {
      if (op.ranged && status == 200 && op.reply.body.size() != op.end - op.begin) {
        op.done(Reply(), std::make_exception_ptr(
                             Error(str(op.what, ": the server sent ", op.reply.body.size(),
                                       " bytes for a ranged read (it ignores the Range header); ",
                                       cfg.endpoint(), " is not an S3-compatible endpoint"))));
        delete &op;
        return;
      }
      if (op.ranged && op.reply.body.size() != op.end - op.begin) {
        failure = str("the reply holds ", op.reply.body.size(), " bytes of the ", op.end - op.begin,
                      " asked (a connection cut mid-object)");
        again = true;
      }
    } else if (status == 412 && op.precondition_ok) {
      op.done(std::move(op.reply), nullptr);
      delete &op;
      return;
    } else {
      const S3Error err = parse_error(op.reply.body);
      failure = str("HTTP ", status, err.code.empty() ? "" : " " + err.code,
                    err.message.empty() ? "" : " (" + err.message + ")");
      again = retryable_status(status, err.code);
      if (!again) {
        op.done(Reply(), std::make_exception_ptr(Error(fatal_message(op, status, err))));
        delete &op;
        return;
      }
    }
    if (failure.empty()) {
      op.done(std::move(op.reply), nullptr);
      delete &op;
      return;
    }
    op.last_failure = failure;
    const double spent = std::chrono::duration<double>(Clock::now() - op.first_start).count();
    if (!again || op.attempt + 1 >= cfg.max_attempts) {
      op.done(Reply(),
              std::make_exception_ptr(Error(
                  str(op.what, ": ", failure,
                      again ? str("; still failing after ", op.attempt + 1, " attempts over ",
                                  static_cast<int>(spent * 10) / 10.0,
                                  " s: the store is down, overloaded or unreachable (",
                                  cfg.endpoint(), "); retry later or raise ", setting("s3_retries"))
                            : str(" (", cfg.endpoint(), ")")))));
      delete &op;
      return;
    }
    // Exponential backoff with jitter (half to all of base * 2^attempt, capped), so that many
    // readers hit by the same outage do not come back in step.
    ++op.attempt;
    ++retries;
    const double cap =
        std::min(cfg.backoff_cap_s, cfg.backoff_base_s * (1 << std::min(op.attempt, 20)));
    const double wait = cap * std::uniform_real_distribution<double>(0.5, 1.0)(rng);
    op.due = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(wait * 1e6));
    std::lock_guard<std::mutex> lock(mu);
    waiting.push_back(&op);
  }

  std::string fatal_message(const Op& op, long status, const S3Error& err) const {
    const std::string what =
        str(op.what, ": HTTP ", status, err.code.empty() ? "" : " " + err.code);
    const std::string creds =
        cfg.signed_requests()
            ? str("check ", cfg.credentials_hint(), " (access key ", cfg.key.access_key,
                  ") and that they may read ", op.url.scheme, "://", op.url.bucket)
            : str("no credentials are set: set ", cfg.credentials_hint());
    if (err.code == "NoSuchKey" || (status == 404 && op.method == "HEAD" && !op.url.key.empty()))
      return str(what, ": no such object; check the path (was it renamed or deleted?)");
    if (err.code == "NoSuchBucket")
      return str(what, ": no bucket '", op.url.bucket, "' at ", cfg.endpoint(),
                 "; check the bucket name, ", setting("s3_endpoint"), " and the region (",
                 cfg.region, ")");
    if (err.code == "InvalidAccessKeyId" || err.code == "SignatureDoesNotMatch" ||
        err.code == "AccessDenied" || status == 403)
      return str(what, err.message.empty() ? "" : " (" + err.message + ")", ": ", creds);
    if (err.code == "RequestTimeTooSkewed")
      return str(what, ": this machine's clock is off; synchronise it (chrony or ntp)");
    if (err.code == "PermanentRedirect" || err.code == "AuthorizationHeaderMalformed" ||
        status == 301) {
      const std::string region = !err.region.empty() ? err.region : op.reply.bucket_region;
      return str(what, ": the bucket lives in another region",
                 region.empty() ? "" : " (" + region + ")", "; set AWS_REGION or ",
                 setting("s3_region"), " to it");
    }
    if (status == 412)
      return str(what, ": the object changed while it was being read (its ETag is no longer ",
                 op.if_match, "); a run must not mix two versions of a file: restart it");
    return str(what, err.message.empty() ? "" : " (" + err.message + ")", " at ", cfg.endpoint());
  }

  void loop() {
    for (;;) {
      std::vector<Op*> ready;
      Clock::time_point next_due = Clock::now() + std::chrono::seconds(1);
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) break;
        const auto now = Clock::now();
        for (auto it = waiting.begin(); it != waiting.end();) {
          if ((*it)->due <= now) {
            ready.push_back(*it);
            it = waiting.erase(it);
          } else {
            next_due = std::min(next_due, (*it)->due);
            ++it;
          }
        }
      }
      for (Op* op : ready) start(*op);
      int running = 0;
      curl_multi_perform(multi, &running);
      int left = 0;
      while (CURLMsg* m = curl_multi_info_read(multi, &left))
        if (m->msg == CURLMSG_DONE) finish(*active.at(m->easy_handle), m->data.result);
      bool any_waiting;
      {
        std::lock_guard<std::mutex> lock(mu);
        any_waiting = !waiting.empty();
      }
      const auto until = any_waiting ? next_due - Clock::now() : std::chrono::seconds(1);
      const int ms = static_cast<int>(std::clamp<int64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(until).count(), 0, 1000));
      if (ms > 0 || active.empty()) curl_multi_poll(multi, nullptr, 0, std::max(ms, 1), nullptr);
    }
    // Stopping: nothing may wait on a request that will not finish.
    const auto gone =
        std::make_exception_ptr(Error("object store closed while a request was pending"));
    for (auto& [e, op] : active) {
      curl_multi_remove_handle(multi, e);
      curl_easy_cleanup(e);
      curl_slist_free_all(op->headers);
      op->done(Reply(), gone);
      delete op;
    }
    for (Op* op : waiting) {
      op->done(Reply(), gone);
      delete op;
    }
  }

  // Runs one request to its end on the I/O thread; the reply, or the Error.
  Reply run(Op* op) {
    auto p = std::make_shared<std::promise<Reply>>();
    std::future<Reply> f = p->get_future();
    op->done = [p](Reply&& r, std::exception_ptr e) {
      if (e)
        p->set_exception(e);
      else
        p->set_value(std::move(r));
    };
    submit(op);
    return f.get();
  }
};

namespace {
std::mutex g_stores_mu;
std::map<std::string, std::unique_ptr<ObjectStore>>& stores() {
  static auto* s = new std::map<std::string, std::unique_ptr<ObjectStore>>;  // lives to the end
  return *s;
}
}  // namespace

ObjectStore& ObjectStore::of(const std::string& scheme) {
  std::lock_guard<std::mutex> lock(g_stores_mu);
  auto& s = stores()[scheme];
  if (!s) s.reset(new ObjectStore(scheme));
  return *s;
}

ObjectStoreStats ObjectStore::totals() {
  std::lock_guard<std::mutex> lock(g_stores_mu);
  ObjectStoreStats t;
  for (const auto& [scheme, s] : stores()) {
    const ObjectStoreStats x = s->stats();
    t.requests += x.requests;
    t.retries += x.retries;
    t.bytes += x.bytes;
    t.request_seconds += x.request_seconds;
  }
  return t;
}

ObjectStore::ObjectStore(const std::string& scheme) : impl_(new Impl(scheme)) {}
ObjectStore::~ObjectStore() = default;

std::vector<ObjectInfo> ObjectStore::list(const std::string& bucket, const std::string& prefix) {
  std::vector<ObjectInfo> out;
  std::string token;
  for (int page = 0;; ++page) {
    Op* op = new Op;
    op->url = {impl_->cfg.scheme, bucket, ""};
    op->query = {{"list-type", "2"}, {"prefix", prefix}};
    if (!token.empty()) op->query.push_back({"continuation-token", token});
    op->what =
        str("listing ", impl_->cfg.scheme, "://", bucket, "/", prefix, "* (page ", page + 1, ")");
    const std::string what = op->what;
    const Reply r = impl_->run(op);
    pugi::xml_document doc;
    if (!doc.load_buffer(r.body.data(), r.body.size()))
      fail(what, ": the reply is not the XML of ListObjectsV2 (", r.body.substr(0, 120), "); is ",
           impl_->cfg.endpoint(), " an S3 endpoint?");
    const pugi::xml_node res = doc.child("ListBucketResult");
    if (!res)
      fail(what, ": the reply has no ListBucketResult; is ", impl_->cfg.endpoint(),
           " an S3 endpoint?");
    for (pugi::xml_node c = res.child("Contents"); c; c = c.next_sibling("Contents"))
      out.push_back({c.child_value("Key"), std::strtoull(c.child_value("Size"), nullptr, 10),
                     c.child_value("ETag")});
    if (std::string(res.child_value("IsTruncated")) != "true") break;
    token = res.child_value("NextContinuationToken");
    if (token.empty()) fail(what, ": a truncated listing without a continuation token");
  }
  std::sort(out.begin(), out.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
  return out;
}

ObjectInfo ObjectStore::head(const ObjectUrl& url) {
  Op* op = new Op;
  op->method = "HEAD";
  op->url = url;
  op->what = url.str();
  const Reply r = impl_->run(op);
  return {url.key, r.content_length, r.etag};
}

std::future<std::string> ObjectStore::get(const ObjectUrl& url, uint64_t begin, uint64_t end,
                                          const std::string& etag) {
  BT_CHECK(end > begin, "empty range");
  Op* op = new Op;
  op->url = url;
  op->ranged = true;
  op->begin = begin;
  op->end = end;
  op->if_match = etag;
  op->what = str(url.str(), " (bytes ", begin, "-", end - 1, ")");
  auto p = std::make_shared<std::promise<std::string>>();
  std::future<std::string> f = p->get_future();
  op->done = [p](Reply&& r, std::exception_ptr e) {
    if (e)
      p->set_exception(e);
    else
      p->set_value(std::move(r.body));
  };
  impl_->submit(op);
  return f;
}

void ObjectStore::put(const ObjectUrl& url, std::string body) {
  put_if(url, std::move(body), false, "");
}

bool ObjectStore::put_if(const ObjectUrl& url, std::string body, bool if_absent,
                         const std::string& if_match, std::string* etag) {
  // One PUT carries at most 5 GiB (S3's limit); prepare's shards are far smaller.
  if (body.size() > (uint64_t{5} << 30))
    fail(url.str(), ": ", body.size(),
         " bytes is more than one PUT carries (5 GiB); write more, "
         "smaller shards (",
         setting("output_shards"), ")");
  Op* op = new Op;
  op->method = "PUT";
  op->url = url;
  op->body = std::move(body);
  op->if_none_match = if_absent;
  op->if_match = if_match;
  op->precondition_ok = if_absent || !if_match.empty();
  op->what = str("writing ", url.str(),
                 if_absent          ? " (if absent)"
                 : if_match.empty() ? ""
                                    : " (if unchanged)");
  const Reply r = impl_->run(op);
  if (r.status == 412) return false;
  if (etag) *etag = r.etag;
  return true;
}

std::string ObjectStore::read(const ObjectUrl& url) {
  const ObjectInfo info = head(url);
  if (info.size == 0) return "";
  return get(url, 0, info.size, info.etag).get();
}

void ObjectStore::remove(const ObjectUrl& url) {
  Op* op = new Op;
  op->method = "DELETE";
  op->url = url;
  op->what = str("deleting ", url.str());
  impl_->run(op);
}

ObjectStoreStats ObjectStore::stats() const {
  return {impl_->requests.load(), impl_->retries.load(), impl_->bytes.load(),
          impl_->request_us.load() / 1e6};
}

}  // namespace bertrain::data
