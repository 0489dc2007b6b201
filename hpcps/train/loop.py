"""The training loop: read batch → unique keys → pull → forward/backward → push → clock.

Run on every rank (collective). Servers serve; workers each read their own byte range of the
training file and step through it in batches of ``train.batch_size`` rows for ``train.epochs``.
All workers take the same number of steps per epoch (the largest of their batch counts; a worker
out of rows takes empty steps), so worker groups and clocks stay in step. The gradient of a step
is the sum over the worker group's rows (``train.gradient = "sum"``) or their mean.

Evaluation (logloss and AUC, or RMSE for the squared loss) runs on the held-out file's parts on
every worker; the margins are gathered on the first worker, which computes the exact metrics.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time

import numpy as np

from hpcps import transport
from hpcps.context import init
from hpcps.train import data as tdata
from hpcps.train import model_file, synth
from hpcps.train.models import make_model
from hpcps.train.progress import Progress, summary_table
from hpcps_kernels import metrics


class TrainError(RuntimeError):
    """A failure every rank agreed on (bad data, missing file): each rank raises the same message."""


def resolve_data(cfg, comm) -> tuple[dict, dict | None]:
    """Collective: the data files to use. With no ``data.train``, the first rank generates a
    synthetic data set (``[synth]``) and every rank gets its paths and known best metrics."""
    paths = {"train": cfg.data.train, "test": cfg.data.test}
    if cfg.data.train:
        return paths, None
    info = None
    if comm.Get_rank() == 0:
        out = cfg.synth.dir or tempfile.mkdtemp(prefix="hpcps-synth-")
        s = synth.generate(out, cfg.synth.rows, cfg.synth.test_rows, cfg.synth.fields, cfg.synth.interactions,
                           cfg.synth.seed, cfg.data.hash_bits, formats=("libsvm",))
        info = {"train": s.files["train_libsvm"], "test": s.files["test_libsvm"],
                "best_test_logloss": float(s.best_test_logloss), "best_test_auc": float(s.best_test_auc),
                "dir": out}
    transport.barrier(comm, timeout=cfg.cluster.stall_timeout_s, what="synthetic data generation")
    info = comm.bcast(info, root=0)  # small control data
    return {"train": info["train"], "test": info["test"]}, info


def _load(ctx, cfg, path: str, what: str) -> tdata.Dataset | None:
    """Collective over the world: workers load their part of ``path``; any error is raised on
    every rank with every failing rank's message."""
    ds, error = None, None
    if ctx.is_worker and path:
        try:
            ds = tdata.load_part(path, ctx.worker_index, ctx.layout.workers, cfg.data.format,
                                 cfg.data.hash_bits, cfg.data.skip_bad_lines, cfg.data.cache_dir)
            if ds.rows == 0:
                error = (f"{what} file {path}: this worker's byte range holds no rows "
                         f"({ctx.layout.workers} workers for a file of {os.path.getsize(path)} bytes); "
                         f"use fewer workers or more data")
        except (tdata.DataError, OSError) as e:
            error = str(e)
    errors = transport.all_ok(ctx.comm, error, ctx.stall_timeout_s, f"loading of {what} data")
    if errors:
        raise TrainError("cannot load data:\n  " + "\n  ".join(errors))
    return ds


def _gather_on_first(ctx, array: np.ndarray) -> np.ndarray | None:
    comm = ctx.workers_comm
    t = ctx.stall_timeout_s
    counts = transport.allgather_int(comm, array.shape[0], t, "gather of evaluation sizes")
    return transport.gatherv(comm, np.ascontiguousarray(array), counts, 0, t, "gather of evaluation results")


def evaluate(ctx, model, ds: tdata.Dataset | None, batch_size: int, loss: str) -> dict:
    """Collective over the workers: exact metrics of the whole held-out set (on every worker)."""
    n = ds.rows if ds is not None else 0
    margins = np.concatenate([model.margins(ds.batch(lo, lo + batch_size)) for lo in range(0, n, batch_size)] or
                             [np.zeros(0)])
    labels = ds.labels[:n].astype(np.float64) if ds is not None else np.zeros(0)
    all_m = _gather_on_first(ctx, margins)
    all_y = _gather_on_first(ctx, labels)
    out = np.zeros(3)
    if ctx.workers_comm.Get_rank() == 0 and all_m.size:
        if loss == "logistic":
            out[:] = (metrics.logloss(all_y, all_m), metrics.auc(all_y, all_m), all_m.size)
        else:
            out[:] = (float(np.sqrt(np.mean((all_m - all_y) ** 2))), np.nan, all_m.size)
    transport.bcast(ctx.workers_comm, out, 0, ctx.stall_timeout_s, "broadcast of metrics")
    if loss == "logistic":
        return {"test_logloss": float(out[0]), "test_auc": float(out[1]), "test_rows": int(out[2])}
    return {"test_rmse": float(out[0]), "test_rows": int(out[2])}


def predict(ctx, model, ds: tdata.Dataset, batch_size: int, loss: str, out_path: str) -> int:
    """Collective over the workers: one score per row of every worker's part, in input order,
    written by the first worker. Returns the number of scores written."""
    margins = np.concatenate([model.margins(ds.batch(lo, lo + batch_size)) for lo in range(0, ds.rows, batch_size)]
                             or [np.zeros(0)])
    scores = 1.0 / (1.0 + np.exp(-margins)) if loss == "logistic" else margins
    everything = _gather_on_first(ctx, scores)
    if ctx.workers_comm.Get_rank() == 0:
        write_scores(out_path, everything)
        return everything.size
    return 0


def write_scores(path: str, scores: np.ndarray) -> None:
    tmp = path + ".tmp"
    np.savetxt(tmp, scores, fmt="%.6f")
    os.replace(tmp, path)


def run(cfg, comm=None) -> dict | None:
    """Train as configured (collective over ``comm``, default the world). Returns the summary on the
    first worker, None elsewhere."""
    world = comm or transport.world()
    paths, synth_info = resolve_data(cfg, world)
    cl = cfg.cluster
    ctx = init(servers=cl.servers, worker_groups=cl.worker_groups or None, staleness=cl.staleness,
               num_shards=cl.num_shards, stall_warn_s=cl.stall_warn_s, stall_timeout_s=cl.stall_timeout_s,
               comm=world)
    model = make_model(ctx, cfg)
    train = _load(ctx, cfg, paths["train"], "training")
    test = _load(ctx, cfg, paths["test"], "test")
    to_predict = _load(ctx, cfg, cfg.data.predict, "prediction")
    if ctx.is_server:
        ctx.serve()
        if cfg.train.model_out:
            model_file.export_from_servers(ctx, model.table.name, cfg.train.model_out,
                                           {"model": cfg.model.type, "loss": cfg.model.loss,
                                            "config": json.dumps(cfg.to_dict())})
        ctx.finalize()
        return None

    tr = cfg.train
    wcomm = ctx.workers_comm
    first = wcomm.Get_rank() == 0
    steps = int(transport.allreduce(wcomm, np.array([math.ceil(train.rows / tr.batch_size)]), "max",
                                    ctx.stall_timeout_s, "agreement on steps per epoch")[0])
    skipped = int(transport.allreduce(wcomm, np.array([train.skipped + (test.skipped if test else 0)]), "sum",
                                      ctx.stall_timeout_s)[0])
    # "sum": each row's gradient counts in full (per-coordinate optimizers like FTRL and AdaGrad
    # set their own step sizes, and a mean would shrink rare keys' gradients by the batch size);
    # "mean": the gradient of the mean loss over the group's rows (the objective of plain SGD).
    scale = 1.0 if tr.gradient == "sum" else 1.0 / (tr.batch_size * ctx.group_comm.Get_size())
    progress = Progress(first and tr.progress, steps, ctx.layout.workers, tr.metrics)
    if first:
        print(f"hpcps train: {ctx.layout.describe()}; {cfg.model.type} with {cfg.optimizer.name}, "
              f"staleness {cl.staleness}; {train.rows} rows on this worker, {steps} steps/epoch"
              + (f"; {skipped} bad lines skipped" if skipped else ""), flush=True)
    t0 = time.perf_counter()
    history = []
    examples = 0
    for epoch in range(1, tr.epochs + 1):
        loss_sum, rows = 0.0, 0
        for step in range(1, steps + 1):
            batch = train.batch((step - 1) * tr.batch_size, step * tr.batch_size)
            loss = model.step(batch, scale)
            ctx.clock()
            loss_sum += loss
            rows += batch.rows
            progress.step(epoch, step, batch.rows, loss, ctx.stats["wait_s"], ctx.stats["max_staleness"])
            if tr.eval_every and test is not None and step % tr.eval_every == 0 and step != steps:
                progress.epoch_end(epoch, {"step": step, **evaluate(ctx, model, test, tr.batch_size, cfg.model.loss)})
        model.finish()
        examples += int(transport.allreduce(wcomm, np.array([rows]), "sum", ctx.stall_timeout_s)[0])
        total_loss = float(transport.allreduce(wcomm, np.array([loss_sum]), "sum", ctx.stall_timeout_s)[0])
        record = {"train_loss": total_loss / max(examples / epoch, 1), "time_s": time.perf_counter() - t0}
        if test is not None:
            record.update(evaluate(ctx, model, test, tr.batch_size, cfg.model.loss))
        history.append(record)
        progress.epoch_end(epoch, record)
    elapsed = time.perf_counter() - t0
    predicted = 0
    if to_predict is not None:
        predicted = predict(ctx, model, to_predict, tr.batch_size, cfg.model.loss, cfg.data.predict_out)
    progress.close()
    wait = float(transport.allreduce(wcomm, np.array([ctx.stats["wait_s"]]), "max", ctx.stall_timeout_s)[0])
    ctx.finalize()
    if not first:
        return None
    summary = {"examples": examples, "time_s": elapsed, "examples_per_s": examples / elapsed,
               "workers": ctx.layout.workers, "servers": ctx.layout.servers, **history[-1],
               "max_wait_s": wait, "max_staleness": ctx.stats["max_staleness"], "bad_lines_skipped": skipped}
    if synth_info:
        summary["best_test_logloss"] = synth_info["best_test_logloss"]
        summary["best_test_auc"] = synth_info["best_test_auc"]
    if predicted:
        summary["predictions"] = predicted
    rows = [("examples", f"{examples:,}"), ("time", f"{elapsed:.1f} s"),
            ("examples/s", f"{examples / elapsed:,.0f}"),
            ("layout", f"{ctx.layout.servers} server(s), {ctx.layout.workers} worker(s)"),
            ("waiting (max over workers)", f"{wait:.1f} s")]
    for k in ("train_loss", "test_logloss", "test_auc", "test_rmse"):
        if k in summary:
            rows.append((k.replace("_", " "), f"{summary[k]:.5f}"))
    if synth_info:
        rows.append(("best achievable logloss", f"{synth_info['best_test_logloss']:.5f}"))
        rows.append(("best achievable AUC", f"{synth_info['best_test_auc']:.5f}"))
    print(summary_table(rows), flush=True)
    return summary
