"""A writer lease on a checkpoint root, so two jobs never interleave checkpoints in one root.

Only the coordinator of a job takes it, at its first save; readers never do. The lease is a
small JSON record at ``ROOT/.safeckpt.lock`` naming the holder (run id, host, pid, a nonce),
created only if absent and refreshed by a heartbeat thread that touches only this record (no
collectives). A holder counts as gone when it is on this host and its pid is dead, or when its
heartbeat is older than the lease. A holder of the same job (same run id) is replaced even while
it lives: an elastic restart under the same rendezvous id, or another process of the same job.

The run id is the job's identity (:func:`default_run_id`): torchrun's rendezvous id where it is a
real one (``--rdzv-id``, or the uuid of ``--standalone``), else a token the job's ranks agree on
through the job's store (``coord.dist.job_token``). Plain ``torchrun`` (no ``--rdzv-id``) sets
TORCHELASTIC_RUN_ID to ``none`` in every job, so that value never identifies one.

A stale lease is taken over under a take-over mutex (``ROOT/.safeckpt.lock.takeover``, created
only if absent): the record is read again there and removed (the storage's ``take_over``, a
rename aside on POSIX) only if it is still the stale one. So a contender that judged a record
stale a moment ago cannot remove the fresh record another contender has just written, and two
contenders cannot both win.

The storage primitives decide how strong this is: on POSIX the record is created with
``O_EXCL`` and the heartbeat is its mtime; on an object store it is created with a conditional
write where the store has one (else after an existence check) and the heartbeat time is written
into the record. The holder reads the record back before trusting it, and every save re-checks
that it still holds it. On a store without conditional writes this is best effort.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours (see below)
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
TAKEOVER_SUFFIX = ".takeover"  # the take-over mutex: ROOT/.safeckpt.lock.takeover
DEFAULT_LEASE = 120.0
MAX_RECORD = 1 << 16
MUTEX_STALE = 30.0  # seconds after which a take-over mutex is a crashed contender's (it lives ms)
ACQUIRE_WAIT = 10.0  # seconds acquire() retries while others create, replace or take over
# ... and longer while a take-over mutex is in the way: a crashed contender's is broken only after
# MUTEX_STALE, and giving up before that said "contention" where nobody contends.


def rendezvous_id() -> str | None:
    """torchrun's rendezvous id when it names one job: plain ``torchrun`` (no ``--rdzv-id``)
    sets TORCHELASTIC_RUN_ID to ``none`` in every job, so ``none`` (or empty) is no identity."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    return rid if rid and rid.lower() != "none" else None


_PROCESS_TOKEN: dict[int, str] = {}


def default_run_id() -> str:
    """This job's identity for the lease: the rendezvous id, else the token the job's ranks
    agree on through its store (the first to ask draws it), else one of this process alone."""
    rid = rendezvous_id()
    if rid:
        return rid
    try:
        from .dist import job_token  # lazy: only a job's writer needs it (the CLI names its own)

        token = job_token()
    except Exception:  # noqa: BLE001 - no torch.distributed, or its store does not answer
        token = None
    if token:
        return token
    pid = os.getpid()
    return _PROCESS_TOKEN.setdefault(pid, f"pid{pid}-{uuid.uuid4().hex[:12]}")


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
    return _read_record(store, store.join(root, LOCK_NAME))


def _read_record(store: Storage, path: str) -> dict[str, Any] | None:
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
        # None: the job's identity, resolved at the first acquire (the process group may not
        # exist yet when the lease object is made)
        self.run_id = run_id
        self.lease = lease
        self.nonce = uuid.uuid4().hex
        self.held = False
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # While the lease is held: a holder object garbage collected (a manager or accelerator
        # dropped without close()) releases it (the heartbeat thread holds only a weak
        # reference; this finalizer stops it and removes the record if it is still ours). None
        # while not held: a lease never taken (every rank but the coordinator) or released does
        # no storage call when it is collected or at exit.
        self._finalizer: weakref.finalize | None = None

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
        if self.run_id is None:
            self.run_id = default_run_id()
        started = time.monotonic()
        mutex_seen: dict[str, Any] | None = None
        while True:
            holder = read_lock(self.root, self.store)
            if holder is not None:
                if not self._replaceable(holder):
                    raise locked_error(self.root, holder, self.lease)
                self._take_over(holder)  # stale or ours: removed unless it changed meanwhile
            else:
                self._started = time.time()
                try:
                    self.store.create(self.path, self._record())
                except FileExistsError:
                    pass  # another contender created it first: judge its record
                else:
                    if self.store.lease_settle:
                        time.sleep(self.store.lease_settle)
                    if self._mine():
                        self.held = True
                        self._start_heartbeat()
                        return
            waited = time.monotonic() - started
            if waited > ACQUIRE_WAIT:
                mutex = _read_record(self.store, self.path + TAKEOVER_SUFFIX)
                if mutex is not None:
                    mutex_seen = mutex
                if waited > ACQUIRE_WAIT + (MUTEX_STALE if mutex_seen is not None else 0.0):
                    holder = "" if mutex_seen is None else (
                        f"; a take-over by pid {mutex_seen.get('pid')} on {mutex_seen.get('host')} "
                        "was in the way")
                    raise CheckpointLocked(f"could not take the writer lease on {self.root} (contention{holder})")
            time.sleep(0.05)  # being written, replaced or taken over right now

    def _replaceable(self, holder: dict[str, Any]) -> bool:
        """The record may be removed: ours, its holder is gone (dead pid on this host, heartbeat
        older than the lease), or it is this same job's: an elastic restart under the same
        rendezvous id (the old coordinator elsewhere may still look alive), or another process
        of this job (the same agreed token). Never another lease object of this very process
        under a token: two managers writing one root."""
        if holder.get("nonce") == self.nonce or not holder_is_live(holder, self.lease):
            return True
        if holder.get("run_id") != self.run_id:
            return False
        same_process = holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()
        return self.run_id == rendezvous_id() or not same_process

    def _take_over(self, stale: dict[str, Any]) -> None:
        """Remove the record ``stale`` (as read) if it is still there and still replaceable.

        Under the take-over mutex: between reading a stale record and removing it, another
        contender may have removed it and written its own fresh record; removing "whatever is
        there" would then throw the winner's record away and let both write. The mutex is
        created only if absent, held for a read and a rename, and a crashed contender's is
        broken after MUTEX_STALE seconds (or at once when its pid is dead on this host).
        """
        mutex = self.path + TAKEOVER_SUFFIX
        try:
            self.store.create(mutex, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                 "beat": time.time(), "nonce": self.nonce}).encode())
        except FileExistsError:
            other = _read_record(self.store, mutex)
            if other is not None and (other.get("age", 0.0) > MUTEX_STALE
                                      or not holder_is_live(other, MUTEX_STALE)):
                self.store.take_over(mutex)  # its contender crashed mid take-over
            return
        try:
            if self.store.lease_settle:
                time.sleep(self.store.lease_settle)
            mutex_record = _read_record(self.store, mutex)
            if mutex_record is None or mutex_record.get("nonce") != self.nonce:
                return  # not ours after all (a store without conditional writes)
            current = read_lock(self.root, self.store)
            if (current is not None and current.get("nonce") == stale.get("nonce")
                    and current.get("run_id") == stale.get("run_id") and self._replaceable(current)):
                self.store.take_over(self.path)
        finally:
            try:
                self.store.delete(mutex)
            except Exception:  # noqa: BLE001 - a leftover mutex is broken after MUTEX_STALE
                pass

    def refresh(self) -> None:
        """Called at each save: still ours? Then mark it fresh; else take it again or raise."""
        if not self.held:
            return
        if self._mine():
            self.store.touch(self.path, self._record())
            return
        self.held = False  # lost it (expired and taken over, or broken)
        self._stop_heartbeat()
        self._disarm()
        self.acquire()

    def _start_heartbeat(self) -> None:
        self._stop = threading.Event()
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _drop_record, self.store, self.path, self.nonce,
                                           self._stop, os.getpid())
        with _HELD_LOCK:
            _HELD[self] = os.getpid()
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

    def _disarm(self) -> None:
        """Not held any more: nothing to release when collected or at exit."""
        with _HELD_LOCK:
            _HELD.pop(self, None)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def release(self) -> None:
        self._stop_heartbeat()
        if self.held and _HELD.get(self) != os.getpid():  # a forked child's copy: its parent's lease
            self.held = False
        if self.held:
            try:
                if self._mine():
                    self.store.delete(self.path)
            except Exception:  # noqa: BLE001 - releasing must not mask the caller's outcome
                pass
            self.held = False
        self._disarm()


def _drop_record(store: Storage, path: str, nonce: str, stop: threading.Event, pid: int) -> None:
    """Finalizer of a collected RootLock: stop its heartbeat, remove the record if ours (never
    in a forked child, whose copy of the lease is its parent's)."""
    stop.set()
    if os.getpid() != pid:
        return
    try:
        raw = store.read(path, MAX_RECORD)
        if raw is not None and json.loads(raw).get("nonce") == nonce:
            store.delete(path)
    except Exception:  # noqa: BLE001 - best effort, possibly at interpreter exit
        pass


# The leases this process holds, with the pid that took each. Released by
# _release_held_at_exit before the interpreter's shutdown stops new executor work: after that
# (weakref finalizers run at atexit, later) an object store client cannot open a connection (an
# S3 call at exit failed after ~11 s of retries, "cannot schedule new futures after shutdown"),
# so a job ending without close() kept its record and stalled at exit on every rank.
_HELD: weakref.WeakKeyDictionary[RootLock, int] = weakref.WeakKeyDictionary()
_HELD_LOCK = threading.Lock()


def _held_here() -> list[RootLock]:
    with _HELD_LOCK:
        return [lock for lock, pid in list(_HELD.items()) if pid == os.getpid()]


def _join_other_threads() -> None:
    """Join this process's other non-daemon threads, as the interpreter is about to: threading
    runs its exit hooks before that join, and a training thread still saving under the lease
    must not see it released (another job could take the root). concurrent.futures' workers
    are left: they end only after its own exit hook, which runs after ours."""
    workers = set(getattr(concurrent.futures.thread, "_threads_queues", {}))
    me = threading.current_thread()
    while True:
        others = [t for t in threading.enumerate()
                  if t is not me and not t.daemon and t not in workers and t.is_alive()]
        if not others:
            return
        for t in others:
            t.join()


def _release_held_at_exit() -> None:
    """Release this process's held leases at its end (the threading exit hook below). A lease
    first taken after this ran (by a thread that took none before the main thread ended) is
    released by its finalizer at atexit, the slow way on an object store."""
    if not _held_here():
        return
    _join_other_threads()
    release_held_leases()


def release_held_leases() -> None:
    """Release every lease this process holds now (best effort: also before an ``os._exit``,
    which skips the exit hooks)."""
    for lock in _held_here():
        try:
            lock.release()
        except Exception:  # noqa: BLE001 - one failure must not stop the interpreter's other hooks
            pass


# threading's exit hooks run in reverse order of registration: this one after every background
# save's drain (registered later, engine.background), before concurrent.futures' (registered at
# its import, above), which refuses new executor work from then on.
try:
    threading._register_atexit(_release_held_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # no such hook (another Python), or imported at exit
    pass


def writer_lease(root: str, run_id: str | None = None, lease: float = DEFAULT_LEASE,
                 store: Storage | None = None) -> RootLock:
    """The lease object for ``root`` (taken by :meth:`RootLock.acquire`)."""
    return RootLock(root, run_id, lease, store)
