#!/usr/bin/env bash
# The scaling model's fit and the points of docs/scaling.png measured on this machine:
#  1. the fit: hpcps bench ps, hpcps bench mpi and a job of 1 server + 1 worker, 3 runs each, read by
#     `python docs/scaling.py fit`, which rewrites the constants in hpcps/train/scaling.py;
#  2. the points: hpcps train on generated Zipf data (the median of 3 runs each), 2-4 ranks on one host
#     (shared memory) and 2-3 hosts of the namespace cluster (TCP), written to
#     docs/scaling-measured.json with the model's Job for each, the loops' CPU seconds and the load
#     average before each run (other work on the machine takes cores the model gives the job).
# Needs root for the cluster (the one-host points run without it). Run from the repository root:
#
#   bash docs/measure-scaling.sh [ROWS]      # default 300000 rows
#   FIT=0 bash docs/measure-scaling.sh       # the points only, with the constants as they are
#   REQUESTS=group bash docs/measure-scaling.sh  # the code sends one request per server per group
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

point() {  # point NAME SERVERS WORKERS HOSTS MACHINE SUMMARY...: the median run's figures
  POINTS+=("$("$PY" -c 'import json, sys
name, s, w, hosts, machine, *paths = sys.argv[1:]
runs = sorted((json.load(open(p)) for p in paths), key=lambda r: r["examples_per_s"])
r = runs[len(runs) // 2]
print(json.dumps({"name": name, "job": {"servers": int(s), "workers": int(w), "hosts": int(hosts)},
                  "machine": json.loads(machine), "examples_per_s": round(r["examples_per_s"]),
                  "runs": [round(x["examples_per_s"]) for x in runs], "workers_wait_s": r["max_wait_s"],
                  "loop_cpu_s_worker": r.get("loop_cpu_s_worker"), "loop_cpu_s_server": r.get("loop_cpu_s_server"),
                  "load": [float(open(p + ".load").read()) for p in paths]}))' "$@")")
  echo "${POINTS[-1]}"
}

train() {  # train SERVERS WORKERS OUT (and OUT.load: the load average of the minute before it started)
  cut -d' ' -f1 /proc/loadavg >"$3.load"
  "$BIN/mpiexec" -n $(($1 + $2)) "$BIN/hpcps" train "${ARGS[@]}" --set cluster.servers="$1" \
    --summary-json "$3" >/dev/null
}

if [ "${FIT:-1}" = 1 ]; then
  for i in $(seq "$REPS"); do
    "$BIN/mpiexec" -n 2 "$BIN/hpcps" bench ps --json --sizes 100,1000,10000,100000 >"$WORK/ps-$i.jsonl"
    "$BIN/mpiexec" -n 2 "$BIN/hpcps" bench mpi --json >"$WORK/mpi-$i.jsonl"
    train 1 1 "$WORK/fit-$i.json"
  done
  "$PY" docs/scaling.py fit --ps "$WORK"/ps-*.jsonl --mpi "$WORK"/mpi-*.jsonl --job "$WORK"/fit-*.json \
    --batch 1000 --cores "$CORES" ${REQUESTS:+--requests "$REQUESTS"}
fi

HERE="{\"cores\": $CORES}"
for layout in "1 1" "1 2" "1 3" "2 2"; do
  set -- $layout
  for i in $(seq "$REPS"); do train "$1" "$2" "$WORK/s-$i.json"; done
  point "$1S+$2W" "$1" "$2" 1 "$HERE" "$WORK"/s-*.json
  rm -f "$WORK"/s-*.json*
done

if HPCPS_SLURM_DIR=$WORK/slurm "$ROOT/slurm/local-cluster.sh" start --nodes 3 >/dev/null; then
  export SLURM_CONF=$WORK/slurm/slurm.conf HPCPS_VENV=$(dirname "$BIN")
  # TCP between the namespace hosts: hpcps bench mpi across two of them
  HPCPS_ARGS="" sbatch --wait --output="$WORK/mpi-hosts.out" -N 2 --ntasks=2 --wrap \
    "$BIN/mpiexec -n 2 $BIN/hpcps bench mpi --json" >/dev/null || true
  TCP=$("$PY" -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(json.dumps({"cores": int(sys.argv[2]), "latency_s": min(r["wait_one_way_s"] for r in rows),
                  "link_bytes_per_s": max(r["bytes"] / r["wait_one_way_s"] for r in rows)} if rows else
                 {"cores": int(sys.argv[2])}))' "$WORK/mpi-hosts.out" "$CORES" 2>/dev/null || echo "$HERE")
  run_hosts() {  # run_hosts NAME SERVERS WORKERS HOSTS sbatch-args...
    local name=$1 s=$2 w=$3 h=$4; shift 4
    for i in $(seq "$REPS"); do
      cut -d' ' -f1 /proc/loadavg >"$WORK/h-$i.json.load"
      HPCPS_CKPT_DIR=$WORK/ck-$h-$s-$i HPCPS_SERVERS=$s HPCPS_ARGS="${ARGS[*]} --summary-json $WORK/h-$i.json" \
        sbatch --wait --output="$WORK/job.out" "$@" "$ROOT/slurm/train.sbatch" >/dev/null
    done
    point "$name" "$s" "$w" "$h" "$TCP" "$WORK"/h-*.json
    rm -f "$WORK"/h-*.json*
  }
  run_hosts "1S+1W, 2 hosts" 1 1 2 -N 2 --ntasks=2
  run_hosts "1S+2W, 3 hosts" 1 2 3 -N 3 --ntasks=3
  run_hosts "2S / 2W, 2 hosts" 2 2 2 -N 2 --ntasks=4 --ntasks-per-node=2
else
  echo "measure-scaling: no namespace cluster here: the one-host points only" >&2
fi
printf '%s\n' "${POINTS[@]}" | "$PY" -c 'import json, sys; print(json.dumps([json.loads(l) for l in sys.stdin], indent=1))' \
  >docs/scaling-measured.json
echo "wrote docs/scaling-measured.json"
"$PY" -c 'import json, sys
loads = sorted(x for p in json.load(open(sys.argv[1])) for x in p.get("load", []))
if loads and loads[len(loads) // 2] > 2:
    print(f"measure-scaling: a load average of {loads[len(loads) // 2]:.1f} (median over the runs): other work took "
          "cores the model gives these jobs; measure again on a quiet machine", file=sys.stderr)' docs/scaling-measured.json
