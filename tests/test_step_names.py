"""format.step_names.step_from_name: the step in the checkpoint names frameworks use (pure)."""

from __future__ import annotations

import pytest

from safeckpt.format.step_names import step_from_name


@pytest.mark.parametrize(("name", "step"), [
    ("step-0000000100", 100),          # safeckpt's CheckpointManager
    ("step-0000000000", 0),
    ("step-6", 6),                     # torchtitan: unpadded
    ("step-0", 0),
    ("step-1234567890123", 1234567890123),
    ("checkpoint-500", 500),           # Hugging Face Trainer
    ("checkpoint_7", 7),               # Accelerate
    ("global_step42", 42),             # DeepSpeed
    ("epoch=2-step=300", 300),         # Lightning ModelCheckpoint
    ("epoch=0-step=8.ckpt", 8),
    ("epoch=0-step=8-v1", 8),
    ("epoch=10-step=8-v12.ckpt", 8),
])
def test_names_frameworks_use(name, step):
    assert step_from_name(name) == step


@pytest.mark.parametrize("name", [
    "last.ckpt", "last", "step-", "step-07", "step-000000001", "step-00000000001", "step--1",
    "step-1e3", "step-1.5", "Step-5", "step-5\n", " step-5", "step-5/", "runs/step-5",
    ".step-5.safeckpt-staging-0a1b2c", ".step-0000000005.safeckpt-trash-0a1b", "checkpoint-07",
    "checkpoint-", "checkpoint_x", "global_step", "global_step-3", "global_step03",
    "epoch=1-step=", "epoch=01-step=3", "epoch=1-step=03", "epoch=1-step=3-v0", "epoch=1-step=3.pt",
    "step=3", "step-\u0663",  # an Arabic-Indic digit: int() would take it, a name does not
    "step-" + "9" * 300, "step-99999999999999999999", None, 5, b"step-5",
])
def test_anything_else_has_no_step(name):
    assert step_from_name(name) is None


def test_largest_step_is_int64():
    assert step_from_name(f"step-{(1 << 63) - 1}") == (1 << 63) - 1
    assert step_from_name(f"step-{1 << 63}") is None


def test_catalog_manager_and_ls_see_the_steps_of_framework_names(tmp_path, capsys):
    """Checkpoints committed under names other frameworks give them are steps for the catalog,
    a manager on that root and `safeckpt ls`; a directory of such a name without a manifest
    stays foreign (never touched)."""
    import torch

    import safeckpt
    from safeckpt import cli
    from safeckpt.storage.catalog import scan

    for name, step in (("step-6", 6), ("global_step7", 7), ("epoch=0-step=8.ckpt", 8)):
        safeckpt.save(str(tmp_path / name), {"w": torch.full((2,), float(step))})
    (tmp_path / "step-9").mkdir()  # a stock directory: no manifest
    (tmp_path / "step-9" / "model.pt").write_bytes(b"\x80")
    entries = {e.name: (e.step, e.status) for e in scan(str(tmp_path))}
    assert entries["step-6"] == (6, "committed") and entries["global_step7"] == (7, "committed")
    assert entries["epoch=0-step=8.ckpt"] == (8, "committed")
    assert "step-9" not in entries or entries["step-9"][1] != "committed"
    mgr = safeckpt.CheckpointManager(str(tmp_path), keep_last=None)
    assert [c.step for c in mgr.list()] == [6, 7, 8]
    state = {"w": torch.zeros(2)}
    assert mgr.restore(state) == 8 and torch.equal(state["w"], torch.full((2,), 8.0))
    mgr.close()
    assert cli.main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("step-6", "global_step7", "epoch=0-step=8.ckpt"))
    assert (tmp_path / "step-9" / "model.pt").exists()
