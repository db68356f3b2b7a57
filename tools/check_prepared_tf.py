#!/usr/bin/env python3
"""Checks that TensorFlow decodes `bertrain prepare` output with Google BERT's own input schema
(run_pretraining.py's name_to_features) and that the values are sane: [CLS] first, padding zero,
masked positions sorted inside the sequence, weights 1 exactly where positions are set.

  python tools/check_prepared_tf.py 'out/*.tfrecord' --seq-len 128 --max-predictions 20

With --classification, `bertrain prepare --task` output with run_classifier.py's schema
(file_based_input_fn_builder's name_to_features): framing, padding, segment ids, and label ids
within the labels.txt written beside the files.

  python tools/check_prepared_tf.py 'out/*.tfrecord' --seq-len 128 --classification
"""
import argparse
import glob
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("pattern")
ap.add_argument("--seq-len", type=int, default=128)
ap.add_argument("--max-predictions", type=int, default=20)
ap.add_argument("--classification", action="store_true")
a = ap.parse_args()
T, P = a.seq_len, a.max_predictions
if a.classification:
    name_to_features = {  # as google-research/bert run_classifier.py
        "input_ids": tf.io.FixedLenFeature([T], tf.int64),
        "input_mask": tf.io.FixedLenFeature([T], tf.int64),
        "segment_ids": tf.io.FixedLenFeature([T], tf.int64),
        "label_ids": tf.io.FixedLenFeature([], tf.int64),
        "is_real_example": tf.io.FixedLenFeature([], tf.int64),
    }
    files = sorted(glob.glob(a.pattern))
    labels = [l for l in open(os.path.join(os.path.dirname(files[0]), "labels.txt")).read().split("\n") if l]
    comp = "GZIP" if files[0].endswith(".gz") else ""
    n, seen, first = 0, set(), set()
    for raw in tf.data.TFRecordDataset(files, compression_type=comp):
        ex = {k: v.numpy() for k, v in tf.io.parse_single_example(raw, name_to_features).items()}
        length = int(ex["input_mask"].sum())
        assert (ex["input_mask"][:length] == 1).all() and (ex["input_ids"][length:] == 0).all()
        assert (ex["segment_ids"][length:] == 0).all()
        first.add(int(ex["input_ids"][0]))  # [CLS], the same id in every example
        assert 0 <= ex["label_ids"] < len(labels) and ex["is_real_example"] == 1
        seen.add(int(ex["label_ids"]))
        n += 1
    assert len(first) == 1, f"examples start with different ids {first}"
    print(f"ok: TensorFlow {tf.__version__} decoded {n} examples from {len(files)} files with "
          f"run_classifier.py's schema; labels used {sorted(seen)} of {labels}")
    sys.exit(0 if n else 1)
name_to_features = {  # as google-research/bert run_pretraining.py
    "input_ids": tf.io.FixedLenFeature([T], tf.int64), "input_mask": tf.io.FixedLenFeature([T], tf.int64),
    "segment_ids": tf.io.FixedLenFeature([T], tf.int64),
    "masked_lm_positions": tf.io.FixedLenFeature([P], tf.int64), "masked_lm_ids": tf.io.FixedLenFeature([P], tf.int64),
    "masked_lm_weights": tf.io.FixedLenFeature([P], tf.float32),
    "next_sentence_labels": tf.io.FixedLenFeature([1], tf.int64),
}
files = sorted(glob.glob(a.pattern))
comp = "GZIP" if files and files[0].endswith(".gz") else ""
n = 0
for raw in tf.data.TFRecordDataset(files, compression_type=comp):
    ex = {k: v.numpy() for k, v in tf.io.parse_single_example(raw, name_to_features).items()}
    length = int(ex["input_mask"].sum())
    assert ex["input_ids"][0] == 101 and ex["input_ids"][length - 1] == 102, "framing"
    assert (ex["input_ids"][length:] == 0).all() and (ex["input_mask"][:length] == 1).all()
    w = ex["masked_lm_weights"]
    k = int(w.sum())
    pos = ex["masked_lm_positions"][:k]
    assert (np.diff(pos) > 0).all() and pos.min() > 0 and pos.max() < length, "positions"
    assert (ex["masked_lm_positions"][k:] == 0).all() and set(np.unique(w)) <= {0.0, 1.0}
    n += 1
print(f"ok: TensorFlow {tf.__version__} decoded {n} examples from {len(files)} files with BERT's schema")
sys.exit(0 if n else 1)
