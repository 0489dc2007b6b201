#!/usr/bin/env bash
# A throw-away single-node Slurm on localhost, for tests and CI (not for production).
#
#   slurm/local-cluster.sh start    install (Debian packages, as root) if needed, start munged,
#                                   slurmctld and slurmd; prints the SLURM_CONF to export
#   slurm/local-cluster.sh stop     stop the daemons by the PIDs in their pid files
#   slurm/local-cluster.sh status
#
# Everything lives under $HPCPS_SLURM_DIR (default /tmp/hpcps-slurm): config, state, spool, logs,
# pid files, the munge key and socket. Clients need SLURM_CONF=$HPCPS_SLURM_DIR/slurm.conf.
# Partitions: "low" (default; its jobs are requeued when preempted, after GraceTime=30 s with
# the user's signal sent first) and "high" (preempts "low"). The node advertises 8 CPUs.
# Exit status 3 = Slurm cannot be had here (not root, packages unavailable): tests skip, saying why.
# Exit status 1 = it was installed but did not start: a failure.
set -euo pipefail

DIR=${HPCPS_SLURM_DIR:-/tmp/hpcps-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
CPUS=${HPCPS_SLURM_CPUS:-8}

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

write_conf() {
  cat >"$CONF" <<EOF
ClusterName=hpcps-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
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
ReturnToService=2
MpiDefault=none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=low Nodes=$HOST Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30 PreemptMode=REQUEUE
PartitionName=high Nodes=$HOST MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  mkdir -p "$DIR"/{state,spool,munge}
  install
  write_conf
  # munge: its own key and socket; the socket directory must be 755
  chmod 755 "$DIR/munge"
  if ! alive "$DIR/munged.pid"; then
    [ -f "$DIR/munge.key" ] || mungekey --create --keyfile="$DIR/munge.key" >/dev/null 2>&1 \
      || dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 2>/dev/null
    chmod 400 "$DIR/munge.key"
    munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge.key" \
      --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge.seed" \
      || fail "munged did not start (see $DIR/munged.log)"
  fi
  export SLURM_CONF=$CONF
  alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF" || fail "slurmctld did not start (see $DIR/slurmctld.log)"
  alive "$DIR/slurmd.pid" || slurmd -f "$CONF" || fail "slurmd did not start (see $DIR/slurmd.log)"
  for _ in $(seq 1 60); do
    state=$(sinfo -h -N -o %T 2>/dev/null | head -1 || true)
    case "$state" in
      idle*|mixed*|alloc*) echo "export SLURM_CONF=$CONF"; return 0 ;;
      drain*|down*|inval*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  fail "the node did not become idle (state: ${state:-none}; see $DIR/slurmctld.log; is another slurmctld running?)"
}

stop() {
  for d in slurmd slurmctld munged; do
    if alive "$DIR/$d.pid"; then
      pid=$(cat "$DIR/$d.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$DIR/$d.pid"
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) for d in munged slurmctld slurmd; do alive "$DIR/$d.pid" && echo "$d running" || echo "$d stopped"; done ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
