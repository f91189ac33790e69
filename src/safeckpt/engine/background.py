"""Run the write/commit part of one save off the training thread.

- Exactly one save in flight; the next one (and ``wait``) first joins it and raises its error
  once. Background collectives run on their own gloo group, never the training group nor the
  main thread's checkpoint group (a group shared between threads aborts the process).
- One worker thread per saver runs the saves (a daemon); a hook registered with
  ``threading._register_atexit`` (it runs before the interpreter stops its threads) waits for
  the pending save, so a script that just ends (or calls ``sys.exit``) still commits its final
  save, and reports a failed one on stderr with a non-zero exit code. Where that hook cannot be
  registered, each save runs on a non-daemon thread of its own (Python waits for it at exit).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..coord.lease import release_held_leases

IDLE_EXIT = 30.0  # seconds a saver's worker thread waits for the next save before it ends


class AsyncSaver:
    def __init__(self, name: str = "safeckpt-save") -> None:
        self.name = name
        self._thread: threading.Thread | None = None  # a save's own thread (the fallback), or None
        self._done: threading.Event | None = None  # set when the pending save finished; None: none
        self._job: Callable[[], Any] | None = None  # what the worker runs next
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Any = None
        self._label = ""
        self._hooked = False
        self._pid = os.getpid()  # the process whose worker runs the pending save

    @property
    def pending(self) -> bool:
        self._forget_if_forked()
        return self._done is not None

    def submit(self, fn: Callable[[], Any], label: str) -> None:
        """Hand ``fn`` to the saving thread and return at once. One worker thread serves every
        save of this saver (starting a thread per save cost 1-3 ms of the blocking part on a
        loaded 2-core machine); it is a daemon, and the exit hook (registered first) waits for
        the pending save, so a script that just ends still commits it. Where that hook cannot
        be registered, each save runs on a non-daemon thread of its own, as before."""
        self._forget_if_forked()
        assert self._done is None, "one save in flight at a time"
        self._error, self._result, self._label = None, None, label
        self._hook()
        done = self._done = threading.Event()

        # The save's closure (its manager) is let go before the save is reported done: a manager
        # dropped right after wait() is then collected, and releases its lease, at once.
        todo = [fn]
        del fn

        def target() -> None:
            try:
                self._result = todo[0]()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc
            finally:
                todo.clear()
                done.set()

        if not self._hooked:
            self._thread = threading.Thread(target=target, name=self.name, daemon=False)
            self._thread.start()
            return
        with self._ready:
            self._job = target
            if self._worker is None or not self._worker.is_alive():  # first use, or after a fork
                self._worker = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._worker.start()
            self._ready.notify()

    def _forget_if_forked(self) -> None:
        """In a forked child (a DataLoader worker) the parent's pending save and worker do not
        exist: nothing is pending here, and the exit hook must not wait for the parent's save
        (it would wait forever: no thread of this process sets its event)."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._done, self._job, self._thread, self._worker = None, None, None, None
        self._ready = threading.Condition()  # the parent's worker may have held the old one
        self._error, self._result = None, None

    def _serve(self) -> None:
        """The worker: run each job handed over; after ``IDLE_EXIT`` seconds without one it
        ends (a manager no longer saving leaves no thread behind; the next save starts one)."""
        while True:
            with self._ready:
                while self._job is None:
                    if not self._ready.wait(timeout=IDLE_EXIT) and self._job is None:
                        self._worker = None
                        return
                job, self._job = self._job, None
            job()

    def _hook(self) -> None:
        if self._hooked:
            return
        try:
            threading._register_atexit(self._drain_at_exit)  # type: ignore[attr-defined]
            self._hooked = True
        except (AttributeError, RuntimeError):
            pass

    def wait(self) -> Any:
        """Block until the pending save finished; raise its error (once)."""
        self._forget_if_forked()
        done = self._done
        if done is None:
            return None
        done.wait()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._done = None
        err, self._error = self._error, None
        if err is not None:
            raise err
        return self._result

    def _drain_at_exit(self) -> None:
        self._forget_if_forked()
        if self._done is None:
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
            release_held_leases()  # os._exit skips the hook that would (coord.lease)
            os._exit(1)
