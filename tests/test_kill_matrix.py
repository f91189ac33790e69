"""A small sample of the kill matrix (tests/stress/kill_matrix.py) in the normal suite.

Real processes, real kills (SIGKILL / os._exit) of one rank at a random point of a
CheckpointManager job, then: no hang, every survivor raises a CheckpointError naming the
killed rank (or nobody), nothing committed is lost, no partial checkpoint is visible, and a
fresh restart restores the newest valid checkpoint bit-exactly. The full run (>= 300 trials)
is ``python -m tests.stress.kill_matrix --trials 300 --seed 1``.
"""

from __future__ import annotations

import pytest

from tests.stress import kill_matrix

TIMEOUT = 8.0  # SAFECKPT_TIMEOUT of the jobs: a hang shows as a survivor outliving it
SLACK = 10.0
ZERO = ("lost", "partial", "wrong_values", "hangs", "non_checkpoint", "no_error", "wrong_blame",
        "misleading", "restart_failed", "no_kill", "odd_hidden")


def _spec(index: int, **fields) -> dict:
    return {**kill_matrix.sample(1000, index, TIMEOUT, worlds=(2, 3)), **fields}


@pytest.mark.timeout(420)
def test_kill_matrix_sample(tmp_path):
    specs = [kill_matrix.sample(7, i, TIMEOUT, worlds=(2, 3)) for i in range(4)]
    specs += [
        # Killed inside gloo's connect while safeckpt's group is created at the start-up
        # restore: survivors used to wait 5x the timeout. Rank 0 (the store's host) fails
        # fast and exits; the ranks still connecting must blame rank 2, not rank 0.
        _spec(100, point="setup/connect", world=4, victim=2, store_ops=1, mode="sync"),
        # Killed in retention after the checkpoint was published: the message says so.
        _spec(101, point="save/retain", world=2, victim=1, mode="async", occurrence=1),
        # Rank 0 (the store's host) killed after publishing: survivors must not blame others.
        _spec(102, point="save/commit-after-publish", world=3, victim=0, mode="sync"),
    ]
    summary, results = kill_matrix.run_specs(specs, seed=7, timeout=TIMEOUT, slack=SLACK,
                                             workdir=str(tmp_path))
    problems = {r["spec"]["trial"]: r["problems"] for r in results if r["problems"]}
    assert not problems, problems
    assert {k: summary[k] for k in ZERO} == dict.fromkeys(ZERO, 0), summary
    assert summary["kills"] == len(specs)
    assert summary["max_tte"] <= TIMEOUT + 2.0, summary["max_tte"]
    by_trial = {r["spec"]["trial"]: r for r in results}
    for survivor in by_trial[101]["survivors"].values():
        assert "is committed; only retention failed" in survivor["msg"], survivor["msg"]
        assert survivor["blamed"] == [1], survivor
    for survivor in by_trial[100]["survivors"].values():
        assert survivor["type"] == "RankFailure" and survivor["tte"] < TIMEOUT, survivor
        assert survivor["blamed"] == [2], survivor
