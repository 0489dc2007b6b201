#!/usr/bin/env bash
# The points of docs/scaling.png measured on this machine: hpcps train on generated Zipf data,
# 1-4 ranks on one host (shared memory) and 2-3 hosts of the namespace cluster (TCP), written to
# docs/scaling-measured.json with the model's Job for each. Needs root for the cluster (the
# one-host points run without it). Run from the repository root:
#
#   bash docs/measure-scaling.sh [ROWS]      # default 300000 rows
set -euo pipefail
ROWS=${1:-300000}
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
BIN=$(dirname "$PY")
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$ROOT/.numba_cache}
WORK=$(mktemp -d /tmp/hpcps-scaling.XXXXXX)
trap 'HPCPS_SLURM_DIR=$WORK/slurm "$ROOT/slurm/local-cluster.sh" stop >/dev/null 2>&1 || true' EXIT
"$BIN/hpcps" gen-data --rows "$ROWS" --test-rows 10000 --formats libsvm "$WORK/data" >/dev/null
ARGS=(--set "data.train=\"$WORK/data/train.svm\"" --set "data.test=\"$WORK/data/test.svm\""
      --set train.epochs=1 --set train.progress=false)
POINTS=()

point() {  # point NAME SERVERS WORKERS HOSTS SUMMARY
  POINTS+=("$("$PY" -c 'import json, sys
name, s, w, hosts, path = sys.argv[1:]
r = json.load(open(path))
print(json.dumps({"name": name, "job": {"servers": int(s), "workers": int(w), "hosts": int(hosts)},
                  "examples_per_s": round(r["examples_per_s"]), "workers_wait_s": r["max_wait_s"]}))' "$@")")
  echo "${POINTS[-1]}"
}

for layout in "1 1" "1 2" "1 3" "2 2"; do
  set -- $layout
  "$BIN/mpiexec" -n $(($1 + $2)) "$BIN/hpcps" train "${ARGS[@]}" --set cluster.servers="$1" \
    --summary-json "$WORK/s.json" >/dev/null
  point "$1S+$2W" "$1" "$2" 1 "$WORK/s.json"
done

if HPCPS_SLURM_DIR=$WORK/slurm "$ROOT/slurm/local-cluster.sh" start --nodes 3 >/dev/null; then
  export SLURM_CONF=$WORK/slurm/slurm.conf HPCPS_VENV=$(dirname "$BIN")
  run_hosts() {  # run_hosts NAME SERVERS WORKERS HOSTS sbatch-args...
    local name=$1 s=$2 w=$3 h=$4; shift 4
    HPCPS_CKPT_DIR=$WORK/ck-$h-$s HPCPS_SERVERS=$s HPCPS_ARGS="${ARGS[*]} --summary-json $WORK/h.json" \
      sbatch --wait --output="$WORK/job.out" "$@" "$ROOT/slurm/train.sbatch" >/dev/null
    point "$name" "$s" "$w" "$h" "$WORK/h.json"
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
