"""engine.background.AsyncSaver: one worker thread serves a saver's saves (no thread started
per save: that cost 1-3 ms of the blocking part on a loaded 2-core machine), ends when idle,
and a failed save's error is raised by wait() once. The exit behaviour (a script that just
ends still commits its final save) is tests/test_async.py's, with real processes."""

from __future__ import annotations

import threading
import time

import pytest

from safeckpt.engine import background

pytestmark = pytest.mark.timeout(60)


def test_one_worker_serves_every_save_and_ends_when_idle(monkeypatch):
    monkeypatch.setattr(background, "IDLE_EXIT", 0.3)
    saver = background.AsyncSaver()
    seen = []
    for i in range(3):
        saver.submit(lambda i=i: seen.append((i, threading.get_ident())) or i, f"step {i}")
        assert saver.pending
        assert saver.wait() == i
        assert not saver.pending
    assert [i for i, _ in seen] == [0, 1, 2] and len({t for _, t in seen}) == 1
    worker = saver._worker
    assert worker is not None and worker.daemon
    deadline = time.time() + 10
    while worker.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert not worker.is_alive() and saver._worker is None  # idle: it ended
    saver.submit(lambda: 7, "step 7")  # a new worker takes the next save
    assert saver.wait() == 7


def test_a_failed_save_raises_once_and_the_next_one_runs():
    saver = background.AsyncSaver()

    def boom() -> None:
        raise OSError("disk full")

    saver.submit(boom, "step 1")
    with pytest.raises(OSError, match="disk full"):
        saver.wait()
    assert saver.wait() is None  # raised once
    saver.submit(lambda: "ok", "step 2")
    assert saver.wait() == "ok"


def test_without_the_exit_hook_each_save_runs_on_a_non_daemon_thread(monkeypatch):
    def refuse(_fn):  # noqa: ANN001
        raise RuntimeError("can't register atexit after shutdown")

    monkeypatch.setattr(threading, "_register_atexit", refuse)
    saver = background.AsyncSaver()
    saver.submit(lambda: threading.current_thread().daemon, "step 1")
    assert saver._thread is not None
    assert saver.wait() is False


def test_a_process_forked_while_a_save_is_in_flight_exits_at_once():
    """A DataLoader worker forked while a background save runs inherits the saver but not its
    worker: at its exit the hook must not wait for the parent's save (it hung forever)."""
    import multiprocessing as mp

    saver = background.AsyncSaver()
    release = threading.Event()
    saver.submit(lambda: release.wait(20), "step 1")
    child = mp.get_context("fork").Process(target=lambda: None)
    started = time.time()
    child.start()
    child.join(15)
    alive = child.is_alive()
    if alive:
        child.kill()
    release.set()
    assert saver.wait() is True
    assert not alive and child.exitcode == 0 and time.time() - started < 10
