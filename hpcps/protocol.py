"""Wire format of parameter-server messages (pure: NumPy buffers, no MPI).

Every request is one message of bytes: a header of ``HEADER_WORDS`` int64 followed by the keys
(uint64) and, for a push, the gradients (float32, ``n x dim``). Every reply is one message: a
header of ``REPLY_WORDS`` int64 followed, for a pull, by the values (float32, ``n x dim``). One
message per request keeps matching trivial (a server receives whole requests with ``ANY_SOURCE``;
a worker pre-posts the receive of each reply under a tag unique to that request) and needs no
pickling. Requests are split by the client so that no message exceeds 2 GiB.

Request header: ``[op, table, req_id, n, clock, worker, 0, 0]``.
Reply header:   ``[req_id, status, min_clock, server]`` — ``min_clock`` is the smallest clock of
all workers that the server knew when it answered (the staleness a pull observed is
``clock - min_clock``); ``status`` bit ``STOP``: the server got a stop signal. There is no error
status: a server that fails aborts the whole job (``hpcps.transport.install_abort_handler``), so no
worker waits for an answer that will not come.
A checkpoint request carries the directory's path in its key area; its reply carries the size
and checksum of the file the server wrote.
"""

from __future__ import annotations

import numpy as np

PULL, PUSH, CLOCK, DONE, CHECKPOINT = 1, 2, 3, 4, 5
OP_NAMES = {PULL: "pull", PUSH: "push", CLOCK: "clock", DONE: "done", CHECKPOINT: "checkpoint"}
HEADER_WORDS = 8
REPLY_WORDS = 4
HEADER_BYTES = 8 * HEADER_WORDS
REPLY_BYTES = 8 * REPLY_WORDS
TAG_REQUEST = 1
TAG_REPLY_BASE = 16
OK = 0
STOP = 2         # status bit: this server received a stop signal (SIGUSR1/SIGTERM)
CHECKPOINT_REPLY = 8 + 64   # file size (int64) + the file's checksum in hex (zero-padded)


def reply_tag(req_id: int, tag_ub: int) -> int:
    """The tag of the reply to request ``req_id`` (unique among a worker's requests in flight)."""
    return TAG_REPLY_BASE + req_id % (tag_ub - TAG_REPLY_BASE)


def request_bytes(op: int, n: int, dim: int) -> int:
    return HEADER_BYTES + 8 * n + (4 * n * dim if op == PUSH else 0)


def reply_bytes(op: int, n: int, dim: int) -> int:
    if op == CHECKPOINT:
        return REPLY_BYTES + CHECKPOINT_REPLY
    return REPLY_BYTES + (4 * n * dim if op == PULL else 0)


def encode_path(path: str) -> np.ndarray:
    """A path as uint64 words (sent in a request's key area)."""
    raw = path.encode()
    raw += b"\0" * (-len(raw) % 8)
    return np.frombuffer(raw, dtype=np.uint64).copy()


def decode_path(words: np.ndarray) -> str:
    return words.tobytes().rstrip(b"\0").decode()


def pack_request(op: int, table: int, req_id: int, clock: int, worker: int,
                 keys: np.ndarray | None = None, grads: np.ndarray | None = None, dim: int = 0) -> np.ndarray:
    n = 0 if keys is None else keys.shape[0]
    buf = np.empty(request_bytes(op, n, dim), dtype=np.uint8)
    buf[:HEADER_BYTES].view(np.int64)[:] = (op, table, req_id, n, clock, worker, 0, 0)
    if n:
        buf[HEADER_BYTES:HEADER_BYTES + 8 * n].view(np.uint64)[:] = keys
        if op == PUSH:
            buf[HEADER_BYTES + 8 * n:].view(np.float32)[:] = grads.reshape(-1)
    return buf


def unpack_request(buf: np.ndarray, dims: list[int]):
    """(header int64[8], keys uint64 view, grads float32 (n, dim) view or None)."""
    h = buf[:HEADER_BYTES].view(np.int64)
    op, table, n = int(h[0]), int(h[1]), int(h[3])
    keys = buf[HEADER_BYTES:HEADER_BYTES + 8 * n].view(np.uint64)
    grads = None
    if op == PUSH:
        dim = dims[table]
        grads = buf[HEADER_BYTES + 8 * n:HEADER_BYTES + 8 * n + 4 * n * dim].view(np.float32).reshape(n, dim)
    return h, keys, grads


def max_keys_per_message(dim: int, max_bytes: int) -> int:
    """Most keys one push or pull message may carry under ``max_bytes``."""
    return max(1, (max_bytes - HEADER_BYTES) // (8 + 4 * dim))
