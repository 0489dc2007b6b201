#!/usr/bin/env bash
# Issue 41's two-host target, measured: the traffic filters (filters.wire_dtype = "fp16" and
# filters.key_cache) against none, on a job whose bytes cross a TCP link between two hosts of the
# namespace cluster (slurm/local-cluster.sh start --nodes 2).
#
#   bash docs/measure-filters-hosts.sh [ROWS] [PAIRS]      # default 100000 rows, 3 pairs
#   EXTRA="--set 'model.type=\"fm\"'" bash docs/measure-filters-hosts.sh   # a second row: more bytes a key
#
# The job is docs/benchmarks.md's filters row: 3 epochs on `hpcps gen-data` Zipf rows (10,000 test
# rows), 1 server + 2 workers, BSP, defaults. The server runs alone on hpcps-node1 and both workers
# on hpcps-node2 (mpiexec -hosts inside the allocation), so every request and reply crosses the
# link; the workers talk to each other through shared memory. Filtered and unfiltered jobs
# alternate (pair i starts with the other side from pair i-1); each job's --summary-json, the load
# average before it, and the link's figures (`hpcps bench mpi` across the two hosts) are written to
# WORK; the medians and per-pair ratios (filtered / unfiltered) of the whole job's wall time
# (mpiexec's, start-up included), its time_s (the summary's: first step to the end), bytes and the
# loop's CPU, and the difference of test logloss, are printed. Needs root (the namespaces) and the Slurm packages; run from the repository root.
set -euo pipefail
ROWS=${1:-100000}
PAIRS=${2:-3}
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
BIN=$(dirname "$PY")
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$ROOT/.numba_cache}
WORK=$(mktemp -d /tmp/hpcps-filters-hosts.XXXXXX)
export HPCPS_SLURM_DIR=$WORK/slurm
STARTED=0  # stop only a cluster this script started (a stop also removes the bridge another may use)
trap '[ "$STARTED" = 0 ] || "$ROOT/slurm/local-cluster.sh" stop >/dev/null 2>&1 || true' EXIT
# as slurm/train.sbatch runs a rank: one thread each, and UCX's rendezvous from 64 KB between hosts
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1 PYTHONUNBUFFERED=1
export UCX_RNDV_THRESH=${UCX_RNDV_THRESH:-intra:auto,inter:64kb}

"$BIN/hpcps" gen-data --rows "$ROWS" --test-rows 10000 --formats libsvm "$WORK/data" >/dev/null
if ip link show hpcps-br >/dev/null 2>&1; then
  echo "measure-filters-hosts: another namespace cluster runs here (hpcps-br exists): wait for it to stop" >&2; exit 1
fi
"$ROOT/slurm/local-cluster.sh" start --nodes 2 >/dev/null \
  || { [ -f "$HPCPS_SLURM_DIR/namespaces" ] && "$ROOT/slurm/local-cluster.sh" stop; exit 1; }
STARTED=1
export SLURM_CONF=$WORK/slurm/slurm.conf
echo "measure-filters-hosts: $WORK"

# the link: hpcps bench mpi between the two hosts
sbatch --wait --output="$WORK/mpi.out" -N 2 --ntasks=2 --ntasks-per-node=1 \
  --wrap "$BIN/mpiexec -n 2 $BIN/hpcps bench mpi --json" >/dev/null

ARGS="--set 'data.train=\"$WORK/data/train.svm\"' --set 'data.test=\"$WORK/data/test.svm\"' --set train.epochs=3"
ARGS+=" --set train.progress=false ${EXTRA:-}"
FILTERS="--set 'filters.wire_dtype=\"fp16\"' --set filters.key_cache=true"
job() {  # job NAME FILTER-ARGS: one job, the server on hpcps-node1 and the workers on hpcps-node2
  cut -d' ' -f1 /proc/loadavg >"$WORK/$1.load"
  sbatch --wait --output="$WORK/$1.out" -N 2 --ntasks=3 --ntasks-per-node=2 --wrap \
    "/usr/bin/time -f %e -o $WORK/$1.wall $BIN/mpiexec -n 3 -hosts hpcps-node1:1,hpcps-node2:2 $BIN/hpcps train $ARGS $2 --summary-json $WORK/$1.json" \
    >/dev/null || { echo "measure-filters-hosts: job $1 failed:"; tail -5 "$WORK/$1.out"; exit 1; }
}
for i in $(seq "$PAIRS"); do
  if [ $((i % 2)) = 1 ]; then job "off-$i" ""; job "on-$i" "$FILTERS"
  else job "on-$i" "$FILTERS"; job "off-$i" ""; fi
  echo "pair $i done"
done

"$PY" - "$WORK" "$PAIRS" <<'EOF'
import json, statistics, sys
work, pairs = sys.argv[1], int(sys.argv[2])
link = [json.loads(l) for l in open(f"{work}/mpi.out") if l.startswith("{")]
if link:
    for name, key in (("MPI's blocking ping-pong", "one_way_s"), ("with hpcps's sleeping waits", "wait_one_way_s")):
        print(f"link (bench mpi across the hosts), {name}: one way {link[0][key] * 1e6:.1f} us at "
              f"{link[0]['bytes']} bytes, {max(r['bytes'] / r[key] for r in link) / 1e9:.2f} GB/s at best")
runs = {(s, i): json.load(open(f"{work}/{s}-{i}.json")) for s in ("off", "on") for i in range(1, pairs + 1)}
for (s, i), r in runs.items():  # the whole job: mpiexec's wall time (start-up and evaluation included)
    r["wall_s"] = float(open(f"{work}/{s}-{i}.wall").read().split()[-1])
load = {(s, i): float(open(f"{work}/{s}-{i}.load").read()) for s, i in runs}
hosts = runs["on", 1].get("hosts")
print(f"placement: {json.dumps(hosts)}")
def total(r): return r["bytes_sent"] + r["bytes_received"]
for what, f in (("wall_s", lambda r: r["wall_s"]), ("time_s", lambda r: r["time_s"]), ("bytes", total), ("bytes_sent", lambda r: r["bytes_sent"]),
                ("test_logloss", lambda r: r["test_logloss"]), ("loop_cpu_s_worker", lambda r: r["loop_cpu_s_worker"]),
                ("loop_cpu_s_server", lambda r: r["loop_cpu_s_server"])):
    off = [f(runs["off", i]) for i in range(1, pairs + 1)]
    on = [f(runs["on", i]) for i in range(1, pairs + 1)]
    diff = what == "test_logloss"  # (a difference, not a ratio)
    ratios = [b - a if diff else b / a for a, b in zip(off, on)]
    print(f"{what}: unfiltered median {statistics.median(off):.6g} ({', '.join(f'{x:.6g}' for x in off)}); "
          f"filtered {statistics.median(on):.6g} ({', '.join(f'{x:.6g}' for x in on)}); filtered "
          f"{'- ' if diff else '/ '}unfiltered: median of pairs {statistics.median(ratios):.3g} "
          f"(pairs {', '.join(f'{x:.3g}' for x in ratios)})")
print("load before each job: " + ", ".join(f"{s}-{i} {load[s, i]:.1f}" for s, i in sorted(load, key=lambda k: (k[1], k[0]))))
EOF
