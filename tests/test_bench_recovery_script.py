"""bench/bench_recovery.py (issue 28's table) is run by hand; a tiny run here keeps it from
rotting unnoticed (run identity once broke it: it moved root away, which made the nodes' data
another run's). It must restore the newest step after the node loss with 0 bytes read from
root, and from root afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_recovery_bench_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_recovery.py"), "--params", "1100000", "--nodes", "2",
         "--repeat", "1", "--loop-repeat", "1", "--loop-steps", "1", "--dir", str(tmp_path / "d"),
         "--local", str(tmp_path / "local")],
        capture_output=True, text=True, timeout=170, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(r for r in map(_row, proc.stdout.splitlines()) if r is not None)
    assert rows["bytes read from root"] == "0", proc.stdout
    # the newest step (the save phase's last, drained at close) from the nodes and from root alike
    assert rows["restored step"] == rows["restored step (root)"] != "None", proc.stdout


def _row(line: str) -> tuple[str, str] | None:
    """('label', 'value') of a result line ``  label<spaces>value``."""
    parts = line.strip().rsplit(None, 1)
    if not line.startswith("  ") or len(parts) != 2:
        return None
    label, value = parts
    if value in ("s", "x"):  # "0.123 s": the number is the value
        label, _, value = label.rpartition(" ")
    return label.strip(), value
