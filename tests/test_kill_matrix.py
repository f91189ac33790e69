"""A small sample of the kill matrix (tests/stress/kill_matrix.py) in the normal suite.

Real processes, real kills (SIGKILL / os._exit) of one rank at a random point of a
CheckpointManager job, then: no hang, every survivor raises a CheckpointError naming the
killed rank (or nobody), nothing committed is lost, a checkpoint rank 0 published before it
died is there, no partial checkpoint is visible, and a fresh restart restores the newest valid
checkpoint bit-exactly. Also at 8 and 16 ranks with the coordinator (rank 0: it hosts the
store and alone resolves every ``Coordinator.decide``) killed. The full run (>= 300 trials) is
``python -m tests.stress.kill_matrix --trials 300 --seed 1``.
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
        # Retention (rank 0, inside the write's resolve, after publishing) fails: every rank
        # says the checkpoint is committed and only retention failed.
        _spec(101, point="save/retain-mid", world=2, victim=0, mode="async", method="raise", occurrence=1),
        # Rank 0 killed after publishing: survivors must not blame others nor say "not published".
        _spec(102, point="save/commit-after-publish", world=3, victim=0, mode="sync"),
        # A non-coordinator killed half-way through its data file.
        _spec(103, point="save/write-mid-file", world=3, victim=2, mode="async", occurrence=1),
        # 8 ranks, the coordinator killed while resolving the write (files gathered, nothing
        # published): every survivor blames rank 0, nothing is published.
        _spec(104, point="save/write-resolve", world=8, victim=0, mode="sync", occurrence=1),
        # 16 ranks, the coordinator killed after staging, before broadcasting the agreement.
        _spec(105, point="save/agree-staged", world=16, victim=0, mode="async", occurrence=1),
    ]
    summary, results = kill_matrix.run_specs(specs, seed=7, timeout=TIMEOUT, slack=SLACK,
                                             workdir=str(tmp_path))
    problems = {r["spec"]["trial"]: r["problems"] for r in results if r["problems"]}
    assert not problems, problems
    assert {k: summary[k] for k in ZERO} == dict.fromkeys(ZERO, 0), summary
    assert summary["kills"] == len(specs)
    assert summary["max_tte"] <= TIMEOUT + 2.0, summary["max_tte"]
    by_trial = {r["spec"]["trial"]: r for r in results}
    assert len(by_trial[101]["survivors"]) == 2  # the rank whose retention failed reports too
    for survivor in by_trial[101]["survivors"].values():
        assert "is committed; only retention failed" in survivor["msg"], survivor["msg"]
    assert by_trial[101]["killed_step"] in by_trial[101]["disk"]["valid"]
    for survivor in by_trial[100]["survivors"].values():
        assert survivor["type"] == "RankFailure" and survivor["tte"] < TIMEOUT, survivor
        assert survivor["blamed"] == [2], survivor
    for trial, world in ((104, 8), (105, 16)):
        res = by_trial[trial]
        assert len(res["survivors"]) == world - 1, res["survivors"]
        for survivor in res["survivors"].values():
            assert survivor["type"] == "RankFailure" and survivor["blamed"] == [0], survivor
        assert res["killed_step"] not in res["disk"]["valid"]  # killed before publishing


@pytest.mark.timeout(420)
def test_kill_matrix_tier_every_point_once(tmp_path):
    """The node-local tier's kill points (tests/stress/kill_tier.py: local write, replicate,
    publish, drain to root, the tiered restore's inventory/verify/fetch), each once in turn on
    simulated nodes, the crash job re-saving the step it restored (so the kill between the two
    renames of a replaced local step is drawn too): the restart restores exactly the newest step complete on some tier,
    bit-exact, and every survivor raises within the timeout blaming the victim."""
    from tests.stress import kill_tier

    points = kill_tier.ALL_POINTS
    summary, results = kill_matrix.run_matrix(len(points), 9, timeout=TIMEOUT, slack=SLACK, tier=True,
                                              cycle=True, overwrite=True, workdir=str(tmp_path))
    problems = {r["spec"]["trial"]: r["problems"] for r in results if r["problems"]}
    assert not problems, problems
    assert {r["spec"]["point"] for r in results} == set(points)
    assert summary["bad_trials"] == [], summary
    assert summary["max_tte"] <= TIMEOUT + 2.0, summary["max_tte"]
