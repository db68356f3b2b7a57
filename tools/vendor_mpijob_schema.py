#!/usr/bin/env python3
"""Extracts the MPIJob v2beta1 OpenAPI v3 schema from the MPI Operator's CRD (kubeflow/mpi-operator,
manifests/base/kubeflow.org_mpijobs.yaml) into a small JSON file for tools/validate_mpijob.py:
the `openAPIV3Schema` of version v2beta1 with every `description` removed (the CRD is 670 KB,
almost all of it Kubernetes' pod-spec documentation).

  python3 tools/vendor_mpijob_schema.py CRD.yaml tests/data/schemas/mpijob-v2beta1.schema.json \\
      --source "kubeflow/mpi-operator@<commit> manifests/base/kubeflow.org_mpijobs.yaml"
"""
import argparse
import json

import yaml


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("crd")
    ap.add_argument("output")
    ap.add_argument("--source", required=True, help="provenance recorded in the file")
    a = ap.parse_args()
    crd = yaml.safe_load(open(a.crd))
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "MPIJob"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v2beta1")
    schema = strip(version["schema"]["openAPIV3Schema"])
    out = {"$comment": f"MPIJob v2beta1 openAPIV3Schema from {a.source} (Apache-2.0), descriptions removed",
           "group": crd["spec"]["group"], "version": "v2beta1", "kind": "MPIJob", "openAPIV3Schema": schema}
    with open(a.output, "w") as f:
        json.dump(out, f, separators=(",", ":"), sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
