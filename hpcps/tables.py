"""Table declarations (pure): what a table is, identical on every rank."""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field

from hpcps_kernels import init as kinit
from hpcps_kernels import optim

OPTIMIZER_PARAMS = {
    "sgd": {"lr": 0.01, "l2": 0.0},
    "adagrad": {"lr": 0.01, "eps": 1e-8, "l2": 0.0, "initial_accumulator": 0.1},
    "ftrl": {"alpha": 0.1, "beta": 1.0, "l1": 0.0, "l2": 0.0},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "l2": 0.0},
}

# The allowed range of each hyper-parameter: (low, high, low_open, high_open). A name not listed
# here is ">= 0". Learning rates and FTRL's alpha must be positive (alpha = 0 divides by zero).
_POSITIVE = (0.0, float("inf"), True, False)
_UNIT = (0.0, 1.0, False, True)  # [0, 1)
PARAM_RANGES = {
    "lr": _POSITIVE, "alpha": _POSITIVE, "eps": _POSITIVE, "beta1": _UNIT, "beta2": _UNIT,
}


def param_range_error(name: str, value: float) -> str | None:
    """Why ``value`` is not allowed for the optimizer hyper-parameter ``name`` (None if it is)."""
    lo, hi, lo_open, hi_open = PARAM_RANGES.get(name, (0.0, float("inf"), False, False))
    if value != value or value in (float("inf"), float("-inf")):
        return f"must be a finite number (got {value})"
    if (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi):
        if hi == float("inf"):
            return f"must be {'greater than' if lo_open else 'at least'} {lo:g} (got {value:g})"
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        return f"must be in {left}{lo:g}, {hi:g}{right} (got {value:g})"
    return None


DIRECT_MAX_BITS = 26  # direct addressing costs 4 * 2**key_bits bytes per server: 256 MiB at 26 bits


@dataclass(frozen=True)
class TableSpec:
    """A sparse table: uint64 key → float32 vector of ``dim``, updated by ``optimizer``.

    ``init`` is ``zeros``, ``uniform`` (in [-init_scale, init_scale)) or ``normal`` (std
    init_scale), deterministic per key and ``seed``. ``params`` are the optimizer's
    hyper-parameters (see ``OPTIMIZER_PARAMS`` for names and defaults). ``key_bits``: the keys are
    (mostly) below ``2**key_bits``, as hashed features are; up to ``DIRECT_MAX_BITS`` the servers
    address rows directly by key instead of through a hash table (any key still works).
    """

    name: str
    dim: int = 1
    optimizer: str = "sgd"
    params: dict = field(default_factory=dict)
    init: str = "zeros"
    init_scale: float = 0.01
    seed: int = 0
    key_bits: int = 64

    def __post_init__(self):
        if self.optimizer not in OPTIMIZER_PARAMS:
            raise ValueError(f"table {self.name!r}: unknown optimizer {self.optimizer!r}; "
                             f"expected one of {sorted(OPTIMIZER_PARAMS)}")
        unknown = set(self.params) - set(OPTIMIZER_PARAMS[self.optimizer])
        if unknown:
            raise ValueError(f"table {self.name!r}: unknown {self.optimizer} parameter(s) {sorted(unknown)}; "
                             f"expected {sorted(OPTIMIZER_PARAMS[self.optimizer])}")
        if self.init not in kinit.KINDS:
            raise ValueError(f"table {self.name!r}: unknown init {self.init!r}; expected one of {sorted(kinit.KINDS)}")
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim must be at least 1")
        if not 1 <= self.key_bits <= 64:
            raise ValueError(f"table {self.name!r}: key_bits must be between 1 and 64")
        merged = dict(OPTIMIZER_PARAMS[self.optimizer])
        merged.update(self.params)
        for key, value in merged.items():
            why = param_range_error(key, float(value))
            if why:
                raise ValueError(f"table {self.name!r}: {self.optimizer} parameter {key} {why}")
        object.__setattr__(self, "params", merged)

    @property
    def direct(self) -> bool:
        """Rows addressed directly by key (a bounded key space) rather than through a hash table."""
        return self.key_bits <= DIRECT_MAX_BITS

    @property
    def width(self) -> int:
        return optim.width(self.optimizer, self.dim)

    def fingerprint(self) -> int:
        """A 31-bit checksum of the declaration, compared across ranks."""
        return zlib.crc32(repr(sorted(asdict(self).items())).encode()) & 0x7FFFFFFF
