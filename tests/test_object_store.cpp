// The S3 request signature against botocore's signer and AWS's documented example; object URLs.
// The transfers themselves (listing, ranged reads, retries, errors) are proven against a real
// S3 server in tests/s3/s3_test.sh.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "data/object_store.h"
#include "data/sigv4.h"
#include "test_util.h"

using namespace bertrain;
using namespace bertrain::data;
using bertrain::test::data_path;

// AWS's own example (S3 API reference, "Signature Calculations for the Authorization Header:
// Transferring Payload in a Single Chunk", GET Object): the Range header is signed too.
TEST(SigV4, MatchesAwsDocumentedGetObjectExample) {
  SigV4Request req;
  req.path = "/test.txt";
  req.headers = {
      {"Host", "examplebucket.s3.amazonaws.com"},
      {"Range", "bytes=0-9"},
      {"x-amz-content-sha256", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"x-amz-date", "20130524T000000Z"}};
  req.payload_sha256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
  const SigV4Key key{"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"};
  EXPECT_EQ(sigv4_authorization(req, key, "20130524T000000Z"),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

// botocore's S3SigV4Auth on listings with '/' and spaces in the prefix, a continuation token,
// an encoded UTF-8 key, a session token and a PUT body (tools/make_sigv4_golden.py).
TEST(SigV4, MatchesBotocoreOnListingsKeysTokensAndPuts) {
  std::ifstream in(data_path("data/s3/sigv4_golden.json"));
  const nlohmann::json g = nlohmann::json::parse(in);
  ASSERT_EQ(g["cases"].size(), 6u);
  for (const auto& c : g["cases"]) {
    SigV4Request req;
    req.method = c["method"];
    req.path = c["path"];
    for (const auto& q : c["query"]) req.query.push_back({q[0], q[1]});
    req.payload_sha256 = c["payload_sha256"];
    req.headers = {{"host", c["host"]},
                   {"x-amz-content-sha256", req.payload_sha256},
                   {"x-amz-date", c["amz_date"]}};
    if (c.contains("token")) req.headers.push_back({"x-amz-security-token", c["token"]});
    if (c.contains("payload")) {
      EXPECT_EQ(sha256_hex(c["payload"].get<std::string>()), req.payload_sha256);
    }
    SigV4Key key{g["access_key"], g["secret_key"], c["region"]};
    EXPECT_EQ(sigv4_authorization(req, key, c["amz_date"]), c["authorization"].get<std::string>())
        << c["method"] << " " << c["host"] << c["path"];
  }
}

TEST(SigV4, EncodesAsTheCanonicalRequestWants) {
  EXPECT_EQ(uri_encode("a b/c+d~e_f.g-h", true), "a%20b/c%2Bd~e_f.g-h");
  EXPECT_EQ(uri_encode("a b/c", false), "a%20b%2Fc");
  EXPECT_EQ(uri_encode("\xe6\x95\xb0", true), "%E6%95%B0");
  EXPECT_EQ(canonical_query({{"prefix", "x/y"}, {"list-type", "2"}, {"a", ""}}),
            "a=&list-type=2&prefix=x%2Fy");
  EXPECT_EQ(amz_date(1369353600), "20130524T000000Z");
}

TEST(ObjectUrl, ParsesBucketAndKeyAndRefusesWhatIsNotOne) {
  const ObjectUrl u = parse_object_url("s3://my-bucket/train/part-00000.tfrecord");
  EXPECT_EQ(u.scheme, "s3");
  EXPECT_EQ(u.bucket, "my-bucket");
  EXPECT_EQ(u.key, "train/part-00000.tfrecord");
  EXPECT_EQ(u.str(), "s3://my-bucket/train/part-00000.tfrecord");
  EXPECT_EQ(parse_object_url("oss://b").key, "");
  EXPECT_TRUE(is_object_url("oss://b/k"));
  EXPECT_FALSE(is_object_url("/data/s3://x"));
  EXPECT_THROW(parse_object_url("s3:///key"), Error);
  EXPECT_THROW(parse_object_url("gs://b/k"), Error);
}
