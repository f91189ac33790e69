"""Settings read from the environment that several layers share (the lowest layer, with
``errors``): one timeout governs collectives and the storage calls made inside them.
"""

from __future__ import annotations

import os

DEFAULT_TIMEOUT = 600.0
TIMEOUT_ENV = "SAFECKPT_TIMEOUT"


def resolve_timeout(timeout: float | None) -> float:
    """Seconds a rank waits for the others: argument, else $SAFECKPT_TIMEOUT, else 600."""
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV)
        timeout = float(env) if env else DEFAULT_TIMEOUT
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    return float(timeout)
