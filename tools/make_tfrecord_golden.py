#!/usr/bin/env python3
"""TFRecord interoperability with TensorFlow itself.

write:   TensorFlow writes tests/data/tfrecord/tf_written/ (uncompressed, GZIP and ZLIB files,
         an empty file, edge-case Examples, BERT-pretraining-schema records) and manifest.json
         with the exact contents of every record; bertrain's tests decode the files and
         compare with the manifest.
verify:  TensorFlow (tf.data.TFRecordDataset + tf.io.parse_single_example) reads files that
         bertrain wrote from the manifest (BERTRAIN_INTEROP_OUT=DIR ctest -R TfInterop) and
         checks every record against the manifest.

  python tools/make_tfrecord_golden.py write
  BERTRAIN_INTEROP_OUT=/tmp/bt ./build/tests/bertrain_tests --gtest_filter='TfInterop*'
  python tools/make_tfrecord_golden.py verify /tmp/bt

Needs tensorflow (tensorflow-cpu from PyPI); bertrain itself does not.
"""
import json
import math
import os
import struct
import sys

import numpy as np
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "tfrecord", "tf_written")


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def edge_records():
    rng = np.random.default_rng(7)
    recs = [
        {},  # an Example with no features
        {"empty_int": ("int64", []), "empty_float": ("float", []), "empty_bytes": ("bytes", [])},
        {"neg": ("int64", [-1, -(2 ** 63), 2 ** 63 - 1, 0]), "f": ("float", [f32(1e-38), -0.0, f32(3.4e38)])},
        {"nan_inf": ("float", ["nan", "inf", "-inf"])},
        {"bytes": ("bytes", [b"", "ünïcödé 中文".encode(), b"\x00\x01\x02"])},
        {"big": ("int64", [int(x) for x in rng.integers(0, 30522, 5000)])},
    ]
    return recs


def bert_records(n=6, T=16, P=3):
    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        ids = [101] + [int(x) for x in rng.integers(999, 30522, T - 2)] + [102]
        pos = sorted(int(x) for x in rng.choice(np.arange(1, T - 1), P, replace=False))
        out.append({
            "input_ids": ("int64", ids), "input_mask": ("int64", [1] * T),
            "segment_ids": ("int64", [0] * (T // 2) + [1] * (T - T // 2)),
            "masked_lm_positions": ("int64", pos), "masked_lm_ids": ("int64", [int(x) for x in rng.integers(999, 30522, P)]),
            "masked_lm_weights": ("float", [1.0] * P), "next_sentence_labels": ("int64", [i % 2]),
        })
    return out


def to_example(rec):
    feats = {}
    for name, (kind, values) in rec.items():
        if kind == "int64":
            feats[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        elif kind == "float":
            feats[name] = tf.train.Feature(float_list=tf.train.FloatList(value=[float(v) for v in values]))
        else:
            feats[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feats))


FILES = {
    "plain.tfrecord": ("", "edge"),
    "gzip.tfrecord.gz": ("GZIP", "edge"),
    "zlib.tfrecord.zlib": ("ZLIB", "bert"),
    "bert.tfrecord": ("", "bert"),
    "empty.tfrecord": ("", "none"),
}


def contents(which):
    return {"edge": edge_records(), "bert": bert_records(), "none": []}[which]


def write():
    os.makedirs(OUT, exist_ok=True)
    manifest = {}
    for fname, (comp, which) in FILES.items():
        recs = contents(which)
        opts = tf.io.TFRecordOptions(compression_type=comp)
        with tf.io.TFRecordWriter(os.path.join(OUT, fname), opts) as w:
            for r in recs:
                w.write(to_example(r).SerializeToString())
        # JSON has no bytes: bytes values are stored as hex strings.
        recs = [{k: (kind, [v.hex() for v in vals] if kind == "bytes" else vals)
                 for k, (kind, vals) in r.items()} for r in recs]
        manifest[fname] = {"compression": comp.lower() or "none", "records": recs}
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=None, separators=(",", ":"))
    print(f"wrote {len(FILES)} files with TensorFlow {tf.__version__} to {OUT}")


def feature_values(ex, name, kind):
    f = ex.features.feature[name]
    if kind == "int64":
        return list(f.int64_list.value)
    if kind == "float":
        return list(f.float_list.value)
    return [v.hex() for v in f.bytes_list.value]


def same_float(a, b):
    b = float(b) if not isinstance(b, str) else float(b)
    return (math.isnan(a) and math.isnan(b)) or a == b


def verify(dir_):
    manifest = json.load(open(os.path.join(OUT, "manifest.json")))
    bad = 0
    for fname, spec in manifest.items():
        path = os.path.join(dir_, fname)
        comp = {"none": "", "gzip": "GZIP", "zlib": "ZLIB"}[spec["compression"]]
        got = [r.numpy() for r in tf.data.TFRecordDataset(path, compression_type=comp)]
        if len(got) != len(spec["records"]):
            print(f"FAIL {fname}: {len(got)} records, expected {len(spec['records'])}")
            bad += 1
            continue
        for i, (raw, rec) in enumerate(zip(got, spec["records"])):
            ex = tf.train.Example.FromString(raw)
            if set(ex.features.feature.keys()) != set(rec.keys()):
                print(f"FAIL {fname}[{i}]: features {sorted(ex.features.feature.keys())}")
                bad += 1
                continue
            for name, (kind, values) in rec.items():
                vals = feature_values(ex, name, kind)
                ok = len(vals) == len(values) and ex.features.feature[name].WhichOneof("kind") == kind + "_list"

                if ok and kind == "float":
                    ok = all(same_float(a, b) for a, b in zip(vals, values))
                elif ok:
                    ok = vals == values
                if not ok:
                    print(f"FAIL {fname}[{i}].{name}")
                    bad += 1
        if spec["records"] and "input_ids" in spec["records"][0]:
            T = len(spec["records"][0]["input_ids"][1])
            P = len(spec["records"][0]["masked_lm_positions"][1])
            schema = {k: tf.io.FixedLenFeature([T], tf.int64) for k in ("input_ids", "input_mask", "segment_ids")}
            schema.update({"masked_lm_positions": tf.io.FixedLenFeature([P], tf.int64),
                           "masked_lm_ids": tf.io.FixedLenFeature([P], tf.int64),
                           "masked_lm_weights": tf.io.FixedLenFeature([P], tf.float32),
                           "next_sentence_labels": tf.io.FixedLenFeature([1], tf.int64)})
            for raw in got:
                tf.io.parse_single_example(raw, schema)  # raises on any mismatch
        print(f"ok {fname}: {len(got)} records read by tf.data match the manifest")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "write":
        write()
    elif len(sys.argv) == 3 and sys.argv[1] == "verify":
        sys.exit(verify(sys.argv[2]))
    else:
        print(__doc__)
        sys.exit(2)
