"""A writer lease on a checkpoint root, so two jobs never interleave checkpoints in one root.

Only the coordinator of a job takes it, at its first save; readers never do. The lease is a
small JSON file created with O_EXCL, naming the holder (run id, host, pid) and refreshed by a
heartbeat thread that only touches this file (no collectives). A holder counts as gone when it
is on this host and its pid is dead, when its heartbeat is older than the lease, or when it is
an earlier incarnation of the same torchrun job (same TORCHELASTIC_RUN_ID). A stale lease is
taken over by renaming it aside first, so two contenders cannot both win.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from ._storage import is_remote
from .errors import CheckpointLocked

LOCK_NAME = ".safeckpt.lock"
DEFAULT_LEASE = 120.0


def default_run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_lock(root: str) -> dict[str, Any] | None:
    if is_remote(root):
        from ._remote import read_lock as read_remote

        return read_remote(root)
    try:
        with open(os.path.join(root, LOCK_NAME)) as f:
            data = json.load(f)
        data["age"] = time.time() - os.path.getmtime(os.path.join(root, LOCK_NAME))
        return data
    except (FileNotFoundError, json.JSONDecodeError, OSError):
        return None


def locked_error(root: str, holder: dict[str, Any], lease: float) -> CheckpointLocked:
    """The error for a second writer: who holds the root and what to do."""
    return CheckpointLocked(
        f"{root} is being written by another job (run {holder.get('run_id')}, "
        f"host {holder.get('host')}, pid {holder.get('pid')}, heartbeat "
        f"{holder.get('age', 0):.0f}s ago). Two jobs must not share a checkpoint root: "
        "stop the other job or use another root. If it is gone, the lease expires "
        f"{holder.get('lease', lease):.0f}s after its last heartbeat "
        "(or run `safeckpt gc --break-lock ROOT`)."
    )


def holder_is_live(holder: dict[str, Any], lease: float = DEFAULT_LEASE) -> bool:
    if holder.get("age", 0.0) > holder.get("lease", lease):
        return False
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return _pid_alive(holder["pid"])
    return True


class RootLock:
    """The writer lease on ``root`` held by this process."""

    def __init__(self, root: str, run_id: str | None = None, lease: float = DEFAULT_LEASE) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK_NAME)
        self.run_id = run_id or default_run_id()
        self.lease = lease
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({
            "run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.time(), "lease": self.lease,
        }).encode()

    def acquire(self) -> None:
        if self.held:
            self.refresh()
            return
        os.makedirs(self.root, exist_ok=True)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_lock(self.root)
                if holder is None:
                    time.sleep(0.05)  # being written or replaced right now
                    continue
                same_job = holder.get("run_id") == self.run_id and "TORCHELASTIC_RUN_ID" in os.environ
                if holder_is_live(holder, self.lease) and not same_job:
                    raise locked_error(self.root, holder, self.lease) from None
                aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(self.path, aside)
                    os.unlink(aside)
                except FileNotFoundError:
                    pass  # someone else took it over; try again
                continue
            try:
                os.write(fd, self._record())
                os.fsync(fd)
            finally:
                os.close(fd)
            self.held = True
            self._start_heartbeat()
            return
        raise CheckpointLocked(f"could not take the writer lease on {self.root} (contention)")

    def refresh(self) -> None:
        if self.held:
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.held = False
                self.acquire()

    def _start_heartbeat(self) -> None:
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(self.lease / 4):
                try:
                    os.utime(self.path)
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="safeckpt-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self.held:
            holder = read_lock(self.root)
            if holder and holder.get("pid") == os.getpid() and holder.get("run_id") == self.run_id:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            self.held = False


def writer_lease(root: str, run_id: str | None = None, lease: float = DEFAULT_LEASE) -> Any:
    """The lease object for ``root``: a :class:`RootLock`, or for a remote root (fsspec URL)
    the best-effort :class:`safeckpt._remote.RemoteLock` with the same methods."""
    if is_remote(root):
        from ._remote import RemoteLock

        return RemoteLock(root, run_id, lease)
    return RootLock(root, run_id, lease)
