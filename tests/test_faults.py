"""Real faults in real multi-process gloo runs (SPEC behaviours 1-4, 9, 10).

Ranks are killed for real (``os._exit`` / SIGKILL) at the phase under test, by patching the
library's own functions inside that worker before it calls ``save``. The survivors must raise
RankFailure naming the dead or absent rank, promptly for a dead peer and within the timeout for
an absent one, and the previous checkpoint must stay intact and loadable.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

import safeckpt
from safeckpt.format.manifest import STAGING_MARK
from tests.helpers import dist_harness

CRASH_TIMEOUT = 60.0  # SAFECKPT_TIMEOUT in crash runs: a dead peer must be seen long before it


_attempt = dist_harness.attempt
_leftovers = dist_harness.leftovers


def _visible(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


def _state(version: float) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    with torch.no_grad():
        model.weight.fill_(version)
        model.bias.fill_(version)
    return {"model": model, "version": version, "rng": safeckpt.RNGState()}


def _assert_holds_version(path, version: float) -> None:
    report = safeckpt.verify(path)
    assert report.ok, report.problems
    flat = safeckpt.read_state_dict(path)
    assert flat["version"] == version
    assert torch.equal(flat["model/weight"], torch.full((256, 256), version))
    # And it loads through the normal (collective, here single-process) path.
    st = _state(0.0)
    del st["rng"]  # per-rank state of 3 ranks; this check runs as a single process
    safeckpt.load(path, st, strict=False)
    assert st["version"] == version and torch.equal(st["model"].weight, torch.full((256, 256), version))


def _assert_survivors_blame(outcomes, results, dead: int) -> None:
    for o in outcomes:
        if o.rank == dead:
            assert not o.ok and o.exitcode not in (0, None), (o.rank, o.exitcode, o.message)
            continue
        assert o.ok, o.message
        res = results(o.value)
        assert not res["ok"], f"rank {o.rank}: save succeeded although rank {dead} died"
        assert res["type"] == "RankFailure", res
        assert sorted(res["failures"]) == [dead], res
        assert f"rank(s) {dead} " in res["msg"], res["msg"]
        # A dead peer is seen when its sockets close, not when the timeout expires.
        assert res["elapsed"] < 15.0, res["elapsed"]


# ------------------------------------------------------------------ rank killed mid-write


def _killed_mid_write(rank, world, root):
    path = os.path.join(root, "ck")
    safeckpt.save(path, _state(1.0))
    if rank == 1:
        from safeckpt.format import shardfile as _shardfile

        real = _shardfile._write_all
        calls = [0]

        def die_mid_write(fd, data):
            calls[0] += 1
            if calls[0] < 2:  # the header goes through; die half-way through the tensor bytes
                return real(fd, data)
            real(fd, data[: len(data) // 2])
            os._exit(17)

        _shardfile._write_all = die_mid_write
    first = _attempt(lambda: safeckpt.save(path, _state(2.0), overwrite=True))
    # The checkpoint group is unusable now; a further save must fail at once, not hang.
    second = _attempt(lambda: safeckpt.save(os.path.join(root, "next"), _state(3.0)))
    return {"first": first, "second": second}


def test_rank_killed_mid_write_fails_fast_everywhere_and_keeps_previous(tmp_path):
    out = dist_harness.run(_killed_mid_write, 3, str(tmp_path), timeout=90,
                           env={"SAFECKPT_TIMEOUT": str(CRASH_TIMEOUT)})
    assert out[1].exitcode == 17
    _assert_survivors_blame(out, lambda v: v["first"], dead=1)
    for o in out:
        if o.rank != 1:
            second = o.value["second"]
            assert second["type"] == "RankFailure" and second["elapsed"] < 5.0, second
    # The previous checkpoint at the same path is intact; the coordinator removed the staging dir.
    assert _visible(tmp_path) == ["ck"]
    assert _leftovers(tmp_path) == []
    _assert_holds_version(tmp_path / "ck", 1.0)


# ---------------------------------------------------------- coordinator killed before publish


def _coordinator_killed_before_publish(rank, world, root):
    path = os.path.join(root, "ck")
    safeckpt.save(path, _state(1.0))
    if rank == 0:
        from safeckpt.engine import save as _save
        from safeckpt.storage import commit as _commit

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        for mod in (_save, _commit):
            if hasattr(mod, "publish"):
                mod.publish = die
    return {"first": _attempt(lambda: safeckpt.save(path, _state(2.0), overwrite=True))}


def test_coordinator_killed_right_before_publish_leaves_no_partial_checkpoint(tmp_path):
    out = dist_harness.run(_coordinator_killed_before_publish, 3, str(tmp_path), timeout=90,
                           env={"SAFECKPT_TIMEOUT": str(CRASH_TIMEOUT)})
    assert out[0].exitcode == -signal.SIGKILL
    _assert_survivors_blame(out, lambda v: v["first"], dead=0)
    # Nothing new is visible: the path still holds the previous checkpoint, whole.
    assert _visible(tmp_path) == ["ck"]
    _assert_holds_version(tmp_path / "ck", 1.0)
    # The dead coordinator's fully written staging dir (manifest included) is never a checkpoint.
    for name in _leftovers(tmp_path):
        assert STAGING_MARK in name and name.startswith(".")
        assert not safeckpt.verify(tmp_path / name).ok
        try:
            safeckpt.load(tmp_path / name, _state(0.0))
        except safeckpt.CheckpointNotFound:
            pass
        else:
            raise AssertionError(f"staging leftover {name} loaded as a checkpoint")


# ------------------------------------------------------------------------- absent rank


def _absent_rank(rank, world, root):
    small = {"x": torch.arange(4.0)}
    done = os.path.join(root, "done")
    safeckpt.save(os.path.join(root, "warm"), small)  # every rank: the checkpoint group exists
    if rank == 1:  # alive, but never calls save again (stuck elsewhere)
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    # The group for a new timeout must be created first: rank 1 never shows up for that either.
    first_ever = _attempt(lambda: safeckpt.save(os.path.join(root, "a"), small, timeout=3))
    # The usual case: the group exists, rank 1 never enters the save (SAFECKPT_TIMEOUT=5).
    usual = _attempt(lambda: safeckpt.save(os.path.join(root, "b"), small))
    if rank == 0:
        open(done, "w").close()
    return {"first_ever": first_ever, "usual": usual}


def test_absent_rank_gives_rank_failure_within_the_timeout(tmp_path):
    out = dist_harness.run(_absent_rank, 3, str(tmp_path), timeout=90, env={"SAFECKPT_TIMEOUT": "5"})
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        if o.rank == 1:
            continue
        for case, timeout in (("first_ever", 3.0), ("usual", 5.0)):
            res = o.value[case]
            assert not res["ok"], (o.rank, case)
            assert res["type"] == "RankFailure", (o.rank, case, res)
            assert sorted(res["failures"]) == [1], (o.rank, case, res)
            assert "rank(s) 1 " in res["msg"] and f"{timeout:.0f}s" in res["msg"], res["msg"]
            # Raised when the timeout expires: not earlier, and not much later.
            assert timeout - 0.5 <= res["elapsed"] <= timeout + 6.0, (o.rank, case, res["elapsed"])
    assert _visible(tmp_path) == ["done", "warm"]
    assert _leftovers(tmp_path) == []


# ------------------------------------------- replicated bytes spread, replica consistency


def _spread_and_replicas(rank, world, root):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)  # identical replicas on every rank
    big = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))
    info = safeckpt.save(os.path.join(root, "spread"), {"model": big})

    torch.manual_seed(rank)
    ddp = DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))  # DDP syncs rank 0's init
    same = _attempt(lambda: safeckpt.save(os.path.join(root, "same"), {"model": ddp}))
    if rank == 1:
        with torch.no_grad():
            ddp.module[1].bias[0] += 1e-3  # a rank-local update: the replicas diverge
    diverged = _attempt(lambda: safeckpt.save(os.path.join(root, "diverged"), {"model": ddp}))
    off = _attempt(lambda: safeckpt.save(os.path.join(root, "off"), {"model": ddp}, check_replicas="off"))
    return {"nbytes": info.nbytes, "same": same, "diverged": diverged, "off": off}


def test_replicated_bytes_spread_and_replica_check(tmp_path):
    out = dist_harness.run(_spread_and_replicas, 4, str(tmp_path), timeout=120)
    assert all(o.ok for o in out), [o.message for o in out]

    # Replicated state is written once in total, about a quarter by each of the 4 ranks.
    model_bytes = 4 * (1024 * 2048 + 2048 + 2048 * 1024 + 1024)
    spread = tmp_path / "spread"
    sizes = {r: (spread / f"rank-{r:05d}.safetensors").stat().st_size for r in range(4)}
    total = sum(sizes.values())
    assert model_bytes <= total <= model_bytes * 1.01, (total, model_bytes)
    for r, n in sizes.items():
        assert 0.2 * model_bytes <= n <= 0.3 * model_bytes, (r, sizes)
    assert {o.value["nbytes"] for o in out} == {total}
    assert safeckpt.verify(spread).ok
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))
    flat = safeckpt.read_state_dict(spread)
    for k, v in ref.state_dict().items():
        assert torch.equal(flat[f"model/{k}"], v), k

    for o in out:
        assert o.value["same"]["ok"], o.value["same"]
        d = o.value["diverged"]
        assert d["type"] == "RankMismatch", (o.rank, d)
        assert "rank 1: model/1.bias" in d["msg"], d["msg"]
        assert "rank 2" not in d["msg"] and "rank 3" not in d["msg"], d["msg"]
        assert "safeckpt.PerRank" in d["msg"]  # the fix for state meant to differ per rank
        assert o.value["off"]["ok"], o.value["off"]
    assert _visible(tmp_path) == ["off", "same", "spread"]  # nothing written for "diverged"
    assert _leftovers(tmp_path) == []
