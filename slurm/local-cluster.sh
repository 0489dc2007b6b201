#!/usr/bin/env bash
# A throw-away Slurm on this machine, for tests and CI (not for production).
#
#   slurm/local-cluster.sh start    install (Debian packages, as root) if needed, start munged,
#                                   slurmctld and slurmd on localhost; prints the SLURM_CONF to export
#   slurm/local-cluster.sh start --nodes N
#                                   N "hosts" instead of localhost: each a Linux network namespace
#                                   with its own hostname (UTS namespace) and address, on a bridge
#                                   (see "Hosts" below)
#   slurm/local-cluster.sh stop     stop the daemons by the PIDs in their pid files; with hosts,
#                                   also every process, namespace, link and file the start made
#   slurm/local-cluster.sh status
#   slurm/local-cluster.sh kill-node NAME
#                                   with hosts: a power cut on one host, every process on it (its
#                                   slurmd, job steps, ranks) killed at once; the node stays down
#
# Everything lives under $HPCPS_SLURM_DIR (default /tmp/hpcps-slurm): config, state, spool, logs,
# pid files, the munge key and socket. Clients need SLURM_CONF=$HPCPS_SLURM_DIR/slurm.conf.
# Partitions: "low" (default; its jobs are requeued when preempted, after GraceTime=30 s with
# the user's signal sent first) and "high" (preempts "low"). A node advertises 8 CPUs
# ($HPCPS_SLURM_CPUS).
#
# Hosts (--nodes N): namespaces hpcps-node1..N (hostnames the same) at $NET.11.., the controller in
# its own namespace hpcps-ctl at $NET.2, all joined by the bridge hpcps-br ($NET.1) in the root
# namespace. NET is $HPCPS_CLUSTER_NET (default 10.231.0, a /24). Names resolve through
# $HPCPS_SLURM_DIR/hosts, bind-mounted over /etc/hosts in each host's own mount namespace, so no
# file outside that directory changes. Slurm listens on ports 6827/6828 there (not 6817/6818), so both clusters
# can run at once. A task prolog sets UCX_TLS=tcp,self for every task: the hosts share one
# kernel, and UCX would otherwise pass messages between them through shared memory (it sees one
# machine); with it, ranks on different hosts talk TCP over the bridge, as on real nodes, while
# ranks on the same host still use MPICH's shared memory.
#
# Exit status 3 = Slurm cannot be had here (not root, packages or namespaces unavailable): tests
# skip, saying why, or fail saying it under HPCPS_REQUIRE_CLUSTER=1 (as CI runs them). Exit
# status 1 = it was installed but did not start: a failure.
set -euo pipefail

DIR=${HPCPS_SLURM_DIR:-/tmp/hpcps-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
CPUS=${HPCPS_SLURM_CPUS:-8}
NET=${HPCPS_CLUSTER_NET:-10.231.0}
BRIDGE=hpcps-br
CTL_NS=hpcps-ctl
NODES=0        # 0 = one node on localhost; N = N namespace hosts

cannot() { echo "local-cluster: Slurm cannot run here: $*" >&2; exit 3; }   # skip-worthy: no Slurm to be had
fail() { echo "local-cluster: $*" >&2; exit 1; }                          # a real failure to start

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return
  fi
  [ "$(id -u)" = 0 ] || cannot "the Slurm packages are missing and installing them needs root"
  command -v apt-get >/dev/null || cannot "the Slurm packages are missing and there is no apt-get"
  echo "local-cluster: installing slurmctld slurmd slurm-client munge" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge; } >"$DIR/apt.log" 2>&1 \
    || cannot "apt-get install failed (see $DIR/apt.log)"
}

node_name() { echo "hpcps-node$1"; }
node_addr() { echo "$NET.$((10 + $1))"; }

write_conf() {
  local ctl ports="" spool dpid dlog prolog="" nodes="" names i
  if [ "$NODES" = 0 ]; then
    ctl="$HOST(127.0.0.1)"; spool=$DIR/spool; dpid=$DIR/slurmd.pid; dlog=$DIR/slurmd.log
    nodes="NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN"
    names=$HOST
  else
    ctl="$CTL_NS($NET.2)"; ports=$'SlurmctldPort=6827\nSlurmdPort=6828'
    spool=$DIR/spool/%n; dpid=$DIR/slurmd-%n.pid; dlog=$DIR/slurmd-%n.log
    prolog="TaskProlog=$DIR/task-prolog.sh"
    for i in $(seq 1 "$NODES"); do
      nodes+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") CPUs=$CPUS State=UNKNOWN"$'\n'
    done
    names="hpcps-node[1-$NODES]"
  fi
  cat >"$CONF" <<CONF
ClusterName=hpcps-local
SlurmctldHost=$ctl
$ports
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$dpid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$dlog
$prolog
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=5
KillWait=5
SlurmdTimeout=10
ReturnToService=2
MpiDefault=none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
$nodes
PartitionName=low Nodes=$names Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30 PreemptMode=REQUEUE
PartitionName=high Nodes=$names MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# --- hosts: network namespaces on a bridge -------------------------------------------------------

in_ns() {  # in_ns NAMESPACE COMMAND...: run on that host (its network, its hostname, its /etc/hosts)
  local ns=$1; shift
  nsenter --net="/run/netns/$ns" unshare --mount --uts \
    sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$DIR/hosts" "$ns" "$@"
}

make_ns() {  # make_ns NAMESPACE ADDRESS INDEX
  local ns=$1 addr=$2 veth=hpcps-v$3
  ip netns add "$ns"
  echo "$ns" >>"$DIR/namespaces"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$BRIDGE"
  ip link set "$veth" up
  ip netns exec "$ns" ip addr add "$addr/24" dev eth0
  ip netns exec "$ns" ip link set eth0 up
  ip netns exec "$ns" ip link set lo up
}

start_network() {
  [ "$(id -u)" = 0 ] || cannot "network namespaces need root"
  { command -v ip && command -v unshare && command -v nsenter; } >/dev/null || cannot "no ip(8), unshare(1) or nsenter(1)"
  ip netns add hpcps-probe 2>/dev/null || cannot "ip netns add failed (no network namespaces here)"
  ip netns del hpcps-probe
  ip link show "$BRIDGE" >/dev/null 2>&1 && fail "$BRIDGE exists: another cluster is running (stop it first)"
  remove_stale_namespaces
  ip link add "$BRIDGE" type bridge 2>/dev/null || cannot "cannot create a bridge"
  : >"$DIR/bridge"  # (this directory's cluster made it: only its stop removes it)
  ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  { echo "127.0.0.1 localhost"; echo "$NET.2 $CTL_NS"
    for i in $(seq 1 "$NODES"); do echo "$(node_addr "$i") $(node_name "$i")"; done; } >"$DIR/hosts"
  : >"$DIR/namespaces"
  make_ns "$CTL_NS" "$NET.2" 0
  for i in $(seq 1 "$NODES"); do make_ns "$(node_name "$i")" "$(node_addr "$i")" "$i"; done
  # Every task on these hosts talks TCP to the other hosts (see the header).
  printf '#!/bin/sh\necho export UCX_TLS=tcp,self\n' >"$DIR/task-prolog.sh"
  chmod 755 "$DIR/task-prolog.sh"
}

remove_stale_namespaces() {  # left by a cluster killed before its stop (no bridge: none runs now)
  local ns pids
  for ns in "$CTL_NS" $(for i in $(seq 1 "$NODES"); do node_name "$i"; done); do
    [ -e "/run/netns/$ns" ] || continue
    echo "local-cluster: removing the stale namespace $ns (a cluster stopped without its stop)" >&2
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    # shellcheck disable=SC2086
    [ -n "$pids" ] && { kill -9 $pids 2>/dev/null || true; }
    ip netns del "$ns" 2>/dev/null || fail "cannot remove the stale namespace $ns"
  done
}

stop_network() {
  local ns pids i
  if [ -f "$DIR/namespaces" ]; then
    i=0
    for ns in $(cat "$DIR/namespaces"); do
      # whatever still runs on that host (job steps, a killed slurmd's children) goes with it
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      # shellcheck disable=SC2086
      [ -n "$pids" ] && { kill -9 $pids 2>/dev/null || true; }
      ip netns del "$ns" 2>/dev/null || true
      ip link del "hpcps-v$i" 2>/dev/null || true
      i=$((i + 1))
    done
    rm -f "$DIR/namespaces"
  fi
  if [ -f "$DIR/bridge" ]; then  # (not another directory's: a start refused for it calls stop too)
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -f "$DIR/bridge"
  fi
}

# --- start / stop --------------------------------------------------------------------------------

start_munge() {  # its own key and socket; the socket directory must be 755
  chmod 755 "$DIR/munge"
  if ! alive "$DIR/munged.pid"; then
    [ -f "$DIR/munge.key" ] || mungekey --create --keyfile="$DIR/munge.key" >/dev/null 2>&1 \
      || dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 2>/dev/null
    chmod 400 "$DIR/munge.key"
    munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge.key" \
      --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge.seed" \
      || fail "munged did not start (see $DIR/munged.log)"
  fi
}

wait_idle() {  # every node idle (a drained one is resumed: its reason survives restarts)
  local want=$1 idle state n
  for _ in $(seq 1 90); do
    state=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
    idle=$(echo "$state" | grep -cE ' (idle|mixed|alloc)' || true)
    if [ "$idle" -ge "$want" ]; then echo "export SLURM_CONF=$CONF"; return 0; fi
    for n in $(echo "$state" | awk '$2 ~ /^(drain|down|inval)/ {print $1}'); do
      scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
    done
    sleep 0.5
  done
  fail "the nodes did not become idle (${state:-no answer}; see $DIR/slurmctld.log; is another slurmctld running?)"
}

start() {
  local i n
  # the daemons run as root (SlurmUser=root above), whether or not the packages are there
  [ "$(id -u)" = 0 ] || cannot "a local cluster runs its daemons as root, and this is user $(id -un)"
  mkdir -p "$DIR"/{state,spool,munge}
  install
  if [ "$NODES" != 0 ]; then
    [ -f "$DIR/nodes" ] && fail "a cluster of $(cat "$DIR/nodes") hosts already runs from $DIR (stop it first)"
    echo "$NODES" >"$DIR/nodes"
    start_network
  fi
  write_conf
  start_munge
  export SLURM_CONF=$CONF
  if [ "$NODES" = 0 ]; then
    alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF" || fail "slurmctld did not start (see $DIR/slurmctld.log)"
    alive "$DIR/slurmd.pid" || slurmd -f "$CONF" || fail "slurmd did not start (see $DIR/slurmd.log)"
    wait_idle 1
  else
    in_ns "$CTL_NS" slurmctld -f "$CONF" || fail "slurmctld did not start (see $DIR/slurmctld.log)"
    for i in $(seq 1 "$NODES"); do
      n=$(node_name "$i")
      mkdir -p "$DIR/spool/$n"
      in_ns "$n" slurmd -f "$CONF" || fail "slurmd on $n did not start (see $DIR/slurmd-$n.log)"
    done
    wait_idle "$NODES"
  fi
}

stop_pid() {
  local f=$1 pid
  if alive "$f"; then
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

stop() {
  local f
  for f in "$DIR"/slurmd*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    [ -e "$f" ] && stop_pid "$f"
  done
  stop_network
  rm -f "$DIR/nodes"
}

kill_node() {  # every process of that host, at once (SIGKILL): what a power cut leaves
  local ns=${1:-} pids
  [ "$NODES" != 0 ] && grep -qx "$ns" "$DIR/namespaces" 2>/dev/null \
    || { echo "local-cluster: kill-node: no host '$ns' in this cluster" >&2; exit 2; }
  pids=$(ip netns pids "$ns")
  # shellcheck disable=SC2086
  [ -z "$pids" ] || kill -9 $pids
  echo "local-cluster: killed $(echo $pids | wc -w) process(es) on $ns"
}

usage() { echo "usage: $0 start [--nodes N] | stop | status | kill-node NAME" >&2; exit 2; }
cmd=${1:-}
[ $# -gt 0 ] && shift
target=""
[ "$cmd" = kill-node ] && { target=${1:-}; [ $# -gt 0 ] && shift; }
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES=${2:-}; shift; [ $# -gt 0 ] && shift ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    *) usage ;;
  esac
done
case "$NODES" in ''|*[!0-9]*) echo "local-cluster: --nodes wants a number, not '$NODES'" >&2; exit 2 ;; esac
[ "$NODES" -le 200 ] || { echo "local-cluster: at most 200 hosts" >&2; exit 2; }
[ "$cmd" != start ] && [ -f "$DIR/nodes" ] && NODES=$(cat "$DIR/nodes")

case "$cmd" in
  start) start ;;
  stop) stop ;;
  kill-node) kill_node "$target" ;;
  status)
    for f in "$DIR/munged.pid" "$DIR/slurmctld.pid" "$DIR"/slurmd*.pid; do
      [ -e "$f" ] || continue
      d=$(basename "$f" .pid); if alive "$f"; then echo "$d running"; else echo "$d stopped"; fi
    done
    if [ "$NODES" != 0 ]; then echo "hosts: $NODES (namespaces: $(tr '\n' ' ' <"$DIR/namespaces" 2>/dev/null))"; fi ;;
  *) usage ;;
esac
