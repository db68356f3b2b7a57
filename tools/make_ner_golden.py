#!/usr/bin/env python3
"""Reference entities and scores for bertrain's NER tests, computed by seqeval (the metric
HuggingFace's run_ner reports), and a check of bertrain's own predictions against it.

  golden: writes tests/golden/metrics/ner.json: tag sequences (CLUENER dev's first 200 sentences
          tagged BIO from their spans, CoNLL-2003 valid's first sentences, BIOES/BMES and
          ill-formed sequences) with seqeval's get_entities per sentence, and precision/recall/F1
          of the gold tags against a perturbed copy (tags dropped, types swapped, I- without B-).
  check INPUT PRED: INPUT is the labelled file given to `bertrain predict` (CLUENER .json or
          CoNLL columns), PRED its output (JSON lines with "tags"); prints seqeval's micro
          precision, recall and F1 of bertrain's predictions, to compare with what it printed.

  /opt/torchvenv/bin/python tools/make_ner_golden.py golden
"""
import json
import os
import random
import sys

from seqeval.metrics import f1_score, precision_score, recall_score
from seqeval.metrics.sequence_labeling import get_entities

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TASKS = os.path.join(ROOT, "tests", "data", "tasks")


def cluener_tags(path):
    out = []
    for line in open(path, encoding="utf-8"):
        j = json.loads(line)
        tags = ["O"] * len(j["text"])
        for typ, ents in j.get("label", {}).items():
            for name, spans in ents.items():
                for b, e in spans:
                    tags[b] = "B-" + typ
                    for k in range(b + 1, e + 1):
                        tags[k] = "I-" + typ
        out.append(tags)
    return out


def conll_tags(path):
    out, cur = [], []
    for line in open(path, encoding="utf-8"):
        cols = line.split()
        if not cols or cols[0] == "-DOCSTART-":
            if cur:
                out.append(cur)
            cur = []
            continue
        cur.append(cols[-1])
    if cur:
        out.append(cur)
    return out


def perturb(seqs, rng):
    out = []
    for tags in seqs:
        t = list(tags)
        for i in range(len(t)):
            r = rng.random()
            if r < 0.05:
                t[i] = "O"
            elif r < 0.08 and t[i] != "O":
                t[i] = t[i][0] + "-MISC"
            elif r < 0.10:
                t[i] = "I-" + rng.choice(["PER", "LOC", "name", "address"])
        out.append(t)
    return out


def golden():
    rng = random.Random(5)
    cluener = cluener_tags(os.path.join(TASKS, "cluener_dev_head200.json"))
    conll = conll_tags(os.path.join(TASKS, "conll2003_valid_head2000.txt"))
    odd = [["S-PER", "B-LOC", "M-LOC", "E-LOC", "O", "I-ORG", "I-ORG", "E-ORG", "S-X"],
           ["B-PER", "I-LOC", "I-LOC", "O", "E-PER", "B-A", "B-A", "I-A", "O", "I-B"],
           ["B-PER"], ["I-PER", "I-PER"], ["O", "O"], []]
    cases = []
    for name, gold in (("cluener_dev_head200", cluener), ("conll2003_valid_head2000", conll),
                       ("ill_formed_and_bioes", odd)):
        pred = perturb(gold, rng)
        cases.append({
            "name": name, "gold": gold, "pred": pred,
            "gold_entities": [[list(e) for e in get_entities(t)] for t in gold],
            "pred_entities": [[list(e) for e in get_entities(t)] for t in pred],
            "precision": precision_score(gold, pred), "recall": recall_score(gold, pred),
            "f1": f1_score(gold, pred)})
        print(name, len(gold), "sentences: p/r/f1", cases[-1]["precision"], cases[-1]["recall"],
              cases[-1]["f1"])
    out = os.path.join(ROOT, "tests", "golden", "metrics", "ner.json")
    with open(out, "w") as f:
        json.dump({"made_by": "seqeval " + __import__("seqeval").__version__ if hasattr(
            __import__("seqeval"), "__version__") else "seqeval", "cases": cases}, f)
        f.write("\n")


def check(input_file, pred_file):
    gold = cluener_tags(input_file) if input_file.endswith(".json") else conll_tags(input_file)
    pred = [json.loads(l)["tags"] for l in open(pred_file) if l.strip()]
    print(f"seqeval: precision {precision_score(gold, pred):.4f}, recall "
          f"{recall_score(gold, pred):.4f}, f1 {f1_score(gold, pred):.4f} on {len(gold)} sentences")


if __name__ == "__main__":
    if sys.argv[1:2] == ["golden"]:
        golden()
    elif sys.argv[1:2] == ["check"] and len(sys.argv) == 4:
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
