#!/usr/bin/env python3
"""The PyTorch peer of `bertrain bench`: HuggingFace BertForPreTraining, same config, batch,
sequence length and thread count, MLM head on the masked positions only (gather first, as
NVIDIA's and DeepSpeed's BERT do), forward + backward + AdamW step timed (as bertrain bench; fp32 master
weights and optimizer state, gradient clipping at 1.0), fp32 or bf16 autocast. Prints one JSON line."""
import argparse
import json
import resource
import time

import torch
from transformers import BertConfig, BertForPreTraining

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--model-config", required=True)
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--seq-len", type=int, default=128)
ap.add_argument("--max-predictions", type=int, default=20)
ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--warmup", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
cfg = BertConfig.from_json_file(a.model_config)
model = BertForPreTraining(cfg).train()
B, T, P = a.batch_size, a.seq_len, a.max_predictions
ids = torch.randint(0, cfg.vocab_size, (B, T))
mask = torch.ones(B, T, dtype=torch.long)
seg = (torch.arange(T) >= T // 2).long().expand(B, T)
pos = (1 + torch.arange(P) * (T - 1) // P).expand(B, P)
lm_ids = torch.randint(0, cfg.vocab_size, (B, P))
nsp = torch.randint(0, 2, (B,))
rows = torch.arange(B).unsqueeze(1).expand(B, P)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, eps=1e-6, weight_decay=0.01)


def step():
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
        out = model.bert(input_ids=ids, attention_mask=mask, token_type_ids=seg)
        seq, pooled = out[0], out[1]
        masked = seq[rows, pos]  # [B, P, C]: the head runs on masked positions only
        logits = model.cls.predictions(masked).float()
        nsp_logits = model.cls.seq_relationship(pooled).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), lm_ids.reshape(-1)) + \
        torch.nn.functional.cross_entropy(nsp_logits, nsp)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


for _ in range(a.warmup):
    step()
times = []
for _ in range(a.steps):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
t = sorted(times)[len(times) // 2]
print(json.dumps({"tokens_per_s": B * T / t, "step_ms": t * 1e3, "precision": a.precision, "torch": torch.__version__,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
