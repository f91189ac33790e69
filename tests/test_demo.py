"""The README's demo runs end to end: a 2-rank torchrun job preempted by SIGTERM to one rank,
resumed, and bit-exact with an uninterrupted run (examples/run_demo.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "examples", "run_demo.py")
HARD_TIMEOUT = 150  # seconds; the demo takes ~30 s on 2 idle CPU cores


@pytest.mark.timeout(HARD_TIMEOUT + 30)
def test_demo_preempt_resume_is_bit_exact(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, DEMO, "--workdir", str(tmp_path / "demo_run"),
         "--run-timeout", str(HARD_TIMEOUT - 10)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=HARD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the demo kills the torchrun jobs it started, then exits
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"demo did not finish within {HARD_TIMEOUT}s:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    assert "DEMO PASSED" in out, out[-6000:]
    assert "resumed == straight, bit for bit" in out, out[-6000:]
    assert "BIT-EXACT match with the reference run" in out, out[-6000:]
    assert "every rank stopped at the same step" in out, out[-6000:]
    assert "[FAIL]" not in out, out[-6000:]
