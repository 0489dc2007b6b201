"""The server's plain way for its commonest requests: a pull, a push or a push-pull of one table
whose arrays travel as they are (flags 0: every key list as its keys, float32 values, the
gradients in the message, the sender's own clock), served without making a message object.

A server's fixed cost per request is mostly Python: making the op's message (a dataclass, its
encoding), dispatching it through the handlers and the consistency check. Here a request is read
from its header's words (:func:`hpcps.ps.protocol.request_words`) and views of its buffer
(:func:`hpcps.ps.protocol.plain_pushed`), and goes to the methods the general path ends in
(:meth:`Server.answer_pull`, ``push_now``, ``_after_clock``), in the same order, so it does what
that path does. A plain way declines (returns False) where anything else applies, and the request
then takes the general way (:meth:`Server.handle`):

* a pull whose clock the consistency model does not allow yet (it waits as a message object);
* a push or a push-pull under BSP, whose pushes are kept for their turn (as message objects);
* any request with flags: key lists, 16-bit values, gradients apart, in-pull marks, a group's clock.

A push-pull's pull that must wait after its push is deferred as the general path defers it, its
message made then.
"""

from __future__ import annotations

import time

import numpy as np

from hpcps.ps import protocol

PULL, PUSH, PUSHPULL = protocol.PULL, protocol.PUSH, protocol.PUSHPULL


class PlainRequests:
    """How a :class:`~hpcps.ps.server.Server` takes a request: its plain way, or its op's handler
    (a mixin: the server's tables, clocks, handlers and replies)."""

    def handle(self, source: int, buf: np.ndarray, grads: np.ndarray | None = None, words: tuple | None = None) -> None:
        """Serve request ``buf`` from rank ``source`` (``grads``: its gradients, when they came
        apart; ``words``: its header's, where read): the plain way where it applies, else as its
        op's message by its op's handler."""
        if words is None:
            words = protocol.request_words(buf)
        self.stats["requests"] += 1
        plain = self.plain.get(words[0])
        if plain is None or not plain(source, buf, words):
            try:
                r = protocol.unpack_request(buf, self.dims, grads, self.key_lists, words)
            except ValueError as e:
                raise RuntimeError(f"server {self.index}: {e} from rank {source}") from None
            self.handlers[r.op](source, r)
        self.apply_backlog()  # (replicas: the backups' part of its pushes, once it is answered)

    def plain_handlers(self) -> dict:
        """op -> its plain way, ``way(source, buf, words) -> served`` (False: take the general way)."""
        return {PULL: self._plain_pull, PUSH: self._plain_push, PUSHPULL: self._plain_push_pull}

    def _plain_pull(self, source: int, buf: np.ndarray, words: tuple) -> bool:
        _, table, req_id, _, n, clock, _, _, flags = words
        if flags or not self.workers.readable(clock):
            return False
        self.answer_pull(source, PULL, req_id, table, protocol.plain_keys(buf, protocol.HEADER_BYTES, n))
        return True

    def _plain_push(self, source: int, buf: np.ndarray, words: tuple) -> bool:
        """A push applied now (SSP, ASP), then acknowledged."""
        _, table, req_id, n, _, clock, _, _, flags = words
        if flags or self.staleness == 0:
            return False
        if n:
            keys, grads, _ = protocol.plain_pushed(buf, n, 0, self.dims[table])
            self.push_now(source - self.worker_rank0, table, keys, grads, clock)
        self.replies.ack(source, req_id, table, "push ack")
        return True

    def _plain_push_pull(self, source: int, buf: np.ndarray, words: tuple) -> bool:
        """The push at clock c applied now (SSP, ASP), the sender's clock to c + 1, then the pull
        at c + 1 + ahead answered (or deferred, as a message, until the clocks allow it)."""
        _, table, req_id, n_push, n_pull, clock, _, ahead, flags = words
        if flags or self.staleness == 0:
            return False
        worker = source - self.worker_rank0
        keys, grads, pull_keys = protocol.plain_pushed(buf, n_push, n_pull, self.dims[table])
        self.workers.advance(worker, clock + 1)
        if n_push:
            self.push_now(worker, table, keys, grads, clock)
        self._after_clock()
        if n_pull == 0 or self.workers.readable(clock + 1 + ahead):
            self.answer_pull(source, PUSHPULL, req_id, table, pull_keys)
        else:
            self.workers.defer(source, protocol.unpack_request(buf, self.dims, words=words), time.monotonic())
            self.stats["deferred"] += 1
        return True
