#!/usr/bin/env python3
"""The peer for bertrain's extractive-QA fine-tuning: transformers' BertForQuestionAnswering
fine-tuned from the same checkpoint on the same files with the same windows, so that a weak dev
score can be told apart: the trainer's (bertrain below the peer) or the checkpoint's (both alike).

  python tools/qa_peer_finetune.py CHECKPOINT_DIR TRAIN.json DEV.json \\
      [--seq-len 128] [--doc-stride 46] [--epochs 3] [--lr 5e-4] [--batch-size 32]

Features as run_qa.py builds them (BertTokenizerFast, truncation only_second, overflowing
windows with doc_stride, the answer's tokens or [CLS]); AdamW with linear warmup (10%) and decay,
clipping at 1 (bertrain finetune's defaults); answers as utils_qa.postprocess_qa_predictions
(20 best starts and ends, at most 30 tokens); CMRC 2018 F1 (longest common subsequence over
characters, punctuation removed; runs of non-Chinese characters split at whitespace where the
official script uses NLTK's word_tokenize: the same on Chinese answers). Prints dev F1 per epoch.
Measured (session 16, bertrain's 4 x 128 Chinese BERT pretrained 2500 steps on 2 cores, CMRC
dev -> trial, 3 epochs): the peer 7.57 / 6.66 / 6.76, bertrain 7.87 / 7.62 / 7.76 (random
19-character spans 6.4-7.1): the checkpoint is the limit. Needs torch and transformers
(/opt/torchcpu here).
"""
import argparse
import collections
import json
import os
import re
import time

import numpy as np
import torch
from transformers import (BertForQuestionAnswering, BertTokenizerFast,
                          get_linear_schedule_with_warmup)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SP_CHAR = set("-:_*^/\\~`+=,。:?!¥“”;’《》……·、,「」()-~『』")


def examples(path):
    d = json.load(open(path, encoding="utf-8"))
    return [(q["question"], p["context"], [a["text"] for a in q["answers"]],
             [a["answer_start"] for a in q["answers"]])
            for art in d["data"] for p in art["paragraphs"] for q in p["qas"]]


def features(tok, exs, seq_len, stride):
    enc = tok([e[0] for e in exs], [e[1] for e in exs], truncation="only_second",
              max_length=seq_len, stride=stride, return_overflowing_tokens=True,
              return_offsets_mapping=True, padding="max_length")
    starts, ends = [], []
    for i, off in enumerate(enc["offset_mapping"]):
        q, ctx, texts, answer_starts = exs[enc["overflow_to_sample_mapping"][i]]
        sid = enc.sequence_ids(i)
        cs = sid.index(1)
        ce = len(sid) - 1 - sid[::-1].index(1)
        s, t = answer_starts[0], texts[0]
        if ctx[s:s + len(t)] != t:  # CMRC's few misplaced answer_start: the text's occurrence
            s = ctx.find(t)
        a = b = 0
        if s >= 0 and off[cs][0] <= s and off[ce][1] >= s + len(t):
            k = cs
            while k <= ce and off[k][0] <= s:
                k += 1
            a = k - 1
            k = ce
            while off[k][1] >= s + len(t):
                k -= 1
            b = k + 1
        starts.append(a)
        ends.append(b)
        enc["offset_mapping"][i] = [o if sid[k] == 1 else None for k, o in enumerate(off)]
    return enc, starts, ends


def segments(s):
    s, out, run = s.lower().strip(), [], ""
    for c in s:
        if c in SP_CHAR:
            continue
        if re.search(r"[\u4e00-\u9fa5]", c):
            if run:
                out.extend(run.split())
                run = ""
            out.append(c)
        else:
            run += c
    if run:
        out.extend(run.split())
    return out


def lcs_len(a, b):
    m = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    best = 0
    for i in range(len(a)):
        for j in range(len(b)):
            if a[i] == b[j]:
                m[i + 1][j + 1] = m[i][j] + 1
                best = max(best, m[i + 1][j + 1])
    return best


def cmrc_f1(answers, pred):
    best = 0.0
    for ans in answers:
        x, y = segments(ans), segments(pred)
        n = lcs_len(x, y)
        if n:
            p, r = n / len(y), n / len(x)
            best = max(best, 2 * p * r / (p + r))
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("train")
    ap.add_argument("dev")
    ap.add_argument("--vocab", default=os.path.join(ROOT, "data/vocab/bert-base-chinese-vocab.txt"))
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--doc-stride", type=int, default=46)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = BertTokenizerFast(args.vocab, do_lower_case=True)
    train, dev = examples(args.train), examples(args.dev)
    te, ts, tend = features(tok, train, args.seq_len, args.doc_stride)
    de, _, _ = features(tok, dev, args.seq_len, args.doc_stride)
    print(f"{len(train)} training questions -> {len(te['input_ids'])} windows; "
          f"{len(dev)} dev questions -> {len(de['input_ids'])}", flush=True)
    model = BertForQuestionAnswering.from_pretrained(args.checkpoint)
    ids, tt, am = (torch.tensor(te[k]) for k in ("input_ids", "token_type_ids", "attention_mask"))
    S, E = torch.tensor(ts), torch.tensor(tend)
    bs = args.batch_size
    per_epoch = (len(ids) + bs - 1) // bs
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * args.epochs * per_epoch),
                                            args.epochs * per_epoch)

    def evaluate():
        model.eval()
        sl, el = [], []
        with torch.no_grad():
            for i in range(0, len(de["input_ids"]), 64):
                o = model(**{k: torch.tensor(de[k][i:i + 64])
                             for k in ("input_ids", "token_type_ids", "attention_mask")})
                sl.append(o.start_logits.numpy())
                el.append(o.end_logits.numpy())
        sl, el = np.concatenate(sl), np.concatenate(el)
        per_example = collections.defaultdict(list)
        for i, e in enumerate(de["overflow_to_sample_mapping"]):
            per_example[e].append(i)
        total = 0.0
        for ei, (q, ctx, answers, _) in enumerate(dev):
            best, text = -1e30, ""
            for fi in per_example[ei]:
                off = de["offset_mapping"][fi]
                for a in np.argsort(sl[fi])[-20:]:
                    for b in np.argsort(el[fi])[-20:]:
                        if off[a] is None or off[b] is None or b < a or b - a + 1 > 30:
                            continue
                        if sl[fi][a] + el[fi][b] > best:
                            best, text = sl[fi][a] + el[fi][b], ctx[off[a][0]:off[b][1]]
            total += cmrc_f1(answers, text)
        model.train()
        return 100 * total / len(dev)

    model.train()
    for epoch in range(args.epochs):
        perm, t0, loss_sum = torch.randperm(len(ids)), time.time(), 0.0
        for k in range(0, len(ids), bs):
            j = perm[k:k + bs]
            out = model(input_ids=ids[j], token_type_ids=tt[j], attention_mask=am[j],
                        start_positions=S[j], end_positions=E[j])
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            loss_sum += out.loss.item()
        print(f"epoch {epoch + 1}/{args.epochs} | train loss {loss_sum / per_epoch:.4f} | "
              f"{time.time() - t0:.0f} s | dev F1 {evaluate():.2f}", flush=True)


if __name__ == "__main__":
    main()
