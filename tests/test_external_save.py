"""CheckpointManager.external_save: the public hook another atomic writer (safeckpt.dcp's
manager_writer, or a user's own) uses to save a step under a manager's root: lease and sweep
before, a commit check and retention after. Multi-rank use runs in tests/test_dcp.py
(manager_writer under dcp.save at 2 ranks)."""

from __future__ import annotations

import os

import pytest
import torch

import safeckpt
from safeckpt.coord.lease import LOCK_NAME


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((4,), v)}}


def test_external_writer_commits_and_retention_runs(tmp_path) -> None:
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root, keep_last=2, preemption_signals=(), dirname="checkpoint-{step}") as mgr:
        for step in (1, 2, 3):
            with mgr.external_save(step, coordinator=True) as path:
                assert path == str(root / f"checkpoint-{step}")
                assert os.path.exists(root / LOCK_NAME), "the writer lease is taken on enter"
                safeckpt.save(path, _state(float(step)), step=step)  # any writer that commits path itself
        assert [i.step for i in mgr.list()] == [2, 3]  # retention ran after each commit
        out = _state(0.0)
        assert mgr.restore(out) == 3 and torch.equal(out["model"]["w"], torch.full((4,), 3.0))


def test_nothing_committed_is_an_error_and_deletes_nothing(tmp_path) -> None:
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root, keep_last=1, preemption_signals=()) as mgr:
        mgr.save(1, _state(1.0))
        with pytest.raises(safeckpt.CheckpointNotFound, match="nothing is committed"):
            with mgr.external_save(2, coordinator=True):
                pass  # the writer "returned" without committing
        assert [i.step for i in mgr.list()] == [1]


def test_an_exception_in_the_writer_skips_retention(tmp_path) -> None:
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root, keep_last=1, preemption_signals=()) as mgr:
        mgr.save(1, _state(1.0))
        with pytest.raises(OSError, match="disk full"):
            with mgr.external_save(2, coordinator=True) as path:
                safeckpt.save(path, _state(2.0), step=2)
                raise OSError("disk full (simulated after the commit)")
        assert [i.step for i in mgr.list()] == [1, 2]  # no retention on the failed exit


def test_non_coordinator_only_gets_the_path_and_bad_steps_are_refused(tmp_path) -> None:
    root = tmp_path / "run"
    with safeckpt.CheckpointManager(root, preemption_signals=()) as mgr:
        with mgr.external_save(5, coordinator=False) as path:
            assert path == str(root / "step-0000000005")
        with pytest.raises(ValueError):
            with mgr.external_save(-1, coordinator=True):
                pass
    with pytest.raises(RuntimeError, match="closed"):
        with mgr.external_save(6, coordinator=True):
            pass


def test_dcp_manager_writer_uses_the_hook_and_the_managers_dirname(tmp_path) -> None:
    """One process (DCP saves without a process group): manager_writer writes the manager's
    own step directory name and retention runs after its commit."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import safeckpt.dcp

    root = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "torch.distributed is disabled ..."
        with safeckpt.CheckpointManager(root, keep_last=1, preemption_signals=(),
                                        dirname="checkpoint-{step}") as mgr:
            for step in (1, 2):
                dcp.save(_state(float(step)), storage_writer=safeckpt.dcp.manager_writer(mgr, step))
            assert sorted(os.listdir(root)) == [".safeckpt.lock", "checkpoint-2"]
            assert [i.step for i in mgr.list()] == [2]
