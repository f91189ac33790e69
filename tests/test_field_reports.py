"""Each field report in /work/shared/field-reports cannot happen with safeckpt.

1. overwrite race (1-ddp-overwrite-rmtree-race): 8 ranks save over the same path again and again
   with overwrite=True and random jitter; no rank crashes, the directory exists once and verifies.
2. per-rank timestamped paths (5-dcp-save-not-on-all-ranks: ranks saved to ...-193345/-193346/
   -193347): every rank raises RankMismatch and nothing is written.
3. an exception on one rank (2-last-checkpoint-not-saved, 3-deepspeed-...-fileexists-race: one
   rank's failure leaves the others hanging or a half-written checkpoint): RankFailure on every
   rank naming the failing one, quickly; the previous checkpoint is intact.
4. proper DDP checkpoint and resume (4-proper-ddp-checkpoint-and-resume): saved from DDP, loaded
   into a plain module and back into DDP, bit-exact, training continues identically.
5. dcp save not on all ranks (5-dcp-save-not-on-all-ranks): when save returns, every rank's file
   is there; a load right after the save works on every rank.

Scenarios 2-5 share one 3-rank run (spawning costs seconds); each has its own test.
"""

from __future__ import annotations

import errno
import json
import os
import random
import time

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt.engine.reader import open_manifest
from tests.helpers import dist_harness

_attempt = dist_harness.attempt
_leftovers = dist_harness.leftovers


# ------------------------------------------------------------------ 1. overwrite race


def _round_state(i: int) -> dict:
    model = nn.Linear(64, 32)
    with torch.no_grad():
        model.weight.fill_(float(i))
        model.bias.fill_(float(i))
    return {"model": model, "round": i}


def _overwrite_race(rank, world, root, rounds):
    path = os.path.join(root, "ckpt")
    jitter = random.Random(1000 + rank)
    seen = []
    for i in range(rounds):
        time.sleep(jitter.uniform(0.0, 0.02))
        safeckpt.save(path, _round_state(i), overwrite=True)
        # Right after save returns, every rank sees this round's checkpoint, complete.
        with open(os.path.join(path, "manifest.json")) as f:
            man = json.load(f)
        present = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        seen.append((man["objects"]["round"]["tree"], len(present), man["world_size"]))
    return seen


@pytest.mark.timeout(170)
def test_fr1_overwrite_race_8_ranks(tmp_path):
    rounds = 20
    path = tmp_path / "ckpt"
    safeckpt.save(path, _round_state(-1))  # a pre-existing checkpoint at the path
    out = dist_harness.run(_overwrite_race, 8, str(tmp_path), rounds, timeout=150)
    assert all(o.ok for o in out), [(o.rank, o.error_type, o.message) for o in out if not o.ok]
    for o in out:
        assert o.value == [(i, 8, 8) for i in range(rounds)], (o.rank, o.value)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # exists once, no staging or trash left
    report = safeckpt.verify(path)
    assert report.ok, report.problems
    flat = safeckpt.read_state_dict(path)
    assert flat["round"] == rounds - 1
    assert torch.equal(flat["model/weight"], torch.full((32, 64), float(rounds - 1)))


# ---------------------------------------------------- 2-5: one 3-rank run, four scenarios


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24))
        self.head = nn.Linear(24, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.head(self.body(x))


def _net(seed: int) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 12, generator=g), torch.randn(5, 3, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _same_tensors(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ (bitwise) between two state dicts."""
    bad = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    return bad + [k for k in b if k not in a]


def _same_optim(o1, o2) -> bool:
    s1, s2 = o1.state_dict(), o2.state_dict()
    return s1["param_groups"] == s2["param_groups"] and s1["state"].keys() == s2["state"].keys() and all(
        torch.equal(s1["state"][i][k], s2["state"][i][k]) if isinstance(s1["state"][i][k], torch.Tensor)
        else s1["state"][i][k] == s2["state"][i][k]
        for i in s1["state"] for k in s1["state"][i]
    )


def _fr5_load_right_after_save(rank, world, root):
    """All shards present as soon as save returns; load right away works on every rank."""
    path = os.path.join(root, "fr5", "ck")
    if rank == world - 1:  # make the last rank the slowest writer
        from safeckpt.format import shardfile as _shardfile

        real = _shardfile._write_all

        def slow(fd, data):
            time.sleep(0.3)
            return real(fd, data)

        _shardfile._write_all = slow
    else:
        real = None
    model = _net(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, opt, 0)
    try:
        safeckpt.save(path, {"model": model, "optim": opt, "rng": safeckpt.RNGState()})
    finally:
        if real is not None:
            from safeckpt.format import shardfile as _shardfile

            _shardfile._write_all = real
    # No barrier, no waiting: the checkpoint is complete for every rank already.
    listing = sorted(os.listdir(path))
    ok = safeckpt.verify(path).ok
    model2 = _net(1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    safeckpt.load(path, {"model": model2, "optim": opt2, "rng": safeckpt.RNGState()})
    return {
        "listing": listing,
        "verify": ok,
        "model_diff": _same_tensors(model.state_dict(), model2.state_dict()),
        "optim_same": _same_optim(opt, opt2),
    }


def _fr4_ddp_resume(rank, world, root):
    """DDP -> checkpoint -> plain module -> checkpoint -> DDP, bit-exact; training continues."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_net(rank))  # DDP broadcasts rank 0's initial weights
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        _step(ddp, opt, 10 * i + rank)  # different data per rank, gradients all-reduced
    a = os.path.join(root, "fr4", "from_ddp")
    safeckpt.save(a, {"model": ddp, "optim": opt, "epoch": 3})
    keys = sorted(safeckpt.read_state_dict(a))

    plain = _net(100 + rank)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    st = {"model": plain, "optim": plain_opt, "epoch": 0}
    safeckpt.load(a, st)
    into_plain = _same_tensors(ddp.module.state_dict(), plain.state_dict())
    b = os.path.join(root, "fr4", "from_plain")
    safeckpt.save(b, {"model": plain, "optim": plain_opt, "epoch": st["epoch"]})

    ddp2 = DDP(_net(200 + rank))
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.05, momentum=0.9)
    st2 = {"model": ddp2, "optim": opt2, "epoch": 0}
    safeckpt.load(b, st2)
    into_ddp = _same_tensors(ddp.module.state_dict(), ddp2.module.state_dict())
    optim_same = _same_optim(opt, opt2)
    # Resumed training matches a resume by in-memory state transfer exactly. (A fresh DDP wrapper
    # is needed for the reference too: the all-reduce's summation order depends on DDP's bucket
    # history, so the original wrapper may differ from any fresh one in the last bit.)
    ddp3 = DDP(_net(300 + rank))
    opt3 = torch.optim.SGD(ddp3.parameters(), lr=0.05, momentum=0.9)
    ddp3.module.load_state_dict(ddp.module.state_dict())
    opt3.load_state_dict(opt.state_dict())
    for i in range(3, 5):
        _step(ddp2, opt2, 10 * i + rank)
        _step(ddp3, opt3, 10 * i + rank)
    after = _same_tensors(ddp3.module.state_dict(), ddp2.module.state_dict())
    return {"keys": keys, "into_plain": into_plain, "into_ddp": into_ddp, "optim_same": optim_same,
            "epoch": st2["epoch"], "after_training": after}


def _fr2_timestamped_paths(rank, world, root):
    """Each rank names the checkpoint from its own clock, skewed by rank * 1.7 s."""
    stamp = time.strftime("%Y-%m-%d-%H%M%S", time.gmtime(time.time() + 1.7 * rank))
    path = os.path.join(root, "fr2", f"sft-{stamp}")
    res = _attempt(lambda: safeckpt.save(path, {"model": _net(0), "step": 5}))
    # Same path, different state layout on one rank: also refused before anything is written.
    layout = {"model": _net(0), "step": 5}
    if rank == 2:
        layout["extra"] = torch.ones(3)
    res2 = _attempt(lambda: safeckpt.save(os.path.join(root, "fr2", "same-path"), layout))
    return {"path": path, "res": res, "layout": res2}


def _fr3_one_rank_fails(rank, world, root):
    """A state_dict() raising on rank 1, then disk-full on rank 2's write."""
    path = os.path.join(root, "fr3", "ck")
    model = _net(0)
    safeckpt.save(path, {"model": model, "v": 1})

    class Flaky:
        def state_dict(self):
            if rank == 1:
                raise RuntimeError("dataloader state unavailable on this rank")
            return {"pos": 3}

        def load_state_dict(self, sd):
            pass

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    raised = _attempt(lambda: safeckpt.save(path, {"model": model, "v": 2, "loader": Flaky()}, overwrite=True))

    if rank == 2:
        from safeckpt.format import shardfile as _shardfile

        real = _shardfile._write_all

        def disk_full(fd, data):
            real(fd, data[: len(data) // 2])  # a partial file, then ENOSPC
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        _shardfile._write_all = disk_full
    enospc = _attempt(lambda: safeckpt.save(path, {"model": model, "v": 2}, overwrite=True))
    if rank == 2:
        _shardfile._write_all = real
    listing = sorted(os.listdir(os.path.dirname(path)))  # the coordinator cleans up before raising

    # The previous checkpoint is intact and loads on every rank.
    fresh = _net(7)
    st = {"model": fresh, "v": 0}
    safeckpt.load(path, st)
    return {"raised": raised, "enospc": enospc, "listing": listing, "v": st["v"],
            "model_diff": _same_tensors(_net(0).state_dict(), fresh.state_dict())}


def _fr_scenarios(rank, world, root):
    out = {}
    for name, fn in (("fr5", _fr5_load_right_after_save), ("fr4", _fr4_ddp_resume),
                     ("fr2", _fr2_timestamped_paths), ("fr3", _fr3_one_rank_fails)):
        out[name] = _attempt(lambda fn=fn: fn(rank, world, root))
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    root = tmp_path_factory.mktemp("fr")
    out = dist_harness.run(_fr_scenarios, 3, str(root), timeout=120)
    assert all(o.ok for o in out), [(o.rank, o.error_type, o.message, o.exitcode) for o in out]
    return root, [o.value for o in out]


def _result(scenarios, name):
    root, values = scenarios
    res = [v[name] for v in values]
    for r, x in enumerate(res):
        assert x["ok"], f"scenario {name} failed on rank {r}: {x['type']}: {x['msg']}"
    return root, [x["value"] for x in res]


def test_fr2_per_rank_timestamped_paths_raise_rank_mismatch_everywhere(scenarios):
    root, res = _result(scenarios, "fr2")
    paths = [r["path"] for r in res]
    assert len(set(paths)) == 3  # the clocks really disagreed
    for rank, r in enumerate(res):
        e = r["res"]
        assert e["type"] == "RankMismatch", (rank, e)
        assert "rank 1 was called with path=" in e["msg"] and "rank 2 was called with path=" in e["msg"]
        assert "nothing was written" in e["msg"]
        e = r["layout"]
        assert e["type"] == "RankMismatch", (rank, e)
        assert "rank 2" in e["msg"] and "extra" in e["msg"], e["msg"]
    # Nothing was written: not the directories, not their parent, no staging.
    assert not (root / "fr2").exists()


def test_fr3_exception_on_one_rank_is_raised_on_every_rank(scenarios):
    root, res = _result(scenarios, "fr3")
    for rank, r in enumerate(res):
        e = r["raised"]
        assert e["type"] == "RankFailure", (rank, e)
        assert sorted(e["failures"]) == [1], e
        assert "dataloader state unavailable" in e["failures"][1]
        assert "rank 1" in e["msg"] and "dataloader state unavailable" in e["msg"]
        assert e["elapsed"] < 10.0, e["elapsed"]  # at once, not after the (30 s) timeout

        e = r["enospc"]
        assert e["type"] == "RankFailure", (rank, e)
        assert sorted(e["failures"]) == [2], e
        assert "No space left on device" in e["failures"][2]
        assert "rank 2" in e["msg"] and "'write'" in e["msg"]
        assert e["elapsed"] < 10.0, e["elapsed"]

        if rank == 0:
            assert r["listing"] == ["ck"], r["listing"]  # no staging leftover
        assert r["v"] == 1 and r["model_diff"] == []  # the previous checkpoint loaded
    assert _leftovers(root / "fr3") == []
    assert safeckpt.verify(root / "fr3" / "ck").ok


def test_fr4_ddp_checkpoint_resumes_bit_exactly(scenarios):
    root, res = _result(scenarios, "fr4")
    for rank, r in enumerate(res):
        assert not any(k.startswith("model/module.") for k in r["keys"]), r["keys"]
        assert "model/body.0.weight" in r["keys"] and "model/seen" in r["keys"]
        assert r["into_plain"] == [], (rank, r["into_plain"])
        assert r["into_ddp"] == [], (rank, r["into_ddp"])
        assert r["optim_same"], rank
        assert r["epoch"] == 3
        assert r["after_training"] == [], (rank, r["after_training"])
    # Written once (replicated), not three times: the checkpoint holds one model's worth of bytes.
    flat = safeckpt.read_state_dict(root / "fr4" / "from_ddp")
    man = open_manifest(str(root / "fr4" / "from_ddp"))  # format 3: chunks from the files' indexes
    assert man["world_size"] == 3
    for key in ("model/body.0.weight", "optim/state/0/momentum_buffer"):
        chunks = man["tensors"][key]["chunks"]
        assert sum(torch.Size(c["sizes"]).numel() for c in chunks) == flat[key].numel()


def test_fr5_all_shards_present_when_save_returns(scenarios):
    root, res = _result(scenarios, "fr5")
    expected = ["manifest.json"] + [f"rank-{r:05d}.safetensors" for r in range(3)]
    for rank, r in enumerate(res):
        assert r["listing"] == expected, (rank, r["listing"])
        assert r["verify"], rank
        assert r["model_diff"] == [], (rank, r["model_diff"])
        assert r["optim_same"], rank
