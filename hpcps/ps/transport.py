"""The one module that talks to MPI.

Everything above this layer (server, worker client, training, CLI) calls these functions and never
imports mpi4py itself. The server, the worker's client and the context reach the other ranks
through a :class:`Transport` object (ps-lite's ``Van``): :class:`MPITransport` between the ranks
of an MPI job, :class:`Loopback` inside a job of one process. It holds every communicator they use,
so that new ones (after a rank fails) or another kind of transport change nothing above it.
Rules kept here:

* Hot-path messages are NumPy buffers sent with mpi4py's capitalised calls (``Isend``/``Irecv``),
  never pickled objects; a payload over 2 GiB is split into chunks.
* No wait spins: MPICH's blocking calls busy-poll a core, which on an oversubscribed node slows the
  ranks that do compute. :func:`wait` polls nonblocking requests and sleeps between polls with an
  exponential back-off (see ``POLL_*`` below), or does the caller's background work instead of
  sleeping, and takes a timeout after which it says which peer never answered.
* Large messages go into buffers that are reused once nothing refers to them (:class:`BufferPool`),
  and a large reply can go as its header then its payload, so that the waiting rank sleeps until
  the payload is ready (:func:`start_send_announced`); the receiver learns which from the header
  itself (:func:`start_recv_framed`).
* An unhandled exception on any rank aborts the whole job, printing the rank and the error in
  one line (:func:`install_abort_handler`), so that no rank waits forever for a dead peer.
* Every wait of the library goes through here, collectives included: each takes a timeout, and
  after the stall warning time (:func:`set_stall_warning`, ``cluster.stall_warn_s``) it warns once,
  naming what it waits for and the ranks it waits on: the peer of a point-to-point message; for a
  collective, the world ranks of the communicator (MPI cannot tell which of them have arrived).
  Small control objects are broadcast pickled (:func:`bcast_object`), with the same sleeping wait.
  Nothing above this module calls a communicator's methods (``tests/test_layers.py`` checks).
* Under ULFM (Open MPI launched with ``mpiexec --with-ft ulfm``, ``cluster.fault_tolerance =
  "ulfm"``), an MPI call that fails because a rank is gone (``MPI_ERR_PROC_FAILED``, its pending
  form, or ``MPI_ERR_REVOKED``) raises one :class:`RankFailed` carrying the world ranks lost, from
  every wait, probe and start of a transfer; the layers above decide whether to go on without
  them (:meth:`Transport.shrink`: new communicators of the survivors). Elsewhere MPI ends a job
  that lost a rank, as it always did.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from hpcps import errors

# Under ULFM a watcher bounds MPI's own start-up (hpcps.ps.start_up), stopped once MPI has started.
from hpcps.ps import start_up

# Under ULFM (Open MPI launched with --with-ft ulfm) MPI_Finalize's PMIx fence over every rank of
# the job may wait for ever on a rank that died (open-mpi/ompi#9434, #11404: seen here in 2 of 10
# jobs that lost a server, every survivor asleep in ompi_mpi_finalize): Open MPI's
# async_mpi_finalize skips it. Nothing is left for it to do: Context.finalize ends with a barrier
# of the survivors once every transfer of theirs is complete. Read by MPI_Init, so set here.
if start_up.under_ulfm(os.environ):
    os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")

# A job on one host gets its MPI settings before the library loads (hpcps.ps.mpi_env: each only
# where the user set none), unless a program of the user's loaded it already.
from hpcps.ps import mpi_env  # noqa: E402

_watcher = None
if "mpi4py.MPI" not in sys.modules:
    mpi_env.before_library(os.environ)
    _watcher = start_up.watch(os.environ)
try:
    from mpi4py import MPI  # noqa: E402
finally:
    start_up.started(_watcher)

# Back-off of the polling wait: first POLL_SPIN_S of pure polling (latency of a fast answer stays
# that of MPI), then sleeps that double from POLL_MIN_SLEEP_S up to POLL_MAX_SLEEP_S. A wait for
# large messages polls without sleeping for as long as their transfer should take at
# SPIN_BYTES_PER_S: MPICH moves a large message only while both sides call into MPI, so sleeping
# during a transfer stretches it. Once a large message of a wait (SPIN_RESET_BYTES) is done (a
# request's send), it spins only for the rest's transfer from then: a worker that has sent a large
# push then sleeps while the server works on it, which leaves the core to a server's second thread
# (hpcps_kernels.parallel). A serving loop's sleeps stay short (POLL_ACTIVE_MAX_SLEEP_S) for
# POLL_ACTIVE_WINDOW_S after its last piece of work, or for twice the recent gap between its
# pieces of work (up to POLL_ACTIVE_MAX_WINDOW_S): a step's first request, after a gap of a
# millisecond or more (the worker computing), is answered within this, not after a grown back-off.
# The numbers are tuned knobs (hpcps_kernels.tuning, docs/tuning.md).
from hpcps_kernels.tuning import (LOST_RANK_QUIET_S, MESSAGE_PAGE_OFFSET, PAGE_BYTES, POLL_ACTIVE_MAX_SLEEP_S,
                                  POLL_ACTIVE_MAX_WINDOW_S, POLL_ACTIVE_WINDOW_S, POLL_MAX_ADAPTIVE_SPIN_S,
                                  POLL_MAX_SLEEP_S,
                                  POLL_MIN_SLEEP_S, POLL_SHORT_MAX_SLEEP_S, POLL_SPIN_S, POOL_MAX_BYTES,
                                  POOL_MIN_BYTES, SPIN_BYTES_PER_S, SPIN_RESET_BYTES, SPIN_WHOLE_REPLY_BYTES)

# Largest element count sent in one MPI message: counts are C ints, and MPICH has trouble with
# messages over 2 GiB. 2**31 - 1 bytes, rounded down to a multiple of 8.
MAX_MESSAGE_BYTES = (2**31 - 1) // 8 * 8

# Messages of POOL_MIN_BYTES and more go into buffers of a BufferPool, which keeps up to
# POOL_MAX_BYTES of them for reuse (see BufferPool). A pooled buffer starts MESSAGE_PAGE_OFFSET
# bytes into a page: away from a page's edges, where MPICH's copy of a message into shared memory
# is slow (see hpcps.ps.protocol.place).


class StallError(RuntimeError):
    """A wait ran past its timeout; the message says which peers never answered."""

    exit_status = 1  # a run-time failure: its message is the whole story (see hpcps.errors)


class RankFailed(RuntimeError):
    """Ranks of the job are gone (killed, or their node lost): what an MPI call raised under ULFM.
    ``ranks``: their world ranks (those MPI knew of when it failed)."""

    exit_status = 1  # a run-time failure

    def __init__(self, ranks: Sequence[int], what: str = "", why: str = ""):
        self.ranks = tuple(sorted(int(r) for r in ranks))
        self.what = str(what)
        self.why = str(why)  # (why the job cannot go on without them, where the raiser knows better)
        # raised by a wait: the peers of its transfers that failed, and those not complete yet
        # (a caller going on without the lost ranks waits for the rest of them)
        self.peers: set[int] = set()
        self.left: list[Pending] = []
        self.failed: list[Pending] = []
        on = f" during {what}" if what else ""
        super().__init__(f"rank {_ranks_text(list(self.ranks)) if self.ranks else '?'} of the job failed{on} "
                         f"(killed, or its node lost)")


# the error classes of a lost rank under ULFM (MPI 5's names; mpi4py has them whatever the MPI)
_FAILED_CLASSES = frozenset(getattr(MPI, name, -1) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                                 "ERR_REVOKED")) - {-1}


def ulfm_missing() -> str | None:
    """Why this job cannot survive a lost rank (None: it can): ULFM needs Open MPI (5 or later)
    launched with ``mpiexec --with-ft ulfm``, which sets ``OMPI_MCA_mpi_ft_enable``."""
    library = MPI.Get_library_version().strip().splitlines()[0] if MPI.Get_library_version() else "?"
    if not library.startswith("Open MPI") or not hasattr(MPI.Comm, "Shrink"):
        return (f"this MPI ({' '.join(library.split(',')[0].split())}) has no ULFM; install Open MPI beside it (make install-ft: "
                f".venv-ft) and launch with .venv-ft/bin/mpiexec --with-ft ulfm")
    if not start_up.under_ulfm(os.environ):
        return "Open MPI without ULFM enabled: launch with mpiexec --with-ft ulfm"
    return None


def failed_ranks(comm: MPI.Comm | None = None) -> list[int]:
    """The world ranks this rank knows to have failed (local: no message; empty without ULFM)."""
    comm = comm or MPI.COMM_WORLD
    try:
        group = comm.Get_failed()
    except (NotImplementedError, MPI.Exception):
        return []
    try:
        if group.Get_size() == 0:
            return []
        wgroup = MPI.COMM_WORLD.Get_group()
        try:
            return sorted(int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), wgroup))
        finally:
            wgroup.Free()
    finally:
        group.Free()


def lost_rank_error(exc: BaseException, what: str = "", comm: MPI.Comm | None = None) -> RankFailed | None:
    """``exc`` as a :class:`RankFailed` when it is an MPI error of a lost rank, else None. The
    failures are acknowledged on ``comm`` (a probe of any source works again after it)."""
    if not isinstance(exc, MPI.Exception):
        return None
    # (Open MPI's nonblocking collectives may end with MPI_ERR_INTERN where a member failed; any
    # other class is no lost rank's, even with one lost: MPI_ERR_TRUNCATE, say, of collectives the
    # ranks called in different orders, must not be taken for one and done again)
    lost, error_class = failed_ranks(), exc.Get_error_class()
    if error_class not in _FAILED_CLASSES and not (lost and error_class == MPI.ERR_INTERN):
        return None
    if comm is not None:
        try:
            comm.Ack_failed()
        except (NotImplementedError, MPI.Exception):
            pass
    return RankFailed(lost or failed_ranks(), what)


def first_survivor() -> bool:
    """Whether this rank is the first of the world's ranks not known to have failed."""
    lost = set(failed_ranks())
    return MPI.COMM_WORLD.Get_rank() == min(r for r in range(MPI.COMM_WORLD.Get_size()) if r not in lost)


def raising_rank_failed(fn):
    """``fn`` (a collective of this module, or the start of a transfer) raising :class:`RankFailed`
    where MPI fails because a rank is gone."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MPI.Exception as e:
            raise lost_rank_error(e, kwargs.get("what") or fn.__name__) or e
    return guarded


_abort_installed = False
_stall_warn_s: float | None = 30.0  # default warn_after of the collectives (set_stall_warning)


def set_stall_warning(seconds: float | None) -> None:
    """Seconds after which a collective or a wait without its own ``warn_after`` warns once
    (``None``: never). :func:`hpcps.init` sets it from ``stall_warn_s``."""
    global _stall_warn_s
    _stall_warn_s = seconds


def world_ranks(comm: MPI.Comm) -> list[int]:
    """The world ranks of ``comm``'s members, in ``comm``'s rank order."""
    n = comm.Get_size()
    if comm == MPI.COMM_WORLD or n == MPI.COMM_WORLD.Get_size():
        return list(range(n))
    group, wgroup = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(n)), wgroup)]
    finally:
        group.Free()
        wgroup.Free()


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _collective(comm: MPI.Comm, request: MPI.Request, what: str, buffers: tuple, timeout: float | None) -> None:
    """Wait for a nonblocking collective; the warning and the timeout name its members."""
    def where() -> str:  # only computed when a warning or the timeout needs it
        me = comm.Get_rank()
        others = [r for i, r in enumerate(world_ranks(comm)) if i != me]
        return (f" (a collective over {comm.Get_size()} ranks: waiting on world rank(s) {_ranks_text(others)}; "
                f"at least one of them has not arrived)") if others else ""

    pending = Pending(request, what, -1, buffers)
    try:
        wait(pending, timeout, warn_after=_stall_warn_s, suffix=where)
    except RankFailed:  # (its buffers kept: MPI may still write them, see cancel)
        _ABANDONED.append(pending)
        raise

def world() -> MPI.Comm:
    """MPI.COMM_WORLD (the library itself works on duplicates of it)."""
    return MPI.COMM_WORLD


def rank_prefix(comm: MPI.Comm | None = None) -> str:
    comm = comm or MPI.COMM_WORLD
    return f"rank {comm.Get_rank()}/{comm.Get_size()}"


def abort(message: str, code: int = 1, comm: MPI.Comm | None = None) -> None:
    """Print ``message`` with this rank's number to stderr (one line) and end the whole MPI job
    with exit status ``code`` (:func:`end_job`)."""
    comm = comm or MPI.COMM_WORLD
    sys.stderr.write(f"hpcps: {rank_prefix(comm)}: {message.rstrip()}\n")
    end_job(code, comm)


def end_job(code: int, comm: MPI.Comm | None = None) -> None:
    """End the whole job at once with the exit status ``code``, adding nothing to what this rank
    has said: ``MPI_Abort`` with this rank's standard streams sent to /dev/null (MPICH's abort
    prints a line of its own); the launcher ends every other rank and exits with ``code``. A
    world of one process just exits."""
    comm = comm or MPI.COMM_WORLD
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.COMM_WORLD.Get_size() == 1:
        os._exit(code)
    time.sleep(0.3)  # let the launcher forward what was said before the job is torn down
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    comm.Abort(code)
    # MPICH's MPI_Abort returned here now and then while a parse thread ran (the launcher had the
    # abort and tore the job down a moment later): this rank must not go on meanwhile
    os._exit(code)


# Functions that may turn an exception into a clearer (type name, first line) for the abort
# message, registered by higher layers (this module imports none of them); None: no opinion.
EXPLAINERS: list[Callable[[BaseException], tuple[str, str] | None]] = []


def _mpi_failure(exc: BaseException) -> tuple[str, str] | None:
    """An MPI call that failed: mostly a rank of the job that died (killed, out of memory), which
    is not a bug of this rank's."""
    if not isinstance(exc, MPI.Exception):
        return None
    first = str(exc).splitlines()[0].split(", error stack:")[0] if str(exc) else "an MPI error"
    return "MPIError", f"an MPI call failed ({first}): most likely another rank of the job died"


EXPLAINERS.append(_mpi_failure)


def explanation(exc: BaseException) -> tuple[str, str] | None:
    """A clearer (type name, first line) for ``exc`` from the registered EXPLAINERS, or None."""
    for explainer in EXPLAINERS:
        try:
            got = explainer(exc)
        except Exception:  # noqa: BLE001 - an explainer never hides the error it explains
            got = None
        if got:
            return got
    return None


def explain(exc: BaseException) -> tuple[str, str]:
    """(type name, first line) of ``exc``: its :func:`explanation`, else its own."""
    return explanation(exc) or (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def install_abort_handler() -> None:
    """Make an unhandled exception on this rank (main or any thread) abort the whole job.

    Without it, the other ranks would wait forever in their next collective or receive for the
    rank that died. The message printed is one line: this rank and the error
    (:func:`hpcps.errors.one_line`; the traceback before it with ``HPCPS_DEBUG=1``). Installed in a
    world of one rank too, where it prints the same line instead of a traceback.
    """
    global _abort_installed
    if _abort_installed:
        return
    _abort_installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt) or (
            issubclass(exc_type, SystemExit) and exc.code in (None, 0)
        ):
            previous(exc_type, exc, tb)
            return
        if issubclass(exc_type, BrokenPipeError):  # (`hpcps train | head`: the reader left; say nothing)
            end_job(128 + signal.SIGPIPE)
        if issubclass(exc_type, RankFailed) and not first_survivor():
            time.sleep(LOST_RANK_QUIET_S)  # (the first rank alive says it and ends the job meanwhile)
        errors.print_traceback(exc)
        line, code = errors.one_line(exc, explanation(exc))
        abort(f"error: {line}", code=code)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        errors.print_traceback(args.exc_value)
        line, code = errors.one_line(args.exc_value, explanation(args.exc_value))
        abort(f"error in thread {args.thread.name if args.thread else '?'}: {line}", code=code)

    sys.excepthook = hook
    threading.excepthook = thread_hook


class Described:
    """What a transfer is for, written out (``fn(*args)``) only when a stall message needs it:
    a request's description costs nothing on the way of every request."""

    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable[..., str], args: tuple):
        self.fn, self.args = fn, args

    def __str__(self) -> str:
        return self.fn(*self.args)


@dataclass
class Pending:
    """A nonblocking request with what it is for (used in stall messages) and its buffers.

    Keeping the buffers referenced here keeps them alive until the request completes.
    """

    request: MPI.Request
    what: str | Described
    peer: int = -1
    buffers: tuple = ()
    nbytes: int = 0
    # called once the request is complete: the transfers it starts then (the rest of a message
    # whose first part says how the rest comes, see start_recv_framed)
    then: Callable[[], list["Pending"]] | None = None


def spin_budget(nbytes: int) -> float:
    """Seconds a wait polls without sleeping for messages of ``nbytes`` in all."""
    return POLL_SPIN_S + nbytes / SPIN_BYTES_PER_S


def _sleep_backoff(start: float, sleep: float, spin: float = POLL_SPIN_S,
                   max_sleep: float = POLL_MAX_SLEEP_S) -> float:
    if time.perf_counter() - start < spin:
        return sleep
    time.sleep(sleep)
    return min(sleep * 2.0, max_sleep)


def wait(
    pending: Sequence[Pending] | Pending,
    timeout: float | None,
    *,
    warn_after: float | None = None,
    on_warn: Callable[[str], None] | None = None,
    suffix: str | Callable[[], str] = "",
    max_sleep: float = POLL_MAX_SLEEP_S,
    background: Callable[[], bool] | None = None,
) -> None:
    """Wait for requests to complete without spinning a core.

    Args:
        pending: one or more :class:`Pending` requests.
        timeout: seconds; ``None`` waits forever. On timeout a :class:`StallError` names the
            requests (and peers) still outstanding.
        warn_after: seconds after which ``on_warn`` (default: print to stderr) is called once with
            the same description, while the wait goes on.
        suffix: added to the description (who a collective waits on).
        max_sleep: the longest sleep between polls: a wait expected to be short (a reply in the
            training loop) uses less than the default, so it does not oversleep the answer.
        background: called between polls instead of sleeping: it does one short piece of other
            work (parsing the next rows) and returns whether there was any; once it returns False
            the wait sleeps as usual.

    Raises:
        StallError: when ``timeout`` passes first.
    """
    if isinstance(pending, Pending):
        pending = [pending]
    todo = [p for p in pending if p.request != MPI.REQUEST_NULL]
    spin = spin_budget(sum(p.nbytes for p in todo))
    start = time.perf_counter()
    sleep = POLL_MIN_SLEEP_S
    warned = False
    while todo:
        left, started, done_bytes = _test(todo)
        if not left:
            return
        if started or done_bytes >= SPIN_RESET_BYTES:
            # a large message done (a push's send), or the rest of a message started once its
            # first part came (a large reply's payload): spin for the transfers from now on
            spin = time.perf_counter() - start + spin_budget(sum(p.nbytes for p in left))
        # most of what was left done in this pass: test the rest again before sleeping. A test
        # makes MPI's progress, which can complete a request tested before it in the pass: a
        # rendezvous send's acknowledgement comes before the reply, so a request's sends were seen
        # done and its replies, already in, a back-off sleep later. Not for a few of many (a
        # burst's replies): what is left at least halves with each pass tested again at once, so a
        # stream of completions is not spun through
        done = len(todo) - len(left)
        again = 0 < done >= len(left)
        todo = left
        elapsed = time.perf_counter() - start
        if warn_after is not None and not warned and elapsed > warn_after:
            warned = True
            msg = f"still waiting after {elapsed:.1f} s for {describe(todo)}{suffix() if callable(suffix) else suffix}"
            (on_warn or _warn)(msg)
        if timeout is not None and elapsed > timeout:
            raise StallError(
                f"{rank_prefix()}: no answer after {timeout:g} s: {describe(todo)}{suffix() if callable(suffix) else suffix}"
            )
        if again:
            continue
        if background is not None:
            if background():
                continue
            background = None
        sleep = _sleep_backoff(start, sleep, spin, max_sleep)


def _test(todo: Sequence[Pending]) -> tuple[list[Pending], bool, int]:
    """The requests of ``todo`` not complete yet, with those that completed ones started (their
    ``then``); whether there were any such, and the bytes of those completed."""
    left, started, done_bytes = [], False, 0
    failure: RankFailed | None = None
    for p in todo:
        try:
            done = p.request.Test()
        except MPI.Exception as e:
            failure = failure or lost_rank_error(e, str(p.what))
            if failure is None:
                raise
            failure.peers.add(p.peer)
            failure.failed.append(p)
            continue
        if not done:
            left.append(p)
            continue
        done_bytes += p.nbytes
        if p.then is not None:
            more = p.then()
            left += more
            started = started or bool(more)
    if failure is not None:  # (every request tested: the caller may go on with those left)
        failure.left = left
        raise failure
    return left, started, done_bytes


# transfers given up (their peer lost): kept, with their buffers, for the job's life, since MPI
# may still hold their receives (a buffer freed or reused under a posted receive corrupts memory)
_ABANDONED: list[Pending] = []


def cancel(pending: Sequence[Pending]) -> None:
    """Give up transfers that will never complete (their peer is lost, under ULFM): each
    cancelled and tested once, which frees it where it is complete (cancelled, or failed: MPI
    frees a request whose test raises); those MPI still holds are kept, with their buffers,
    until the end of the job."""
    for p in pending:
        if p.request == MPI.REQUEST_NULL:
            continue
        try:
            p.request.Cancel()
            p.request.Test()
        except MPI.Exception:
            pass
        if p.request != MPI.REQUEST_NULL:
            _ABANDONED.append(p)


def describe(todo: Sequence[Pending]) -> str:
    peers = sorted({p.peer for p in todo if p.peer >= 0})
    whats = sorted({str(p.what) for p in todo})
    s = ", ".join(whats)
    if peers:
        s += f" (from rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))})"
    return s


def _warn(msg: str) -> None:
    sys.stderr.write(f"hpcps: {rank_prefix()}: warning: {msg}\n")
    sys.stderr.flush()


def completed(pending: Sequence[Pending]) -> list[Pending]:
    """The requests of ``pending`` not complete yet (tests each once; never waits)."""
    return _test(pending)[0]


@raising_rank_failed
def barrier(comm: MPI.Comm, timeout: float | None = None, what: str = "barrier") -> None:
    """A barrier that sleeps while it waits (see :func:`wait`)."""
    _collective(comm, comm.Ibarrier(), what, (), timeout)


_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


@raising_rank_failed
def allreduce(
    comm: MPI.Comm, array: np.ndarray, op: str = "sum", timeout: float | None = None,
    what: str = "allreduce",
) -> np.ndarray:
    """Allreduce a NumPy array (a new array is returned) while sleeping between polls."""
    send = np.ascontiguousarray(array)
    out = np.empty_like(send)
    if send.nbytes > MAX_MESSAGE_BYTES:
        flat_in, flat_out = send.reshape(-1), out.reshape(-1)
        step = MAX_MESSAGE_BYTES // send.itemsize
        for lo in range(0, flat_in.size, step):
            _collective(comm, comm.Iallreduce(flat_in[lo:lo + step], flat_out[lo:lo + step], _OPS[op]),
                        what, (flat_in, flat_out), timeout)
        return out
    _collective(comm, comm.Iallreduce(send, out, _OPS[op]), what, (send, out), timeout)
    return out


@raising_rank_failed
def start_allreduce(comm: MPI.Comm, array: np.ndarray, op: str = "sum", what: str = "allreduce") -> tuple:
    """Start a nonblocking allreduce (at most MAX_MESSAGE_BYTES): returns (the result's array, its
    Pending); :func:`finish_collective` completes it. Work done between the two overlaps it."""
    send = np.ascontiguousarray(array)
    if send.nbytes > MAX_MESSAGE_BYTES:
        raise ValueError(f"{what}: {send.nbytes} bytes is more than one message may carry")
    out = np.empty_like(send)
    return out, Pending(comm.Iallreduce(send, out, _OPS[op]), what, -1, (send, out))


@raising_rank_failed
def finish_collective(comm: MPI.Comm, pending: Pending, timeout: float | None = None) -> None:
    """Wait for a collective started by a ``start_`` function (sleeping; the timeout names the
    members that did not arrive)."""
    _collective(comm, pending.request, pending.what, pending.buffers, timeout)


def _chunks(array: np.ndarray):
    flat = array.reshape(-1).view(np.uint8) if array.size else array.reshape(-1)
    if flat.nbytes <= MAX_MESSAGE_BYTES:
        yield flat
        return
    for lo in range(0, flat.nbytes, MAX_MESSAGE_BYTES):
        yield flat[lo:lo + MAX_MESSAGE_BYTES]


@raising_rank_failed
def start_send(comm: MPI.Comm, array: np.ndarray, dest: int, tag: int, what: str = "send") -> list[Pending]:
    """Start sending a contiguous NumPy array; payloads over 2 GiB go as several messages.

    The receiver must post :func:`start_recv` with an array of the same size in bytes.
    """
    if array.dtype == np.uint8 and array.ndim == 1 and array.nbytes <= MAX_MESSAGE_BYTES \
            and array.flags.c_contiguous:  # a message of bytes, whole (every request and reply): its type given
        return [Pending(comm.Isend([array, MPI.BYTE], dest=dest, tag=tag), what, dest, (array,), array.nbytes)]
    array = np.ascontiguousarray(array)
    return [Pending(comm.Isend(c, dest=dest, tag=tag), what, dest, (array, c), c.nbytes) for c in _chunks(array)]


@raising_rank_failed
def start_recv(comm: MPI.Comm, out: np.ndarray, source: int, tag: int, what: str = "receive") -> list[Pending]:
    """Start receiving into the contiguous array ``out`` (see :func:`start_send`)."""
    if not out.flags.c_contiguous:
        raise ValueError("start_recv needs a C-contiguous output array")
    return [Pending(comm.Irecv(c, source=source, tag=tag), what, source, (out, c), c.nbytes) for c in _chunks(out)]


def start_send_announced(comm: MPI.Comm, array: np.ndarray, head: int, dest: int, tag: int,
                         what: str = "send") -> list[Pending]:
    """Send ``array`` as two messages of ``tag``: its first ``head`` bytes, then the rest, which
    MPI delivers in that order; the receiver posts :func:`start_recv_announced`."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return start_send(comm, flat[:head], dest, tag, what) + start_send(comm, flat[head:], dest, tag, what)


def start_recv_announced(comm: MPI.Comm, out: np.ndarray, head: int, source: int, tag: int,
                         what: str = "receive") -> list[Pending]:
    """Receive what :func:`start_send_announced` sends into ``out``. A :func:`wait` on them sleeps
    until the head has come, and spins (see ``POLL_*``) for the rest's transfer only from then:
    a sender that sends the head once the rest is ready (a server's reply to a large pull) then
    has the waiting rank's core while it computes the rest."""
    return start_recv_framed(comm, out, head, source, tag, what, lambda first: True)


@raising_rank_failed
def start_recv_framed(comm: MPI.Comm, out: np.ndarray, head: int, source: int, tag: int, what: str,
                      rest_apart: Callable[[np.ndarray], bool]) -> list[Pending]:
    """Receive into ``out`` a message whose first ``head`` bytes say how it comes: whole, as
    :func:`start_send` sends it, or, where ``rest_apart(out[:head])`` holds once they have come,
    as its head then the rest, as :func:`start_send_announced` sends it. The rest's receive is
    posted once the head has come. A :func:`wait` spins for the whole message where it is smaller
    than SPIN_WHOLE_REPLY_BYTES (a reply that size comes whole: only larger pulls are split), else
    for the head only (a worker sleeps through a large pull's work), then for the rest."""
    if not out.flags.c_contiguous:
        raise ValueError("start_recv_framed needs a C-contiguous output array")
    flat = out.reshape(-1).view(np.uint8)
    first = flat[:min(flat.nbytes, MAX_MESSAGE_BYTES)]

    def rest() -> list[Pending]:
        if rest_apart(flat[:head]):
            return start_recv(comm, flat[head:], source, tag, what)
        return start_recv(comm, flat[first.nbytes:], source, tag, what) if flat.nbytes > first.nbytes else []

    spin = first.nbytes if flat.nbytes < SPIN_WHOLE_REPLY_BYTES else head
    return [Pending(comm.Irecv(first, source=source, tag=tag), what, source, (out, first), spin, then=rest)]


def tag_upper_bound(comm: MPI.Comm) -> int:
    """The largest usable tag (``MPI_TAG_UB``; at least 32767 by the standard)."""
    ub = comm.Get_attr(MPI.TAG_UB)
    return int(ub) if ub else 32767


class Poller:
    """The back-off of a serving loop: call :meth:`idle` after a poll that found nothing (it
    sleeps as :func:`wait` does and returns the seconds slept; :meth:`spinning` says whether it
    would only return) and :meth:`reset` after work.

    The pure-polling window adapts to the traffic. While requests come every few hundred
    microseconds (twice the recent gap between pieces of work, an exponential average, at most
    POLL_MAX_ADAPTIVE_SPIN_S) the loop polls for that long and catches them without sleeping (a
    sleep would add up to its length to each request's latency). Where the gap is longer (a
    training step's compute between its requests) a spin would end before the next request comes
    and only take the core from the ranks computing: the loop polls for POLL_SPIN_S (and a reply's
    transfer), then sleeps, its sleeps kept short (POLL_ACTIVE_MAX_SLEEP_S) for twice that gap,
    within [POLL_ACTIVE_WINDOW_S, POLL_ACTIVE_MAX_WINDOW_S], so the next request is answered within
    a short sleep; once requests stop the sleeps grow to POLL_MAX_SLEEP_S.
    """

    def __init__(self):
        self.gap = POLL_SPIN_S
        self.last = time.perf_counter()
        self.reset()

    def reset(self, nbytes: int = 0, now: float | None = None) -> None:
        """Work was done (it ended at ``now``, ``time.perf_counter()``'s, where read): spin again,
        longer while ``nbytes`` are still being transferred."""
        if now is None:
            now = time.perf_counter()
        self.gap = 0.8 * self.gap + 0.2 * (now - self.last)
        self.last = now
        self.start = now
        self.sleep = POLL_MIN_SLEEP_S
        window = 2.0 * self.gap
        self.spin = spin_budget(nbytes) + (max(window, POLL_SPIN_S) if window <= POLL_MAX_ADAPTIVE_SPIN_S else 0.0)
        self.active = min(max(window, POLL_ACTIVE_WINDOW_S), POLL_ACTIVE_MAX_WINDOW_S)

    def spinning(self) -> bool:
        """Whether :meth:`idle` would return at once (its pure-polling window is not over)."""
        return time.perf_counter() - self.start < self.spin

    def idle(self) -> float:
        t = time.perf_counter()
        if t - self.start < self.spin:
            return 0.0
        time.sleep(self.sleep)
        # short sleeps while active (see POLL_ACTIVE_MAX_SLEEP_S), then back off to POLL_MAX_SLEEP_S
        cap = POLL_ACTIVE_MAX_SLEEP_S if t - self.last < self.active else POLL_MAX_SLEEP_S
        self.sleep = min(self.sleep * 2.0, cap)
        return time.perf_counter() - t


class BufferPool:
    """Byte buffers for large messages, each reused once nothing refers to it any more.

    glibc serves an allocation of more than 32 MiB with a fresh mapping and returns it to the
    kernel when freed, so each large message faulted its pages in again (and the kernel zeroed
    them), on each side of each transfer: where a page fault is costly, about as long as the
    transfer itself (docs/benchmarks.md). :meth:`take` hands out a view of a kept buffer that is free (no array,
    view of it or pending MPI request refers to it: its reference count says so, as views of
    views refer to the buffer itself), else a new buffer, kept while the pool holds less than
    ``max_bytes``. Requests below ``min_bytes`` get plain ``np.empty`` (the heap reuses those).
    The pool is not thread-safe: one per process, used by its MPI thread.
    """

    def __init__(self, min_bytes: int = POOL_MIN_BYTES, max_bytes: int = POOL_MAX_BYTES):
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self._buffers: list[np.ndarray] = []
        self.reused = 0

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) == 2  # the list's reference and the argument's

    def take(self, nbytes: int) -> np.ndarray:
        """An uninitialised uint8 array of ``nbytes``."""
        if nbytes < self.min_bytes:
            return np.empty(nbytes, dtype=np.uint8)
        best = -1
        for i in range(len(self._buffers)):  # the smallest free buffer that fits, at most twice the size
            size = self._buffers[i].nbytes - PAGE_BYTES  # (a page to start it at MESSAGE_PAGE_OFFSET)
            if nbytes <= size <= 2 * nbytes and (best < 0 or size < self._buffers[best].nbytes - PAGE_BYTES) \
                    and self._free(i):
                best = i
        if best >= 0:
            self.reused += 1
            return self._start(self._buffers[best], nbytes)
        # an eighth more than asked for (pages never touched cost nothing), so that a slightly
        # larger message later reuses it, and a page to start it at MESSAGE_PAGE_OFFSET
        want = nbytes + nbytes // 8 + PAGE_BYTES
        held, i = self.held_bytes, 0
        while held + want > self.max_bytes and i < len(self._buffers):  # forget free buffers while over
            if self._free(i):
                held -= self._buffers.pop(i).nbytes
            else:
                i += 1
        buf = np.empty(want, dtype=np.uint8)
        if held + buf.nbytes <= self.max_bytes:
            self._buffers.append(buf)
        return self._start(buf, nbytes)

    @staticmethod
    def _start(buf: np.ndarray, nbytes: int) -> np.ndarray:
        lo = (MESSAGE_PAGE_OFFSET - buf.ctypes.data) % PAGE_BYTES
        return buf[lo:lo + nbytes]

    @property
    def held_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers)


def probe_request(comm: MPI.Comm, tag: int, take: Callable[[int], np.ndarray] | None = None,
                  status: MPI.Status | None = None) -> tuple[int, np.ndarray] | None:
    """Receive one whole pending message of ``tag`` from any rank, if there is one, into
    ``take(nbytes)`` (a :meth:`BufferPool.take`; default ``np.empty``); ``status``: the
    ``MPI.Status`` to probe with (a serving loop's own, reused: one made per poll costs as much as
    the probe), else a new one.

    Returns ``(source, bytes)`` or ``None`` without waiting. Uses a matched probe, so the message
    found is the one received even with several threads (each with its own ``status``).
    """
    if status is None:
        status = MPI.Status()
    try:
        msg = comm.Improbe(source=MPI.ANY_SOURCE, tag=tag, status=status)
    except MPI.Exception as e:
        raise lost_rank_error(e, "a probe for requests", comm) or e
    if msg is None:
        return None
    n = status.Get_count(MPI.BYTE)
    buf = np.empty(n, dtype=np.uint8) if take is None else take(n)
    msg.Recv([buf, MPI.BYTE])  # (bytes: the buffer's type given, not inferred)
    return status.Get_source(), buf


@raising_rank_failed
def bcast(comm: MPI.Comm, array: np.ndarray, root: int = 0, timeout: float | None = None,
          what: str = "broadcast") -> None:
    """Broadcast a contiguous NumPy array in place while sleeping between polls."""
    for c in _chunks(array):
        _collective(comm, comm.Ibcast(c, root=root), what, (array, c), timeout)


@raising_rank_failed
def bcast_object(comm: MPI.Comm, obj=None, root: int = 0, timeout: float | None = None,
                 what: str = "broadcast") -> object:
    """Broadcast a small picklable control object from ``root`` (returned on every rank), with
    the sleeping wait and the timeout of :func:`bcast`. Never for hot-path data."""
    size = np.zeros(1, dtype=np.int64)
    payload = None
    if comm.Get_rank() == root:
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
        size[0] = payload.size
    bcast(comm, size, root, timeout, what + " (size)")
    if comm.Get_rank() != root:
        payload = np.empty(int(size[0]), dtype=np.uint8)
    bcast(comm, payload, root, timeout, what)
    return obj if comm.Get_rank() == root else pickle.loads(payload.tobytes())


@raising_rank_failed
def allgather_int(comm: MPI.Comm, value: int, timeout: float | None = None, what: str = "allgather") -> np.ndarray:
    """Every rank's ``value`` (int64 array of comm size)."""
    send = np.array([value], dtype=np.int64)
    out = np.empty(comm.Get_size(), dtype=np.int64)
    _collective(comm, comm.Iallgather(send, out), what, (send, out), timeout)
    return out


@raising_rank_failed
def host_names(comm: MPI.Comm, timeout: float | None = None, what: str = "host names") -> list[str]:
    """Every rank's host (MPI's processor name), in rank order: where each rank runs."""
    width = MPI.MAX_PROCESSOR_NAME + 1
    send = np.zeros(width, dtype=np.uint8)
    name = MPI.Get_processor_name().encode()[: width - 1]
    send[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    out = np.empty((comm.Get_size(), width), dtype=np.uint8)
    _collective(comm, comm.Iallgather(send, out), what, (send, out), timeout)
    return [bytes(row).split(b"\0", 1)[0].decode(errors="replace") for row in out]


@raising_rank_failed
def gatherv(comm: MPI.Comm, array: np.ndarray, counts: np.ndarray, root: int = 0,
            timeout: float | None = None, what: str = "gather") -> np.ndarray | None:
    """Gather variable-length 1-D arrays (``counts`` elements from each rank) on ``root``."""
    array = np.ascontiguousarray(array)
    if comm.Get_rank() == root:
        out = np.empty(int(counts.sum()), dtype=array.dtype)
        displ = np.zeros_like(counts)
        displ[1:] = np.cumsum(counts)[:-1]
        req = comm.Igatherv(array, [out, counts, displ, _mpi_type(array.dtype)], root=root)
        _collective(comm, req, what, (array, out, counts, displ), timeout)
        return out
    _collective(comm, comm.Igatherv(array, None, root=root), what, (array,), timeout)
    return None


@raising_rank_failed
def scatterv(comm: MPI.Comm, array: np.ndarray | None, counts: np.ndarray | None, out: np.ndarray, root: int = 0,
             timeout: float | None = None, what: str = "scatter") -> np.ndarray:
    """Scatter consecutive parts of ``array`` (``counts`` elements to each rank; both on ``root``
    only) into every rank's ``out``; returns ``out``."""
    if comm.Get_rank() == root:
        array = np.ascontiguousarray(array)
        displ = np.zeros_like(counts)
        displ[1:] = np.cumsum(counts)[:-1]
        req = comm.Iscatterv([array, counts, displ, _mpi_type(array.dtype)], out, root=root)
        _collective(comm, req, what, (array, out, counts, displ), timeout)
    else:
        _collective(comm, comm.Iscatterv(None, out, root=root), what, (out,), timeout)
    return out


def _mpi_type(dtype: np.dtype):
    return MPI._typedict[np.dtype(dtype).char]


@raising_rank_failed
def split(comm: MPI.Comm, color: int, key: int) -> MPI.Comm:
    """``comm.Split`` (collective); ``color < 0`` gives no communicator (``MPI.COMM_NULL``)."""
    return comm.Split(MPI.UNDEFINED if color < 0 else color, key)


def dup(comm: MPI.Comm | None = None) -> MPI.Comm:
    """A private duplicate of ``comm`` (default: COMM_WORLD): the library's own traffic never
    matches the user's messages."""
    return (comm or MPI.COMM_WORLD).Dup()


def self_comm() -> MPI.Comm:
    """A private duplicate of ``COMM_SELF``: the communicator of a job of one process."""
    return MPI.COMM_SELF.Dup()


def shrink(comm: MPI.Comm, timeout: float | None = None, what: str = "shrink") -> MPI.Comm:
    """Collective over the survivors of ``comm`` (ULFM): revoke it, so that any member waiting on
    it fails and comes here too, then a new communicator of the members alive. MPI's blocking
    shrink (Open MPI's nonblocking one fails on a revoked communicator): a one-off after a loss,
    which ULFM completes whatever else fails."""
    try:
        comm.Revoke()
    except MPI.Exception as e:
        if e.Get_error_class() not in _FAILED_CLASSES:
            raise
    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    return new


def free(comm: MPI.Comm) -> None:
    """Free a communicator made by :func:`split` or :func:`dup` (``COMM_NULL`` is ignored)."""
    if comm != MPI.COMM_NULL:
        comm.Free()


def blocking_pingpong_reference(comm: MPI.Comm, peer: int, first: bool, buf: np.ndarray, reps: int) -> list[float]:
    """Round-trip times of ``reps`` ping-pongs with MPI's *blocking* Send/Recv: the reference the
    PS benchmark compares the sleeping wait against (spins a core; benchmarks only)."""
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        if first:
            comm.Send(buf, dest=peer, tag=5)
            comm.Recv(buf, source=peer, tag=6)
        else:
            comm.Recv(buf, source=peer, tag=5)
            comm.Send(buf, dest=peer, tag=6)
        times.append(time.perf_counter() - t)
    return times[1:]


def blocking_serve_reference(comm: MPI.Comm, requests: int, request_bytes: int, reply_bytes: int, tag: int) -> None:
    """Receive ``requests`` messages of ``request_bytes`` from any rank with MPI's blocking calls,
    answering each with ``reply_bytes`` under ``tag + 1``: the raw floor of a server's requests
    (spins a core; benchmarks only)."""
    buf = np.empty(max(request_bytes, 1), dtype=np.uint8)
    reply = np.zeros(max(reply_bytes, 1), dtype=np.uint8)
    status = MPI.Status()
    for _ in range(requests):
        comm.Recv(buf[:request_bytes], source=MPI.ANY_SOURCE, tag=tag, status=status)
        comm.Send(reply[:reply_bytes], dest=status.Get_source(), tag=tag + 1)


def blocking_recv_reference(comm: MPI.Comm, buf: np.ndarray, source: int, tag: int) -> None:
    """MPI's blocking Recv (spins a core while it waits): a benchmark reference only."""
    comm.Recv(buf, source=source, tag=tag)


def send_blocking(comm: MPI.Comm, buf: np.ndarray, dest: int, tag: int, timeout: float | None = None,
                  what: str = "send") -> None:
    """Send a small array and wait (sleeping) until it is sent."""
    wait(start_send(comm, buf, dest, tag, what), timeout)


def recv_blocking(comm: MPI.Comm, buf: np.ndarray, source: int, tag: int, timeout: float | None = None,
                  what: str = "receive") -> None:
    """Receive into ``buf`` and wait (sleeping) until it has arrived."""
    wait(start_recv(comm, buf, source, tag, what), timeout)


def agree(comm: MPI.Comm, value: int, timeout: float | None = None, what: str = "agreement") -> bool:
    """Collective: True on every rank if every rank passed the same integer ``value``."""
    v = np.array([value, -value], dtype=np.int64)
    r = allreduce(comm, v, "max", timeout=timeout, what=what)
    return bool(r[0] == value and r[1] == -value)


def all_ok(comm: MPI.Comm, error: str | None, timeout: float | None = None, what: str = "check") -> list[str]:
    """Collective: every rank's error message (empty list when no rank had one).

    Lets ranks fail together with the same clear message instead of one rank raising while the
    others wait for it.
    """
    flags = allgather_int(comm, 0 if error is None else 1, timeout, what)
    # every rank is here, so each failing rank's message is broadcast in turn
    out = []
    for r in np.flatnonzero(flags):
        message = bcast_object(comm, error, int(r), timeout, what)
        out.append(f"rank {r}: {message}")
    return out


# -- the transport object ---------------------------------------------------------------------


class Transport:
    """A rank's messages to and from the other ranks of a parameter-server job, and the
    communicators its collectives run over (ps-lite's ``Van``). The server, the worker's client
    and the context reach other ranks only through one, so that another kind (:class:`Loopback`:
    a job of one process) or new communicators (after a rank fails) change nothing above it.
    Ranks are those of :attr:`world`; each ``start_`` method returns the :class:`Pending`
    transfers it started, for :func:`wait` (the module's functions of the same names)."""

    COLLECTIVE = ("everyone", "group", "workers", "servers")  # the communicators :meth:`shrink` replaces

    def __init__(self, world: MPI.Comm, group: MPI.Comm, workers: MPI.Comm, servers: MPI.Comm):
        self.world = world      # every rank of the job (the library's own communicator): its messages
        self.everyone = world   # the collectives over every rank (after a lost rank: the survivors')
        self.group = group      # this worker's group (COMM_NULL on a server)
        self.workers = workers  # every worker (COMM_NULL on a server)
        self.servers = servers  # every server (COMM_NULL on a worker)
        self.rank = world.Get_rank()
        self.tag_ub = tag_upper_bound(world)
        self.lost: set[int] = set()  # the world ranks lost (under ULFM), known from a shrink or a failure

    def shrink(self, name: str, timeout: float | None) -> list[int]:
        """Collective over the survivors of communicator ``name`` (one of :attr:`COLLECTIVE`):
        replace it by theirs (:func:`shrink`). Returns the world ranks it lost. Messages keep
        :attr:`world` and its rank numbers: a lost rank only stops answering there."""
        old = getattr(self, name)
        if old == MPI.COMM_NULL:
            return []
        new = shrink(old, timeout, f"shrink of the {name} communicator after a lost rank")
        gone = sorted(set(world_ranks(old)) - set(world_ranks(new)))
        setattr(self, name, new)
        self.lost.update(gone)
        return gone

    def start_send(self, array: np.ndarray, dest: int, tag: int, what: str) -> list[Pending]:
        raise NotImplementedError

    def start_send_announced(self, array: np.ndarray, head: int, dest: int, tag: int, what: str) -> list[Pending]:
        raise NotImplementedError

    def start_recv(self, out: np.ndarray, source: int, tag: int, what: str) -> list[Pending]:
        raise NotImplementedError

    def start_recv_framed(self, out: np.ndarray, head: int, source: int, tag: int, what: str,
                          rest_apart: Callable[[np.ndarray], bool]) -> list[Pending]:
        raise NotImplementedError

    def probe_request(self, tag: int, take: Callable[[int], np.ndarray] | None = None
                      ) -> tuple[int, np.ndarray] | None:
        raise NotImplementedError

    def free(self) -> None:
        """Free its communicators (collective over each)."""
        if self.lost:  # (a communicator that held a lost rank cannot be freed collectively)
            return
        for comm in (self.group, self.workers, self.servers, self.world):
            free(comm)
        if self.everyone is not self.world:
            free(self.everyone)


class MPITransport(Transport):
    """Messages between the ranks of an MPI job (the module's functions over :attr:`world`)."""

    probe_status: MPI.Status | None = None  # the serving loop's status of its probes (made at its first)

    @classmethod
    def split(cls, world: MPI.Comm, group: int, is_worker: bool, timeout: float | None,
              fault_tolerant: bool = False) -> "MPITransport":
        """Collective over ``world``: the transport of a rank of worker group ``group`` (-1: a
        server), with the communicators of its group, of all workers and of all servers.
        ``fault_tolerant``: the collectives over every rank get a communicator of their own, so
        that revoking it (:meth:`Transport.shrink`) leaves the messages' communicator working."""
        # Every rank here before the splits, which block and spin in MPI: a rank still importing
        # would have to share its core with ranks spinning in the first split (0.2-0.6 s of CPU
        # each on an oversubscribed node); this barrier sleeps, and names who never came.
        barrier(world, timeout, "start-up of every rank (communicators)")
        rank = world.Get_rank()
        net = cls(world, split(world, group, rank), split(world, 0 if is_worker else -1, rank),
                  split(world, -1 if is_worker else 0, rank))
        if fault_tolerant:
            net.everyone = dup(world)
        return net

    def start_send(self, array: np.ndarray, dest: int, tag: int, what: str) -> list[Pending]:
        return start_send(self.world, array, dest, tag, what)

    def start_send_announced(self, array: np.ndarray, head: int, dest: int, tag: int, what: str) -> list[Pending]:
        return start_send_announced(self.world, array, head, dest, tag, what)

    def start_recv(self, out: np.ndarray, source: int, tag: int, what: str) -> list[Pending]:
        return start_recv(self.world, out, source, tag, what)

    def start_recv_framed(self, out: np.ndarray, head: int, source: int, tag: int, what: str,
                          rest_apart: Callable[[np.ndarray], bool]) -> list[Pending]:
        return start_recv_framed(self.world, out, head, source, tag, what, rest_apart)

    def probe_request(self, tag: int, take: Callable[[int], np.ndarray] | None = None
                      ) -> tuple[int, np.ndarray] | None:
        if self.probe_status is None:  # (one, reused: requests are probed for by one thread, the serving loop)
            self.probe_status = MPI.Status()
        return probe_request(self.world, tag, take, self.probe_status)


class Loopback(Transport):
    """The transport of a job of one process: rank 0 serves and rank 1 works, both here. A
    message to rank 0 is handed at once to :attr:`deliver` (the server's ``handle(source,
    message)``), which answers it before the send returns: its reply is copied into the receive
    posted for its tag. So every transfer is done when started, and nothing waits. Its
    communicators are duplicates of ``COMM_SELF`` (collectives over this one rank)."""

    SERVER, WORKER = 0, 1

    def __init__(self):
        world = self_comm()
        super().__init__(world, dup(world), dup(world), dup(world))
        self.rank = self.WORKER
        self.deliver: Callable[[int, np.ndarray], None] | None = None
        self.posted: dict[int, tuple[np.ndarray, str]] = {}  # tag -> (the receive's array, what it is)

    def start_send(self, array: np.ndarray, dest: int, tag: int, what: str) -> list[Pending]:
        if dest == self.WORKER:
            out, _ = self.posted.pop(tag)
            out[:] = array  # (a reply: bytes, as many as the worker expects)
            return []
        self.deliver(self.WORKER, array)
        if self.posted:
            raise RuntimeError(f"the in-process server did not answer: {self.posted.popitem()[1][1]} (one worker "
                               f"never waits for another)")
        return []

    def start_send_announced(self, array: np.ndarray, head: int, dest: int, tag: int, what: str) -> list[Pending]:
        return self.start_send(array, dest, tag, what)

    def start_recv(self, out: np.ndarray, source: int, tag: int, what: str) -> list[Pending]:
        self.posted[tag] = (out, what)
        return []

    def start_recv_framed(self, out: np.ndarray, head: int, source: int, tag: int, what: str,
                          rest_apart: Callable[[np.ndarray], bool]) -> list[Pending]:
        return self.start_recv(out, source, tag, what)

    def probe_request(self, tag: int, take: Callable[[int], np.ndarray] | None = None) -> None:
        return None  # (requests are delivered as they are sent)
