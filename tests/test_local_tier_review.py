"""Regression tests for the adversarial review of the node-local tier (issue 28), on real
processes: 2 simulated nodes x 1 rank (GROUP_RANK per rank, each node its own local_dir), gloo.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(120)


def _state(step: int, rank: int, tag: float = 0.0) -> dict:
    import safeckpt

    return {"w": torch.arange(64, dtype=torch.float32) * step + tag,
            "mine": safeckpt.PerRank(torch.full((4,), 100.0 * rank + step + tag)), "v": step}


def _job(rank: int, world: int, root: str, nodes_dir: str, plan: list, kw: dict) -> list:
    """Run ``plan`` on node ``rank`` (one rank per node): ("save", step[, tag]), ("nan", step),
    ("close"[, drain]), ("restore", expected step, expected tag), ("local", dir) (a new manager
    with another local_dir for this node). Returns what each op observed."""
    import safeckpt

    os.environ["GROUP_RANK"] = str(rank)
    opts = dict(durable_every=10, replicas=1, keep_last=None, check_finite=True, preemption_signals=(),
                timeout=20, **kw)

    def manager(local: str) -> safeckpt.CheckpointManager:
        return safeckpt.CheckpointManager(root, local_dir=os.path.join(nodes_dir, f"{local}{rank}"), **opts)

    mgr = manager("node")
    out: list = []
    for op in plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if op[0] == "local":
                    mgr = manager(op[1])
                    got = None
                elif op[0] in ("save", "nan"):
                    st = _state(op[1], rank, op[2] if len(op) > 2 else 0.0)
                    if op[0] == "nan" and rank == 1:
                        st["mine"].value[1] = float("nan")
                    mgr.save(op[1], st)
                    if op[0] == "save":
                        mgr.wait()
                    got = None
                elif op[0] == "quarantine":
                    mgr.quarantine(op[1], "loss spiked")
                    got = None
                elif op[0] == "wait":
                    got = mgr.wait() and None
                elif op[0] == "close":
                    mgr.close(drain=op[1] if len(op) > 1 else True)
                    got = None
                elif op[0] == "fail-publish":  # node 1 cannot publish its copy of this save
                    from safeckpt.engine.local_tier import NodeDir

                    plain = NodeDir.publish
                    if rank == 1:
                        def full(self, *a, **k):
                            raise OSError(28, "No space left on device")
                        NodeDir.publish = full
                    try:
                        mgr.save(op[1], _state(op[1], rank, op[2]))
                        mgr.wait()
                    finally:
                        NodeDir.publish = plain
                    got = None
                elif op[0] == "enospc":  # this node's disk is full from now on (its heal fails)
                    import safeckpt.engine.tier as tier

                    if rank == op[1]:
                        def nospace(*a, **k):
                            raise OSError(28, "No space left on device")
                        tier.write_bytes_atomic = nospace
                    got = None
                elif op[0] == "restore":
                    st = _state(0, rank)
                    got = mgr.restore(st, step=op[3] if len(op) > 3 else None)
                    exp = _state(got if got is not None else 0, rank, op[2] if len(op) > 2 else 0.0)
                    got = [got, torch.equal(st["w"], exp["w"]) and torch.equal(st["mine"].value, exp["mine"].value)]
                out.append([op[0], got, None])
            except Exception as exc:  # noqa: BLE001 - recorded
                out.append([op[0], None, f"{type(exc).__name__}: {exc}"])
        out[-1].append([str(w.message) for w in caught])
    return out


def _run(plan: list, tmp_path, world: int = 2, **kw) -> list:
    outs = dist_harness.run(_job, world, str(tmp_path / "root"), str(tmp_path / "nodes"), plan, kw, timeout=60)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
    return [o.value for o in outs]


def _root_steps(tmp_path) -> list[int]:
    root = tmp_path / "root"
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step-")) if root.is_dir() else []


def test_close_drains_the_newest_good_step_never_a_refused_one(tmp_path):
    """A step check_finite refused is never drained; close() drains the step before it (from the
    nodes' copies: the refused save reused the host buffers), whether wait() already raised the
    refusal or close() raises it; a restart from root alone restores the good step."""
    from safeckpt.cli import app as cli

    outs = _run([("save", 4), ("nan", 5), ("wait",), ("close",)], tmp_path / "a")
    for out in outs:
        assert out[2][2] and "check_finite" in out[2][2] and out[3][2] is None, out
    assert _root_steps(tmp_path / "a") == [4]
    assert cli.main(["verify", str(tmp_path / "a" / "root" / "step-0000000004")]) == 0

    outs = _run([("save", 9), ("nan", 10), ("close",), ("close",)], tmp_path / "b")  # 10: durable by number
    for out in outs:
        assert out[2][2] and "check_finite" in out[2][2] and out[3][2] is None, out
    assert _root_steps(tmp_path / "b") == [9]

    outs = _run([("local", "fresh"), ("restore", 9), ("close", False)], tmp_path / "b")  # root only
    assert all(out[1][1] == [9, True] for out in outs), outs


def test_a_restore_takes_roots_save_of_a_step_never_a_stale_node_copy(tmp_path):
    """Job 1 saves 10 (durable), 11, 12 on the nodes and dies; job 2 runs elsewhere (other
    local_dirs), resumes from root's 10, saves 11 and 12 again (other values) and closes (12
    drained); job 3 is back on the first nodes, which still hold job 1's 11 and 12: root's 12
    is the committed truth, restored with job 2's values, never job 1's copy."""
    _run([("save", 10), ("save", 11), ("save", 12), ("close", False)], tmp_path)
    outs = _run([("local", "other"), ("restore", 10), ("save", 11, 1000.0), ("save", 12, 1000.0), ("close",)],
                tmp_path)
    assert all(out[1][1] == [10, True] for out in outs), outs
    assert _root_steps(tmp_path) == [10, 12]
    outs = _run([("restore", 12, 1000.0), ("close", False)], tmp_path)
    assert all(out[0][1] == [12, True] for out in outs), outs
    stale = [p for p in (tmp_path / "nodes").glob("node*/run-*/step-0000000012")]
    assert stale == [], stale  # job 1's copies of 12 are removed by the restore from root


def test_a_save_after_a_rollback_wins_over_the_abandoned_history(tmp_path):
    """20 and 22 saved; a rollback to 20; 22 saved again (other values) but node 1 cannot
    publish its copy: a restore takes the new 22 (complete on node 0 with node 1's replica),
    never node 1's copy of the abandoned 22, which the first save after the rollback removed."""
    outs = _run([("save", 20), ("save", 22), ("restore", 20, 0.0, 20), ("fail-publish", 22, 1000.0),
                 ("restore", 22, 1000.0)], tmp_path)
    for out in outs:
        assert out[2][1] == [20, True] and out[3][2] is None and out[4][1] == [22, True], out


def test_holders_of_takes_roots_save_or_the_newest_never_a_mix():
    from safeckpt.engine.tier import holders_of

    def rec(h, sig, created, files):
        return {"manifest": h, "sig": sig, "created": created, "files": files, "all": ["a", "b"]}

    inv = {"n0": {"5": rec("old", "s-old", "2026-01-01T00:00:00", ["a", "b"])},
           "n1": {"5": rec("new", "s-new", "2026-01-02T00:00:00", ["b"])},
           "n2": {"5": rec("old", "s-old", "2026-01-01T00:00:00", ["a", "b"])}}
    plan = {"inv": inv, "root": [], "root_sigs": {}}
    assert holders_of(plan, 5) == ("new", ["a", "b"], {"b": ["n1"]})  # newest save, fewer copies
    plan = {"inv": inv, "root": [5], "root_sigs": {"5": "s-old"}}
    assert holders_of(plan, 5) == ("old", ["a", "b"], {"a": ["n0", "n2"], "b": ["n0", "n2"]})
    plan = {"inv": inv, "root": [5], "root_sigs": {"5": "s-root"}}
    assert holders_of(plan, 5)[0] is None  # root's own save: from root alone


def test_durable_every_drains_a_schedule_that_never_hits_a_multiple(tmp_path):
    """durable_every=10 with saves at 9, 19, 29, ...: the first save at or past each next
    multiple is durable (19, 29, 35, 41); multiples stay durable; after a restore the schedule goes
    on from the newest step root holds."""
    import safeckpt

    def mgr(local: str) -> safeckpt.CheckpointManager:
        return safeckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / local, durable_every=10,
                                          keep_last=None, preemption_signals=())

    m = mgr("l0")
    for s in (9, 19, 29, 35, 41, 43, 50, 51):
        m.save(s, {"w": torch.full((4,), float(s))})
        m.wait()
    assert _root_steps(tmp_path) == [19, 29, 35, 41, 50]
    m.close(drain=False)
    m = mgr("l1")  # a fresh node: root's 50
    assert m.restore({"w": torch.zeros(4)}) == 50
    for s in (53, 59, 61):
        m.save(s, {"w": torch.full((4,), float(s))})
        m.wait()
    assert _root_steps(tmp_path) == [19, 29, 35, 41, 50, 61]
    m.close(drain=False)


def test_healing_is_best_effort_and_a_restore_keeps_the_budget(tmp_path):
    """A node whose disk is full cannot keep the files it fetches: the step is restored (node 1,
    of one rank, loads them from the memory files it received them into) and the heal, after
    the restore, warns on that node, never a RankFailure. With local_max_bytes, a node healed
    after losing its directory keeps only what a save places there (its file and the replica it
    receives), within the budget; the other nodes still hold every file."""
    import shutil

    from safeckpt.engine.local_tier import dir_bytes

    _run([("save", 10), ("close", False)], tmp_path / "a")
    shutil.rmtree(tmp_path / "a" / "nodes" / "node1")
    outs = _run([("enospc", 1), ("restore", 10), ("close", False)], tmp_path / "a")
    for rank, out in enumerate(outs):
        assert out[1][1] == [10, True] and out[1][2] is None and out[2][2] is None, out
        healed = [w for w in out[2][3] if "could not keep" in w and "not healed" in w]  # close joins the heal
        assert len(healed) == (rank == 1), out
    assert not [n for n in os.listdir(tmp_path / "a" / "nodes" / "node1" / os.listdir(tmp_path / "a" / "nodes" / "node1")[0]
                                      / "step-0000000010") if n.startswith("rank-")]  # nothing half-kept

    _run([("save", 10), ("save", 11), ("close", False)], tmp_path / "b", world=3, keep_local=1)
    nodes = tmp_path / "b" / "nodes"
    budget = max(dir_bytes(str(nodes / f"node{i}")) for i in range(3)) + 64
    shutil.rmtree(nodes / "node1")
    outs = _run([("restore", 11), ("close", False)], tmp_path / "b", world=3, keep_local=1, local_max_bytes=budget)
    assert all(out[0][1] == [11, True] for out in outs), outs
    assert all(dir_bytes(str(nodes / f"node{i}")) <= budget for i in range(3))
    outs = _run([("local", "node"), ("restore", 11), ("close", False)], tmp_path / "b", world=3)  # still whole
    assert all(out[1][1] == [11, True] for out in outs), outs


def test_a_full_disk_on_heal_loads_a_local_only_step_from_memory(tmp_path):
    """Step 11 is on the local tier alone (root holds 10): node 1 lost its directory and its disk
    is full, so it cannot keep the files it fetches from node 0. They were verified on arrival
    and are loaded from memory: step 11 is restored, not the older 10, and node 1 stays unhealed."""
    import shutil

    _run([("save", 10), ("save", 11), ("close", False)], tmp_path)
    shutil.rmtree(tmp_path / "nodes" / "node1")
    outs = _run([("enospc", 1), ("restore", 11), ("close", False)], tmp_path)
    for rank, out in enumerate(outs):
        assert out[1][1] == [11, True] and out[1][2] is None and out[2][2] is None, out
        healed = [w for w in out[2][3] if "could not keep" in w and "not healed" in w]  # close joins the heal
        assert len(healed) == (rank == 1), out
    assert not (tmp_path / "root" / "step-0000000011").exists()
    from safeckpt.engine import held_files

    assert not held_files._HELD  # nothing held in this (the test's) process


def test_a_step_saved_again_after_its_quarantine_is_restored_from_the_local_tier(tmp_path):
    """Quarantine names the save it hides, on every tier: step 22 (local only) quarantined, the
    job rolls back to 21 (durable) and saves 22 again, another save: the restore takes the new
    22 from the nodes (also after one node is lost), never the quarantined one, never 21."""
    import shutil

    outs = _run([("save", 21), ("save", 22, 0.5), ("quarantine", 22), ("restore", 21), ("save", 22, 0.25),
                 ("close", False)], tmp_path)
    for out in outs:
        assert out[3][1] == [21, True], out
        assert [o[2] for o in out] == [None] * 6, out
    outs = _run([("restore", 22, 0.25), ("close", False)], tmp_path)
    for out in outs:
        assert out[0][1] == [22, True] and out[0][2] is None, out
    shutil.rmtree(tmp_path / "nodes" / "node1")
    outs = _run([("restore", 22, 0.25), ("close", False)], tmp_path)
    for out in outs:
        assert out[0][1] == [22, True] and out[0][2] is None, out
    # the quarantined save alone, in root too (the job drains it): still never picked
    outs = _run([("save", 23), ("quarantine", 23), ("restore", 22, 0.25), ("close", False)], tmp_path)
    for out in outs:
        assert out[2][1] == [22, True], out


def _two_orders(rank: int, world: int, root: str, nodes: str) -> list:
    """Two managers of one root with other local_dirs, made in opposite orders on the ranks."""
    import safeckpt

    os.environ["GROUP_RANK"] = str(rank)

    def mgr(local: str) -> safeckpt.CheckpointManager:
        return safeckpt.CheckpointManager(root, local_dir=os.path.join(nodes, f"{local}{rank}"), durable_every=None,
                                          replicas=1, keep_last=None, preemption_signals=(), timeout=20)

    a, b = (mgr("la"), mgr("lb")) if rank == 0 else tuple(reversed((mgr("lb"), mgr("la"))))
    a.save(1, _state(1, rank))
    a.wait()
    b.save(2, _state(2, rank))
    b.wait()
    out = []
    for m, step in ((a, 1), (b, 2)):
        st = _state(0, rank)
        got = m.restore(st)
        out.append([got, torch.equal(st["w"], _state(step, rank)["w"]), m.restored_path])
    a.close(drain=False)
    b.close(drain=False)
    return out


def test_managers_made_in_other_orders_on_the_ranks_agree_on_their_directories(tmp_path):
    """Rank 0 makes manager A then B, rank 1 B then A (same root, other local_dirs): each manager's
    tier URL is agreed at its first collective, so both save and restore their own steps."""
    outs = dist_harness.run(_two_orders, 2, str(tmp_path / "root"), str(tmp_path / "nodes"), timeout=90)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        (ga, oka, pa), (gb, okb, pb) = o.value
        assert (ga, oka, gb, okb) == (1, True, 2, True), o.value
        assert pa != pb
    assert [o.value[0][2] for o in outs] == [outs[0].value[0][2]] * 2  # the same URL on both ranks


def test_two_managers_of_one_root_with_other_local_dirs_in_one_process(tmp_path):
    """A second manager of the same root with another local_dir (one process) does not take
    over the first one's node directory: each restores its own steps."""
    import safeckpt

    def mgr(local: str) -> safeckpt.CheckpointManager:
        return safeckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / local, durable_every=None,
                                          keep_last=None, preemption_signals=())

    a, b = mgr("la"), mgr("lb")
    a.save(1, {"w": torch.full((4,), 1.0)})
    a.wait()
    b.save(2, {"w": torch.full((4,), 2.0)})
    b.wait()
    for m, step in ((a, 1), (b, 2)):
        st = {"w": torch.zeros(4)}
        assert m.restore(st) == step and st["w"][0].item() == float(step)
    assert a.restored_path != b.restored_path
    a.close(drain=False)
    b.close(drain=False)
