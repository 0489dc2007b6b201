"""Table declarations (pure): what a table is, identical on every rank."""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field

from hpcps_kernels import init as kinit
from hpcps_kernels import optim
from hpcps_kernels.tuning import DIRECT_MAX_BITS

@dataclass(frozen=True)
class Features:
    """Admission and eviction of a table's keys on the servers (the ``[features]`` section).

    A key becomes a row only at its ``admit_count``-th push (1: at once), and then only if a
    deterministic draw per key and clock passes ``admit_probability``. Until then pulls return the
    initializer and pushes only count. Every ``evict_every_steps`` clocks the servers evict rows
    not updated in the last ``evict_after_steps`` clocks (0: never) and rows whose parameters'
    L2 norm is below ``evict_l2_below`` (0: never). ``server_memory_mb`` (0: unbounded) caps a
    table's memory on each server: before a push would pass it, the least recently updated rows
    are evicted (to 90 % of the cap).
    """

    admit_count: int = 1
    admit_probability: float = 1.0
    evict_after_steps: int = 0
    evict_l2_below: float = 0.0
    evict_every_steps: int = 100
    server_memory_mb: float = 0.0
    count_bits: int = 22  # counters shared by hash for keys not directly addressed (4 MiB)

    def __post_init__(self):
        for name, ok, what in (("admit_count", 1 <= self.admit_count <= 255, "in [1, 255]"),
                               ("admit_probability", 0.0 < self.admit_probability <= 1.0, "in (0, 1]"),
                               ("evict_after_steps", self.evict_after_steps >= 0, "at least 0"),
                               ("evict_l2_below", self.evict_l2_below >= 0.0, "at least 0"),
                               ("evict_every_steps", self.evict_every_steps >= 1, "at least 1"),
                               ("server_memory_mb", self.server_memory_mb >= 0.0, "at least 0"),
                               ("count_bits", 10 <= self.count_bits <= 32, "in [10, 32]")):
            if not ok:
                raise ValueError(f"features.{name} must be {what} (got {getattr(self, name)})")

    @property
    def admission(self) -> bool:
        return self.admit_count > 1 or self.admit_probability < 1.0

    @property
    def eviction(self) -> bool:
        """Rows may be evicted (so each row's last update is tracked)."""
        return self.evict_after_steps > 0 or self.evict_l2_below > 0.0 or self.server_memory_mb > 0.0


@dataclass(frozen=True)
class ServerFunction:
    """A request kind of your own, run on the servers over a table's keys (Angel's psFunc).

    ``fn(shard, keys, args)`` runs on each server with its :class:`hpcps.ps.server_table.ServerTable`
    ``shard``, the requested keys it owns (uint64) and their argument rows (float32,
    ``(n, in_width)``). It returns float32: ``(n, out_width)`` rows, one per key (``per_key``; the
    worker gets them back in request order), or ``out_width`` values that the worker sums over
    the servers (a reduction). A call is read at the worker's clock like a pull (under BSP it sees
    every push of earlier steps). Register it on every rank; :meth:`Context.server_function`
    checks that the definition is the same everywhere.

    The same registry holds the functions that answer the servers' own computation requests,
    ``MARGINS`` and ``RESIDUALS``, under :data:`MARGINS_FUNCTION` and :data:`RESIDUALS_FUNCTION`
    (see :mod:`hpcps.ps.margins` for their signatures).
    """

    name: str
    fn: object
    out_width: int
    in_width: int = 0
    per_key: bool = True

    def fingerprint(self) -> int:
        import inspect

        try:
            source = inspect.getsource(self.fn)
        except (OSError, TypeError):
            source = getattr(self.fn, "__qualname__", repr(self.fn))
        return zlib.crc32(repr((self.name, self.out_width, self.in_width, self.per_key, source)).encode()) & 0x7FFFFFFF


SERVER_FUNCTIONS: dict[str, ServerFunction] = {}

# The server functions that answer the MARGINS and RESIDUALS requests (computation on the servers;
# hpcps.ps.margins registers LR's and FM's under these names, with the signatures given there).
MARGINS_FUNCTION = "hpcps.margins"
RESIDUALS_FUNCTION = "hpcps.residuals"


def register_server_function(name: str, fn, out_width: int, in_width: int = 0, per_key: bool = True,
                             replace: bool = False) -> ServerFunction:
    """Add a request kind (see :class:`ServerFunction`); on every rank, before declaring it."""
    if name in SERVER_FUNCTIONS and not replace:
        raise ValueError(f"server function {name!r} is already registered")
    if out_width < 1 or in_width < 0:
        raise ValueError(f"server function {name!r}: out_width must be >= 1 and in_width >= 0")
    f = SERVER_FUNCTIONS[name] = ServerFunction(name, fn, int(out_width), int(in_width), bool(per_key))
    return f




@dataclass(frozen=True)
class TableSpec:
    """A sparse table: uint64 key → float32 vector of ``dim``, updated by ``optimizer``.

    ``init`` is ``zeros``, ``uniform`` (in [-init_scale, init_scale)) or ``normal`` (std
    init_scale), deterministic per key and ``seed``. ``params`` are the optimizer's
    hyper-parameters (see the optimizer registry, :mod:`hpcps_kernels.optim`, for names, defaults
    and ranges; user code can register its own update rule there). ``key_bits``: the keys are
    (mostly) below ``2**key_bits``, as hashed features are; up to ``DIRECT_MAX_BITS`` the servers
    address rows directly by key instead of through a hash table (any key still works), once a
    shard holds enough keys to pay for the direct array (``DIRECT_FROM_SHIFT``).
    """

    name: str
    dim: int = 1
    optimizer: str = "sgd"
    params: dict = field(default_factory=dict)
    init: str = "zeros"
    init_scale: float = 0.01
    seed: int = 0
    key_bits: int = 64
    features: Features = Features()
    init_keys: tuple = ()  # ((key, (value, ...) of dim), ...): these keys start at these values

    def __post_init__(self):
        try:
            opt = optim.get(self.optimizer)
        except ValueError as e:
            raise ValueError(f"table {self.name!r}: {e}") from None
        unknown = set(self.params) - set(opt.params)
        if unknown:
            raise ValueError(f"table {self.name!r}: unknown {self.optimizer} parameter(s) {sorted(unknown)}; "
                             f"expected {sorted(opt.params)}")
        if self.init not in kinit.KINDS:
            raise ValueError(f"table {self.name!r}: unknown init {self.init!r}; expected one of {sorted(kinit.KINDS)}")
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim must be at least 1")
        if not 1 <= self.key_bits <= 64:
            raise ValueError(f"table {self.name!r}: key_bits must be between 1 and 64")
        for key, values in self.init_keys:
            if len(values) != self.dim or not 0 <= int(key) < 2**64:
                raise ValueError(f"table {self.name!r}: init_keys entry for key {key} needs a key in [0, 2**64) "
                                 f"and {self.dim} values")
        merged = dict(opt.params)
        merged.update(self.params)
        for key, value in merged.items():
            why = opt.range_error(key, float(value))
            if why:
                raise ValueError(f"table {self.name!r}: {self.optimizer} parameter {key} {why}")
        object.__setattr__(self, "params", merged)

    @property
    def direct(self) -> bool:
        """Rows addressed directly by key (a bounded key space) rather than through a hash table."""
        return self.key_bits <= DIRECT_MAX_BITS

    @property
    def opt(self) -> optim.Optimizer:
        return optim.get(self.optimizer)

    @property
    def width(self) -> int:
        return self.opt.width(self.dim)

    def fingerprint(self) -> int:
        """A 31-bit checksum of the declaration and of its optimizer's definition, compared across
        ranks (a rank that registered another update rule under the same name differs)."""
        facts = (sorted(asdict(self).items()), self.opt.fingerprint())
        return zlib.crc32(repr(facts).encode()) & 0x7FFFFFFF
