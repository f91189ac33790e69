"""A quarantine mark names the save it hid: a later save of the same step number (a job that
rolled back and saved that step again) is restorable; an older version's mark (a plain reason)
still hides any save of its step. Plain manager, 2 ranks, gloo on 127.0.0.1."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(180)


def _job(rank: int, world: int, root: str) -> dict:
    import safeckpt

    def state(v: float) -> dict:
        return {"w": torch.full((16,), v), "r": safeckpt.PerRank(torch.full((2,), v + rank))}

    def restore() -> list:
        st = state(-1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = mgr.restore(st)
        return [got, float(st["w"][0]), [str(w.message) for w in caught if "quarantined" in str(w.message)]]

    out: dict = {}
    mgr = safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=(), timeout=30)
    mgr.save(5, state(5.0))
    mgr.save(10, state(10.0))  # a bad step
    mgr.quarantine(10, "loss spike")
    out["after_mark"] = restore()
    mgr.save(10, state(100.0))  # rolled back to 5, trained on, saved step 10 again: a good one
    out["resaved"] = restore()
    mgr.close()
    mgr = safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=(), timeout=30)
    out["new_manager"] = restore()
    if rank == 0:
        out["cli"] = _ls(root)
    mgr.close()
    return out


def _ls(root: str) -> str:
    import contextlib
    import io

    from safeckpt.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["ls", root])
    return buf.getvalue()


def _old_style(rank: int, world: int, root: str) -> list:
    import safeckpt

    mgr = safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=(), timeout=30)
    st = {"w": torch.zeros(16), "r": safeckpt.PerRank(torch.zeros(2))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = mgr.restore(st)
    mgr.close()
    return [got, float(st["w"][0])]


def test_a_resaved_step_is_not_hidden_by_the_mark_of_its_earlier_save(tmp_path):
    root = str(tmp_path / "root")
    outs = dist_harness.run(_job, 2, root, timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        v = o.value
        assert v["after_mark"][:2] == [5, 5.0] and "skipping step 10: quarantined (loss spike)" in \
            v["after_mark"][2][0], v
        assert v["resaved"] == [10, 100.0, []], v
        assert v["new_manager"] == [10, 100.0, []], v
    rec = json.loads(open(os.path.join(root, ".safeckpt-quarantine.json")).read())
    assert rec["10"]["reason"] == "loss spike" and len(rec["10"]["sigs"]) == 1, rec
    line10 = next(ln for ln in outs[0].value["cli"].splitlines() if "step-0000000010" in ln)
    assert "quarantined" not in line10, outs[0].value["cli"]
    # an older version's mark (a plain reason) hides any save of the step: 5 is restored
    with open(os.path.join(root, ".safeckpt-quarantine.json"), "w") as f:
        json.dump({"10": "marked by an old version"}, f)
    for o in dist_harness.run(_old_style, 2, root, timeout=150):
        assert o.ok, (o.rank, o.error_type, o.message)
        assert o.value == [5, 5.0], o.value


def test_hidden_by():
    from safeckpt.engine.local_tier import hidden_by, quarantine_entries, quarantine_mark

    marks = quarantine_entries({"3": "old", "4": quarantine_mark("bad", ["a", "b"]), "5": quarantine_mark("x", [])})
    assert hidden_by(marks, 3, "z") == "old"  # an old mark hides every save
    assert hidden_by(marks, 4, "a") == "bad" and hidden_by(marks, 4, "c") is None
    assert hidden_by(marks, 4, None) == "bad"  # an unknown save: treated as the one marked
    assert hidden_by(marks, 5, "q") == "x"  # a mark that names no save hides any
    assert hidden_by(marks, 6, "a") is None
