"""``hpcps tune``: a grid of hyper-parameters trained at once, as several tables on the same servers.

    mpiexec -n 3 hpcps tune run.toml --grid optimizer.alpha=0.03,0.1,0.3 --grid optimizer.l2=0,1 --out best.toml

Every point of the grid is a member of one :class:`~hpcps.train.models.Grid`: its own tables (its
own optimizer and hyper-parameters), pulled and pushed with the others' in the same requests, so one
pass over the data trains them all. Rows held out of training (``train.holdout``, every 10th row
unless set) score every member after every epoch; a member stops improving when its holdout loss
has not improved for ``train.early_stop`` epochs (2 unless set), and training ends when every
member has stopped or after ``train.epochs`` (10 unless set). The ranked table goes to the terminal
and the best member's configuration, with ``train.epochs`` set to its best epoch, to ``--out``:
``hpcps train --config best.toml`` trains that member's model again (the same holdout rows), and
without ``train.holdout`` it trains on every row.

On a small data set a tenth of the rows is a noisy judge (300 held-out rows rank members 0.002 apart
by chance), so the grid is trained again with other phases of ``train.holdout`` held out, as
cross-validation folds (``--folds``; auto: about as many as it takes for 20,000 held-out rows in
all, all ten phases up to 20,000 rows, one pass from about 135,000), ranked by the mean holdout loss.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import sys
import time
from dataclasses import replace


from hpcps import config, outputs
from hpcps.ps.collectives import World
from hpcps.train.early_stop import EarlyStopping
from hpcps.train.evaluation import evaluate_columns
from hpcps.train.loop import Result, Trainer
from hpcps.train.models import Grid
from hpcps.train.progress import summary_table

# the keys a grid may vary: the optimizer's (any of them) and these
GRID_KEYS = ("model.type", "model.factors", "model.init_scale", "model.dense_lr")
MAX_MEMBERS = 64
TUNE_DEFAULTS = {"holdout": 10, "early_stop": 2, "epochs": 10}
EVAL_ROWS = 20_000  # --folds auto: about enough folds for this many held-out rows in all


def parse_grid(items: list[str]) -> list[tuple[str, list]]:
    """``["optimizer.alpha=0.03,0.1", ...]`` → ``[("optimizer.alpha", [0.03, 0.1]), ...]`` (values
    as TOML would read them). Raises ConfigError naming the key."""
    grid = []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not values.strip():
            raise config.ConfigError(f"--grid {item!r}: expected key=value1,value2,...")
        if not (key.startswith("optimizer.") or key in GRID_KEYS):
            raise config.ConfigError(f"--grid {key}: a grid varies optimizer.* or one of {list(GRID_KEYS)}")
        if any(k == key for k, _ in grid):
            raise config.ConfigError(f"--grid {key} is given twice")
        grid.append((key, [config.parse_value(v.strip()) for v in values.split(",")]))
    if not grid:
        raise config.ConfigError("hpcps tune needs at least one --grid key=value1,value2,...")
    size = math.prod(len(v) for _, v in grid)
    if size > MAX_MEMBERS:
        raise config.ConfigError(f"the grid has {size} points; at most {MAX_MEMBERS} train at once")
    return grid


IGNORED = (("train", "model_out"), ("data", "predict"), ("data", "predict_out"), ("checkpoint", "dir"),
           ("checkpoint", "resume"))  # keys of a training run that a tune has no use for


def member_raws(raw: dict, grid: list[tuple[str, list]]) -> list[tuple[dict, dict]]:
    """The raw configuration of every point of the grid, with the tune defaults where ``raw``
    does not set them: ``(point, raw)`` pairs, each validated (a bad value names its key)."""
    base = copy.deepcopy(raw)
    train = base.setdefault("train", {})
    for key, value in TUNE_DEFAULTS.items():
        train.setdefault(key, value)
    ignored = [f"{section}.{key}" for section, key in IGNORED if base.get(section, {}).pop(key, None)]
    if ignored:  # (a tune writes a configuration, not models, predictions or checkpoints)
        print(f"hpcps tune: ignoring {', '.join(ignored)}: a tune writes the best configuration (--out), not "
              f"models, predictions or checkpoints", file=sys.stderr, flush=True)
    if not train["holdout"]:
        raise config.ConfigError("train.holdout = 0: hpcps tune ranks the grid on held-out rows; set train.holdout "
                                 "(10 unless set: every 10th row)")
    out = []
    for values in itertools.product(*(v for _, v in grid)):
        point = dict(zip((k for k, _ in grid), values))
        r = copy.deepcopy(base)
        for key, value in point.items():
            section, name = key.split(".", 1)
            r.setdefault(section, {})[name] = value
        try:
            cfg = config.from_dict(r)
        except config.ConfigError as e:
            raise config.ConfigError(f"grid point {_describe(point)}: {e}") from None
        out.append((point, r, cfg.model.type in config.FIELDED))
    if len({deep for _, _, deep in out}) > 1:
        raise config.ConfigError("--grid model.type: a grid's models are all lr/fm or all wdl/deepfm/ffm "
                                 "(these read each row's fields)")
    return [(point, r) for point, r, _ in out]


def _describe(point: dict) -> str:
    return ", ".join(f"{k.split('.', 1)[1] if k.startswith('optimizer.') else k}={v}" for k, v in point.items())


class GridEarlyStopping(EarlyStopping):
    """Early stopping of each member of a grid: the holdout scores every member each epoch
    (``evaluate_members(ds)``), a member stops when its holdout loss has not improved for
    ``train.early_stop`` epochs, and training when every member has stopped. ``test_metrics()``:
    every member's metrics on the test set this epoch (empty dicts without one)."""

    def __init__(self, ctx, cfg, members: int, evaluate_members, test_metrics):
        super().__init__(ctx, cfg)
        self.member_best = [{"loss": math.inf, "epoch": 0, "test": {}} for _ in range(members)]
        self.member_stopped = [0] * members
        self.evaluate_members, self.test_metrics = evaluate_members, test_metrics

    def watch(self, epoch: int, record: dict, evaluate, model, first: bool) -> bool:
        name, n = self.metric, len(self.member_best)
        got = self.evaluate_members(self.holdout)
        for i, (g, t) in enumerate(zip(got, self.test_metrics())):
            best = self.member_best[i]
            if self.member_stopped[i]:
                continue
            if g[f"test_{name}"] < best["loss"]:
                best.update(loss=g[f"test_{name}"], epoch=epoch, test=t)
            elif self.patience and epoch - best["epoch"] >= self.patience:
                self.member_stopped[i] = epoch
        leader = min(range(n), key=lambda i: self.member_best[i]["loss"])
        record[f"holdout_{name}"] = got[leader][f"test_{name}"]
        record["members_stopped"] = sum(1 for s in self.member_stopped if s)
        return all(self.member_stopped)

    def restore_best(self, last_epoch: int, model, workers) -> bool:
        """Nothing to restore: a tune reports configurations, not a model."""
        return False

    def ranking(self, points: list[dict]) -> list[dict]:
        """The members (their grid ``points``) from the best holdout loss to the worst."""
        name = self.metric
        rows = [{**points[i], f"holdout_{name}": b["loss"], "best_epoch": b["epoch"],
                 **{k: v for k, v in b["test"].items() if k != "test_rows"}, "member": i}
                for i, b in enumerate(self.member_best)]
        return sorted(rows, key=lambda r: r[f"holdout_{name}"])


class Tuner(Trainer):
    """A :class:`~hpcps.train.loop.Trainer` whose model is a Grid: the holdout scores every member
    each epoch, each member has its own early stopping, and the report ranks them."""

    NO_CHECKPOINT = "hpcps tune writes no checkpoints"
    check_finite = False  # a member that diverges is ranked last, not the end of the others

    def __init__(self, members: list[tuple[dict, dict]], comm=None, fold: int = 0, folds: int | None = 1):
        self.points = [p for p, _ in members]
        self.raws = [r for _, r in members]
        self.cfgs = [config.from_dict(r) for r in self.raws]
        super().__init__(self.cfgs[0], comm)
        self.fold, self.folds = fold, folds
        self.holdout_phase = -1 - fold  # fold 0: the rows hpcps train holds out
        self.test_metrics: list[dict] = []  # every member's on the test set, this epoch

    def agree_on_plan(self) -> None:
        super().agree_on_plan()
        rows = self.cfg.train.batch_size  # (resolved)
        self.cfgs = [replace(c, train=replace(c.train, batch_size=rows)) for c in self.cfgs]
        if self.fold:  # the test set is scored in the first fold only (the rows best.toml holds out)
            self.plan = replace(self.plan, paths={**self.plan.paths, "test": ""})

    def build_model(self, bias: float, fields: int):
        return Grid(self.ctx, self.cfgs, bias, fields)

    def early_stopping(self) -> EarlyStopping:
        n = len(self.cfgs)
        return GridEarlyStopping(self.ctx, self.cfg, n, self.evaluate_members,
                                 lambda: self.test_metrics if self.test is not None else [{}] * n)

    def evaluate_members(self, ds) -> list[dict]:
        """Collective over the workers: every member's metrics on ``ds``."""
        grid, pipeline = self.model, self.pipeline
        return evaluate_columns(self.ctx, pipeline, lambda b: grid.member_margins(b, *pipeline.pull_rows(b)),
                                len(self.cfgs), ds, self.cfg.train.batch_size, self.cfg.model.loss)

    def train_step(self, batch, upcoming) -> float:
        """The members' mean loss of the step."""
        before = self.model.member_loss.sum()
        self.pipeline.step(batch, self.scale, upcoming)
        return float(self.model.member_loss.sum() - before) / len(self.model.members)

    def evaluate(self, ds) -> dict:
        """The first member's metrics (the epoch's record); every member's on the test set are
        kept for the members' early stopping."""
        got = self.evaluate_members(ds)
        if ds is self.test:
            self.test_metrics = got
        return got[0]

    def plan_steps(self) -> None:
        super().plan_steps()
        if self.workers.is_first and self.folds != 1:
            print(f"hpcps tune: fold {self.fold + 1}{f' of {self.folds}' if self.folds else ''}: holding out "
                  f"the rows r with r % {self.cfg.train.holdout} == {self.holdout_phase % self.cfg.train.holdout}",
                  flush=True)

    def report(self, summary: dict, elapsed: float, wait: float, key_counts: dict) -> None:
        """The fold's ranking into the summary; :func:`run` reports the folds together."""
        summary["ranking"] = self.early.ranking(self.points)
        summary["holdout_rows"] = self.early.holdout_rows


def auto_folds(holdout_rows: int, holdout: int) -> int:
    """``--folds auto``: about as many of the ``holdout`` phases as it takes to score the grid on
    :data:`EVAL_ROWS` held-out rows in all (the nearest count: every phase for a small set, one
    from about ``EVAL_ROWS`` held-out rows a phase)."""
    return max(1, min(holdout, round(EVAL_ROWS / max(holdout_rows, 1))))


def combine(rankings: list[list[dict]], name: str) -> list[dict]:
    """Every member's rows from each fold → one row a member: the mean holdout loss (and the
    per-fold values), the median best epoch, the first fold's test metrics; sorted by the mean."""
    key = f"holdout_{name}"
    by_member = [sorted(r, key=lambda row: row["member"]) for r in rankings]
    out = []
    for rows in zip(*by_member):
        row = dict(rows[0])  # the test metrics: the first fold's (only it scores the test set)
        row[key] = sum(r[key] for r in rows) / len(rows)
        row[f"{key}_folds"] = [r[key] for r in rows]
        row["best_epoch"] = max(1, round(statistics.median(r["best_epoch"] for r in rows)))
        row["best_epoch_folds"] = [r["best_epoch"] for r in rows]
        out.append(row)
    return sorted(out, key=lambda r: r[key])


def run(members: list[tuple[dict, dict]], out: str = "", comm=None, folds: int | str = "auto") -> Result:
    """``hpcps tune`` (collective over ``comm``): the grid trained once per fold, each fold holding
    out another phase of ``train.holdout`` (fold 0 the rows ``hpcps train`` holds out), ranked by
    the mean holdout loss over the folds; the ranked table is printed and the best configuration
    written on the first worker. ``folds="auto"`` decides after the first fold (:func:`auto_folds`)."""
    cfg = config.from_dict(members[0][1])
    holdout = cfg.train.holdout
    if folds != "auto" and not 1 <= int(folds) <= holdout:
        raise config.ConfigError(f"--folds {folds}: between 1 and train.holdout ({holdout}) "
                                 f"(each fold holds out one phase of every {holdout}th row)")
    world = World(comm, cfg.cluster.stall_timeout_s)
    summaries, total, fold, t0 = [], None if folds == "auto" else int(folds), 0, time.perf_counter()
    while total is None or fold < total:
        tuner = Tuner(members, comm=world.comm, fold=fold, folds=total)
        result = tuner.run()
        if result.preempted:
            return result
        summaries.append(result.summary)
        if total is None:  # every rank learns the holdout's size from the first worker
            rows = world.largest(tuner.early.holdout_rows, "agreement on the number of folds")
            total = auto_folds(rows, holdout)
        fold += 1
    if summaries[0] is None:  # not the first worker
        return Result(None, 0)
    elapsed = time.perf_counter() - t0
    summary = dict(summaries[0])  # the first fold's record: its test metrics (the others score none)
    summary["examples"] = sum(s["examples"] for s in summaries)
    summary["time_s"], summary["examples_per_s"] = elapsed, summary["examples"] / elapsed
    summary["folds"] = total
    summary["ranking"] = combine([s["ranking"] for s in summaries], tuner.early.metric) if total > 1 \
        else summaries[0]["ranking"]
    summary["holdout_rows"] = sum(s["holdout_rows"] for s in summaries)
    report(summary, tuner, out, elapsed)
    return Result(summary, 0)


def report(summary: dict, tuner: Tuner, out: str, elapsed: float) -> None:
    """The ranked table on the terminal, the best configuration into ``summary`` and ``out``."""
    ranked, name, holdout, folds = summary["ranking"], tuner.early.metric, tuner.cfg.train.holdout, summary["folds"]
    keys = list(tuner.points[0])
    test = any(f"test_{name}" in r for r in ranked)
    head = ["rank", *keys, "best epoch", f"holdout {name}"] + ([f"test {name}"] if test else [])
    lines = [head]
    for rank, r in enumerate(ranked, 1):
        lines.append([str(rank), *(f"{r[k]}" for k in keys), str(r["best_epoch"]), f"{r[f'holdout_{name}']:.5f}"]
                     + ([f"{r.get(f'test_{name}', float('nan')):.5f}"] if test else []))
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    how = (f"holdout: every {holdout}th row" if folds == 1 else
           f"{folds} folds, each holding out another phase of every {holdout}th row: {summary['holdout_rows']:,} "
           f"held-out rows in all; the mean over the folds, the median best epoch, the first fold's test")
    print(f"hpcps tune: {len(ranked)} models in {'one pass' if folds == 1 else f'{folds} passes'} over the data, "
          f"{summary['examples']:,} examples in {elapsed:.1f} s ({how})", flush=True)
    print("\n".join("  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in lines), flush=True)
    best = ranked[0]
    raw = copy.deepcopy(tuner.raws[best["member"]])
    raw["train"]["epochs"] = best["best_epoch"] or 1
    summary["best_config"] = raw
    if out:  # (replaced whole: hpcps.outputs.replacing)
        outputs.write_text(out, f"# hpcps tune: the best of {len(ranked)} ({_describe(tuner.points[best['member']])}), "
                                f"holdout {name} {best[f'holdout_{name}']:.5f} after {best['best_epoch']} epochs"
                                f"{'' if folds == 1 else f' (the mean and median over {folds} folds)'}.\n"
                                f"# Without [train] holdout it trains on every row.\n" + config.to_toml(raw))
        print(f"hpcps tune: the best configuration is in {out}; train it with hpcps train {out}", flush=True)
    print(summary_table([("best", _describe(tuner.points[best["member"]])),
                         ("best epoch", str(best["best_epoch"])),
                         (f"holdout {name}", f"{best[f'holdout_{name}']:.5f}")]), flush=True)
