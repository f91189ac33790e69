"""The writer lease tells jobs apart when torchrun gives them no identity (issue 27, item 2).

Plain ``torchrun`` (no ``--standalone``, no ``--rdzv-id``) sets TORCHELASTIC_RUN_ID=none in
every job. The lease used to take that for "the same job" and let a second live job take it
over; each job then swept the other's staging and applied retention to its checkpoints. The
lease now identifies a job by its rendezvous id where that is a real one, else by a token the
job's ranks agree on through the job's store.

Real 2-rank gloo jobs (tests/helpers/dist_harness.py) with TORCHELASTIC_RUN_ID=none, each with
its own store as two torchrun jobs have; a restart after SIGKILL of every rank; and the take-over
race (a contender that judged the record stale must not remove the record another contender
has just written), with the interleaving forced.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from safeckpt import CheckpointLocked, CheckpointManager
from safeckpt.coord.dist import job_token
from safeckpt.coord.lease import LOCK_NAME, RootLock, read_lock
from safeckpt.storage.base import storage_for
from tests.helpers import dist_harness

PLAIN_TORCHRUN = {"TORCHELASTIC_RUN_ID": "none"}  # what plain torchrun sets in every job


def _state(step: int, rank: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "step": step}


def _wait(path: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def _touch(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def _steps(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


# ------------------------------------------------------------------ two live plain-torchrun jobs
def _job_a(rank, world, root, sync):
    mgr = CheckpointManager(root, keep_last=1, preemption_signals=())
    mgr.save(1, _state(1, rank))
    holder = read_lock(root)
    if rank == 0:
        _touch(os.path.join(sync, "a-holds"))
    _wait(os.path.join(sync, "b-done"), 120)
    info = mgr.save(2, _state(2, rank))  # still the holder: B took nothing away
    mgr.close()
    return {"saved": info.step, "run": os.environ.get("TORCHELASTIC_RUN_ID"), "token": job_token(),
            "holder_run": holder["run_id"]}


def _job_b(rank, world, root, sync):
    _wait(os.path.join(sync, "a-holds"), 120)
    mgr = CheckpointManager(root, keep_last=1, preemption_signals=())
    res = dist_harness.attempt(lambda: mgr.save(100, _state(100, rank)).step)
    res["steps"] = _steps(root)
    res["token"] = job_token()
    torch.distributed.barrier()
    if rank == 0:
        _touch(os.path.join(sync, "b-done"))
    mgr.close()
    return res


@pytest.mark.timeout(240)
def test_a_second_live_plain_torchrun_job_is_refused(tmp_path):
    root, sync = tmp_path / "ckpts", tmp_path / "sync"
    sync.mkdir()
    box: dict = {}
    a = threading.Thread(target=lambda: box.setdefault(
        "a", dist_harness.run(_job_a, 2, str(root), str(sync), timeout=200, env=PLAIN_TORCHRUN)))
    a.start()
    try:
        b = dist_harness.run(_job_b, 2, str(root), str(sync), timeout=200, env=PLAIN_TORCHRUN)
    finally:
        _touch(str(sync / "b-done"))  # never leave job A waiting
        a.join(220)
    out_a = box["a"]
    assert all(o.ok for o in out_a + b), [(o.rank, o.exitcode, o.message) for o in out_a + b]
    for o in b:
        res = o.value
        # Every rank of the second job gets the same CheckpointLocked, naming the holder.
        assert not res["ok"] and "CheckpointLocked" in res["mro"], res
        assert "is being written by another job" in res["msg"], res["msg"]
        # Its retention (keep_last=1) did not delete job A's checkpoint; nothing of B's landed.
        assert res["steps"] == ["step-0000000001"], res["steps"]
    # The job's identity: one token on every rank of a job, another in the other job.
    (token_a,) = {o.value["token"] for o in out_a}
    (token_b,) = {o.value["token"] for o in b}
    assert token_a and token_b and token_a != token_b
    for o in out_a:
        assert {k: o.value[k] for k in ("saved", "run", "holder_run")} == {
            "saved": 2, "run": "none", "holder_run": token_a}
    assert _steps(root) == ["step-0000000002"]
    assert [n for n in os.listdir(root) if n.startswith(".")] == []  # no leftovers, lease released


# ------------------------------------------------------------------ restart after SIGKILL
def _job_killed_after_save(rank, world, root, sync):
    mgr = CheckpointManager(root, keep_last=2, preemption_signals=())
    mgr.save(1, _state(1, rank))
    torch.distributed.barrier()
    if rank == 0:
        _touch(os.path.join(sync, "pid0"))
    os.kill(os.getpid(), signal.SIGKILL)


def _restarted_job(rank, world, root):
    mgr = CheckpointManager(root, keep_last=2, preemption_signals=())
    st = _state(-1, rank)
    restored = mgr.restore(st)
    t0 = time.monotonic()
    info = mgr.save(2, _state(2, rank))
    took = time.monotonic() - t0
    with open(os.path.join(root, LOCK_NAME)) as f:
        holder = json.load(f)
    torch.distributed.barrier()
    mgr.close()
    return {"restored": restored, "w": float(st["w"][0]), "saved": info.step, "took": took,
            "holder_pid": holder["pid"], "pid": os.getpid()}


@pytest.mark.timeout(240)
def test_a_plain_torchrun_job_restarted_after_sigkill_takes_over_at_once(tmp_path):
    root, sync = tmp_path / "ckpts", tmp_path / "sync"
    sync.mkdir()
    out = dist_harness.run(_job_killed_after_save, 2, str(root), str(sync), timeout=120, env=PLAIN_TORCHRUN)
    assert [o.exitcode for o in out] == [-signal.SIGKILL] * 2, [(o.exitcode, o.message) for o in out]
    holder = read_lock(str(root))
    dead_pid = int((sync / "pid0").read_text())
    assert holder is not None and holder["pid"] == dead_pid
    assert holder["age"] < holder["lease"]  # a fresh heartbeat: only the dead pid says it is gone

    out = dist_harness.run(_restarted_job, 2, str(root), timeout=120, env=PLAIN_TORCHRUN)
    assert all(o.ok for o in out), [(o.rank, o.exitcode, o.message) for o in out]
    for o in out:
        v = o.value
        assert v["restored"] == 1 and v["w"] == 1.0 and v["saved"] == 2
        assert v["took"] < 20, v  # no waiting out the 120 s lease
    assert out[0].value["holder_pid"] == out[0].value["pid"]  # the new job's coordinator holds it
    assert _steps(root) == ["step-0000000001", "step-0000000002"]
    assert read_lock(str(root)) is None  # released at close


# ------------------------------------------------------------------ holders on other hosts
def _write_record(root, **fields) -> None:
    os.makedirs(root, exist_ok=True)
    rec = {"run_id": "job-elsewhere", "host": "some-other-host", "pid": 1, "started": 0.0,
           "beat": time.time(), "lease": 120.0, "nonce": "n-elsewhere", **fields}
    with open(os.path.join(root, LOCK_NAME), "w") as f:
        json.dump(rec, f)


@pytest.mark.timeout(60)
def test_a_holder_elsewhere_is_refused_while_its_heartbeat_is_fresh_and_replaced_once_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    root = str(tmp_path / "ckpts")
    _write_record(root)  # another host: its pid cannot be checked from here
    lock = RootLock(root)
    with pytest.raises(CheckpointLocked, match="some-other-host"):
        lock.acquire()
    assert read_lock(root)["nonce"] == "n-elsewhere"
    old = time.time() - 500  # heartbeat (mtime) older than the lease: the holder is gone
    os.utime(os.path.join(root, LOCK_NAME), (old, old))
    lock.acquire()
    try:
        assert read_lock(root)["nonce"] == lock.nonce
        assert lock.run_id not in ("none", "")  # never the shared placeholder
    finally:
        lock.release()


@pytest.mark.timeout(60)
def test_a_real_rendezvous_id_still_replaces_a_live_holder_of_the_same_job(tmp_path, monkeypatch):
    # An elastic restart of a job with a real rendezvous id (--rdzv-id, --standalone): its old
    # coordinator elsewhere may still look alive, but the id says it is this job's own.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-1234")
    root = str(tmp_path / "ckpts")
    _write_record(root, run_id="rdzv-1234")
    lock = RootLock(root)
    lock.acquire()
    try:
        assert read_lock(root)["nonce"] == lock.nonce and lock.run_id == "rdzv-1234"
    finally:
        lock.release()
    _write_record(root, run_id="none")  # a plain-torchrun holder is no relative of anyone
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(CheckpointLocked):
        RootLock(root).acquire()


# ------------------------------------------------------------------ the take-over race
class _Interleaved:
    """A storage whose first read of the lease record runs ``meanwhile`` before answering:
    the contender gets the record as it was, and acts on it after another has moved on."""

    def __init__(self, store, path, meanwhile):
        self._store, self._path, self._meanwhile = store, path, meanwhile

    def __getattr__(self, name):
        return getattr(self._store, name)

    def read(self, path, limit):
        data = self._store.read(path, limit)
        if path == self._path and self._meanwhile is not None:
            run, self._meanwhile = self._meanwhile, None
            run()
        return data


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.timeout(60)
def test_a_take_over_never_removes_the_fresh_record_of_a_rival(tmp_path):
    root = str(tmp_path / "ckpts")
    # A crashed holder on this host: its heartbeat is fresh but its pid is dead.
    _write_record(root, run_id="job-crashed", host=socket.gethostname(), pid=_dead_pid(), nonce="n-dead")
    store = storage_for(root)
    path = store.join(root, LOCK_NAME)
    a = RootLock(root, run_id="job-a")
    # B reads the crashed holder's record; before B acts on it, A takes the lease over.
    b = RootLock(root, run_id="job-b", store=_Interleaved(store, path, a.acquire))
    try:
        with pytest.raises(CheckpointLocked, match="job-a"):
            b.acquire()
        assert a.held and not b.held
        assert read_lock(root)["nonce"] == a.nonce  # A's record survived B's take-over
        a.refresh()  # and A still finds it its own at its next save
        assert a.held and read_lock(root)["nonce"] == a.nonce
        assert sorted(os.listdir(root)) == [LOCK_NAME]  # no take-over mutex left behind
    finally:
        a.release()
        b.release()
    assert read_lock(root) is None


def test_a_crashed_contenders_take_over_mutex_does_not_lock_a_restart_out(tmp_path, monkeypatch):
    """A contender on another host killed between creating the take-over mutex and deleting it,
    and a dead holder: acquire() used to give up after ACQUIRE_WAIT with "contention" although
    the mutex is broken only after MUTEX_STALE (found by review). It now waits the mutex out."""
    import json as _json
    import socket as _socket

    from safeckpt.coord import lease as lease_mod

    monkeypatch.setattr(lease_mod, "MUTEX_STALE", 1.5)
    monkeypatch.setattr(lease_mod, "ACQUIRE_WAIT", 0.3)
    root = str(tmp_path)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    with open(os.path.join(root, lease_mod.LOCK_NAME), "w") as f:
        _json.dump({"run_id": "old-job", "host": _socket.gethostname(), "pid": dead, "nonce": "x",
                    "lease": 120, "started": time.time()}, f)
    with open(os.path.join(root, lease_mod.LOCK_NAME + lease_mod.TAKEOVER_SUFFIX), "w") as f:
        _json.dump({"host": "node-7", "pid": 4242, "beat": time.time(), "nonce": "y"}, f)
    lock = lease_mod.RootLock(root, run_id="new-job")
    started = time.monotonic()
    lock.acquire()
    try:
        assert lock.held and 1.0 < time.monotonic() - started < 15
    finally:
        lock.release()
