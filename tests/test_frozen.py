"""Frozen parameters saved as fingerprints (issue 19, requirement 3); one process."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt.engine import frozen as _frozen

pytestmark = pytest.mark.timeout(60)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    return m


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _opt(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1)


def _train(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.ones(2, 64)).sum().backward()
    opt.step()


def test_frozen_params_are_fingerprinted_and_resume_restores_the_rest(tmp_path) -> None:
    m = _model()
    opt = _opt(m)
    _train(m, opt)
    with safeckpt.CheckpointManager(tmp_path / "fp", preemption_signals=()) as mgr:
        info = mgr.save(1, {"model": m, "optim": opt, "note": {"k": 1}})
    with safeckpt.CheckpointManager(tmp_path / "full", preemption_signals=(), frozen="full") as mgr:
        full = mgr.save(1, {"model": m, "optim": opt, "note": {"k": 1}})
    # 64*64+64 frozen floats (16.6 KB) are not stored; the head and its Adam state are.
    assert _size(full.path) - _size(info.path) >= 64 * 65 * 4 - 512
    keys = set(safeckpt.read_state_dict(info.path))
    assert not any(k.startswith("model/0.") for k in keys) and "model/1.weight" in keys

    fresh = _model()  # same base (seed 0), untrained head
    fresh_opt = _opt(fresh)
    state = {"model": fresh, "optim": fresh_opt, "note": {"k": 0}}
    with safeckpt.CheckpointManager(tmp_path / "fp", preemption_signals=()) as mgr:
        assert mgr.restore(state) == 1
    assert state["note"] == {"k": 1}
    for a, b in zip(m.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    # A checkpoint saved in full loads into the same model too (layout read from the checkpoint).
    again = _model()
    with safeckpt.CheckpointManager(tmp_path / "full", preemption_signals=()) as mgr:
        assert mgr.restore({"model": again, "optim": _opt(again), "note": {}}) == 1
    assert torch.equal(again[1].weight, m[1].weight)


def test_a_different_base_model_is_refused_naming_the_tensor(tmp_path) -> None:
    m = _model()
    with safeckpt.CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        mgr.save(1, {"model": m})
    other = _model(seed=1)  # another base: frozen weights differ
    head_before = other[1].weight.clone()
    with safeckpt.CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        with pytest.raises(safeckpt.IncompatibleCheckpoint, match=r"(?s)frozen tensor '0\.(bias|weight)' differs.*state is unchanged"):
            mgr.restore({"model": other})
    assert torch.equal(other[1].weight, head_before)  # nothing was loaded

    shaped = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 4))
    shaped[0].requires_grad_(False)
    with safeckpt.CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        with pytest.raises(safeckpt.IncompatibleCheckpoint):
            mgr.restore({"model": shaped})

    unfrozen = _model()
    unfrozen.requires_grad_(True)  # now trainable: the checkpoint lacks its weights
    with safeckpt.CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        with pytest.raises(safeckpt.IncompatibleCheckpoint, match=r"0\.weight"):
            mgr.restore({"model": unfrozen})


def test_fingerprint_cache_sees_in_place_changes() -> None:
    t = torch.zeros(8)
    first = _frozen.checksum(t)
    assert _frozen.checksum(t) == first
    with torch.no_grad():
        t[3] = 1.0
    assert _frozen.checksum(t) != first
    assert _frozen.fingerprint(torch.zeros(2, 3, dtype=torch.bfloat16))["dtype"] == "bfloat16"


def test_fingerprint_cache_is_not_fooled_by_a_reused_address() -> None:
    """A freed tensor's address and version counter come back with the next tensor of its size
    (the allocator reuses the block): the cache must hash the new one, not serve the old digest.
    Seen in CI: a base model built after a different one passed verification as that one."""
    served_stale = 0
    for seed in range(50):
        old = nn.Parameter(torch.randn(384, 384, generator=torch.Generator().manual_seed(seed)),
                           requires_grad=False)
        old_digest, address = _frozen.checksum(old), old.data_ptr()
        del old
        new = nn.Parameter(torch.empty(384, 384), requires_grad=False)
        with torch.no_grad():
            new.copy_(torch.randn(384, 384, generator=torch.Generator().manual_seed(seed + 1000)))
        if new.data_ptr() == address:
            served_stale += _frozen.checksum(new) == old_digest
        assert _frozen.checksum(new) == _frozen.checksum(new.detach().clone())
        del new
    assert served_stale == 0


def test_frozen_mode_is_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="frozen must be one of"):
        safeckpt.CheckpointManager(tmp_path, frozen="skip")
