"""Is a peer rank's process still alive, and did it see the failure itself? Used only to name
the rank that failed, and to tell what the coordinator had done.

When a collective breaks, gloo says "connection closed by peer" but not which rank, and the
arrival markers in the job's store are gone if the store's host (rank 0 when torchrun's agent
does not host it) has exited. So every rank publishes a small record of itself when
safeckpt's group is created: pid, process start time and an identity of the kernel and pid
namespace it runs in. A survivor in the same kernel and pid namespace can then tell for
certain whether a peer's process is gone (no /proc entry, a zombie, or the pid reused by a
newer process). For a peer elsewhere the answer is "unknown": never guessed.

A survivor that saw the failure may raise and exit before a slower peer looks; it leaves a
note on its host (``mark_survivor``) so it is not blamed, saying what it had completed.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from typing import Any


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or None if it has none."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read().decode(errors="replace")
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may contain spaces or ")"
    return fields[0], int(fields[19])


_NAMESPACE: dict[int, str | None] = {}


def _namespace() -> str | None:
    """Same string on two processes iff their pids are comparable (same kernel boot and pid ns).
    Looked up once per process: failure diagnosis asks it for every peer."""
    pid = os.getpid()
    if pid not in _NAMESPACE:
        _NAMESPACE[pid] = _read_namespace()
    return _NAMESPACE[pid]


def _read_namespace() -> str | None:
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



_STATES = {"R": "running", "S": "waiting", "D": "blocked in uninterruptible I/O", "T": "stopped",
           "t": "stopped by a debugger"}


def process_state(record: dict[str, Any] | None) -> str | None:
    """How a live peer's process looks (``stopped``, ``running``...), None if unknown."""
    if not record or is_gone(record) is not False:
        return None
    try:
        return _STATES.get(_proc_stat(record["pid"])[0])  # type: ignore[index]
    except (OSError, ValueError, IndexError, KeyError):
        return None


def _marker_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"safeckpt-survivors-{os.getuid()}")


def _note_path(record: dict[str, Any], group: str) -> str:
    # pid + start time name one process on this host (pids are reused, start times differ)
    return os.path.join(_marker_dir(), f"{record.get('pid')}-{record.get('start')}-{group}")


def mark_survivor(group: str, note: dict[str, Any]) -> None:
    """Leave a note on this host that this process saw the failure of ``group`` itself.

    A survivor may raise and exit before a slower peer looks, and then its process is gone
    too (with the store, if it was rank 0); the note, found from the process's record where
    the pid check works (on this host), keeps it from being blamed and tells what it had
    done. Notes older than a day are removed.
    """
    try:
        folder = _marker_dir()
        os.makedirs(folder, exist_ok=True)
        path = _note_path(self_record(), group)
        with open(f"{path}.tmp", "w") as f:
            json.dump(note, f)
        os.replace(f"{path}.tmp", path)
        cutoff = time.time() - 86400
        for name in os.listdir(folder):
            old = os.path.join(folder, name)
            if os.path.getmtime(old) < cutoff:
                os.unlink(old)
    except OSError:
        pass


def survivor_note(record: dict[str, Any] | None, group: str) -> dict[str, Any] | None:
    """The note the process of ``record`` left on this host for ``group``, or None."""
    if not record:
        return None
    try:
        with open(_note_path(record, group)) as f:
            note = json.load(f)
        return note if isinstance(note, dict) else None
    except (OSError, ValueError):
        return None
