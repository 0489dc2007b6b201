"""Wire format of parameter-server messages (pure: NumPy buffers, no MPI), defined in one place.

Every request is one message of bytes: a header (:data:`REQUEST`, a NumPy structured dtype) and
then its op's arrays. Each op has its class (:class:`Pull`, :class:`Push`, :class:`PushPull`,
:class:`Clock`, :class:`Done`, :class:`Checkpoint`, :class:`Margins`, :class:`Residuals`,
:class:`Call`), whose fields are named for what they are and whose ``pack`` and ``unpack`` are the
one place its message is written and read (:func:`unpack_request` picks the class). A push-pull's
arrays, in order: the pushed keys (uint64, ``n_push``), their gradients (float32, ``n_push x dim``)
and the pulled keys (uint64, ``n_pull``); large gradients follow as a second message
(``GRADS_APART``, below). Every reply is one message: a header (:data:`REPLY`) followed by the
pulled values (float32, ``n_pull x dim``) or, for a checkpoint, by :data:`CHECKPOINT_RESULT`; a
reply whose header has ``flags`` bit :data:`PAYLOAD_APART` goes as two messages instead, its
header, then its payload (see :func:`payload_apart`). One message per request
keeps matching trivial (a server receives whole requests with ``ANY_SOURCE``; a worker pre-posts
the receive of each reply under a tag unique to that request) and needs no pickling. Requests are
split by the client so that no message exceeds 2 GiB.

Operations:

* ``PULL`` (keys at ``clock``), ``PUSH`` (gradients computed at ``clock``), ``CLOCK`` (the worker
  has reached ``clock``), ``DONE``;
* ``PUSHPULL`` (ps-lite's ZPushPull, one round trip per step): the gradients of step ``clock``,
  then the worker's clock advances to ``clock + 1``, then a pull of the next step's keys at that
  clock. Exactly PUSH(clock), CLOCK(clock + 1), PULL(clock + 1) in one message; its reply is also
  the push's acknowledgement. Sent to every server (each gets the clock), with empty parts where a
  server owns none of the keys. The op's word (``reserved``) is ``ahead``: the pull reads at ``clock + 1 + ahead``
  (``train.pull_early`` pulls the batch after the next one, ``ahead`` = 1). With ``flags`` bit
  ``IN_PULL``, ``ceil(n_push / 8)`` bytes follow the pull keys: bit ``i`` (little-endian within a
  byte) says whether pushed key ``i`` is among this request's pulled keys. The server may then
  apply the push's other keys after it has replied (nothing it replies reads them), so the
  worker's wait is shorter by that part of the push. The flags from bit ``CLOCK_WORKERS_SHIFT``
  on, where not 0: the clock advance is that of as many workers from the sender on (a worker
  group's first rank, whose push carries the group's merged gradients and whose pull the group's
  keys: ``train.group_pull``; the others send nothing that step).
* Large gradients (:data:`GRADS_APART_BYTES`, a ``PUSH`` or ``PUSHPULL`` to a server rank) go
  apart: with ``flags`` bit ``GRADS_APART`` the message holds no gradients, and they follow from
  the same rank as a second message of exactly ``n_push x dim`` float32 under ``TAG_GRADS``, sent
  from the worker's own array, without a copy into the request. A server receives them right
  after the request, so each request's gradients are the next ``TAG_GRADS`` message from its rank.
* ``CHECKPOINT``: the directory's path, UTF-8, after the header (``n_pull`` 8-byte words); its reply
  carries the size and checksum of the file the server wrote.
* ``MARGINS`` (computation on the servers): a batch's nonzeros that this server owns, ``n_push``
  of them, as keys (uint64), values (float32) and row numbers (int32), for a batch of ``n_pull``
  rows, read at ``clock`` like a pull. The reply holds each row's partial sums (float64,
  ``n_pull x margin_width(dim)``): for a dim-1 table (LR) the sum of weight x value over the
  server's nonzeros of the row; for an FM table (dim 1 + k) ``[sum w x, sum V_f x (k), sum
  (V_f x)^2]``. The server keeps the nonzeros for the ``RESIDUALS`` that follows.
* ``RESIDUALS``: per row of the worker's last ``MARGINS``, float64 ``n_pull x dim``: d loss /
  d margin (LR), and for an FM the row's ``sum V_f x`` over all servers after it. The server turns
  them into per-key gradients of its nonzeros and pushes them at ``clock``, then the worker's
  clock advances to ``clock + 1`` (like a push-pull without a pull). Its reply is the
  acknowledgement. Weights never leave the servers.
* ``PULLS`` and ``PUSHPULLS``: a :class:`Pull` and a :class:`PushPull` of several tables over the
  same keys (a step of a tune grid or a deep model touches every table at the batch's keys), one
  message instead of one per table (:class:`TablesPushPull`). Its reply carries each table's
  counts and pulled values (:func:`tables_reply_bytes`, :func:`tables_reply_parts`). The traffic
  filters apply to it as to a table's own requests (flags as below, and ``TABLE_PUSHES``: each
  table pushes its own subset of the keys, behind the significance filter).
* ``PLACED`` (a worker to every server, after a lost server whose shards get new backups): from
  this message on, the worker sends its pushes under the placement without server ``reserved``;
  ``clock`` is its clock then (every push it sent before has a clock no later). ``COPY`` (a server
  to a server): new backup copies of whole shards, their rows as the source applied them up to
  ``clock`` (every push of an earlier clock, none of a later one): see :class:`Copy` and
  :mod:`hpcps.ps.rereplication`.
* ``STOPPING`` (a worker to every server, under backup workers): the worker saw a stop signal
  (``reserved``: its number) and joins the workers' agreement on it; the server reports it as its
  own (``STOP`` in its replies) and answers every read at once until the signal's checkpoint, so
  that no worker waits for those in the agreement (:mod:`hpcps.train.quorum_checkpoints`).
* ``CALL``: a registered server function (the op's word, ``reserved``: its number, in declaration order) over
  ``n_push`` keys (uint64) with ``n_pull`` float32 arguments each; read at ``clock`` like a pull.
  The reply holds its float32 results: a row per key, or one reduction.

``min_clock`` in a reply is the smallest clock of all workers that the server knew when it answered
(the staleness a pull observed is ``clock - min_clock``). ``table_keys``, ``admitted`` and
``evicted``: the request's table on that server (rows held, keys admitted and rows evicted so far),
which the worker's progress line and metrics report while training. ``status`` bit ``STOP``: the server got a
stop signal, and ``INTERRUPT`` with it: that signal was SIGINT. There is no error status: a server that fails aborts the whole job
(``hpcps.ps.transport.install_abort_handler``), so no worker waits for an answer that will not come.
"""

from __future__ import annotations

import signal
import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from hpcps.ps import filters
from hpcps_kernels.tuning import GRADS_APART_BYTES, MESSAGE_PAGE_OFFSET, PAGE_BYTES, PAGE_EDGE_BYTES, PLACED_BYTES


PULL, PUSH, CLOCK, DONE, CHECKPOINT, PUSHPULL, MARGINS, RESIDUALS, CALL = 1, 2, 3, 4, 5, 6, 7, 8, 9
PULLS, PUSHPULLS = 10, 11  # a pull and a push-pull of several tables over the same keys
PLACED, COPY = 12, 13  # after a lost server: a worker's switch to the new placement; new backups' rows
STOPPING = 14  # backup workers: a worker saw a stop signal (the signal's number: the reserved word)
OP_NAMES = {PULL: "pull", PUSH: "push", CLOCK: "clock", DONE: "done", CHECKPOINT: "checkpoint",
            PUSHPULL: "push-pull", MARGINS: "margins", RESIDUALS: "residuals", CALL: "call",
            PULLS: "tables pull", PUSHPULLS: "tables push-pull", PLACED: "placed", COPY: "copy",
            STOPPING: "stopping"}

REQUEST = np.dtype([("op", "<i8"), ("table", "<i8"), ("req_id", "<i8"), ("n_push", "<i8"),
                    ("n_pull", "<i8"), ("clock", "<i8"), ("worker", "<i8"), ("reserved", "<i8"),
                    ("flags", "<i8")])
REPLY = np.dtype([("req_id", "<i8"), ("status", "<i8"), ("min_clock", "<i8"), ("server", "<i8"),
                  ("table_keys", "<i8"), ("admitted", "<i8"), ("evicted", "<i8"), ("flags", "<i8")])
CHECKPOINT_RESULT = np.dtype([("file_bytes", "<i8"), ("xxh64", "S64")])
HEADER_BYTES = REQUEST.itemsize
REPLY_BYTES = REPLY.itemsize
# the same headers as struct formats: every field is a little-endian int64, and struct writes and
# reads a header's words about ten times faster than a structured NumPy scalar (on every request)
_REQUEST_WORDS = struct.Struct("<" + "q" * len(REQUEST.names))
_REPLY_WORDS = struct.Struct("<" + "q" * len(REPLY.names))
# a reply header's words written in one call, ``REPLY_HEADER.pack_into(buf, 0, req_id, status,
# min_clock, server, table_keys, admitted, evicted, flags)``: what :func:`pack_reply` does, for a
# server's quickest replies (hpcps.ps.quick_requests)
REPLY_HEADER = _REPLY_WORDS
assert all(REQUEST.fields[n][0] == np.dtype("<i8") for n in REQUEST.names)
assert all(REPLY.fields[n][0] == np.dtype("<i8") for n in REPLY.names)
assert _REQUEST_WORDS.size == HEADER_BYTES and _REPLY_WORDS.size == REPLY_BYTES

NO_KEYS = np.zeros(0, dtype=np.uint64)  # (no keys: a push's pull, a bare clock)

TAG_REQUEST = 1
TAG_GRADS = 2
TAG_REPLY_BASE = 16
IN_PULL = 1      # request flag: a push-pull's in-pull bits follow its pull keys
GRADS_APART = 2  # request flag: its gradients follow as a message of their own (TAG_GRADS)
WIRE_SHIFT = 2   # request flags bits 2-3: the values' wire type, both ways (filters.FP32, FP16 or BF16)
PUSH_LIST_ID = 16    # request flag: the pushed keys are a key list the server holds: one word, its id
PUSH_LIST_NEW = 32   # request flag: the pushed keys follow a word, their list's id, under which the server keeps them
PULL_LIST_ID = 64    # as PUSH_LIST_ID, for the pulled keys
PULL_LIST_NEW = 128  # as PUSH_LIST_NEW, for the pulled keys
KEY_LIST_FLAGS = PUSH_LIST_ID | PUSH_LIST_NEW | PULL_LIST_ID | PULL_LIST_NEW
TABLE_PUSHES = 256  # request flag (PUSHPULLS): each table pushes its own subset of the keys (the significance filter)
CLOCK_WORKERS_SHIFT = 9  # request flags from this bit on: the workers whose clock a push-pull carries (0: 1)
PAYLOAD_APART = 1  # reply flag: the header is a message of its own, and the payload follows it
OK = 0
STOP = 2         # status bit: this server received a stop signal (SIGINT, SIGTERM or SIGUSR1)
INTERRUPT = 4    # status bit, with STOP: the signal was SIGINT (the job stops with status 130, not 75)


def stop_status(signum: int | None) -> int:
    """A reply's status bits for the stop signal a server received (None: none)."""
    return OK if signum is None else STOP | (INTERRUPT if signum == signal.SIGINT else 0)


def pull_clock(op: int, clock: int, ahead: int = 0) -> int:
    """The clock a request's pull part is read at (a push-pull pulls after its clock advance,
    ``ahead`` clocks later still)."""
    return clock + 1 + ahead if op in (PUSHPULL, PUSHPULLS) else clock


def reply_tag(req_id: int, tag_ub: int) -> int:
    """The tag of the reply to request ``req_id`` (unique among a worker's requests in flight)."""
    return TAG_REPLY_BASE + req_id % (tag_ub - TAG_REPLY_BASE)


@dataclass(frozen=True)
class Encoding:
    """How a push's, a pull's or a push-pull's arrays travel (the traffic filters,
    :mod:`hpcps.ps.filters`): the values' wire type (both ways), and each key list as its keys
    (id 0), as the id of a list the server holds (``held``), or as a new list's id and its keys."""

    wire: int = filters.FP32
    push_list: int = 0
    push_held: bool = False
    pull_list: int = 0
    pull_held: bool = False

    def flags(self) -> int:
        return (self.wire << WIRE_SHIFT
                | (0 if not self.push_list else PUSH_LIST_ID if self.push_held else PUSH_LIST_NEW)
                | (0 if not self.pull_list else PULL_LIST_ID if self.pull_held else PULL_LIST_NEW))

    @classmethod
    def of(cls, flags: int, push_list: int = 0, pull_list: int = 0) -> "Encoding":
        return cls((flags >> WIRE_SHIFT) & 3, push_list, bool(flags & PUSH_LIST_ID), pull_list,
                   bool(flags & PULL_LIST_ID))


PLAIN = Encoding()


def keys_bytes(n: int, list_id: int, held: bool) -> int:
    """The bytes of a key list in a request: its keys, or its id (and its keys, when new)."""
    return 8 * n if not list_id else 8 if held else 8 + 8 * n


def request_bytes(n_push: int, n_pull: int, dim: int, in_pull: bool = False, grads_apart: bool = False,
                  enc: Encoding = PLAIN) -> int:
    """The bytes of a request message (without its gradients when they go apart)."""
    return (HEADER_BYTES + keys_bytes(n_push, enc.push_list, enc.push_held)
            + (0 if grads_apart else filters.wire_bytes(n_push * dim, enc.wire))
            + keys_bytes(n_pull, enc.pull_list, enc.pull_held) + (-(-n_push // 8) if in_pull else 0))


def clock_workers_flags(n: int) -> int:
    """The request flags saying that a push-pull carries the clock of ``n`` workers."""
    return n << CLOCK_WORKERS_SHIFT if n > 1 else 0


def clock_workers_of(flags: int) -> int:
    """The workers whose clock a push-pull of these request flags carries (:func:`clock_workers_flags`)."""
    return max(1, flags >> CLOCK_WORKERS_SHIFT)


def margin_width(dim: int) -> int:
    """Partial sums per row a ``MARGINS`` reply carries for a table of ``dim``: 1 for LR, and
    ``dim + 1`` for an FM (linear part, the k factor sums, the sum of squares)."""
    return 1 if dim == 1 else dim + 1


def reply_bytes(op: int, n_pull: int, dim: int, wire: int = filters.FP32) -> int:
    if op == CHECKPOINT:
        return REPLY_BYTES + CHECKPOINT_RESULT.itemsize
    if op == MARGINS:
        return REPLY_BYTES + 8 * n_pull * margin_width(dim)
    if op == RESIDUALS:
        return REPLY_BYTES
    return REPLY_BYTES + filters.wire_bytes(n_pull * dim, wire)


# Where a large request is placed in memory. Copies of large messages run at a fraction of their
# speed depending only on addresses modulo a page (docs/benchmarks.md): glibc's memcpy when its
# destination lies 16-512 bytes past its source's offset in a page, and MPICH's copy of a message
# into shared memory when the message begins within a few bytes of a page's start. So a request
# whose gradients take at least PLACED_BYTES starts MESSAGE_PAGE_OFFSET bytes into a page, or 1024
# bytes further where that would put the gradients 1-1023 bytes past their source's offset.
# (Gradients of GRADS_APART_BYTES and more mostly go apart, from their own array.) The numbers are
# tuned knobs (hpcps_kernels.tuning).


def _take(alloc, nbytes: int) -> np.ndarray:
    """``nbytes`` of a message buffer from ``alloc`` (a ``BufferPool.take``), or ``np.empty``."""
    return np.empty(nbytes, dtype=np.uint8) if alloc is None else alloc(nbytes)


def place(alloc, nbytes: int, at: int, like: np.ndarray) -> np.ndarray:
    """``nbytes`` from ``alloc`` (default ``np.empty``) starting ``MESSAGE_PAGE_OFFSET`` (or 1024 bytes
    further) into a page, with byte ``at`` 0 or at least 1024 bytes past ``like``'s first byte's
    offset in a page (see above)."""
    buf = _take(alloc, nbytes + PAGE_BYTES)
    for start in (MESSAGE_PAGE_OFFSET, MESSAGE_PAGE_OFFSET + 1024):
        lo = (start - buf.ctypes.data) % PAGE_BYTES
        past = (buf.ctypes.data + lo + at - like.ctypes.data) % PAGE_BYTES
        if past == 0 or past >= 1024:
            break
    return buf[lo:lo + nbytes]


# Gradients of GRADS_APART_BYTES or more go as a message of their own (GRADS_APART), from the
# worker's array, unless the array starts where MPICH's copy is slow (see place).


def grads_apart(grads: np.ndarray) -> bool:
    """Whether a request's ``grads`` (contiguous float32) go as a message of their own."""
    if grads.nbytes < GRADS_APART_BYTES:
        return False
    return PAGE_EDGE_BYTES <= grads.ctypes.data % PAGE_BYTES <= PAGE_BYTES - PAGE_EDGE_BYTES


# -- requests: a class per op, each packing and unpacking its own message ---------------------
#
# Every request message starts with the 9 int64 words of REQUEST: the op, the table, the request's
# id, two sizes, the clock, the worker, a word of the op's own and the flags. What the sizes and
# the op's word are is each op's own: its class says (``n_push``, ``n_pull`` and ``reserved`` are
# the words' names in REQUEST).


class Message:
    """What every request has: its op (its class's) and the clock its read, if any, is made at."""

    op: ClassVar[int] = 0
    clock: int

    @property
    def pull_clock(self) -> int:
        """The clock its read is made at: its own (a push-pull's is later, see :class:`PushPull`)."""
        return self.clock


@dataclass(eq=False)
class TableMessage(Message):
    """A request about a table: the table's number, the request's id (its reply's tag is made of
    it; 0 where no reply comes), the sender's clock and the sending worker."""

    table: int
    req_id: int
    clock: int
    worker: int


def _words(op: int, table: int, req_id: int, sizes: tuple[int, int], clock: int, worker: int, word: int = 0,
           flags: int = 0) -> tuple:
    """A request header's words, in REQUEST's order."""
    return (op, table, req_id, sizes[0], sizes[1], clock, worker, word, flags)


def _pack(words: tuple, nbytes: int, alloc=None) -> np.ndarray:
    """A message of ``nbytes`` from ``alloc`` (default ``np.empty``) with its header written."""
    buf = _take(alloc, nbytes)
    _REQUEST_WORDS.pack_into(buf, 0, *words)
    return buf


@dataclass(eq=False)
class Pull(TableMessage):
    """``PULL``: the rows of ``pull_keys`` read at ``clock``. Sizes: 0, the keys (uint64)."""

    op: ClassVar[int] = PULL
    pull_keys: np.ndarray
    encoding: Encoding = PLAIN  # the traffic filters' (the pulled values' wire type, the keys' list)

    def pack(self, alloc=None) -> np.ndarray:
        n, enc = self.pull_keys.shape[0], self.encoding
        buf = _pack(_words(PULL, self.table, self.req_id, (0, n), self.clock, self.worker, flags=enc.flags()),
                    HEADER_BYTES + keys_bytes(n, enc.pull_list, enc.pull_held), alloc)
        _put_keys(buf, HEADER_BYTES, self.pull_keys, enc.pull_list, enc.pull_held)
        return buf

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None,
               lists=None) -> "Pull":
        _, table, req_id, _, n, clock, worker, _, flags = words
        keys, _, pull_list = _get_keys(buf, HEADER_BYTES, n, flags, PULL_LIST_ID, lists, worker, table)
        return cls(table, req_id, clock, worker, keys, Encoding.of(flags, 0, pull_list) if flags else PLAIN)


def _put_keys(buf: np.ndarray, at: int, keys: np.ndarray, list_id: int, held: bool) -> int:
    """Write a key list at ``at`` as :func:`keys_bytes` says; returns where it ends."""
    if list_id:
        buf[at:at + 8].view(np.int64)[0] = list_id
        at += 8
        if held:
            return at
    n = keys.shape[0]
    if n:
        buf[at:at + 8 * n].view(np.uint64)[:] = keys
    return at + 8 * n


def _get_keys(buf: np.ndarray, at: int, n: int, flags: int, held_flag: int, lists, worker: int, table: int):
    """(the key list at ``at``, where it ends, its list's id or 0) in a request whose ``flags`` say
    how it travels (``held_flag``: PUSH_LIST_ID or PULL_LIST_ID; the NEW flag is the next bit);
    ``lists``: the server's key lists (:class:`hpcps.ps.filters.ServerKeyLists`)."""
    if not flags & (held_flag | held_flag << 1):
        return buf[at:at + 8 * n].view(np.uint64), at + 8 * n, 0
    if lists is None:
        raise ValueError("a request names a key list, and this server keeps none (filters.key_cache)")
    list_id = int(buf[at:at + 8].view(np.int64)[0])
    if flags & held_flag:
        return lists.get(worker, table, list_id), at + 8, list_id
    return lists.store(worker, table, list_id, buf[at + 8:at + 8 + 8 * n].view(np.uint64)), at + 8 + 8 * n, list_id


def _put_values(buf: np.ndarray, at: int, values: np.ndarray, wire: int) -> int:
    """Write float32 ``values`` at ``at`` in the wire type; returns where they end."""
    count = values.size
    if wire == filters.FP32:
        buf[at:at + 4 * count].view(np.float32)[:] = values.reshape(-1)
    else:
        buf[at:at + 2 * count].view(np.uint16)[:] = filters.encode(values, wire)
    return at + filters.wire_bytes(count, wire)


def _get_values(buf: np.ndarray, at: int, count: int, wire: int) -> np.ndarray:
    """``count`` values at ``at`` in the wire type, as float32 (a view where they are float32)."""
    if wire == filters.FP32:
        return buf[at:at + 4 * count].view(np.float32)
    return filters.decode(buf[at:at + 2 * count], wire)


def plain_keys(buf: np.ndarray, at: int, n: int) -> np.ndarray:
    """The ``n`` keys at byte ``at`` of a request whose flags are 0 (its keys travel as they are)."""
    return buf[at:at + 8 * n].view(np.uint64)


def plain_pushed(buf: np.ndarray, n_push: int, n_pull: int, dim: int) -> tuple:
    """(pushed keys, gradients ``n_push x dim``, pulled keys) of a push or a push-pull whose flags
    are 0: views of ``buf`` laid out as :func:`_pack_pushed` writes them (every key list as its
    keys, float32 gradients in the message)."""
    at = HEADER_BYTES + 8 * n_push
    end = at + 4 * n_push * dim
    return (buf[HEADER_BYTES:at].view(np.uint64), buf[at:end].view(np.float32).reshape(n_push, dim),
            buf[end:end + 8 * n_pull].view(np.uint64) if n_pull else NO_KEYS)


def plain_in_pull(buf: np.ndarray, n_push: int, n_pull: int, dim: int) -> np.ndarray:
    """The in-pull bits (``IN_PULL``) of a push-pull otherwise laid out as :func:`plain_pushed`
    reads it: the ``ceil(n_push / 8)`` bytes after its pulled keys."""
    at = HEADER_BYTES + (8 + 4 * dim) * n_push + 8 * n_pull
    return buf[at:at + (n_push + 7) // 8]


def _pack_pushed(words: tuple, keys: np.ndarray, grads: np.ndarray, pull_keys: np.ndarray,
                 in_pull: np.ndarray | None, alloc, apart: bool, enc: Encoding = PLAIN) -> np.ndarray:
    """The layout of a push and a push-pull (sizes: the pushed keys, the pulled keys): the keys,
    their gradients (unless ``apart``), the pulled keys, the in-pull bits (with ``IN_PULL``); each
    key list as its list's id and keys, or its id alone, where ``enc`` says."""
    n_push, n_pull, dim = keys.shape[0], pull_keys.shape[0], grads.shape[1] if grads.ndim == 2 else 0
    flags = words[8]
    nbytes = request_bytes(n_push, n_pull, dim, flags & IN_PULL, flags & GRADS_APART, enc)
    if n_push * dim * 4 >= PLACED_BYTES and not apart and enc is PLAIN:  # the gradients' copy is most of the packing
        buf = place(alloc, nbytes, HEADER_BYTES + 8 * n_push, grads)
    else:
        buf = _take(alloc, nbytes)
    _REQUEST_WORDS.pack_into(buf, 0, *words)
    at = HEADER_BYTES
    if n_push:
        at = _put_keys(buf, at, keys, enc.push_list, enc.push_held)
        if not apart:
            at = _put_values(buf, at, grads, enc.wire)
    if n_pull:
        at = _put_keys(buf, at, pull_keys, enc.pull_list, enc.pull_held)
    if flags & IN_PULL:
        buf[at:] = np.packbits(in_pull, bitorder="little")
    return buf


def _unpack_pushed(buf: np.ndarray, words: tuple, dim: int, grads: np.ndarray | None, lists=None):
    """(pushed keys, gradients, pulled keys, in-pull bits or None, :class:`Encoding`) of a push or
    a push-pull (``lists``: the server's key lists, where it keeps them)."""
    _, table, _, n_push, n_pull, _, worker, _, flags = words
    if not flags:
        return (*plain_pushed(buf, n_push, n_pull, dim), None, PLAIN)
    at, push_list, enc = HEADER_BYTES, 0, PLAIN
    if n_push:
        keys, at, push_list = _get_keys(buf, at, n_push, flags, PUSH_LIST_ID, lists, worker, table)
    else:
        keys = buf[at:at].view(np.uint64)
    wire = (flags >> WIRE_SHIFT) & 3
    if flags & GRADS_APART:
        grads = grads.view(np.float32).reshape(n_push, dim)
    else:
        grads = _get_values(buf, at, n_push * dim, wire).reshape(n_push, dim)
        at += filters.wire_bytes(n_push * dim, wire)
    pull_list = 0
    if n_pull:
        pull_keys, at, pull_list = _get_keys(buf, at, n_pull, flags, PULL_LIST_ID, lists, worker, table)
    else:
        pull_keys = buf[at:at].view(np.uint64)
    if flags & (KEY_LIST_FLAGS | 3 << WIRE_SHIFT):
        enc = Encoding.of(flags, push_list, pull_list)
    return keys, grads, pull_keys, buf[at:at + (n_push + 7) // 8] if flags & IN_PULL else None, enc


@dataclass(eq=False)
class Push(TableMessage):
    """``PUSH``: gradients (float32, ``n x dim``) of ``keys`` computed at ``clock``. Sizes: the
    keys, 0. With ``GRADS_APART`` the gradients follow as a message of their own."""

    op: ClassVar[int] = PUSH
    keys: np.ndarray
    grads: np.ndarray
    grads_apart: bool = False  # the gradients go as a message of their own (GRADS_APART)
    encoding: Encoding = PLAIN  # the traffic filters' (the values' wire type, the keys' list)

    def pack(self, alloc=None) -> np.ndarray:
        n = self.keys.shape[0]
        apart = self.grads_apart and n > 0
        words = _words(PUSH, self.table, self.req_id, (n, 0), self.clock, self.worker,
                       flags=(GRADS_APART if apart else 0) | self.encoding.flags())
        return _pack_pushed(words, self.keys, self.grads, NO_KEYS, None, alloc, apart, self.encoding)

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None,
               lists=None) -> "Push":
        _, table, req_id, n, _, clock, worker, _, flags = words
        keys, grads, _, _, enc = _unpack_pushed(buf, words, dims[table], grads, lists)
        return cls(table, req_id, clock, worker, keys, grads, bool(flags & GRADS_APART), enc)


@dataclass(eq=False)
class PushPull(TableMessage):
    """``PUSHPULL``: :class:`Push` at ``clock``, the clock to ``clock + 1``, :class:`Pull` at
    ``clock + 1 + ahead`` (see the module docstring). Sizes: the pushed keys, the pulled keys; the
    op's word: ``ahead``. ``in_pull``: a bool per pushed key (packed) or its bits (unpacked)."""

    op: ClassVar[int] = PUSHPULL
    push_keys: np.ndarray
    grads: np.ndarray
    pull_keys: np.ndarray
    ahead: int = 0
    in_pull: np.ndarray | None = None
    grads_apart: bool = False  # as for Push
    clock_workers: int = 1  # the workers (from ``worker`` on) whose clock it advances
    encoding: Encoding = PLAIN  # as for Push and Pull

    @property
    def pull_clock(self) -> int:
        return pull_clock(PUSHPULL, self.clock, self.ahead)

    def push(self) -> Push:
        """Its push part."""
        return Push(self.table, self.req_id, self.clock, self.worker, self.push_keys, self.grads, self.grads_apart,
                    self.encoding)

    def pack(self, alloc=None) -> np.ndarray:
        n_push = self.push_keys.shape[0]
        apart = self.grads_apart and n_push > 0
        flags = (IN_PULL if self.in_pull is not None and n_push else 0) | (GRADS_APART if apart else 0) \
            | clock_workers_flags(self.clock_workers) | self.encoding.flags()
        words = _words(PUSHPULL, self.table, self.req_id, (n_push, self.pull_keys.shape[0]), self.clock,
                       self.worker, self.ahead, flags)
        return _pack_pushed(words, self.push_keys, self.grads, self.pull_keys, self.in_pull, alloc, apart,
                            self.encoding)

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None,
               lists=None) -> "PushPull":
        _, table, req_id, n_push, n_pull, clock, worker, ahead, flags = words
        keys, grads, pull_keys, in_pull, enc = _unpack_pushed(buf, words, dims[table], grads, lists)
        return cls(table, req_id, clock, worker, keys, grads, pull_keys, ahead, in_pull, bool(flags & GRADS_APART),
                   clock_workers_of(flags), enc)


@dataclass(eq=False)
class Clock(Message):
    """``CLOCK``: the worker has reached ``clock``. Sizes 0; nothing follows the header."""

    op: ClassVar[int] = CLOCK
    clock: int
    worker: int

    def pack(self, alloc=None) -> np.ndarray:
        return _pack(_words(self.op, 0, 0, (0, 0), self.clock, self.worker), HEADER_BYTES, alloc)

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None) -> "Clock":
        return cls(words[5], words[6])


class Done(Clock):
    """``DONE``: the worker sends no more requests (its clock: its last). As :class:`Clock`."""

    op: ClassVar[int] = DONE


class _Notice(Clock):
    """A :class:`Clock` with one word more, the header's reserved one (:attr:`word`). Sizes 0."""

    @property
    def word(self) -> int:
        raise NotImplementedError

    def pack(self, alloc=None) -> np.ndarray:
        return _pack(_words(self.op, 0, 0, (0, 0), self.clock, self.worker, self.word), HEADER_BYTES, alloc)

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None) -> "_Notice":
        return cls(words[5], words[6], words[7])


@dataclass(eq=False)
class Placed(_Notice):
    """``PLACED``: worker ``worker``, at ``clock``, sends its pushes under the placement without
    server ``lost`` from now on (the header's reserved word). Sizes 0."""

    op: ClassVar[int] = PLACED
    lost: int = -1

    @property
    def word(self) -> int:
        return self.lost


@dataclass(eq=False)
class Stopping(_Notice):
    """``STOPPING`` (backup workers): worker ``worker``, at ``clock``, saw stop signal ``signal`` (the
    header's reserved word) and joins the workers' agreement on it. Sizes 0."""

    op: ClassVar[int] = STOPPING
    signal: int = 0

    @property
    def word(self) -> int:
        return self.signal


@dataclass(eq=False)
class Copy(Message):
    """``COPY``: server ``source``'s rows of ``shards`` (new backups on the receiver after server
    ``lost`` was lost), as applied up to ``clock``: every push of an earlier clock, none of a later
    one (-1, under SSP and ASP: every push sent before its worker's ``PLACED``, none after).
    ``parts``: each table's (keys, rows), in the tables' order; ``cut_at``: when the source
    read them (``time.monotonic()``, the same clock on one host: the copy's time). Header: the
    tables' count (``table``), the shards' (``n_push``), ``clock``, ``source`` (``worker``) and
    ``lost`` (``reserved``); then the shards (int64), ``cut_at`` (float64) and each table's row
    count and width (int64), keys (uint64) and rows (float32, padded to 8 bytes)."""

    op: ClassVar[int] = COPY
    clock: int
    source: int
    lost: int
    shards: np.ndarray
    parts: list
    cut_at: float = 0.0

    def pack(self, alloc=None) -> np.ndarray:
        sizes = [16 + 8 * keys.shape[0] + -(-rows.nbytes // 8) * 8 for keys, rows in self.parts]
        buf = _pack(_words(self.op, len(self.parts), 0, (self.shards.shape[0], 0), self.clock, self.source, self.lost),
                    HEADER_BYTES + 8 * self.shards.shape[0] + 8 + sum(sizes), alloc)
        at = HEADER_BYTES + 8 * self.shards.shape[0]
        buf[HEADER_BYTES:at].view(np.int64)[:] = self.shards
        buf[at:at + 8].view(np.float64)[0] = self.cut_at
        at += 8
        for (keys, rows), size in zip(self.parts, sizes):
            n = keys.shape[0]
            width = rows.shape[1] if rows.ndim == 2 else 1
            buf[at:at + 16].view(np.int64)[:] = (n, width)
            buf[at + 16:at + 16 + 8 * n].view(np.uint64)[:] = keys
            buf[at + 16 + 8 * n:at + 16 + 8 * n + rows.nbytes].view(np.float32)[:] = rows.reshape(-1)
            at += size
        return buf

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None) -> "Copy":
        _, n_tables, _, n_shards, _, clock, source, lost, _ = words
        at = HEADER_BYTES + 8 * n_shards
        shards = buf[HEADER_BYTES:at].view(np.int64).copy()
        cut_at = float(buf[at:at + 8].view(np.float64)[0])
        at += 8
        parts = []
        for _ in range(n_tables):
            n, width = (int(v) for v in buf[at:at + 16].view(np.int64))
            keys = buf[at + 16:at + 16 + 8 * n].view(np.uint64).copy()
            rows = buf[at + 16 + 8 * n:at + 16 + 8 * n + 4 * n * width].view(np.float32).reshape(n, width).copy()
            parts.append((keys, rows))
            at += 16 + 8 * n + -(-4 * n * width // 8) * 8
        return cls(clock, source, lost, shards, parts, cut_at)


@dataclass(eq=False)
class Checkpoint(Message):
    """``CHECKPOINT``: write the server's shards into the directory ``path`` once every worker
    has reached ``clock``; with ``quorum`` (backup workers: one worker's checkpoint, no other
    waiting for it), once clock ``clock - 1`` is complete, and none at all when a later clock
    completed before it came (:meth:`hpcps.ps.consistency.WorkerClocks.missed`). ``for_signal``:
    written for a stop signal, which the server forgets once it is written (it reports its own
    in every reply until then). Sizes: 0, the path's 8-byte words (UTF-8, padded with NULs);
    ``quorum`` and ``for_signal`` as bits 0 and 1 of the header's reserved word."""

    op: ClassVar[int] = CHECKPOINT
    req_id: int
    clock: int
    worker: int
    path: str
    quorum: bool = False
    for_signal: bool = False

    def pack(self, alloc=None) -> np.ndarray:
        raw = self.path.encode()
        raw += b"\0" * (-len(raw) % 8)
        buf = _pack(_words(CHECKPOINT, 0, self.req_id, (0, len(raw) // 8), self.clock, self.worker,
                           int(self.quorum) | int(self.for_signal) << 1), HEADER_BYTES + len(raw), alloc)
        buf[HEADER_BYTES:] = np.frombuffer(raw, dtype=np.uint8)
        return buf

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None) -> "Checkpoint":
        _, _, req_id, _, n_words, clock, worker, bits, _ = words
        path = buf[HEADER_BYTES:HEADER_BYTES + 8 * n_words].tobytes().rstrip(b"\0").decode()
        return cls(req_id, clock, worker, path, bool(bits & 1), bool(bits & 2))


@dataclass(eq=False)
class Margins(TableMessage):
    """``MARGINS``: a batch's nonzeros this server owns, read at ``clock``: ``keys`` (uint64),
    ``values`` (float32) and ``row_ids`` (int32, each nonzero's row of ``n_rows``). Sizes: the
    nonzeros, the rows."""

    op: ClassVar[int] = MARGINS
    keys: np.ndarray
    values: np.ndarray
    row_ids: np.ndarray
    n_rows: int

    def pack(self, alloc=None) -> np.ndarray:
        n = self.keys.shape[0]
        buf = _pack(_words(MARGINS, self.table, self.req_id, (n, self.n_rows), self.clock, self.worker),
                    HEADER_BYTES + 16 * n, alloc)
        at = HEADER_BYTES
        buf[at:at + 8 * n].view(np.uint64)[:] = self.keys
        buf[at + 8 * n:at + 12 * n].view(np.float32)[:] = self.values
        buf[at + 12 * n:at + 16 * n].view(np.int32)[:] = self.row_ids
        return buf

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None) -> "Margins":
        _, table, req_id, n, n_rows, clock, worker, _, _ = words
        at = HEADER_BYTES
        return cls(table, req_id, clock, worker, buf[at:at + 8 * n].view(np.uint64),
                   buf[at + 8 * n:at + 12 * n].view(np.float32), buf[at + 12 * n:at + 16 * n].view(np.int32), n_rows)


@dataclass(eq=False)
class Residuals(TableMessage):
    """``RESIDUALS``: per row of the worker's last :class:`Margins`, float64 ``n_rows x dim``
    (see the module docstring), pushed at ``clock``. Sizes: 0, the rows."""

    op: ClassVar[int] = RESIDUALS
    residuals: np.ndarray

    def pack(self, alloc=None) -> np.ndarray:
        n = self.residuals.shape[0]
        buf = _pack(_words(RESIDUALS, self.table, self.req_id, (0, n), self.clock, self.worker),
                    HEADER_BYTES + 8 * self.residuals.size, alloc)
        buf[HEADER_BYTES:].view(np.float64)[:] = self.residuals.reshape(-1)
        return buf

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None) -> "Residuals":
        _, table, req_id, _, n_rows, clock, worker, _, _ = words
        rows = buf[HEADER_BYTES:].view(np.float64).reshape(n_rows, -1) if n_rows else np.zeros((0, dims[table]))
        return cls(table, req_id, clock, worker, rows)


@dataclass(eq=False)
class Call(TableMessage):
    """``CALL``: server function number ``function`` over ``keys`` (uint64) with a row of float32
    ``args`` each (``n x width``, width may be 0), read at ``clock``. Sizes: the keys, the width;
    the op's word: the function."""

    op: ClassVar[int] = CALL
    function: int
    keys: np.ndarray
    args: np.ndarray

    def pack(self, alloc=None) -> np.ndarray:
        n, width = self.keys.shape[0], self.args.shape[1]
        buf = _pack(_words(CALL, self.table, self.req_id, (n, width), self.clock, self.worker, self.function),
                    HEADER_BYTES + 8 * n + 4 * n * width, alloc)
        buf[HEADER_BYTES:HEADER_BYTES + 8 * n].view(np.uint64)[:] = self.keys
        buf[HEADER_BYTES + 8 * n:].view(np.float32)[:] = self.args.reshape(-1)
        return buf

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None) -> "Call":
        _, table, req_id, n, width, clock, worker, function, _ = words
        at = HEADER_BYTES
        return cls(table, req_id, clock, worker, function, buf[at:at + 8 * n].view(np.uint64),
                   buf[at + 8 * n:at + 8 * n + 4 * n * width].view(np.float32).reshape(n, width))


def tables_request_bytes(n_tables: int, n_push: int, n_pull: int, dims: list[int], in_pull: bool = False,
                         enc: Encoding = PLAIN, table_counts: list[int] | None = None) -> int:
    """The bytes of a :class:`TablesPushPull` (or :class:`TablesPull`) message; ``table_counts``:
    the keys each table pushes of the ``n_push`` sent, where each sends its own (``TABLE_PUSHES``)."""
    own = table_counts is not None
    counts = table_counts if own else [n_push] * n_tables
    return (HEADER_BYTES + 8 * n_tables + keys_bytes(n_push, enc.push_list, enc.push_held)
            + keys_bytes(n_pull, enc.pull_list, enc.pull_held)
            + sum(filters.wire_bytes(n * d, enc.wire) for n, d in zip(counts, dims))
            + (-(-n_push // 8) if in_pull else 0) + ((8 + -(-n_push // 8)) * n_tables if own else 0))


def tables_reply_bytes(n_pull: int, dims: list[int], wire: int = filters.FP32) -> int:
    """The bytes of the reply to a :class:`TablesPushPull`: the header, each table's (rows held,
    keys admitted, rows evicted) as int64, then each table's pulled values (``n_pull x dim``, in
    the wire type ``wire``, each table's padded to 4 bytes) in the request's order of tables."""
    return REPLY_BYTES + 24 * len(dims) + sum(filters.wire_bytes(n_pull * d, wire) for d in dims)


def tables_reply_payloads(buf: np.ndarray, n_pull: int, dims: list[int],
                          wire: int = filters.FP32) -> tuple[np.ndarray, list[np.ndarray]]:
    """(each table's counts, int64 ``n_tables x 3``; each table's values' bytes) of a reply laid out
    as :func:`tables_reply_bytes` says (``buf``: the reply, or from its payload on with
    ``REPLY_BYTES`` in front). A server fills each through :func:`pull_into` and
    :func:`encode_pulled`."""
    at = REPLY_BYTES + 24 * len(dims)
    counts = buf[REPLY_BYTES:at].view(np.int64).reshape(len(dims), 3)
    payloads = []
    for dim in dims:
        size = filters.wire_bytes(n_pull * dim, wire)
        payloads.append(buf[at:at + size])
        at += size
    return counts, payloads


def tables_reply_parts(buf: np.ndarray, n_pull: int, dims: list[int],
                       wire: int = filters.FP32) -> tuple[np.ndarray, list[np.ndarray]]:
    """(each table's counts; each table's values, float32 ``n_pull x dim``: views of ``buf`` in
    fp32, decoded from a 16-bit wire type) of a reply (:func:`tables_reply_payloads`)."""
    counts, payloads = tables_reply_payloads(buf, n_pull, dims, wire)
    return counts, [p.view(np.float32).reshape(n_pull, d) if wire == filters.FP32 else
                    filters.decode(p[:2 * n_pull * d], wire).reshape(n_pull, d) for p, d in zip(payloads, dims)]


@dataclass(eq=False)
class TablesPushPull(Message):
    """``PUSHPULLS``: a :class:`PushPull` of each of ``tables`` at the same keys, in one message:
    every table's push at ``clock``, the clock to ``clock + 1`` (once), every table's pull at
    ``clock + 1 + ahead``. Without pulled keys it is the tables' pushes and the clock, answered at
    once. The header's ``table`` word: the number of tables; sizes: the pushed keys, the pulled
    keys; the op's word: ``ahead``. Then the tables' numbers (int64), the pushed keys, the pulled
    keys (uint64), each table's gradients (``n_push x dim``) and, with ``IN_PULL``, the in-pull
    bits (as :class:`PushPull`'s, shared by the tables). Gradients never go apart.

    The traffic filters (``encoding``, as :class:`PushPull`'s): every table's values, pushed and
    pulled, in the wire type (each table's padded to 4 bytes), and the pushed and the pulled key
    lists each as a list the server keeps under the first table (one list for every table). Behind
    the significance filter each table pushes its own subset of the pushed keys (``sends``: a bool
    per pushed key and table; flag ``TABLE_PUSHES``): after the tables' numbers, the keys each
    pushes (int64 per table); each table's gradients are those of its keys; after them, no in-pull
    bits but each table's bits (``ceil(n_push / 8)`` bytes each, as the in-pull bits are packed)."""

    op: ClassVar[int] = PUSHPULLS
    tables: tuple
    req_id: int
    clock: int
    worker: int
    push_keys: np.ndarray
    grads: list
    pull_keys: np.ndarray
    ahead: int = 0
    in_pull: np.ndarray | None = None
    clock_workers: int = 1  # as for PushPull
    encoding: Encoding = PLAIN  # as for PushPull
    sends: list | None = None  # TABLE_PUSHES: each table's bools (which pushed keys it sends), or None: all

    @property
    def pull_clock(self) -> int:
        return pull_clock(self.op, self.clock, self.ahead)

    def pushes(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(table, pushed keys, gradients) of each table."""
        if self.sends is None:
            return [(t, self.push_keys, g) for t, g in zip(self.tables, self.grads)]
        return [(t, self.push_keys[m], g) for t, m, g in zip(self.tables, self.sends, self.grads)]

    def pack(self, alloc=None) -> np.ndarray:
        enc, own = self.encoding, self.sends is not None
        n_tables, n_push, n_pull = len(self.tables), self.push_keys.shape[0], self.pull_keys.shape[0]
        dims = [g.shape[1] for g in self.grads]
        counts = [g.shape[0] for g in self.grads] if own else None
        flags = (IN_PULL if self.in_pull is not None and n_push and not own else 0) \
            | clock_workers_flags(self.clock_workers) | enc.flags() | (TABLE_PUSHES if own else 0)
        buf = _pack(_words(self.op, n_tables, self.req_id, (n_push, n_pull), self.clock, self.worker, self.ahead,
                           flags),
                    tables_request_bytes(n_tables, n_push, n_pull, dims, bool(flags & IN_PULL), enc, counts), alloc)
        at = HEADER_BYTES + 8 * n_tables
        buf[HEADER_BYTES:at].view(np.int64)[:] = self.tables
        if own:
            buf[at:at + 8 * n_tables].view(np.int64)[:] = counts
            at += 8 * n_tables
        if n_push:
            at = _put_keys(buf, at, self.push_keys, enc.push_list, enc.push_held)
        if n_pull:
            at = _put_keys(buf, at, self.pull_keys, enc.pull_list, enc.pull_held)
        for g in self.grads:
            at = _put_values(buf, at, g, enc.wire)
        if flags & IN_PULL:
            buf[at:] = np.packbits(self.in_pull, bitorder="little")
        elif own and n_push:
            buf[at:] = np.concatenate([np.packbits(m, bitorder="little") for m in self.sends])
        return buf

    @classmethod
    def unpack(cls, words: list, buf: np.ndarray, dims: list[int], grads: np.ndarray | None,
               lists=None) -> "TablesPushPull":
        _, n_tables, req_id, n_push, n_pull, clock, worker, ahead, flags = words
        at = HEADER_BYTES + 8 * n_tables
        tables = tuple(buf[HEADER_BYTES:at].view(np.int64).tolist())
        own = bool(flags & TABLE_PUSHES)
        counts = [n_push] * n_tables
        if own:
            counts = buf[at:at + 8 * n_tables].view(np.int64).tolist()
            at += 8 * n_tables
        push_keys, at, push_list = _get_keys(buf, at, n_push, flags, PUSH_LIST_ID, lists, worker, tables[0]) \
            if n_push else (NO_KEYS, at, 0)
        pull_keys, at, pull_list = _get_keys(buf, at, n_pull, flags, PULL_LIST_ID, lists, worker, tables[0]) \
            if n_pull else (NO_KEYS, at, 0)
        wire, table_grads = (flags >> WIRE_SHIFT) & 3, []
        for t, n in zip(tables, counts):
            table_grads.append(_get_values(buf, at, n * dims[t], wire).reshape(n, dims[t]))
            at += filters.wire_bytes(n * dims[t], wire)
        in_pull = buf[at:at + (n_push + 7) // 8] if flags & IN_PULL else None
        sends = None
        if own:  # (each table's bits, unpacked)
            bits = (n_push + 7) // 8
            sends = [np.unpackbits(buf[at + i * bits:at + (i + 1) * bits], count=n_push, bitorder="little").view(bool)
                     for i in range(n_tables)]
        return cls(tables, req_id, clock, worker, push_keys, table_grads, pull_keys, ahead, in_pull,
                   clock_workers_of(flags), Encoding.of(flags, push_list, pull_list), sends)


class TablesPull(TablesPushPull):
    """``PULLS``: a :class:`Pull` of each of ``tables`` at the same keys, read at ``clock``: laid
    out as :class:`TablesPushPull` with no pushed keys (the op's word: 0)."""

    op: ClassVar[int] = PULLS

    @property
    def pull_clock(self) -> int:
        return self.clock


MESSAGES = {cls.op: cls for cls in (Pull, Push, PushPull, Clock, Done, Checkpoint, Margins, Residuals, Call,
                                      TablesPull, TablesPushPull, Placed, Copy, Stopping)}


def header(buf: np.ndarray):
    """The request header of a message (a structured scalar: ``h["op"]``, ``h["clock"]``, ...)."""
    return buf[:HEADER_BYTES].view(REQUEST)[0]


_FLAGS_AT = REQUEST.fields["flags"][1]


def apart_grads_bytes(buf: np.ndarray, dims: list[int], words: tuple | None = None) -> int:
    """The size of the gradients message that follows request ``buf`` (0: none); ``words``: its
    :func:`request_words`, where already read."""
    if not (buf[_FLAGS_AT] if words is None else words[8]) & GRADS_APART:  # (this runs on every request)
        return 0
    op, table, _, n_push, _, _, _, _, flags = _REQUEST_WORDS.unpack_from(buf) if words is None else words
    return 4 * n_push * dims[table] if op in (PUSH, PUSHPULL) else 0


def request_words(buf: np.ndarray) -> tuple:
    """A request header's words, in REQUEST's order (``op, table, req_id, n_push, n_pull, clock,
    worker, reserved, flags``), in one call (reading a structured scalar field by field costs
    about 30 us a request on the server's critical path)."""
    return _REQUEST_WORDS.unpack_from(buf)


def unpack_request(buf: np.ndarray, dims: list[int], grads: np.ndarray | None = None, lists=None,
                   words: tuple | None = None) -> Message:
    """The request in ``buf``, as its op's class (its arrays are views into ``buf``, or float32
    values decoded from their wire type); ``dims``: each table's; ``grads``: the bytes of the
    gradients that followed it (:data:`GRADS_APART`); ``lists``: the server's key lists
    (:class:`hpcps.ps.filters.ServerKeyLists`), which a request's key-list ids name; ``words``:
    its :func:`request_words`, where already read."""
    if words is None:
        words = _REQUEST_WORDS.unpack_from(buf)
    kind = MESSAGES.get(words[0])
    if kind is None:
        raise ValueError(f"unknown request op {words[0]}")
    if words[8] & KEY_LIST_FLAGS and words[0] in (PULL, PUSH, PUSHPULL, PULLS, PUSHPULLS):
        return kind.unpack(words, buf, dims, grads, lists)
    return kind.unpack(words, buf, dims, grads)


def pack_reply(req_id: int, status: int, min_clock: int, server: int, payload_bytes: int,
               counts: tuple[int, int, int] = (0, 0, 0), alloc=None,
               apart: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A reply message and a view of its payload (to be filled); ``counts``: the table's
    (rows held, keys admitted, rows evicted) on this server; ``alloc``: as for :func:`pack_request`;
    ``apart``: it goes as its header, then its payload (:data:`PAYLOAD_APART`)."""
    buf = _take(alloc, REPLY_BYTES + payload_bytes)
    _REPLY_WORDS.pack_into(buf, 0, req_id, status, min_clock, server, *counts, PAYLOAD_APART if apart else 0)
    return buf, buf[REPLY_BYTES:]


_REPLY_FLAGS_AT = REPLY.fields["flags"][1]


def payload_apart(head: np.ndarray) -> bool:
    """Whether the reply whose header is ``head`` (its first :data:`REPLY_BYTES`) goes as that
    header, then its payload as a message of its own (:data:`PAYLOAD_APART`). The server decides
    (a large pull it runs on two threads: the worker sleeps until the header comes rather than
    spinning through the server's work); the worker reads it here, once the header has come."""
    return bool(head[_REPLY_FLAGS_AT] & PAYLOAD_APART)  # (one byte read: this runs on every reply)


def reply_words(buf: np.ndarray) -> tuple:
    """A reply header's words, in REPLY's order (``req_id, status, min_clock, server, table_keys,
    admitted, evicted, flags``): what a worker reads of every reply."""
    return _REPLY_WORDS.unpack_from(buf)


def pulled_values(buf: np.ndarray, dim: int, wire: int = filters.FP32, n: int = -1) -> np.ndarray:
    """The pulled rows (float32, ``n x dim``) a reply carries in the wire type ``wire`` (``n``: the
    rows, needed for a 16-bit type, whose values may be padded)."""
    if wire == filters.FP32:
        return buf[REPLY_BYTES:].view(np.float32).reshape(-1, dim)
    return filters.decode(buf[REPLY_BYTES:REPLY_BYTES + 2 * n * dim], wire).reshape(n, dim)


def pull_into(payload: np.ndarray, n: int, dim: int, wire: int) -> np.ndarray:
    """Where a server writes the ``n x dim`` float32 rows a reply's ``payload`` carries: the
    payload itself, or (another wire type) a float32 array to :func:`encode_pulled` from."""
    if wire == filters.FP32:  # (the payload: exactly these rows)
        return payload.view(np.float32).reshape(n, dim)
    return np.empty((n, dim), dtype=np.float32)


def encode_pulled(rows: np.ndarray, payload: np.ndarray, wire: int) -> None:
    """The rows of :func:`pull_into` into the reply's payload, in the wire type (fp32: already there)."""
    if wire != filters.FP32:
        _put_values(payload, 0, rows, wire)


CHECKPOINT_MISSED = -1  # a checkpoint result's file_bytes: a quorum checkpoint came too late, nothing written


def pack_checkpoint_result(payload: np.ndarray, file_bytes: int, digest: str) -> None:
    payload.view(CHECKPOINT_RESULT)[0] = (file_bytes, digest.encode())


def unpack_checkpoint_result(buf: np.ndarray) -> tuple[int, str]:
    r = buf[REPLY_BYTES:].view(CHECKPOINT_RESULT)[0]
    return int(r["file_bytes"]), r["xxh64"].decode()


def max_keys_per_message(dim: int, max_bytes: int) -> int:
    """Most keys one push or pull message may carry under ``max_bytes``."""
    return max(1, (max_bytes - HEADER_BYTES) // (8 + 4 * dim))
