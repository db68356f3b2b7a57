#!/usr/bin/env python3
"""Reads a bertrain run directory's TensorBoard event files with TensorBoard's own reader
(EventAccumulator, from the `tensorboard` package on PyPI) and checks them against the run's
metrics.jsonl: the same tags, the same steps, the same values (float32 in the events). With
--write it stores what TensorBoard saw (tags, steps, values) as JSON: the committed golden that
tests/test_events.cpp compares bertrain's own files with in CI, where TensorBoard is absent.

  python tools/check_tensorboard_events.py RUN_DIR [--write tests/golden/tensorboard/tiny_run.json]

The golden's run (from the repository root):
  build/bertrain train --model-config configs/bert-tiny.json \
    --data tests/data/tfrecord/bert_pretrain_sample_text.tfrecord --output RUN_DIR --steps 6 \
    --log-every 2 --batch-size 4 --seq-len 128 --max-predictions 20 --threads 1 --seed 7 \
    --optimizer adamw --lr 1e-4
"""
import argparse
import json
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--write", help="store TensorBoard's reading as JSON here")
    a = ap.parse_args()
    ea = EventAccumulator(a.run_dir, size_guidance={"scalars": 0})
    ea.Reload()
    tags = sorted(ea.Tags()["scalars"])
    seen = {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in tags}
    rows = [json.loads(l) for l in open(os.path.join(a.run_dir, "metrics.jsonl")) if l.strip()]
    bad = 0
    want_tags = sorted(k for k in rows[0] if "/" in k)
    if tags != want_tags:
        print(f"tags differ: tensorboard {tags}\n  metrics.jsonl {want_tags}")
        bad += 1
    for t in want_tags:
        steps = [s for s, _ in seen.get(t, [])]
        want = [r["step"] for r in rows]
        if steps != want:
            print(f"{t}: steps {steps}, metrics.jsonl {want}")
            bad += 1
            continue
        for (s, v), r in zip(seen[t], rows):
            x = r[t]
            if not math.isclose(v, x, rel_tol=1e-6, abs_tol=1e-30) and not (math.isnan(v) and math.isnan(x)):
                print(f"{t} step {s}: tensorboard {v}, metrics.jsonl {x}")
                bad += 1
    print(f"tensorboard read {len(tags)} scalar tags x {len(rows)} steps from {a.run_dir}: "
          f"{'all equal to metrics.jsonl' if not bad else f'{bad} mismatches'}")
    if a.write:
        out = {"reader": "tensorboard.backend.event_processing.event_accumulator.EventAccumulator",
               "tags": tags,
               "steps": {t: [s for s, _ in seen[t]] for t in tags},
               "values": {t: [v for _, v in seen[t]] for t in tags}}
        with open(a.write, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {a.write}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
