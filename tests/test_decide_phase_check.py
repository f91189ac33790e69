"""``Coordinator.decide`` checks that every rank is in the same phase.

Ranks out of step (one skipped or repeated a call) used to have their values matched silently:
rank 0 resolved the values of another call. Every rank now sends its phase's name with its
value, and a mismatch fails the phase on every rank (RankFailure naming the ranks and their
phases) without calling ``resolve``, at once instead of after the timeout.

Real processes (gloo on 127.0.0.1), each run under the harness's hard timeout. The cases that
leave the group usable run one after another in one job per world size (``world2``,
``world3``: each case makes its own Coordinator and ends with a call in step, which its test
checks); the ones that poison the group (run against decide) have a job each.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(150)

TIMEOUT = "60"  # the coordinator's timeout: a mismatch must be reported far sooner
QUICK = 15.0  # seconds a mismatched decide may take at most (incl. a loaded 2-core machine)
BIG = 3000  # a value longer than a slot (SLOT = 1024): the decision's extra gather


def _decide(coord, phase: str, value, resolved: list) -> dict:
    def resolve(values):
        resolved.append(phase)
        return {"values": values}

    return dist_harness.attempt(lambda: coord.decide(phase, lambda: value, resolve))


def _out_of_step_pair(rank, world):
    """Rank 0 in phase 'a', rank 1 in 'b'; then both in 'c' (the group is still usable)."""
    from safeckpt.coord.dist import Coordinator

    coord = Coordinator()
    resolved: list = []
    first = _decide(coord, "b" if rank == 1 else "a", rank, resolved)
    after = _decide(coord, "c", rank * 10, resolved)
    return {"first": first, "after": after, "resolved": resolved}


def _assert_rank_1_out_of_step(rank, first) -> None:
    """``first``: what rank ``rank`` got from its call while rank 0 was in phase 'a' and rank 1
    in 'b' (decide or run): the same RankFailure, naming rank 1 and both phases, at once."""
    assert not first["ok"], (rank, first)
    assert "RankFailure" in first["mro"] and "CheckpointError" in first["mro"], first
    assert "rank 1 is in phase 'b' while rank 0 is in 'a'" in first["msg"], first["msg"]
    assert "out of step (one rank skipped or repeated a call)" in first["msg"], first["msg"]
    assert sorted(first["failures"]) == [1], first["failures"]
    assert first["elapsed"] < QUICK, first


def test_rank_in_another_phase_fails_every_rank_at_once(world2):
    out = world2["decide-pair"]
    assert all(o.ok for o in out), [o.message for o in out]
    for rank, o in enumerate(out):
        _assert_rank_1_out_of_step(rank, o.value["first"])
        # a mismatch is not a transport failure: the group stays usable for calls in step
        assert o.value["after"] == {"ok": True, "value": {"values": [0, 10]},
                                    "elapsed": o.value["after"]["elapsed"]}, o.value["after"]
    # resolve ran only for the phase in step, on the coordinator
    assert out[0].value["resolved"] == ["c"]
    assert out[1].value["resolved"] == []


def _stray_rank(rank, world, stray, big):
    """Every rank in phase 'write' but ``stray``, in 'agree' (with a value longer than a slot
    if ``big``)."""
    from safeckpt.coord.dist import Coordinator

    coord = Coordinator()
    resolved: list = []
    value = "x" * BIG if big and rank == stray else rank
    got = _decide(coord, "agree" if rank == stray else "write", value, resolved)
    return {"got": got, "resolved": resolved}


@pytest.mark.parametrize("stray,big", [(2, False), (1, True)])
def test_non_coordinator_out_of_step_in_three_ranks(world3, stray, big):
    out = world3[f"decide-stray-{stray}-{big}"]
    assert all(o.ok for o in out), [o.message for o in out]
    for rank, o in enumerate(out):
        got = o.value["got"]
        assert not got["ok"], (rank, got)
        assert "RankFailure" in got["mro"], got
        assert f"rank {stray} is in phase 'agree' while rank 0 is in 'write'" in got["msg"], got["msg"]
        assert "out of step" in got["msg"], got["msg"]
        assert sorted(got["failures"]) == [stray], got["failures"]
        assert got["elapsed"] < QUICK, got
        assert o.value["resolved"] == []


def _in_step(rank, world):
    from safeckpt.coord.dist import Coordinator

    coord = Coordinator()
    resolved: list = []
    small = _decide(coord, "agree", rank, resolved)
    big = _decide(coord, "write", "y" * BIG if rank == world - 1 else rank, resolved)
    return {"small": small, "big": big, "resolved": resolved}


@pytest.mark.parametrize("world", [2, 3])
def test_matching_phases_still_decide(world2, world3, world):
    out = (world2 if world == 2 else world3)["decide-in-step"]
    assert all(o.ok for o in out), [o.message for o in out]
    values = list(range(world))
    long_values = [*range(world - 1), "y" * BIG]
    for o in out:
        assert o.value["small"]["ok"], o.value["small"]
        assert o.value["small"]["value"] == {"values": values}
        assert o.value["big"]["ok"], o.value["big"]
        assert o.value["big"]["value"] == {"values": long_values}
    assert out[0].value["resolved"] == ["agree", "write"]
    assert all(o.value["resolved"] == [] for o in out[1:])


# ---------------------------------------------------------------------------------- run()
# ``Coordinator.run`` (an all-gather: barrier(), the load's apply failure path, the
# integrations' steps) checks the same: every rank sends its phase's name with its value, and
# every rank compares each rank's phase with rank 0's by itself, so that every rank raises the
# same RankFailure without another exchange.


def _run(coord, phase: str, value, fail: bool = False) -> dict:
    def fn():
        if fail:
            raise ValueError(f"own error in {phase}")
        return value

    return dist_harness.attempt(lambda: coord.run(phase, fn))


def _run_out_of_step_pair(rank, world):
    """Rank 0 in run('a'), rank 1 in run('b'); then both in run('c') and barrier('d')."""
    from safeckpt.coord.dist import Coordinator

    coord = Coordinator()
    first = _run(coord, "b" if rank == 1 else "a", rank)
    after = _run(coord, "c", rank * 10)
    barrier = dist_harness.attempt(lambda: coord.barrier("d"))
    return {"first": first, "after": after, "barrier": barrier}


def test_run_in_another_phase_fails_every_rank_at_once(world2):
    out = world2["run-pair"]
    assert all(o.ok for o in out), [o.message for o in out]
    for rank, o in enumerate(out):
        _assert_rank_1_out_of_step(rank, o.value["first"])
        # a mismatch is not a transport failure: the group stays usable for calls in step
        assert o.value["after"]["ok"] and o.value["after"]["value"] == [0, 10], o.value["after"]
        assert o.value["barrier"]["ok"], o.value["barrier"]
    # every rank computed the same error (rank 0's phase is the reference on every rank)
    assert out[0].value["first"]["msg"] == out[1].value["first"]["msg"]
    assert out[0].value["first"]["failures"] == out[1].value["first"]["failures"]


def _run_stray_rank(rank, world, stray, big, fail):
    """Every rank in run('write') but ``stray``, in run('agree') (with a long value if ``big``;
    with its own step failing on every rank if ``fail``)."""
    from safeckpt.coord.dist import Coordinator

    coord = Coordinator()
    value = "x" * BIG if big and rank == stray else rank
    got = _run(coord, "agree" if rank == stray else "write", value, fail)
    after = _run(coord, "next", rank)
    return {"got": got, "after": after}


@pytest.mark.parametrize("stray,big,fail", [(2, False, False), (1, True, False), (0, False, False),
                                            (2, False, True)])
def test_run_out_of_step_in_three_ranks(world3, stray, big, fail):
    out = world3[f"run-stray-{stray}-{big}-{fail}"]
    assert all(o.ok for o in out), [o.message for o in out]
    # rank 0's phase is the reference: a stray rank 0 names every other rank
    named = [1, 2] if stray == 0 else [stray]
    lead, other = ("agree", "write") if stray == 0 else ("write", "agree")
    for rank, o in enumerate(out):
        got = o.value["got"]
        assert not got["ok"], (rank, got)
        assert "RankFailure" in got["mro"], got
        for r in named:
            assert f"rank {r} is in phase {other!r} while rank 0 is in {lead!r}" in got["msg"], got["msg"]
        assert "out of step" in got["msg"], got["msg"]
        # the mismatch is reported, not the ranks' own errors (they answer different calls)
        assert "own error" not in got["msg"], got["msg"]
        assert sorted(got["failures"]) == named, got["failures"]
        assert got["elapsed"] < QUICK, got
        assert o.value["after"] == {"ok": True, "value": [0, 1, 2], "elapsed": o.value["after"]["elapsed"]}
    assert len({o.value["got"]["msg"] for o in out}) == 1, [o.value["got"]["msg"] for o in out]


def _run_in_step(rank, world):
    from safeckpt.coord.dist import Coordinator

    coord = Coordinator()
    small = _run(coord, "agree", rank)
    big = _run(coord, "write", "y" * BIG if rank == world - 1 else {"rank": rank})
    failed = _run(coord, "apply", rank, fail=rank == world - 1)
    barrier = dist_harness.attempt(lambda: coord.barrier("done"))
    return {"small": small, "big": big, "failed": failed, "barrier": barrier}


@pytest.mark.parametrize("world", [2, 3])
def test_matching_run_phases_still_gather(world2, world3, world):
    out = (world2 if world == 2 else world3)["run-in-step"]
    assert all(o.ok for o in out), [o.message for o in out]
    last = world - 1
    for o in out:
        assert o.value["small"]["ok"] and o.value["small"]["value"] == list(range(world)), o.value["small"]
        expected = [{"rank": r} for r in range(last)] + ["y" * BIG]
        assert o.value["big"]["ok"] and o.value["big"]["value"] == expected
        # a rank's own error in a phase in step is reported as before
        failed = o.value["failed"]
        assert not failed["ok"] and "RankFailure" in failed["mro"], failed
        assert f"rank {last}: ValueError: own error in apply" in failed["msg"], failed["msg"]
        assert "out of step" not in failed["msg"], failed["msg"]
        assert sorted(failed["failures"]) == [last], failed["failures"]
        assert o.value["barrier"]["ok"], o.value["barrier"]


# ------------------------------------------------------------- one job per world size

CASES = {  # name -> (function, extra arguments)
    "decide-pair": (_out_of_step_pair, ()),
    "run-pair": (_run_out_of_step_pair, ()),
    "decide-in-step": (_in_step, ()),
    "run-in-step": (_run_in_step, ()),
    **{f"decide-stray-{stray}-{big}": (_stray_rank, (stray, big)) for stray, big in [(2, False), (1, True)]},
    **{f"run-stray-{stray}-{big}-{fail}": (_run_stray_rank, (stray, big, fail))
       for stray, big, fail in [(2, False, False), (1, True, False), (0, False, False), (2, False, True)]},
}


def _cases(rank, world, names):
    return {name: CASES[name][0](rank, world, *CASES[name][1]) for name in names}


def _job(world: int, names: list[str]) -> dict[str, list[SimpleNamespace]]:
    """Every case of ``names`` in one job: per case, each rank's outcome as the harness gives
    it (ok and value)."""
    out = dist_harness.run(_cases, world, names, timeout=140, env={"SAFECKPT_TIMEOUT": TIMEOUT})
    assert all(o.ok for o in out), [o.message for o in out]
    return {name: [SimpleNamespace(ok=True, value=o.value[name], message="") for o in out] for name in names}


@pytest.fixture(scope="module")
def world2() -> dict[str, list[SimpleNamespace]]:
    return _job(2, ["decide-pair", "run-pair", "decide-in-step", "run-in-step"])


@pytest.fixture(scope="module")
def world3() -> dict[str, list[SimpleNamespace]]:
    return _job(3, [name for name in CASES if "stray" in name or "in-step" in name])


MIXED_TIMEOUT = 10.0


def _run_against_decide(rank, world, decider):
    """Rank ``decider`` in decide('x'), the others in run('x'): different collectives (a gather
    and a broadcast against an all-gather), so no phase name can be compared."""
    from safeckpt.coord.dist import Coordinator

    coord = Coordinator()
    if rank == decider:
        got = dist_harness.attempt(lambda: coord.decide("x", lambda: rank, lambda values: values))
    else:
        got = _run(coord, "x", rank)
    after = _run(coord, "y", rank)
    return {"got": got, "after": after}


@pytest.mark.parametrize("world,decider", [(2, 1), (3, 0)])
def test_run_against_decide_fails_within_the_timeout(world, decider):
    """Not detected as out of step (the exchanges do not match, so neither side reads the
    other's phase): every rank's transport times out, so every rank raises RankFailure within
    the timeout, nothing is matched silently, and the group is poisoned (later calls fail at
    once instead of hanging)."""
    out = dist_harness.run(_run_against_decide, world, decider, timeout=120,
                           env={"SAFECKPT_TIMEOUT": str(MIXED_TIMEOUT)})
    assert all(o.ok for o in out), [o.message for o in out]
    for rank, o in enumerate(out):
        got = o.value["got"]
        assert not got["ok"], (rank, got)
        assert "RankFailure" in got["mro"], got
        assert got["elapsed"] < 3 * MIXED_TIMEOUT, got
        after = o.value["after"]
        assert not after["ok"] and "unusable since an earlier failure" in after["msg"], after
        assert after["elapsed"] < 1.0, after
