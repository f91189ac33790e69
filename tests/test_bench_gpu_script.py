"""bench/bench_gpu.py (issue 12's GPU measurement) needs a GPU to mean anything, and CI has
none: its --device cpu mode runs the same code paths, so the script cannot rot unnoticed
before a session with a GPU runs it. It checks that its last async checkpoint loads back
bit-exactly and exits non-zero otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_gpu_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_gpu.py"), "--device", "cpu", "--gib", "0.01",
         "--tensors", "8", "--reps", "2", "--root", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for row in ("pinned copy", "copy + write + fsync", "safeckpt async: save() returns",
                "safeckpt async: durable (wait() returns)", "safeckpt sync save", "stall of the work burst"):
        assert row in text, row
    assert [p for p in tmp_path.iterdir() if p.name.startswith("safeckpt-gpu-")] == []  # cleaned up
