#!/usr/bin/env python3
"""Checks that HuggingFace transformers loads a checkpoint directory written by bertrain.

Loads DIR with BertForPreTraining / BertForSequenceClassification (from config.json's
architectures), strictly (no missing or unexpected keys), and if --reference is given compares
every tensor with the reference checkpoint bit for bit and the logits of a fixed input.

  python tools/check_hf_load.py demo-out/bert-mini-init
  python tools/check_hf_load.py /tmp/resaved --reference tests/golden/bert_pretrain
"""
import argparse
import json
import os
import sys

import torch
import transformers


def load(path):
    arch = json.load(open(os.path.join(path, "config.json")))["architectures"][0]
    cls = getattr(transformers, arch)
    model, info = cls.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--reference")
    args = ap.parse_args()
    model, info = load(args.dir)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"FAIL: {args.dir}: {problems}")
        return 1
    print(f"ok: {args.dir} loads as {type(model).__name__} with no missing/unexpected keys")
    if args.reference:
        ref, _ = load(args.reference)
        a, b = model.state_dict(), ref.state_dict()
        assert a.keys() == b.keys(), set(a) ^ set(b)
        for k in a:
            if not torch.equal(a[k], b[k]):
                print(f"FAIL: tensor {k} differs")
                return 1
        ids = torch.arange(2, 18).reshape(2, 8) % model.config.vocab_size
        with torch.no_grad():
            out_a, out_b = model(input_ids=ids), ref(input_ids=ids)
        for name in out_a.keys():
            if not torch.equal(out_a[name], out_b[name]):
                print(f"FAIL: output {name} differs")
                return 1
        print(f"ok: all {len(a)} tensors and the outputs equal {args.reference} bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
