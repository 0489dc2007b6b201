"""Stop signals: SIGUSR1 and SIGTERM set a flag that the training loop polls at step boundaries
(where the ranks agree to checkpoint together). Pure Python, no MPI."""

from __future__ import annotations

import signal

_state = {"signal": None, "installed": False}


def install() -> None:
    """Catch SIGUSR1 and SIGTERM (main thread only); a second SIGTERM still stops at once."""
    if _state["installed"]:
        return

    def handler(signum, frame):
        if _state["signal"] == signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        _state["signal"] = signum

    signal.signal(signal.SIGUSR1, handler)
    signal.signal(signal.SIGTERM, handler)
    _state["installed"] = True


def requested() -> int | None:
    """The signal received (SIGUSR1 or SIGTERM), or None."""
    return _state["signal"]


def clear() -> None:
    _state["signal"] = None
