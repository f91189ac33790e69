"""The writer lease at process exit: released while the interpreter can still do I/O, and never
by a forked child.

Found through the suite's time: a job on an S3 root that ended without ``close()`` released its
lease from a weakref finalizer, which runs after the interpreter's shutdown stopped new executor
work; the S3 client then failed ("cannot schedule new futures after shutdown") after ~11 s of
retries, so every such process stalled at exit and left its record behind. Every rank paid it,
even with ``close()``: a lease object never taken (every rank but the coordinator) read the
record from its finalizer too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import s3_harness

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_JOB = textwrap.dedent("""
    import sys, time, torch, safeckpt
    from tests.helpers import s3_harness
    endpoint, root, close = sys.argv[1], sys.argv[2], sys.argv[3] == "close"
    opts = {**s3_harness.options(endpoint), "config_kwargs": {"retries": {"max_attempts": 1}}}
    mgr = safeckpt.CheckpointManager(root, storage_options=opts, preemption_signals=())
    mgr.save(1, {"x": torch.ones(3)})
    mgr.wait()
    spare = safeckpt.CheckpointManager(root, storage_options=opts, preemption_signals=())  # never saves
    if close:
        mgr.close()
    print("ENDING", time.time(), flush=True)
""")


def _run_script(code: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c code args...`` from the repository root, this checkout's package first."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=90, env=env, cwd=REPO)


def _ends(endpoint: str, root: str, how: str) -> float:
    """Seconds from the job's last line to its exit."""
    p = _run_script(_JOB, endpoint, root, how)
    ended = time.time()
    assert p.returncode == 0, p.stderr[-3000:]
    said = [line for line in p.stdout.splitlines() if line.startswith("ENDING")]
    assert said, p.stdout
    return ended - float(said[0].split()[1])


@pytest.mark.parametrize("how", ["no-close", "close"])
def test_an_s3_job_ending_releases_its_lease_at_once(how):
    pytest.importorskip("s3fs")
    with s3_harness.moto_server() as endpoint:
        s3_harness.make_bucket(endpoint, "exit")
        took = _ends(endpoint, f"s3://exit/{how}", how)
        fs = s3_harness.s3fs_for(endpoint)
        assert not fs.exists(f"exit/{how}/.safeckpt.lock"), "the lease record outlived its job"
        assert fs.exists(f"exit/{how}/step-0000000001/manifest.json")
        # Before: ~11 s (the S3 call at exit retried until it gave up), on every rank.
        assert took < 6.0, f"the process took {took:.1f} s to exit after its last line"


def _fork_and_exit_child(root: str) -> tuple[int, object]:
    """A manager holding the lease forks; the child ends normally (its exit hooks and
    finalizers run, as in a DataLoader worker that returns from sys.exit). The child's status
    and the parent's manager (kept alive: the parent still holds its lease)."""
    import torch

    import safeckpt

    mgr = safeckpt.CheckpointManager(root, preemption_signals=())
    mgr.save(1, {"x": torch.ones(3)})
    mgr.wait()
    pid = os.fork()
    if pid == 0:
        try:
            del mgr
        finally:
            sys.exit(0)  # Python's own shutdown: threading's exit hooks, then atexit finalizers
    _, status = os.waitpid(pid, 0)
    return status, mgr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_ending_never_releases_its_parents_lease(tmp_path):
    import json

    root = tmp_path / "root"
    p = _run_script(f"""
        import json, os, sys
        from tests.test_lease_exit import _fork_and_exit_child
        status, mgr = _fork_and_exit_child({str(root)!r})
        print("CHILD", status)
        print("PARENT", os.getpid())
        lock = os.path.join({str(root)!r}, ".safeckpt.lock")
        print("RECORD", json.dumps(json.load(open(lock)) if os.path.exists(lock) else None))
        os._exit(0)  # the parent's own release is not what this test looks at
    """)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line.split(" ", 1)[0] in ("CHILD", "RECORD", "PARENT"))
    assert lines["CHILD"] == "0", p.stdout
    record = json.loads(lines["RECORD"])
    assert record is not None, "a forked child's exit removed its parent's lease record"
    assert record["pid"] != 0
    assert lines["PARENT"] == str(record["pid"]), "the record is not the parent's"


def test_a_thread_still_saving_after_the_main_thread_ends_keeps_the_lease(tmp_path):
    """The exit hook runs before Python joins the non-daemon threads: it waits for them, so a
    training thread still saving holds the root against another job until it is done."""
    root = str(tmp_path / "root")
    p = _run_script(f"""
        import subprocess, sys, threading, time, torch, safeckpt
        root = {root!r}
        started = threading.Event()

        def train():
            m = safeckpt.CheckpointManager(root, preemption_signals=())
            m.save(1, {{"x": torch.ones(3)}})
            started.set()
            time.sleep(1.0)  # the main thread has ended by now
            other = subprocess.run([sys.executable, "-c",
                "import sys, safeckpt.coord.lease as L; L.writer_lease(sys.argv[1], run_id='other').acquire();"
                "print('OTHER TOOK IT')", root], capture_output=True, text=True)
            print("OTHER", "took" if "OTHER TOOK IT" in other.stdout else
                  "locked" if "CheckpointLocked" in other.stderr else other.stderr[-300:], flush=True)
            m.save(2, {{"x": torch.ones(3) * 2}})
            print("SAVED 2", flush=True)

        threading.Thread(target=train).start()
        started.wait()
        print("MAIN ENDS", flush=True)
    """)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "OTHER locked" in p.stdout, p.stdout + p.stderr[-2000:]  # before: "OTHER took"
    assert "SAVED 2" in p.stdout, p.stdout + p.stderr[-2000:]
    assert not os.path.exists(os.path.join(root, ".safeckpt.lock")), "released at the end all the same"


def test_an_async_manager_dropped_without_close_lets_a_second_manager_save(tmp_path):
    """docs/how-to/accelerate.md: a manager collected without close() releases the root. The
    background worker kept its last save's closure (and so the manager) for 30 s."""
    root = str(tmp_path / "root")
    p = _run_script(f"""
        import gc, torch, safeckpt
        for i in range(8):  # the worker let go of the save just after wait() returned: a race
            root = {root!r} + str(i)
            m = safeckpt.CheckpointManager(root, async_save=True, preemption_signals=())
            m.save(1, {{"x": torch.ones(3)}})
            m.wait()
            del m
            gc.collect()
            m2 = safeckpt.CheckpointManager(root, async_save=True, preemption_signals=())
            m2.save(2, {{"x": torch.ones(3)}})
            m2.wait()
            m2.close()
        print("SECOND SAVED", flush=True)
    """)
    assert p.returncode == 0 and "SECOND SAVED" in p.stdout, p.stderr[-3000:]
