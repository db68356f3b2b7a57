#!/usr/bin/env bash
# `bertrain launch --emit mpijob` writes manifests the MPI Operator accepts: every job spec in
# configs/jobs/ is emitted and validated against the MPIJob v2beta1 CRD schema (vendored from
# kubeflow/mpi-operator, tests/data/schemas/) by python-jsonschema through
# tools/validate_mpijob.py, strictly (unknown fields are errors). The validator is proven to
# reject what the API server would: a misspelt field, a count as a word, another apiVersion.
#   tests/launch/mpijob_schema_test.sh BERTRAIN
set -u
BT=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PY=/usr/bin/python3  # Debian's, with python3-jsonschema and python3-yaml (scripts/setup.sh)
SCHEMA="$ROOT/tests/data/schemas/mpijob-v2beta1.schema.json"
cd "$ROOT"
for spec in configs/jobs/*.yaml; do
  "$BT" launch "$spec" --emit mpijob --output "$TMP" > /dev/null || { echo "FAIL: launch --emit mpijob $spec"; exit 1; }
done
ls "$TMP"/*-mpijob.yaml > /dev/null 2>&1 || { echo "FAIL: no manifests emitted"; exit 1; }
"$PY" tools/validate_mpijob.py "$SCHEMA" "$TMP"/*-mpijob.yaml || { echo "FAIL: an emitted manifest is invalid"; exit 1; }
m=$(ls "$TMP"/*-mpijob.yaml | head -1)
expect_invalid() {  # expect_invalid NAME SED-EXPR PATTERN
  sed "$2" "$m" > "$TMP/bad-$1.yml"
  cmp -s "$m" "$TMP/bad-$1.yml" && { echo "FAIL: the mutation $1 changed nothing"; exit 1; }
  out=$("$PY" tools/validate_mpijob.py "$SCHEMA" "$TMP/bad-$1.yml") && { echo "$out"; echo "FAIL: $1 accepted"; exit 1; }
  echo "$out" | grep -q "$3" || { echo "$out"; echo "FAIL: $1 rejected without naming $3"; exit 1; }
  echo "rejected as expected ($1): $(echo "$out" | sed -n 2p)"
}
expect_invalid misspelt-field 's/slotsPerWorker:/slotPerWorker:/' "slotPerWorker"
expect_invalid count-as-word '0,/replicas: 1$/s//replicas: one/' "replicas"
expect_invalid other-version 's#kubeflow.org/v2beta1#kubeflow.org/v1#' "apiVersion"
echo ok
