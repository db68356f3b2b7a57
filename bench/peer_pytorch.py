#!/usr/bin/env python3
"""The PyTorch peer of `bertrain bench`: HuggingFace BertForPreTraining, same config, batch,
sequence length and thread count, MLM head on the masked positions only (gather first, as
NVIDIA's and DeepSpeed's BERT do), forward + backward + AdamW step timed (as bertrain bench; fp32 master
weights and optimizer state, gradient clipping at 1.0), fp32 or bf16 autocast. Prints one JSON line.
--device cuda: the same on the GPU as a PyTorch user runs it there (SDPA attention, fused AdamW,
bf16 or fp16 autocast; fp16 with a GradScaler), timed between CUDA synchronisations; the JSON
adds the GPU's peak allocated memory."""
import argparse
import json
import resource
import time

import torch
import transformers
from transformers import AutoModelForPreTraining, BertConfig

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--model-config", required=True)
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--seq-len", type=int, default=128)
ap.add_argument("--max-predictions", type=int, default=20)
ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--warmup", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
cfg = BertConfig.from_json_file(a.model_config)
dev = torch.device(a.device)
gpu = a.device == "cuda"
# On a GPU, PyTorch's fused attention (SDPA), asked for the supported way (transformers >= 4.36
# and 5.x: from_config's attn_implementation); the implementation taken is reported.
model = AutoModelForPreTraining.from_config(cfg, **({"attn_implementation": "sdpa"} if gpu else {}))
model = model.train().to(dev)
B, T, P = a.batch_size, a.seq_len, a.max_predictions
ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
mask = torch.ones(B, T, dtype=torch.long, device=dev)
seg = (torch.arange(T, device=dev) >= T // 2).long().expand(B, T)
pos = (1 + torch.arange(P, device=dev) * (T - 1) // P).expand(B, P)
lm_ids = torch.randint(0, cfg.vocab_size, (B, P), device=dev)
nsp = torch.randint(0, 2, (B,), device=dev)
rows = torch.arange(B, device=dev).unsqueeze(1).expand(B, P)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, eps=1e-6, weight_decay=0.01,
                        **({"fused": True} if gpu else {}))
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
scaler = torch.amp.GradScaler("cuda", enabled=gpu and a.precision == "fp16")


def step():
    model.zero_grad(set_to_none=True)
    with torch.autocast(a.device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model.bert(input_ids=ids, attention_mask=mask, token_type_ids=seg)
        seq, pooled = out[0], out[1]
        masked = seq[rows, pos]  # [B, P, C]: the head runs on masked positions only
        logits = model.cls.predictions(masked).float()
        nsp_logits = model.cls.seq_relationship(pooled).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), lm_ids.reshape(-1)) + \
        torch.nn.functional.cross_entropy(nsp_logits, nsp)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return loss.item()


for _ in range(a.warmup):
    step()
times = []
for _ in range(a.steps):
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()  # loss.item() waits for the step's kernels
    times.append(time.perf_counter() - t0)
t = sorted(times)[len(times) // 2]
out = {"tokens_per_s": B * T / t, "step_ms": t * 1e3, "precision": a.precision,
       "torch": torch.__version__, "transformers": transformers.__version__,
       "attention": getattr(model.config, "_attn_implementation", None), "device": a.device,
       "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
if gpu:
    out["gpu"] = torch.cuda.get_device_name()
    out["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
print(json.dumps(out))
