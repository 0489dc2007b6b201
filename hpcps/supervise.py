"""``hpcps supervise``: rerun a training job after a crash, from its newest good checkpoint.

    hpcps supervise [--max-restarts 3] [--backoff 5] -- mpiexec -n 4 hpcps train run.toml

Like torchrun's ``--max-restarts`` and XDL's failover: when any rank dies (a crash, ``kill -9``, a
lost node), MPI ends the whole job; the supervisor then starts it again with ``--resume auto``, so
every server and worker rolls back together to the newest checkpoint that verifies, data position
included. Each restart is logged with the exit status, the checkpoint used and the work lost (the
steps trained since that checkpoint, from the status file the first worker keeps, see
:func:`hpcps.train.progress.write_status`). Back-off between attempts doubles from ``--backoff`` up to ``--backoff-max``.

Not restarted: success (0), a usage or configuration error (2: it would fail the same way again),
a stop after a signal's checkpoint (75: the job was asked to stop; under Slurm the batch script
requeues it) and an interrupted job (130, SIGINT). SIGINT, SIGTERM and SIGUSR1 sent to the
supervisor are passed on to the job (``mpiexec`` forwards them to every rank); the supervisor
then waits for the job to end, exits with its status and does not restart it. The job runs in a
process group of its own, so that a Ctrl-C in the terminal reaches it once, through the
supervisor, not twice (a second Ctrl-C makes ``mpiexec`` kill the ranks at once).

No MPI here: the supervisor is a plain process around the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from hpcps.ps import checkpoint
from hpcps.train.progress import STATUS_ENV, read_status, write_status

NO_RESTART = {0: "finished", 2: "usage or configuration error", 75: "stopped by a signal after a checkpoint",
              130: "interrupted (SIGINT)"}
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _log(message: str, log_file: str = "") -> None:
    line = f"hpcps supervise: {message}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if log_file:
        with open(log_file, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")


def _with_resume(command: list[str]) -> list[str]:
    """The command with ``--resume auto`` (unless it already says how to resume)."""
    if any(a == "--resume" or a.startswith("--resume=") for a in command):
        return list(command)
    return [*command, "--resume", "auto"]


def lost_work(status: dict) -> tuple[str, str, dict | None]:
    """(checkpoint to be resumed, a sentence on the work lost, the checkpoint's manifest) from the
    job's last status (the checkpoint verified here: the restarted job trusts it, see
    :func:`_handed_over`)."""
    step = status.get("global_step")
    ckdir = status.get("checkpoint_dir", "")
    found = checkpoint.newest_good(ckdir, report=lambda m: None) if ckdir else None
    if found is None:
        return "", (f"no checkpoint yet: all {step} step(s) lost" if step is not None
                    else "no status from the job: the work lost is unknown"), None
    ckpt, manifest = found
    at = manifest.get("position", {}).get("global_step", 0)
    if step is None or step <= at:  # the status is written every 0.2 s: it may lag the checkpoint
        return ckpt, f"resuming at step {at}; at most 0.2 s of work lost", manifest
    return ckpt, f"resuming at step {at}; {step - at} step(s) of work lost (the job had reached step {step})", manifest


def _handed_over(status: dict, ckpt: str, manifest: dict | None = None) -> dict:
    """The environment that hands the restarted job what :func:`lost_work` verified of ``ckpt``
    (whose ``manifest`` it read) and the chain it is taken over, in the job's checkpoint directory
    (:func:`hpcps.ps.checkpoint.verified_under`): verified once, here, while the job is down, not
    again by its first rank before it restores."""
    ckdir = status.get("checkpoint_dir", "")
    return {checkpoint.VERIFIED_ENV: checkpoint.verified_under(ckdir, ckpt, manifest)} if ckdir and ckpt else {}


def _not_restarted(rc: int, signum: int, status: dict, log_file: str) -> int:
    """Say that the job a signal was passed on to ended with ``rc`` and is not restarted, naming
    the checkpoint to resume from (a second signal may have ended its ranks as the first one's
    checkpoint committed, they saying none was written); returns ``rc``."""
    ckpt = lost_work(status)[0]
    _log(f"job ended with exit status {rc} after signal {signal.Signals(signum).name}: not restarting"
         + (f"; --resume auto continues from {ckpt}" if ckpt else ""), log_file)
    return rc


def _back_off(delay: float, received: list) -> None:
    """Wait ``delay`` seconds, less if a signal is received meanwhile."""
    end = time.monotonic() + delay
    while time.monotonic() < end and not received:
        time.sleep(min(0.1, max(end - time.monotonic(), 0)))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def run(command: list[str], max_restarts: int = 3, backoff: float = 5.0, backoff_max: float = 300.0,
        log_file: str = "") -> int:
    """Run ``command`` until it succeeds, stops for a reason not worth a restart, or has been
    restarted ``max_restarts`` times. Returns the last exit status."""
    if not command:
        raise ValueError("hpcps supervise needs a command after --, e.g. -- mpiexec -n 4 hpcps train run.toml")
    status_path = os.environ.get(STATUS_ENV, "")  # a file the caller watches too, else a temporary one
    own_status = not status_path
    if own_status:
        fd, status_path = tempfile.mkstemp(prefix="hpcps-status-", suffix=".json")
        os.close(fd)
    received: list[int] = []
    child: list[subprocess.Popen] = []

    def forward(signum, frame):
        # a second SIGINT goes on as SIGTERM: the ranks, already stopping, then end at once (a
        # second SIGINT to mpiexec itself makes MPICH kill them, with an exit status of its own)
        again = signum == signal.SIGINT and signal.SIGINT in received
        received.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signal.SIGTERM if again else signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    # while the job runs: the checksums a restart verifies, loaded already (joined before returning:
    # a process that exits while the thread loads numba's kernels aborts in free())
    warm = threading.Thread(target=checkpoint.warm_checksums, daemon=True, name="hpcps-warm")
    try:
        attempt, handed = 0, {}  # handed: what a restart verified, for the job (_handed_over)
        checkpointing = True  # whether the job writes checkpoints (its status says; unknown: assumed)
        while True:
            cmd = command if attempt == 0 or not checkpointing else _with_resume(command)
            write_status(status_path)
            started = time.monotonic()
            try:
                proc = subprocess.Popen(cmd, env=dict(os.environ, **{STATUS_ENV: status_path}, **handed),
                                        stdin=subprocess.DEVNULL, process_group=0)
            except OSError as e:  # no such launcher, not executable
                _log(f"cannot start the job: {cmd[0]}: {e.strerror or e}", log_file)
                return 2
            child[:] = [proc]
            if attempt == 0:
                warm.start()
            if received:  # a signal came while it started: it is passed on now
                proc.send_signal(received[-1])
            rc = proc.wait()
            child.clear()
            if rc in NO_RESTART:
                _log(f"job {NO_RESTART[rc]} (exit status {rc})" + (f" after {attempt} restart(s)" if attempt else ""),
                     log_file)
                return rc
            if received:
                return _not_restarted(rc, received[-1], read_status(status_path), log_file)
            status = read_status(status_path)
            if "checkpoint_dir" in status:
                checkpointing = bool(status["checkpoint_dir"])
            ckpt, lost, manifest = lost_work(status)
            handed = _handed_over(status, ckpt, manifest)
            if attempt >= max_restarts:
                _log(f"job failed with exit status {rc} after {time.monotonic() - started:.0f} s; "
                     f"{max_restarts} restart(s) used up, giving up ({lost})", log_file)
                return rc
            delay = min(backoff * 2**attempt, backoff_max)
            attempt += 1
            _log(f"job failed with exit status {rc} after {time.monotonic() - started:.0f} s; restart "
                 f"{attempt}/{max_restarts} in {delay:g} s "
                 + (("with --resume auto" + (f" from {ckpt}" if ckpt else "")) if checkpointing else
                    "from the start (the job has no checkpoint.dir)") + f": {lost}", log_file)
            _back_off(delay, received)
            if received:
                _log(f"signal {signal.Signals(received[-1]).name} during the back-off: not restarting", log_file)
                return rc
    finally:
        if warm.is_alive():
            warm.join()
        for s, h in previous.items():
            signal.signal(s, h)
        if own_status:
            _remove(status_path)
