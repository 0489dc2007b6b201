"""``python -m hpcps_kernels warmup`` is complete: after it, a job's usual work compiles nothing.

Run in a fresh process: warm up, list every kernel's compiled signatures, do what a training job,
the data generator, evaluation and the server do on small inputs, and list them again.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import numpy as np
    import hpcps_kernels
    from numba.core.registry import CPUDispatcher
    from hpcps_kernels import profiler

    KERNELS = {}  # "module.name" -> dispatcher, each kernel where it is defined
    for m in pkgutil.iter_modules(hpcps_kernels.__path__):
        if m.name in ("profiler", "reference", "__main__"):
            continue
        mod = importlib.import_module(f"hpcps_kernels.{m.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == mod.__name__ \\
                    and obj.targetoptions.get("inline") != "always":
                KERNELS[f"{m.name}.{name}"] = obj

    def signatures():
        return {k: sorted(map(str, obj.signatures)) for k, obj in KERNELS.items()}

    def callees(fn, seen):  # the kernels fn calls, directly or through others (names in its code)
        codes = [fn.py_func.__code__]
        while codes:
            code = codes.pop()
            codes += [c for c in code.co_consts if hasattr(c, "co_names")]
            for name in code.co_names:
                g = fn.py_func.__globals__.get(name)
                if isinstance(g, CPUDispatcher) and g not in seen:
                    seen.add(g)
                    callees(g, seen)
        return seen

    profiler.warmup()
    before = signatures()
    # A kernel called only from other kernels is compiled into them: from a warm cache its own
    # dispatcher never loads, so it counts as warmed up when a warmed-up kernel calls it.
    called = set()
    for k, v in before.items():
        if v:
            callees(KERNELS[k], called)
    missing = sorted(k for k, v in before.items() if not v and KERNELS[k] not in called)

    from hpcps.ps.checkpoint import checksum
    from hpcps.ps.placement import Placement
    from hpcps.ps.server_table import ServerTable
    from hpcps.ps.tables import TableSpec
    from hpcps_kernels.optim import REGISTRY as OPTIMIZER_PARAMS
    from hpcps.train import data, model_file, synth
    from hpcps.train.models import margins_from_params
    from hpcps_kernels import keys as kkeys, metrics, models as kmodels

    d = sys.argv[1]  # the test's own temporary directory
    info = synth.generate(d, 300, 100, 39, True, 1, 24, formats=("libsvm", "criteo", "vw"))
    synth.ratings(d + "/r", 200, 50)
    parts = [data.load_part(info.files["train_libsvm"], 0, 2, binary=True),
             data.load_part(info.files["train_libsvm"], 1, 2),
             data.load_part(info.files["train_criteo"], 0, 1, hash_bits=20, binary=True)]
    place = Placement(3, 64)
    for ds in parts:
        b = ds.batch(0, 64)
        uniq, pos = kkeys.unique_keys(b.indices)
        place.server_of(uniq); place.shard_of(uniq); place.slice(uniq)
        for opt in OPTIMIZER_PARAMS:
            for init, dim, bits in (("zeros", 1, 64), ("normal", 3, 64), ("zeros", 1, 20)):
                t = ServerTable(TableSpec("w", dim, opt, {}, init, 0.01, 0, bits))
                out = np.empty((uniq.size, dim), np.float32)
                t.pull(uniq, out)
                t.push(uniq, np.ones((uniq.size, dim), np.float32))
                t.pull(uniq, out)
                k, r = t.items()
                t.load(k.copy(), r.copy())
        kind = "lr"
        m = margins_from_params(kind, b, pos, np.zeros((uniq.size, 1), np.float32), "logistic")
        kept = ds.batch(0, 64)  # a batch kept across epochs: int32 positions into its unique keys
        ku, kp = kept.compact(*kkeys.dedup_keys(kept.indices))
        w, V = np.zeros(ku.size, np.float32), np.zeros((ku.size, 2), np.float32)
        kmodels.lr_forward_backward(kept.indptr, kp, kept.values, kept.labels, w, np.empty_like(w), 1.0, 0.0, 0)
        kmodels.fm_forward_backward(kept.indptr, kp, kept.values, kept.labels, w, V, np.empty_like(w),
                                    np.empty_like(V), 1.0, 0.0, 0, np.empty(kept.rows))
        metrics.logloss(b.labels.astype(np.float64), m); metrics.auc(b.labels.astype(np.float64), m)
        model_file.write(d + "/m.h5", uniq, np.ones((uniq.size, 1), np.float32),
                         {"model": "lr", "loss": "logistic", "dim": 1, "init": "zeros", "init_scale": 0.01, "seed": 0})
        model_file.ServingModel(d + "/m.h5").pull(uniq)
        checksum(d + "/m.h5")
    after = signatures()
    added = {k: sorted(set(v) - set(before.get(k, []))) for k, v in after.items() if set(v) - set(before.get(k, []))}
    print(json.dumps({"never_compiled": missing, "compiled_after_warmup": added}))
""")


def test_warmup_compiles_every_kernel_a_job_uses(tmp_path):
    # On a copy of the suite's cache (tests/run.py warms it up first) when there is one: a
    # signature the job needs that warmup did not load still shows as added, loaded or compiled,
    # and the copy saves compiling every kernel again (47 s here). Without one, all compile afresh.
    cache = tmp_path / "cache"
    shared = os.environ.get("NUMBA_CACHE_DIR")
    if shared and os.path.isdir(shared):
        shutil.copytree(shared, cache)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(work)], capture_output=True, text=True, timeout=900,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"never_compiled": [], "compiled_after_warmup": {}}, result


LAZY_BLAS = textwrap.dedent("""
    import json, sys
    import numpy as np
    from numba import njit
    from hpcps_kernels import keys

    keys.dedup_keys(np.arange(10, dtype=np.uint64))  # numba's CPU target loads here
    before = "scipy.linalg" in sys.modules

    @njit(cache=False)
    def dot(a, b):
        return np.dot(a, b)

    a = np.arange(6.0).reshape(2, 3)
    ok = bool(np.allclose(dot(a, a.T), a @ a.T))
    print(json.dumps({"scipy_linalg_at_start": before, "blas_works": ok}))
""")


def test_numbas_blas_probe_imports_no_scipy_linalg_at_start_up_and_blas_still_works():
    """numba asks for a BLAS as its CPU target first loads (any kernel's first call) by importing
    scipy.linalg.cython_blas: 0.2-0.3 s of every process with SciPy 1.17. hpcps_kernels answers that
    probe from SciPy's files; a numba function that needs BLAS still compiles and runs (numba's
    C helper imports the module at the first call). HPCPS_LAZY_BLAS=0 leaves numba as it is."""
    got = {}
    for lazy in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", LAZY_BLAS], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, HPCPS_LAZY_BLAS=lazy))
        assert out.returncode == 0, out.stderr[-2000:]
        got[lazy] = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["1"] == {"scipy_linalg_at_start": False, "blas_works": True}, got
    assert got["0"] == {"scipy_linalg_at_start": True, "blas_works": True}, got


PART = textwrap.dedent("""
    import json, sys
    from hpcps_kernels import profiler

    getattr(profiler, "warmup_" + sys.argv[1])() if sys.argv[1] != "all" else profiler.warmup()
    kernels = profiler._kernel_dispatchers()
    # from an empty cache a kernel called by others compiles (and shows signatures) in each process
    # that compiles a caller; it is compiled into its callers, and its own index is not what
    # the processes share. Only the kernels the warm-up calls itself count.
    ids = {id(d) for d in kernels}
    called = {id(g) for d in kernels for name in d.py_func.__code__.co_names
              for g in [d.py_func.__globals__.get(name)] if g is not d and id(g) in ids}
    print(json.dumps({f"{d.__module__}.{d.__name__}": sorted(map(str, d.signatures))
                      for d in kernels if d.signatures and id(d) not in called}))
""")


def test_warmups_two_processes_compile_disjoint_kernels_that_make_up_the_whole():
    """`warmup --jobs 2` runs its parts in two processes at once: no kernel is in both (two
    processes would write one cache index), and together they load what the whole warm-up does."""
    got = {}
    for part in ("models", "data", "all"):
        out = subprocess.run([sys.executable, "-c", PART, part], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        got[part] = json.loads(out.stdout.strip().splitlines()[-1])
    assert not set(got["models"]) & set(got["data"]), set(got["models"]) & set(got["data"])
    assert {**got["models"], **got["data"]} == got["all"]
    assert len(got["all"]) > 50  # 58 kernels today
