"""Preemption: a signal on any rank becomes a flag every rank agrees on at the same call.

The handler only sets a flag (never collectives in a signal handler) and then chains to the
handler that was installed before, unless that was the default action (which would kill the
process before it can save) or "ignore". The agreement is a one-int MAX all-reduce on the
checkpoint group, cheap enough to call every step.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Iterable
from typing import Any

from ..errors import SafeckptWarning


class PreemptionWatcher:
    def __init__(self, signals: Iterable[int]) -> None:
        self.flag = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "CheckpointManager was created outside the main thread: preemption signals are "
                "not watched (signal handlers can only be installed from the main thread).",
                SafeckptWarning, stacklevel=3,
            )
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag = True
        self.signum = signum
        prev = self._previous.get(signum)
        if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler):
            prev(signum, frame)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            try:
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, prev)
            except (ValueError, TypeError):  # not in main thread / interpreter shutting down
                pass
        self._previous.clear()

