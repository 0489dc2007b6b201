"""``hpcps plot METRICS.jsonl [MORE.jsonl ...] -o run.png``: training runs side by side.

Reads the JSON lines ``train.metrics`` writes (a record per step and per epoch) and draws, over
the global step, one panel each for the training loss (a running mean of the steps' losses) with
the test metric at each evaluation, the examples/s, and the share of the time the workers waited.
matplotlib is an optional extra (``pip install hpcps[plot]``).
"""

from __future__ import annotations

import json
import os

from hpcps import outputs


STEP_KEYS = ("loss", "examples_per_s", "wait_s", "time_s")  # what a step's record must hold to be drawn


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_metrics(path: str, note=None) -> tuple[list[dict], list[dict]]:
    """(step records, evaluation records with the global step they follow). A line that is not
    a record of hpcps metrics is a ValueError naming the file and line; an unfinished last line
    (a run still writing the file) is skipped, and ``note(message)`` says so."""
    from hpcps.train.data import check_file

    check_file(path, "metrics")  # (a FIFO would wait for a writer for ever)
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    unfinished = lines.pop()  # b"" when the file ends with a line end
    steps, evals = [], []
    for n, line in enumerate(lines + [unfinished], 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            if n > len(lines):  # the last line, not ended yet
                if note:
                    note(f"{path}:{n}: its last line is unfinished (a run still writing it?): skipped")
                break
            raise ValueError(f"{path}:{n}: not a JSON line of hpcps metrics") from None
        if not isinstance(r, dict):
            raise ValueError(f"{path}:{n}: not a record of hpcps metrics (a JSON object with a \"kind\")")
        if r.get("kind") == "step":
            bad = [k for k in STEP_KEYS if not (_number(r.get(k)) or (k == "loss" and r.get(k, 0) is None))]
            if bad:
                raise ValueError(f"{path}:{n}: a step record without a number for {', '.join(map(repr, bad))}: "
                                 f"not hpcps metrics as train.metrics writes them")
            steps.append(r)
        elif r.get("kind") == "epoch":
            evals.append({**r, "global_step": len(steps)})
    if not steps:
        raise ValueError(f"{path}: no step records (write them with train.metrics = \"{path}\")")
    return steps, evals


def _running(values: list, weight: float = 0.98) -> list:
    out, m = [], None
    for v in values:
        if v is not None:
            m = v if m is None else weight * m + (1 - weight) * v
        out.append(m)
    return out


def plot(paths: list[str], out: str, labels: list[str] | None = None, note=None) -> str:
    """Draw the runs of the metrics files ``paths`` into ``out`` (replaced whole; never one of the
    metrics files: an OutputError, status 2). ``labels``: one a file, or none. ``note(message)``:
    see :func:`read_metrics`."""
    problem = outputs.clash([("-o", out)], [(f"metrics file {i + 1}", p) for i, p in enumerate(paths)])
    if problem:
        raise outputs.OutputError(problem, 2)
    if labels and len(labels) != len(paths):
        raise ValueError(f"{len(labels)} --label for {len(paths)} metrics files: give one a file, in order "
                         f"(or none: the files' names)")
    runs = [read_metrics(p, note) for p in paths]  # (all read, and checked, before drawing)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("hpcps plot needs matplotlib: pip install 'hpcps[plot]' (or matplotlib)") from None
    fig, (ax_loss, ax_rate, ax_wait) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for i, (path, (steps, evals)) in enumerate(zip(paths, runs)):
        name = labels[i] if labels else os.path.basename(path)
        x = list(range(1, len(steps) + 1))
        line, = ax_loss.plot(x, _running([s.get("loss") for s in steps]), label=f"{name}: training loss")
        for key in ("test_logloss", "test_rmse"):
            pts = [(e["global_step"], e[key]) for e in evals if _number(e.get(key))]
            if pts:
                ax_loss.plot(*zip(*pts), "o--", color=line.get_color(), label=f"{name}: {key.replace('_', ' ')}")
        ax_rate.plot(x, [s["examples_per_s"] for s in steps], color=line.get_color(), label=name)
        ax_wait.plot(x, [100 * s["wait_s"] / s["time_s"] if s["time_s"] > 0 else 0 for s in steps],
                     color=line.get_color(), label=name)
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=8)
    ax_rate.set_ylabel("examples/s (all workers)")
    ax_wait.set_ylabel("time waiting (%)")
    ax_wait.set_xlabel("step")
    for ax in (ax_loss, ax_rate, ax_wait):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    kind = os.path.splitext(out)[1][1:].lower() or "png"  # (the temporary file's name has no extension)
    try:
        with outputs.replacing(out) as tmp:
            fig.savefig(tmp, dpi=100, format=kind)
    finally:
        plt.close(fig)
    return out
