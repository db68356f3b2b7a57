#!/usr/bin/env bash
# Test hosts on this machine: network namespaces on one bridge, each with its own address,
# hostname (a UTS namespace per command) and shaped link, so that Open MPI launches ranks into
# them as into separate hosts and talks between them over TCP.
#
#   hosts.sh up DIR N        create N hosts h0..h(N-1) (10.91.X.1..N/24) and write into DIR:
#                            hostfile (one line per host, slots from SLOTS, default 2), agent
#                            (Open MPI's plm_rsh_agent: enters the host's namespace), names
#   hosts.sh down DIR        remove every namespace of DIR (safe to call twice, after failures)
#   hosts.sh exec DIR HOST CMD...   run CMD on HOST (h0.. or its address)
#   hosts.sh shape DIR HOST RATE_GBIT [DELAY_MS [LOSS_PCT]]   shape HOST's link (both directions;
#                            delay needs the kernel's netem, loss uses nftables)
#   hosts.sh cut DIR HOST    take HOST's link down (its processes keep running, unreachable)
#   hosts.sh restore DIR HOST   bring HOST's link up again
#   hosts.sh pids DIR HOST   the processes running on HOST
#   hosts.sh kill DIR HOST   SIGKILL every process in HOST's namespace (a host that died)
#   hosts.sh mpirun DIR ARGS...     mpirun from h0 over the hostfile, TCP between the hosts
#   hosts.sh mca DIR         the same settings as OMPI_MCA_* variables (NAME=VALUE lines), for
#                            an mpirun started by another program (bertrain launch --elastic)
#
# Only addresses inside these namespaces exist; the bridge lives in a namespace of its own, so
# nothing is added to this machine's network. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN).
set -euo pipefail

die() { echo "hosts.sh: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: hosts.sh up|down|exec|shape|cut|restore|pids|kill|mca|mpirun DIR ..."
cmd=$1 dir=$2
shift 2

# Each DIR gets its own namespaces: the prefix is derived from DIR's path, so that concurrent
# clusters (ctest -j) never share names, and the subnet from the same hash.
key=$(printf '%s' "$(realpath -m "$dir")" | cksum | awk '{print $1 % 200 + 20}')
prefix="bt${key}"
subnet="10.91.${key}"
ns_of() { # HOST (hN or address) -> namespace name
  local h=$1
  case "$h" in
    h[0-9]*) echo "${prefix}-${h}" ;;
    "$subnet".*) echo "${prefix}-h$((${h##*.} - 1))" ;;
    *) die "unknown host '$h' (h0.. or ${subnet}.N)" ;;
  esac
}
host_of() { local ns; ns=$(ns_of "$1"); echo "${ns#"${prefix}-"}"; }
in_ns() { # NS CMD...: run in the namespace with its own hostname
  local ns=$1
  shift
  ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "${ns#"${prefix}-"}" "$@"
}

case "$cmd" in
  up)
    n=${1:?hosts.sh up DIR N}
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
    mkdir -p "$dir"
    "$0" down "$dir" 2> /dev/null || true
    sw="${prefix}-sw"
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    : > "$dir/hostfile"
    : > "$dir/names"
    for i in $(seq 0 $((n - 1))); do
      ns="${prefix}-h$i"
      addr="${subnet}.$((i + 1))"
      ip netns add "$ns"
      ip -n "$ns" link set lo up
      # Give up on unacknowledged TCP data after ~6 s instead of ~15 min, as clusters tuned for
      # failure detection do: the launcher then notices a host cut off (the ranks do anyway,
      # through --stall-timeout).
      ip netns exec "$ns" sysctl -q -w net.ipv4.tcp_retries2=5
      ip -n "$ns" link add eth0 type veth peer name "v$i" netns "$sw"
      ip -n "$ns" addr add "$addr/24" dev eth0
      ip -n "$ns" link set eth0 up
      ip -n "$sw" link set "v$i" master br0
      ip -n "$sw" link set "v$i" up
      echo "$addr slots=${SLOTS:-2}" >> "$dir/hostfile"
      echo "h$i $addr $ns" >> "$dir/names"
    done
    cat > "$dir/agent" << AGENT
#!/bin/sh
# Open MPI's plm_rsh_agent for the test hosts of $dir: agent HOST CMD...
# A host whose link is down (cut, or a dead machine: kill + cut) does not answer, as ssh would
# not: the agent tries the network first.
host=\$1; shift
ping -c 1 -W 2 "\$host" > /dev/null 2>&1 || { echo "ssh: connect to host \$host port 22: No route to host" >&2; exit 255; }
exec "$(realpath "$0")" exec "$(realpath "$dir")" "\$host" sh -c "\$*"
AGENT
    chmod +x "$dir/agent"
    # Every host reaches every other before anything is launched.
    for i in $(seq 0 $((n - 1))); do
      ip netns exec "${prefix}-h0" ping -c 1 -W 2 "${subnet}.$((i + 1))" > /dev/null ||
        die "h0 cannot reach h$i (${subnet}.$((i + 1)))"
    done
    ;;
  down)
    for ns in $(ip netns list | awk '{print $1}' | grep "^${prefix}-" || true); do
      ip netns pids "$ns" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
      ip netns del "$ns" 2> /dev/null || true
    done
    ;;
  exec)
    host=${1:?hosts.sh exec DIR HOST CMD...}
    shift
    in_ns "$(ns_of "$host")" "$@"
    ;;
  shape)
    host=${1:?} rate=${2:?} delay=${3:-0} loss=${4:-0}
    ns=$(ns_of "$host")
    i=${ns##*-h}
    # Rate on both ends of the host's cable (its sending side and the switch's side to it):
    # netem when there is delay to add (and the kernel has netem), else a token bucket. Loss
    # is dropped by nftables on the host's side, in both directions (netem is not in every
    # kernel; nftables' numgen is).
    for end in "$ns eth0" "${prefix}-sw v$i"; do
      set -- $end
      ip -n "$1" link set "$2" txqueuelen 10000
      tc -n "$1" qdisc del dev "$2" root 2> /dev/null || true
      if [ "$delay" != 0 ]; then
        tc -n "$1" qdisc add dev "$2" root netem rate "${rate}gbit" delay "${delay}ms" limit 100000 ||
          die "this kernel has no netem qdisc: latency cannot be added (rate and loss can)"
      else
        tc -n "$1" qdisc add dev "$2" root tbf rate "${rate}gbit" burst 4mb latency 100ms
      fi
    done
    ip netns exec "$ns" nft delete table inet btloss 2> /dev/null || true
    if [ "$loss" != 0 ]; then
      per10k=$(awk -v l="$loss" 'BEGIN{printf "%d", l * 100}')
      ip netns exec "$ns" nft -f - << NFT
table inet btloss {
  chain in { type filter hook input priority 0; iifname "eth0" numgen random mod 10000 < $per10k drop; }
  chain out { type filter hook output priority 0; oifname "eth0" numgen random mod 10000 < $per10k drop; }
}
NFT
    fi
    ;;
  cut)
    ns=$(ns_of "${1:?}")
    ip -n "$ns" link set eth0 down
    ;;
  restore)
    ns=$(ns_of "${1:?}")
    ip -n "$ns" link set eth0 up
    ;;
  pids)
    ip netns pids "$(ns_of "${1:?}")"
    ;;
  kill)
    ns=$(ns_of "${1:?}")
    # (a process may end between the listing and its kill, and a dying rank may start another:
    # kill what is listed until nothing is, a second at most; a process already gone is no error)
    for _ in $(seq 1 10); do
      pids=$(ip netns pids "$ns")
      [ -n "$pids" ] || break
      kill -9 $pids 2>/dev/null || true
      sleep 0.1
    done
    ;;
  mca)
    echo "OMPI_MCA_plm_rsh_agent=$(realpath "$dir")/agent"
    echo "OMPI_MCA_plm_rsh_no_tree_spawn=1"
    echo "OMPI_MCA_btl=tcp,vader,self"
    echo "OMPI_MCA_btl_tcp_if_include=${subnet}.0/24"
    echo "OMPI_MCA_oob_tcp_if_include=${subnet}.0/24"
    ;;
  mpirun)
    exec "$0" exec "$dir" h0 mpirun --hostfile "$(realpath "$dir")/hostfile" \
      --mca plm_rsh_agent "$(realpath "$dir")/agent" --mca plm_rsh_no_tree_spawn 1 \
      --mca btl tcp,vader,self --mca btl_tcp_if_include "${subnet}.0/24" \
      --mca oob_tcp_if_include "${subnet}.0/24" --mca oob_tcp_keepalive_time 5 \
      --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3 "$@"
    ;;
  *) die "unknown command '$cmd'" ;;
esac
