"""Configuration: one validated, frozen object from TOML plus ``--set section.key=value`` overrides.

The keys form a closed set (like ``mpi4py.rc``): an unknown section or key is an error naming it,
and so is a value of the wrong type. Pure: no MPI (the CLI reads the file on one rank and
broadcasts the resulting dictionary).

Sections and keys, with defaults, are the dataclasses below; ``hpcps train --help-config`` prints
them, and the README has the table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from hpcps.outputs import clash
from hpcps.ps.tables import Features
from hpcps_kernels import optim


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


@dataclass(frozen=True)
class Cluster:
    servers: int = 1                 # server ranks (the first ranks of the world)
    worker_groups: int = 0           # worker groups; 0 = one per worker
    staleness: int = 0               # 0 = BSP, s > 0 = SSP, -1 = ASP
    num_shards: int = 1024           # virtual shards (fixed for a model's life)
    stall_warn_s: float = 30.0       # report a request unanswered this long
    stall_timeout_s: float = 300.0   # abort the job when a request is unanswered this long


@dataclass(frozen=True)
class Data:
    train: str = ""                  # training data: a file, a list of files, a glob or a directory of part files,
                                     # plain or gzip/zstd/bzip2/xz; "" = generate (see [synth])
    test: str = ""                   # held-out data for evaluation (the same forms)
    format: str = "auto"             # libsvm | criteo | vw | auto (vw: a "|" in the first line or .vw; criteo: a tab)
    hash_bits: int = 24              # keys are masked to this many bits (Criteo hashes; libsvm indices)
    skip_bad_lines: bool = False     # count and skip malformed lines instead of stopping
    cache_dir: str = ""              # binary cache of parsed data ("" = none; then the part is loaded whole)
    memory_mb: float = 0.0           # 0: keep the parsed training part in memory; > 0: hold at most this
                                     # much parsed data, reading the file again each epoch
    shuffle_rows: int = 0            # > 0: each worker's rows shuffled in windows of this many (0 = file order)
    shuffle_seed: int = 0            # the windows' permutations (the same every epoch)
    parse_thread: bool = False       # parse the part ahead on a thread of its own, not in the steps' waits
    predict: str = ""                # after training, score this data (the same forms) ...
    predict_out: str = ""            # ... into this file, one score per row in input order


@dataclass(frozen=True)
class Synth:
    rows: int = 1_000_000            # training rows generated when data.train is ""
    test_rows: int = 100_000
    fields: int = 39
    interactions: bool = False       # add pairwise field interactions (FM data)
    seed: int = 1
    dir: str = ""                    # where the generated files go ("" = under HPCPS_CACHE_DIR); reused when they match


@dataclass(frozen=True)
class Model:
    type: str = "lr"                 # lr | fm | wdl (wide & deep) | deepfm
    loss: str = "logistic"           # logistic | squared
    factors: int = 8                 # fm: factors per key; wdl, deepfm: the embedding size
    init_scale: float = 0.01         # fm, wdl, deepfm: std of the initial factors/embeddings (lr: zeros)
    seed: int = 0                    # seed of the initializer
    compute: str = "workers"         # "servers": the servers compute margins and gradients
    bias_init: str = "auto"          # auto: the first labels' mean (squared loss) or its log-odds (logistic; lr, fm); zero
    hidden: tuple = (64, 32)         # wdl, deepfm: the MLP's hidden layer sizes
    activation: str = "relu"         # wdl, deepfm: relu | tanh
    fields: int = 0                  # wdl, deepfm: fields per row; 0 = the format's (Criteo 39, libsvm/vw 1)
    dense_optimizer: str = "adam"    # wdl, deepfm: the MLP's optimizer (on the servers' dense table)
    dense_lr: float = 0.0            # wdl, deepfm: its learning rate; 0 = 0.001 per 1000 rows a step (models.dense_lr_for)
    dense_sync_steps: int = 1        # wdl, deepfm: worker groups pull the MLP every k steps


@dataclass(frozen=True)
class Optimizer:
    name: str = "ftrl"               # sgd | adagrad | ftrl | adam
    params: dict = field(default_factory=dict)  # the optimizer's own keys: [optimizer] lr = ...


@dataclass(frozen=True)
class Train:
    epochs: int = 2
    batch_size: int = 0              # rows per worker per step (0 = auto: see AUTO_BATCH)
    gradient: str = "sum"            # sum | mean of the rows' gradients per key in a step
    aggregate: bool = True           # merge a worker group's pushes before sending
    eval_every: int = 0              # steps between evaluations (0 = at the end of each epoch)
    metrics: str = ""                # JSON-lines metrics file ("" = none)
    progress: bool = True            # progress bar on the first worker
    model_out: str = ""              # write the trained model (HDF5) here
    holdout: int = 0                 # hold out every Nth row of each worker's part from training (0 = none)
    early_stop: int = 0              # stop after N epochs without a better holdout loss, keeping the best model
    pull_early: bool = False         # SSP/ASP: pull the rows of the batch after the next with each step (overlap)


@dataclass(frozen=True)
class Checkpoint:
    dir: str = ""                    # where checkpoints go ("" = none)
    every_steps: int = 0             # checkpoint every N steps (0 = off)
    every_s: float = 0.0             # checkpoint every T seconds (0 = off)
    keep: int = 3                    # complete checkpoints kept
    on_signal: str = "exit"          # after a SIGUSR1/SIGTERM checkpoint: exit (status 75) | continue
    final: bool = True               # checkpoint at the end of training
    resume: str = ""                 # "" = start fresh | auto = newest good checkpoint in dir | a path
    allow_other_data: bool = False   # resume even if the training file, batch size or workers changed
    existing: str = "error"          # a fresh run into a dir holding another run's checkpoints: error | replace (move them aside)


@dataclass(frozen=True)
class Config:
    cluster: Cluster = field(default_factory=Cluster)
    data: Data = field(default_factory=Data)
    synth: Synth = field(default_factory=Synth)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    train: Train = field(default_factory=Train)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    features: Features = field(default_factory=Features)

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
    return [f"{k} was {a.get(k, 'unset')}, now {b.get(k, 'unset')}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_CLASSES = {"cluster": Cluster, "data": Data, "synth": Synth, "model": Model, "train": Train,
                    "checkpoint": Checkpoint, "features": Features}


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


BUILT_IN_MODELS = ("lr", "fm", "wdl", "deepfm")
CHOICES = {  # the keys whose values are names; models and data formats registered from user code add theirs
    ("data", "format"): ("auto", "libsvm", "criteo", "vw", "libffm"),
    ("model", "type"): BUILT_IN_MODELS,
    ("model", "activation"): ("relu", "tanh"),
    ("model", "loss"): ("logistic", "squared"),
    ("model", "compute"): ("workers", "servers"),
    ("model", "bias_init"): ("auto", "zero"),
    ("train", "gradient"): ("sum", "mean"),
    ("checkpoint", "on_signal"): ("exit", "continue"),
    ("checkpoint", "existing"): ("error", "replace"),
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
    if name == "ftrl" and "l2" not in params and model.type in ("fm", *DEEP) and model.loss == "logistic":
        params["l2"] = FACTOR_FTRL_L2  # (a default: written out as if set, so checkpoints and tune's best.toml keep it)
    sections["optimizer"] = Optimizer(name, params)
    cfg = Config(**sections)
    _check(cfg)
    return cfg


DEEP = ("wdl", "deepfm")  # models with embeddings and an MLP
# FTRL's default l2 for the models with factors or embeddings (fm, wdl, deepfm) under the logistic
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
    ("cluster", "num_shards"): (1, 1 << 24, False),
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
}


def describe_range(lo, hi, lo_open) -> str:
    """A key's range in words (``lo_open``: ``lo`` itself is out of it)."""
    if hi == INF:
        return f"{'greater than' if lo_open else 'at least'} {lo:g}"
    return f"between {lo:g} and {hi:g}"


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
    if cfg.train.holdout == 1:
        raise ConfigError("train.holdout = 1 would hold out every row; use 0 (none) or N >= 2 (every Nth row, "
                          "e.g. 10 as Vowpal Wabbit does)")
    if cfg.train.early_stop and not cfg.train.holdout:
        raise ConfigError("train.early_stop needs a holdout to watch: set train.holdout (e.g. 10: every 10th row)")
    if cfg.model.compute == "servers" and cfg.cluster.worker_groups:
        raise ConfigError("model.compute = 'servers' needs one worker per group (cluster.worker_groups = 0): "
                          "each worker's rows go to the servers, there is no group merge")
    if cfg.train.pull_early and cfg.model.compute == "servers":
        raise ConfigError("train.pull_early is for model.compute = 'workers' (the servers' computation pulls nothing)")
    if cfg.model.compute == "servers" and cfg.model.type not in BUILT_IN_MODELS:
        raise ConfigError(f"model.compute = 'servers' is for lr and fm; a registered model ({cfg.model.type}) "
                          f"computes on the workers")
    if cfg.model.type in DEEP:
        if cfg.model.compute == "servers":
            raise ConfigError(f"model.compute = 'servers' is for lr and fm; a {cfg.model.type}'s MLP runs on the workers")
        if cfg.data.hash_bits > 48:
            raise ConfigError(f"data.hash_bits must be at most 48 for a {cfg.model.type} (a key carries its field "
                              f"above the hash bits; got {cfg.data.hash_bits})")
        if cfg.model.dense_optimizer not in optim.REGISTRY:
            raise ConfigError(f"model.dense_optimizer = {cfg.model.dense_optimizer!r}: expected one of "
                              f"{sorted(optim.REGISTRY)}")
        if "lr" not in optim.get(cfg.model.dense_optimizer).params:
            raise ConfigError(f"model.dense_optimizer = {cfg.model.dense_optimizer!r} takes no learning rate "
                              f"(model.dense_lr); use adam, adagrad or sgd")
    if cfg.model.type in ("fm", *DEEP) and cfg.model.init_scale <= 0:
        raise ConfigError("model.init_scale must be greater than 0 for an fm (factors that all start at 0 "
                          "never move)")
    if bool(cfg.data.predict) != bool(cfg.data.predict_out):
        raise ConfigError("data.predict and data.predict_out go together")
    if cfg.checkpoint.resume and not cfg.checkpoint.dir and cfg.checkpoint.resume == "auto":
        raise ConfigError("checkpoint.resume = 'auto' needs checkpoint.dir")


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
        if path:
            if os.path.isdir(path):
                return f"{key} = {path!r} is a directory, not a file"
            why = _writable_dir(os.path.dirname(os.path.abspath(path)))
            if why:
                return f"{key} = {path!r}: cannot write in {os.path.dirname(os.path.abspath(path))}: {why}"
    return None


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
            raise ConfigError(f"{path}: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    return merge(raw, parse_overrides(overrides))


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


def describe() -> str:
    """Every section and key with its default, for --help-config."""
    lines = []
    for name, cls in _SECTION_CLASSES.items():
        lines.append(f"[{name}]")
        for f in dataclasses.fields(cls):
            lines.append(f"  {f.name} = {f.default!r}")
    lines.append("[optimizer]\n  name = 'ftrl'")
    for opt, rule in optim.REGISTRY.items():
        lines.append(f"  ({opt}: " + ", ".join(f"{k} = {v}" for k, v in rule.params.items()) + ")")
    return "\n".join(lines)
