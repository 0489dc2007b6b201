"""The server's plain way for its commonest requests: a pull, a push or a push-pull of one table
whose arrays travel as they are (every key list as its keys, float32 values, the gradients in the
message), served without making a message object where none is kept.

A server's fixed cost per request is mostly Python: making the op's message (a dataclass, its
encoding), dispatching it through the handlers and the consistency check. Here a request is read
from its header's words (:func:`hpcps.ps.protocol.request_words`) and views of its buffer
(:func:`hpcps.ps.protocol.plain_pushed`), and goes to the methods the general path ends in
(:meth:`Server.answer_pull`, ``push_now``, ``_push``, ``_after_clock``), in the same order, so it
does what that path does. Under every consistency model:

* a pull is answered, or kept (as its message) until the clocks allow it;
* a push is applied now (SSP, ASP) or kept for its turn (BSP, as its message), then acknowledged;
* a push-pull advances the sender's clock (or its group's: the flags' clock workers) and, with
  in-pull marks (``IN_PULL``, a training step's request) where nothing else waits, updates the
  rows the pull reads, answers, and updates the others after the reply; else it applies or keeps
  its push, serves what the clock allows, and answers or defers its pull.

A plain way declines (returns False) where anything else applies, and the request then takes the
general way (:meth:`Server.handle`): key lists, 16-bit values, gradients apart, any other op.
"""

from __future__ import annotations

import time

import numpy as np

from hpcps.ps import protocol

PULL, PUSH, PUSHPULL = protocol.PULL, protocol.PUSH, protocol.PUSHPULL
IN_PULL = protocol.IN_PULL
# the flags a push-pull may have and still take the plain way: its in-pull marks, its group's clock
PLAIN_PUSH_PULL_FLAGS = IN_PULL | -(1 << protocol.CLOCK_WORKERS_SHIFT)


class PlainRequests:
    """How a :class:`~hpcps.ps.server.Server` takes a request: its plain way, or its op's handler
    (a mixin: the server's tables, clocks, handlers and replies)."""

    def handle(self, source: int, buf: np.ndarray, grads: np.ndarray | None = None, words: tuple | None = None) -> None:
        """Serve request ``buf`` from rank ``source`` (``grads``: its gradients, when they came
        apart; ``words``: its header's, where read): the plain way where it applies, else as its
        op's message by its op's handler."""
        if words is None:
            words = protocol.request_words(buf)
        stats = self.stats
        stats["requests"] += 1
        plain = self.plain.get(words[0])
        if plain is None or not plain(source, buf, words):
            stats["general_requests"] += 1
            try:
                r = protocol.unpack_request(buf, self.dims, grads, self.key_lists, words)
            except ValueError as e:
                raise RuntimeError(f"server {self.index}: {e} from rank {source}") from None
            self.handlers[r.op](source, r)
        if self.backlog:
            self.apply_backlog()  # (replicas: the backups' part of its pushes, once it is answered)

    def plain_handlers(self) -> dict:
        """op -> its plain way, ``way(source, buf, words) -> served`` (False: take the general way)."""
        return {PULL: self._plain_pull, PUSH: self._plain_push, PUSHPULL: self._plain_push_pull}

    def _plain_pull(self, source: int, buf: np.ndarray, words: tuple) -> bool:
        """A pull answered now, or kept until the clocks allow it."""
        _, table, req_id, _, n, clock, worker, _, flags = words
        if flags:
            return False
        keys = protocol.plain_keys(buf, protocol.HEADER_BYTES, n)
        if self.workers.readable(clock):
            self.answer_pull(source, PULL, req_id, table, keys)
        else:
            self._defer_plain(source, protocol.Pull(table, req_id, clock, worker, keys))
        return True

    def _plain_push(self, source: int, buf: np.ndarray, words: tuple) -> bool:
        """A push applied now (SSP, ASP) or kept for its turn (BSP), then acknowledged."""
        _, table, req_id, n, _, clock, sender, _, flags = words
        if flags:
            return False
        if n:
            keys, grads, _ = protocol.plain_pushed(buf, n, 0, self.dims[table])
            self._plain_push_part(source - self.worker_rank0, table, req_id, clock, sender, keys, grads)
        self.quick.ack(source, req_id, table)
        return True

    def _plain_push_part(self, worker: int, table: int, req_id: int, clock: int, sender: int, keys: np.ndarray,
                         grads: np.ndarray) -> None:
        """A push's keys applied now (SSP, ASP: no message made), or kept for their turn (BSP)."""
        if self.staleness:
            if not self.quick.push(worker, table, keys, grads, clock):
                self.push_now(worker, table, keys, grads, clock)
        else:
            self._push(worker, protocol.Push(table, req_id, clock, sender, keys, grads))

    def _plain_push_pull(self, source: int, buf: np.ndarray, words: tuple) -> bool:
        """The push at clock c, the sender's clock (or its group's) to c + 1, then the pull at
        c + 1 + ahead, as :meth:`Server._push_pull` does them: with in-pull marks and nothing else
        waiting, the pulled part of the push first and the rest after the reply."""
        _, table, req_id, n_push, n_pull, clock, sender, ahead, flags = words
        if flags & ~PLAIN_PUSH_PULL_FLAGS:
            return False
        if self.quick.steps.push_pull(source, buf, words):
            return True  # (ASP, SSP: to a pull's slots, in fewer steps: hpcps.ps.quick_steps)
        worker, dim = source - self.worker_rank0, self.dims[table]
        keys, grads, pull_keys = protocol.plain_pushed(buf, n_push, n_pull, dim)
        pull_clock = clock + 1 + ahead
        self._advance(worker, protocol.clock_workers_of(flags), clock)
        if flags & IN_PULL and self._answers_at_once(n_push, clock, sender, pull_clock):
            in_pull = protocol.plain_in_pull(buf, n_push, n_pull, dim)
            if self.quick.steps.step(source, PUSHPULL, req_id, table, keys, grads, in_pull, pull_keys):
                return True  # (the same, in fewer steps: hpcps.ps.quick_steps)
            rest = self.push_now(worker, table, keys, grads, clock, in_pull)
            self.answer_pull(source, PUSHPULL, req_id, table, pull_keys)
            if rest is not None:
                self.tables[table].apply_after_reply(rest)
            return True
        if n_push:
            self._plain_push_part(worker, table, req_id, clock, sender, keys, grads)
        self._after_clock()
        if n_pull == 0 or self.workers.readable(pull_clock):
            self.answer_pull(source, PUSHPULL, req_id, table, pull_keys)
        else:  # (its message, made now: read when the clocks allow it)
            self._defer_plain(source, protocol.unpack_request(buf, self.dims, words=words))
        return True

    def _defer_plain(self, source: int, r: protocol.Message) -> None:
        self.workers.defer(source, r, time.monotonic())
        self.stats["deferred"] += 1
