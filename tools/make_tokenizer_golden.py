#!/usr/bin/env python3
"""Golden token ids from HuggingFace's BertTokenizer for bertrain's tokenizer test.

Each case is (text file, vocabulary, lower_case, line range). Files are read as bytes, split on
b"\\n", each line decoded as UTF-8 with errors="replace" (as bertrain reads corpora), and
tokenized; the ids go to tests/data/tokenizer/golden.json:
  {"cases": [{"file", "vocab", "lower_case", "lines": [[line_number, [ids...]], ...]}]}

  python tools/make_tokenizer_golden.py   (needs transformers)
"""
import json
import os

from transformers import BertTokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
UNCASED = "data/vocab/bert-base-uncased-vocab.txt"
CHINESE = "data/vocab/bert-base-chinese-vocab.txt"
CASES = [
    ("data/corpus/bert_sample_text.txt", UNCASED, True, 0, 10 ** 9),
    ("data/corpus/gutenberg/shakespeare-caesar.txt", UNCASED, True, 0, 400),  # Latin-1 bytes
    ("data/corpus/gutenberg/melville-moby_dick.txt", UNCASED, True, 0, 500),  # CRLF
    ("data/corpus/gutenberg/chesterton-thursday.txt", UNCASED, True, 0, 300),
    ("data/corpus/zh_CLUECorpusSmall_bert_sampled.txt", CHINESE, False, 0, 600),
    ("data/corpus/zh_CLUECorpusSmall_bert_sampled.txt", UNCASED, True, 600, 700),
    ("tests/data/tokenizer/edge_cases.txt", UNCASED, True, 0, 10 ** 9),
    ("tests/data/tokenizer/edge_cases.txt", CHINESE, False, 0, 10 ** 9),
]


def main():
    out = {"cases": []}
    toks = {}
    for path, vocab, lower, lo, hi in CASES:
        key = (vocab, lower)
        if key not in toks:
            toks[key] = BertTokenizer(os.path.join(ROOT, vocab), do_lower_case=lower)
        tok = toks[key]
        raw = open(os.path.join(ROOT, path), "rb").read().split(b"\n")
        lines = []
        for i in range(lo, min(hi, len(raw))):
            text = raw[i].decode("utf-8", errors="replace")
            lines.append([i, tok.convert_tokens_to_ids(tok.tokenize(text))])
        out["cases"].append({"file": path, "vocab": vocab, "lower_case": lower, "lines": lines})
        print(f"{path} ({os.path.basename(vocab)}, lower={lower}): {len(lines)} lines")
    dst = os.path.join(ROOT, "tests", "data", "tokenizer", "golden.json")
    with open(dst, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
