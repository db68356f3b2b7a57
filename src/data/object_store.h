// Object storage over the S3 API (AWS S3, and Alibaba OSS, MinIO, Ceph RGW... which speak it):
// listing (ListObjectsV2, paginated), HEAD, ranged GETs and PUTs, signed with SigV4, through
// libcurl. One background thread drives every transfer of the process (curl's multi interface:
// many requests in flight, connections reused); callers get futures. A request that fails for a
// reason that passes (5xx, throttling, a timeout, a connection cut, a body shorter than asked) is
// retried with exponential backoff and jitter; one that cannot succeed (403, 404, bad request)
// or that keeps failing raises Error naming the object, the bytes and what to do.
//
// Paths: s3://bucket/key and oss://bucket/key. Settings come from flags (set_overrides) over the
// usual environment variables:
//   s3://   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION or
//           AWS_DEFAULT_REGION (us-east-1), AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (AWS itself);
//           without them the AWS CLI's files: the AWS_PROFILE (else default) profile's keys in
//           ~/.aws/credentials and its region / endpoint_url in ~/.aws/config
//           (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE move them)
//   oss://  OSS_ACCESS_KEY_ID, OSS_ACCESS_KEY_SECRET, OSS_SESSION_TOKEN, OSS_ENDPOINT (required:
//           oss-cn-hangzhou.aliyuncs.com or a URL), OSS_REGION (else from the endpoint); the AWS_*
//           credentials when the OSS_* ones are unset.
// Without credentials requests go unsigned (public buckets).
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace bertrain::data {

// Settings a command line can give (empty / 0: from the environment or the default).
struct ObjectStoreOverrides {
  std::string endpoint, region;
  std::string addressing;  // auto | path | virtual
  int max_attempts = 0;    // tries per request before giving up (default 8)
  double timeout_s = 0;    // a transfer that moves no byte for this long is cut and retried (30)
};
void set_object_store_overrides(const ObjectStoreOverrides& o);

struct ObjectUrl {
  std::string scheme, bucket, key;  // "s3" or "oss"
  std::string str() const { return scheme + "://" + bucket + "/" + key; }
};
bool is_object_url(const std::string& path);
ObjectUrl parse_object_url(const std::string& path);  // Error when malformed

struct ObjectInfo {
  std::string key;
  uint64_t size = 0;
  std::string etag;
};

struct ObjectStoreStats {
  uint64_t requests = 0, retries = 0, bytes = 0;
  double request_seconds = 0;  // summed over requests (first byte asked to last byte in)
};

class ObjectStore {
 public:
  // The store for a scheme ("s3" or "oss"), made on first use with the settings then in force.
  static ObjectStore& of(const std::string& scheme);
  ~ObjectStore();

  // Every object under bucket/prefix (all pages), in key order.
  std::vector<ObjectInfo> list(const std::string& bucket, const std::string& prefix);
  ObjectInfo head(const ObjectUrl& url);
  // Bytes [begin, end) of an object. With etag set the read fails (412) if the object was
  // replaced meanwhile, rather than mixing two versions.
  std::future<std::string> get(const ObjectUrl& url, uint64_t begin, uint64_t end,
                               const std::string& etag = "");
  void put(const ObjectUrl& url, std::string body);
  // A conditional PUT: only where no object is (if_absent: If-None-Match *), or only over the
  // version whose ETag is if_match. False, and nothing written, when the condition fails (412);
  // the new object's ETag in *etag otherwise. (AWS S3 and MinIO honour both conditions.)
  bool put_if(const ObjectUrl& url, std::string body, bool if_absent, const std::string& if_match,
              std::string* etag = nullptr);
  // The whole object (HEAD, then one read pinned to that version's ETag).
  std::string read(const ObjectUrl& url);
  // DELETE; an object that is not there is no error (S3's answer is the same).
  void remove(const ObjectUrl& url);

  ObjectStoreStats stats() const;
  // Summed over the stores in use (none made for asking).
  static ObjectStoreStats totals();

  struct Impl;

 private:
  explicit ObjectStore(const std::string& scheme);
  std::unique_ptr<Impl> impl_;
};

}  // namespace bertrain::data
