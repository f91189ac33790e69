"""Overwrites on a filesystem that refuses renameat2's flags (issue 27, item 1).

NFS, CephFS and FUSE answer EINVAL to RENAME_NOREPLACE / RENAME_EXCHANGE, so an overwrite (a
managed save of a step that exists) takes two renames: the old checkpoint aside, the new one in.
On a real FUSE mount (bindfs), the coordinator of a 2-rank job is SIGKILLed before each step of
that overwrite in turn (the manifest's fsync and rename, each directory fsync, each rename, each
unlink and rmdir of the replaced checkpoint's removal) and after the last one. After every kill:
the step restores, with the old contents if the new one was not yet renamed in and the new ones
otherwise; a following save (whose sweep runs first) and a re-save of the step lose nothing.
Before the fix a kill between the two renames made restore start fresh (None) and the next
sweep deleted both copies.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time

import pytest
import torch

import safeckpt
from safeckpt.format.manifest import STAGING_MARK, TRASH_MARK
from safeckpt.storage import catalog, posix
from tests.helpers import dist_harness, fuse_mount

pytestmark = pytest.mark.timeout(600)

N = 4096  # floats in the checkpoint's tensor
STEP_DIR = "step-0000000001"
OPS = ("rename", "replace", "fsync", "unlink", "rmdir")
REPLACED = ".safeckpt-replaced-"  # posix.REPLACED_MARK, spelled out so the test runs on older code


@pytest.fixture
def fuse_root(tmp_path):
    """A directory on a bindfs (FUSE) mount that refuses renameat2's flags; unmounted after."""
    why = fuse_mount.unavailable()
    if why:
        pytest.skip(f"no FUSE mount for the renameat2 fallback: {why}")
    try:
        mount = fuse_mount.bindfs_mount(str(tmp_path / "src"), str(tmp_path / "mnt"))
        mnt = mount.__enter__()
    except RuntimeError as exc:
        pytest.skip(f"no FUSE mount for the renameat2 fallback: {exc}")
    try:
        os.mkdir(os.path.join(mnt, "a"))
        os.mkdir(os.path.join(mnt, "b"))
        refused = not posix._renameat2(os.path.join(mnt, "a"), os.path.join(mnt, "b"), posix.RENAME_EXCHANGE)
        assert refused, "this bindfs accepts RENAME_EXCHANGE: the test would not reach the fallback"
        os.rmdir(os.path.join(mnt, "a"))
        os.rmdir(os.path.join(mnt, "b"))
        yield mnt
    finally:
        mount.__exit__(None, None, None)


def _state(value: float) -> dict:
    return {"w": torch.full((N,), value), "meta": {"value": value}}


def _values(state: dict) -> float:
    w = state["w"]
    assert torch.equal(w, torch.full((N,), float(w[0]))), "mixed contents"
    assert state["meta"] == {"value": float(w[0])}, state["meta"]
    return float(w[0])


# ----------------------------------------------------------------------- the killed job


def _arm(kill_at: int, log: str) -> None:
    """Count the filesystem steps of rank 0's publish (``OPS``); SIGKILL before the
    ``kill_at``-th, or after the publish returns if there are fewer (0: never)."""
    real = {name: getattr(os, name) for name in OPS}
    state = {"armed": False, "n": 0}

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def note(name: str, args: tuple) -> None:
        with open(log, "a") as f:
            f.write(json.dumps([name, [os.path.basename(str(a)) for a in args if isinstance(a, (str, bytes))]]) + "\n")

    for name in OPS:
        def op(*args, _name=name, **kwargs):
            if state["armed"] and threading.current_thread() is threading.main_thread():
                state["n"] += 1
                if state["n"] == kill_at:
                    die()
                note(_name, args)
            return real[_name](*args, **kwargs)
        setattr(os, name, op)

    publish = posix.PosixStorage.publish

    def armed_publish(self, *args, **kwargs):
        state["armed"] = True
        try:
            publish(self, *args, **kwargs)
        finally:
            state["armed"] = False
        if kill_at and kill_at > state["n"]:
            die()  # after the last step of the publish

    posix.PosixStorage.publish = armed_publish


def _overwrite_job(rank: int, world: int, root: str, kill_at: int, log: str) -> str:
    if rank == 0:
        _arm(kill_at, log)
    with safeckpt.CheckpointManager(root, keep_last=None, timeout=15, preemption_signals=()) as mgr:
        mgr.save(1, _state(2.0))  # step 1 exists (1.0): an overwrite
    return "saved"


def _run_job(root: str, kill_at: int, log: str, timeout: float = 90.0) -> list:
    """``_overwrite_job`` on 2 real processes joined by gloo (as ``dist_harness.run``), forked
    from a server that imported torch and safeckpt once: a trial costs a fork, not an import."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "safeckpt", "tests.test_nfs_overwrite"])
    queue = ctx.Queue()
    port = dist_harness.free_port()
    env = {"SAFECKPT_TIMEOUT": "15", "OMP_NUM_THREADS": "1"}
    procs = [ctx.Process(target=dist_harness._worker,
                         args=(_overwrite_job, r, 2, port, env, (root, kill_at, log), queue, 30.0))
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcomes = dist_harness.collect(procs, queue, deadline)
    for p in procs:
        p.join(max(0.5, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} did not finish within {timeout}s (hang)"
    result = []
    for r, p in enumerate(procs):
        o = outcomes.get(r, dist_harness.Outcome(r))
        o.exitcode = p.exitcode
        result.append(o)
    return result


def _ops(log: str) -> list:
    with open(log) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- checks


def _seed(root: str) -> None:
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(1, _state(1.0))


def _restore(root: str, step: int | None = None) -> tuple[int | None, float | None]:
    state = _state(0.0)
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        got = mgr.restore(state, step)
    return got, (_values(state) if got is not None else None)


def _hidden(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if STAGING_MARK in n or TRASH_MARK in n
                  or REPLACED in n)


def _check_after_kill(root: str, want: float, where: str) -> None:
    # The step is there for a reader (no sweep has run), with the right contents.
    steps = [e.step for e in catalog.committed(root)]
    assert steps == [1], f"{where}: committed steps {steps}, hidden {_hidden(root)}"
    assert _restore(root) == (1, want), where
    # A following save: its sweep puts a set-aside checkpoint back and removes the rest.
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(2, _state(3.0))
    assert [e.step for e in catalog.committed(root)] == [1, 2], where
    assert _hidden(root) == [], f"{where}: leftovers after the sweep: {_hidden(root)}"
    assert os.path.isfile(os.path.join(root, STEP_DIR, "manifest.json")), where
    assert _restore(root, 1) == (1, want), where
    assert safeckpt.verify(os.path.join(root, STEP_DIR)).ok, where
    # And the step can be overwritten again.
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(1, _state(4.0))
    assert _restore(root, 1) == (1, 4.0), where
    assert _restore(root) == (2, 3.0), where


def test_overwrite_killed_at_every_step_on_fuse(fuse_root, tmp_path) -> None:
    # Count the steps of one overwrite on this filesystem (nobody killed).
    root = os.path.join(fuse_root, "count")
    _seed(root)
    log = str(tmp_path / "count.log")
    out = _run_job(root, 0, log)
    assert all(o.ok for o in out), [o.message for o in out]
    ops = _ops(log)
    # where the new checkpoint takes the step's name: from the kill before it on, the new one
    swap = next(i for i, (name, args) in enumerate(ops, 1)
                if name == "rename" and STAGING_MARK in args[0] and args[1] == STEP_DIR)
    renames = [args for name, args in ops if name == "rename"]
    assert any(a[0] == STEP_DIR for a in renames), ops  # the two-rename fallback ran: old aside
    assert len(ops) >= 8, ops
    seen = []
    for kill_at in range(1, len(ops) + 2):
        root = os.path.join(fuse_root, f"kill-{kill_at}")
        _seed(root)
        klog = str(tmp_path / f"kill-{kill_at}.log")
        out = _run_job(root, kill_at, klog)
        assert out[0].exitcode == -signal.SIGKILL, (kill_at, out[0])
        assert not out[1].ok and out[1].raised("CheckpointError"), (kill_at, out[1])
        where = f"killed before {ops[kill_at - 1]}" if kill_at <= len(ops) else "killed after the publish"
        want = 1.0 if kill_at <= swap else 2.0
        _check_after_kill(root, want, f"{where} (step {kill_at} of {len(ops)})")
        seen.append((kill_at, want))
        shutil.rmtree(root, ignore_errors=True)
    assert {w for _, w in seen} == {1.0, 2.0}


def test_plain_save_after_a_killed_overwrite_puts_the_old_one_back(fuse_root, tmp_path) -> None:
    """``safeckpt.save`` (no manager) to a path whose overwrite was killed between its renames:
    the set-aside checkpoint is that path again (so overwrite=False refuses), and a load of the
    path meanwhile names where the checkpoint is."""
    root = os.path.join(fuse_root, "plain")
    _seed(root)
    log = str(tmp_path / "count.log")
    out = _run_job(root, 0, log)
    assert all(o.ok for o in out)
    ops = _ops(log)
    between = next(i for i, (name, args) in enumerate(ops, 1)
                   if name == "rename" and STAGING_MARK in args[0] and args[1] == STEP_DIR)
    shutil.rmtree(root)
    _seed(root)
    out = _run_job(root, between, str(tmp_path / "kill.log"))
    assert out[0].exitcode == -signal.SIGKILL
    path = os.path.join(root, STEP_DIR)
    assert not os.path.exists(path)
    with pytest.raises(safeckpt.CheckpointNotFound, match="safeckpt-replaced-"):
        safeckpt.load(path, _state(0.0))
    with pytest.raises(safeckpt.CheckpointError, match="already exists"):
        safeckpt.save(path, _state(5.0))
    state = _state(0.0)
    safeckpt.load(path, state)
    assert _values(state) == 1.0
    safeckpt.save(path, _state(5.0), overwrite=True)
    state = _state(0.0)
    safeckpt.load(path, state)
    assert _values(state) == 5.0


def test_readers_never_miss_the_step_during_overwrites_on_fuse(fuse_root) -> None:
    """While one thread overwrites a checkpoint again and again (two renames each), readers
    listing the root always find the step, committed."""
    root = os.path.join(fuse_root, "live")
    path = os.path.join(root, STEP_DIR)
    safeckpt.save(path, _state(1.0))
    stop = threading.Event()
    misses: list = []
    scans = [0]

    def read() -> None:
        while not stop.is_set():
            found = [e for e in catalog.committed(root) if e.step == 1]
            scans[0] += 1
            if not found:
                misses.append(sorted(os.listdir(root)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # At least 40 overwrites, and on until the reader has scanned more than 40 times (a
        # loaded machine, e.g. two test workers on two cores, gives the reader thread less time)
        i = 0
        while (i < 40 or scans[0] <= 40) and i < 400:
            safeckpt.save(path, _state(float(i)), overwrite=True)
            i += 1
    finally:
        stop.set()
        reader.join(30)
    assert scans[0] > 40
    assert not misses, f"{len(misses)} of {scans[0]} scans missed the step, e.g. {misses[:3]}"
