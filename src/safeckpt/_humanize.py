"""Numbers and times for people: sizes, ages, timestamps, metric values. No dependencies."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size(nbytes: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units; whole bytes below 1 KiB)."""
    n = float(nbytes)
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def age(seconds: float) -> str:
    """``75`` -> ``"1m15s"``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def timestamp(value: str | float | None) -> str:
    """An ISO time (``2025-01-02T03:04:05Z``) or a Unix time, as ``2025-01-02 03:04:05Z``."""
    if value is None or value == "":
        return "-"
    if isinstance(value, (int, float)):
        value = iso(value)
    return str(value).replace("T", " ", 1)


def number(value: Any) -> str:
    """A metric value: floats with 4 significant digits, everything else as is."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def metrics(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={number(v)}" for k, v in values.items()) or "-"


def shape(dims: list[int] | tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def iso(unix: float) -> str:
    """A Unix time as ISO 8601 UTC, the way manifests record ``created_at``."""
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
