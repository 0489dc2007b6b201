"""The server side: table shards, optimizers, worker clocks and the serving loop.

A server rank owns, for every declared table, the keys of the virtual shards placed on it
(:mod:`hpcps.placement`). Each table shard is a :class:`~hpcps_kernels.hashtable.KeyIndex` (key →
slot) plus a float32 array of slot rows ``[parameters | optimizer state]``.

Semantics a worker can rely on:

* A pull of a key never pushed returns the table's initializer for that key and creates nothing.
* A push creates missing keys (initializer, then the update) and applies the optimizer to each
  key once per push: the client merges duplicate keys by summing their gradients before sending.
* Requests from one worker are applied in the order it sent them.
* Consistency: the server knows every worker's clock. A pull sent at clock ``c`` is answered only
  once every worker has clocked at least ``c - staleness`` (BSP: staleness 0; ASP: staleness < 0,
  never waits). A worker sends its pushes before its clock message, so under BSP a pull sees
  exactly the updates of all earlier iterations.
* Determinism under BSP: pushes are acknowledged on arrival but applied, once every worker has
  passed their clock, in the order (clock, worker, sequence), so the result never depends on
  which message arrived first (with FTRL or AdaGrad the order changes the numbers, not only
  their rounding). A push is thus not visible to pulls of its own iteration. Under SSP and ASP
  pushes are applied on arrival.

The loop never spins: it polls for requests and sleeps between polls with an exponential
back-off (:mod:`hpcps.transport`), so an idle server costs almost no CPU.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from hpcps import checkpoint, protocol, signals, transport
from hpcps.placement import Placement
from hpcps.tables import TableSpec
from hpcps_kernels import init as kinit
from hpcps_kernels import optim
from hpcps_kernels.hashtable import KeyIndex


class ServerTable:
    """One table's shard on this server."""

    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.index = KeyIndex()
        self.rows = np.zeros((self.index.key_capacity, spec.width), dtype=np.float32)
        self.kind = kinit.KINDS[spec.init]
        self.state = optim.state_init(spec.optimizer, spec.dim, spec.params.get("initial_accumulator", 0.0))

    @property
    def size(self) -> int:
        return self.index.size

    def pull(self, keys: np.ndarray, out: np.ndarray) -> None:
        """Values of ``keys`` into ``out`` (n, dim)."""
        slots = self.index.lookup(keys)
        s = self.spec
        kinit.pull_rows(self.rows, slots, keys, s.dim, self.kind, s.init_scale, s.seed, out)

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """Apply one update per key (keys unique within a push)."""
        s = self.spec
        first_new = self.index.size
        slots = self.index.lookup_or_insert(keys)
        if self.index.key_capacity > self.rows.shape[0]:
            rows = np.zeros((self.index.key_capacity, s.width), dtype=np.float32)
            rows[:first_new] = self.rows[:first_new]
            self.rows = rows
        if self.index.size > first_new:
            kinit.create_rows(self.rows, slots, keys, first_new, s.dim, self.kind, s.init_scale, s.seed, self.state)
        p = s.params
        if s.optimizer == "sgd":
            optim.sgd(self.rows, slots, grads, p["lr"], p["l2"])
        elif s.optimizer == "adagrad":
            optim.adagrad(self.rows, slots, grads, p["lr"], p["eps"], p["l2"])
        elif s.optimizer == "ftrl":
            optim.ftrl(self.rows, slots, grads, p["alpha"], p["beta"], p["l1"], p["l2"])
        else:
            optim.adam(self.rows, slots, grads, p["lr"], p["beta1"], p["beta2"], p["eps"], p["l2"])

    def load(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Replace the contents with ``keys`` and their rows (restoring a checkpoint)."""
        self.index = KeyIndex.from_keys(np.ascontiguousarray(keys, dtype=np.uint64))
        self.rows = np.zeros((self.index.key_capacity, self.spec.width), dtype=np.float32)
        self.rows[: keys.shape[0]] = rows

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, rows) of everything stored, in slot order (views)."""
        n = self.index.size
        return self.index.keys[:n], self.rows[:n]

    def nbytes(self) -> int:
        return self.index.nbytes() + self.rows.nbytes


class Server:
    """The serving loop of one server rank."""

    def __init__(self, comm, server_index: int, num_workers: int, worker_rank0: int,
                 specs: list[TableSpec], placement: Placement, staleness: int,
                 stall_warn_s: float = 30.0):
        self.comm = comm
        self.index = server_index
        self.num_workers = num_workers
        self.worker_rank0 = worker_rank0
        self.tables = [ServerTable(s) for s in specs]
        self.dims = [s.dim for s in specs]
        self.placement = placement
        self.staleness = staleness
        self.stall_warn_s = stall_warn_s
        self.clocks = np.zeros(num_workers, dtype=np.int64)
        self.done = np.zeros(num_workers, dtype=bool)
        self.deferred: list[tuple[int, np.ndarray, float]] = []  # (source, request buffer, since)
        self.buffered: list[tuple[int, int, int, np.ndarray]] = []  # BSP: (clock, worker, seq, request)
        self.seq = 0
        self.sending: list[transport.Pending] = []
        self.tag_ub = transport.tag_upper_bound(comm)
        self.stats = {"requests": 0, "idle_s": 0.0, "busy_s": 0.0, "deferred": 0}

    # -- consistency -------------------------------------------------------------------------

    def min_clock(self) -> int:
        live = self.clocks[~self.done]
        return int(live.min()) if live.size else int(self.clocks.max(initial=0))

    def _ready(self, op: int, clock: int) -> bool:
        """A pull waits for clock - staleness; a checkpoint for every worker to reach its clock."""
        if op == protocol.CHECKPOINT:
            return clock <= self.min_clock()
        return self.staleness < 0 or clock - self.staleness <= self.min_clock()

    def restore(self, ckpt: str, manifest: dict) -> None:
        """Load this server's shards of every table (under the current placement) and the clock."""
        for table in self.tables:
            keys, rows = checkpoint.read_for_server(ckpt, manifest, table.spec.name, self.index,
                                                    self.placement.shard_server, self.placement.num_servers)
            table.load(keys, rows)
        self.clocks[:] = manifest["clock"]

    def _write_checkpoint(self, source: int, buf: np.ndarray) -> None:
        h, words, _ = protocol.unpack_request(buf, self.dims)
        path = checkpoint.server_file(protocol.decode_path(words), self.index)
        parts = [(table.spec.name, *table.items()) for table in self.tables]
        try:
            size, digest = checkpoint.write_server_file(path, self.index, self.placement.num_servers,
                                                        self.placement.num_shards, parts)
        except OSError as e:
            why = "No space left on device" if e.errno == 28 else (e.strerror or str(e)).splitlines()[0]
            raise checkpoint.CheckpointError(
                f"server {self.index} cannot write its checkpoint file {path}: {why}; the checkpoints "
                f"committed before it are intact") from None
        reply = self._reply(source, int(h[2]), protocol.CHECKPOINT_REPLY)
        reply[protocol.REPLY_BYTES:protocol.REPLY_BYTES + 8].view(np.int64)[0] = size
        text = digest.encode()[:protocol.CHECKPOINT_REPLY - 8]
        reply[protocol.REPLY_BYTES + 8:] = 0
        reply[protocol.REPLY_BYTES + 8:protocol.REPLY_BYTES + 8 + len(text)] = np.frombuffer(text, dtype=np.uint8)
        self._send(reply, source, int(h[2]), "checkpoint reply")

    # -- requests ----------------------------------------------------------------------------

    def _reply(self, source: int, req_id: int, payload_bytes: int) -> np.ndarray:
        buf = np.empty(protocol.REPLY_BYTES + payload_bytes, dtype=np.uint8)
        status = protocol.STOP if signals.requested() else protocol.OK
        buf[:protocol.REPLY_BYTES].view(np.int64)[:] = (req_id, status, self.min_clock(), self.index)
        return buf

    def _send(self, buf: np.ndarray, dest: int, req_id: int, what: str) -> None:
        self.sending.extend(transport.start_send(self.comm, buf, dest, protocol.reply_tag(req_id, self.tag_ub), what))

    def _serve_pull(self, source: int, buf: np.ndarray) -> None:
        h, keys, _ = protocol.unpack_request(buf, self.dims)
        table, req_id, n = int(h[1]), int(h[2]), int(h[3])
        dim = self.dims[table]
        reply = self._reply(source, req_id, 4 * n * dim)
        out = reply[protocol.REPLY_BYTES:].view(np.float32).reshape(n, dim)
        self.tables[table].pull(keys, out)
        self._send(reply, source, req_id, "pull reply")

    def handle(self, source: int, buf: np.ndarray) -> None:
        h, keys, grads = protocol.unpack_request(buf, self.dims)
        op = int(h[0])
        worker = source - self.worker_rank0
        self.stats["requests"] += 1
        if op in (protocol.PULL, protocol.CHECKPOINT):
            clock = int(h[4])
            if self._ready(op, clock):
                self._serve_deferrable(op, source, buf)
            else:
                self.deferred.append((source, buf, time.monotonic()))
                self.stats["deferred"] += 1
        elif op == protocol.PUSH:
            if self.staleness == 0:
                self.seq += 1
                self.buffered.append((int(h[4]), worker, self.seq, buf))
            else:
                self.tables[int(h[1])].push(keys, grads)
            self._send(self._reply(source, int(h[2]), 0), source, int(h[2]), "push ack")
        elif op == protocol.CLOCK:
            self.clocks[worker] = max(self.clocks[worker], int(h[4]))
            self._apply_buffered()
            self._release_deferred()
        elif op == protocol.DONE:
            self.done[worker] = True
            self._apply_buffered()
            self._release_deferred()
        else:
            raise RuntimeError(f"server {self.index}: unknown request op {op} from rank {source}")

    def _apply_buffered(self) -> None:
        """BSP: apply, in (clock, worker, seq) order, the pushes of clocks every worker has passed."""
        if not self.buffered:
            return
        limit = self.min_clock() if not self.done.all() else np.iinfo(np.int64).max
        ready = sorted((b for b in self.buffered if b[0] < limit), key=lambda b: b[:3])
        if not ready:
            return
        self.buffered = [b for b in self.buffered if b[0] >= limit]
        for _, _, _, buf in ready:
            h, keys, grads = protocol.unpack_request(buf, self.dims)
            self.tables[int(h[1])].push(keys, grads)

    def _release_deferred(self) -> None:
        if not self.deferred:
            return
        keep = []
        for source, buf, since in self.deferred:
            h = buf[:protocol.HEADER_BYTES].view(np.int64)
            if self._ready(int(h[0]), int(h[4])):
                self._serve_deferrable(int(h[0]), source, buf)
            else:
                keep.append((source, buf, since))
        self.deferred = keep

    def _serve_deferrable(self, op: int, source: int, buf: np.ndarray) -> None:
        if op == protocol.PULL:
            self._serve_pull(source, buf)
        else:
            self._write_checkpoint(source, buf)

    def _check_stalled_pulls(self, warned: set) -> None:
        now = time.monotonic()
        for source, buf, since in self.deferred:
            if now - since > self.stall_warn_s and id(buf) not in warned:
                warned.add(id(buf))
                h = buf[:protocol.HEADER_BYTES].view(np.int64)
                clock = int(h[4])
                need = clock if int(h[0]) == protocol.CHECKPOINT else clock - self.staleness
                behind = [int(w) + self.worker_rank0 for w in np.flatnonzero((self.clocks < need) & ~self.done)]
                sys.stderr.write(
                    f"hpcps: server {self.index} (rank {self.comm.Get_rank()}): {protocol.OP_NAMES[int(h[0])]} from rank {source} at clock "
                    f"{clock} waits {now - since:.0f} s for rank(s) {behind} to reach clock {need} "
                    f"(staleness {self.staleness})\n")
                sys.stderr.flush()

    # -- loop --------------------------------------------------------------------------------

    def serve(self) -> dict:
        """Serve until every worker has sent DONE; returns statistics."""
        poll = transport.Poller()
        warned: set = set()
        last_check = time.monotonic()
        last_request = (time.perf_counter(), time.process_time())
        self.stats.update(idle_gap_wall_s=0.0, idle_gap_cpu_s=0.0)
        while not self.done.all() or self.deferred or self.buffered:
            got = transport.probe_request(self.comm, protocol.TAG_REQUEST)
            if got is None:
                if self.sending:
                    self.sending = transport.completed(self.sending)
                now = time.monotonic()
                if now - last_check > 1.0:
                    self._check_stalled_pulls(warned)
                    last_check = now
                self.stats["idle_s"] += poll.idle()
                continue
            t = time.perf_counter()
            cpu = time.process_time()
            if t - last_request[0] > 0.5:  # a quiet spell: what did waiting cost?
                self.stats["idle_gap_wall_s"] += t - last_request[0]
                self.stats["idle_gap_cpu_s"] += cpu - last_request[1]
            source, buf = got
            self.handle(source, buf)
            self.stats["busy_s"] += time.perf_counter() - t
            # keep polling without sleep while the replies just queued should be in transfer
            poll.reset(sum(p.nbytes for p in self.sending))
            last_request = (time.perf_counter(), time.process_time())
        transport.wait(self.sending, timeout=300)
        self.sending = []
        self.stats["keys"] = [t.size for t in self.tables]
        return self.stats
