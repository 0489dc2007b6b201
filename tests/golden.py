"""Golden runs: whole training jobs whose models must not change when the code is reorganised.

    python tests/golden.py record      # run every golden job and write tests/golden/<name>.json
    python tests/golden.py check       # run them and compare (what tests/test_golden.py does)

Each run trains on synthetic data made here from a fixed seed and describes its model file by
the XXH64 of its keys and of the bit patterns of its values, per table, with float64 sums of the
values. On the platform the goldens were recorded on (the CPU model and its vector extensions,
NumPy, numba and the BLAS) the hashes must match: the model is bit-identical. Elsewhere a BLAS or
a compiler may round differently, so the sums must agree to a relative 1e-5 and the test says
that it compared them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_DIR = os.path.join(HERE, "golden")
sys.path.insert(0, HERE)
from run import mpiexec  # noqa: E402

HPCPS = [sys.executable, "-m", "hpcps.cli"]

# name -> (ranks, data kind, settings, a second run resumed from the first's checkpoint: ranks, settings)
RUNS = {
    "lr-bsp-1s2w": (3, "ctr", {"model.type": "lr", "train.epochs": 2}, None),
    "fm-bsp-1s2w": (3, "ctr", {"model.type": "fm", "model.factors": 4, "train.epochs": 2}, None),
    "deepfm-bsp-1s2w": (3, "deep", {"model.type": "deepfm", "model.factors": 4, "model.hidden": [16, 8], "model.fields": 8,
                                    "train.epochs": 2}, None),
    "fm-one-process": (0, "ctr", {"model.type": "fm", "model.factors": 4, "train.epochs": 2}, None),
    "lr-resume-1-to-2-servers": (3, "ctr", {"model.type": "lr", "train.epochs": 1},
                                 (4, {"model.type": "lr", "train.epochs": 2, "cluster.servers": 2})),
}
ROWS, TEST_ROWS = 4000, 1000


def platform_key() -> dict:
    """What decides the rounding of a run: the CPU and its vector extensions, and the numeric
    libraries."""
    import numba

    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    blas = ""
    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"].get("version", "")
    except (AttributeError, KeyError, TypeError):
        pass
    return {"cpu": model, "extensions": sorted(flags & {"avx2", "avx512f", "fma", "avx512vl", "avx512bw"}),
            "numpy": np.__version__, "numba": numba.__version__, "blas": blas}


def make_data(kind: str, where: str) -> dict:
    from hpcps.train import synth

    if kind == "deep":
        synth.deep(where, ROWS, TEST_ROWS, seed=7)
        return {"data.train": os.path.join(where, "train.ffm"), "data.test": os.path.join(where, "test.ffm")}
    info = synth.generate(where, ROWS, TEST_ROWS, fields=10, interactions=True, seed=7, formats=("libsvm",))
    return {"data.train": info.files["train_libsvm"], "data.test": info.files["test_libsvm"]}


def _args(settings: dict) -> list[str]:
    out = []
    for k, v in settings.items():
        out += ["--set", f"{k}={json.dumps(v)}"]
    return out


def _job(ranks: int, settings: dict, extra: list[str] = ()) -> str:
    cmd = [*mpiexec(), "-n", str(ranks), *HPCPS] if ranks else HPCPS
    proc = subprocess.run([*cmd, "train", *_args(settings), *extra], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"golden job exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr


def describe(model_path: str, summary_path: str) -> dict:
    """The model's tables by the hashes of their keys and values' bits and their sums, and the
    run's test metric."""
    from hpcps.train.model_file import ServingModel
    from hpcps_kernels.hashing import xxh64

    def digest(a: np.ndarray) -> str:
        raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        return f"{int(xxh64(raw, 0, raw.shape[0], np.uint64(0))):016x}"

    model = ServingModel(model_path)
    tables = {}
    for name, t in model.tables.items():
        v = t.values.astype(np.float64)
        tables[name] = {"keys": int(t.keys.shape[0]), "keys_xxh64": digest(t.keys), "values_xxh64": digest(t.values),
                        "sum": float(v.sum()), "abs_sum": float(np.abs(v).sum())}
    summary = json.load(open(summary_path))
    metric = {k: summary[k] for k in ("test_logloss", "test_rmse") if k in summary}
    return {"tables": tables, "metric": metric}


def run(name: str, tmp: str) -> dict:
    """Run the golden job ``name`` in the directory ``tmp``; its description."""
    ranks, kind, settings, then = RUNS[name]
    data = make_data(kind, os.path.join(tmp, "data"))
    common = {**data, "train.progress": False, "train.model_out": os.path.join(tmp, "model.h5")}
    if then is None:
        _job(ranks, {**common, **settings}, ["--summary-json", os.path.join(tmp, "summary.json")])
    else:
        ck = {"checkpoint.dir": os.path.join(tmp, "ck")}
        _job(ranks, {**common, **ck, **settings})
        _job(then[0], {**common, **ck, **then[1]}, ["--resume", "auto", "--summary-json",
                                                     os.path.join(tmp, "summary.json")])
    return describe(os.path.join(tmp, "model.h5"), os.path.join(tmp, "summary.json"))


def compare(name: str, got: dict, want: dict) -> list[str]:
    """Why ``got`` is not the golden ``want`` (empty: it is): exact on the recorded platform,
    else within a relative 1e-5."""
    problems = []
    exact = want["platform"] == platform_key()
    for table, w in want["tables"].items():
        g = got["tables"].get(table)
        if g is None:
            problems.append(f"{name}: no table {table!r}")
            continue
        if g["keys"] != w["keys"] or g["keys_xxh64"] != w["keys_xxh64"]:
            problems.append(f"{name}: table {table!r}'s keys differ ({g['keys']} keys, {w['keys']} golden)")
        if exact and g["values_xxh64"] != w["values_xxh64"]:
            problems.append(f"{name}: table {table!r}'s values differ in their bits (sum {g['sum']!r}, "
                            f"golden {w['sum']!r})")
        for k in ("sum", "abs_sum"):
            if not np.isclose(g[k], w[k], rtol=1e-5, atol=1e-6):
                problems.append(f"{name}: table {table!r}'s {k} {g[k]!r}, golden {w[k]!r}")
    for k, v in want["metric"].items():
        if exact and got["metric"].get(k) != v or not np.isclose(got["metric"].get(k, np.nan), v, rtol=1e-5):
            problems.append(f"{name}: {k} {got['metric'].get(k)!r}, golden {v!r}")
    return problems


def golden_path(name: str) -> str:
    return os.path.join(GOLDEN_DIR, f"{name}.json")


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "check"
    names = argv[1:] or list(RUNS)
    problems = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"hpcps-golden-{name}-") as tmp:
            got = run(name, tmp)
        if what == "record":
            os.makedirs(GOLDEN_DIR, exist_ok=True)
            with open(golden_path(name), "w") as f:
                json.dump({**got, "platform": platform_key()}, f, indent=1)
            print(f"recorded {golden_path(name)}")
        else:
            found = compare(name, got, json.load(open(golden_path(name))))
            problems += found
            print(f"{name}: {'OK' if not found else 'DIFFERS'}")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
