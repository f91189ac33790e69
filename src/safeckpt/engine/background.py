"""Run the write/commit part of one save off the training thread.

- Exactly one save in flight; the next one (and ``wait``) first joins it and raises its error
  once. Background collectives run on their own gloo group, never the training group nor the
  main thread's checkpoint group (a group shared between threads aborts the process).
- The thread is *non-daemon*: Python waits for it before exit, so a script that just ends (or
  calls ``sys.exit``) still commits its final save. A hook registered with
  ``threading._register_atexit`` (runs before that wait) reports a failed final save on stderr
  and makes the exit code non-zero.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any


class AsyncSaver:
    def __init__(self, name: str = "safeckpt-save") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Any = None
        self._label = ""
        self._hooked = False

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def submit(self, fn: Callable[[], Any], label: str) -> None:
        assert self._thread is None, "one save in flight at a time"
        self._error, self._result, self._label = None, None, label

        def target() -> None:
            try:
                self._result = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc

        self._thread = threading.Thread(target=target, name=self.name, daemon=False)
        self._thread.start()
        if not self._hooked:
            try:
                threading._register_atexit(self._drain_at_exit)  # type: ignore[attr-defined]
                self._hooked = True
            except (AttributeError, RuntimeError):
                pass

    def wait(self) -> Any:
        """Block until the pending save finished; raise its error (once)."""
        thread = self._thread
        if thread is None:
            return None
        thread.join()
        self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err
        return self._result

    def _drain_at_exit(self) -> None:
        if self._thread is None:
            return
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001
            sys.stderr.write(
                f"safeckpt: the final background save ({self._label}) FAILED at exit and was not "
                f"published; the previous checkpoint is intact.\n{type(exc).__name__}: {exc}\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)
