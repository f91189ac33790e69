"""Run identity of the node-local tier, on real processes (2 simulated nodes x 1 rank:
GROUP_RANK per rank, each node its own local_dir, gloo on 127.0.0.1): a new run at the same
root path (root deleted and made again) never restores the old run's local steps; a restart of
the same run always does, whether root still holds its steps, holds none of them, or cannot be
reached; local data of versions without run ids is adopted by the run upgrading.

Jobs "die" by returning without close(): nothing drains to root.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(240)

NODES = 2


def _state(step: int, rank: int, tag: float = 0.0) -> dict:
    import safeckpt

    return {"w": torch.arange(64, dtype=torch.float32) * step + tag,
            "mine": safeckpt.PerRank(torch.full((4,), 100.0 * rank + step + tag)), "v": step}


def _job(rank: int, world: int, root: str, nodes_dir: str, plan: list) -> list:
    """Run ``plan`` on node ``rank``: ("save", step[, tag]), ("restore"[, tag]) -> [step, bit-exact],
    ("unreachable",) / ("reachable",) (every read and write of root's storage fails / works)."""
    import safeckpt
    from safeckpt.errors import StorageError

    os.environ["GROUP_RANK"] = str(rank)
    mgr = safeckpt.CheckpointManager(root, local_dir=os.path.join(nodes_dir, f"node{rank}"), durable_every=10,
                                     replicas=1, keep_last=None, keep_local=3, preemption_signals=(), timeout=30)
    out: list = []
    for op in plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = None
            if op[0] == "save":
                mgr.save(op[1], _state(op[1], rank, op[2] if len(op) > 2 else 0.0))
                mgr.wait()
            elif op[0] == "restore":
                st = _state(0, rank)
                step = mgr.restore(st)
                exp = _state(step if step is not None else 0, rank, op[1] if len(op) > 1 else 0.0)
                got = [step, torch.equal(st["w"], exp["w"]) and torch.equal(st["mine"].value, exp["mine"].value)
                       and st["v"] == exp["v"]]
            elif op[0] == "unreachable":
                def down(*a, **k):
                    raise StorageError(f"{root}: endpoint unreachable (test)")

                for name in ("read", "list", "put", "read_manifest", "create", "touch"):
                    setattr(mgr._store, name, down)
            elif op[0] == "reachable":
                for name in ("read", "list", "put", "read_manifest", "create", "touch"):
                    mgr._store.__dict__.pop(name, None)
        out.append([op[0], got, [str(w.message) for w in caught]])
    return out


def _run(plan: list, root, nodes) -> list:
    outs = dist_harness.run(_job, NODES, str(root), str(nodes), plan, timeout=120)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
    return [o.value for o in outs]


def _run_dir(nodes, n: int, root) -> str:
    from safeckpt.engine.local_tier import tier_tag

    return os.path.join(nodes, f"node{n}", tier_tag(str(root)))


def _root_id(root) -> str:
    rec = json.loads((root / ".safeckpt-run.json").read_text())
    assert rec["format"] == "safeckpt-run" and len(rec["id"]) == 32, rec
    return rec["id"]


def _recorded(nodes, n: int, root, step: int | None = None) -> str | None:
    d = _run_dir(nodes, n, root)
    path = os.path.join(d, f"step-{step:010d}", "tier.json") if step is not None else os.path.join(d, "tier.json")
    return json.loads(open(path).read()).get("run_id")


def test_a_new_run_at_a_deleted_roots_path_never_restores_the_old_runs_local_steps(tmp_path):
    from safeckpt.engine.local_tier import describe, tier_tag

    root, nodes = tmp_path / "root", tmp_path / "nodes"
    # Run A: local-only steps 1 and 2 (durable_every=10), then it dies.
    _run([("save", 1), ("save", 2)], root, nodes)
    a_id = _root_id(root)
    assert not [n for n in os.listdir(root) if n.startswith("step-")]
    for n in range(NODES):
        assert _recorded(nodes, n, root) == a_id and _recorded(nodes, n, root, 2) == a_id
    # The user deletes the output directory and starts again: run B, same root path, same local_dirs.
    shutil.rmtree(root)
    outs = _run([("restore",), ("save", 3, 5.0), ("restore", 5.0)], root, nodes)
    b_id = _root_id(root)
    assert b_id != a_id
    tag = tier_tag(str(root))
    for n, o in enumerate(outs):
        (_, fresh, notes), (_, _, save_notes), (_, again, _) = o
        assert fresh == [None, True], o  # a fresh start, never A's step 2
        aside = os.path.join(nodes, f"node{n}", f"{tag}.other-{a_id}")
        moved = [w for w in notes if "another run of this root" in w]
        assert len(moved) == 1 and aside in moved[0] and "delete it to free the space" in moved[0], notes
        assert save_notes == [], save_notes
        assert again == [3, True], o  # B's own step
        # A's data moved aside, whole; B's run directory holds B's step alone, recorded as B's
        assert sorted(x for x in os.listdir(aside) if x.startswith("step-")) == ["step-0000000001",
                                                                                 "step-0000000002"]
        assert sorted(x for x in os.listdir(_run_dir(nodes, n, root)) if x.startswith("step-")) == [
            "step-0000000003"]
        assert _recorded(nodes, n, root) == b_id and _recorded(nodes, n, root, 3) == b_id
        # safeckpt ls LOCAL_DIR: the moved-aside directory belongs to no run
        runs = {os.path.basename(r["run"]): r for r in describe(str(nodes / f"node{n}"))}
        assert runs[tag]["moved_aside"] is False and runs[tag]["run_id"] == b_id
        assert runs[f"{tag}.other-{a_id}"]["moved_aside"] is True
    # A restart of B: its own step, and no further warning about A's data
    outs = _run([("restore", 5.0)], root, nodes)
    for o in outs:
        assert o[0][1] == [3, True] and not [w for w in o[0][2] if "another run" in w], o


def test_a_restart_restores_its_local_step_with_root_intact_or_emptied_of_steps(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    # Run A: step 10 durable, step 11 on the nodes only; it dies.
    _run([("save", 10, 1.0), ("save", 11, 2.0)], root, nodes)
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000010"]
    # (b) restart with root intact: the local-only 11, bit-exact
    outs = _run([("restore", 2.0)], root, nodes)
    for o in outs:
        assert o[0][1] == [11, True] and o[0][2] == [], o
    # (c) root's steps removed, its run file kept: still this run's; 11 from the nodes
    for name in os.listdir(root):
        if name.startswith("step-"):
            shutil.rmtree(root / name)
    outs = _run([("restore", 2.0)], root, nodes)
    for o in outs:
        assert o[0][1] == [11, True] and not [w for w in o[0][2] if "another run" in w], o


def test_an_unreachable_root_trusts_the_run_the_nodes_recorded(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    # Root unreachable from the first tier collective: a new id (no node records one, nothing to
    # warn about); it reaches root's run file with the first drain once root is back.
    outs = _run([("unreachable",), ("save", 1), ("reachable",), ("save", 10), ("save", 11, 3.0)], root, nodes)
    for o in outs:
        assert o[1][2] == [], o
    rid = _root_id(root)
    for n in range(NODES):
        assert _recorded(nodes, n, root) == rid and _recorded(nodes, n, root, 11) == rid
    # (d) a restart while root is unreachable: the nodes' run is trusted (one warning), local 11 restored
    outs = _run([("unreachable",), ("restore", 3.0), ("save", 12, 4.0), ("restore", 4.0)], root, nodes)
    for o in outs:
        (_, got, notes) = o[1]
        assert got == [11, True], o
        trusted = [w for w in notes if "could not be read" in w]
        assert len(trusted) == 1 and rid in trusted[0], notes
        assert not [w for w in notes if "another run" in w], notes
        assert o[3][1] == [12, True], o
    assert _root_id(root) == rid


def test_legacy_local_data_is_adopted_by_a_root_with_steps_and_no_run_file(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    _run([("save", 10, 1.0), ("save", 11, 2.0)], root, nodes)

    def make_legacy() -> None:  # as an older version wrote it: no run ids, no run file
        os.unlink(root / ".safeckpt-run.json")
        for n in range(NODES):
            d = _run_dir(nodes, n, root)
            for path in [os.path.join(d, "tier.json")] + [os.path.join(d, s, "tier.json") for s in os.listdir(d)
                                                           if s.startswith("step-")]:
                rec = json.loads(open(path).read())
                rec.pop("run_id")
                open(path, "w").write(json.dumps(rec))

    make_legacy()
    # (e) root holds committed steps and no run file: an existing run upgrading; its local 11 is used
    outs = _run([("restore", 2.0)], root, nodes)
    for o in outs:
        assert o[0][1] == [11, True] and not [w for w in o[0][2] if "another run" in w], o
    rid = _root_id(root)
    for n in range(NODES):
        assert _recorded(nodes, n, root) == rid and _recorded(nodes, n, root, 11) == rid
    # Legacy data beside an empty root (deleted and made again): another run's, moved aside
    make_legacy()
    shutil.rmtree(root)
    outs = _run([("restore",)], root, nodes)
    for n, o in enumerate(outs):
        assert o[0][1] == [None, True], o
        moved = [w for w in o[0][2] if "another run of this root" in w]
        assert len(moved) == 1 and ".other-legacy" in moved[0], o
        assert not os.path.exists(_run_dir(nodes, n, root))


def test_a_run_that_never_reached_root_is_the_same_run_at_its_restart(tmp_path):
    """Run A's root is unreachable from its first tier collective on (its id agreed by the
    nodes, unconfirmed) and A dies before any drain: the restart, with root back and no run
    file there, adopts A's id (the run had never reached root: not a deleted root) and restores
    A's local step; a later new run after root's deletion is another run again."""
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    _run([("unreachable",), ("save", 1, 1.0), ("save", 2, 2.0)], root, nodes)
    ids = {_recorded(nodes, n, root) for n in range(NODES)}
    assert len(ids) == 1 and None not in ids
    (a_id,) = ids
    for n in range(NODES):
        assert json.loads(open(os.path.join(_run_dir(nodes, n, root), "tier.json")).read())["unconfirmed"] is True
    outs = _run([("restore", 2.0)], root, nodes)
    for o in outs:
        (_, got, notes), = o
        assert got == [2, True], o
        assert not [w for w in notes if "another run" in w], notes
    assert _root_id(root) == a_id  # root's run file names A now: confirmed
    for n in range(NODES):
        assert "unconfirmed" not in json.loads(open(os.path.join(_run_dir(nodes, n, root), "tier.json")).read())
    shutil.rmtree(root)  # now a deleted root means another run
    outs = _run([("restore",)], root, nodes)
    for o in outs:
        (_, got, notes), = o
        assert got == [None, True] and [w for w in notes if "another run" in w], o


def _adopt_fails(rank: int, world: int, root: str, local: str, fail: bool) -> list:
    """One node of 2 ranks; with ``fail`` its first rank cannot move another run's data aside."""
    import safeckpt

    os.environ["GROUP_RANK"] = "0"
    mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=10, keep_last=None, preemption_signals=(),
                                     timeout=20)
    out: list = []
    real = os.rename
    if fail and rank == 0:
        def bad(a, b, *k, **kw):  # noqa: ANN001, ANN002, ANN003
            if ".other-" in str(b):
                raise OSError(5, "Input/output error (test)")
            return real(a, b, *k, **kw)

        os.rename = bad
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.append(["restore", mgr.restore(_state(0, rank))])
    except Exception as exc:  # noqa: BLE001 - recorded
        out.append(["restore raised", type(exc).__name__])
    os.rename = real
    try:
        mgr.save(1, _state(1, rank, 3.0))
        mgr.wait()
        out.append(["save", True])
    except Exception as exc:  # noqa: BLE001 - recorded
        out.append(["save raised", type(exc).__name__])
    return out


def _restart(rank: int, world: int, root: str, local: str) -> list:
    import safeckpt

    os.environ["GROUP_RANK"] = "0"
    mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=10, preemption_signals=(), timeout=20)
    st = _state(0, rank)
    got = mgr.restore(st)
    return [got, torch.equal(st["w"], _state(1, rank, 3.0)["w"])]


def test_a_failed_move_aside_leaves_every_rank_to_agree_again(tmp_path):
    """Another run's data on a node of 2 ranks cannot be moved aside (EIO) at the restore: every
    rank raises, and none keeps the half-agreed run id, so the next save agrees again on every
    rank (no rank skips the agreement), moves the data aside, and its step is this run's."""
    root, local = tmp_path / "root", tmp_path / "local"
    for o in dist_harness.run(_adopt_fails, 2, str(root), str(local), False, timeout=100):
        assert o.ok, (o.rank, o.error_type, o.message)
    shutil.rmtree(root)  # a new run at the same root path
    outs = dist_harness.run(_adopt_fails, 2, str(root), str(local), True, timeout=100)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        assert o.value[0] == ["restore raised", "RankFailure"] and o.value[1] == ["save", True], o.value
    assert len([n for n in os.listdir(local) if ".other-" in n]) == 1  # the old run's data, moved aside whole
    for o in dist_harness.run(_restart, 2, str(root), str(local), timeout=100):
        assert o.ok, (o.rank, o.error_type, o.message)
        assert o.value == [1, True], o.value
