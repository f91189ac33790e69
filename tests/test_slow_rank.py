"""A rank slower than ``timeout`` in its own part of a phase is named as such (issue 27, item 12).

``timeout`` bounds how long a rank waits for the others in each phase, and so also how long a
rank's own work in a phase (writing its share) may take. A rank that was still writing when the
others gave up used to be told it "did not reach phase 'write' ... hung" (the waiting side) and
"the store is unreachable" or "every rank reached this phase and none is known to have exited"
(the slow side, although rank 0 had given up and exited). Now the waiting ranks say that rank 1
was still writing when they gave up after the timeout, and rank 1 says that it was still writing
when the others gave up, and how long its write took.

Real 2-rank gloo jobs (tests/helpers/dist_harness.py): rank 1 sleeps past the 5 s timeout
before opening its file (it then finds the staging directory removed) or in its first write.
Rank 0 either exits right after its error (the store, which it hosts, goes with it: a job
without torchrun's agent) or stays until rank 1 is done (torchrun's agent keeps the store).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.helpers import dist_harness

TIMEOUT = 5
SLOW = 9.0  # seconds rank 1's write sleeps: past the timeout


def _state() -> dict:
    return {"w": torch.ones(1000), "x": torch.zeros(3000)}


def _job(rank, world, root, sync, rank0_stays, where):
    import safeckpt
    import safeckpt.format.shardfile as sf
    import safeckpt.storage.commit as commit

    safeckpt.save(os.path.join(root, "a"), _state(), timeout=TIMEOUT)
    if rank == 1:
        # mid-write: its file is open in the staging directory when the others give up;
        # before-open: it opens its file only after rank 0 removed the staging directory
        module, name = (sf, "_write_all") if where == "mid-write" else (commit, "write")
        real, calls = getattr(module, name), [0]

        def slow(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 1:
                time.sleep(SLOW)
            return real(*args, **kwargs)

        setattr(module, name, slow)
    res = dist_harness.attempt(lambda: safeckpt.save(os.path.join(root, "b"), _state(), timeout=TIMEOUT).path)
    if rank == 1:
        open(os.path.join(sync, "rank1-done"), "w").close()
    elif rank0_stays:  # keep the store (hosted here) up while rank 1 diagnoses
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(sync, "rank1-done")) and time.monotonic() < deadline:
            time.sleep(0.05)
    return res


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("rank0_stays", "where"), [(False, "before-open"), (True, "mid-write")],
                         ids=["rank0-exits", "store-stays"])
def test_a_rank_slower_than_the_timeout_is_told_it_was_still_writing(tmp_path, rank0_stays, where):
    root, sync = tmp_path / "ckpts", tmp_path / "sync"
    root.mkdir()
    sync.mkdir()
    out = dist_harness.run(_job, 2, str(root), str(sync), rank0_stays, where, timeout=150)
    assert all(o.ok for o in out), [(o.rank, o.exitcode, o.message) for o in out]
    r0, r1 = out[0].value, out[1].value
    assert not r0["ok"] and not r1["ok"], (r0, r1)
    assert "RankFailure" in r0["mro"] and "RankFailure" in r1["mro"]

    # The waiting rank: rank 1 was still writing when it gave up after the timeout.
    m0 = r0["msg"]
    assert "rank(s) 1 (of 2) was still writing its share of the checkpoint" in m0, m0
    assert f"gave up after the {TIMEOUT}s timeout" in m0, m0
    assert "takes longer than `timeout`" in m0, m0  # what to do about it
    assert r0["failures"] == {1: f"still writing its share of the checkpoint ('write') after the {TIMEOUT}s timeout"}
    assert TIMEOUT <= r0["elapsed"] < TIMEOUT + 4, r0["elapsed"]

    # The slow rank: it was still writing when the others gave up, its write took > timeout.
    m1 = r1["msg"]
    assert "this rank (1) was still writing its share of the checkpoint" in m1, m1
    assert f"when the other ranks gave up waiting for it after the {TIMEOUT}s timeout" in m1, m1
    assert "raise `timeout`" in m1, m1
    assert "Every rank reached this phase" not in m1 and "unreachable" not in m1, m1
    if not rank0_stays:
        assert "rank(s) 0 then exited" in m1, m1
    if where == "before-open":  # what it then ran into is told as the consequence it is
        assert "Its own step then ended with CheckpointError: the staging directory" in m1, m1
        assert "do not share" not in m1, m1  # not the unshared-directory guess: it was removed
        assert "a consequence of the others giving up" in m1, m1
    assert list(r1["failures"]) == [1], r1["failures"]
    took = float(m1.split("took ")[1].split("s here")[0])
    assert took >= SLOW, m1

    # Nothing was published; the previous checkpoint is intact.
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["a"]
    import safeckpt

    assert safeckpt.verify(str(root / "a")).ok


def _late_to_the_call(rank, world, root):
    import safeckpt

    safeckpt.save(os.path.join(root, "a"), _state(), timeout=TIMEOUT)
    if rank == 1:
        time.sleep(TIMEOUT + 4)  # stuck in its own training code, not in safeckpt
    res = dist_harness.attempt(lambda: safeckpt.save(os.path.join(root, "b"), _state(), timeout=TIMEOUT).path)
    if rank == 0:
        time.sleep(TIMEOUT + 5)  # keep the store up until rank 1 has seen its error
    return res


def test_a_rank_late_to_the_call_is_not_said_to_be_inside_it(tmp_path):
    """Rank 1 busy in its own code between two saves (found by review): rank 0 must not say it
    "was still preparing its state for the save", and rank 1, coming to the save after the
    others gave up on it, must say so, not "every rank reached this phase"."""
    outs = dist_harness.run(_late_to_the_call, 2, str(tmp_path), timeout=120)
    r0, r1 = (o.value for o in outs)
    assert not r0["ok"] and not r1["ok"]
    assert "was still preparing its state" not in r0["msg"], r0["msg"]
    assert "rank(s) 1 (of 2)" in r0["msg"], r0["msg"]
    assert "this rank (1) came to phase 'agree' after the other ranks had given up" in r1["msg"], r1["msg"]
    assert "Every rank reached this phase" not in r1["msg"], r1["msg"]
