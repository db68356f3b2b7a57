#!/usr/bin/env python3
"""Golden tensors for bertrain's model tests, produced by HuggingFace transformers + PyTorch.

Builds a small BERT (2 layers, hidden 64, 4 heads, vocab 256) with fixed random weights, saves it
with HF's own save_pretrained (model.safetensors + config.json), then runs the reference forward
and backward in float64 with dropout off and writes inputs, outputs, losses and the gradient of
every parameter to golden.safetensors:

  tests/golden/bert_pretrain/   BertForPreTraining: MLM (Google's weighted loss) + NSP
  tests/golden/bert_cls/        BertForSequenceClassification (3 labels, same encoder weights)
  tests/golden/bert_reg/        BertForSequenceClassification with one output (problem_type
                                regression: MSE loss, as STS-B), same encoder weights
  tests/golden/bert_token/      BertForTokenClassification (5 labels, no pooler; -100 labels on
                                [CLS], [SEP], padding and some later sub-tokens)
  tests/golden/bert_qa/         BertForQuestionAnswering (qa_outputs, no pooler; start/end
                                positions, one example's answer at [CLS] as run_qa labels an
                                answer outside the window)

The MLM loss is Google BERT's: sum(w * ce) / (sum(w) + 1e-5) over masked_lm_positions, computed
here in torch on HF's prediction logits, so gradients flow through HF's own graph.

Usage (needs torch and transformers, e.g. a venv made with --system-site-packages):
  python tools/make_bert_golden.py [--out tests/golden] [--only bert_qa ...]

A newer torch changes the last bits of the existing goldens; --only writes just the named ones.
"""
import argparse
import os

import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertForPreTraining, BertForSequenceClassification

B, T, P = 3, 16, 5
LENGTHS = [16, 11, 7]


def make_config(**kw):
    return BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=32, type_vocab_size=2,
                      hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      layer_norm_eps=1e-12, initializer_range=0.02, **kw)


def randomize(model, gen):
    # Larger than BERT's init so that every parameter visibly matters (LayerNorm away from 1/0).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def make_inputs(gen, vocab):
    ids = torch.randint(5, vocab, (B, T), generator=gen)
    mask = torch.zeros(B, T, dtype=torch.long)
    seg = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = 1
        ids[b, n:] = 0
        ids[b, 0] = 2  # a [CLS]-like id
        seg[b, n // 2:n] = 1
    pos = torch.zeros(B, P, dtype=torch.long)
    lm_ids = torch.zeros(B, P, dtype=torch.long)
    w = torch.zeros(B, P, dtype=torch.float64)
    for b, n in enumerate(LENGTHS):
        k = min(P, max(1, (n - 2) // 2))
        choice = torch.randperm(n - 2, generator=gen)[:k] + 1
        choice, _ = torch.sort(choice)
        pos[b, :k] = choice
        lm_ids[b, :k] = torch.randint(5, vocab, (k,), generator=gen)
        w[b, :k] = 1.0
    nsp = torch.tensor([0, 1, 1])
    labels = torch.tensor([2, 0, 1])
    return dict(input_ids=ids, input_mask=mask, segment_ids=seg, masked_lm_positions=pos,
                masked_lm_ids=lm_ids, masked_lm_weights=w, next_sentence_labels=nsp,
                label_ids=labels)


def grads_of(model):
    return {f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def pretrain_golden(out_dir, gen):
    cfg = make_config()
    model = BertForPreTraining(cfg)
    randomize(model, gen)
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    inp = make_inputs(gen, cfg.vocab_size)
    model = model.double()
    bert_out = model.bert(input_ids=inp["input_ids"], attention_mask=inp["input_mask"],
                          token_type_ids=inp["segment_ids"])
    seq, pooled = bert_out.last_hidden_state, bert_out.pooler_output
    pred, nsp_logits = model.cls(seq, pooled)
    rows = torch.arange(B).unsqueeze(1).expand(B, P)
    mlm_logits = pred[rows, inp["masked_lm_positions"]].reshape(B * P, -1)
    ce = torch.nn.functional.cross_entropy(mlm_logits, inp["masked_lm_ids"].reshape(-1),
                                           reduction="none")
    w = inp["masked_lm_weights"].reshape(-1)
    mlm_loss = (w * ce).sum() / (w.sum() + 1e-5)
    nsp_loss = torch.nn.functional.cross_entropy(nsp_logits, inp["next_sentence_labels"])
    loss = mlm_loss + nsp_loss
    loss.backward()
    tensors = {f"input.{k}": v.contiguous() for k, v in inp.items()}
    tensors.update({
        "output.sequence_output": seq.detach(), "output.pooled_output": pooled.detach(),
        "output.mlm_logits": mlm_logits.detach(), "output.nsp_logits": nsp_logits.detach(),
        "output.mlm_loss": mlm_loss.detach().reshape(1), "output.nsp_loss": nsp_loss.detach().reshape(1),
        "output.loss": loss.detach().reshape(1)})
    tensors.update(grads_of(model))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "golden.safetensors"))
    print(f"{out_dir}: loss {loss.item():.6f} (mlm {mlm_loss.item():.6f}, nsp {nsp_loss.item():.6f})")
    return model


def cls_golden(out_dir, gen, encoder_src):
    cfg = make_config(num_labels=3)
    model = BertForSequenceClassification(cfg)
    randomize(model, gen)
    model.bert.load_state_dict({k: v.float() for k, v in encoder_src.bert.state_dict().items()})
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    inp = make_inputs(gen, cfg.vocab_size)
    model = model.double()
    out = model(input_ids=inp["input_ids"], attention_mask=inp["input_mask"],
                token_type_ids=inp["segment_ids"], labels=inp["label_ids"])
    out.loss.backward()
    tensors = {f"input.{k}": v.contiguous() for k, v in inp.items()}
    tensors.update({"output.logits": out.logits.detach(), "output.loss": out.loss.detach().reshape(1)})
    tensors.update(grads_of(model))
    save_file(tensors, os.path.join(out_dir, "golden.safetensors"))
    print(f"{out_dir}: loss {out.loss.item():.6f}")


def reg_golden(out_dir, gen, encoder_src):
    # BertForSequenceClassification with one output: HF's regression head (MSELoss), as STS-B.
    cfg = make_config(num_labels=1, problem_type="regression")
    model = BertForSequenceClassification(cfg)
    randomize(model, gen)
    model.bert.load_state_dict({k: v.float() for k, v in encoder_src.bert.state_dict().items()})
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    inp = make_inputs(gen, cfg.vocab_size)
    del inp["label_ids"]
    inp["label_values"] = torch.tensor([3.8, 0.5, 2.25], dtype=torch.float64)
    model = model.double()
    out = model(input_ids=inp["input_ids"], attention_mask=inp["input_mask"],
                token_type_ids=inp["segment_ids"], labels=inp["label_values"])
    out.loss.backward()
    tensors = {f"input.{k}": v.contiguous() for k, v in inp.items()}
    tensors.update({"output.logits": out.logits.detach(), "output.loss": out.loss.detach().reshape(1)})
    tensors.update(grads_of(model))
    save_file(tensors, os.path.join(out_dir, "golden.safetensors"))
    print(f"{out_dir}: loss {out.loss.item():.6f}")


def token_golden(out_dir, gen, encoder_src):
    # BertForTokenClassification (5 labels, no pooler); label -100 (not scored) on padding, the
    # first token and some "later sub-token" positions, as HF's run_ner aligns labels.
    from transformers import BertForTokenClassification
    cfg = make_config(num_labels=5)
    model = BertForTokenClassification(cfg)
    randomize(model, gen)
    model.bert.load_state_dict({k: v.float() for k, v in encoder_src.bert.state_dict().items()
                                if not k.startswith("pooler.")})
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    inp = make_inputs(gen, cfg.vocab_size)
    labels = torch.randint(0, 5, (B, T), generator=gen)
    for b, n in enumerate(LENGTHS):
        labels[b, n - 1:] = -100  # [SEP] and padding
        labels[b, 0] = -100  # [CLS]
        labels[b, 1:n - 1][torch.rand(n - 2, generator=gen) < 0.3] = -100  # later sub-tokens
    inp = {k: inp[k] for k in ("input_ids", "input_mask", "segment_ids")}
    inp["token_labels"] = labels
    model = model.double()
    out = model(input_ids=inp["input_ids"], attention_mask=inp["input_mask"],
                token_type_ids=inp["segment_ids"], labels=labels)
    out.loss.backward()
    tensors = {f"input.{k}": v.contiguous() for k, v in inp.items()}
    tensors.update({"output.logits": out.logits.detach(), "output.loss": out.loss.detach().reshape(1)})
    tensors.update(grads_of(model))
    save_file(tensors, os.path.join(out_dir, "golden.safetensors"))
    print(f"{out_dir}: loss {out.loss.item():.6f}")


def qa_golden(out_dir, gen, encoder_src):
    # BertForQuestionAnswering: qa_outputs (2 outputs) on every token, no pooler, no dropout;
    # loss (CE(start) + CE(end)) / 2 over the sequence positions.
    from transformers import BertForQuestionAnswering
    cfg = make_config()
    model = BertForQuestionAnswering(cfg)
    randomize(model, gen)
    model.bert.load_state_dict({k: v.float() for k, v in encoder_src.bert.state_dict().items()
                                if not k.startswith("pooler.")})
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    inp = make_inputs(gen, cfg.vocab_size)
    inp = {k: inp[k] for k in ("input_ids", "input_mask", "segment_ids")}
    start = torch.zeros(B, dtype=torch.long)
    end = torch.zeros(B, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        if b == 2:
            continue  # answer outside the window: both at [CLS] (0)
        s = int(torch.randint(n // 2, n - 1, (1,), generator=gen))
        start[b], end[b] = s, min(n - 2, s + int(torch.randint(0, 3, (1,), generator=gen)))
    inp["span_positions"] = torch.stack([start, end])
    model = model.double()
    out = model(input_ids=inp["input_ids"], attention_mask=inp["input_mask"],
                token_type_ids=inp["segment_ids"], start_positions=start, end_positions=end)
    out.loss.backward()
    tensors = {f"input.{k}": v.contiguous() for k, v in inp.items()}
    tensors.update({"output.start_logits": out.start_logits.detach(),
                    "output.end_logits": out.end_logits.detach(),
                    "output.loss": out.loss.detach().reshape(1)})
    tensors.update(grads_of(model))
    save_file(tensors, os.path.join(out_dir, "golden.safetensors"))
    print(f"{out_dir}: loss {out.loss.item():.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden"))
    ap.add_argument("--only", nargs="*", help="write only these goldens (bert_qa, ...)")
    args = ap.parse_args()
    only = set(args.only or ["bert_pretrain", "bert_cls", "bert_reg", "bert_token", "bert_qa"])
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(1234)
    # The pretraining model is the others' encoder: always built (its files written when asked).
    import tempfile
    pre_dir = os.path.join(args.out, "bert_pretrain") if "bert_pretrain" in only else tempfile.mkdtemp()
    pre = pretrain_golden(pre_dir, gen)
    if "bert_cls" in only:
        cls_golden(os.path.join(args.out, "bert_cls"), gen, pre)
    if "bert_reg" in only:
        reg_golden(os.path.join(args.out, "bert_reg"), torch.Generator().manual_seed(4321), pre)
    if "bert_token" in only:
        token_golden(os.path.join(args.out, "bert_token"), torch.Generator().manual_seed(5678), pre)
    if "bert_qa" in only:
        qa_golden(os.path.join(args.out, "bert_qa"), torch.Generator().manual_seed(8765), pre)


if __name__ == "__main__":
    main()
