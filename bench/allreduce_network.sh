#!/usr/bin/env bash
# Allreduce between nodes over a rate-limited network, emulated on one host: every rank acts
# as its own node (BERTRAIN_LOCAL_SIZE=1, so shm/hierarchical run the ring among node leaders),
# Open MPI moves bytes over TCP on loopback only (--mca btl tcp,self), and loopback is shaped
# to RATE (default 10gbit, common cluster Ethernet) with tc's token-bucket filter. This is
# where wire compression pays: compare ring-fp16 with ring, and both with MPI_Allreduce.
# Needs root and iproute2 (tc); the shaping is removed on exit.
#   RATE=25gbit bench/allreduce_network.sh [max_mb]
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-10gbit}
MAX_MB=${1:-256}
tc qdisc add dev lo root tbf rate "$RATE" burst 4mb latency 100ms
trap 'tc qdisc del dev lo root 2>/dev/null || true' EXIT
echo "# loopback shaped to $RATE; 2 ranks as 2 nodes over TCP"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  mpirun -np 2 --oversubscribe --bind-to none --mca btl tcp,self --mca btl_tcp_if_include lo \
  -x OMP_NUM_THREADS=1 -x BERTRAIN_LOCAL_SIZE=1 build/bench/bench_allreduce "$MAX_MB"
