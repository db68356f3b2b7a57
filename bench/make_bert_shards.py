#!/usr/bin/env python3
"""Builds benchmark shards of real BERT pretraining records without TensorFlow: the framed
records of Google's create_pretraining_data.py output (tests/data/tfrecord/
bert_pretrain_sample_text.tfrecord, seq 128, 20 predictions) are copied round-robin into N
shards of M records each (bytes, CRCs and all, unchanged)."""
import argparse
import os
import struct

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--out", required=True)
ap.add_argument("--shards", type=int, default=16)
ap.add_argument("--records", type=int, default=4096)
ap.add_argument("--source", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "tfrecord",
                                                 "bert_pretrain_sample_text.tfrecord"))
args = ap.parse_args()
raw = open(args.source, "rb").read()
frames, i = [], 0
while i < len(raw):
    n = struct.unpack("<Q", raw[i:i + 8])[0]
    frames.append(raw[i:i + 16 + n])
    i += 16 + n
os.makedirs(args.out, exist_ok=True)
k = 0
for s in range(args.shards):
    with open(os.path.join(args.out, f"shard-{s:04d}.tfrecord"), "wb") as f:
        for _ in range(args.records):
            f.write(frames[k % len(frames)])
            k += 1
print(f"{args.shards} shards x {args.records} records in {args.out}")
