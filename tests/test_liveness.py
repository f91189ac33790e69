"""Peer liveness records (safeckpt.coord.liveness): what RankFailure messages rely on to name the
rank that died and never a live one. Real processes, killed for real."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from safeckpt.coord import liveness as _liveness


def _spawn() -> tuple[subprocess.Popen, dict]:
    """A child process and the record it would publish (built here: the child is just sleep)."""
    proc = subprocess.Popen(["sleep", "60"])
    me = _liveness.self_record()
    return proc, {**me, "pid": proc.pid, "start": _liveness._proc_stat(proc.pid)[1]}


def test_alive_zombie_reaped_and_stopped():
    proc, rec = _spawn()
    try:
        assert _liveness.is_gone(rec) is False
        assert _liveness.process_state(rec) in ("waiting", "running")
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert _liveness.is_gone(rec) is False and _liveness.process_state(rec) == "stopped"
        os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert _liveness.is_gone(rec) is True  # a zombie: not reaped yet, but gone
        assert _liveness.process_state(rec) is None
        proc.wait()
        assert _liveness.is_gone(rec) is True  # reaped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_pid_reuse_and_other_hosts_are_never_guessed():
    me = _liveness.self_record()
    assert _liveness.is_gone(me) is False
    assert _liveness.is_gone({**me, "start": me["start"] + 1}) is True  # the pid is another process now
    assert _liveness.is_gone({**me, "ns": "elsewhere/boot/pid:[1]"}) is None  # cannot tell
    assert _liveness.is_gone(None) is None and _liveness.is_gone({"pid": "x", "ns": me["ns"]}) is None


def test_survivor_notes():
    group = f"test-group-{time.monotonic_ns()}"
    me = _liveness.self_record()
    proc, other = _spawn()
    try:
        assert _liveness.survivor_note(me, group) is None
        _liveness.mark_survivor(group, {"seq": 7, "done": True})
        assert _liveness.survivor_note(me, group) == {"seq": 7, "done": True}
        assert _liveness.survivor_note(other, group) is None  # another process left none
        assert _liveness.survivor_note({**me, "start": me["start"] + 1}, group) is None  # pid reused
        assert _liveness.survivor_note(None, group) is None
    finally:
        proc.kill()
        proc.wait()
        os.unlink(_liveness._note_path(me, group))
