// The Unicode pieces BERT's tokenizer needs (through utf8proc): UTF-8 decoding that replaces
// invalid bytes with U+FFFD (Python's errors="replace": one per maximal invalid subpart),
// character classes as Google's tokenization.py defines them, lower-casing as HuggingFace
// applies Python's str.lower() (one character at a time, so no final-sigma rule), NFC/NFD.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace bertrain::prep::unicode {

// Decodes UTF-8; returns the number of replacement characters inserted for invalid bytes.
size_t decode(std::string_view s, std::u32string& out);
void encode(std::u32string_view s, std::string& out);
void append_utf8(char32_t c, std::string& out);
// Replaces invalid UTF-8 with U+FFFD; returns how many replacements were made.
size_t repair(std::string& s);

bool is_whitespace(char32_t c);       // space, \t, \n, \r, category Zs
bool is_python_space(char32_t c);     // str.isspace(): what str.split() splits words on
bool is_control(char32_t c);          // category C* except \t, \n, \r
bool is_punctuation(char32_t c);      // ASCII symbol ranges, or category P*
bool is_cjk(char32_t c);              // CJK Unified Ideographs blocks (BERT's _is_chinese_char)
bool is_mark_nonspacing(char32_t c);  // category Mn (stripped with accents)
bool is_word_char(char32_t c);        // Python's regex \w on str: categories L* and N*, and '_'

std::u32string nfc(std::u32string_view s);
// True when every character is one that NFC leaves alone whatever surrounds it (ASCII and
// Latin-1, CJK ideographs and punctuation, full-width forms): lets most text skip nfc().
bool nfc_stable(std::u32string_view s);
std::u32string nfd(std::u32string_view s);
std::u32string lower(std::u32string_view s);  // Python's str.lower(), per character

}  // namespace bertrain::prep::unicode
