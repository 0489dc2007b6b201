"""Every tuned number of hpcps in one place: its value, why, the benchmark that measures it, and an
environment variable that overrides it (``HPCPS_TUNE_<NAME>``), as Horovod keeps its knobs.

A knob is a number chosen by measuring, for speed or memory; it never changes what is computed
(a model trained with any value of a knob is the same, bit for bit). Format and protocol constants
(message tags, status bits, file versions) are not knobs and stay with the code that defines them.

Kernel knobs (``compiled``) are frozen into the numba kernels when they compile, and numba's
on-disk cache does not know about them: when one is overridden, ``hpcps_kernels`` compiles into a
cache directory of its own for that set of overrides (see :func:`compiled_cache_suffix`), so
cached kernels never run with a stale value. Runtime knobs are read by the code that uses them.

This module is pure Python (no numba, no hpcps) so that every layer can import it;
``python -m hpcps_kernels tuning`` prints the table of docs/tuning.md (generated from here, and
checked by tests/test_tuning.py).
"""

from __future__ import annotations

import difflib
import hashlib
import os
from dataclasses import dataclass

ENV_PREFIX = "HPCPS_TUNE_"


@dataclass(frozen=True)
class Knob:
    name: str
    default: int | float
    reason: str
    benchmark: str
    compiled: bool = False  # frozen into numba kernels at compile time
    minimum: int | float = 0

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name

    def read(self, environ) -> int | float:
        """The knob's value: its environment override if set, else its default. A value that is
        not a number of the knob's type, or below its minimum, is an error naming the variable."""
        text = environ.get(self.env)
        if text is None or text.strip() == "":
            return self.default
        kind = type(self.default)
        try:
            value = kind(float(text)) if kind is float else int(text.strip(), 0)
        except ValueError:
            raise ValueError(f"{self.env}={text!r}: expected {'an integer' if kind is int else 'a number'} "
                             f"(default {self.default})") from None
        if not value >= self.minimum:
            raise ValueError(f"{self.env}={text!r}: must be at least {self.minimum} (default {self.default})")
        return value


KERNELS_BENCH = "python -m hpcps_kernels bench"
PS_BENCH = "mpiexec -n 2 hpcps bench ps"

KNOBS = (
    # kernels (compiled)
    Knob("PREFETCH_KEYS", 16, "prefetch distance, in keys, of hash-index probes, direct-index lookups, update "
         "rules and row gathers: far enough to hide a DRAM miss, near enough to stay in L1",
         KERNELS_BENCH + " --kernel hashtable --kernel optim", compiled=True, minimum=1),
    Knob("CACHED_TABLE_BYTES", 1 << 20, "a server's one-pass lookups in a table shard whose index and rows take at "
         "most this many bytes (half of L2) go key by key, without the prefetch pipeline: such a shard stays in "
         "cache between requests, where the stages cost more than the misses they hide (a 1,000-key pull's loop "
         "took twice as long)", PS_BENCH + " --sizes 100,1000", compiled=True),
    Knob("PREFETCH_NONZEROS", 24, "prefetch distance, in nonzeros, of the LR/FM forward-backward's model rows",
         KERNELS_BENCH + " --kernel lr --kernel fm", compiled=True, minimum=1),
    Knob("WIDE_PREFETCH_BYTES", 4096, "update rules on wide rows prefetch this many bytes of rows ahead (at "
         "least 4 keys), not PREFETCH_KEYS rows: more lines in flight than the core tracks only stall it",
         KERNELS_BENCH + " --kernel optim (dim 64)", compiled=True, minimum=64),
    Knob("NARROW_VALUES", 8, "rows of at most this many values get their first cache line prefetched only: "
         "on dim-1 rules the loop over lines cost more than the rare second line saved",
         KERNELS_BENCH + " --kernel optim (dim 1)", compiled=True, minimum=1),
    Knob("HASH_MAX_LOAD", 0.75, "a hash index doubles when its load passes this: probes stay short "
         "(linear probing) at a memory cost of 1/load entries a key", KERNELS_BENCH + " --kernel hashtable",
         compiled=True, minimum=0.1),
    Knob("DEDUP_MIN_SLOTS", 1024, "first size of a batch's scratch table for unique keys: small batches "
         "stay in L1", KERNELS_BENCH + " --kernel unique", compiled=True, minimum=16),
    Knob("DEDUP_MAX_FIRST_SLOTS", 1 << 16, "the scratch table starts at most this large, then doubles as "
         "keys arrive (load <= 1/2): a large batch of repeated keys does not clear a large table",
         KERNELS_BENCH + " --kernel unique", compiled=True, minimum=16),
    Knob("PUSH_SLICE_SCAN_SERVERS", 8, "a push under replicas is sliced by a scan of its keys a server up to "
         "this many servers, else by a counting sort of its keys' copies (the kernel alone, 10,000 keys, 1 "
         "replica, at load 7: the scan 33 us at 2 servers, 50 at 4, 91 at 8; the sort 67-108 us, 110-160 at its "
         "median)", "mpiexec -n 3 hpcps bench ps --replicas 1", compiled=True, minimum=1),
    # kernels (runtime: the server's two threads)
    Knob("PARALLEL_MIN_KEYS", 1 << 16, "pushes of fewer keys (and fewer than PARALLEL_MIN_VALUES values) "
         "run on one thread: handing half to a second thread costs about 0.1-0.3 ms",
         PS_BENCH + " (HPCPS_SERVER_THREADS=1 against 2)", minimum=2),
    Knob("PARALLEL_MIN_VALUES", 1 << 19, "pushes of fewer values (keys x width) and fewer than "
         "PARALLEL_MIN_KEYS keys run on one thread", PS_BENCH + " (HPCPS_SERVER_THREADS=1 against 2)", minimum=2),
    Knob("PARALLEL_MIN_PULL_WORK", 1 << 21, "a pull runs its halves at once from this much work, "
         "keys x (values a key + PULL_KEY_VALUES); its reply is then announced so the worker sleeps",
         PS_BENCH + " (HPCPS_SERVER_THREADS=1 against 2)", minimum=2),
    Knob("PULL_KEY_VALUES", 8, "a key's lookup costs about as much as copying this many values (in a "
         "pull's work)", PS_BENCH + " (HPCPS_SERVER_THREADS=1 against 2)", minimum=0),
    # the parameter server: waits (hpcps.ps.transport)
    Knob("POLL_SPIN_S", 50e-6, "a wait polls without sleeping this long first: a fast answer's latency stays "
         "MPI's", PS_BENCH + " (1,000-key pulls)"),
    Knob("POLL_MIN_SLEEP_S", 20e-6, "then it sleeps, from this long, doubling up to POLL_MAX_SLEEP_S: a "
         "waiting rank leaves its core to the ranks computing", PS_BENCH),
    Knob("POLL_MAX_SLEEP_S", 1e-3, "the longest sleep of a wait's back-off", PS_BENCH),
    Knob("POLL_SHORT_MAX_SLEEP_S", 2e-4, "the longest sleep of a worker's wait for replies in the training "
         "loop (sub-millisecond answers)", "hpcps bench vw (the training loop's examples/s)"),
    Knob("POLL_MAX_ADAPTIVE_SPIN_S", 1e-3, "a serving loop polls without sleeping for twice the recent gap "
         "between its requests where that is at most this long (a longer gap is waited asleep)",
         PS_BENCH + " (100,000-key pushes and pulls)"),
    Knob("SPIN_BYTES_PER_S", 2e9, "a wait for large messages polls without sleeping for as long as their "
         "transfer takes at this rate: MPICH moves a large message only while both sides call into MPI",
         PS_BENCH + " (100,000-key pushes and pulls)", minimum=1.0),
    Knob("SPIN_RESET_BYTES", 1 << 20, "once a message this large of a wait is done (a request's send), the "
         "wait spins only for the rest's transfer: a worker sleeps while the server works", PS_BENCH),
    Knob("SPIN_WHOLE_REPLY_BYTES", 1 << 20, "a worker's wait spins for a reply smaller than this as for a "
         "whole message (only larger pulls are split and their payload sent apart): a worker sleeping "
         "while a reply transfers stretches the transfer", PS_BENCH + " --sizes 1000 --dim 64 (pull)", minimum=0),
    Knob("POLL_ACTIVE_MAX_SLEEP_S", 1e-4, "a serving loop's sleeps stay this short for POLL_ACTIVE_WINDOW_S "
         "after its last work: a step's first request is answered at once, not after a grown back-off",
         "hpcps bench deep (W&D, SSP 2, pipelined)"),
    Knob("POLL_ACTIVE_WINDOW_S", 2e-3, "see POLL_ACTIVE_MAX_SLEEP_S: at least this long, else twice the recent "
         "gap between a serving loop's requests (a step's compute gap)", "hpcps bench deep (W&D, SSP 2, pipelined)"),
    Knob("POLL_ACTIVE_MAX_WINDOW_S", 2e-2, "a serving loop's sleeps stay short for twice the recent gap between "
         "its requests, at most this long (an idle server's sleeps then grow to POLL_MAX_SLEEP_S)",
         "a BSP job's loop_cpu_s_server and time_s (docs/benchmarks.md)"),
    # the parameter server: large messages (hpcps.ps.transport, hpcps.ps.protocol)
    Knob("POOL_MIN_BYTES", 16 << 20, "messages this large and larger go into reused buffers (no page faults of "
         "fresh ones)", PS_BENCH + " --sizes 1000000", minimum=1),
    Knob("POOL_MAX_BYTES", 1 << 30, "the buffers kept for reuse hold at most this much", PS_BENCH, minimum=0),
    Knob("PAGE_BYTES", 4096, "the memory page that placements below are relative to (16 or 64 KiB on some "
         "ARM machines)", PS_BENCH + " --sizes 1000000 --dim 64", minimum=64),
    Knob("MESSAGE_PAGE_OFFSET", 2048, "a large message or pooled buffer starts this far into a page: MPICH's "
         "copy into shared memory ran at a quarter of its speed from a page's first bytes",
         PS_BENCH + " --sizes 1000000 --dim 64"),
    Knob("PLACED_BYTES", 32 << 20, "requests whose gradients take this much are placed in memory (see "
         "MESSAGE_PAGE_OFFSET; glibc's memcpy also slows at some offsets past its source's)",
         PS_BENCH + " --sizes 1000000 --dim 64", minimum=1),
    Knob("PAGE_EDGE_BYTES", 16, "gradients that start within this many bytes of a page's edge are copied "
         "into a placed message rather than sent from their array", PS_BENCH + " --sizes 1000000 --dim 64"),
    Knob("GRADS_APART_BYTES", 1 << 21, "gradients this large go as a message of their own, from the worker's "
         "array (no copy)", PS_BENCH + " (100,000-key pushes)", minimum=1),
    # the parameter server: a shard's index (hpcps.ps.tables, hpcps.ps.store, hpcps.ps.server_table)
    Knob("DIRECT_MAX_BITS", 26, "keys of at most this many bits may be addressed directly (an int32 slot per "
         "possible key: 256 MiB a server at 26 bits) instead of through a hash index",
         KERNELS_BENCH + " --kernel hashtable (direct rows)", minimum=0),
    Knob("DIRECT_AT_ONCE_BITS", 18, "up to this many key bits a shard is addressed directly from its first key",
         KERNELS_BENCH + " --kernel hashtable (direct rows)", minimum=0),
    Knob("DIRECT_FROM_SHIFT", 8, "above, a shard goes direct once it holds 2**(key_bits - this) keys: before, a "
         "hash index costs less memory", KERNELS_BENCH + " --kernel hashtable (direct rows)", minimum=0),
    Knob("FINITE_CHECK_VALUES", 1 << 20, "a table's numbers are checked for NaN and infinities this many at a time "
         "(no temporary array the size of a table)", "mpiexec -n 2 hpcps bench checkpoint", minimum=1),
    Knob("STOP_QUIET_S", 1.0, "on a stop signal, a rank other than the first waits this long before it speaks "
         "for itself (one message for the job, not one a rank)", "tests/test_faults.py (signals)"),
    Knob("MPI_START_UP_TIMEOUT_S", 300.0, "under ULFM, a rank whose MPI start-up has not finished after this "
         "long ends with a line saying so (a rank lost before it finished leaves the others in Open MPI's start-up "
         "for ever); as cluster.stall_timeout_s's default, which is read after MPI has started",
         "tests/test_ulfm.py (a rank lost in start-up)", minimum=1.0),
    Knob("LOST_RANK_QUIET_S", 3.0, "under ULFM, a rank that meets a lost rank it cannot go on without waits this "
         "long before it ends the job itself: meanwhile the first rank alive says it (one line, not one a rank)",
         "tests/test_ulfm.py (a server killed)", minimum=0.0),
    # training
    Knob("PARSE_BLOCK_BYTES", 1 << 30, "a worker's part of a text file is parsed in blocks of at most this "
         "many bytes (usually one): bounds the parse's buffers", "hpcps train with data.memory_mb", minimum=1 << 20),
    Knob("STREAM_BLOCK_BYTES", 64 << 20, "a compressed stream's text (gzip, zstd, ...) is parsed in blocks of at "
         "most this many bytes: its size is not known before it is read, and a block's buffer is made whole "
         "(at PARSE_BLOCK_BYTES, each small .gz file took a zero-filled GiB)", "hpcps train on gzipped part files",
         minimum=1 << 20),
    Knob("EVAL_BATCH_ROWS", 4096, "rows a worker scores at once at least, whatever the training's batch: "
         "fewer, larger pulls", "hpcps eval on a 1M-row test set", minimum=1),
    Knob("STATUS_EVERY_S", 0.2, "supervise's status file is written at most this often",
         "hpcps train under hpcps supervise (status file writes)", minimum=0.0),
    Knob("PARSE_AHEAD_BYTES", 8 << 20, "parsed rows a training stream holds ahead of its steps at most when "
         "nothing keeps its slices (one epoch, or batches kept compacted): more only costs memory, the worker "
         "parses in its waits either way", "hpcps train, 1 and 3 epochs, peak RSS (docs/benchmarks.md)",
         minimum=1 << 16),
)

_BY_NAME = {k.name: k for k in KNOBS}


def _values(environ) -> dict:
    """Every knob's value in ``environ``; a ``HPCPS_TUNE_`` variable that names no knob (a misspelt
    one would leave its knob at the default unseen) is an error naming it, as a misspelt config key is."""
    unknown = sorted(v for v in environ if v.startswith(ENV_PREFIX) and v[len(ENV_PREFIX):] not in _BY_NAME)
    if unknown:
        near = difflib.get_close_matches(unknown[0][len(ENV_PREFIX):], _BY_NAME, 1)
        raise ValueError(f"{unknown[0]}: no such knob" + (f" (did you mean {ENV_PREFIX}{near[0]}?)" if near else "")
                         + "; the knobs are in docs/tuning.md")
    return {k.name: k.read(environ) for k in KNOBS}


VALUES = _values(os.environ)
globals().update(VALUES)  # each knob as a module constant: ``from hpcps_kernels.tuning import PREFETCH_KEYS``


def overridden(environ=os.environ) -> dict:
    """The knobs set in ``environ`` to a value other than their default, by name."""
    values = _values(environ)
    return {n: v for n, v in values.items() if v != _BY_NAME[n].default}


def compiled_cache_suffix(environ=os.environ) -> str:
    """'' when no compiled knob is overridden, else a directory name for the kernels compiled with
    these overrides (the same for every rank of a job)."""
    changed = {n: v for n, v in overridden(environ).items() if _BY_NAME[n].compiled}
    if not changed:
        return ""
    text = ",".join(f"{n}={changed[n]!r}" for n in sorted(changed))
    return "tuned-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def markdown() -> str:
    """The table of docs/tuning.md."""
    lines = ["| knob | default | environment | why | measured by |", "|---|---|---|---|---|"]
    for k in KNOBS:
        default = f"{k.default:,}" if isinstance(k.default, int) and k.default >= 10_000 else repr(k.default)
        kind = " (compiled)" if k.compiled else ""
        lines.append(f"| `{k.name}`{kind} | {default} | `{k.env}` | {k.reason} | `{k.benchmark}` |")
    return "\n".join(lines) + "\n"

