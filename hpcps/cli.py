"""The ``hpcps`` command line.

    mpiexec -n 4 hpcps train [CONFIG.toml] [--set section.key=value ...]
    hpcps eval --model MODEL.h5 --data FILE
    hpcps predict --model MODEL.h5 --data FILE --out SCORES
    hpcps gen-data OUT_DIR [--rows N] [--test-rows N] [--interactions] [--ratings]
    hpcps supervise [--max-restarts N] -- mpiexec -n 4 hpcps train [CONFIG.toml] ...
    mpiexec -n 3 hpcps tune [CONFIG.toml] --grid optimizer.alpha=0.03,0.1,0.3 [--grid ...] --out best.toml
    mpiexec -n 2 hpcps bench {mpi,ps}

``train`` is collective: every rank parses its own command line and the ranks check they were
given the same one; the first rank reads the configuration file and broadcasts it. A bad key or
value is reported on every rank, naming the key, and the job exits with status 2.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import re
import sys



def _fail(message: str, rank: int | None = None, status: int = 2) -> int:
    """Report ``message`` as this command's one-line error; returns ``status`` (2: bad input or
    configuration, 1: a run-time failure such as a full disk). An empty message is not printed
    (another rank reported it)."""
    if message:
        prefix = f"hpcps: rank {rank}: " if rank is not None else "hpcps: "
        sys.stderr.write(f"{prefix}error: {message}\n")
        sys.stderr.flush()
    return status


def _fail_once(message: str, rank: int) -> int:
    """An error every rank of the job found alike (the configuration, the layout, the command
    line): reported once, by the first rank, without a rank number; exit status 2 on every rank."""
    return _fail(message if rank == 0 else "")


def _collective_config(args, world, prepare=None):
    """Collective: the configuration every rank was given, read on the first rank (with
    ``prepare(raw)`` turning it into what the command runs, checked there) and broadcast; the
    ranks check they agree and that the layout fits the world. Returns (raw, prepared, 0) or
    (None, None, exit status) after reporting the error."""
    from hpcps import config
    from hpcps.ps.layout import LayoutError, check_world

    rank = world.rank
    # 1. every rank was given the same command line?
    digest = int(hashlib.sha256(json.dumps(sorted((k, str(v)) for k, v in vars(args).items() if k != "func"))
                                .encode()).hexdigest()[:12], 16)
    if not world.same_everywhere(digest, "agreement on the command line"):
        return None, None, _fail_once(f"ranks were started with different hpcps {args.command} arguments", rank)
    # 2. the first rank reads and validates the configuration; everyone gets it or its error
    raw, prepared, error = None, None, None
    if rank == 0:
        try:
            overrides = list(args.set)
            if getattr(args, "skip_bad_lines", False):
                overrides.append("data.skip_bad_lines=true")
            if getattr(args, "resume", ""):
                overrides.append(f"checkpoint.resume={json.dumps(args.resume)}")
            raw = config.load_raw(args.config, overrides)
            cfg = config.from_dict(raw)
            prepared = prepare(raw) if prepare else None
            # the outputs written: tune's members write none of the configuration's, only --out
            checked = config.from_dict(prepared[0][1]) if args.command == "tune" else cfg
            problem = config.check_paths(checked, args.config or "", [("--summary-json", args.summary_json),
                                                                     ("--out", getattr(args, "out", ""))])
            from hpcps_kernels.parallel import server_threads_problem  # (the first rank is a server)

            problem = problem or server_threads_problem()  # (an environment setting: said before any data)
            if problem:
                raise config.ConfigError(problem)
        except config.ConfigError as e:
            error = str(e)
    raw, prepared, error = world.first_decides((raw, prepared, error), "broadcast of the configuration")
    if error:
        return None, None, _fail_once(error, rank)
    cfg = config.from_dict(raw)
    if not world.same_everywhere(int(cfg.fingerprint(), 16) & 0x7FFFFFFFFFFF, "agreement on the configuration"):
        return None, None, _fail_once("ranks disagree on the configuration", rank)
    # 3. the layout fits the world: checked on every rank before any data is generated or read
    try:
        check_world(world.size, cfg.cluster.servers, cfg.cluster.worker_groups or None, cfg.cluster.num_shards)
    except LayoutError as e:
        return None, None, _fail_once(str(e), rank)
    return raw, prepared, 0


def _start_collective():
    """The world (its agreements wait 120 s at most), after refusing a Slurm step of separate
    one-rank programs; the abort handler on."""
    from hpcps.ps.collectives import World

    world = World(timeout=120)
    step_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)
    if world.size == 1 and step_tasks > 1:
        return None, _fail(f"this MPI world has 1 rank but Slurm started {step_tasks} tasks in this step: srun "
                           f"without an MPI plugin starts separate programs. Use `srun --mpi=pmi2 hpcps train ...` "
                           f"or `mpiexec -n $SLURM_NTASKS hpcps train ...` (see slurm/README.md)",
                           int(os.environ.get("SLURM_PROCID", 0)))
    world.stop_on_unhandled_errors()
    return world, 0


def _write_summary(result, path: str, rank: int) -> int:
    """``--summary-json`` (the first worker); the exit status of a failed write, else 0."""
    from hpcps import outputs

    if result.summary is not None and path:
        try:
            outputs.write_json(path, result.summary, indent=1)
        except outputs.OutputError as e:
            return _fail(str(e), rank, e.exit_status)
    return 0


def _cmd_train(args) -> int:
    from hpcps import config
    from hpcps.train import loop

    if args.help_config:
        print(config.help_config(), end="")
        return 0
    world, status = _start_collective()
    if world is None:
        return status
    raw, _, status = _collective_config(args, world)
    if raw is None:
        return status
    _startup_over()
    try:
        result = loop.run(config.from_dict(raw), world.comm)
    except loop.TrainError as e:
        return _fail(str(e), world.rank, e.exit_status)
    # 0, or the exit status of a failed summary write, or of a stop by a signal after its checkpoint
    return _write_summary(result, args.summary_json, world.rank) or result.preempted


def _cmd_tune(args) -> int:
    from hpcps import outputs
    from hpcps.train import loop, tune

    world, status = _start_collective()
    if world is None:
        return status
    raw, members, status = _collective_config(args, world,
                                              lambda raw: tune.member_raws(raw, tune.parse_grid(args.grid)))
    if raw is None:
        return status
    _startup_over()
    try:
        result = tune.run(members, args.out, world.comm, args.folds)
    except (loop.TrainError, ValueError, outputs.OutputError) as e:  # (OutputError: --out's write)
        return _fail(str(e), world.rank, getattr(e, "exit_status", 2))
    return _write_summary(result, args.summary_json, world.rank) or result.preempted


def _load_for_serving(args):
    """The model (a :class:`hpcps.train.predictor.Predictor`) and the rows of ``--data``, read as
    the model's keys were made: refused (one line, exit 2) when the data's hash bits or format
    would make other keys, unless ``--allow-other-hashing``, and when the data holds no rows."""
    from hpcps.train import inputs
    from hpcps.train.predictor import Predictor

    predictor = Predictor(args.model)
    model = predictor.model
    if not model.checked:
        known = [f"{model.hash_bits} hash bits" if model.hash_bits is not None else "",
                 f"{model.input_format} rows" if model.input_format else ""]
        checks = " and ".join(k for k in known if k)
        print(f"hpcps {args.command}: note: {args.model} was written before model files carried a checksum: its "
              f"arrays cannot be checked" + (f"; the data is checked against its config's {checks}" if checks else ""),
              file=sys.stderr, flush=True)
    inputs.data_files(args.data, "--data")  # (a directory or glob without files: said so, naming --data)
    ds = predictor.rows_of_file(args.data, args.format or "auto", args.skip_bad_lines, args.allow_other_hashing,
                                args.hash_bits, need_labels=args.command == "eval")
    return predictor, ds


def _cmd_eval(args) -> int:
    import numpy as np

    from hpcps import outputs
    from hpcps_kernels import metrics

    predictor, ds = _load_for_serving(args)
    m = predictor.decision_function(ds)
    y, w = ds.labels.astype(np.float64), ds.weights  # (weights: None unless the rows have some)
    if predictor.loss == "logistic":
        res = {"rows": int(ds.rows), "logloss": metrics.logloss(y, m, w), "auc": metrics.auc(y, m, w)}
    else:
        res = {"rows": int(ds.rows), "rmse": metrics.rmse(y, m, w)}
    print(outputs.dumps(res))  # (an AUC of rows of one class is null, not NaN)
    return 0


def _cmd_predict(args) -> int:
    import numpy as np

    from hpcps import config, outputs
    from hpcps.train import data as tdata
    from hpcps.train import inputs
    from hpcps.train.evaluation import write_scores

    out = "" if args.out == "-" else args.out  # "-": standard output
    files = inputs.data_files(args.data, "--data")  # (a file, a glob or a directory of part files)
    for f in files:
        tdata.check_file(f)  # (what --data is, before it is compared with --out)
    problem = outputs.clash([("--out", out)], [*(("--data", f) for f in files), ("--model", args.model),
                                               *_trained_on(args.model)]) or config.output_problem("--out", out)
    if problem:
        return _fail(problem)
    predictor, ds = _load_for_serving(args)
    scores = predictor.scores(ds)
    if out:
        write_scores(out, scores)
    else:
        try:
            np.savetxt(sys.stdout, scores, fmt="%.6f")
            sys.stdout.flush()
        except BrokenPipeError:
            return _reader_gone()
    print(f"hpcps predict: {ds.rows} scores written to {out or 'standard output'}",
          file=sys.stdout if out else sys.stderr)  # (with -, standard output holds the scores only)
    return 0


GEN_FORMATS = ("libsvm", "criteo", "vw")
GEN_FIELDS = (1, 39)  # the generator's Criteo-like columns: up to 13 integer and 26 categorical
GEN_CLICK_DEFAULTS = {"fields": 39, "hash_bits": 24, "interactions": False, "formats": "libsvm,criteo"}


def _gen_data_problem(args) -> str | None:
    """Why ``gen-data``'s options cannot make a data set (one line), or None."""
    from hpcps import config

    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        return f"{args.out_dir} exists and is not a directory"
    if args.ratings and args.deep:
        return "--ratings and --deep make different data sets: choose one"
    ranges = {"--rows": (args.rows, config.RANGES[("synth", "rows")]),
              "--test-rows": (args.test_rows, config.RANGES[("synth", "test_rows")]),
              "--seed": (args.seed, config.RANGES[("synth", "seed")])}
    if not (args.ratings or args.deep):
        ranges["--fields"] = (args.fields, (*GEN_FIELDS, False))
        ranges["--hash-bits"] = (args.hash_bits, config.RANGES[("data", "hash_bits")])
    for flag, (v, (lo, hi, _)) in ranges.items():
        if not lo <= v <= hi:
            return f"{flag} {v}: must be {config.describe_range(lo, hi, False)}"
    if args.ratings or args.deep:
        given = [f"--{k.replace('_', '-')}" for k, v in GEN_CLICK_DEFAULTS.items() if getattr(args, k) != v]
        if given:
            return (f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the click data; "
                    f"{'--ratings writes libsvm ratings' if args.ratings else '--deep writes libffm rows of 8 fields'}")
        return None
    formats = [f.strip() for f in args.formats.split(",")]
    unknown = [f for f in formats if f not in GEN_FORMATS]
    if unknown or not args.formats.strip():
        return (f"--formats {args.formats!r}: {'unknown format ' + ', '.join(map(repr, unknown)) if unknown else 'empty'}"
                f"; gen-data writes {', '.join(GEN_FORMATS)} (comma-separated)")
    return None


def _cmd_gen_data(args) -> int:
    from hpcps.train import synth

    problem = _gen_data_problem(args)
    if problem:
        return _fail(problem)
    try:
        return _gen_data(args)
    except synth.SynthError as e:  # another data set (or other files) where this one would go
        return _fail(str(e))


def _gen_data(args) -> int:
    from hpcps import outputs
    from hpcps.train import synth

    if args.ratings:
        out = synth.ratings(args.out_dir, args.rows, args.test_rows, seed=args.seed, overwrite=args.overwrite)
        print(outputs.dumps(out, indent=1))
        return 0
    if args.deep:
        out = synth.deep(args.out_dir, args.rows, args.test_rows, seed=args.seed, overwrite=args.overwrite)
        print(f"hpcps gen-data: {args.rows} train + {args.test_rows} test rows (libffm, {out['fields']} fields) in "
              f"{args.out_dir}; best achievable test logloss {out['best_test_logloss']:.5f}, "
              f"AUC {out['best_test_auc']:.5f}")
        return 0
    info = synth.generate(args.out_dir, args.rows, args.test_rows, args.fields, args.interactions, args.seed,
                          args.hash_bits, formats=tuple(dict.fromkeys(f.strip() for f in args.formats.split(","))),
                          overwrite=args.overwrite)
    print(f"hpcps gen-data: {info.rows} train + {info.test_rows} test rows in {args.out_dir}"
          f"{' (already there: reused)' if info.reused else ''}; best achievable "
          f"test logloss {info.best_test_logloss:.5f}, AUC {info.best_test_auc:.5f}")
    return 0


def _cmd_bench_mpi(args) -> int:
    from hpcps import outputs
    from hpcps.bench import mpi as bench_mpi
    from hpcps.ps.collectives import World

    World.stop_on_unhandled_errors()
    world = World()
    if world.size < 2:
        return _fail("bench mpi needs at least 2 ranks: mpiexec -n 2 hpcps bench mpi")
    rows = bench_mpi.run_on_world()
    if world.is_first:
        if args.json:
            for r in rows:
                print(outputs.dumps(r))
        else:
            print(f"{'bytes':>10} {'blocking':>12} {'GB/s':>8} {'hpcps wait':>12} {'GB/s':>8} {'ratio':>6}")
            for r in rows:
                print(f"{r['bytes']:>10} {r['one_way_s'] * 1e6:>10.1f}us {r['gb_per_s']:>8.3f} "
                      f"{r['wait_one_way_s'] * 1e6:>10.1f}us {r['wait_gb_per_s']:>8.3f} "
                      f"{r['wait_gb_per_s'] / r['gb_per_s']:>5.2f}x")
            print("(one-way time of a ping-pong, median; blocking = MPI Send/Recv spinning a core, the raw "
                  "reference; hpcps wait = Isend/Irecv polled with sleeps, what hpcps's messages get)")
    return 0


def _cmd_bench_ps(args) -> int:
    from hpcps import outputs
    from hpcps.bench import ps as bench_ps
    from hpcps.ps.collectives import World
    from hpcps_kernels import optim

    if World().size < 2 + args.replicas:
        r = args.replicas
        servers, flag = (f"{1 + r} servers", f" --replicas {r}") if r else ("1 server", "")
        return _fail(f"bench ps needs at least {2 + args.replicas} ranks ({servers}, 1 worker): "
                     f"mpiexec -n {2 + args.replicas} hpcps bench ps{flag}")
    if args.optimizer not in optim.REGISTRY:
        return _fail(f"--optimizer {args.optimizer!r}: expected one of {sorted(optim.REGISTRY)}")
    if args.replicas:  # the replication rows alone
        from hpcps.bench import replicas as bench_replicas
        rows = bench_replicas.run(args.sizes or bench_replicas.SIZES, args.replicas, args.pairs, args.repeat, args.dim,
                                  args.optimizer)
        formatted = bench_replicas.format_rows
    else:
        rows = bench_ps.run(args.sizes or bench_ps.SIZES, args.repeat, args.dim, args.optimizer, args.key_bits)
        formatted = lambda rows: bench_ps.format_rows(rows, args.optimizer)  # noqa: E731
    if rows is not None:
        print("\n".join(outputs.dumps(r) for r in rows) if args.json else formatted(rows))
    return 0


def _cmd_bench_vw(args) -> int:
    from hpcps import outputs
    from hpcps.bench import vw as bench_vw

    results = bench_vw.run(args.dir, args.rows, args.test_rows, args.ranks, args.epochs, args.alpha, args.vw_alpha,
                           args.hash_bits, args.staleness, args.formats, args.repeat)
    print(bench_vw.format_results(results, args.rows))
    if args.json:  # every job's record, then the medians and ratios of the table
        outputs.write_json(args.json, {"runs": results, "table": bench_vw.compare(results)}, indent=1)
    return 0


def _bench_results(bench, results: dict, json_path: str) -> int:
    """A benchmark's results printed (its module's ``format_results``), and written to ``json_path``."""
    from hpcps import outputs

    print(bench.format_results(results))
    if json_path:
        outputs.write_json(json_path, results, indent=1)
    return 0


def _cmd_bench_inputs(args) -> int:
    from hpcps.bench import inputs as bench_inputs

    return _bench_results(bench_inputs, bench_inputs.run(args.dir, args.rows, args.test_rows, args.ranks, args.repeats,
                                                         args.epochs), args.json)


def _cmd_bench_backup(args) -> int:
    from hpcps.bench import backup as bench_backup

    return _bench_results(bench_backup, bench_backup.run(args.dir, args.rows, args.test_rows, args.stop_s, args.repeats,
                                                         args.at), args.json)


def _inspect_model(path: str) -> int:
    """``hpcps inspect MODEL.h5``: what a model file holds and whether it is intact (exit 1 if
    damaged, 2 if it is no model file)."""
    from hpcps.train.model_file import ModelFileError, ServingModel

    try:
        model = ServingModel(path)
    except ModelFileError as e:
        if e.exit_status == 2:
            return _fail(f"{path} is not an hpcps checkpoint, checkpoint directory or model file ({e.reason})")
        print(f"{path}: DAMAGED: {e}")
        return 1
    a = model.attrs
    print(f"{path}: OK: an hpcps model file (version {a.get('version', 1)}; "
          + ("checksum verified)" if model.checked else "written before model files carried a checksum: "
             "its arrays cannot be checked)"))
    print(f"  {model.kind} model, {model.loss} loss, {a.get('fields', 1)} field(s)")
    trained = [f"{model.hash_bits} hash bits" if model.hash_bits is not None else "hash bits unknown",
               f"{model.input_format} rows" if model.input_format else "input format unknown"]
    print(f"  trained on {', '.join(trained)}"
          + (f"; keys: {a['key_hashing']}" if a.get("key_hashing") else ""))
    for name, t in model.tables.items():
        print(f"  table {name!r}: dim {t.dim}, {t.keys.shape[0]} keys, init {t.attrs.get('init')}")
    return 0


def _cmd_inspect(args) -> int:
    from hpcps.ps import checkpoint

    if not os.path.exists(args.ckpt):
        return _fail(f"{args.ckpt}: no such checkpoint, checkpoint directory or model file")
    if not os.path.isdir(args.ckpt):
        return _inspect_model(args.ckpt)
    paths = [args.ckpt]
    if not os.path.exists(os.path.join(args.ckpt, checkpoint.MANIFEST)):
        paths = checkpoint.complete_checkpoints(args.ckpt) or paths  # a checkpoint.dir: list them all
        partial = sorted(n for n in os.listdir(args.ckpt) if re.fullmatch(r"(ckpt|delta)-\d+\.tmp", n))
        if paths == [args.ckpt] and partial:  # a checkpoint.dir whose only checkpoints are unfinished
            print(f"{args.ckpt}: DAMAGED: no complete checkpoint, only unfinished writes: {', '.join(partial)}")
            return 1
        if paths == [args.ckpt] and not re.fullmatch(r"(ckpt|delta)-\d+(\.tmp)?", os.path.basename(os.path.normpath(args.ckpt))):
            return _fail(f"{args.ckpt} is not an hpcps checkpoint or checkpoint directory (no {checkpoint.MANIFEST}, "
                         f"no ckpt-* directories in it)")
    aside = {d: len(os.listdir(os.path.join(args.ckpt, d))) for d in (checkpoint.DAMAGED, checkpoint.REPLACED,
                                                                        checkpoint.SUPERSEDED)
             if os.path.isdir(os.path.join(args.ckpt, d))}
    bad = 0
    for path in paths:
        s = checkpoint.inspect(path)
        m = s.manifest
        broken = _chain_broken(path, m) if s.ok else ""
        problem = s.problem if not s.ok else broken and f"its delta chain is broken: {broken}"
        print(f"{path}: {'DAMAGED: ' + problem if problem else 'OK'}")
        if m:
            pos = m.get("position", {})
            lay = m.get("layout", {})
            print(f"  step {pos.get('global_step')} (next: epoch {pos.get('epoch')}, step {pos.get('step')}), "
                  f"clock {m.get('clock')}, reason {m.get('reason')!r}, run {checkpoint.run_of(m)}")
            print(f"  written by {lay.get('servers')} server(s), {lay.get('workers')} worker(s); "
                  f"{lay.get('num_shards')} virtual shards; {s.bytes / 1e6:.1f} MB in {len(m.get('files', []))} file(s)")
            if m.get("snapshot") == "delta":  # (its keys: the rows changed since the snapshot before)
                print(f"  delta snapshot over {m['base']['name']}, after {len(m['deltas_before'])} delta(s); "
                      f"keys below: the rows changed since the snapshot before")
            for t in m.get("tables", []):
                print(f"  table {t['name']!r}: dim {t['dim']}, {t['optimizer']}, {s.keys.get(t['name'], '?')} keys")
        bad += bool(problem)
    if aside:  # what retention, resume and checkpoint.existing moved aside (never deleted)
        print(f"{args.ckpt}: set aside: " + ", ".join(f"{n} under {d}/" for d, n in aside.items()))
    return 1 if bad else 0


def _export_format(manifest: dict) -> str:
    """The format a checkpoint's training file was read as: recorded in its manifest, else its
    config's data.format, else detected from the training file if it is still there ("" if not)."""
    from hpcps.train import data as tdata

    if manifest.get("input_format"):
        return manifest["input_format"]
    fmt = manifest.get("config", {}).get("data", {}).get("format", "auto")
    train = manifest.get("data", {}).get("train")
    if fmt == "auto" and isinstance(train, dict) and os.path.isfile(train.get("path", "")):
        try:
            return tdata.detect_format(train["path"], "auto")
        except (OSError, tdata.DataError):
            return ""
    return "" if fmt == "auto" else fmt


def _trained_on(source: str) -> list[tuple[str, str]]:
    """The data files of the run that wrote the model file or checkpoint ``source`` (its
    ``data.train``, ``data.test`` and ``data.predict``, each directory's or glob's files, and the
    training file's path as its manifest recorded it), as inputs for :func:`hpcps.outputs.clash`:
    an export or a prediction from it must not overwrite them (a mistyped ``--out train.svm``),
    though it may write beside them (``--out parts/scores.txt``: nothing reads that directory
    now). [] where none is known."""
    from hpcps.ps import checkpoint
    from hpcps.train import inputs

    try:
        if os.path.isfile(source):
            import h5py

            with h5py.File(source, "r") as f:
                cfg, recorded = json.loads(f.attrs.get("config", "{}")), {}
        else:
            manifest = checkpoint.read_manifest(source)
            cfg, recorded = manifest.get("config", {}), manifest.get("data", {}).get("train", {})
    except (OSError, ValueError, TypeError, AttributeError, checkpoint.CheckpointError):
        return []  # (what is not a model or checkpoint is said where it is read)
    data = cfg.get("data", {}) if isinstance(cfg, dict) else {}
    named = [(f"{source}'s data.{k}", data.get(k)) for k in ("train", "test", "predict")]
    paths = [(w, p) for w, v in named for p in ([v] if isinstance(v, str) else v if isinstance(v, list) else [])]
    if isinstance(recorded, dict) and isinstance(recorded.get("path"), str):
        paths.append((f"{source}'s training file", recorded["path"]))
    files = []
    for what, path in paths:
        if not isinstance(path, str) or not path:
            continue
        try:
            files += [(what, f) for f in inputs.data_files(path, what)]
        except (OSError, inputs.DataError):  # (a directory emptied since: nothing of it to overwrite)
            pass
    return [(w, p) for w, p in files if p and not os.path.isdir(p)]


def _checkpoint_directory_problem(path: str) -> str:
    """What to say when ``path`` is a checkpoint.dir, not one of its checkpoints ('' if not)."""
    from hpcps.ps import checkpoint

    inside = checkpoint.complete_checkpoints(path) if not os.path.exists(os.path.join(path, checkpoint.MANIFEST)) else []
    return (f"{path} is a checkpoint directory: name one of its checkpoints, e.g. the newest, {inside[-1]} "
            f"(hpcps inspect {path} lists them)") if inside else ""


def _checkpoint_tables(args) -> tuple[dict, list]:
    """The model attributes and the tables ``[(name, keys, values, table_attrs)]`` of the
    checkpoint ``args.ckpt`` (``--table``: that one only); a _Failure with its line and status."""
    import numpy as np

    from hpcps.ps import deltas
    from hpcps.train import model_file

    m = _verified_snapshot(args.ckpt)
    since = (args.since, _verified_snapshot(args.since)) if getattr(args, "since", "") else None
    tables = [t["name"] for t in m["tables"]]
    names = [args.table] if args.table else tables
    if args.table and args.table not in tables:
        raise _Failure(f"no table {args.table!r} in {args.ckpt}; it has {tables}")
    if since:  # (the rows compared must be the same table's: a model of another type or shape is not)
        old = {t["name"]: (t["dim"], t["width"]) for t in since[1]["tables"]}
        for t in m["tables"]:
            if t["name"] in names and old.get(t["name"]) != (t["dim"], t["width"]):
                raise _Failure(f"export --since: {args.since} is not a snapshot of the same model as {args.ckpt}: "
                               f"its tables are {sorted(old)}, and table {t['name']!r} is dim {t['dim']}, "
                               f"{t['width']} numbers a row here" + (f", {old[t['name']][0]} and {old[t['name']][1]} "
                                                                    f"there" if t["name"] in old else ""))
    cfg = m.get("config", {})
    model_cfg = cfg.get("model", {})
    out = []
    for name in names:
        spec = next(t for t in m["tables"] if t["name"] == name)
        keys, rows = deltas.read_table(args.ckpt, m, name)  # (a delta snapshot: over its chain)
        if since:
            keys, rows, removed = deltas.changed_since(keys, rows, *deltas.read_table(*since, name))
        if "init" in spec:
            init = {k: spec[k] for k in ("init", "init_scale", "seed")}
        else:  # checkpoints written before the manifest named each table's initializer
            init = {"init": "normal" if model_cfg.get("type") == "fm" else "zeros",
                    "init_scale": model_cfg.get("init_scale", 0.01), "seed": model_cfg.get("seed", 0)}
        out.append((name, keys, rows[:, : spec["dim"]], {"dim": spec["dim"], **init}))
        if since:  # the keys a serving copy drops: a table of their own, values 0
            out.append((f"{name}.removed", removed, np.zeros((removed.shape[0], 1), np.float32), {"dim": 1}))
    attrs = {"model": model_cfg.get("type", "lr"), "loss": model_cfg.get("loss", "logistic"),
             "config": json.dumps(cfg), "fields": m.get("fields", 1),
             **model_file.trained_on(_export_format(m), cfg.get("data", {}).get("hash_bits", 24)),
             **({"delta_since": os.path.basename(os.path.normpath(args.since))} if since else {})}
    return attrs, out


def _chain_broken(path: str, manifest: dict) -> str:
    """Why the delta snapshot ``path`` (its own files verified) cannot be restored: the first link
    of its chain (its base, a delta before it) missing, damaged or another snapshot; '' when it
    can be, or it is a full checkpoint."""
    from hpcps.ps import checkpoint

    return checkpoint.first_broken_link(path, manifest)[2] if manifest.get("snapshot") == "delta" else ""


def _verified_snapshot(path: str) -> dict:
    """The manifest of the checkpoint or delta snapshot ``path``, its chain verified; a _Failure
    (1: damaged, 2: no checkpoint) with its line."""
    from hpcps.ps import checkpoint

    try:
        m = checkpoint.verify(path)
        broken = _chain_broken(path, m)
        if broken:
            raise checkpoint.CheckpointError(f"{path}: its chain of delta snapshots is broken: {broken}")
        return m
    except checkpoint.CheckpointError as e:  # damaged (1), or no checkpoint at all (2)
        raise _Failure(str(e), 1 if os.path.isfile(os.path.join(path, checkpoint.MANIFEST)) else 2) from None


def _model_file_tables(args) -> tuple[dict, list]:
    """The attributes and tables of the model file ``args.ckpt`` (``--table``: that one only)."""
    from hpcps.train.model_file import ServingModel

    model = ServingModel(args.ckpt)
    names = list(model.tables)
    if args.table and args.table not in names:
        raise _Failure(f"no table {args.table!r} in {args.ckpt}; it has {names}")
    out = [(n, t.keys, t.values, t.attrs) for n, t in model.tables.items() if not args.table or n == args.table]
    return model.attrs, out


class _Failure(Exception):
    """A command's one-line failure and its exit status."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def _cmd_export(args) -> int:
    from hpcps import config, outputs
    from hpcps.train import model_file

    from_model = os.path.isfile(args.ckpt)
    problem = "" if from_model else _checkpoint_directory_problem(args.ckpt)
    snapshots = [] if from_model else [p for p in (args.ckpt, args.since) if p]
    # (not into any snapshot of the directories read: a chain's base or a delta before it is read too)
    problem = problem or outputs.clash(
        [("--out", args.out)], [("the model file" if from_model else "the checkpoint", args.ckpt),
                                *(("--since", args.since) for _ in snapshots[1:]), *_trained_on(args.ckpt)],
        [("the checkpoints' directory", os.path.dirname(os.path.normpath(p)) or ".") for p in snapshots])
    problem = problem or config.output_problem("--out", args.out)  # (before the tables are read)
    if problem:
        return _fail(problem)
    if from_model and args.since:
        return _fail(f"export --since: {args.ckpt} is a model file; a delta model is made from a checkpoint")
    if from_model and args.format == "model":
        return _fail(f"{args.ckpt} is a model file already: --format text or npz writes it for other tools")
    try:
        attrs, tables = _model_file_tables(args) if from_model else _checkpoint_tables(args)
    except _Failure as e:
        return _fail(str(e), status=e.status)
    if args.format == "model":
        model_file.write(args.out, tables, attrs=attrs)
    else:
        model_file.write_readable(args.out, args.format, attrs, tables)
    total = sum(t[1].shape[0] for t in tables)
    names = ", ".join(repr(t[0]) for t in tables)
    print(f"hpcps export: {total} keys of table(s) {names} from {args.ckpt} -> {args.out}"
          + ("" if args.format == "model" else f" ({args.format})"))
    return 0


def _cmd_bench_deep(args) -> int:
    from hpcps.bench import deep as bench_deep

    results = bench_deep.run(args.dir, args.rows, args.batch_size)
    print(bench_deep.format_results(results))
    return 0


def _cmd_bench_margins(args) -> int:
    from hpcps.bench import margins as bench_margins

    results = bench_margins.run(args.dir, args.rows, args.ranks, args.batch_size)
    print(bench_margins.format_results(results, args.rows))
    return 0


def _cmd_plot(args) -> int:
    from hpcps import outputs, plot

    try:
        out = plot.plot(args.metrics, args.out, args.label,
                        note=lambda m: print(f"hpcps plot: note: {m}", file=sys.stderr, flush=True))
    except (ValueError, RuntimeError, OSError, outputs.OutputError) as e:
        print(f"hpcps plot: error: {e}", file=sys.stderr)
        return getattr(e, "exit_status", 2)  # (1: the image's write failed, a full disk)
    print(f"hpcps plot: wrote {out}")
    return 0


def _cmd_bench_checkpoint(args) -> int:
    from hpcps import outputs
    from hpcps.bench import checkpoint as bench_checkpoint

    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        return _fail(f"bench checkpoint --dir {args.dir} is not a directory")
    try:
        with outputs.making(args.dir):  # (what it made is removed if a write fails)
            try:
                rows = [bench_checkpoint.measure(n, args.dir) for n in args.keys]
            except (OSError, RuntimeError) as e:  # a full disk (h5py's failures can be RuntimeErrors)
                raise outputs.write_failure(getattr(e, "filename", None) or args.dir, outputs.h5_failure(e)) from None
    except outputs.OutputError as e:
        return _fail(f"bench checkpoint --dir {args.dir}: {e}", status=e.exit_status)
    print("\n".join(outputs.dumps(r) for r in rows) if args.json else bench_checkpoint.format_rows(rows))
    return 0


def _cmd_supervise(args) -> int:
    from hpcps import supervise

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        return _fail("hpcps supervise needs the job's command after --, e.g. "
                     "hpcps supervise -- mpiexec -n 4 hpcps train run.toml")
    for name, value in (("--max-restarts", args.max_restarts), ("--backoff", args.backoff),
                        ("--backoff-max", args.backoff_max)):
        if not value >= 0:  # (NaN too)
            return _fail(f"hpcps supervise {name} must be at least 0 (got {value:g})")
    if args.log:
        try:
            open(args.log, "a").close()
        except OSError as e:
            return _fail(f"hpcps supervise --log {args.log}: cannot write there: {e.strerror or e}")
    return supervise.run(command, args.max_restarts, args.backoff, args.backoff_max, args.log)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (``hpcps bench ps: error: argument --sizes: ...``),
    exit status 2, as every other bad input."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _whole(text: str, lo: int, hi: int | None) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < lo or (hi is not None and v > hi):
        raise argparse.ArgumentTypeError(f"{v} is out of range: expected {lo}" + (f" to {hi}" if hi is not None
                                                                                  else " or more"))
    return v


def count(lo: int = 1, hi: int | None = None):
    """An argparse type: a whole number from ``lo`` (to ``hi``)."""
    return lambda text: _whole(text, lo, hi)


def counts(lo: int = 1, hi: int | None = None):
    """An argparse type: comma-separated whole numbers from ``lo`` (to ``hi``), at least one."""
    def parse(text: str) -> list[int]:
        if not text.strip():
            raise argparse.ArgumentTypeError("empty: expected comma-separated whole numbers")
        return [_whole(t, lo, hi) for t in text.split(",")]
    return parse


def bench_formats(text: str) -> list[str]:
    """An argparse type: ``bench vw --formats``, comma-separated, each of libsvm and criteo at most once."""
    formats = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [f for f in formats if f not in ("libsvm", "criteo")]
    if unknown or not formats:
        raise argparse.ArgumentTypeError(f"{'unknown format ' + ', '.join(map(repr, unknown)) if unknown else 'empty'}; "
                                         f"expected libsvm, criteo (comma-separated)")
    return formats


def _serving_args(p):
    p.add_argument("--model", required=True, help="model file written by train (train.model_out) or export")
    p.add_argument("--data", required=True, help="libsvm, Criteo TSV, VW, libffm, Parquet or CSV file")
    p.add_argument("--format", default="", help="libsvm | criteo | vw | libffm (default: detected from the file)")
    p.add_argument("--hash-bits", type=int, default=0, help="key bits (default: the model's)")
    p.add_argument("--skip-bad-lines", action="store_true")
    p.add_argument("--allow-other-hashing", action="store_true",
                   help="score even when the data's hash bits or format make other keys than the model was "
                        "trained on (refused otherwise: such scores are near chance)")


TRAIN_EXAMPLES = """examples:
  mpiexec -n 4 hpcps train                                  # synthetic CTR data: 1 server + 3 workers
  hpcps train --set data.train=train.svm --set data.test=test.svm   # your data, one process
  mpiexec -n 4 hpcps train run.toml --set train.epochs=3 --set model.type=fm
  mpiexec -n 4 hpcps train run.toml --set checkpoint.dir=ckpt --resume auto   # after a crash
  hpcps train --help-config > run.toml                      # every key, its default and meaning
"""


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train a model (under mpiexec); see --help-config", epilog=TRAIN_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", nargs="?", help="TOML configuration file")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a configuration key (repeatable)")
    t.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed lines")
    t.add_argument("--summary-json", default="", help="write the final summary here (first worker)")
    t.add_argument("--resume", default="", metavar="auto|CKPT",
                   help="resume from the newest good checkpoint in checkpoint.dir (auto) or from CKPT")
    t.add_argument("--help-config", action="store_true", help="print every configuration key with its default and meaning, as TOML, and exit")
    t.set_defaults(func=_cmd_train)


def _add_tune(sub) -> None:
    u = sub.add_parser("tune", help="train a grid of hyper-parameters at once and rank it on held-out rows")
    u.add_argument("config", nargs="?", help="TOML configuration file (the grid's common settings)")
    u.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a configuration key (repeatable)")
    u.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="values to try: optimizer.* (alpha, lr, l1, l2, ...), model.type, model.factors or "
                        "model.init_scale (repeatable: the grid is their product)")
    u.add_argument("--out", default="", help="write the best configuration here (TOML)")
    u.add_argument("--folds", default="auto", type=lambda v: v if v == "auto" else int(v), metavar="K|auto",
                   help="train the grid K times, each holding out another phase of train.holdout's rows, and "
                        "rank by the mean (auto: about enough folds for 20,000 held-out rows; 1 from about 135,000 rows)")
    u.add_argument("--summary-json", default="", help="write the summary with the ranking here (first worker)")
    u.set_defaults(func=_cmd_tune)


def _add_supervise(sub) -> None:
    s = sub.add_parser("supervise", help="run a training job, restarting it with --resume auto after a crash")
    s.add_argument("--max-restarts", type=int, default=3, help="restarts before giving up (default 3)")
    s.add_argument("--backoff", type=float, default=5.0, help="seconds before the first restart; doubles each time")
    s.add_argument("--backoff-max", type=float, default=300.0, help="longest wait between attempts")
    s.add_argument("--log", default="", help="also append each restart to this file")
    s.add_argument("command_line", nargs=argparse.REMAINDER, help="-- the job's command (mpiexec ... hpcps train ...)")
    s.set_defaults(func=_cmd_supervise)


def _add_model_files(sub) -> None:
    """eval, predict, plot, inspect and export: what reads a run's outputs."""
    e = sub.add_parser("eval", help="logloss and AUC (or RMSE) of a model file on a data file")
    _serving_args(e)
    e.set_defaults(func=_cmd_eval)
    pr = sub.add_parser("predict", help="one score per row of a data file, in input order")
    _serving_args(pr)
    pr.add_argument("--out", required=True, help="output file: one score per line (-: standard output)")
    pr.set_defaults(func=_cmd_predict)

    pl = sub.add_parser("plot", help="training loss and test metric, examples/s and waiting of runs, from their metrics")
    pl.add_argument("metrics", nargs="+", help="JSON-lines files written by train.metrics")
    pl.add_argument("-o", "--out", required=True, help="image file (PNG, SVG or PDF by its extension)")
    pl.add_argument("--label", action="append", help="a name per run, in order (default: file names)")
    pl.set_defaults(func=_cmd_plot)

    i = sub.add_parser("inspect", help="what a checkpoint (or every checkpoint in a directory) or a model file holds, "
                                       "and its integrity (exit 1: damaged, 2: not an hpcps file)")
    i.add_argument("ckpt", metavar="PATH")
    i.set_defaults(func=_cmd_inspect)
    x = sub.add_parser("export", help="a checkpoint's tables as a single-file model for hpcps predict/eval, or a "
                                      "checkpoint or model file as text or NumPy arrays for other tools")
    x.add_argument("ckpt", metavar="SOURCE", help="a checkpoint, or (with --format text or npz) a model file")
    x.add_argument("--out", required=True)
    x.add_argument("--table", default="", help="table to export (default: every table)")
    x.add_argument("--since", default="", metavar="CKPT",
                   help="a delta model: only the rows changed since the checkpoint CKPT, and per table NAME a "
                        "table NAME.removed of the keys gone since (see docs/operations.md)")
    x.add_argument("--format", choices=("model", "text", "npz"), default="model",
                   help="model: an HDF5 model file (default); text: '#' lines of attributes, then key<TAB>values "
                        "by key; npz: NumPy's archive of NAME.keys and NAME.values")
    x.set_defaults(func=_cmd_export)


def _add_gen_data(sub) -> None:
    g = sub.add_parser("gen-data", help="write a synthetic CTR data set with known best metrics")
    g.add_argument("out_dir")
    g.add_argument("--rows", type=int, default=200_000)
    g.add_argument("--test-rows", type=int, default=50_000)
    g.add_argument("--fields", type=int, default=GEN_CLICK_DEFAULTS["fields"], help="fields a row (1 to 39)")
    g.add_argument("--interactions", action="store_true", help="pairwise field interactions (FM data)")
    g.add_argument("--ratings", action="store_true", help="explicit ratings (squared loss) instead")
    g.add_argument("--deep", action="store_true",
                   help="libffm data with a known nonlinear truth (a three-field parity on top of pairwise "
                        "interactions), where deep models beat FM and FM beats LR")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--hash-bits", type=int, default=GEN_CLICK_DEFAULTS["hash_bits"], help="key bits (1 to 64)")
    g.add_argument("--formats", default=GEN_CLICK_DEFAULTS["formats"], help="comma-separated: libsvm, criteo, vw")
    g.add_argument("--overwrite", action="store_true",
                   help="replace a data set of other parameters (or other files of the names written) in OUT_DIR; "
                        "without it they are refused (the same data set is reused)")
    g.set_defaults(func=_cmd_gen_data)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (run under mpiexec)")
    bsub = bench.add_subparsers(dest="what", required=True)
    b = bsub.add_parser("mpi", help="raw MPI point-to-point bandwidth between ranks 0 and 1")
    b.add_argument("--json", action="store_true", help="one JSON object per line")
    b.set_defaults(func=_cmd_bench_mpi)
    b = bsub.add_parser("ps", help="push/pull throughput per server beside raw MPI bandwidth (1 server + 1 worker)")
    b.add_argument("--sizes", type=counts(), default=None,
                   help="batch sizes in keys, comma-separated (default 1000,10000,100000,1000000)")
    b.add_argument("--repeat", type=count(), default=5)
    b.add_argument("--dim", type=count(), default=1)
    b.add_argument("--optimizer", default="ftrl", help="a registered optimizer (sgd, adagrad, ftrl, adam, or your own)")
    b.add_argument("--key-bits", type=count(1, 64), default=64,
                   help="keys below 2**BITS; up to 26 the server addresses them directly (hashed features)")
    b.add_argument("--replicas", type=count(0), default=0,
                   help="R > 0: instead, the push time with cluster.replicas R beside 0 (R + 1 servers, 1 worker: "
                        "mpiexec -n R+2); --sizes default 10000,100000 then")
    b.add_argument("--pairs", type=count(), default=3, help="with --replicas: alternating pairs of runs")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_cmd_bench_ps)
    b = bsub.add_parser("vw", help="hpcps vs Vowpal Wabbit on the same synthetic rows (runs its own mpiexec jobs)")
    b.add_argument("--dir", default="/tmp/hpcps-bench-vw", help="where the data and results go")
    b.add_argument("--rows", type=count(), default=1_500_000)
    b.add_argument("--test-rows", type=count(), default=100_000)
    b.add_argument("--ranks", type=counts(2), default="2", help="hpcps world sizes (1 server + the rest workers)")
    b.add_argument("--epochs", type=counts(), default="1,3")
    b.add_argument("--formats", type=bench_formats, default="libsvm,criteo",
                   help="the text hpcps reads, comma-separated: libsvm, criteo (VW reads its own text of the same rows)")
    b.add_argument("--repeat", type=count(), default=3,
                   help="rounds: each runs every job once, hpcps's then VW's (medians and the pairs' ratios)")
    b.add_argument("--alpha", type=float, default=0.1, help="hpcps FTRL alpha")
    b.add_argument("--vw-alpha", type=float, default=0.05, help="VW --ftrl_alpha (0.05 was VW's best of 0.005/0.05/0.5 here)")
    b.add_argument("--hash-bits", type=count(1, 64), default=24)
    b.add_argument("--staleness", type=counts(0), default="0",
                   help="hpcps consistency per job: 0 = BSP, s > 0 = SSP s with train.pull_early (the pipelined step)")
    b.add_argument("--json", default="", help="also write the results here")
    b.set_defaults(func=_cmd_bench_vw, own_jobs=True)
    b = bsub.add_parser("inputs", help="a training job from gzip text beside the same job from plain text (its own jobs)")
    b.add_argument("--dir", default="/tmp/hpcps-bench-inputs", help="where the data and results go")
    b.add_argument("--rows", type=count(), default=1_000_000)
    b.add_argument("--test-rows", type=count(), default=50_000)
    b.add_argument("--ranks", type=count(2), default=2, help="world size of each job (1 server + the rest workers)")
    b.add_argument("--epochs", type=count(), default=1)
    b.add_argument("--repeats", type=count(), default=3, help="jobs of each input, alternating plain and gzip")
    b.add_argument("--json", default="", help="also write the results here")
    b.set_defaults(func=_cmd_bench_inputs, own_jobs=True)
    b = bsub.add_parser("backup", help="backup workers (b = 1) against b = 0 with a worker stopped for seconds (its own jobs)")
    b.add_argument("--dir", default="/tmp/hpcps-bench-backup", help="where the data and results go")
    b.add_argument("--rows", type=count(), default=300_000,
                   help="rows of the job: its training must outlast the stop to show what b = 1 saves (a job "
                        "cannot end before its stopped worker continues)")
    b.add_argument("--test-rows", type=count(), default=3_000)
    b.add_argument("--stop-s", type=float, default=5.0, help="seconds worker rank 3 is stopped (SIGSTOP)")
    b.add_argument("--at", type=count(), default=50, help="the first worker's step after which it is stopped")
    b.add_argument("--repeats", type=count(), default=3, help="jobs of each b, alternating")
    b.add_argument("--json", default="", help="also write the results here")
    b.set_defaults(func=_cmd_bench_backup, own_jobs=True)
    b = bsub.add_parser("margins", help="computing on the servers (model.compute) vs pulling weights: bytes and speed")
    b.add_argument("--dir", default="/tmp/hpcps-bench-margins")
    b.add_argument("--rows", type=count(), default=300_000)
    b.add_argument("--ranks", type=count(2), default=2)
    b.add_argument("--batch-size", type=count(), default=1000)
    b.set_defaults(func=_cmd_bench_margins, own_jobs=True)
    b = bsub.add_parser("deep", help="Wide & Deep jobs at 2 and 4 ranks, per stage, beside one NumPy process")
    b.add_argument("--dir", default="/tmp/hpcps-bench-deep")
    b.add_argument("--rows", type=count(), default=300_000)
    b.add_argument("--batch-size", type=count(), default=1000)
    b.set_defaults(func=_cmd_bench_deep, own_jobs=True)
    b = bsub.add_parser("checkpoint", help="checkpoint write/read throughput and resume time beside a plain file copy")
    b.add_argument("--keys", type=counts(), default="10000000,100000000", help="table sizes, comma-separated")
    b.add_argument("--dir", default="/tmp/hpcps-bench-checkpoint", help="a directory on the disk to measure")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_cmd_bench_checkpoint)


def _version() -> str:
    """The installed distribution's version (its metadata, as pip shows it)."""
    from importlib import metadata

    try:
        return metadata.version("hpcps")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        from hpcps import __version__

        return f"{__version__} (not installed)"


class _PrintVersion(argparse.Action):
    """``-V``/``--version``: argparse's version action, but the version looked up only when asked
    for: finding the distribution's metadata on ``sys.path`` was part of every rank's start-up,
    for a line that a job never prints."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show program's version number and exit"):  # noqa: A002 - argparse's name
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(f"hpcps {_version()}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hpcps", description="MPI parameter server for huge sparse models")
    p.add_argument("-V", "--version", action=_PrintVersion)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_tune, _add_supervise, _add_model_files, _add_gen_data, _add_bench):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from hpcps.malloc import keep_freed_memory

    keep_freed_memory()
    args = build_parser().parse_args(argv)
    from hpcps.outputs import OutputError
    from hpcps.ps import signals  # (NumPy and numba come with it: after entry's gc.disable)

    rank, size = _launched_ranks()
    if getattr(args, "own_jobs", False) and size > 1:
        return _fail(f"hpcps bench {args.what} starts its own mpiexec jobs: run it without mpiexec "
                     f"(it was started as one of {size} ranks)" if rank == 0 else "")
    if args.command in ("train", "tune"):
        signals.install()  # a stop signal before training starts is kept for its first step
    else:
        _startup_over()
    try:
        return args.func(args)
    except KeyboardInterrupt:  # (the commands without signals.install: one line, no traceback)
        _fail("interrupted (SIGINT)")
        return signals.EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader stopped early (`hpcps inspect DIR | head`): quietly
        return _reader_gone()
    except Exception as e:  # noqa: BLE001 - one line, not a traceback (HPCPS_DEBUG=1 shows it)
        if args.command in ("eval", "predict", "gen-data", "export", "inspect", "plot") and \
                isinstance(e, (OSError, ValueError, RuntimeError, OutputError)):
            return _fail(str(e), status=getattr(e, "exit_status", 2))  # (1: a damaged file, a full disk)
        if sys.excepthook is not sys.__excepthook__:  # the abort handler: it ends every rank of the job
            raise
        return _fail_unexpected(e)


def _launched_ranks() -> tuple[int, int]:
    """(this process's rank, the ranks launched together) as the launcher's environment says
    (MPICH's Hydra and Slurm's PMI: ``PMI_RANK``/``PMI_SIZE``; Open MPI: ``OMPI_COMM_WORLD_*``),
    without starting MPI; (0, 1) outside a launcher."""
    env = os.environ
    size = env.get("PMI_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or "1"
    rank = env.get("PMI_RANK") or env.get("OMPI_COMM_WORLD_RANK") or "0"
    try:
        return int(rank), int(size)
    except ValueError:
        return 0, 1


def _reader_gone() -> int:
    """Standard output's reader stopped early (``| head``): no message, and the status a writer
    killed by SIGPIPE would have; standard output pointed at /dev/null so the exit's flush is quiet."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + 13  # (SIGPIPE)


def _startup_over() -> None:
    """The garbage collector back on where :func:`entry` turned it off for the start-up, with
    every object made so far frozen out of its passes (``gc.freeze``). Start-up makes hundreds of
    thousands of long-lived objects (NumPy's, numba's and MPI's modules, hpcps's), which the
    collector's passes walked again and again: about 0.09 s of each rank's CPU in a short job,
    most of it before the first step, to free some 2,000 objects, which freezing keeps instead
    (the same peak memory, docs/benchmarks.md). A ``train`` or
    ``tune`` ends its start-up once its ranks agree on the configuration; the other commands at
    once. Nothing changes where the collector was on (``main`` called by a program of its own)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _fail_unexpected(e: BaseException) -> int:
    """An error no command caught, outside an MPI job: one line (:func:`hpcps.errors.one_line`)."""
    from hpcps import errors

    errors.print_traceback(e)
    line, status = errors.one_line(e)
    sys.stderr.write(f"hpcps: error: {line}\n")
    sys.stderr.flush()
    return status


def entry() -> None:
    """The ``hpcps`` command: :func:`main`, then a quick exit once it has returned.

    Everything a command writes is written and closed by then (models, checkpoints, metrics,
    summaries), so what the interpreter's own teardown would add is freeing every object and
    module one by one, a noticeable part of a short job's wall time (docs/benchmarks.md). The standard streams are
    flushed and MPI is finalized first (when this command started it), then C's ``exit`` runs
    the C libraries' exit handlers, not Python's teardown. Not ``os._exit``, which skips those
    too: MPICH ends a process's part in the job with ``mpiexec`` in one of them, and without it
    ``mpiexec`` took the first rank to leave for a failure and killed the others (SIGKILL, in 1
    of 4-8 runs of a 4-rank resumed job). An exception still
    goes the normal way (a traceback, or the abort handler's message). So does every exit
    under a profiler or a tracer (``python -m cProfile``, coverage), which write their results
    at the interpreter's exit, and with ``HPCPS_QUICK_EXIT=0``."""
    gc.disable()  # until the command's start-up is over (_startup_over)
    code = main()
    if (os.environ.get("HPCPS_QUICK_EXIT", "1") == "0" or sys.getprofile() is not None
            or sys.gettrace() is not None):
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    ctypes.CDLL(None).exit(code if isinstance(code, int) else 0 if code is None else 1)


if __name__ == "__main__":
    entry()
