"""Is a peer rank's process still alive? Used only to name the rank that failed.

When a collective breaks, gloo says "connection closed by peer" but not which rank, and the
arrival markers in the job's store are gone if the store's host (rank 0 when torchrun's agent
does not host it) is the one that died. So every rank publishes a small record of itself when
safeckpt's group is created: pid, process start time and an identity of the kernel and pid
namespace it runs in. A survivor in the same kernel and pid namespace can then tell for
certain whether a peer's process is gone (no /proc entry, a zombie, or the pid reused by a
newer process). For a peer elsewhere the answer is "unknown": never guessed.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or None if it has none."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read().decode(errors="replace")
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may contain spaces or ")"
    return fields[0], int(fields[19])


def _namespace() -> str | None:
    """Same string on two processes iff their pids are comparable (same kernel boot and pid ns)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{socket.gethostname()}/{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def self_record() -> dict[str, Any]:
    """What this process publishes about itself (JSON)."""
    pid = os.getpid()
    try:
        start: int | None = _proc_stat(pid)[1]  # type: ignore[index]
    except (OSError, ValueError, IndexError):
        start = None
    return {"pid": pid, "host": socket.gethostname(), "ns": _namespace(), "start": start}


def is_gone(record: dict[str, Any] | None) -> bool | None:
    """True if the process ``record`` describes has exited (or been killed), False if it is
    alive, None if this process cannot tell (another host or namespace, or no record)."""
    if not record or record.get("ns") is None or record.get("ns") != _namespace():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        state, start = _proc_stat(pid)  # type: ignore[misc]
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return None
    if state in ("Z", "X", "x"):
        return True  # exited; its parent has not reaped it yet
    return record.get("start") is not None and start != record["start"]  # pid reused: gone


class _Watch:
    """One blocking call's view: when each watched peer was first seen gone."""

    def __init__(self, peers: dict[int, dict[str, Any]]) -> None:
        self.peers = peers
        self.first_gone: dict[int, float] = {}


class DeathWatch:
    """Notes the moment each peer's process is first seen gone while a blocking call runs.

    When several processes are gone by the time a survivor's call fails (it may have waited
    out a timeout while other survivors already failed and exited), the order tells which
    one went first. A daemon thread polls /proc only while some call is being watched; it
    runs no collectives and touches no shared state but its own.
    """

    INTERVAL = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: list[_Watch] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watching(self, peers: list[dict[str, Any] | None]) -> Iterator[_Watch]:
        here = _namespace()
        comparable = {r: p for r, p in enumerate(peers) if p and here is not None and p.get("ns") == here}
        watch = _Watch(comparable)
        if not comparable:
            yield watch
            return
        with self._lock:
            self._active.append(watch)
            if self._thread is None or not self._thread.is_alive():  # also after a fork
                self._thread = threading.Thread(target=self._run, name="safeckpt-deathwatch", daemon=True)
                self._thread.start()
            self._wake.set()
        try:
            yield watch
        finally:
            with self._lock:
                self._active.remove(watch)
                if not self._active:
                    self._wake.clear()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                watches = list(self._active)
            for w in watches:
                for r, rec in w.peers.items():
                    if r not in w.first_gone and is_gone(rec):
                        w.first_gone[r] = time.monotonic()
            time.sleep(self.INTERVAL)


DEATH_WATCH = DeathWatch()
