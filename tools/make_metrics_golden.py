#!/usr/bin/env python3
"""Reference values of fine-tuning metrics, computed by scipy, for bertrain's tests; and a check
of the metrics bertrain prints against scipy on bertrain's own predictions.

  golden: writes tests/golden/metrics/regression.json: cases of (x, y) with scipy.stats'
          pearsonr and spearmanr. The first case is real: STS-B dev's first 300 gold scores
          (tests/data/tasks/stsb_dev_head300.tsv; many ties) against a noisy copy rounded to one
          decimal (ties on both sides).
  check PREDICTIONS TSV: PREDICTIONS is `bertrain predict` output for a regression model (one
          value per line), TSV the labelled input (label column 'score'); prints scipy's
          Pearson and Spearman to compare with the line bertrain printed.

  /opt/torchvenv/bin/python tools/make_metrics_golden.py golden
"""
import csv
import json
import math
import os
import sys

import numpy as np
from scipy import stats

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def scores(tsv, column="score"):
    with open(tsv, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    i = rows[0].index(column)
    return [float(r[i]) for r in rows[1:] if r]


def case(name, x, y):
    r = stats.pearsonr(x, y)[0] if np.std(x) > 0 and np.std(y) > 0 else float("nan")
    rho = stats.spearmanr(x, y)[0] if np.std(x) > 0 and np.std(y) > 0 else float("nan")
    nan = lambda v: None if math.isnan(v) else float(v)
    return {"name": name, "x": [float(v) for v in x], "y": [float(v) for v in y],
            "pearson": nan(r), "spearman": nan(rho)}


def golden():
    gold = scores(os.path.join(ROOT, "tests", "data", "tasks", "stsb_dev_head300.tsv"))
    rng = np.random.default_rng(11)
    noisy = np.round(np.array(gold) + rng.normal(0, 1.2, len(gold)), 1)
    cases = [
        case("stsb_dev_head300_vs_noisy", noisy.tolist(), gold),
        case("ties_both_sides", [1, 2, 2, 3, 3, 3, 4, 5], [2, 1, 4, 3, 3, 5, 5, 5]),
        case("negative", [0.5, 1.5, 2.5, 3.5], [4.0, 3.0, 3.0, 1.0]),
        case("constant_prediction", [2.0, 2.0, 2.0], [1.0, 2.0, 3.0]),
    ]
    out = os.path.join(ROOT, "tests", "golden", "metrics", "regression.json")
    with open(out, "w") as f:
        json.dump({"made_by": f"scipy {stats.__name__} {__import__('scipy').__version__}",
                   "cases": cases}, f, indent=1)
        f.write("\n")
    for c in cases:
        print(c["name"], c["pearson"], c["spearman"])


def check(pred_file, tsv):
    pred = [float(l) for l in open(pred_file) if l.strip()]
    gold = scores(tsv)
    print(f"scipy: pearson {stats.pearsonr(pred, gold)[0]:.4f}, "
          f"spearman {stats.spearmanr(pred, gold)[0]:.4f}, "
          f"mse {np.mean((np.array(pred) - np.array(gold)) ** 2):.4f} on {len(pred)} examples")


if __name__ == "__main__":
    if sys.argv[1:2] == ["golden"]:
        golden()
    elif sys.argv[1:2] == ["check"] and len(sys.argv) == 4:
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
