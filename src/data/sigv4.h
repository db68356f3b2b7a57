// AWS Signature Version 4 for S3 requests (what S3, OSS's S3 API and MinIO check): the canonical
// request, the string to sign and the Authorization header, with OpenSSL's SHA-256 and HMAC.
// Written here rather than taken from libcurl's CURLOPT_AWS_SIGV4 because Debian 12's libcurl
// (7.88) signs a query string as it stands instead of canonically, so every ListObjectsV2 with a
// '/' in its prefix is refused with SignatureDoesNotMatch. Checked against the examples in AWS's
// documentation and against botocore's signer (tools/make_sigv4_golden.py).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace bertrain::data {

struct SigV4Request {
  std::string method = "GET";
  std::string path = "/";  // already URI-encoded, as sent (S3 encodes the key once)
  std::vector<std::pair<std::string, std::string>> query;    // decoded name, value
  std::vector<std::pair<std::string, std::string>> headers;  // to sign; must include host
  std::string payload_sha256 = "UNSIGNED-PAYLOAD";           // hex, or UNSIGNED-PAYLOAD
};

struct SigV4Key {
  std::string access_key, secret_key, region = "us-east-1", service = "s3";
};

// RFC 3986 percent-encoding as SigV4 wants it: unreserved characters kept, every other byte as
// %XX (upper case); '/' kept when keep_slash (paths), encoded otherwise (query values).
std::string uri_encode(const std::string& s, bool keep_slash);
std::string sha256_hex(const std::string& data);
// "20130524T000000Z" for a Unix time.
std::string amz_date(long long unix_seconds);
// The canonical query string: names and values encoded, sorted by name then value.
std::string canonical_query(const std::vector<std::pair<std::string, std::string>>& query);

// The value of the Authorization header for `req` at time amz_date ("YYYYMMDDTHHMMSSZ").
// The caller sends the same headers (x-amz-date and x-amz-content-sha256 among them).
std::string sigv4_authorization(const SigV4Request& req, const SigV4Key& key,
                                const std::string& amz_date);

}  // namespace bertrain::data
