// --s3-* flags: the object store's endpoint, region, addressing, retries and timeout for every
// command that reads or writes s3:// and oss:// paths (over the AWS_* / OSS_* environment).
#include "cli/commands.h"
#include "data/object_store.h"

namespace bertrain::cli {

void add_storage_options(CLI::App* c) {
  auto o = std::make_shared<data::ObjectStoreOverrides>();
  c->add_option("--s3-endpoint", o->endpoint,
                "Object store endpoint for s3:// and oss:// paths (URL or host; default: "
                "AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, OSS_ENDPOINT, else AWS S3)")
      ->group("Object storage");
  c->add_option("--s3-region", o->region,
                "Region the requests are signed for (default: AWS_REGION, AWS_DEFAULT_REGION, "
                "OSS_REGION, us-east-1)")
      ->group("Object storage");
  c->add_option("--s3-addressing", o->addressing,
                "auto, path or virtual (bucket.host). auto: virtual for AWS and OSS, path for "
                "other endpoints (MinIO, Ceph)")
      ->group("Object storage");
  c->add_option("--s3-retries", o->max_attempts,
                "Attempts per request on 5xx, throttling, timeouts and cut connections "
                "(backoff with jitter; default 8)")
      ->group("Object storage");
  c->add_option("--s3-timeout", o->timeout_s,
                "Seconds a transfer may move no data before it is cut and retried (default 30)")
      ->group("Object storage");
  c->parse_complete_callback([o] { data::set_object_store_overrides(*o); });
}

}  // namespace bertrain::cli
