#include "tasks/qa.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "core/setting.h"
#include "data/storage.h"
#include "prep/unicode.h"
#include "tasks/task_files.h"

namespace bertrain::tasks {

namespace unicode = prep::unicode;

namespace {

std::u32string decoded(const std::string& s) {
  std::u32string u;
  unicode::decode(s, u);
  return u;
}

std::string encoded(std::u32string_view u) {
  std::string s;
  unicode::encode(u, s);
  return s;
}

// Python's str.split(): words between runs of whitespace.
std::vector<std::u32string> split_words(std::u32string_view s) {
  std::vector<std::u32string> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && unicode::is_python_space(s[i])) ++i;
    size_t j = i;
    while (j < s.size() && !unicode::is_python_space(s[j])) ++j;
    if (j > i) out.emplace_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

// Python's str.strip() of whitespace.
std::u32string strip(std::u32string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && unicode::is_python_space(s[b])) ++b;
  while (e > b && unicode::is_python_space(s[e - 1])) --e;
  return std::u32string(s.substr(b, e - b));
}

// The highest n values' indices, highest first (numpy's argsort()[-1:-n-1:-1]).
std::vector<int32_t> top_indices(const std::vector<float>& v, int64_t n) {
  std::vector<int32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  const auto k = static_cast<ptrdiff_t>(std::min<size_t>(static_cast<size_t>(n), v.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return v[a] != v[b] ? v[a] > v[b] : a > b; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

// ---- the official SQuAD v1.1 evaluation's normalize_answer ----

bool squad_punctuation(char32_t c) {  // Python's string.punctuation
  return (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
         (c >= 123 && c <= 126);
}

// lower, remove punctuation, re.sub(r"\b(a|an|the)\b", " "), " ".join(split()): the words.
std::vector<std::u32string> squad_words(const std::string& s) {
  std::u32string t;
  for (char32_t c : unicode::lower(decoded(s)))
    if (!squad_punctuation(c)) t.push_back(c);
  static const std::u32string kArticles[] = {U"a", U"an", U"the"};
  std::u32string out;
  for (size_t i = 0; i < t.size();) {
    bool matched = false;
    if (i == 0 || !unicode::is_word_char(t[i - 1]))
      for (const auto& a : kArticles) {
        const size_t n = a.size();
        if (t.compare(i, n, a) == 0 && (i + n == t.size() || !unicode::is_word_char(t[i + n]))) {
          out.push_back(U' ');
          i += n;
          matched = true;
          break;
        }
      }
    if (!matched) out.push_back(t[i++]);
  }
  return split_words(out);
}

double squad_f1(const std::vector<std::u32string>& pred, const std::vector<std::u32string>& gold) {
  std::map<std::u32string, int64_t> count;
  for (const auto& w : gold) ++count[w];
  int64_t same = 0;
  for (const auto& w : pred) {
    auto it = count.find(w);
    if (it != count.end() && it->second > 0) {
      --it->second;
      ++same;
    }
  }
  if (same == 0) return 0.0;
  const double precision = static_cast<double>(same) / static_cast<double>(pred.size());
  const double recall = static_cast<double>(same) / static_cast<double>(gold.size());
  return 2 * precision * recall / (precision + recall);
}

// ---- CMRC 2018's official evaluation ----

bool cmrc_punctuation(char32_t c) {  // its sp_char list ('……' is two characters: never one)
  static const std::u32string kChars = U"-:_*^/\\~`+=，。：？！“”；’《》·、「」（）－～『』";
  return kChars.find(c) != std::u32string::npos;
}

bool cmrc_chinese(char32_t c) {  // its [\u4e00-\u9fa5]
  return c >= 0x4e00 && c <= 0x9fa5;
}

// NLTK's word_tokenize on the text between Chinese characters, by its Treebank rules that such
// text meets: brackets, quotes and ;@#$%&?! are tokens of their own, so are , and : unless a
// digit follows, and the text's final period.
void treebank_words(std::u32string_view s, std::vector<std::u32string>& out) {
  static const std::u32string kAlone = U"()[]{}<>;@#$%&?!\"";
  const std::vector<std::u32string> words = split_words(s);
  for (size_t w = 0; w < words.size(); ++w) {
    std::u32string word = words[w];
    bool final_period = false;
    if (w + 1 == words.size() && word.size() > 1 && word.back() == '.' &&
        word[word.size() - 2] != '.') {
      final_period = true;
      word.pop_back();
    }
    std::u32string run;
    for (size_t k = 0; k < word.size(); ++k) {
      const char32_t c = word[k];
      const bool alone = kAlone.find(c) != std::u32string::npos ||
                         ((c == ',' || c == ':') &&
                          (k + 1 == word.size() || word[k + 1] < '0' || word[k + 1] > '9'));
      if (!alone) {
        run.push_back(c);
        continue;
      }
      if (!run.empty()) out.push_back(std::move(run));
      run.clear();
      out.emplace_back(1, c);
    }
    if (!run.empty()) out.push_back(std::move(run));
    if (final_period) out.emplace_back(U".");
  }
}

std::vector<std::u32string> cmrc_segments(const std::string& s) {
  const std::u32string t = strip(unicode::lower(decoded(s)));
  std::vector<std::u32string> out;
  std::u32string pending;
  for (char32_t c : t) {
    if (cmrc_punctuation(c)) continue;  // rm_punc
    if (cmrc_chinese(c)) {
      treebank_words(pending, out);
      pending.clear();
      out.emplace_back(1, c);
    } else {
      pending.push_back(c);
    }
  }
  treebank_words(pending, out);
  return out;
}

std::u32string cmrc_without_punctuation(const std::string& s) {
  std::u32string out;
  for (char32_t c : strip(unicode::lower(decoded(s))))
    if (!cmrc_punctuation(c)) out.push_back(c);
  return out;
}

// Length of the longest common contiguous run of segments (its find_lcs).
int64_t longest_common_run(const std::vector<std::u32string>& a,
                           const std::vector<std::u32string>& b) {
  std::vector<int64_t> prev(b.size() + 1, 0), cur(b.size() + 1, 0);
  int64_t best = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < b.size(); ++j) {
      cur[j + 1] = a[i] == b[j] ? prev[j] + 1 : 0;
      best = std::max(best, cur[j + 1]);
    }
    std::swap(prev, cur);
  }
  return best;
}

}  // namespace

std::string QaSet::skipped_summary(const std::string& file) const {
  return tasks::skipped_summary(skipped, skipped_reasons, file, "question");
}

QaSet read_squad(const std::string& path, bool training) {
  std::istringstream in(data::read_all(path));  // a file or an object (s3://, oss://)
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not a JSON document (", e.what(), "); a SQuAD file is one JSON object");
  }
  if (!j.is_object() || !j.contains("data") || !j["data"].is_array())
    fail(path,
         ": no \"data\" list (a SQuAD v1.1 file is {\"data\": [{\"paragraphs\": [{\"context\", "
         "\"qas\": [...]}]}]})");
  QaSet s;
  auto skip = [&](const std::string& where, const std::string& why) {
    ++s.skipped;
    if (s.skipped_reasons.size() < 5)
      s.skipped_reasons.push_back(str(path, ": ", where, ": ", why));
  };
  const auto& data = j["data"];
  for (size_t a = 0; a < data.size(); ++a) {
    const auto& article = data[a];
    if (!article.is_object() || !article.contains("paragraphs") ||
        !article["paragraphs"].is_array()) {
      skip(str("data[", a, "]"), "no \"paragraphs\" list");
      continue;
    }
    const auto& paragraphs = article["paragraphs"];
    for (size_t p = 0; p < paragraphs.size(); ++p) {
      const auto& para = paragraphs[p];
      const std::string where_p = str("data[", a, "].paragraphs[", p, "]");
      if (!para.is_object() || !para.contains("context") || !para["context"].is_string() ||
          !para.contains("qas") || !para["qas"].is_array()) {
        skip(where_p, "no \"context\" string or no \"qas\" list");
        continue;
      }
      const std::string context = para["context"].get<std::string>();
      const std::u32string ctx = decoded(context);
      const auto& qas = para["qas"];
      for (size_t q = 0; q < qas.size(); ++q) {
        const auto& qa = qas[q];
        std::string where = str(where_p, ".qas[", q, "]");
        if (!qa.is_object() || !qa.contains("question") || !qa["question"].is_string() ||
            !qa.contains("id")) {
          skip(where, "no \"id\" or no \"question\" string");
          continue;
        }
        QaExample ex;
        ex.id = qa["id"].is_string() ? qa["id"].get<std::string>() : qa["id"].dump();
        where += " (id " + ex.id + ")";
        ex.question = qa["question"].get<std::string>();
        ex.context = context;
        int64_t first_start = -1;
        bool bad_answer = false;
        if (qa.contains("answers") && qa["answers"].is_array()) {
          for (const auto& ans : qa["answers"]) {
            if (!ans.is_object() || !ans.contains("text") || !ans["text"].is_string()) {
              bad_answer = true;
              continue;
            }
            if (ex.answers.empty() && ans.contains("answer_start") &&
                ans["answer_start"].is_number_integer())
              first_start = ans["answer_start"].get<int64_t>();
            ex.answers.push_back(ans["text"].get<std::string>());
          }
        }
        if (bad_answer) {
          skip(where, "an answer without a \"text\" string");
          continue;
        }
        if (!ex.answers.empty()) {
          // Locate the first answer: at answer_start when the text is there, else the text's
          // occurrence nearest to it (CMRC 2018 has a few offsets that miss their text).
          const std::u32string ans = decoded(ex.answers[0]);
          if (!ans.empty()) {
            if (first_start >= 0 &&
                first_start + static_cast<int64_t>(ans.size()) <=
                    static_cast<int64_t>(ctx.size()) &&
                ctx.compare(static_cast<size_t>(first_start), ans.size(), ans) == 0) {
              ex.answer_begin = first_start;
            } else {
              int64_t best = -1;
              for (size_t k = ctx.find(ans); k != std::u32string::npos; k = ctx.find(ans, k + 1))
                if (best < 0 || std::llabs(static_cast<int64_t>(k) - first_start) <
                                    std::llabs(best - first_start))
                  best = static_cast<int64_t>(k);
              ex.answer_begin = best;
              if (best >= 0) ++s.moved;
            }
            if (ex.answer_begin >= 0)
              ex.answer_end = ex.answer_begin + static_cast<int64_t>(ans.size());
          }
        }
        if (training) {
          if (ex.answers.empty()) {
            skip(where,
                 "no answer to learn from (SQuAD v2's unanswerable questions are not "
                 "supported)");
            continue;
          }
          if (ex.answer_begin < 0) {
            skip(where, str("the answer '", ex.answers[0], "' is not in the context"));
            continue;
          }
        }
        s.examples.push_back(std::move(ex));
      }
    }
  }
  if (s.examples.empty())
    fail(path, " has no usable questions",
         s.skipped_reasons.empty() ? "" : " (" + s.skipped_reasons[0] + ")");
  return s;
}

QaOptions resolve_qa_options(QaOptions o) {
  if (o.max_query_length <= 0) fail(setting("max_query_length"), " must be positive");
  if (o.max_answer_length <= 0) fail(setting("max_answer_length"), " must be positive");
  if (o.n_best <= 0) fail(setting("n_best"), " must be positive");
  if (o.metric != "squad" && o.metric != "cmrc2018")
    fail("the QA metric must be squad or cmrc2018, got '", o.metric, "'");
  const int64_t room = o.seq_len - o.max_query_length - 3;  // [CLS] q [SEP] ... [SEP]
  if (room < 2)
    fail(setting("seq_len"), " ", o.seq_len, " leaves no room for the context after a question of ",
         setting("max_query_length"), " ", o.max_query_length, " tokens");
  if (o.doc_stride < 0) o.doc_stride = std::min<int64_t>(128, room / 2);
  if (o.doc_stride >= room)
    fail(setting("doc_stride"), " ", o.doc_stride,
         " must be smaller than the context tokens of a window (", setting("seq_len"), " - ",
         setting("max_query_length"), " - 3 = ", room, ")");
  return o;
}

QaFeatures make_qa_features(const QaSet& s, const prep::Tokenizer& tok, const QaOptions& o) {
  QaFeatures out;
  std::vector<int32_t> q, c;
  std::vector<prep::CharSpan> offsets;
  const std::string* last_context = nullptr;
  for (size_t e = 0; e < s.examples.size(); ++e) {
    const QaExample& ex = s.examples[e];
    q.clear();
    tok.encode(ex.question, q);
    if (static_cast<int64_t>(q.size()) > o.max_query_length) {
      q.resize(static_cast<size_t>(o.max_query_length));
      ++out.truncated_questions;
    }
    if (!last_context || *last_context != ex.context) {  // a paragraph's questions share it
      c.clear();
      offsets.clear();
      tok.encode_with_offsets(ex.context, c, offsets);
      last_context = &ex.context;
    }
    const int64_t L = static_cast<int64_t>(c.size());
    const int64_t room = o.seq_len - static_cast<int64_t>(q.size()) - 3;
    const int64_t step = room - o.doc_stride;  // > 0: resolve_qa_options
    for (int64_t w0 = 0;; w0 += step) {
      const int64_t w1 = std::min(L, w0 + room);
      QaFeature f;
      f.example = static_cast<int64_t>(e);
      f.ids.push_back(tok.vocab().cls());
      f.ids.insert(f.ids.end(), q.begin(), q.end());
      f.ids.push_back(tok.vocab().sep());
      f.context_begin = static_cast<int32_t>(f.ids.size());
      f.ids.insert(f.ids.end(), c.begin() + w0, c.begin() + w1);
      f.ids.push_back(tok.vocab().sep());
      f.offsets.assign(offsets.begin() + w0, offsets.begin() + w1);
      // Labels: the tokens holding the answer's first and last characters when the window holds
      // all of it, else [CLS].
      if (ex.answer_begin >= 0 && w1 > w0 && offsets[w0].begin <= ex.answer_begin &&
          offsets[w1 - 1].end >= ex.answer_end) {
        int64_t a = w0, b = w1 - 1;
        while (a + 1 < w1 && offsets[a + 1].begin <= ex.answer_begin) ++a;
        while (b - 1 >= w0 && offsets[b - 1].end >= ex.answer_end) --b;
        f.start = static_cast<int32_t>(f.context_begin + a - w0);
        f.end = static_cast<int32_t>(f.context_begin + b - w0);
      }
      out.features.push_back(std::move(f));
      if (w1 >= L) break;
    }
  }
  return out;
}

std::vector<QaAnswer> best_answers(const QaSet& s, const QaFeatures& f,
                                   const std::vector<std::vector<float>>& start_logits,
                                   const std::vector<std::vector<float>>& end_logits,
                                   const QaOptions& o) {
  BT_CHECK(start_logits.size() == f.features.size() && end_logits.size() == f.features.size(),
           "one row of start and end logits per feature");
  struct Candidate {
    double score;
    int64_t begin, end;
  };
  std::vector<std::vector<Candidate>> found(s.examples.size());
  for (size_t i = 0; i < f.features.size(); ++i) {
    const QaFeature& x = f.features[i];
    const int64_t lo = x.context_begin, hi = lo + static_cast<int64_t>(x.offsets.size());
    const std::vector<int32_t> starts = top_indices(start_logits[i], o.n_best);
    const std::vector<int32_t> ends = top_indices(end_logits[i], o.n_best);
    for (int32_t a : starts)
      for (int32_t b : ends) {
        if (a < lo || a >= hi || b < lo || b >= hi) continue;  // not a context token
        if (b < a || b - a + 1 > o.max_answer_length) continue;
        found[static_cast<size_t>(x.example)].push_back(
            {static_cast<double>(start_logits[i][a]) + end_logits[i][b], x.offsets[a - lo].begin,
             x.offsets[b - lo].end});
      }
  }
  std::vector<QaAnswer> out(s.examples.size());
  for (size_t e = 0; e < out.size(); ++e) {
    if (found[e].empty()) continue;  // no valid span: an empty answer
    // The highest score; among equal scores the first found (Python's stable sorted()).
    std::stable_sort(found[e].begin(), found[e].end(),
                     [](const Candidate& a, const Candidate& b) { return a.score > b.score; });
    const Candidate& c = found[e].front();
    const std::u32string ctx = decoded(s.examples[e].context);
    out[e] = {encoded(std::u32string_view(ctx).substr(static_cast<size_t>(c.begin),
                                                      static_cast<size_t>(c.end - c.begin))),
              c.begin, c.end, c.score};
  }
  return out;
}

namespace {

// Percent over every question of the set: score(prediction, answers) gives its (EM, F1), the
// best over its answers.
template <typename F>
QaScores percent_over_questions(const QaSet& s, const std::vector<std::string>& predictions,
                                F&& score) {
  BT_CHECK(predictions.size() == s.examples.size(), "one prediction per question");
  QaScores r;
  for (size_t e = 0; e < s.examples.size(); ++e) {
    const auto [em, f1] = score(predictions[e], s.examples[e].answers);
    r.exact_match += em;
    r.f1 += f1;
    ++r.total;
  }
  if (r.total) {
    r.exact_match *= 100.0 / static_cast<double>(r.total);
    r.f1 *= 100.0 / static_cast<double>(r.total);
  }
  return r;
}

}  // namespace

QaScores squad_scores(const QaSet& s, const std::vector<std::string>& predictions) {
  return percent_over_questions(s, predictions,
                                [](const std::string& p, const std::vector<std::string>& answers) {
                                  const std::vector<std::u32string> pred = squad_words(p);
                                  double em = 0, f1 = 0;
                                  for (const auto& a : answers) {
                                    const std::vector<std::u32string> gold = squad_words(a);
                                    em = std::max(em, pred == gold ? 1.0 : 0.0);
                                    f1 = std::max(f1, squad_f1(pred, gold));
                                  }
                                  return std::pair{em, f1};
                                });
}

QaScores cmrc_scores(const QaSet& s, const std::vector<std::string>& predictions) {
  return percent_over_questions(
      s, predictions, [](const std::string& p, const std::vector<std::string>& answers) {
        const std::vector<std::u32string> pred = cmrc_segments(p);
        const std::u32string pred_text = cmrc_without_punctuation(p);
        double em = 0, f1 = 0;
        for (const auto& a : answers) {
          const std::vector<std::u32string> gold = cmrc_segments(a);
          const int64_t common = longest_common_run(gold, pred);
          if (common > 0) {
            const double precision = static_cast<double>(common) / static_cast<double>(pred.size());
            const double recall = static_cast<double>(common) / static_cast<double>(gold.size());
            f1 = std::max(f1, 2 * precision * recall / (precision + recall));
          }
          if (cmrc_without_punctuation(a) == pred_text) em = 1;
        }
        return std::pair{em, f1};
      });
}

QaScores qa_scores(const QaSet& s, const std::vector<std::string>& predictions,
                   const std::string& metric) {
  return metric == "cmrc2018" ? cmrc_scores(s, predictions) : squad_scores(s, predictions);
}

}  // namespace bertrain::tasks
