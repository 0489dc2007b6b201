"""What a training run decides before its parameter-server context exists: the :class:`RunPlan`.

Every rank of the job agrees on it (:func:`agree_on_plan`, collective over the world, the first
rank deciding and checking): the output paths are free, the checkpoint to resume and this run's
id, the data files (or the synthetic set made for the run), the training file's format, the batch
size (``train.batch_size = 0``: from the file's rows) and that a resumed checkpoint's data position
still means the same rows. The plan itself is plain data, and what follows from it (where a
resumed run starts, what its checkpoints' data position means) is computed without MPI.
"""

from __future__ import annotations

import math
import os
import socket
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hpcps import config, outputs
from hpcps.ps import checkpoint
from hpcps.ps.consistency import Backup
from hpcps.train import data as tdata
from hpcps.train import inputs, model_file, tables
from hpcps_kernels import optim

if TYPE_CHECKING:  # (imported where cluster.layout = "auto" uses it: a job's start-up without it)
    from hpcps.train import scaling


class TrainError(RuntimeError):
    """A failure every rank agreed on (bad data, missing file): each rank raises the same message
    (or an empty one, when the rank that failed reports it). ``exit_status``: the exit status, 2 (bad
    configuration or input) or 1 (a run-time failure, such as a full disk)."""

    def __init__(self, message: str = "", status: int = 2):
        super().__init__(message)
        self.exit_status = status


# train.batch_size = 0 (auto): rows per worker a step, at least AUTO_BATCH_MIN and at most
# AUTO_BATCH_MAX (AUTO_BATCH_MAX_LINEAR for a linear model), so that an epoch takes at least
# AUTO_BATCH_STEPS steps. A step updates each of its keys once (FTRL and AdaGrad move a key by about
# the same amount whatever the rows behind its summed gradient), so a small set in batches of 1000
# rows gets a few updates an epoch and undertrains; a large one keeps large steps, which the servers'
# and workers' per-step costs need (smaller steps slow the loop for the same test logloss).
# Calibrated on docs/defaults-sweep.py: more steps an epoch bring more of its sets near their best
# logloss, fewer rows a step slow the Criteo example's loop. Past 128,000 rows a worker, steps of
# 4000 rows left a linear model's test logloss where 1000 did, in less loop time; a factorization
# machine's rose, so models with factors keep 1000 (docs/defaults.md has the figures).
AUTO_BATCH_MIN, AUTO_BATCH_MAX, AUTO_BATCH_MAX_LINEAR, AUTO_BATCH_STEPS = 50, 1000, 4000, 128


def auto_batch_size(rows: int, workers: int, model: str) -> int:
    """``train.batch_size`` = 0: the rows a step for ``rows`` rows of training over ``workers``,
    for a model of type ``model`` (``model.type``)."""
    return min(auto_batch_max(model), max(AUTO_BATCH_MIN, math.ceil(rows / max(workers, 1) / AUTO_BATCH_STEPS)))


def auto_batch_max(model: str) -> int:
    """The most rows a step :func:`auto_batch_size` gives a model of type ``model``."""
    return AUTO_BATCH_MAX_LINEAR if model == "lr" else AUTO_BATCH_MAX


def backup_of(cfg) -> Backup:
    """The run's backup workers (``cluster.backup_workers``, ``cluster.late_pushes``)."""
    return Backup(cfg.cluster.backup_workers, cfg.cluster.late_pushes)


def gradient_scale(cfg, group_size: int) -> float:
    """What a step's summed gradient is multiplied by. ``train.gradient = "sum"``: 1, each row's
    gradient counts in full (per-coordinate optimizers like FTRL and AdaGrad set their own step
    sizes, and a mean would shrink rare keys' gradients by the batch size); ``"mean"``: the
    gradient of the mean loss over the worker group's rows (the objective of plain SGD)."""
    return 1.0 if cfg.train.gradient == "sum" else 1.0 / (cfg.train.batch_size * group_size)


def data_position_meaning(cfg, train_path, workers: int) -> dict:
    """What a checkpoint's data position refers to: the training files (their sizes and
    fingerprints, :func:`hpcps.train.data.fingerprint`), the batch size, the number of workers
    (each reads its own files or byte range, :func:`hpcps.train.inputs.split`) and the shuffle of
    their rows, if any. The position itself is a step: row ``(step - 1) * batch_size`` of each
    worker's part, its files read in order, so the same files and workers mean the same rows."""
    meaning = {"train": tdata.fingerprint(train_path), "batch_size": cfg.train.batch_size, "workers": workers}
    if cfg.data.shuffle_rows:  # (absent when off: checkpoints written before the key resume as before)
        meaning["shuffle"] = [cfg.data.shuffle_rows, cfg.data.shuffle_seed]
    return meaning


def _files_said(fp: dict) -> str:
    """The training files of a :func:`hpcps.train.data.fingerprint`, as a message names them."""
    more = fp.get("files", 1) - 1
    return f"{fp.get('path')}" + (f" and {more} more file(s)" if more else "")


def check_same_data(manifest: dict, now: dict) -> str | None:
    """Why resuming ``manifest`` over the data described by ``now`` would continue at its step
    over other rows (None if it would not)."""
    then = manifest.get("data", {})
    if not isinstance(then.get("train"), dict):
        return None  # written before checkpoints recorded their data (version 1)
    problems = []
    a, b = then["train"], now["train"]
    if (a.get("bytes"), a.get("head_tail_xxh64"), a.get("files", 1)) != (b["bytes"], b["head_tail_xxh64"],
                                                                           b.get("files", 1)):
        problems.append(f"the training file differs ({_files_said(a)}, {a.get('bytes')} bytes, then; "
                        f"{_files_said(b)}, {b['bytes']} bytes, now)")
    for key, what in (("batch_size", "train.batch_size"), ("workers", "the number of workers")):
        if then.get(key) != now[key]:
            problems.append(f"{what} was {then.get(key)}, now {now[key]}")
    if then.get("shuffle") != now.get("shuffle"):
        show = lambda v: f"shuffle_rows {v[0]}, seed {v[1]}" if v else "off"  # noqa: E731
        problems.append(f"data.shuffle_rows/shuffle_seed were {show(then.get('shuffle'))}, now {show(now.get('shuffle'))}")
    if not problems:
        return None
    return ("the checkpoint's data position would point at other rows: " + "; ".join(problems)
            + ". Set checkpoint.allow_other_data = true to resume anyway")


@dataclass(frozen=True)
class RunPlan:
    """What every rank of a run agreed on before its context exists (:func:`agree_on_plan`)."""

    cfg: object                        # the configuration, with train.batch_size resolved
    batch_size_auto: bool              # train.batch_size was 0: resolved from the training file's rows
    restore: tuple[str, dict] | None   # the checkpoint resumed (its path and manifest), or None
    run_id: str                        # the lineage of the checkpoints this run writes
    paths: dict                        # "train" and "test": the data files
    synth_info: dict | None            # the synthetic set made for the run (no data.train), else None
    input_format: str                  # the training file's format ("" where it could not be read yet)
    workers: int

    @property
    def resumed(self) -> str:
        """The checkpoint resumed, or ""."""
        return self.restore[0] if self.restore else ""

    def data_meaning(self) -> dict:
        """What this run's checkpoints' data position refers to (:func:`data_position_meaning`)."""
        return data_position_meaning(self.cfg, self.paths["train"], self.workers)

    def start(self, steps: int) -> tuple[int, int, int]:
        """(epoch, step, steps done) where training starts with ``steps`` steps an epoch: the
        resumed checkpoint's position (one written at an epoch's last step: the next epoch's
        first), else the first step."""
        if self.restore is None:
            return 1, 1, 0
        pos = self.restore[1]["position"]
        epoch, step = pos["epoch"], pos["step"]
        if step > steps:
            epoch, step = epoch + 1, 1
        return epoch, step, pos["global_step"]

    def resumes_from_its_checkpoint_dir(self) -> bool:
        """The checkpoint resumed lies in ``checkpoint.dir`` and means the same data: it is this
        run's newest checkpoint there (so a run with nothing left to train writes none)."""
        ck = self.cfg.checkpoint
        if self.restore is None or not ck.dir or ck.allow_other_data:
            return False
        try:
            return os.path.samefile(os.path.dirname(os.path.normpath(self.restore[0])) or ".", ck.dir)
        except OSError:
            return False


def check_output_paths(cfg, world) -> None:
    """Collective over the world: the output paths are usable and apart from the inputs
    (:func:`hpcps.config.check_paths`, on the first rank), else TrainError on every rank."""
    errors = world.failures(config.check_paths(cfg) if world.is_first else None, "check of the output paths")
    if errors:
        raise TrainError(errors[0].split(": ", 1)[1])


def agree_on_plan(cfg, world) -> RunPlan:
    """Collective over the world (a :class:`hpcps.ps.collectives.World`): the run's plan, the
    first rank deciding; a reason not to run is TrainError on every rank."""
    ck = cfg.checkpoint
    restore = resolve_resume(cfg, world)
    if ck.dir and world.is_first:
        os.makedirs(ck.dir, exist_ok=True)
    run_id = claim_checkpoints(cfg, world, restore)
    check_world_fits(cfg, world, chosen=cfg.cluster.layout != "auto")
    paths, synth_info = resolve_data(cfg, world)
    input_format = _training_format(cfg, world, paths, synth_info)
    auto = not cfg.train.batch_size
    if cfg.cluster.layout == "auto":  # before the world is split: servers, groups and batch
        cfg = choose_layout(cfg, world, paths["train"], input_format)
        check_world_fits(cfg, world, chosen=True)
    workers = world.size - cfg.cluster.servers if world.size > 1 else 1  # one process: one worker
    resumed = (restore[1].get("data") or {}).get("batch_size") if restore else None
    if not cfg.train.batch_size and isinstance(resumed, int) and resumed > 0:
        # (a resumed run keeps the rows a step it was started with, which its data position counts,
        # though this version's rule would give another number: its lr cap was 1000 before)
        cfg = replace(cfg, train=replace(cfg.train, batch_size=resumed))
    elif not cfg.train.batch_size:  # from the training file's rows (counted as far as it matters)
        enough = auto_batch_max(cfg.model.type) * AUTO_BATCH_STEPS * workers
        rows = tdata.rows_at_least(paths["train"], enough, cfg.data.format) if world.is_first else 0
        rows = world.first_decides(rows, "broadcast of the training file's rows")
        cfg = replace(cfg, train=replace(cfg.train, batch_size=auto_batch_size(rows, workers, cfg.model.type)))
    plan = RunPlan(cfg, auto, restore, run_id, paths, synth_info, input_format, workers)
    problem = None
    if world.is_first and restore is not None and not ck.allow_other_data:
        try:
            problem = check_same_data(restore[1], plan.data_meaning())
        except (OSError, tdata.DataError):
            pass  # (missing or unreadable data is reported where it is loaded)
    errors = world.failures(problem, "check of the resumed data position")
    if errors:
        raise TrainError(f"cannot resume {restore[0]}: " + errors[0].split(": ", 1)[1])
    return plan


def _training_format(cfg, world, paths: dict, synth_info: dict | None) -> str:
    """Collective: the training file's format, recorded in the model file (what its keys mean);
    generated files that clash with the outputs are TrainError on every rank."""
    problem, fmt = None, ""
    if world.is_first:
        if synth_info:  # the generated files are inputs too
            problem = outputs.clash(*config.path_roles(cfg, data=paths))
        try:
            fmt = tdata.detect_format(paths["train"], cfg.data.format)
            problem = problem or _scored_format_clash(cfg, paths, fmt)
        except (OSError, tdata.DataError):
            pass  # (a missing file, or a FIFO, is reported where it is loaded)
    problem, fmt = world.first_decides((problem, fmt), "broadcast of the training file's format")
    if problem:
        raise TrainError(problem)
    return fmt


def _scored_format_clash(cfg, paths: dict, fmt: str) -> str | None:
    """Why data.test or data.predict cannot be scored by a model of ``fmt`` rows (their keys made
    another way), or None; unless ``data.allow_other_hashing``."""
    for key, spec in (("data.test", paths["test"]), ("data.predict", cfg.data.predict)):
        if spec and not cfg.data.allow_other_hashing:
            problem = model_file.scored_format_clash(fmt, key, spec, tdata.detect_format(spec, cfg.data.format, key))
            if problem:
                return problem
    return None


def resolve_resume(cfg, world) -> tuple[str, dict] | None:
    """Collective: the checkpoint to resume from (verified on the first rank), or None. The first
    rank locks ``checkpoint.dir`` before it looks in it: a job still running there may be deleting
    its old checkpoints, which the search would take for damaged ones and move aside."""
    ck = cfg.checkpoint
    if not ck.resume:
        return None
    found, error = None, None
    busy = checkpoint.hold(ck.dir) if world.is_first and ck.dir else None
    if world.is_first and not busy:
        # a job restarted by hpcps supervise: what it verified is not hashed again (unless changed since)
        handed = checkpoint.trust_verified(os.environ.get(checkpoint.VERIFIED_ENV, ""))
        if ck.resume == "auto":
            found = checkpoint.newest_good(ck.dir, report=checkpoint.say, move_damaged=True, trust_unchanged=handed)
            if found is None:
                print(f"hpcps: no checkpoint to resume in {ck.dir}: starting from scratch", flush=True)
        else:
            try:
                found = (ck.resume, checkpoint.verify(ck.resume, trust_unchanged=handed))
            except checkpoint.CheckpointError as e:
                error = str(e)
        if found and found[1].get("model_fingerprint") != cfg.model_fingerprint():
            changed = config.fingerprint_differences(found[1].get("config") or {}, cfg.to_dict())
            error = (f"{found[0]} was written for another model, optimizer or key space "
                     f"(model fingerprint {found[1].get('model_fingerprint')} != {cfg.model_fingerprint()}"
                     + (f": {'; '.join(changed)}" if changed else "") + ")")
    found, error = world.first_decides((found, f"cannot resume: {error}" if error else busy),
                                       "broadcast of the checkpoint to resume")
    if error:
        raise TrainError(error)
    return found


def claim_checkpoints(cfg, world, restore: tuple[str, dict] | None) -> str:
    """Collective: this run's id, inherited from the checkpoint it resumes (its lineage) or new,
    once the first rank has made ``checkpoint.dir`` hold this run's checkpoints only
    (:func:`hpcps.ps.checkpoint.claim`: another run's stop the job, unless ``checkpoint.existing =
    "replace"`` moves them aside)."""
    run_id, error = None, None
    if world.is_first:
        run_id = checkpoint.run_of(restore[1]) if restore else checkpoint.new_run_id()
        if cfg.checkpoint.dir:
            error = checkpoint.claim(cfg.checkpoint.dir, run_id, restore[0] if restore else None, cfg.checkpoint.existing,
                                     report=checkpoint.say)
    run_id, error = world.first_decides((run_id, error), "broadcast of the run's id")
    if error:
        raise TrainError(error)
    return run_id


def release_checkpoints(cfg) -> None:
    """The end of a run: ``checkpoint.dir`` unlocked for the next run (where this rank held it)."""
    if cfg.checkpoint.dir:
        checkpoint.release(cfg.checkpoint.dir)


def resolve_data(cfg, world) -> tuple[dict, dict | None]:
    """Collective: the data files to use. With no ``data.train``, the first rank generates a
    synthetic data set (``[synth]``), or reuses the one it generated before with the same
    parameters (in ``synth.dir``, else under :func:`synth.cache_dir`), and every rank gets its
    paths and known best metrics."""
    paths = {"train": cfg.data.train, "test": cfg.data.test}
    if cfg.data.train:
        return paths, None
    info = world.first_decides(_synthetic_set(cfg) if world.is_first else None,
                               "broadcast of the synthetic data's paths")
    if "error" in info:
        raise TrainError(info["error"])
    return {"train": info["train"], "test": info["test"]}, info


def _synthetic_set(cfg) -> dict:
    """The first rank of a run without ``data.train``: the synthetic set's paths and best metrics
    (generated, or reused from the cache), or its error. The generator (:mod:`hpcps.train.synth`
    and its kernels) is imported here, by the one run in a thousand that needs it."""
    from hpcps.train import synth

    out = cfg.synth.dir or os.path.join(synth.cache_dir(), synth.dir_name(
        cfg.synth.rows, cfg.synth.test_rows, cfg.synth.fields, cfg.synth.interactions, cfg.synth.seed,
        cfg.data.hash_bits))
    try:  # the cache's directories are hpcps's own, named by their parameters: replaced if need be
        s = synth.generate(out, cfg.synth.rows, cfg.synth.test_rows, cfg.synth.fields, cfg.synth.interactions,
                           cfg.synth.seed, cfg.data.hash_bits, formats=("libsvm",), overwrite=not cfg.synth.dir,
                           how="give synth.dir another directory (or \"\" to use the cache)")
        return {"train": s.files["train_libsvm"], "test": s.files["test_libsvm"],
                "best_test_logloss": float(s.best_test_logloss), "best_test_auc": float(s.best_test_auc),
                "dir": out, "reused": s.reused}
    except synth.SynthError as e:
        return {"error": f"synth.dir = {cfg.synth.dir!r}: {e}"}


# cluster.layout = "auto": the keys a batch holds are measured on the first rows of the training
# data (at most HEAD_ROWS, from its first HEAD_BYTES of text); compressed files and tables are not
# read ahead, and the model's curve of hpcps gen-data's Zipf data stands in for them.
HEAD_ROWS, HEAD_BYTES = 20_000, 4 << 20


def head_keys(cfg, path, fmt: str) -> tuple[scaling.KeyCurve, float]:
    """The distinct keys of the first rows of the training data, by rows (or the Zipf curve), and
    the rows a byte of its text (0 where it was not read)."""
    from hpcps.train import scaling

    try:
        first = inputs.data_files(path, "data.train")[0]
        if not fmt or fmt in tables.FORMATS or inputs.compression(first):
            return scaling.KeyCurve(), 0.0
        size = os.path.getsize(first)
        parts = max(1, size // HEAD_BYTES)
        ds = tdata.load_part(first, 0, parts, fmt, cfg.data.hash_bits, cfg.data.skip_bad_lines, key="data.train")
    except (OSError, tdata.DataError):  # (reported where the data is loaded)
        return scaling.KeyCurve(), 0.0
    n = min(ds.rows, HEAD_ROWS)
    if n < 100:
        return scaling.KeyCurve(), 0.0
    curve = scaling.KeyCurve.of_csr(ds.indptr[:n + 1], ds.indices, f"the first {n:,} rows of {first}")
    return curve, ds.rows / (size / parts)


def training_rows(cfg, path, ranks: int, rows_a_byte: float) -> int:
    """The training files' rows (first rank), as far as the batches :func:`decide_layout` tries
    need them: counted up to an epoch of AUTO_BATCH_STEPS steps of the model's most automatic rows a
    step on every worker, beyond that estimated from the files' sizes and ``rows_a_byte`` (plain text)."""
    enough = auto_batch_max(cfg.model.type) * AUTO_BATCH_STEPS * max(1, ranks - 1)
    try:
        rows = tdata.rows_at_least(path, enough, cfg.data.format)
        if rows >= enough and rows_a_byte:
            rows = max(rows, int(sum(os.path.getsize(f) for f in inputs.data_files(path)) * rows_a_byte))
    except (OSError, tdata.DataError):
        rows = 0  # (reported where the data is loaded)
    return rows


def model_shape(cfg) -> tuple[int, int, int]:
    """(floats a key, the optimizer's state floats a float, tables a step touches) of the model."""
    m = cfg.model
    dim, tables_ = {"lr": (1, 1), "fm": (1 + m.factors, 1), "ffm": (1 + max(m.fields, 1) * m.factors, 1),
                    "wdl": (1 + m.factors, 2), "deepfm": (1 + m.factors, 2)}.get(m.type, (1, 1))
    state = (optim.width(cfg.optimizer.name, dim) - dim) // dim
    return dim, state, tables_


def decide_layout(cfg, ranks: int, hosts: int, cores: int, keys: scaling.KeyCurve, rows: int
                  ) -> tuple[int, int, int, str]:
    """cluster.layout = "auto" (the first rank): (servers, worker_groups, batch_size, the line
    that says why, train.group_pull), each part the user set (not at its default) kept; group pulls
    where the model gives them more than 5 % over a pull per worker, a group merges its keys and
    there are several hosts (on one host they were measured slower: docs/scaling.md); on one host
    whose ranks outnumber its cores, one server (a copy of each shard: a second measured slower
    there than the model gives it). ``rows``: the training
    file's rows (:func:`training_rows`): batches as :func:`auto_batch_size` makes them at most,
    or beyond them, up to 10,000, as long as an epoch keeps AUTO_BATCH_STEPS steps."""
    from hpcps.train import scaling

    cl, tr = cfg.cluster, cfg.train
    fixed = {k: v for k, v in (("cluster.servers", cl.servers if cl.servers != 1 else 0),
                               ("cluster.worker_groups", cl.worker_groups), ("train.batch_size", tr.batch_size)) if v}
    dim, state, tables_ = model_shape(cfg)
    job = scaling.Job(dim=dim, state=state, staleness=cl.staleness, hosts=hosts, tables=tables_, keys=keys,
                      requests="group" if tr.group_pull else "worker")
    def cap(workers: int) -> int:
        return min(scaling.BATCHES[-1], max(AUTO_BATCH_MIN, math.ceil(rows / workers / AUTO_BATCH_STEPS)))
    merges = tr.aggregate and cfg.model.compute == "workers"  # (else a group is one worker)
    # one host whose ranks outnumber its cores: one server (a copy of each shard), where a second
    # was measured slower than the model gives it (docs/scaling.md, "cluster.layout = auto")
    most_servers = cl.num_shards if hosts > 1 or ranks <= cores else cl.replicas + 1
    servers = fixed.get("cluster.servers", 0)
    if cl.backup_workers:  # a worker a group, more workers than backups (Backup.check)
        merges, most_servers = False, min(most_servers, ranks - cl.backup_workers - 1)
        servers = servers or (ranks - cl.worker_groups if cl.worker_groups else 0)
    c = scaling.choose(ranks, job, scaling.Machine(cores=cores), servers,
                       fixed.get("cluster.worker_groups", 0), fixed.get("train.batch_size", 0), cap,
                       max_servers=most_servers, max_group=scaling.MAX_GROUP if merges else 1,
                       min_servers=cl.replicas + 1, requests=("worker", "group") if merges and hosts > 1 else ())
    groups = 0 if c.groups == c.workers and not cl.worker_groups else c.groups
    return (c.servers, groups, c.batch, scaling.explain(c, fixed) + f"; keys a batch from {keys.source}",
            c.requests == "group")


def check_world_fits(cfg, world, chosen: bool = True) -> None:
    """Before any data is read or generated (and again once ``cluster.layout = "auto"`` chose):
    TrainError, said by the first rank, where the world cannot hold ``cluster.replicas`` (auto) or
    the backup workers (every rank decides the same). ``chosen``: the servers and groups are the
    ones the run uses; else (auto, before it chose) the layout auto can choose that suits them best."""
    r = cfg.cluster.replicas
    if cfg.cluster.layout == "auto" and r and world.size < r + 2:
        raise TrainError(f"cluster.replicas = {r} needs at least {r + 1} servers and a worker: run {r + 2} ranks "
                         f"or more (mpiexec -n {r + 2}; this world has {world.size})" if world.is_first else "")
    workers, groups = workers_and_groups(cfg, world.size, chosen)
    problem = backup_of(cfg).check(workers, cfg.cluster.staleness, groups)
    if problem:
        raise TrainError(problem if world.is_first else "")


def workers_and_groups(cfg, ranks: int, chosen: bool = True) -> tuple[int, int]:
    """(workers, worker groups) of a world of ``ranks`` ranks: the configuration's, or where
    ``cluster.layout = "auto"`` has not ``chosen`` yet, those it can choose that suit backup workers
    best: the most workers (its servers as set, else one server, or each shard's copies), or, with
    ``cluster.worker_groups`` set and ``cluster.servers`` not, a worker a group (:func:`decide_layout`)."""
    cl = cfg.cluster
    if ranks == 1:  # one process: one worker
        return 1, 1
    if chosen or cl.servers != 1:
        workers = ranks - cl.servers
        return workers, cl.worker_groups or workers
    if cl.worker_groups and cl.backup_workers:
        return cl.worker_groups, cl.worker_groups
    workers = ranks - max(1, cl.replicas + 1)
    return workers, cl.worker_groups or workers


def choose_layout(cfg, world, path, fmt: str):
    """Collective over the world, before it is split: ``cfg`` with the servers, worker groups and
    batch ``cluster.layout = "auto"`` picks (:func:`decide_layout`, on the first rank, printed there)."""
    if world.size == 1:
        if world.is_first:
            print("hpcps train: layout auto: one process runs its server and its worker inside it: nothing to "
                  "place", flush=True)
        return cfg
    names = world.sizes(zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF, "the hosts' names")
    cpus = world.sizes(len(os.sched_getaffinity(0)), "the hosts' cores")
    picked = None
    if world.is_first:
        per_host = dict(zip(names.tolist(), cpus.tolist()))
        keys, rows_a_byte = head_keys(cfg, path, fmt)
        rows = 0 if cfg.train.batch_size else training_rows(cfg, path, world.size, rows_a_byte)
        picked = decide_layout(cfg, world.size, len(per_host), sum(per_host.values()), keys, rows)
        print(f"hpcps train: {picked[3]}", flush=True)
    servers, groups, batch, _, group_pull = world.first_decides(picked, "broadcast of the layout")
    return replace(cfg, cluster=replace(cfg.cluster, servers=servers, worker_groups=groups),
                   train=replace(cfg.train, batch_size=batch, group_pull=group_pull))
