#!/usr/bin/env python3
"""tf.data reading BERT pretraining shards the way users know it (Google BERT's input_fn with
tf.data.AUTOTUNE): shuffled file list -> interleave(TFRecordDataset, cycle_length, block_length,
num_parallel_calls=AUTOTUNE) -> shuffle -> map(parse_single_example + int32 casts, AUTOTUNE)
-> batch(drop_remainder) -> prefetch(AUTOTUNE). --vectorized parses after batching
(tf.io.parse_example on the whole batch), tf.data's faster variant. Prints one JSON line."""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--data", required=True)
ap.add_argument("--batch-size", type=int, default=32)
ap.add_argument("--seq-len", type=int, default=128)
ap.add_argument("--max-predictions", type=int, default=20)
ap.add_argument("--cycle-length", type=int, default=8)
ap.add_argument("--block-length", type=int, default=256)
ap.add_argument("--shuffle-buffer", type=int, default=1000)
ap.add_argument("--seconds", type=float, default=10)
ap.add_argument("--vectorized", action="store_true")
a = ap.parse_args()
T, P = a.seq_len, a.max_predictions
features = {
    "input_ids": tf.io.FixedLenFeature([T], tf.int64), "input_mask": tf.io.FixedLenFeature([T], tf.int64),
    "segment_ids": tf.io.FixedLenFeature([T], tf.int64),
    "masked_lm_positions": tf.io.FixedLenFeature([P], tf.int64), "masked_lm_ids": tf.io.FixedLenFeature([P], tf.int64),
    "masked_lm_weights": tf.io.FixedLenFeature([P], tf.float32),
    "next_sentence_labels": tf.io.FixedLenFeature([1], tf.int64),
}


def cast(ex):
    return {k: tf.cast(v, tf.int32) if v.dtype == tf.int64 else v for k, v in ex.items()}


AUTO = tf.data.AUTOTUNE
files = tf.data.Dataset.list_files(a.data.split(","), shuffle=True, seed=1).repeat()
d = files.interleave(tf.data.TFRecordDataset, cycle_length=a.cycle_length, block_length=a.block_length,
                     num_parallel_calls=AUTO)
d = d.shuffle(a.shuffle_buffer, seed=2)
if a.vectorized:
    d = d.batch(a.batch_size, drop_remainder=True).map(lambda s: cast(tf.io.parse_example(s, features)), AUTO)
else:
    d = d.map(lambda s: cast(tf.io.parse_single_example(s, features)), AUTO).batch(a.batch_size, drop_remainder=True)
d = d.prefetch(AUTO)
it = iter(d)
t0 = time.perf_counter()
while time.perf_counter() - t0 < min(2.0, a.seconds / 4):
    next(it)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < a.seconds:
    b = next(it)
    n += int(b["input_ids"].shape[0])
dt = time.perf_counter() - t0
import resource  # noqa: E402
print(json.dumps({"examples_per_s": n / dt, "vectorized": a.vectorized, "tf": tf.__version__,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
