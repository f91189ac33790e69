"""CheckpointManager(dirname=...): the frameworks' own directory names (``checkpoint-N``,
``checkpoint_N``) as real commits, understood by restore, retention, the sweep, ``safeckpt ls``
and ``gc``; a framework's own checkpoint (same name, no manifest) is never touched; and
``save(extra_files=...)`` commits files inside the checkpoint, checked by verify.
Single process (the naming is decided on the coordinator only)."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stdout

import pytest
import torch

import safeckpt
from safeckpt import CheckpointManager, cli
from safeckpt.storage.catalog import DirName, parse_step, scan


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((64,), v)}, "step": int(v)}


def _visible(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


def _cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = cli.main([str(a) for a in argv])
    return code, buf.getvalue()


def test_dirname_patterns_format_and_parse_inversely():
    assert DirName("checkpoint-{step}").format(7) == "checkpoint-7"
    assert DirName("checkpoint_{step}").parse("checkpoint_12") == 12
    assert DirName("step-{step:010d}").format(3) == "step-0000000003"
    assert parse_step("checkpoint-07") is None  # not canonical: another program's name
    assert parse_step("checkpoint-5") == 5 and parse_step("checkpoint_5") == 5
    # torchtitan's unpadded step-N is a step too (issue 29); still canonical only
    assert parse_step("step-5") == 5 and parse_step("step-0000000005") == 5 and parse_step("step-05") is None
    for bad in ("checkpoint", "{step}", ".x{step}", "a/{step}", "a{step}-{step}", "a{stp}"):
        with pytest.raises(ValueError):
            DirName(bad)


def test_trainer_names_are_real_commits_with_retention_restore_and_foreign_dirs_left_alone(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    # A stock Trainer checkpoint (no manifest) of a higher step: never picked, never deleted,
    # not reported as an incomplete safeckpt checkpoint.
    stock = root / "checkpoint-99"
    stock.mkdir()
    (stock / "model.safetensors").write_bytes(b"not ours")
    # An older run of the default naming under the same root: still found by the new pattern.
    with CheckpointManager(root, keep_last=None, preemption_signals=()) as old:
        old.save(1, _state(1))
    with CheckpointManager(root, keep_last=2, dirname="checkpoint-{step}", preemption_signals=()) as mgr:
        assert [i.step for i in mgr.list()] == [1]
        got = _state(0)
        assert mgr.restore(got) == 1 and torch.equal(got["model"]["w"], torch.full((64,), 1.0))
        for s in (2, 3, 4):
            info = mgr.save(s, _state(s))
            assert os.path.basename(info.path) == f"checkpoint-{s}"
        # keep_last=2 over every committed checkpoint; the restored step-N one is protected
        assert _visible(root) == ["checkpoint-3", "checkpoint-4", "checkpoint-99", "step-0000000001"]
        assert (stock / "model.safetensors").read_bytes() == b"not ours"
        got = _state(0)
        assert mgr.restore(got) == 4 and got["step"] == 4
    statuses = {e.name: e.status for e in scan(str(root))}
    assert statuses == {"checkpoint-3": "committed", "checkpoint-4": "committed",
                        "step-0000000001": "committed"}
    code, out = _cli("ls", root)
    assert code == 0 and "checkpoint-4" in out and "checkpoint-3" in out
    code, out = _cli("gc", root, "--keep-last", "1")
    assert code == 0
    assert _visible(root) == ["checkpoint-4", "checkpoint-99"]


def test_accelerate_names_and_leftovers_of_a_crashed_save_are_swept(tmp_path):
    root = tmp_path / "checkpoints"
    with CheckpointManager(root, keep_last=None, dirname="checkpoint_{step}", preemption_signals=()) as mgr:
        mgr.save(0, _state(0))
        # what a save killed mid-write leaves behind: a hidden staging directory of this name
        left = root / ".checkpoint_1.safeckpt-staging-0123abcd"
        left.mkdir()
        (left / "rank-00000.safetensors").write_bytes(b"partial")
        assert any(e.status == "staging" and e.step == 1 for e in scan(str(root)))
        mgr.save(1, _state(1))
        assert not left.exists()
        assert _visible(root) == ["checkpoint_0", "checkpoint_1"]


def test_extra_files_are_committed_listed_and_verified(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=None, dirname="checkpoint-{step}", preemption_signals=()) as mgr:
        info = mgr.save(5, _state(5), extra_files={"trainer_state.json": b'{"global_step": 5}'})
        path = info.path
        assert (root / "checkpoint-5" / "trainer_state.json").read_bytes() == b'{"global_step": 5}'
        assert safeckpt.verify(path).ok
        (root / "checkpoint-5" / "trainer_state.json").write_bytes(b'{"global_step": 6}')
        report = safeckpt.verify(path)
        assert not report.ok and any("trainer_state.json" in p for p in report.problems)
        # names that are ours are refused before anything is written
        for bad in ("manifest.json", "rank-00000.safetensors", "../x", "a/b"):
            with pytest.raises(safeckpt.CheckpointError, match="not allowed"):
                mgr.save(6, _state(6), extra_files={bad: b"x"})
        with pytest.raises(TypeError, match="bytes"):
            mgr.save(6, _state(6), extra_files={"x.json": "text"})
        assert not (root / "checkpoint-6").exists()
