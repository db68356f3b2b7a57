#include "data/sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <ctime>

#include "core/error.h"

namespace bertrain::data {

namespace {

std::string hex(const unsigned char* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[p[i] >> 4];
    out[2 * i + 1] = digits[p[i] & 15];
  }
  return out;
}

std::string hmac(const std::string& key, const std::string& data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  BT_CHECK(HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len),
           "HMAC-SHA256 failed");
  return std::string(reinterpret_cast<char*>(out), len);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Header values are signed trimmed, with inner runs of spaces as one.
std::string trim_value(const std::string& v) {
  std::string out;
  bool space = false;
  for (char c : v) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out.push_back(' ');
    space = false;
    out.push_back(c);
  }
  return out;
}

}  // namespace

std::string uri_encode(const std::string& s, bool keep_slash) {
  static const char* digits = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size() * 3 / 2);
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(digits[c >> 4]);
      out.push_back(digits[c & 15]);
    }
  }
  return out;
}

std::string sha256_hex(const std::string& data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  BT_CHECK(EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr), "SHA-256 failed");
  return hex(md, len);
}

std::string amz_date(long long unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

std::string canonical_query(const std::vector<std::pair<std::string, std::string>>& query) {
  std::vector<std::pair<std::string, std::string>> q;
  for (const auto& [k, v] : query) q.push_back({uri_encode(k, false), uri_encode(v, false)});
  std::sort(q.begin(), q.end());
  std::string out;
  for (const auto& [k, v] : q) out += (out.empty() ? "" : "&") + k + "=" + v;
  return out;
}

std::string sigv4_authorization(const SigV4Request& req, const SigV4Key& key,
                                const std::string& amz_date) {
  std::vector<std::pair<std::string, std::string>> h;
  for (const auto& [n, v] : req.headers) h.push_back({lower(n), trim_value(v)});
  std::sort(h.begin(), h.end());
  std::string canonical_headers, signed_headers;
  for (const auto& [n, v] : h) {
    canonical_headers += n + ":" + v + "\n";
    signed_headers += (signed_headers.empty() ? "" : ";") + n;
  }
  const std::string canonical = req.method + "\n" + req.path + "\n" + canonical_query(req.query) +
                                "\n" + canonical_headers + "\n" + signed_headers + "\n" +
                                req.payload_sha256;
  const std::string day = amz_date.substr(0, 8);
  const std::string scope = day + "/" + key.region + "/" + key.service + "/aws4_request";
  const std::string to_sign =
      "AWS4-HMAC-SHA256\n" + amz_date + "\n" + scope + "\n" + sha256_hex(canonical);
  std::string k = hmac("AWS4" + key.secret_key, day);
  k = hmac(k, key.region);
  k = hmac(k, key.service);
  k = hmac(k, "aws4_request");
  const std::string sig = hmac(k, to_sign);
  return "AWS4-HMAC-SHA256 Credential=" + key.access_key + "/" + scope +
         ", SignedHeaders=" + signed_headers +
         ", Signature=" + hex(reinterpret_cast<const unsigned char*>(sig.data()), sig.size());
}

}  // namespace bertrain::data
