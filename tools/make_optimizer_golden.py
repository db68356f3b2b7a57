#!/usr/bin/env python3
"""Golden optimizer trajectories for bertrain's optimizer test.

Five tensors (a matrix, an embedding, a bias and LayerNorm weight/bias: the last three without
weight decay, as BERT), random gradients for 6 steps (steps 2 and 4 scaled up so global-norm
clipping engages), a warmup-then-decay learning rate. Each step: torch.nn.utils.clip_grad_norm_
(max 1.0), then
  adamw: torch.optim.AdamW(betas 0.9/0.999, eps 1e-6, weight_decay 0.01 / 0.0 groups)
  lamb:  the reference LAMB below (NVIDIA's BERT LAMB as apex FusedLAMB: bias correction,
         u = m_hat / (sqrt(v_hat) + eps) + wd * p, trust ratio ||p|| / ||u|| where wd != 0)
Parameters after every step go to tests/golden/optimizer.safetensors.
"""
import os

import torch
from safetensors.torch import save_file

SHAPES = {"w": (16, 8), "emb": (10, 8), "b": (16,), "ln_w": (8,), "ln_b": (8,)}
DECAY = {"w": True, "emb": True, "b": False, "ln_w": False, "ln_b": False}
LRS = [1e-3, 2e-3, 3e-3, 2.5e-3, 2e-3, 1.5e-3]


def lamb_step(params, state, lr, step, b1=0.9, b2=0.999, eps=1e-6):
    for name, p in params.items():
        g = p.grad
        m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        mh = m / (1 - b1 ** step)
        vh = v / (1 - b2 ** step)
        wd = 0.01 if DECAY[name] else 0.0
        u = mh / (vh.sqrt() + eps) + wd * p
        trust = 1.0
        if wd != 0:
            pn, un = p.norm(), u.norm()
            if pn > 0 and un > 0:
                trust = (pn / un).item()
        with torch.no_grad():
            p.add_(u, alpha=-lr * trust)


def main():
    gen = torch.Generator().manual_seed(7)
    init = {k: torch.randn(s, generator=gen) * 0.5 for k, s in SHAPES.items()}
    grads = []
    for t in range(len(LRS)):
        g = {k: torch.randn(s, generator=gen) * 0.1 for k, s in SHAPES.items()}
        if t in (2, 4):
            g = {k: v * 40 for k, v in g.items()}
        grads.append(g)
    out = {f"init.{k}": v for k, v in init.items()}
    for t, g in enumerate(grads):
        for k, v in g.items():
            out[f"grad{t}.{k}"] = v
    out["lrs"] = torch.tensor(LRS, dtype=torch.float64)
    for kind in ("adamw", "lamb"):
        params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
        opt = None
        if kind == "adamw":
            opt = torch.optim.AdamW([
                {"params": [params[k] for k in SHAPES if DECAY[k]], "weight_decay": 0.01},
                {"params": [params[k] for k in SHAPES if not DECAY[k]], "weight_decay": 0.0}],
                lr=LRS[0], betas=(0.9, 0.999), eps=1e-6)
        state = {}
        for t, g in enumerate(grads):
            for k, p in params.items():
                p.grad = g[k].clone()
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
            out[f"{kind}.norm{t}"] = norm.reshape(1).double()
            if kind == "adamw":
                for group in opt.param_groups:
                    group["lr"] = LRS[t]
                opt.step()
            else:
                lamb_step(params, state, LRS[t], t + 1)
            for k, p in params.items():
                out[f"{kind}.step{t}.{k}"] = p.detach().clone()
    dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "optimizer.safetensors")
    save_file({k: v.contiguous() for k, v in out.items()}, dst)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
