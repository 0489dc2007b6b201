"""Progress on the first worker: a bar (on a terminal) or periodic lines (in a log), JSON-lines
metrics, and the final summary table."""

from __future__ import annotations

import json
import sys
import time

from hpcps import outputs

STATUS_ENV = "HPCPS_STATUS_FILE"  # set by `hpcps supervise`: where the first worker reports its step


def write_status(path: str, **fields) -> None:
    """Atomically replace a job's status file (JSON: the fields and the time)."""
    outputs.write_json(path, {**fields, "time": time.time()})


def vm_hwm_mb(pid: int | str = "self") -> float | None:
    """Peak resident memory (VmHWM) of a process's current memory image, in MiB; None if it cannot
    be read. Unlike getrusage's maxrss, it does not count what a parent held when it forked the
    process (maxrss survives exec)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def read_status(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def before(epoch: int, step: int):
    """Whether a metrics record comes from before step ``step`` of epoch ``epoch`` (a step's
    record of an earlier step; an evaluation after an earlier step, or an earlier epoch's end)."""
    def keep(record: dict) -> bool:
        at = (record.get("epoch", 0), record.get("step", float("inf")))
        return at < (epoch, step) if isinstance(at[0], (int, float)) and isinstance(at[1], (int, float)) else True
    return keep


class Progress:
    """The progress line and the metrics file (``metrics_path``, JSON lines appended by whole
    records: :class:`hpcps.outputs.Appender`; ``on_error(e)`` is called with the OutputError of a
    failed write, which is raised when it returns).

    ``resume``: the (epoch, step) a resumed run starts at: its records are appended to the
    metrics file, less those an interrupted run wrote from that step on (said in one line);
    None, a fresh run: the metrics file starts anew."""

    def __init__(self, enabled: bool, total_steps: int, workers: int, metrics_path: str = "",
                 stream=None, interval: float = 0.5, on_error=None, resume: tuple[int, int] | None = None):
        self.enabled = enabled
        self.total = total_steps
        self.workers = workers
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = interval if self.tty else 10.0
        self.on_error = on_error
        self.metrics = None
        if metrics_path:
            self.metrics = self._writing(outputs.Appender, metrics_path, 1 << 16, 1.0, resume is None,
                                         before(*resume) if resume else None)
            if self.metrics.dropped:
                print(f"hpcps train: {metrics_path}: dropped {self.metrics.dropped} record(s) from epoch {resume[0]}, "
                      f"step {resume[1]} on (or an unfinished line): this run writes them anew from its checkpoint",
                      flush=True)
        self.start = time.perf_counter()
        self.last_print = 0.0
        self.examples = 0
        self.loss_sum = 0.0
        self.loss_rows = 0
        self.running = None

    def step(self, epoch: int, step: int, rows: int, loss_sum: float, wait_s: float, staleness: int,
             keys: tuple[int, int, int] | None = None) -> None:
        """``keys``: the model's (rows held, keys admitted, rows evicted) on the servers, when
        admission or eviction is on."""
        self.examples += rows
        self.loss_sum += loss_sum
        self.loss_rows += rows
        if rows:
            batch = loss_sum / rows
            self.running = batch if self.running is None else 0.98 * self.running + 0.02 * batch
        if not (self.enabled or self.metrics):
            return
        now = time.perf_counter()
        elapsed = now - self.start
        rate = self.examples * self.workers / max(elapsed, 1e-9)
        if self.metrics and rows:  # (a step without rows here, its part ended, has no loss to record)
            self._writing(self.metrics.write, {"kind": "step", "epoch": epoch, "step": step, "rows": rows,
                                               "loss": loss_sum / rows if rows else None, "examples_per_s": rate,
                                               "wait_s": wait_s, "max_staleness": staleness, "time_s": elapsed,
                                               **({"table_keys": keys[0], "admitted_keys": keys[1],
                                                   "evicted_keys": keys[2]} if keys else {})})
        if self.enabled and (now - self.last_print >= self.interval or step == self.total):
            self.last_print = now
            done = step / max(self.total, 1)
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            running = f"{self.running:.4f}" if self.running is not None else "-"
            line = (f"epoch {epoch} [{bar}] {step}/{self.total} {rate:,.0f} ex/s  loss {running}  "
                    f"wait {wait_s:.1f}s ({100 * wait_s / max(elapsed, 1e-9):.0f}%)"
                    + (f"  keys {keys[0]:,} (+{keys[1]:,} -{keys[2]:,})" if keys else ""))
            self.stream.write(("\r" + line) if self.tty else (line + "\n"))
            self.stream.flush()

    def epoch_end(self, epoch: int, record: dict) -> None:
        if self.enabled:
            if self.tty:
                self.stream.write("\n")
            parts = [f"{k} {v:.5f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()]
            self.stream.write(f"epoch {epoch} done: " + ", ".join(parts) + "\n")
            self.stream.flush()
        if self.metrics:
            self._writing(self.metrics.write, {"kind": "epoch", "epoch": epoch, **record})
            self._writing(self.metrics.flush)

    def close(self) -> None:
        if self.metrics:
            self._writing(self.metrics.close)

    def _writing(self, write, *args):
        try:
            return write(*args)
        except outputs.OutputError as e:
            if self.on_error is not None:
                self.on_error(e)
            raise


def summary_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k:<{width}}   {v}" for k, v in rows] + [line])
