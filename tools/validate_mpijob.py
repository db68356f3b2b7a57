#!/usr/bin/env python3
"""Validates Kubernetes MPIJob manifests (bertrain launch --emit mpijob) against the MPI Operator's
v2beta1 CRD schema (tests/data/schemas/mpijob-v2beta1.schema.json, from
tools/vendor_mpijob_schema.py) with python-jsonschema, as strictly as `kubectl apply
--validate=strict` does: apiVersion and kind must be the CRD's, and an unknown field is an error
(the API server would prune it silently) except under x-kubernetes-preserve-unknown-fields.
OpenAPI's x-kubernetes-int-or-string becomes "an integer or a string".

  python3 tools/validate_mpijob.py SCHEMA.json MANIFEST.yaml [MANIFEST.yaml ...]

Prints one line per manifest (ok, or each error with its path) and exits 1 if any is invalid.
"""
import json
import sys

import jsonschema
import yaml


def strict(node):
    """The OpenAPI v3 structural schema as a JSON Schema that rejects unknown fields."""
    if isinstance(node, list):
        return [strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    vendored = json.load(open(sys.argv[1]))
    schema = strict(vendored["openAPIV3Schema"])
    api_version = f"{vendored['group']}/{vendored['version']}"
    # The CRD leaves metadata open ("type: object"); Kubernetes requires a name.
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": vendored["kind"]}
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}}}
    validator = jsonschema.Draft7Validator(schema)
    bad = 0
    for path in sys.argv[2:]:
        docs = [d for d in yaml.safe_load_all(open(path)) if d is not None]
        errors = []
        if len(docs) != 1:
            errors.append(f"{len(docs)} YAML documents, expected one MPIJob")
        for doc in docs:
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
                where = ".".join(str(p) for p in e.absolute_path) or "(top)"
                errors.append(f"{where}: {e.message}")
        if errors:
            bad += 1
            print(f"{path}: INVALID against MPIJob {vendored['version']}")
            for e in errors:
                print(f"  {e}")
        else:
            print(f"{path}: valid MPIJob {vendored['version']} ({len(json.dumps(docs[0]))} bytes)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
