#include "tasks/ner.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "data/storage.h"
#include "prep/unicode.h"
#include "tasks/task_files.h"

namespace bertrain::tasks {

namespace {

std::vector<std::string> split_ws(const std::string& line) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t') ++j;
    if (j > i) out.push_back(line.substr(i, j - i));
    i = j;
  }
  return out;
}

// The chunk letter and type of a tag as seqeval reads it (prefix form: B-PER, I-PER, O).
std::pair<char, std::string> split_tag(const std::string& tag) {
  const char c = tag.empty() ? 'O' : tag[0];
  std::string rest = tag.size() > 1 ? tag.substr(1) : "";
  const size_t dash = rest.find('-');
  std::string type = dash == std::string::npos ? rest : rest.substr(dash + 1);
  return {c, type.empty() ? "_" : type};
}

bool end_of_chunk(char prev, char tag, const std::string& prev_type, const std::string& type) {
  if (prev == 'E' || prev == 'S') return true;
  if ((prev == 'B' || prev == 'I') && (tag == 'B' || tag == 'S' || tag == 'O')) return true;
  return prev != 'O' && prev != '.' && prev_type != type;
}

bool start_of_chunk(char prev, char tag, const std::string& prev_type, const std::string& type) {
  if (tag == 'B' || tag == 'S') return true;
  if ((prev == 'E' || prev == 'S' || prev == 'O') && (tag == 'E' || tag == 'I')) return true;
  return tag != 'O' && tag != '.' && prev_type != type;
}

}  // namespace

std::string TaggedSet::skipped_summary(const std::string& file) const {
  return tasks::skipped_summary(skipped, skipped_reasons, file, "sentence");
}

TaggedSet read_tagged_file(const std::string& path) {
  std::istringstream in(data::read_all(path));  // a file or an object (s3://, oss://)
  TaggedSet s;
  auto skip = [&](int64_t line, const std::string& why) {
    ++s.skipped;
    if (s.skipped_reasons.size() < 5) s.skipped_reasons.push_back(str(path, ":", line, ": ", why));
  };
  std::string line;
  int64_t lineno = 0;
  if (path.ends_with(".json") || path.ends_with(".jsonl")) {
    while (std::getline(in, line)) {
      ++lineno;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        skip(lineno, str("not a JSON object (", e.what(), ")"));
        continue;
      }
      if (!j.is_object() || !j.contains("text") || !j["text"].is_string()) {
        skip(lineno, "no \"text\" string");
        continue;
      }
      TaggedSentence t;
      t.text = j["text"].get<std::string>();
      std::u32string chars;
      prep::unicode::decode(t.text, chars);
      for (size_t i = 0; i < chars.size(); ++i) {
        std::string w;
        prep::unicode::append_utf8(chars[i], w);
        t.words.push_back(w);
        t.spans.push_back({static_cast<int64_t>(i), static_cast<int64_t>(i) + 1});
      }
      std::string why;
      if (j.contains("label")) {
        t.tags.assign(chars.size(), "O");
        for (const auto& [type, entities] : j["label"].items()) {
          if (!entities.is_object()) {
            why = str("entities of '", type, "' are not an object");
            break;
          }
          for (const auto& [name, spans] : entities.items())
            for (const auto& sp : spans) {
              if (!sp.is_array() || sp.size() != 2 || !sp[0].is_number_integer() ||
                  !sp[1].is_number_integer()) {
                why = str("span of '", name, "' is not [start, end]");
                continue;
              }
              const int64_t b = sp[0], e = sp[1];  // inclusive end
              if (b < 0 || e < b || e >= static_cast<int64_t>(chars.size())) {
                why = str("span [", b, ", ", e, "] of '", name, "' is outside the text (",
                          chars.size(), " characters)");
                continue;
              }
              std::string covered;
              prep::unicode::encode(chars.substr(b, e - b + 1), covered);
              if (covered != name) {
                why = str("span [", b, ", ", e, "] covers '", covered, "', not '", name, "'");
                continue;
              }
              for (int64_t k = b; k <= e; ++k)
                if (t.tags[k] != "O") why = str("entities overlap at character ", k);
              if (!why.empty()) continue;
              t.tags[b] = "B-" + type;
              for (int64_t k = b + 1; k <= e; ++k) t.tags[k] = "I-" + type;
            }
        }
      }
      if (!why.empty()) {
        skip(lineno, why);
        continue;
      }
      s.sentences.push_back(std::move(t));
    }
  } else {
    TaggedSentence t;
    int64_t chars = 0;  // of t.text
    bool bad = false;
    auto flush = [&] {
      if (!t.words.empty() && !bad) s.sentences.push_back(std::move(t));
      t = {};
      chars = 0;
      bad = false;
    };
    while (std::getline(in, line)) {
      ++lineno;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      const auto cols = split_ws(line);
      if (cols.empty() || cols[0] == "-DOCSTART-") {  // a sentence break (WNUT: a lone TAB)
        flush();
        continue;
      }
      if (cols.size() < 2) {
        if (!bad) skip(lineno, str("a word without a tag ('", line, "')"));
        bad = true;
        continue;
      }
      // The sentence's text: its words joined by spaces (spans in characters of it).
      std::u32string w;
      prep::unicode::decode(cols[0], w);
      if (!t.text.empty()) {
        t.text += ' ';
        ++chars;
      }
      t.text += cols[0];
      t.words.push_back(cols[0]);
      t.tags.push_back(cols.back());
      t.spans.push_back({chars, chars + static_cast<int64_t>(w.size())});
      chars += static_cast<int64_t>(w.size());
    }
    flush();
  }
  if (s.sentences.empty())
    fail(path, " has no usable sentences",
         s.skipped ? str(" (", s.skipped, " skipped; first: ", s.skipped_reasons[0], ")")
                   : std::string());
  return s;
}

std::vector<Entity> tag_entities(const std::vector<std::string>& tags) {
  std::vector<Entity> out;
  char prev = 'O';
  std::string prev_type;
  int64_t begin = 0;
  const int64_t n = static_cast<int64_t>(tags.size());
  for (int64_t i = 0; i <= n; ++i) {
    const auto [tag, type] = i < n ? split_tag(tags[i]) : std::pair<char, std::string>{'O', "_"};
    if (end_of_chunk(prev, tag, prev_type, type)) out.push_back({prev_type, begin, i - 1});
    if (start_of_chunk(prev, tag, prev_type, type)) begin = i;
    prev = tag;
    prev_type = type;
  }
  return out;
}

EntityScores entity_scores(const std::vector<std::vector<std::string>>& gold,
                           const std::vector<std::vector<std::string>>& predicted) {
  BT_CHECK(gold.size() == predicted.size(), "entity_scores: ", gold.size(), " vs ",
           predicted.size(), " sentences");
  EntityScores r;
  for (size_t i = 0; i < gold.size(); ++i) {
    const auto g = tag_entities(gold[i]), p = tag_entities(predicted[i]);
    const std::set<Entity> gs(g.begin(), g.end()), ps(p.begin(), p.end());
    r.gold += static_cast<int64_t>(gs.size());
    r.predicted += static_cast<int64_t>(ps.size());
    for (const auto& e : ps) r.correct += gs.count(e);
  }
  r.precision = r.predicted ? static_cast<double>(r.correct) / r.predicted : 0.0;
  r.recall = r.gold ? static_cast<double>(r.correct) / r.gold : 0.0;
  r.f1 = r.precision + r.recall > 0 ? 2 * r.precision * r.recall / (r.precision + r.recall) : 0.0;
  return r;
}

TokenSet encode_tagged(const TaggedSet& s, const prep::Tokenizer& tok, int64_t seq_len,
                       std::vector<std::string> label_names) {
  TokenSet out;
  const bool labelled = !s.sentences.empty() && !s.sentences[0].tags.empty();
  if (label_names.empty() && labelled) {
    std::set<std::string> uniq;
    for (const auto& t : s.sentences) uniq.insert(t.tags.begin(), t.tags.end());
    uniq.erase("O");
    label_names.push_back("O");
    std::vector<std::string> rest(uniq.begin(), uniq.end());
    std::sort(rest.begin(), rest.end(), [](const std::string& a, const std::string& b) {
      const auto x = split_tag(a), y = split_tag(b);
      return std::tie(x.second, x.first) < std::tie(y.second, y.first);
    });
    label_names.insert(label_names.end(), rest.begin(), rest.end());
  }
  std::map<std::string, int32_t> index;
  for (size_t i = 0; i < label_names.size(); ++i) index[label_names[i]] = static_cast<int32_t>(i);
  std::vector<int32_t> pieces;
  for (const auto& t : s.sentences) {
    std::vector<int32_t> ids = {tok.vocab().cls()}, labels = {-1};
    std::vector<int64_t> first(t.words.size(), -1);
    bool cut = false;
    for (size_t w = 0; w < t.words.size(); ++w) {
      pieces.clear();
      tok.encode(t.words[w], pieces);
      if (pieces.empty()) continue;  // e.g. a space: no token, predicted "O"
      if (static_cast<int64_t>(ids.size() + pieces.size()) > seq_len - 1) {
        cut = true;
        break;
      }
      first[w] = static_cast<int64_t>(ids.size());
      int32_t label = -1;
      if (!t.tags.empty()) {
        auto it = index.find(t.tags[w]);
        label = it == index.end() ? -1 : it->second;  // a tag training never saw: not scored
      }
      for (size_t k = 0; k < pieces.size(); ++k) {
        ids.push_back(pieces[k]);
        labels.push_back(k == 0 ? label : -1);
      }
    }
    ids.push_back(tok.vocab().sep());
    labels.push_back(-1);
    out.truncated += cut;
    out.ids.push_back(std::move(ids));
    out.labels.push_back(std::move(labels));
    out.first_token.push_back(std::move(first));
  }
  out.label_names = std::move(label_names);
  return out;
}

std::vector<EntitySpan> entity_spans(const TaggedSentence& s,
                                     const std::vector<std::string>& tags) {
  std::vector<EntitySpan> out;
  std::u32string text;
  prep::unicode::decode(s.text, text);
  for (const Entity& e : tag_entities(tags)) {
    EntitySpan x{e.type, "", s.spans[e.begin].first, s.spans[e.end].second};
    prep::unicode::encode(text.substr(x.start, x.end - x.start), x.text);
    out.push_back(std::move(x));
  }
  return out;
}

}  // namespace bertrain::tasks
