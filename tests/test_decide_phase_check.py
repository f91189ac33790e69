"""``Coordinator.decide`` checks that every rank is in the same phase.

Ranks out of step (one skipped or repeated a call) used to have their values matched silently:
rank 0 resolved the values of another call. Every rank now sends its phase's name with its
value, and a mismatch fails the phase on every rank (RankFailure naming the ranks and their
phases) without calling ``resolve``, at once instead of after the timeout.

Real processes (gloo on 127.0.0.1), each run under the harness's hard timeout.
"""

from __future__ import annotations

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


def test_rank_in_another_phase_fails_every_rank_at_once():
    out = dist_harness.run(_out_of_step_pair, 2, timeout=120, env={"SAFECKPT_TIMEOUT": TIMEOUT})
    assert all(o.ok for o in out), [o.message for o in out]
    for rank, o in enumerate(out):
        first = o.value["first"]
        assert not first["ok"], (rank, first)
        assert "RankFailure" in first["mro"] and "CheckpointError" in first["mro"], first
        assert "rank 1 is in phase 'b' while rank 0 is in 'a'" in first["msg"], first["msg"]
        assert "out of step (one rank skipped or repeated a call)" in first["msg"], first["msg"]
        assert sorted(first["failures"]) == [1], first["failures"]
        assert first["elapsed"] < QUICK, first
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
def test_non_coordinator_out_of_step_in_three_ranks(stray, big):
    out = dist_harness.run(_stray_rank, 3, stray, big, timeout=120, env={"SAFECKPT_TIMEOUT": TIMEOUT})
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
def test_matching_phases_still_decide(world):
    out = dist_harness.run(_in_step, world, timeout=120, env={"SAFECKPT_TIMEOUT": TIMEOUT})
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
