"""Configuration: one validated, frozen object from TOML plus ``--set section.key=value`` overrides.

The keys form a closed set (like ``mpi4py.rc``): an unknown section or key is an error naming it,
and so is a value of the wrong type. Pure: no MPI (the CLI reads the file on one rank and
broadcasts the resulting dictionary).

Sections and keys, with defaults, are the dataclasses below; ``hpcps train --help-config`` prints
them, and docs/configuration.md is generated from them (docs/configuration.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
import textwrap
from dataclasses import dataclass, field
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from hpcps.outputs import clash
from hpcps.ps import filters as traffic_filters
from hpcps.ps.tables import Features
from hpcps_kernels import optim


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


def described(default, help: str):
    """A configuration key: its default and its description, defined together here and shown by
    ``hpcps train --help-config`` and the generated docs/configuration.md."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Cluster:
    """[cluster]: the layout (servers, worker groups), the consistency, backups, replicas and faults."""

    layout: str = described("manual", "manual: the servers, worker groups and batch as set; auto: the scaling "
                                      "model (docs/scaling.md) picks cluster.servers, cluster.worker_groups and "
                                      "train.batch_size from the world's size, the model and the data's keys a "
                                      "batch, each one the user set (not at its default) kept, and on several "
                                      "hosts turns train.group_pull on where it models it > 5 % faster")
    servers: int = described(1, "server ranks (the first ranks of the world)")
    worker_groups: int = described(0, "worker groups; 0 = one per worker. A group merges its pushes "
                                      "(train.aggregate)")
    staleness: int = described(0, "0 = BSP, s > 0 = SSP with staleness s, -1 = ASP")
    backup_workers: int = described(0, "BSP: b workers nobody waits for (TensorFlow's sync replicas, KunPeng's "
                                       "backup instances): a clock completes once W - b of the W workers pushed "
                                       "it; a late worker goes on with the current model and, once W - b workers "
                                       "ended an epoch, skips the rest of it (its rows counted). 0 <= b < W; "
                                       "needs one worker per group (layout auto keeps one). See "
                                       "docs/operations.md")
    late_pushes: str = described("next", "backup workers: what a push of a clock that completed without it "
                                         "does: next = applied with the next clock, drop = dropped (TensorFlow's "
                                         "sync replicas)")
    num_shards: int = described(1024, "virtual shards (fixed for a model's life)")
    replicas: int = described(0, "hot backups: each virtual shard is kept on replicas + 1 servers (on distinct "
                                 "hosts where there are enough), pushes applied on every copy, pulls answered "
                                 "by the primary; at most cluster.servers - 1 (layout auto picks at least "
                                 "replicas + 1 servers; docs/operations.md)")
    stall_warn_s: float = described(30.0, "report a request or collective nobody has answered for this long "
                                          "(seconds)")
    stall_timeout_s: float = described(300.0, "abort the job when a request or collective is unanswered this "
                                              "long (seconds; at least stall_warn_s)")
    fault_tolerance: str = described("none", "none: a lost rank ends the job (hpcps supervise restarts it from "
                                             "its last checkpoint); ulfm: the job goes on without a lost "
                                             "worker, whose rows the others train (Open MPI launched with "
                                             "mpiexec --with-ft ulfm: make install-ft, docs/operations.md)")


@dataclass(frozen=True)
class Data:
    """[data]: the files read and how (format, hashing, memory, shuffling, predictions)."""

    train: str = described("", "training data: a file, a list of files, a glob or a directory of part files "
                               "(libsvm, Criteo TSV, VW or libffm; plain or gzip/zstd/bzip2/xz); \"\" = "
                               "generate one (see [synth])")
    test: str = described("", "held-out data (the same forms), evaluated after each epoch (\"\" = none)")
    format: str = described("auto", "the files' format; auto: a tab in the first line = criteo, a \"|\" or a "
                                    ".vw name = vw, field:index:value tokens or a .ffm name = libffm, "
                                    "Parquet's magic bytes = parquet, a .csv name = csv (a header line; "
                                    "parquet and csv need pip install 'hpcps[parquet]'), else libsvm")
    label_column: str = described("label", "parquet, csv: the label's column (a row to score may lack it)")
    weight_column: str = described("", "parquet, csv: the rows' weights' column (\"\" = every row's weight 1)")
    feature_columns: str = described("", "parquet, csv: the feature columns, comma-separated (\"\" = every "
                                         "other column); a float column c gives key c with its value, any "
                                         "other is categorical: xxh64(str(value), seed=c), value 1")
    hash_bits: int = described(24, "keys are masked to this many bits (Criteo hashes and libsvm indices alike)")
    skip_bad_lines: bool = described(False, "count and skip malformed lines instead of stopping")
    cache_dir: str = described("", "binary cache of parsed parts, memory-mapped on later runs (\"\" = none); "
                                   "a cached part is loaded whole, not streamed")
    memory_mb: float = described(0.0, "0: keep the parsed training part in memory for later epochs; > 0: "
                                      "hold at most this much parsed data, reading the file again each epoch")
    shuffle_rows: int = described(0, "> 0: each worker's rows are shuffled in windows of this many "
                                     "consecutive rows, the same order every epoch (0 = file order)")
    shuffle_seed: int = described(0, "the seed of the shuffle windows' permutations")
    parse_thread: bool = described(False, "parse the part ahead on a thread of its own (for a spare core "
                                          "beside each worker), not in the steps' waits; the same rows in "
                                          "the same order")
    predict: str = described("", "after training, score this data (the same forms) ... (\"\" = none)")
    predict_out: str = described("", "... into this one, one score per row in input order")
    allow_other_hashing: bool = described(False, "test and score data.test and data.predict even where their "
                                                 "format makes keys another way than data.train's (refused "
                                                 "otherwise, as by hpcps eval without --allow-other-hashing)")


@dataclass(frozen=True)
class Synth:
    """[synth]: the synthetic data set made for a run without data.train."""

    rows: int = described(1_000_000, "training rows generated when data.train is \"\"")
    test_rows: int = described(100_000, "test rows generated")
    fields: int = described(39, "fields a row (Criteo-like: up to 13 integer and 26 categorical columns)")
    interactions: bool = described(False, "add pairwise field interactions to the truth (data for an FM)")
    seed: int = described(1, "the generator's seed")
    dir: str = described("", "where the generated files go (\"\" = a directory named by these parameters "
                             "under HPCPS_CACHE_DIR); the same data set already there is reused")


@dataclass(frozen=True)
class Model:
    """[model]: the model's type, loss, sizes and initial values, and its dense part's optimizer."""

    type: str = described("lr", "lr (logistic or linear regression), fm (factorization machine), ffm "
                                "(field-aware FM), wdl (Wide & Deep) or deepfm, or a type registered from "
                                "user code")
    loss: str = described("logistic", "logistic (labels 0/1 or -1/+1) or squared (any finite labels)")
    factors: int = described(8, "fm: factors per key; ffm: factors per key and field; wdl, deepfm: the "
                                "embedding size")
    init_scale: float = described(0.01, "fm, ffm, wdl, deepfm: std of the initial factors and embeddings "
                                        "(lr starts at zeros)")
    seed: int = described(0, "seed of the initializer (and of the MLP's initial weights)")
    compute: str = described("workers", "servers: the servers compute margins and gradients and weights "
                                        "never travel (lr and fm, one worker per group)")
    bias_init: str = described("auto", "auto: the bias starts where it predicts the first 4,096 rows' mean "
                                       "label (its log-odds under the logistic loss, for lr and fm); zero")
    hidden: tuple = described((64, 32), "wdl, deepfm: the MLP's hidden layer sizes")
    activation: str = described("relu", "wdl, deepfm: the MLP's activation")
    fields: int = described(0, "ffm, wdl, deepfm: fields per row; 0 = the format's (Criteo 39, libsvm and "
                               "VW 1); libffm needs it")
    dense_optimizer: str = described("adam", "wdl, deepfm: the MLP's optimizer on the servers (adam, adagrad "
                                             "or sgd)")
    dense_lr: float = described(0.0, "wdl, deepfm: the MLP's learning rate; 0 = 0.001 per 1000 rows in each "
                                     "MLP step (hpcps train prints the rate it used)")
    dense_sync_steps: int = described(1, "wdl, deepfm: worker groups pull the MLP from the servers every k "
                                         "steps")


@dataclass(frozen=True)
class Optimizer:
    """[optimizer]: the servers' update rule and its own keys."""

    name: str = described("ftrl", "sgd | adagrad | ftrl | adam (or one registered from the library API)")
    params: dict = described({}, "the optimizer's own keys, beside name: [optimizer] alpha = 0.1")


@dataclass(frozen=True)
class Train:
    """[train]: the steps, epochs, evaluation, early stopping and what a run prints and writes."""

    epochs: int = described(2, "passes over the training data")
    batch_size: int = described(0, "rows per worker per step; 0 = enough for at least 128 steps an epoch, "
                                   "between 50 and 4000 for lr, 1000 for the models with factors (hpcps "
                                   "train prints the number it used)")
    gradient: str = described("sum", "sum or mean of a step's per-row gradients per key (sum suits FTRL "
                                     "and AdaGrad; mean with plain SGD minimises the mean loss)")
    aggregate: bool = described(True, "merge a worker group's pushes before sending")
    eval_every: int = described(0, "steps between evaluations (0 = at the end of each epoch)")
    metrics: str = described("", "JSON-lines metrics file, a record per step and per epoch (\"\" = none)")
    progress: bool = described(True, "progress bar (or a line every 10 s in a log) on the first worker")
    model_out: str = described("", "write the trained model here (HDF5; \"\" = none)")
    holdout: int = described(0, "hold out every Nth row of each worker's part from training and evaluate "
                                "it after each epoch (10 as Vowpal Wabbit does; 0 = none)")
    early_stop: int = described(0, "stop after N epochs without a better holdout loss and keep the best "
                                   "epoch's model (0 = train every epoch; needs holdout)")
    pull_early: bool = described(False, "SSP/ASP: each step also pulls the rows of the batch after the next "
                                        "(the pipelined step; changes nothing under BSP)")
    group_pull: bool = described(False, "a worker group's first rank pulls the rows of the union of its members' "
                                        "keys with the group's merged push and hands each member its rows: one "
                                        "request per server per group a step instead of one per worker (KunPeng's "
                                        "aggregation; needs train.aggregate; the same numbers)")


@dataclass(frozen=True)
class Checkpoint:
    """[checkpoint]: where and when the model's state is saved, and what a run resumes."""

    dir: str = described("", "where checkpoints go (\"\" = none)")
    every_steps: int = described(0, "checkpoint every N steps (0 = off)")
    every_s: float = described(0.0, "checkpoint every T seconds (0 = off)")
    keep: int = described(3, "good full checkpoints of this run kept (each with its delta snapshots)")
    delta_every_steps: int = described(0, "a delta snapshot (only the rows changed since the snapshot before) "
                                          "every N steps (0 = off)")
    delta_every_s: float = described(0.0, "delta snapshots timed so that a kill loses at most T seconds of "
                                          "training: each committed within T s of the step of the one before "
                                          "(0 = off)")
    full_every: int = described(10, "with delta snapshots: a full checkpoint instead of every Nth delta (bounds "
                                    "the chain a restore reads)")
    on_signal: str = described("exit", "after a SIGUSR1/SIGTERM checkpoint: exit (status 75) or continue")
    final: bool = described(True, "checkpoint at the end of training")
    resume: str = described("", "\"\" = start fresh, auto = the newest good checkpoint in dir, or a "
                                "checkpoint's path (--resume)")
    allow_other_data: bool = described(False, "resume even though the training file, batch size or number "
                                              "of workers changed (not exact)")
    existing: str = described("error", "a fresh run into a dir holding another run's checkpoints: error, or "
                                       "replace (move them under dir/replaced/)")


@dataclass(frozen=True)
class Filters:
    """[filters]: the traffic filters on the requests' values and keys."""

    push_threshold: float = described(0.0, "send a pushed key only once a coordinate of its accumulated update "
                                           "reaches this in absolute value; the rest stays in a residual on the "
                                           "worker, flushed (pushed, one extra clock) at the end of every epoch "
                                           "and before every checkpoint but backup workers' periodic ones (0 = off; "
                                           "docs/architecture.md, traffic filters)")
    wire_dtype: str = described("fp32", "the type of pushed and pulled values on the wire (the servers' rows and "
                                        "optimizer state stay fp32); fp16 carries at most 65504: values "
                                        "beyond it travel as +-65504, counted in the summary's "
                                        "wire_dtype_saturated_values with a warning (bf16 has fp32's range)")
    key_cache: bool = described(False, "send a key list to a server once, then only its id while it is unchanged")
    key_cache_mb: float = described(64.0, "with key_cache: the key lists a worker keeps per table (each server "
                                          "holds its share of them), the least recently used dropped past it")

    def traffic(self):
        """These settings as the parameter server's :class:`hpcps.ps.filters.Filters`."""
        return traffic_filters.Filters(self.push_threshold, self.wire_dtype, self.key_cache, self.key_cache_mb)


@dataclass(frozen=True)
class Config:
    """A run's whole configuration, one field a section."""

    cluster: Cluster = field(default_factory=Cluster)
    data: Data = field(default_factory=Data)
    synth: Synth = field(default_factory=Synth)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    train: Train = field(default_factory=Train)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    features: Features = field(default_factory=Features)
    filters: Filters = field(default_factory=Filters)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        opt = d.pop("optimizer")
        d["optimizer"] = {"name": opt["name"], **opt["params"]}
        return d

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def model_fingerprint(self) -> str:
        """What a checkpoint must match to be resumed: model, optimizer and key space (not the
        data paths, epochs or layout, which may change between runs)."""
        keep = fingerprinted(self.to_dict())
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def fingerprinted(d: dict) -> dict:
    """The parts of a configuration (as :meth:`Config.to_dict` writes it) that
    :meth:`Config.model_fingerprint` hashes."""
    features = d.get("features", {})
    return {"model": d.get("model"), "optimizer": d.get("optimizer"), "hash_bits": d.get("data", {}).get("hash_bits"),
            **({"features": features} if features != dataclasses.asdict(Features()) else {}),
            "num_shards": d.get("cluster", {}).get("num_shards"), "gradient": d.get("train", {}).get("gradient")}


def fingerprint_differences(then: dict, now: dict) -> list[str]:
    """``key was X, now Y`` for each fingerprinted setting that differs between two configurations
    (as :meth:`Config.to_dict` writes them: a checkpoint's and this run's)."""
    def flat(d: dict) -> dict:
        out = {}
        for part, value in fingerprinted(d).items():
            names = {"hash_bits": "data.hash_bits", "num_shards": "cluster.num_shards", "gradient": "train.gradient"}
            if isinstance(value, dict):
                out.update({f"{part}.{k}": v for k, v in value.items()})
            else:
                out[names.get(part, part)] = value
        return out
    a, b = (flat(json.loads(json.dumps(d))) for d in (then, now))  # as stored: tuples are lists
    unset = "its default"  # (an optimizer's key not set: the optimizer's own default)
    return [f"{k} was {a.get(k, unset)}, now {b.get(k, unset)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_CLASSES = {"cluster": Cluster, "data": Data, "synth": Synth, "model": Model, "train": Train,
                    "checkpoint": Checkpoint, "features": Features, "filters": Filters}


def _coerce(where: str, value: Any, default: Any):
    """``value`` converted to the type of ``default``, or a ConfigError naming ``where``."""
    kind = type(default)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{where}: {value} is too large for a float") from None
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind is tuple:  # a list of positive integers: [64, 32], or "64,32"
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)):
            try:
                out = tuple(_coerce(where, x, 0) for x in items if not (isinstance(x, str) and not x.strip()))
            except ConfigError:
                out = None
            if out is not None and all(x >= 1 for x in out) and len(out) <= 16:
                return out
        raise ConfigError(f"{where}: expected a list of up to 16 positive integers, got {value!r}")
    raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")


# the keys that name data: a path, a glob or a directory (a string), or a list of them
FILE_LISTS = (("data", "train"), ("data", "test"), ("data", "predict"))


def _file_list(where: str, value: list) -> str | tuple:
    """A list of paths for a key of :data:`FILE_LISTS` (one path: that string)."""
    if not value or not all(isinstance(x, str) and x for x in value):
        raise ConfigError(f"{where}: expected a path or a list of paths, got {value!r}")
    return value[0] if len(value) == 1 else tuple(value)


BUILT_IN_MODELS = ("lr", "fm", "ffm", "wdl", "deepfm")
CHOICES = {  # the keys whose values are names; models and data formats registered from user code add theirs
    ("data", "format"): ("auto", "libsvm", "criteo", "vw", "libffm", "parquet", "csv"),
    ("model", "type"): BUILT_IN_MODELS,
    ("model", "activation"): ("relu", "tanh"),
    ("model", "loss"): ("logistic", "squared"),
    ("model", "compute"): ("workers", "servers"),
    ("cluster", "late_pushes"): ("next", "drop"),
    ("model", "bias_init"): ("auto", "zero"),
    ("train", "gradient"): ("sum", "mean"),
    ("cluster", "layout"): ("manual", "auto"),
    ("cluster", "fault_tolerance"): ("none", "ulfm"),
    ("checkpoint", "on_signal"): ("exit", "continue"),
    ("checkpoint", "existing"): ("error", "replace"),
    ("filters", "wire_dtype"): ("fp32", "fp16", "bf16"),
}


def add_choice(section: str, key: str, value: str) -> None:
    """Allow ``value`` for ``section.key`` (a closed set of names): how the registries of model
    types and data formats (:func:`hpcps.register_model`, :func:`hpcps.register_format`) add their
    names to the configuration."""
    if (section, key) not in CHOICES:
        raise ValueError(f"{section}.{key} is not a key with a set of names")
    if value not in CHOICES[(section, key)]:
        CHOICES[(section, key)] += (value,)


def _name(x) -> str:
    """A key or section name as it can be shown on one line (quoted if it is odd)."""
    return x if isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9_.-]+", x) else repr(x)


def from_dict(raw: dict) -> Config:
    """Build and validate a Config from a nested dictionary (as parsed from TOML)."""
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section [{_name(name)}]; expected one of {sorted(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of keys")
        if name == "optimizer":
            continue
        cls = _SECTION_CLASSES[name]
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        kw = {}
        for key, value in values.items():
            if key not in defaults:
                raise ConfigError(f"unknown config key {name}.{_name(key)}; [{name}] has {sorted(defaults)}")
            if (name, key) in FILE_LISTS and isinstance(value, (list, tuple)):
                kw[key] = _file_list(f"{name}.{key}", value)
            else:
                kw[key] = _coerce(f"{name}.{key}", value, defaults[key])
            if (name, key) in CHOICES and kw[key] not in CHOICES[(name, key)]:
                raise ConfigError(f"{name}.{key} = {kw[key]!r}: expected one of {list(CHOICES[(name, key)])}")
        try:
            sections[name] = cls(**kw)
        except ValueError as e:  # a section that checks its own values (features)
            raise ConfigError(str(e)) from None
    opt = dict(raw.get("optimizer", {}))
    name = opt.pop("name", Optimizer.name)
    if not isinstance(name, str) or name not in optim.REGISTRY:
        raise ConfigError(f"optimizer.name = {name!r}: expected one of {sorted(optim.REGISTRY)}")
    rule = optim.get(name)
    params = {}
    for key, value in opt.items():
        if key not in rule.params:
            raise ConfigError(f"unknown config key optimizer.{_name(key)} for optimizer {name!r}; "
                              f"it takes {sorted(rule.params)}")
        params[key] = _coerce(f"optimizer.{key}", value, float(rule.params[key]))
        why = rule.range_error(key, params[key])
        if why:
            raise ConfigError(f"optimizer.{key} {why}")
    model = sections.get("model") or Model()
    if name == "ftrl" and "l2" not in params and model.type in FACTORED and model.loss == "logistic":
        params["l2"] = FACTOR_FTRL_L2  # (a default: written out as if set, so checkpoints and tune's best.toml keep it)
    sections["optimizer"] = Optimizer(name, params)
    cfg = Config(**sections)
    _check(cfg)
    return cfg


DEEP = ("wdl", "deepfm")  # models with embeddings and an MLP
FIELDED = ("ffm", *DEEP)  # models that read each key's field (above the hash bits)
FACTORED = ("fm", *FIELDED)  # models with factors or embeddings
# FTRL's default l2 for the models with factors or embeddings (fm, ffm, wdl, deepfm) under the logistic
# loss; LR and regression keep the registry's 0. Every tuned FM and DeepFM model of the tests' data
# sets had l2 10 (docs/defaults-sweep.py), and it cut their defaults' gaps to the tuned models from
# 0.0054-0.0076 to 0.0010-0.0027; on the LR sets and the ratings set (squared loss) it made things worse.
FACTOR_FTRL_L2 = 10.0
INF = float("inf")
# The allowed range of every numeric key: (low, high, low_open). High is inclusive.
RANGES = {
    ("cluster", "servers"): (1, INF, False),
    ("cluster", "worker_groups"): (0, INF, False),
    ("cluster", "staleness"): (-1, INF, False),
    ("cluster", "backup_workers"): (0, INF, False),
    ("cluster", "num_shards"): (1, 1 << 24, False),
    ("cluster", "replicas"): (0, INF, False),
    ("cluster", "stall_warn_s"): (0, INF, True),
    ("cluster", "stall_timeout_s"): (0, INF, True),
    ("data", "hash_bits"): (1, 64, False),
    ("data", "memory_mb"): (0, INF, False),
    ("data", "shuffle_rows"): (0, INF, False),
    ("data", "shuffle_seed"): (0, INF, False),
    ("synth", "rows"): (1, INF, False),
    ("synth", "test_rows"): (1, INF, False),
    ("synth", "fields"): (2, 39, False),
    ("synth", "seed"): (0, INF, False),
    ("model", "factors"): (1, 4096, False),
    ("model", "init_scale"): (0, INF, False),
    ("model", "seed"): (0, INF, False),
    ("model", "fields"): (0, 65536, False),
    ("model", "dense_lr"): (0, INF, False),
    ("model", "dense_sync_steps"): (1, INF, False),
    ("train", "epochs"): (1, INF, False),
    ("train", "batch_size"): (0, INF, False),
    ("train", "eval_every"): (0, INF, False),
    ("train", "holdout"): (0, INF, False),
    ("train", "early_stop"): (0, INF, False),
    ("checkpoint", "every_steps"): (0, INF, False),
    ("checkpoint", "every_s"): (0, INF, False),
    ("checkpoint", "keep"): (1, INF, False),
    ("checkpoint", "delta_every_steps"): (0, INF, False),
    ("checkpoint", "delta_every_s"): (0, INF, False),
    ("checkpoint", "full_every"): (1, INF, False),
    ("filters", "push_threshold"): (0, INF, False),
    ("filters", "key_cache_mb"): (0, INF, True),
}


def describe_range(lo, hi, lo_open) -> str:
    """A key's range in words (``lo_open``: ``lo`` itself is out of it)."""
    def shown(x) -> str:  # (1 << 24 as 16777216, not 1.67772e+07)
        return str(int(x)) if float(x).is_integer() else f"{x:g}"
    if hi == INF:
        return f"{'greater than' if lo_open else 'at least'} {shown(lo)}"
    return f"between {shown(lo)} and {shown(hi)}"


def _check(cfg: Config) -> None:
    for (section, key), (lo, hi, lo_open) in RANGES.items():
        v = getattr(getattr(cfg, section), key)
        if isinstance(v, float) and not math.isfinite(v) and not (v == INF and hi == INF and key.endswith("_s")):
            raise ConfigError(f"{section}.{key} must be a finite number (got {v})")
        if (v <= lo if lo_open else v < lo) or v > hi:
            raise ConfigError(f"{section}.{key} must be {describe_range(lo, hi, lo_open)} (got {v})")
    if cfg.cluster.stall_warn_s > cfg.cluster.stall_timeout_s:
        raise ConfigError(f"cluster.stall_warn_s ({cfg.cluster.stall_warn_s:g}) must not exceed "
                          f"cluster.stall_timeout_s ({cfg.cluster.stall_timeout_s:g})")
    check_replicas(cfg)
    if cfg.train.holdout == 1:
        raise ConfigError("train.holdout = 1 would hold out every row; use 0 (none) or N >= 2 (every Nth row, "
                          "e.g. 10 as Vowpal Wabbit does)")
    if cfg.train.early_stop and not cfg.train.holdout:
        raise ConfigError("train.early_stop needs a holdout to watch: set train.holdout (e.g. 10: every 10th row)")
    if cfg.model.compute == "servers" and cfg.cluster.worker_groups:
        raise ConfigError("model.compute = 'servers' needs one worker per group (cluster.worker_groups = 0): "
                          "each worker's rows go to the servers, there is no group merge")
    if cfg.cluster.backup_workers and cfg.cluster.staleness != 0:
        raise ConfigError(f"cluster.backup_workers = {cfg.cluster.backup_workers} is for BSP (cluster.staleness = 0, "
                          f"got {cfg.cluster.staleness}): under SSP and ASP nobody waits for the slowest worker anyway")
    if cfg.cluster.backup_workers and 0 < cfg.cluster.worker_groups <= cfg.cluster.backup_workers:
        # (more groups than backups: judged against the world, hpcps.train.plan.check_world_fits)
        raise ConfigError(f"cluster.backup_workers = {cfg.cluster.backup_workers} needs one worker per group "
                          f"(cluster.worker_groups = 0, or as many as the workers; got {cfg.cluster.worker_groups}, "
                          f"which leaves no more workers than backups): a group's members wait for each other "
                          f"in its merge")
    if cfg.train.group_pull and not cfg.train.aggregate:
        raise ConfigError("train.group_pull needs train.aggregate = true (the group's first rank pushes for the group)")
    if cfg.train.pull_early and cfg.model.compute == "servers":
        raise ConfigError("train.pull_early is for model.compute = 'workers' (the servers' computation pulls nothing)")
    if cfg.model.compute == "servers" and cfg.model.type not in BUILT_IN_MODELS:
        raise ConfigError(f"model.compute = 'servers' is for lr and fm; a registered model ({cfg.model.type}) "
                          f"computes on the workers")
    if cfg.model.type in FIELDED:
        if cfg.model.compute == "servers":
            raise ConfigError(f"model.compute = 'servers' is for lr and fm; {cfg.model.type} computes on the workers")
        if cfg.data.hash_bits > 48:
            raise ConfigError(f"data.hash_bits must be at most 48 for a {cfg.model.type} (a key carries its field "
                              f"above the hash bits; got {cfg.data.hash_bits})")
    if cfg.model.type in DEEP:
        if cfg.model.dense_optimizer not in optim.REGISTRY:
            raise ConfigError(f"model.dense_optimizer = {cfg.model.dense_optimizer!r}: expected one of "
                              f"{sorted(optim.REGISTRY)}")
        if "lr" not in optim.get(cfg.model.dense_optimizer).params:
            raise ConfigError(f"model.dense_optimizer = {cfg.model.dense_optimizer!r} takes no learning rate "
                              f"(model.dense_lr); use adam, adagrad or sgd")
    if cfg.model.type in FACTORED and cfg.model.init_scale <= 0:
        raise ConfigError("model.init_scale must be greater than 0 for an fm (factors that all start at 0 "
                          "never move)")
    if bool(cfg.data.predict) != bool(cfg.data.predict_out):
        raise ConfigError("data.predict and data.predict_out go together")
    if cfg.checkpoint.resume and not cfg.checkpoint.dir and cfg.checkpoint.resume == "auto":
        raise ConfigError("checkpoint.resume = 'auto' needs checkpoint.dir")


def check_replicas(cfg: Config) -> None:
    """``cluster.replicas`` against the servers and the features whose outcome on a server depends
    on every key it holds (a backup holds other keys than its primary), which would make a
    backup's rows differ from its primary's."""
    r, f = cfg.cluster.replicas, cfg.features
    if not r:
        return
    if (cfg.cluster.layout == "manual" or cfg.cluster.servers > 1) and r >= cfg.cluster.servers:  # (auto keeps servers set)
        raise ConfigError(f"cluster.replicas = {r} needs at least {r + 1} servers (cluster.servers = "
                          f"{cfg.cluster.servers}): each shard's copies are on distinct servers")
    why = ("model.compute = 'servers' (a backup does not see the batches)" if cfg.model.compute == "servers" else
           "cluster.backup_workers (which pushes are late depends on each server's timing)"
           if cfg.cluster.backup_workers else
           "features.admit_count > 1 (counters shared by hash)" if f.admit_count > 1 else
           "features.server_memory_mb (a budget over every row a server holds)" if f.server_memory_mb else "")
    if why:
        raise ConfigError(f"cluster.replicas = {r} does not go with {why}: set cluster.replicas = 0")


def _writable_dir(directory: str) -> str | None:
    """Why files cannot be created in ``directory`` (made if missing), or None."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hpcps-write-check-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def path_roles(cfg: Config, config_file: str = "", outputs=(), data: dict | None = None) -> tuple[list, list, list]:
    """The (outputs, inputs, checkpoint directories) of a run of ``cfg``, as ``(what, path)`` pairs
    for :func:`hpcps.outputs.clash`: ``outputs`` adds the command's own (``--summary-json``);
    ``data``: the training and test files when they are not ``data.train`` and ``data.test``
    (generated ones)."""
    d = cfg.data
    data = data or {"train": d.train, "test": d.test}
    outs = [("train.model_out", cfg.train.model_out), ("train.metrics", cfg.train.metrics),
            ("data.predict_out", d.predict_out), *outputs]
    named = [("data.train", data["train"]), ("data.test", data["test"]), ("data.predict", d.predict)]
    ins = [(key, p) for key, v in named for p in ([v] if isinstance(v, str) else v)]
    ins.append(("the config file", config_file or ""))
    if cfg.checkpoint.resume not in ("", "auto"):
        ins.append(("checkpoint.resume", cfg.checkpoint.resume))
    return outs, ins, [("checkpoint.dir", cfg.checkpoint.dir)]


def check_paths(cfg: Config, config_file: str = "", outputs=(), data: dict | None = None) -> str | None:
    """Why an output of ``cfg`` could not be written (the first problem, naming the key), or None.

    Run before training, so that an unwritable ``train.model_out`` is not found at its end, and
    an output that is an input (by the same file: :func:`hpcps.outputs.clash`) overwrites nothing.
    ``config_file``, ``outputs`` and ``data``: see :func:`path_roles`. Creates ``checkpoint.dir``
    (and ``synth.dir``) if missing.
    """
    outs, ins, ckpt_dirs = path_roles(cfg, config_file, outputs, data)
    problem = clash(outs, ins, ckpt_dirs)
    if problem:
        return problem
    dirs = [("checkpoint.dir", cfg.checkpoint.dir), ("synth.dir", cfg.synth.dir if not cfg.data.train else "")]
    for key, d in dirs:
        if d:
            why = _writable_dir(d)
            if why:
                return f"{key} = {d!r} is not writable: {why}"
    for key, path in outs:
        problem = output_problem(key, path)
        if problem:
            return problem
    return None


def output_problem(key: str, path: str) -> str | None:
    """Why the output file ``path`` (``key`` names it: a config key or a command's option) could
    not be written, or None; its directory is made if missing (as train.model_out's is)."""
    if not path:
        return None
    named = f"{key} {path!r}" if key.startswith("-") else f"{key} = {path!r}"
    if os.path.isdir(path):
        return f"{named} is a directory, not a file"
    why = _writable_dir(os.path.dirname(os.path.abspath(path)))
    return f"{named}: cannot write in {os.path.dirname(os.path.abspath(path))}: {why}" if why else None


def parse_overrides(items: list[str]) -> dict:
    """``["train.epochs=3", "optimizer.alpha=0.1"]`` → nested dict (values parsed as TOML)."""
    out: dict = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        key, value = item.split("=", 1)
        section, name = key.strip().split(".", 1)
        out.setdefault(section, {})[name] = parse_value(value)
    return out


def parse_value(text: str):
    """A value given on the command line, parsed as TOML (a bare word is a string)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def merge(base: dict, override: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in override.items():
        if isinstance(values, dict) and isinstance(out.get(section), dict):
            out[section].update(values)
        else:
            out[section] = values
    return out


def load_raw(path: str | None, overrides: list[str]) -> dict:
    """The nested dictionary of a TOML file (optional) with overrides applied (not validated)."""
    raw: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                text = f.read()
            # a byte-order mark (Windows editors write one) is no TOML, but says nothing either
            raw = tomllib.loads(text.decode("utf-8-sig"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(data_file_hint(path, text) or f"{path}: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(data_file_hint(path, text) or
                              f"{path}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    return merge(raw, parse_overrides(overrides))


# What a data file given where a configuration is expected starts with: a compressed stream's or
# Parquet's magic bytes, or a first line that is a row (a label, then features or a VW "|";
_DATA_MAGIC = (b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"BZh", b"\xfd7zXZ", b"PAR1")
# (unlabeled rows too: "| a b", "3:1 7:1"), or a data file's name.
_DATA_ROW = re.compile(rb"\s*(\||\d+:\S|[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?(\s+\S+:\S|\t|\s*\||\s+\S+\s*\|))")
_DATA_SUFFIXES = (".svm", ".libsvm", ".tsv", ".csv", ".vw", ".ffm", ".gz", ".zst", ".bz2", ".xz", ".parquet")


def data_file_hint(path: str, text: bytes) -> str | None:
    """One line for a data file given as the configuration file (``hpcps train data.svm``, as VW
    and LightGBM users type it): the ``--set data.train=`` form to use instead; None for a file
    that does not look like data (its TOML error is then the message)."""
    first = next((line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(b"#")), b"")
    if not (text.startswith(_DATA_MAGIC) or _DATA_ROW.match(first) or path.lower().endswith(_DATA_SUFFIXES)):
        return None
    shown = path if re.fullmatch(r"[\w./+-]+", path) else "'" + json.dumps(path) + "'"
    return (f"{path} looks like a data file, not a TOML configuration: train on it with "
            f"`hpcps train --set data.train={shown}` (data.test and data.predict likewise)")


def _toml_value(where: str, v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return "inf" if v > 0 else "-inf" if v < 0 else "nan"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(where, x) for x in v) + "]"
    raise ConfigError(f"{where}: cannot write {v!r} as TOML")


def to_toml(raw: dict) -> str:
    """A nested dictionary of sections (as :func:`load_raw` returns) as TOML text that
    :func:`load_raw` reads back to the same dictionary."""
    out = []
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of keys")
        out.append(f"[{section}]")
        out += [f"{key} = {_toml_value(f'{section}.{key}', v)}" for key, v in values.items()]
        out.append("")
    return "\n".join(out)


# [features]' keys are defined in hpcps/ps/tables.py (Features, a table's admission and eviction);
# their descriptions are kept here, beside every other key's, for --help-config and the docs.
FEATURES_HELP = {
    "admit_count": "a key gets a row on the servers at its Nth push (1: at once); until then pulls give "
                   "the initializer and pushes only count (1 to 255)",
    "admit_probability": "each push of a key without a row admits it with this probability (a "
                         "deterministic draw per key and clock; in (0, 1])",
    "evict_after_steps": "evict rows not updated in the last T clocks (0: never)",
    "evict_l2_below": "evict rows whose parameters' L2 norm is below x (0: never)",
    "evict_every_steps": "evictions run each time the slowest worker's clock passes a multiple of K",
    "server_memory_mb": "cap on each table's memory on each server: the least recently updated rows are "
                        "evicted, down to 90 %, before a push would pass it (0: unbounded)",
    "count_bits": "push counters for keys not directly addressed (hash_bits > 26): 2^bits bytes, shared by "
                  "hash (10 to 32)",
}
REGISTERED_CHOICES = {("model", "type"), ("data", "format")}  # (user code adds to these: listed in their text)
OPTIMIZER_KEYS_HELP = ("the optimizer's own keys; a key left out takes its default (ftrl's l2 is 10 for fm, ffm, "
                       "wdl and deepfm under the logistic loss, else 0)")


def keys() -> list[tuple[str, str, Any, str]]:
    """Every configuration key but the optimizer's own: (section, key, default, description with its
    allowed values or range), in the order of the sections and their fields."""
    out = []
    for section, cls in {**_SECTION_CLASSES, "optimizer": Optimizer}.items():
        for f in dataclasses.fields(cls):
            if section == "optimizer" and f.name == "params":
                continue
            text = FEATURES_HELP[f.name] if section == "features" else f.metadata["help"]
            if (section, f.name) in CHOICES and (section, f.name) not in REGISTERED_CHOICES:
                text += f"; one of: {', '.join(CHOICES[(section, f.name)])}"
            if (section, f.name) in RANGES:
                text += f"; {describe_range(*RANGES[(section, f.name)])}"
            out.append((section, f.name, f.default, text))
    return out


def help_config() -> str:
    """Every section and key with its default and description, as TOML that can be pasted into a
    configuration file (``hpcps train --help-config``): it reads back to the defaults."""
    lines = ["# hpcps train's configuration: every key with its default. Keep the keys you change;",
             "# a key left out takes its default. `--set section.key=value` overrides a file's.", ""]
    section = None
    for sec, key, default, text in keys():
        if sec != section:
            lines += ([""] if section else []) + [f"[{sec}]"]
            section = sec
        lines += [f"# {line}" for line in textwrap.wrap(text, 96)] + [f"{key} = {_toml_value(f'{sec}.{key}', default)}"]
    lines.append(f"# {OPTIMIZER_KEYS_HELP}:")
    for name, rule in optim.REGISTRY.items():
        lines.append(f"# {name}: " + ", ".join(f"{k} = {_toml_value(k, v)}" for k, v in rule.params.items()))
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The tables of docs/configuration.md: a table per section, every key with its default and
    description."""
    lines, section = [], None
    for sec, key, default, text in keys():
        if sec != section:
            lines += ([""] if section else []) + [f"## [{sec}]", "", "| key | default | meaning |", "|---|---|---|"]
            section = sec
        shown = _toml_value(key, default).replace("|", "\\|")
        lines.append(f"| `{sec}.{key}` | `{shown}` | {text.replace('|', chr(92) + '|')} |")
    lines.append(f"| `optimizer.*` | | {OPTIMIZER_KEYS_HELP}: |")
    for name, rule in optim.REGISTRY.items():
        lines.append(f"| {name} | | " + ", ".join(f"`{k}` {_toml_value(k, v)}" for k, v in rule.params.items()) + " |")
    return "\n".join(lines) + "\n"
