#include "prep/unicode.h"

#include <utf8proc.h>

#include <cstdlib>

namespace bertrain::prep::unicode {

size_t decode(std::string_view s, std::u32string& out) {
  out.clear();
  out.reserve(s.size());
  size_t bad = 0, i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      out.push_back(c);
      ++i;
      continue;
    }
    // Expected length and the valid range of the second byte (Unicode Table 3-7).
    int len;
    unsigned char lo = 0x80, hi = 0xbf;
    char32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
      cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      cp = c & 0x0f;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      cp = c & 0x07;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    } else {
      out.push_back(0xfffd);
      ++bad;
      ++i;
      continue;
    }
    size_t j = i + 1;
    bool ok = true;
    for (int k = 1; k < len; ++k, ++j) {
      const unsigned char lo_k = k == 1 ? lo : 0x80, hi_k = k == 1 ? hi : 0xbf;
      if (j >= n || p[j] < lo_k || p[j] > hi_k) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (p[j] & 0x3f);
    }
    if (ok) {
      out.push_back(cp);
      i = j;
    } else {
      out.push_back(0xfffd);  // the maximal invalid subpart [i, j) becomes one U+FFFD
      ++bad;
      i = j;
    }
  }
  return bad;
}

void append_utf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  }
}

void encode(std::u32string_view s, std::string& out) {
  out.clear();
  for (char32_t c : s) append_utf8(c, out);
}

size_t repair(std::string& s) {
  bool ascii = true;
  for (unsigned char c : s) ascii &= c < 0x80;
  if (ascii) return 0;
  std::u32string u;
  const size_t bad = decode(s, u);
  if (bad) encode(u, s);
  return bad;
}

namespace {
utf8proc_category_t cat(char32_t c) {
  return c > 0x10ffff ? UTF8PROC_CATEGORY_CN : utf8proc_category(static_cast<utf8proc_int32_t>(c));
}
}  // namespace

bool is_python_space(char32_t c) {
  if (is_whitespace(c)) return true;
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0x2028 ||
         c == 0x2029;
}

bool is_whitespace(char32_t c) {
  if (c == ' ' || c == '\t' || c == '\n' || c == '\r') return true;
  return cat(c) == UTF8PROC_CATEGORY_ZS;
}

bool is_control(char32_t c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  switch (cat(c)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CS:
      return true;
    default:
      return false;
  }
}

bool is_punctuation(char32_t c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
      (c >= 123 && c <= 126))
    return true;
  switch (cat(c)) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

bool is_mark_nonspacing(char32_t c) {
  return cat(c) == UTF8PROC_CATEGORY_MN;
}

bool is_word_char(char32_t c) {
  if (c == '_') return true;
  switch (cat(c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

namespace {
std::u32string map(std::u32string_view s, int options) {
  bool ascii = true;
  for (char32_t c : s) ascii &= c < 0x80;
  if (ascii) return std::u32string(s);
  std::string in;
  encode(s, in);
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(in.data()),
                                          static_cast<utf8proc_ssize_t>(in.size()), &dst,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) return std::u32string(s);  // cannot happen for valid code points
  std::u32string out;
  decode(std::string_view(reinterpret_cast<char*>(dst), static_cast<size_t>(n)), out);
  std::free(dst);
  return out;
}
}  // namespace

bool nfc_stable(std::u32string_view s) {
  for (char32_t c : s) {
    const bool stable = c < 0x300 || (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3000 && c <= 0x3029) ||
                        (c >= 0x3030 && c <= 0x303F) || (c >= 0xFF00 && c <= 0xFFEF);
    if (!stable) return false;
  }
  return true;
}

std::u32string nfc(std::u32string_view s) {
  return map(s, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
}
std::u32string nfd(std::u32string_view s) {
  return map(s, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
}

std::u32string lower(std::u32string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    const char32_t c = s[i];
    if (c < 0x80) {
      out.push_back(c >= 'A' && c <= 'Z' ? c + 32 : c);
    } else if (c == 0x130) {  // İ -> i + combining dot above (SpecialCasing)
      out.push_back('i');
      out.push_back(0x307);
    } else {
      out.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
    }
  }
  return out;
}

}  // namespace bertrain::prep::unicode
