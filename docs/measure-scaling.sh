#!/usr/bin/env bash
# The scaling model's fit and the points of docs/scaling.png measured on this machine:
#  1. the fit: hpcps bench ps, hpcps bench mpi (on one host, and across two namespace hosts: the CPU
#     of a message between hosts that share the cores, and the link's constants for the points on
#     hosts) and a job of 1 server + 1 worker, 3 runs each, read by `python docs/scaling.py fit`,
#     which rewrites the constants in hpcps/train/scaling.py;
#  2. the points: hpcps train on generated Zipf data (the median of 3 runs each), 2-4 ranks on one host
#     (shared memory) and 2-3 hosts of the namespace cluster (TCP), written to
#     docs/scaling-measured.json with the model's Job for each, the loops' CPU seconds and the load
#     average before each run (other work on the machine takes cores the model gives the job);
#  3. the servers' poll share fitted on the points' loops' CPU seconds (`python docs/scaling.py
#     fit-polls --write`, which rewrites POLLS in hpcps/train/scaling.py) and the points' table,
#     measured / modelled, each also with the share fitted on the others.
# Needs root for the cluster (the one-host points run without it). Run from the repository root:
#
#   bash docs/measure-scaling.sh [ROWS]      # default 300000 rows
#   FIT=0 bash docs/measure-scaling.sh       # the points only, with the constants as they are
#   REQUESTS=group bash docs/measure-scaling.sh  # the code sends one request per server per group
#   LAYOUTS="1 1,1 3,2 6,4 12" CLUSTER=0 bash docs/measure-scaling.sh  # other one-host points (servers
#                                            # workers, comma-separated), no namespace hosts (a 16-core node)
#   LAYOUTS="1 2,2 1 2000" FIT=0 CLUSTER=0 bash docs/measure-scaling.sh  # a point's batch as a third
#                                            # field (default 1000): a layout auto picks beside another
set -euo pipefail
ROWS=${1:-300000}
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
BIN=$(dirname "$PY")
REPS=${REPS:-3}
CORES=$(nproc)
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$ROOT/.numba_cache}
WORK=$(mktemp -d /tmp/hpcps-scaling.XXXXXX)
trap 'HPCPS_SLURM_DIR=$WORK/slurm "$ROOT/slurm/local-cluster.sh" stop >/dev/null 2>&1 || true' EXIT
"$BIN/hpcps" gen-data --rows "$ROWS" --test-rows 10000 --formats libsvm "$WORK/data" >/dev/null
ARGS=(--set "data.train=\"$WORK/data/train.svm\"" --set train.epochs=1 --set train.progress=false
      --set train.batch_size=1000)
POINTS=()
HOSTS=0  # 1: the namespace cluster runs (root)
if [ "${CLUSTER:-1}" = 1 ] && HPCPS_SLURM_DIR=$WORK/slurm "$ROOT/slurm/local-cluster.sh" start --nodes 3 >/dev/null; then
  HOSTS=1
  export SLURM_CONF=$WORK/slurm/slurm.conf HPCPS_VENV=$(dirname "$BIN")
else
  echo "measure-scaling: no namespace cluster here: the one-host points only, the link's CPU as it is" >&2
fi

point() {  # point NAME SERVERS WORKERS HOSTS MACHINE SUMMARY...: the median run's figures (BATCH: its batch)
  POINTS+=("$(BATCH=${BATCH:-1000} "$PY" -c 'import json, os, sys
name, s, w, hosts, machine, *paths = sys.argv[1:]
runs = sorted((json.load(open(p)) for p in paths), key=lambda r: r["examples_per_s"])
r = runs[len(runs) // 2]
job = {"servers": int(s), "workers": int(w), "hosts": int(hosts)}
if os.environ["BATCH"] != "1000":
    job["batch"] = int(os.environ["BATCH"])
if job["hosts"] > 1:  # (every point on hosts has its servers on other hosts than its workers)
    job["crossing"] = 1.0
print(json.dumps({"name": name, "job": job,
                  "machine": json.loads(machine), "examples_per_s": round(r["examples_per_s"]), "examples": r["examples"],
                  "runs": [round(x["examples_per_s"]) for x in runs], "workers_wait_s": r["max_wait_s"],
                  "loop_cpu_s_worker": r.get("loop_cpu_s_worker"), "loop_cpu_s_server": r.get("loop_cpu_s_server"),
                  "load": [float(open(p + ".load").read()) for p in paths]}))' "$@")")
  echo "${POINTS[-1]}"
}

train() {  # train SERVERS WORKERS OUT [BATCH] (and OUT.load: the load average of the minute before it started)
  cut -d' ' -f1 /proc/loadavg >"$3.load"
  "$BIN/mpiexec" -n $(($1 + $2)) "$BIN/hpcps" train "${ARGS[@]}" --set cluster.servers="$1" \
    --set train.batch_size="${4:-1000}" --summary-json "$3" >/dev/null
}

mpi_hosts() {  # mpi_hosts OUT: hpcps bench mpi between two namespace hosts (TCP)
  HPCPS_ARGS="" sbatch --wait --output="$1" -N 2 --ntasks=2 --wrap \
    "UCX_RNDV_THRESH=intra:auto,inter:64kb $BIN/mpiexec -n 2 $BIN/hpcps bench mpi --json" >/dev/null || true
}

train_hosts() {  # train_hosts SERVERS OUT sbatch-args...: a job on namespace hosts (OUT.load as train's)
  local s=$1 out=$2; shift 2
  cut -d' ' -f1 /proc/loadavg >"$out.load"
  HPCPS_CKPT_DIR=$out.ck HPCPS_SERVERS=$s HPCPS_ARGS="${ARGS[*]} --summary-json $out" \
    sbatch --wait --output="$WORK/job.out" "$@" "$ROOT/slurm/train.sbatch" >/dev/null
}

if [ "${FIT:-1}" = 1 ]; then
  for i in $(seq "$REPS"); do
    "$BIN/mpiexec" -n 2 "$BIN/hpcps" bench ps --json --sizes 100,1000,10000,100000 >"$WORK/ps-$i.jsonl"
    "$BIN/mpiexec" -n 2 "$BIN/hpcps" bench mpi --json >"$WORK/mpi-$i.jsonl"
    train 1 1 "$WORK/fit-$i.json"
    if [ "$HOSTS" = 1 ]; then  # the same job, the server and the worker on two hosts
      mpi_hosts "$WORK/mpi-hosts-$i.jsonl"
      train_hosts 1 "$WORK/fit-hosts-$i.json" -N 2 --ntasks=2
    fi
  done
  "$PY" docs/scaling.py fit --ps "$WORK"/ps-*.jsonl --mpi "$WORK"/mpi-*.jsonl --job "$WORK"/fit-?.json \
    --batch 1000 --cores "$CORES" ${REQUESTS:+--requests "$REQUESTS"} \
    $([ "$HOSTS" = 1 ] && echo --mpi-hosts "$WORK"/mpi-hosts-*.jsonl --job-hosts "$WORK"/fit-hosts-?.json)
elif [ "$HOSTS" = 1 ]; then
  for i in $(seq "$REPS"); do mpi_hosts "$WORK/mpi-hosts-$i.jsonl"; done
fi

HERE="{\"cores\": $CORES}"
IFS=, read -ra LAYOUT_LIST <<<"${LAYOUTS:-1 1,1 2,1 3,2 2}"
for layout in "${LAYOUT_LIST[@]}"; do
  set -- $layout
  for i in $(seq "$REPS"); do train "$1" "$2" "$WORK/s-$i.json" "${3:-1000}"; done
  BATCH=${3:-1000} point "$1S+$2W${3:+, batch $3}" "$1" "$2" 1 "$HERE" "$WORK"/s-*.json
  rm -f "$WORK"/s-*.json*
done

if [ "$HOSTS" = 1 ]; then
  # TCP between the namespace hosts: hpcps bench mpi across two of them (the fit's runs; medians a size)
  TCP=$("$PY" -c 'import json, sys
import numpy as np
rows = [json.loads(l) for p in sys.argv[2:] for l in open(p) if l.startswith("{")]
one_way = {b: float(np.median([r["wait_one_way_s"] for r in rows if r["bytes"] == b])) for b in {r["bytes"] for r in rows}}
print(json.dumps({"cores": int(sys.argv[1]), "latency_s": min(one_way.values()),
                  "link_bytes_per_s": max(b / t for b, t in one_way.items())} if rows else
                 {"cores": int(sys.argv[1])}))' "$CORES" "$WORK"/mpi-hosts-*.jsonl 2>/dev/null || echo "$HERE")
  run_hosts() {  # run_hosts NAME SERVERS WORKERS HOSTS sbatch-args...
    local name=$1 s=$2 w=$3 h=$4; shift 4
    for i in $(seq "$REPS"); do train_hosts "$s" "$WORK/h-$i.json" "$@"; done
    point "$name" "$s" "$w" "$h" "$TCP" "$WORK"/h-*.json
    rm -rf "$WORK"/h-*.json*
  }
  run_hosts "1S+1W, 2 hosts" 1 1 2 -N 2 --ntasks=2
  run_hosts "1S+2W, 3 hosts" 1 2 3 -N 3 --ntasks=3
  run_hosts "2S / 2W, 2 hosts" 2 2 2 -N 2 --ntasks=4 --ntasks-per-node=2
fi
printf '%s\n' "${POINTS[@]}" | "$PY" -c 'import json, sys; print(json.dumps([json.loads(l) for l in sys.stdin], indent=1))' \
  >docs/scaling-measured.json
echo "wrote docs/scaling-measured.json"
# the servers' poll share from the points' loops' CPU seconds (FIT=1; with FIT=0 the table alone),
# and each point's measured / modelled, fitted and left out; again later with
# `python docs/scaling.py fit-polls [--write]`
"$PY" docs/scaling.py fit-polls $([ "${FIT:-1}" = 1 ] && echo --write)
"$PY" -c 'import json, sys
loads = sorted(x for p in json.load(open(sys.argv[1])) for x in p.get("load", []))
if loads and loads[len(loads) // 2] > 2:
    print(f"measure-scaling: a load average of {loads[len(loads) // 2]:.1f} (median over the runs): other work took "
          "cores the model gives these jobs; measure again on a quiet machine", file=sys.stderr)' docs/scaling-measured.json
