"""Speculative agreement (SaveJob.agree(speculate=True)): after a save that went through on
every rank, an async save (plain or node-local tier) does only its own part of the agreement
before it copies the state, and the exchange runs in the background before anything is written.
What must still hold: ranks that disagree (path/step, layout, replicas, a bad argument on one
rank) fail the save on every rank with nothing written, raised by wait() (save() returned: that
is what shows the exchange was not in the blocking part), and the save after a failure agrees in
the blocking part again; a layout that changes the same way on every rank (optimizer state
appearing) is saved. Real processes, gloo on 127.0.0.1."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(240)


def _state(step: int, rank: int, *, extra: bool = False, only_rank1: bool = False, diverged: bool = False) -> dict:
    import safeckpt

    w = torch.full((3000,), float(step))
    if diverged and rank == 1:
        w[17] += 1  # one element of a replicated tensor differs on rank 1
    state = {"model": {"w": w, "b": torch.full((500,), step, dtype=torch.int64)},
             "mine": safeckpt.PerRank(torch.full((4,), float(rank)))}
    if extra:
        state["opt"] = {"exp_avg": torch.full((3000,), -float(step))}
    if only_rank1 and rank == 1:
        state["model"]["only_on_rank_1"] = torch.zeros(3)
    return state


def _outcome(fn) -> dict:
    from safeckpt import CheckpointError

    try:
        return {"ok": True, "value": fn()}
    except CheckpointError as exc:
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc)}


def _scenario(mgr, rank: int) -> dict:
    """The same sequence for the plain and the tiered manager; returns what each call did."""
    res: dict = {}

    def save_then_wait(step: int, state: dict, **kw) -> dict:
        saved = _outcome(lambda: mgr.save(step, state, **kw))
        waited = _outcome(lambda: getattr(mgr.wait(), "step", None))
        return {"save": saved, "wait": waited}

    res["0"] = save_then_wait(0, _state(0, rank))  # blocking agreement (first save)
    # a step that differs on rank 1 (each rank computing its own step): save() returns on both,
    # the background exchange finds it, nothing is written
    res["step"] = save_then_wait(2 if rank == 1 else 1, _state(1, rank))
    res["3"] = save_then_wait(3, _state(3, rank))  # after a failure: blocking agreement, fine
    res["4"] = save_then_wait(4, _state(4, rank, extra=True))  # new keys on every rank: saved
    res["layout"] = save_then_wait(5, _state(5, rank, extra=True, only_rank1=True))
    res["6"] = save_then_wait(6, _state(6, rank, extra=True))
    res["replicas"] = save_then_wait(7, _state(7, rank, extra=True, diverged=True))
    res["8"] = save_then_wait(8, _state(8, rank, extra=True))
    bad = {"note": object()} if rank == 1 else {"note": "fine"}  # not JSON, on rank 1 only
    res["metadata"] = save_then_wait(9, _state(9, rank, extra=True), metadata=bad)
    # right after a failed save, no speculation: the blocking part's exchange raises, in save()
    res["layout_blocking"] = save_then_wait(10, _state(10, rank, extra=True, only_rank1=True))
    res["11"] = save_then_wait(11, _state(11, rank, extra=True))
    # back to back, no wait() between, one rank late: each save reads the previous save's outcome
    # only after waiting for it (reading it before made the ranks choose differently: a hang)
    import time

    for step in range(12, 18):
        if rank == step % 2:
            time.sleep(0.05)
        mgr.save(step, _state(step, rank, extra=True))
    res["17"] = {"save": {"ok": True, "value": None}, "wait": _outcome(lambda: getattr(mgr.wait(), "step", None))}
    return res


def _plain_job(rank: int, world: int, root: str) -> dict:
    import safeckpt

    mgr = safeckpt.CheckpointManager(root, keep_last=None, async_save=True, preemption_signals=(), timeout=30)
    res = _scenario(mgr, rank)
    mgr.close()
    return res


def _tier_job(rank: int, world: int, base: str) -> dict:
    import torch.distributed as dist

    import safeckpt

    os.environ["GROUP_RANK"] = str(rank)
    root = os.path.join(base, "root")
    local = os.path.join(base, f"node{rank}")
    mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=4, replicas=1, keep_local=None,
                                     preemption_signals=(), timeout=30)
    res = _scenario(mgr, rank)
    mgr.close(drain=False)
    dist.barrier()
    res["local"] = sorted(os.listdir(local))
    fresh = safeckpt.CheckpointManager(root, local_dir=local, durable_every=4, replicas=1,
                                       preemption_signals=(), timeout=30)
    state = _state(0, rank, extra=True)
    res["restored"] = fresh.restore(state)
    res["restored_w"] = float(state["model"]["w"][0])
    res["restored_opt"] = float(state["opt"]["exp_avg"][0])
    fresh.close(drain=False)
    return res


def _check(res: dict, durable: set[int] | None = None) -> None:
    """``durable``: the steps whose wait() returns their info (the tier: the drained ones)."""
    ok_steps = {"0": 0, "3": 3, "4": 4, "6": 6, "8": 8, "11": 11, "17": 17}
    for key, step in ok_steps.items():
        assert res[key]["save"] == {"ok": True, "value": None}, (key, res[key])
        shown = step if durable is None or step in durable else None
        assert res[key]["wait"] == {"ok": True, "value": shown}, (key, res[key])
    speculative = {"step": ("RankMismatch", "step="), "layout": ("RankMismatch", "only_on_rank_1"),
                   "replicas": ("RankMismatch", "replicated tensors differ"),
                   "metadata": (None, "metadata must be JSON")}
    for key, (kind, words) in speculative.items():
        assert res[key]["save"] == {"ok": True, "value": None}, (key, res[key])  # the exchange was not here
        err = res[key]["wait"]
        assert not err["ok"] and words in err["msg"], (key, err)
        assert kind is None or err["type"] == kind, (key, err)
        assert "nothing was written" in err["msg"].lower() or "Nothing was written" in err["msg"], (key, err)
    # no speculation right after a failed save: the blocking part raises itself
    assert not res["layout_blocking"]["save"]["ok"], res["layout_blocking"]
    assert "only_on_rank_1" in res["layout_blocking"]["save"]["msg"]


def test_plain_async_speculative_agreement(tmp_path):
    root = tmp_path / "root"
    outs = dist_harness.run(_plain_job, 2, str(root), timeout=200)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        _check(o.value)
    import safeckpt

    steps = [i.step for i in safeckpt.CheckpointManager(str(root), preemption_signals=()).list()]
    assert steps == [0, 3, 4, 6, 8, 11, *range(12, 18)], steps
    assert [n for n in os.listdir(root) if n.startswith(".") and not n.startswith(".safeckpt")] == []
    for step in steps:
        sd = safeckpt.read_state_dict(str(root / f"step-{step:010d}"))
        assert bool((sd["model/w"] == step).all()) and bool((sd["model/b"] == step).all()), step
        assert ("opt/exp_avg" in sd) == (step >= 4)


def test_tier_speculative_agreement(tmp_path):
    outs = dist_harness.run(_tier_job, 2, str(tmp_path), timeout=200)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        _check(o.value, durable={0, 4, 8, 16})
        names = o.value["local"]
        assert not [n for n in names if n.startswith(".partial-")], names  # nothing half-written left
        assert not any(f"{s:010d}" in n for n in names for s in (1, 2, 5, 7, 9, 10)), names
        assert o.value["restored"] == 17 and o.value["restored_w"] == 17.0 and o.value["restored_opt"] == -17.0


def _check_finite_job(rank: int, world: int, root: str) -> dict:
    """check_finite on a plain async manager: its exchange stays in the blocking part, and a
    speculative save whose own part failed on one rank still enters it (with nothing to check),
    so the ranks stay in step and the real error comes from the background on both."""
    import safeckpt

    mgr = safeckpt.CheckpointManager(root, keep_last=None, async_save=True, check_finite=True,
                                     preemption_signals=(), timeout=30)
    res = {}
    for step, meta in ((0, {}), (1, {"note": object()} if rank == 1 else {}), (2, {}), (3, {})):
        saved = _outcome(lambda step=step, meta=meta: mgr.save(step, _state(step, rank), metadata=meta))
        res[str(step)] = {"save": saved, "wait": _outcome(lambda: getattr(mgr.wait(), "step", None))}
    mgr.close()
    return res


def test_check_finite_with_a_failed_speculative_part_keeps_ranks_in_step(tmp_path):
    outs = dist_harness.run(_check_finite_job, 2, str(tmp_path / "root"), timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        v = o.value
        for step in (0, 2, 3):
            assert v[str(step)] == {"save": {"ok": True, "value": None}, "wait": {"ok": True, "value": step}}, v
        assert v["1"]["save"] == {"ok": True, "value": None}, v
        assert not v["1"]["wait"]["ok"] and "metadata must be JSON" in v["1"]["wait"]["msg"], v
