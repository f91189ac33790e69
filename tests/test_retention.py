"""RetentionPolicy: pure rules, no I/O (SPEC behaviour 6; BZ-29, BZ-28)."""

from __future__ import annotations

import itertools
import math

import pytest

from safeckpt import RetentionPolicy


def ck(*steps, metric=None, **by_step):
    """[(step, metrics)] for steps; ``by_step`` maps 's<step>' to that step's metric value."""
    out = []
    for s in steps:
        v = by_step.get(f"s{s}", None)
        out.append((s, {} if v is None else {metric or "loss": v}))
    return out


def test_keep_last_keeps_newest_n():
    p = RetentionPolicy(keep_last=2)
    cps = ck(1, 2, 3, 4, 5)
    assert p.keep(cps) == {4, 5}
    assert p.delete(cps) == [1, 2, 3]


def test_keep_last_order_independent_and_numeric():
    # Input order and string-sorting traps (9 vs 10 vs 100) must not matter.
    p = RetentionPolicy(keep_last=2)
    cps = [(100, {}), (9, {}), (10, {}), (2, {})]
    assert p.keep(cps) == {10, 100}
    assert p.delete(cps) == [2, 9]


def test_keep_last_none_keeps_everything():
    p = RetentionPolicy(keep_last=None)
    cps = ck(1, 2, 3, 4)
    assert p.keep(cps) == {1, 2, 3, 4}
    assert p.delete(cps) == []
    # whatever other rules say
    p = RetentionPolicy(keep_last=None, keep_best=1, best_metric="loss", keep_every=10)
    assert p.delete(ck(1, 2, 3, s1=0.5, s2=0.1, s3=0.9)) == []


def test_empty_and_single():
    for p in (RetentionPolicy(keep_last=1), RetentionPolicy(keep_last=None),
              RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")):
        assert p.keep([]) == set()
        assert p.delete([]) == []
        assert p.delete([(7, {})]) == []


def test_keep_last_larger_than_count():
    p = RetentionPolicy(keep_last=10)
    assert p.delete(ck(1, 2, 3)) == []


def test_keep_best_min_keeps_oldest_best_and_newest():
    # BZ-29: keep_last=1 + keep_best where the oldest is best: newest AND best survive.
    p = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss", best_mode="min")
    cps = ck(1, 2, 3, 4, s1=0.1, s2=0.5, s3=0.4, s4=0.9)
    assert p.keep(cps) == {1, 4}
    assert p.delete(cps) == [2, 3]


def test_keep_best_when_newest_is_best():
    # BZ-29 second half: best == newest must not shrink below one checkpoint nor delete it.
    p = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    cps = ck(1, 2, 3, s1=0.5, s2=0.4, s3=0.1)
    assert p.keep(cps) == {3}
    assert p.delete(cps) == [1, 2]


def test_keep_best_max_mode():
    p = RetentionPolicy(keep_last=1, keep_best=2, best_metric="acc", best_mode="max")
    cps = ck(1, 2, 3, 4, 5, metric="acc", s1=0.9, s2=0.3, s3=0.95, s4=0.5, s5=0.1)
    assert p.keep(cps) == {1, 3, 5}
    # the same numbers in min mode pick the other end
    p_min = RetentionPolicy(keep_last=1, keep_best=2, best_metric="acc", best_mode="min")
    assert p_min.keep(cps) == {2, 5}


def test_keep_best_ignores_missing_nan_and_non_numeric_metrics():
    p = RetentionPolicy(keep_last=1, keep_best=2, best_metric="loss")
    cps = [
        (1, {}),                      # no metrics at all
        (2, {"loss": float("nan")}),  # NaN never counts as best (min or max)
        (3, {"other": 0.0}),          # other metric only
        (4, {"loss": "0.01"}),        # a string is not a number
        (5, {"loss": True}),          # a bool is not a metric value
        (6, {"loss": 0.7}),
        (7, {"loss": 0.3}),
        (8, None),                    # metrics may be None
        (9, {}),
    ]
    assert p.keep(cps) == {6, 7, 9}
    p_max = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss", best_mode="max")
    assert p_max.keep(cps) == {6, 9}


def test_keep_best_with_no_scored_checkpoint_falls_back_to_other_rules():
    p = RetentionPolicy(keep_last=2, keep_best=3, best_metric="loss")
    cps = [(1, {"loss": math.nan}), (2, {}), (3, {}), (4, {})]
    assert p.keep(cps) == {3, 4}


def test_keep_best_ties_are_deterministic():
    p = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    cps = ck(1, 2, 3, 4, s1=0.2, s2=0.2, s3=0.2, s4=0.9)
    kept = p.keep(cps)
    assert len(kept) == 2 and 4 in kept
    assert p.keep(list(reversed(cps))) == kept


def test_keep_best_int_and_inf_metrics():
    p = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    cps = [(1, {"loss": 3}), (2, {"loss": float("-inf")}), (3, {"loss": 1}), (4, {"loss": 10})]
    assert p.keep(cps) == {2, 4}


def test_keep_every():
    p = RetentionPolicy(keep_last=1, keep_every=3)
    cps = ck(*range(1, 11))
    assert p.keep(cps) == {3, 6, 9, 10}
    assert p.delete(cps) == [1, 2, 4, 5, 7, 8]
    # step 0 is divisible by everything
    assert 0 in RetentionPolicy(keep_last=1, keep_every=5).keep(ck(0, 1, 2))


def test_rules_combine_as_union():
    p = RetentionPolicy(keep_last=2, keep_best=1, best_metric="loss", keep_every=4)
    cps = ck(*range(1, 10), s1=0.05, **{f"s{s}": 1.0 / s for s in range(2, 10)})
    # newest two {8, 9}, best {1}, every 4th {4, 8}
    assert p.keep(cps) == {1, 4, 8, 9}
    assert p.delete(cps) == [2, 3, 5, 6, 7]


def test_protect_keeps_restored_checkpoint():
    # BZ-28: the checkpoint a run restored from is never deleted by that run.
    p = RetentionPolicy(keep_last=1)
    cps = ck(1, 2, 3, 4)
    assert p.keep(cps, protect={2}) == {2, 4}
    assert p.delete(cps, protect=[2]) == [1, 3]
    # protecting a step that is not among the checkpoints adds nothing
    assert p.keep(cps, protect={99}) == {4}
    # with everything protected nothing is deleted
    assert p.delete(cps, protect={1, 2, 3, 4}) == []


def test_newest_always_kept_and_never_zero():
    # Exhaustive over small configurations: the newest survives, deletions are a subset of the
    # input, kept and deleted partition the input, and at least keep_last survive.
    policies = [RetentionPolicy(keep_last=None)] + [
        RetentionPolicy(keep_last=k, keep_best=b, best_metric="loss" if b else None,
                        best_mode=m, keep_every=e)
        for k, b, m, e in itertools.product([1, 2, 3], [None, 1, 2], ["min", "max"], [None, 2, 5])
    ]
    metric_seqs = [
        [0.5, 0.4, 0.3, 0.2, 0.1, 0.05],
        [0.05, 0.1, 0.2, 0.3, 0.4, 0.5],
        [float("nan"), None, 0.3, None, float("nan"), None],
        [None] * 6,
    ]
    for p in policies:
        for seq in metric_seqs:
            for n in range(1, 7):
                steps = [10 * (i + 1) + 1 for i in range(n)]
                cps = [(s, {} if v is None else {"loss": v}) for s, v in zip(steps, seq)]
                for protect in (set(), {steps[0]}):
                    kept = p.keep(cps, protect)
                    deleted = p.delete(cps, protect)
                    assert steps[-1] in kept, (p, cps)
                    assert protect <= kept
                    assert set(deleted) | kept == set(steps)
                    assert not set(deleted) & kept
                    assert deleted == sorted(deleted)
                    if p.keep_last is not None:
                        assert set(steps[-p.keep_last:]) <= kept


@pytest.mark.parametrize("kwargs", [
    {"keep_last": 0},
    {"keep_last": -1},
    {"keep_last": 1.5},
    {"keep_last": "3"},
    {"keep_last": True},
    {"keep_best": 0, "best_metric": "loss"},
    {"keep_best": -2, "best_metric": "loss"},
    {"keep_best": 1},                      # keep_best without best_metric
    {"keep_best": 1, "best_metric": ""},
    {"keep_every": 0},
    {"keep_every": -5},
    {"keep_every": 2.0},
    {"best_mode": "avg"},
    {"best_mode": "MIN"},
    {"keep_best": 1, "best_metric": "loss", "best_mode": None},
])
def test_invalid_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        RetentionPolicy(**kwargs)


def test_invalid_arguments_raise_value_error_through_manager(tmp_path):
    import safeckpt

    with pytest.raises(ValueError):
        safeckpt.CheckpointManager(tmp_path, keep_last=0, preemption_signals=())
    with pytest.raises(ValueError):
        safeckpt.CheckpointManager(tmp_path, keep_best=2, preemption_signals=())
    with pytest.raises(ValueError):
        safeckpt.CheckpointManager(tmp_path, best_mode="maximum", preemption_signals=())
    assert list(tmp_path.iterdir()) == []  # constructing (even failing) writes nothing
