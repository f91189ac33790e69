"""A writer lease on a checkpoint root, so two jobs never interleave checkpoints in one root.

Only the coordinator of a job takes it, at its first save; readers never do. The lease is a
small JSON record at ``ROOT/.safeckpt.lock`` naming the holder (run id, host, pid, a nonce),
created only if absent and refreshed by a heartbeat thread that touches only this record (no
collectives). A holder counts as gone when it is on this host and its pid is dead, when its
heartbeat is older than the lease, or when it is an earlier incarnation of the same torchrun job
(same TORCHELASTIC_RUN_ID). A stale lease is taken over through the storage's ``take_over``
(a rename aside on POSIX), so two contenders cannot both win.

The storage primitives decide how strong this is: on POSIX the record is created with
``O_EXCL`` and the heartbeat is its mtime; on an object store it is created with a conditional
write where the store has one (else after an existence check) and the heartbeat time is written
into the record. The holder reads the record back before trusting it, and every save re-checks
that it still holds it. On a store without conditional writes this is best effort.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any

from ..errors import CheckpointLocked
from ..storage.base import Storage, storage_for

LOCK_NAME = ".safeckpt.lock"
DEFAULT_LEASE = 120.0
MAX_RECORD = 1 << 16


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


def read_lock(root: str, store: Storage | None = None) -> dict[str, Any] | None:
    """The lease record on ``root`` with its ``age`` (seconds since the last heartbeat), or
    None when there is none (or it cannot be read)."""
    store = store or storage_for(root)
    path = store.join(root, LOCK_NAME)
    raw = store.read(path, MAX_RECORD)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            return None
        data["age"] = store.age(path, data)
        return data
    except (ValueError, TypeError, OSError):
        return None


def break_lease(root: str, store: Storage | None = None) -> None:
    """Remove the lease record, whoever holds it (``safeckpt gc --break-lock``)."""
    store = store or storage_for(root)
    store.take_over(store.join(root, LOCK_NAME))


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
    """The writer lease on ``root`` held by this process (any storage)."""

    def __init__(self, root: str, run_id: str | None = None, lease: float = DEFAULT_LEASE,
                 store: Storage | None = None) -> None:
        self.root = root
        self.store = store or storage_for(root)
        self.path = self.store.join(root, LOCK_NAME)
        self.run_id = run_id or default_run_id()
        self.lease = lease
        self.nonce = uuid.uuid4().hex
        self.held = False
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # A lease whose holder object is garbage collected (a manager or accelerator dropped
        # without close()) is released: the heartbeat thread holds only a weak reference, and
        # this finalizer stops it and removes the record if it is still ours.
        self._finalizer = weakref.finalize(self, _drop_record, self.store, self.path, self.nonce,
                                           self._stop)

    def _record(self) -> bytes:
        return json.dumps({
            "run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
            "started": self._started, "beat": time.time(), "lease": self.lease, "nonce": self.nonce,
        }).encode()

    def _mine(self) -> bool | None:
        """True if the record names us, False if someone else, None if there is none."""
        holder = read_lock(self.root, self.store)
        if holder is None:
            return None
        return holder.get("nonce") == self.nonce

    def acquire(self) -> None:
        if self.held:
            self.refresh()
            return
        for _ in range(5):
            holder = read_lock(self.root, self.store)
            if holder is not None:
                same_job = holder.get("run_id") == self.run_id and "TORCHELASTIC_RUN_ID" in os.environ
                if holder.get("nonce") != self.nonce and holder_is_live(holder, self.lease) and not same_job:
                    raise locked_error(self.root, holder, self.lease)
                self.store.take_over(self.path)  # stale: only one contender wins
            self._started = time.time()
            try:
                self.store.create(self.path, self._record())
            except FileExistsError:
                time.sleep(0.05)  # being written or replaced right now
                continue
            if self.store.lease_settle:
                time.sleep(self.store.lease_settle)
            if self._mine():
                self.held = True
                self._start_heartbeat()
                return
        raise CheckpointLocked(f"could not take the writer lease on {self.root} (contention)")

    def refresh(self) -> None:
        """Called at each save: still ours? Then mark it fresh; else take it again or raise."""
        if not self.held:
            return
        if self._mine():
            self.store.touch(self.path, self._record())
            return
        self.held = False  # lost it (expired and taken over, or broken)
        self._stop_heartbeat()
        self.acquire()

    def _start_heartbeat(self) -> None:
        self._stop = threading.Event()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _drop_record, self.store, self.path, self.nonce,
                                           self._stop)
        stop = self._stop
        me = weakref.ref(self)
        period = self.lease / 4

        def beat() -> None:
            while not stop.wait(period):
                lock = me()
                if lock is None:
                    return
                try:
                    if lock._mine():
                        lock.store.touch(lock.path, lock._record())
                except Exception:  # noqa: BLE001 - best effort; the next save re-checks
                    pass
                del lock

        self._thread = threading.Thread(target=beat, name="safeckpt-lease", daemon=True)
        self._thread.start()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)  # a heartbeat mid-write must not recreate the record
            self._thread = None

    def release(self) -> None:
        self._stop_heartbeat()
        if self.held:
            try:
                if self._mine():
                    self.store.delete(self.path)
            except Exception:  # noqa: BLE001 - releasing must not mask the caller's outcome
                pass
            self.held = False


def _drop_record(store: Storage, path: str, nonce: str, stop: threading.Event) -> None:
    """Finalizer of a collected RootLock: stop its heartbeat, remove the record if ours."""
    stop.set()
    try:
        raw = store.read(path, MAX_RECORD)
        if raw is not None and json.loads(raw).get("nonce") == nonce:
            store.delete(path)
    except Exception:  # noqa: BLE001 - best effort, possibly at interpreter exit
        pass


def writer_lease(root: str, run_id: str | None = None, lease: float = DEFAULT_LEASE,
                 store: Storage | None = None) -> RootLock:
    """The lease object for ``root`` (taken by :meth:`RootLock.acquire`)."""
    return RootLock(root, run_id, lease, store)
