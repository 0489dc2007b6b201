"""How far hpcps's defaults land from a tuned model, on every data set the tests and examples use.

    .venv/bin/python docs/defaults-sweep.py [--only NAME ...] [--ranks 3] [--out docs/defaults-sweep.json]

For each data set (generated as the tests generate it, into a temporary folder):

1. **defaults**: ``hpcps train`` with nothing set but the files (and the model the tests use there);
   and again with early stopping (``train.holdout = 10``, ``train.early_stop = 2``, up to
   ``--epochs``), the two keys a user adds to let the holdout pick the number of epochs;
2. **grid**: ``hpcps tune`` over the set's grid (every point trained at once, early stopping on every
   10th row, up to ``--epochs``): the best test loss in the grid and that of tune's pick;
3. **tuned**: tune's ``best.toml`` trained again on every row (its ``[train] holdout`` removed).

It prints one markdown row per set: the defaults' gaps to the better of the grid's best and the
tuned model (the issue's goal: at most 0.002 logloss), and tune's pick against the grid's best
(at most 0.001). Regression sets report RMSE. Runs every job under ``mpiexec -n --ranks``.

``--paired`` measures how much of each logloss set's gap is noise: it trains the defaults and the
tuned model (the stored pick, for its epochs) again, scores the test rows with both, and prints the
gap with its paired bootstrap standard error over the test rows (2,000 resamples).

``--picks`` measures tune's pick on a test set large enough to judge it (on 300–5,000 test rows
the grid's best on test is partly the luck of those rows): each logloss set's training rows again
with 20,000 test rows, ``hpcps tune`` with ``--folds 1`` (one holdout) and with ``--folds auto``
(cross-validation folds); every member trained on every row for the epochs the folds chose for it,
and each pick trained as its ``best.toml`` would be, scored on the 20,000 rows against the best
member.

``--candidate KEY=VALUE ...`` tries other defaults instead: one job per set with those settings
added, each compared with the grid's best and tuned model already in ``--out`` (nothing is
written), and a count of the logloss sets within 0.002. For example, early stopping with an L2 of
10: ``--candidate train.holdout=10 train.early_stop=2 train.epochs=20 optimizer.l2=10``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from hpcps.bench.vw import mpiexec_command  # noqa: E402  (HPCPS_MPIEXEC, else the venv's, as the benchmarks)
from hpcps.train import synth  # noqa: E402

LR_GRID = ["optimizer.alpha=0.03,0.05,0.1,0.2,0.3,0.5", "optimizer.l2=0,1,10"]
# name, who uses it, how to make it, the model the tests train on it, the grid
SETS = [
    ("s3k-f6", "test_train (small_data)", ("synth", 3000, 300, dict(fields=6, seed=4)), [], LR_GRID),
    ("s3k-f10", "test_data", ("synth", 3000, 500, dict(fields=10, seed=3)), [], LR_GRID),
    ("s4k-f8", "test_train", ("synth", 4000, 1001, dict(fields=8, seed=2)), [], LR_GRID),
    ("s6k-f10", "test_train", ("synth", 6000, 500, dict(fields=10, seed=9)), [], LR_GRID),
    ("s6k-f8", "test_reliability", ("synth", 6000, 2000, dict(fields=8, seed=3)), [], LR_GRID),
    ("s20k-f10", "test_one_process", ("synth", 20_000, 2000, dict(fields=10, seed=4)), [], LR_GRID),
    ("s30k-f10", "test_chaos (its 20,000 rows since 2026-11-23)", ("synth", 30_000, 3000, dict(fields=10, seed=11)), [], LR_GRID),
    ("s30k-f39", "test_one_process (criteo)", ("synth", 30_000, 3000, dict(fields=39, seed=6)), [], LR_GRID),
    ("s60k-f10", "test_checkpoint, Slurm tests", ("synth", 60_000, 5000, dict(fields=10, seed=8)), [], LR_GRID),
    ("fm6k", "test_estimator (FM)", ("synth", 6000, 3000, dict(fields=10, interactions=True, seed=3, hash_bits=14)),
     ['model.type="fm"'], LR_GRID),
    ("fm30k", "test_tune (FM)", ("synth", 30_000, 5000, dict(fields=10, interactions=True, seed=4, hash_bits=16)),
     ['model.type="fm"'], LR_GRID),
    ("deep200k", "test_deep, examples/deepfm.toml (DeepFM)", ("deep", 200_000, 20_000, dict(seed=5)),
     ['model.type="deepfm"', "model.fields=8", "data.hash_bits=16"],
     ["model.dense_lr=0.001,0.002,0.004,0.008", "optimizer.alpha=0.05,0.1,0.2"]),
    ("ratings60k", "test_one_process, examples/fm_ratings.toml (FM, squared loss)", ("ratings", 60_000, 6000, {}),
     ['model.type="fm"', 'model.loss="squared"'],
     ["optimizer.alpha=0.1,0.3,1,3", "optimizer.l2=0,0.1,1"]),
]


def make(kind, rows, test_rows, kw, out):
    if kind == "synth":
        f = synth.generate(out, rows, test_rows, formats=("libsvm",), **kw).files
        return f["train_libsvm"], f["test_libsvm"]
    if kind == "deep":
        d = synth.deep(out, rows, test_rows, **kw)
        return d["train"], d["test"]
    d = synth.ratings(out, rows, test_rows, **kw)
    return d["train"], d["test"]


def prepare(tmp: str, name: str, kind: str, rows: int, test_rows: int, kw: dict, settings: list[str]):
    """Generate one set into ``tmp/name``; returns (that folder, its metric, the settings of a job on it)."""
    d = os.path.join(tmp, name)
    train, test = make(kind, rows, test_rows, kw, d)
    metric = "test_rmse" if kind == "ratings" else "test_logloss"
    return d, metric, [f'data.train="{train}"', f'data.test="{test}"', "train.progress=false", *settings]


def job(ranks: int, args: list[str], what: str) -> str:
    cmd = [mpiexec_command(), "-n", str(ranks), sys.executable, "-m", "hpcps.cli", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"defaults-sweep: {what} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p.stdout


def sets_args(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="run these sets only (names from the table)")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20, help="tune's epoch limit (early stopping ends sooner)")
    ap.add_argument("--out", default=os.path.join(HERE, "defaults-sweep.json"))
    ap.add_argument("--candidate", nargs="+", metavar="KEY=VALUE",
                    help="try these settings as the defaults against the results in --out (writes nothing)")
    ap.add_argument("--picks", action="store_true",
                    help="tune's pick with one holdout and with folds, judged on --pick-test-rows test rows")
    ap.add_argument("--pick-test-rows", type=int, default=20_000)
    ap.add_argument("--paired", action="store_true",
                    help="the gap between the defaults and the tuned model in --out, with its bootstrap error")
    ap.add_argument("--grid", nargs="+", metavar="KEY=V1,V2",
                    help="this grid instead of each set's own (the tests use a smaller one)")
    a = ap.parse_args()
    chosen = [s if not a.grid else (*s[:4], a.grid) for s in SETS if not a.only or s[0] in a.only]
    if a.paired:
        return paired(chosen, json.load(open(a.out)), a.ranks)
    if a.picks:
        return picks(chosen, a.ranks, a.epochs, a.pick_test_rows)
    if a.candidate:
        return candidate(chosen, a.candidate, json.load(open(a.out)), a.ranks)
    results = json.load(open(a.out)) if a.only and os.path.exists(a.out) else {}
    print("| data set (used by) | metric | defaults | with early stopping (epoch) | grid's best on test "
          "| tuned (best.toml, every row) | defaults − best | early stopping − best | pick − grid's best | time (its 4 jobs, whole) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="hpcps-sweep-") as tmp:
        for name, used_by, (kind, rows, test_rows, kw), model, grid in chosen:
            t0 = time.time()
            d, metric, common = prepare(tmp, name, kind, rows, test_rows, kw, model)
            job(a.ranks, ["train", *sets_args(common), "--summary-json", f"{d}/defaults.json"], f"{name}: defaults")
            defaults = json.load(open(f"{d}/defaults.json"))[metric]
            job(a.ranks, ["train", *sets_args([*common, "train.holdout=10", "train.early_stop=2",
                                               f"train.epochs={a.epochs}"]),
                          "--summary-json", f"{d}/early.json"], f"{name}: defaults with early stopping")
            early = json.load(open(f"{d}/early.json"))
            job(a.ranks, ["tune", *sets_args([*common, f"train.epochs={a.epochs}"]),
                          *[g for item in grid for g in ("--grid", item)],
                          "--out", f"{d}/best.toml", "--summary-json", f"{d}/tune.json"], f"{name}: tune")
            ranking = json.load(open(f"{d}/tune.json"))["ranking"]
            grid_best = min(r[metric] for r in ranking)
            pick = ranking[0]
            best_toml = re.sub(r"(?m)^(holdout|early_stop) = .*\n", "", open(f"{d}/best.toml").read())
            open(f"{d}/tuned.toml", "w").write(best_toml)
            job(a.ranks, ["train", f"{d}/tuned.toml", "--summary-json", f"{d}/tuned.json"], f"{name}: tuned")
            tuned = json.load(open(f"{d}/tuned.json"))[metric]
            point = {k: v for k, v in pick.items() if "." in k}
            best = min(grid_best, tuned)
            results[name] = dict(used_by=used_by, metric=metric, defaults=defaults, early=early[metric],
                                 early_epoch=early.get("best_epoch"), early_gap=early[metric] - best,
                                 ranking=ranking, grid_best=grid_best,
                                 pick=pick[metric], pick_point=point, pick_epochs=pick["best_epoch"], tuned=tuned,
                                 gap=defaults - best, pick_gap=pick[metric] - grid_best, time_s=time.time() - t0)
            r = results[name]
            desc = ", ".join(f"{k.split('.')[-1]} {v:g}" for k, v in point.items())
            print(f"| {name} ({used_by}) | {metric.split('_')[1]} | {defaults:.4f} | {r['early']:.4f} ({r['early_epoch']}) | "
                  f"{grid_best:.4f} | {tuned:.4f} ({desc}, {r['pick_epochs']} epochs) | {r['gap']:+.4f} | "
                  f"{r['early_gap']:+.4f} | {r['pick_gap']:+.4f} | "
                  f"{r['time_s']:.0f} s |", flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


def candidate(chosen: list, settings: list[str], results: dict, ranks: int) -> None:
    """One job per set with ``settings`` added, against the grid's best and tuned model in ``results``."""
    print(f"| data set | metric | with {' '.join(settings)} (epoch) | best (grid or tuned) | gap | defaults' gap |")
    print("|---|---|---|---|---|---|")
    within = total = before = 0
    with tempfile.TemporaryDirectory(prefix="hpcps-sweep-") as tmp:
        for name, _, (kind, rows, test_rows, kw), model, _ in chosen:
            if name not in results:
                sys.exit(f"defaults-sweep: {name} has no results to compare with; run the sweep for it first")
            d, metric, common = prepare(tmp, name, kind, rows, test_rows, kw, [*model, *settings])
            job(ranks, ["train", *sets_args(common), "--summary-json", f"{d}/candidate.json"], f"{name}: candidate")
            got = json.load(open(f"{d}/candidate.json"))
            r = results[name]
            best = min(r["grid_best"], r["tuned"])
            gap = got[metric] - best
            if metric == "test_logloss":
                total += 1
                within += gap <= 0.002
                before += r["gap"] <= 0.002
            print(f"| {name} | {metric.split('_')[1]} | {got[metric]:.4f} ({got.get('best_epoch') or '-'}) | {best:.4f} "
                  f"| {gap:+.4f} | {r['gap']:+.4f} |", flush=True)
    print(f"\nlogloss sets within 0.002 of the best: {within} of {total} (the defaults: {before})")


def picks(chosen: list, ranks: int, epochs: int, test_rows: int = 20_000) -> None:
    """Each logloss set with ``test_rows`` test rows: ``hpcps tune`` with one holdout and with folds;
    then every member of the grid trained on every row for the epochs the folds chose for it (as
    ``best.toml`` would train it), and each pick trained the same way, against the best of those."""
    print(f"| data set | folds (auto) | the grid's best, trained on every row, on {test_rows:,} test rows "
          f"| one holdout: its pick − best | folds: its pick − best | time: tunes (one holdout / folds), members |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="hpcps-sweep-") as tmp:
        for name, _, (kind, rows, _, kw), model, grid in chosen:
            if kind == "ratings":
                continue
            d, metric, common = prepare(tmp, name, kind, rows, test_rows, kw, model)
            got, times = {}, {}
            for folds in ("1", "auto"):
                t0 = time.time()
                job(ranks, ["tune", *sets_args([*common, f"train.epochs={epochs}"]),
                            *[g for item in grid for g in ("--grid", item)], "--folds", folds,
                            "--summary-json", f"{d}/tune-{folds}.json"], f"{name}: tune --folds {folds}")
                got[folds], times[folds] = json.load(open(f"{d}/tune-{folds}.json")), time.time() - t0

            def trained(row: dict) -> float:  # that member, its epochs, every row
                point = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in row.items() if "." in k]
                out = f"{d}/member.json"
                job(ranks, ["train", *sets_args([*common, *point, f"train.epochs={row['best_epoch']}"]),
                            "--summary-json", out], f"{name}: a member")
                return json.load(open(out))[metric]

            t0 = time.time()
            members = {r["member"]: trained(r) for r in got["auto"]["ranking"]}
            best = min(members.values())
            one = got["1"]["ranking"][0]
            one_loss = members[one["member"]] if got["auto"]["folds"] == 1 else trained(one)
            cv = members[got["auto"]["ranking"][0]["member"]]
            print(f"| {name} | {got['auto']['folds']} | {best:.4f} | {one_loss - best:+.4f} | {cv - best:+.4f} "
                  f"| {times['1']:.0f} / {times['auto']:.0f} s, {time.time() - t0:.0f} s |", flush=True)


def paired(chosen: list, results: dict, ranks: int) -> None:
    """Each logloss set's defaults against its tuned model, row by row on the test set: the gap and
    its paired bootstrap standard error (how far the gap would move with other test rows)."""
    import numpy as np
    print("| data set | test rows | defaults | tuned | gap | bootstrap SE | 95 % interval |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="hpcps-sweep-") as tmp:
        for name, _, (kind, rows, test_rows, kw), model, _ in chosen:
            r = results.get(name)
            if r is None or r["metric"] != "test_logloss":
                continue
            tuned = [f"{k}={v}" for k, v in r["pick_point"].items()] + [f"train.epochs={r['pick_epochs']}"]
            losses = {}
            for which, extra in (("defaults", []), ("tuned", tuned)):
                d, _, common = prepare(os.path.join(tmp, which), name, kind, rows, test_rows, kw, [*model, *extra])
                test = next(c for c in common if c.startswith("data.test="))[len("data.test="):]
                out = os.path.join(d, "scores.txt")
                job(ranks, ["train", *sets_args([*common, f"data.predict={test}", f'data.predict_out="{out}"'])],
                    f"{name}: {which}")
                labels = np.array([float(line.split(None, 1)[0]) > 0 for line in open(json.loads(test), "rb")])
                p = np.clip(np.loadtxt(out), 1e-12, 1 - 1e-12)
                losses[which] = -np.where(labels, np.log(p), np.log1p(-p))
            diff = losses["defaults"] - losses["tuned"]
            rng = np.random.default_rng(0)
            boots = np.array([diff[rng.integers(0, diff.size, diff.size)].mean() for _ in range(2000)])
            lo, hi = np.percentile(boots, [2.5, 97.5])
            print(f"| {name} | {diff.size} | {losses['defaults'].mean():.4f} | {losses['tuned'].mean():.4f} "
                  f"| {diff.mean():+.4f} | {boots.std():.4f} | [{lo:+.4f}, {hi:+.4f}] |", flush=True)


if __name__ == "__main__":
    main()
