#!/usr/bin/env python3
"""The Python reference for `bertrain prepare`: Google BERT's create_pretraining_data.py
algorithm (documents, NSP pairs, truncation, 80/10/10 masking, dupe_factor) with HuggingFace's
BertTokenizer (--fast: BertTokenizerFast, batched) and TensorFlow's TFRecordWriter, as users run
it. Prints one JSON line with documents/s."""
import argparse
import collections
import json
import os
import random
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402
from transformers import BertTokenizer, BertTokenizerFast  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--input", required=True)
ap.add_argument("--vocab", required=True)
ap.add_argument("--output", required=True)
ap.add_argument("--seq-len", type=int, default=128)
ap.add_argument("--max-predictions", type=int, default=20)
ap.add_argument("--dupe-factor", type=int, default=5)
ap.add_argument("--lower-case", type=int, default=1)
ap.add_argument("--fast", action="store_true")
a = ap.parse_args()

t0 = time.perf_counter()
tok = (BertTokenizerFast if a.fast else BertTokenizer)(a.vocab, do_lower_case=bool(a.lower_case))
vocab_words = list(tok.vocab.keys())
rng = random.Random(12345)
lines = [l.decode("utf-8", "replace").strip() for l in open(a.input, "rb")]
docs, cur = [], []
texts = [l for l in lines if l]
if a.fast:
    ids_all = iter(tok(texts, add_special_tokens=False)["input_ids"])
for line in lines:
    if not line:
        if cur:
            docs.append(cur)
        cur = []
        continue
    ids = next(ids_all) if a.fast else tok.convert_tokens_to_ids(tok.tokenize(line))
    if ids:
        cur.append(ids)
if cur:
    docs.append(cur)
rng.shuffle(docs)
CLS, SEP, MASK = tok.cls_token_id, tok.sep_token_id, tok.mask_token_id
MLM = collections.namedtuple("MLM", ["index", "label"])


def mask(tokens):
    cand = [[i] for i, t in enumerate(tokens) if t not in (CLS, SEP)]
    rng.shuffle(cand)
    out = list(tokens)
    n = min(a.max_predictions, max(1, int(round(len(tokens) * 0.15))))
    lms, covered = [], set()
    for s in cand:
        if len(lms) >= n:
            break
        if len(lms) + len(s) > n or any(i in covered for i in s):
            continue
        for i in s:
            covered.add(i)
            if rng.random() < 0.8:
                m = MASK
            elif rng.random() < 0.5:
                m = tokens[i]
            else:
                m = rng.randint(0, len(vocab_words) - 1)
            out[i] = m
            lms.append(MLM(i, tokens[i]))
    lms.sort(key=lambda x: x.index)
    return out, [m.index for m in lms], [m.label for m in lms]


def instances(di):
    doc, max_tokens = docs[di], a.seq_len - 3
    target = rng.randint(2, max_tokens) if rng.random() < 0.1 else max_tokens
    res, chunk, length, i = [], [], 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                ta = [t for s in chunk[:a_end] for t in s]
                tb, rnd = [], False
                if len(chunk) == 1 or rng.random() < 0.5:
                    rnd = True
                    for _ in range(10):
                        r = rng.randint(0, len(docs) - 1)
                        if r != di:
                            break
                    rd = docs[r]
                    for j in range(rng.randint(0, len(rd) - 1), len(rd)):
                        tb.extend(rd[j])
                        if len(tb) >= target - len(ta):
                            break
                    i -= len(chunk) - a_end
                else:
                    tb = [t for s in chunk[a_end:] for t in s]
                while len(ta) + len(tb) > max_tokens:
                    t = ta if len(ta) > len(tb) else tb
                    if rng.random() < 0.5:
                        del t[0]
                    else:
                        t.pop()
                if ta and tb:
                    tokens = [CLS] + ta + [SEP] + tb + [SEP]
                    seg = [0] * (len(ta) + 2) + [1] * (len(tb) + 1)
                    out, pos, lab = mask(tokens)
                    res.append((out, seg, rnd, pos, lab))
            chunk, length = [], 0
        i += 1
    return res


insts = []
for _ in range(a.dupe_factor):
    for di in range(len(docs)):
        insts.extend(instances(di))
rng.shuffle(insts)


def feat(v, f=False):
    return tf.train.Feature(float_list=tf.train.FloatList(value=v)) if f else \
        tf.train.Feature(int64_list=tf.train.Int64List(value=v))


T, P = a.seq_len, a.max_predictions
os.makedirs(a.output, exist_ok=True)
with tf.io.TFRecordWriter(os.path.join(a.output, "peer.tfrecord")) as w:
    for out, seg, rnd, pos, lab in insts:
        n, k = len(out), len(pos)
        ex = tf.train.Example(features=tf.train.Features(feature=collections.OrderedDict(
            input_ids=feat(out + [0] * (T - n)), input_mask=feat([1] * n + [0] * (T - n)),
            segment_ids=feat(seg + [0] * (T - n)), masked_lm_positions=feat(pos + [0] * (P - k)),
            masked_lm_ids=feat(lab + [0] * (P - k)), masked_lm_weights=feat([1.0] * k + [0.0] * (P - k), True),
            next_sentence_labels=feat([1 if rnd else 0]))))
        w.write(ex.SerializeToString())
dt = time.perf_counter() - t0
print(json.dumps({"documents": len(docs), "examples": len(insts), "seconds": dt, "docs_per_s": len(docs) / dt,
                  "tokenizer": "BertTokenizerFast" if a.fast else "BertTokenizer"}))
