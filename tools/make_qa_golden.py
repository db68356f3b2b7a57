#!/usr/bin/env python3
"""Goldens for bertrain's extractive QA (tests/test_qa.cpp), from the reference implementations.

  data     tests/data/tasks/: the SQuAD v1.1 excerpt whole, the first articles of CMRC 2018 trial
           (dev set of the tests) and dev (training set of the tests and the demo), the first
           articles of DRCD dev (a one-line file with extra answer keys), cut from the whole
           files when --subsets-from names their directory (the layout of the team's data
           set: squad_v1.1_tiny/, cmrc2018/, drcd/; sources in tests/data/README.md); without
           it the committed excerpts are used as they are.
           (PROVENANCE.md there), written back in the source's own layout.
  offsets  HuggingFace's BertTokenizerFast offset_mapping for every context and question of
           those files and every line of tests/data/tokenizer/edge_cases.txt (lines where the fast
           tokenizer's ids differ from the slow BertTokenizer's, which applies NFC, are left out
           and counted).
  features prepare_train_features / prepare_validation_features of transformers'
           examples/pytorch/question-answering/run_qa.py, verbatim but for: the question is first
           cut to max_query_length tokens (Google's run_squad.py option, which run_qa lacks), an
           answer whose answer_start misses its text is moved to the text's nearest occurrence
           (as bertrain's loader does; CMRC 2018 has a few), and the walk to the start token stops
           at the window's last context token (run_qa's walk can step onto the final [SEP] when
           the answer starts in the window's last token).
  answers  postprocess_qa_predictions of run_qa's utils_qa.py on random float32 logits (no
           valid span: "" where utils_qa writes the placeholder "empty").
  metrics  the official SQuAD v1.1 evaluate-v1.1.py and CMRC 2018's cmrc2018_evaluate.py (ported
           to Python 3; NLTK's word_tokenize with preserve_line=True: answers are one sentence)
           on predictions made from the gold answers (exact, shifted, cut, widened, other spans).

  python tools/make_qa_golden.py   (needs transformers, numpy and nltk: /opt/torchvenv)

Scoring bertrain's own predictions with the official evaluations (the JSON lines that
`bertrain predict` writes for a QA model):
  python tools/make_qa_golden.py --score PREDICTIONS.jsonl DATA.json --metric squad|cmrc2018
"""
import collections
import json
import os
import re
import string

import numpy as np
from nltk.tokenize import word_tokenize
from transformers import BertTokenizer, BertTokenizerFast

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TASKS = os.path.join(ROOT, "tests", "data", "tasks")
UNCASED = "data/vocab/bert-base-uncased-vocab.txt"
CHINESE = "data/vocab/bert-base-chinese-vocab.txt"


# ---- data subsets ----

def head_articles(src, dst, max_questions, one_line=False):
    d = json.load(open(src, encoding="utf-8"))
    out, n = [], 0
    for art in d["data"]:
        if n >= max_questions:
            break
        out.append(art)
        n += sum(len(p["qas"]) for p in art["paragraphs"])
    d["data"] = out
    with open(dst, "w", encoding="utf-8") as f:
        if one_line:
            f.write(json.dumps(d, ensure_ascii=False))
        else:
            f.write(json.dumps(d, ensure_ascii=False, indent=2))
    return n


def write_data(qa_dir):
    os.makedirs(TASKS, exist_ok=True)
    src = os.path.join(qa_dir, "squad_v1.1_tiny", "squad.json")
    open(os.path.join(TASKS, "squad_v1.1_tiny.json"), "wb").write(open(src, "rb").read())
    n = head_articles(os.path.join(qa_dir, "cmrc2018", "cmrc2018_trial.json"),
                      os.path.join(TASKS, "cmrc2018_trial_head.json"), 120)
    print(f"cmrc2018_trial_head.json: {n} questions")
    n = head_articles(os.path.join(qa_dir, "cmrc2018", "cmrc2018_dev.json"),
                      os.path.join(TASKS, "cmrc2018_dev_head.json"), 700)
    print(f"cmrc2018_dev_head.json: {n} questions")
    n = head_articles(os.path.join(qa_dir, "drcd", "DRCD_dev.json"),
                      os.path.join(TASKS, "drcd_dev_head.json"), 30, one_line=True)
    print(f"drcd_dev_head.json: {n} questions")


def examples(path):
    d = json.load(open(path, encoding="utf-8"))
    out = []
    for art in d["data"]:
        for p in art["paragraphs"]:
            for qa in p["qas"]:
                out.append({"id": qa["id"], "question": qa["question"], "context": p["context"],
                            "answers": {"text": [a["text"] for a in qa["answers"]],
                                        "answer_start": [a["answer_start"] for a in qa["answers"]]}})
    return out


def locate(ex):
    # bertrain's loader: an answer_start that misses its text moves to the nearest occurrence.
    text, start, ctx = ex["answers"]["text"][0], ex["answers"]["answer_start"][0], ex["context"]
    if ctx[start:start + len(text)] == text:
        return start
    hits = [k for k in range(len(ctx)) if ctx.startswith(text, k)]
    return min(hits, key=lambda k: abs(k - start)) if hits else None


# ---- features: run_qa.py ----

def cut_question(tok, q, max_query_length):
    q = q.lstrip()
    enc = tok(q, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) <= max_query_length:
        return q, False
    return q[:enc["offset_mapping"][max_query_length - 1][1]], True


def features(tok, exs, seq_len, doc_stride, max_query_length):
    qs, cut = [], 0
    for ex in exs:
        q, c = cut_question(tok, ex["question"], max_query_length)
        qs.append(q)
        cut += c
    enc = tok(qs, [ex["context"] for ex in exs], truncation="only_second", max_length=seq_len,
              stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
              padding="max_length")
    out = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        ids = enc["input_ids"][i]
        seq_ids = enc.sequence_ids(i)
        ex = exs[enc["overflow_to_sample_mapping"][i]]
        cls_index = ids.index(tok.cls_token_id)
        ctx_start = 0
        while seq_ids[ctx_start] != 1:
            ctx_start += 1
        ctx_end = len(ids) - 1
        while seq_ids[ctx_end] != 1:
            ctx_end -= 1
        start_pos = end_pos = cls_index
        s = locate(ex)
        if s is not None:
            start_char, end_char = s, s + len(ex["answers"]["text"][0])
            if offsets[ctx_start][0] <= start_char and offsets[ctx_end][1] >= end_char:
                k = ctx_start
                while k <= ctx_end and offsets[k][0] <= start_char:
                    k += 1
                start_pos = k - 1
                k = ctx_end
                while offsets[k][1] >= end_char:
                    k -= 1
                end_pos = k + 1
        # The window as a range of the whole context's tokens (whose ids and offsets the offsets
        # golden holds): the feature is [CLS] question [SEP] context[w0:w1] [SEP].
        ctx = tok(ex["context"], add_special_tokens=False, return_offsets_mapping=True)
        w0 = ctx["offset_mapping"].index(offsets[ctx_start])
        w1 = w0 + ctx_end + 1 - ctx_start
        n = sum(enc["attention_mask"][i])
        q_ids = ids[1:ctx_start - 1]
        assert ids[:n] == [tok.cls_token_id] + q_ids + [tok.sep_token_id] + \
            ctx["input_ids"][w0:w1] + [tok.sep_token_id]
        assert [list(o) for o in offsets[ctx_start:ctx_end + 1]] == \
            [list(o) for o in ctx["offset_mapping"][w0:w1]]
        out.append({"example": enc["overflow_to_sample_mapping"][i], "question_ids": q_ids,
                    "window": [w0, w1], "start": start_pos, "end": end_pos})
    return out, cut


# ---- answers: utils_qa.py postprocess_qa_predictions (version_2_with_negative=False) ----

def postprocess(exs, feats, all_start_logits, all_end_logits, n_best_size=20, max_answer_length=30):
    features_per_example = collections.defaultdict(list)
    for i, f in enumerate(feats):
        features_per_example[f["example"]].append(i)
    all_predictions = []
    for example_index, example in enumerate(exs):
        prelim_predictions = []
        for feature_index in features_per_example[example_index]:
            start_logits = all_start_logits[feature_index]
            end_logits = all_end_logits[feature_index]
            f = feats[feature_index]
            offset_mapping = [None] * len(start_logits)
            for k, o in enumerate(f["offsets"]):
                offset_mapping[f["context_begin"] + k] = o
            start_indexes = np.argsort(start_logits)[-1: -n_best_size - 1: -1].tolist()
            end_indexes = np.argsort(end_logits)[-1: -n_best_size - 1: -1].tolist()
            for start_index in start_indexes:
                for end_index in end_indexes:
                    if (start_index >= len(offset_mapping) or end_index >= len(offset_mapping)
                            or offset_mapping[start_index] is None
                            or len(offset_mapping[start_index]) < 2
                            or offset_mapping[end_index] is None
                            or len(offset_mapping[end_index]) < 2):
                        continue
                    if end_index < start_index or end_index - start_index + 1 > max_answer_length:
                        continue
                    prelim_predictions.append({
                        "offsets": (offset_mapping[start_index][0], offset_mapping[end_index][1]),
                        "score": float(start_logits[start_index]) + float(end_logits[end_index])})
        predictions = sorted(prelim_predictions, key=lambda x: x["score"], reverse=True)[:n_best_size]
        context = example["context"]
        for pred in predictions:
            offsets = pred.pop("offsets")
            pred["text"] = context[offsets[0]: offsets[1]]
        if len(predictions) == 0:
            all_predictions.append("")  # utils_qa: "empty"
        else:
            all_predictions.append(predictions[0]["text"])
    return all_predictions


# ---- metrics: evaluate-v1.1.py ----

def normalize_answer(s):
    def remove_articles(text):
        return re.sub(r'\b(a|an|the)\b', ' ', text)

    def white_space_fix(text):
        return ' '.join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return ''.join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def squad_f1(prediction, ground_truth):
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def squad_em(prediction, ground_truth):
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def squad_scores(prediction, answers):
    return (float(max(squad_em(prediction, a) for a in answers)),
            float(max(squad_f1(prediction, a) for a in answers)))


# ---- metrics: cmrc2018_evaluate.py ----

SP_CHAR = ['-', ':', '_', '*', '^', '/', '\\', '~', '`', '+', '=',
           '，', '。', '：', '？', '！', '“', '”', '；', '’', '《', '》', '……', '·', '、',
           '「', '」', '（', '）', '－', '～', '『', '』']


def mixed_segmentation(in_str, rm_punc=False):
    in_str = in_str.lower().strip()
    segs_out = []
    temp_str = ""
    for char in in_str:
        if rm_punc and char in SP_CHAR:
            continue
        if re.search(r'[\u4e00-\u9fa5]', char) or char in SP_CHAR:
            if temp_str != "":
                segs_out.extend(word_tokenize(temp_str, preserve_line=True))
                temp_str = ""
            segs_out.append(char)
        else:
            temp_str += char
    if temp_str != "":
        segs_out.extend(word_tokenize(temp_str, preserve_line=True))
    return segs_out


def remove_punctuation(in_str):
    in_str = in_str.lower().strip()
    return ''.join(c for c in in_str if c not in SP_CHAR)


def find_lcs(s1, s2):
    m = [[0 for i in range(len(s2) + 1)] for j in range(len(s1) + 1)]
    mmax = 0
    p = 0
    for i in range(len(s1)):
        for j in range(len(s2)):
            if s1[i] == s2[j]:
                m[i + 1][j + 1] = m[i][j] + 1
                if m[i + 1][j + 1] > mmax:
                    mmax = m[i + 1][j + 1]
                    p = i + 1
    return s1[p - mmax:p], mmax


def cmrc_f1(answers, prediction):
    f1_scores = []
    for ans in answers:
        ans_segs = mixed_segmentation(ans, rm_punc=True)
        prediction_segs = mixed_segmentation(prediction, rm_punc=True)
        lcs, lcs_len = find_lcs(ans_segs, prediction_segs)
        if lcs_len == 0:
            f1_scores.append(0)
            continue
        precision = 1.0 * lcs_len / len(prediction_segs)
        recall = 1.0 * lcs_len / len(ans_segs)
        f1_scores.append((2 * precision * recall) / (precision + recall))
    return max(f1_scores)


def cmrc_em(answers, prediction):
    for ans in answers:
        if remove_punctuation(ans) == remove_punctuation(prediction):
            return 1
    return 0


def cmrc_scores(prediction, answers):
    return float(cmrc_em(answers, prediction)), float(cmrc_f1(answers, prediction))


def metric_predictions(exs, rng):
    # Predictions made from the gold answers: exact, a few characters shifted either way, cut,
    # widened with punctuation, upper-cased, another span of the context, empty.
    out = []
    for i, ex in enumerate(exs):
        ctx, text = ex["context"], ex["answers"]["text"][0]
        s = locate(ex)
        if s is None:
            s = 0
        e = s + len(text)
        cands = {text, ctx[max(0, s - 3):e], ctx[s:min(len(ctx), e + 4)], text[:max(1, len(text) // 2)],
                 " " + text.upper() + ". ", "the " + text, ctx[max(0, s - 12):max(0, s - 2)], ""}
        for c in sorted(cands):
            out.append([i, c])
    rng.shuffle(out)
    return out


def score_predictions(pred_path, data_path, metric):
    preds = {}
    for line in open(pred_path, encoding="utf-8"):
        p = json.loads(line)
        preds[p["id"]] = p["answer"]
    d = json.load(open(data_path, encoding="utf-8"))
    em = f1 = total = 0
    for art in d["data"]:
        for para in art["paragraphs"]:
            for qa in para["qas"]:
                total += 1
                answers = [a["text"] for a in qa["answers"]]
                if qa["id"] not in preds:
                    continue
                if metric == "squad":
                    e, f = squad_scores(preds[qa["id"]], answers)
                else:
                    e, f = cmrc_scores(preds[qa["id"]], answers)
                em += e
                f1 += f
    print(f"{metric} official evaluation: exact match {100.0 * em / total:.2f}, "
          f"F1 {100.0 * f1 / total:.2f} ({total} questions)")


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--score", nargs=2, metavar=("PREDICTIONS", "DATA"))
    ap.add_argument("--metric", default="squad", choices=["squad", "cmrc2018"])
    ap.add_argument("--subsets-from", metavar="QA_DIR",
                    help="rewrite the excerpts under tests/data/tasks from these whole files")
    args = ap.parse_args()
    if args.score:
        score_predictions(args.score[0], args.score[1], args.metric)
        return
    if args.subsets_from:
        write_data(args.subsets_from)
    rng = np.random.default_rng(2026)
    slow, fast = {}, {}
    for vocab in (UNCASED, CHINESE):
        lower = vocab == UNCASED
        slow[vocab] = BertTokenizer(os.path.join(ROOT, vocab), do_lower_case=lower)
        fast[vocab] = BertTokenizerFast(os.path.join(ROOT, vocab), do_lower_case=lower)
    cases = [
        ("tests/data/tasks/squad_v1.1_tiny.json", UNCASED, 64, 16, 16, "squad", 5, 5),
        ("tests/data/tasks/cmrc2018_trial_head.json", CHINESE, 128, 32, 32, "cmrc2018", 6, 30),
        ("tests/data/tasks/drcd_dev_head.json", CHINESE, 96, 24, 16, "cmrc2018", 4, 20),
    ]
    # (file, vocab, seq_len, doc_stride, max_query_length, metric, questions answered from random
    # logits, questions whose features are kept): the goldens stay small
    golden = {"offsets": [], "qa": []}
    # offsets
    texts = []
    for path, vocab, *_, n_feats in cases:
        exs = examples(os.path.join(ROOT, path))[:n_feats]
        seen = set()
        for ex in exs:
            for t in (ex["context"], ex["question"]):
                if t not in seen:
                    seen.add(t)
                    texts.append((vocab, t))
    edge = open(os.path.join(ROOT, "tests/data/tokenizer/edge_cases.txt"), "rb").read().split(b"\n")
    for line in edge:
        t = line.decode("utf-8", errors="replace")
        texts.append((UNCASED, t))
        texts.append((CHINESE, t))
    left_out = 0
    for vocab, t in texts:
        enc = fast[vocab](t, add_special_tokens=False, return_offsets_mapping=True)
        if enc["input_ids"] != slow[vocab].convert_tokens_to_ids(slow[vocab].tokenize(t)):
            left_out += 1
            continue
        golden["offsets"].append({"vocab": vocab, "lower_case": vocab == UNCASED, "text": t,
                                  "ids": enc["input_ids"],
                                  "offsets": [list(o) for o in enc["offset_mapping"]]})
    print(f"offsets: {len(golden['offsets'])} texts, {left_out} left out (fast != slow ids)")
    for path, vocab, seq_len, stride, max_query, metric, n_answers, n_feats in cases:
        exs = examples(os.path.join(ROOT, path))
        train_exs = [ex for ex in exs if ex["answers"]["text"] and locate(ex) is not None]
        train_exs = train_exs[:n_feats]
        feats, cut = features(fast[vocab], train_exs, seq_len, stride, max_query)
        # answers from random logits over the first n_answers questions' features
        few = train_exs[:n_answers]
        few_feats = [f for f in feats if f["example"] < n_answers]
        for f in few_feats:  # postprocess reads the window's offsets
            ctx = fast[vocab](train_exs[f["example"]]["context"], add_special_tokens=False,
                              return_offsets_mapping=True)["offset_mapping"]
            f["context_begin"] = 1 + len(f["question_ids"]) + 1
            f["offsets"] = ctx[f["window"][0]:f["window"][1]]
        starts = [rng.normal(size=seq_len).astype(np.float32) for _ in few_feats]
        ends = [rng.normal(size=seq_len).astype(np.float32) for _ in few_feats]
        answers = postprocess(few, few_feats, starts, ends)
        for f in few_feats:
            del f["context_begin"], f["offsets"]
        preds = metric_predictions(exs, rng)
        score = squad_scores if metric == "squad" else cmrc_scores
        scored = [[i, p, *score(p, exs[i]["answers"]["text"])] for i, p in preds]
        golden["qa"].append({
            "file": path, "questions": n_feats, "vocab": vocab, "lower_case": vocab == UNCASED, "seq_len": seq_len,
            "doc_stride": stride, "max_query_length": max_query, "metric": metric,
            "truncated_questions": cut, "features": feats, "answer_questions": n_answers,
            "start_logits": [[float(str(x)) for x in s] for s in starts],
            "end_logits": [[float(str(x)) for x in e] for e in ends], "answers": answers,
            "predictions": scored})
        print(f"{path}: {len(train_exs)} questions, {len(feats)} features ({cut} questions cut), "
              f"{len(preds)} scored predictions")
    dst = os.path.join(ROOT, "tests", "golden", "qa", "golden.json")
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, separators=(",", ":"))
    print(f"wrote {dst} ({os.path.getsize(dst)} bytes)")


if __name__ == "__main__":
    main()
