# Sourced by the tests on test hosts (cluster_test.sh, elastic_test.sh, slurm_nodes_test.sh): BT (the binary, $1),
# ROOT, HOSTS (hosts.sh), KEEP; skips (77) without root, network namespaces or mpirun; TMP (a
# new directory) and CL (its test hosts' directory). The caller sets its own EXIT trap.
set -euo pipefail
KEEP=${KEEP:-}
BT=$(realpath "$1")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HOSTS="$ROOT/tests/cluster/hosts.sh"
[ "$(id -u)" = 0 ] || { echo "SKIP: needs root for network namespaces"; exit 77; }
ip netns add bt-probe-$$ 2> /dev/null && ip netns del bt-probe-$$ ||
  { echo "SKIP: cannot create network namespaces here"; exit 77; }
command -v mpirun > /dev/null || { echo "SKIP: no mpirun"; exit 77; }
TMP=$(mktemp -d)
CL="$TMP/cluster"
