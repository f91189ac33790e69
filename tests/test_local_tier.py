"""The node-local tier with peer replicas (issue 28), on real processes: 3 simulated nodes x 2
ranks (GROUP_RANK set per rank, each node with its own local_dir), gloo on 127.0.0.1.

Jobs "die" by returning without close(): nothing drains to root, as when a job is killed
after its last local save (the background save is waited for, as a job killed later would
have finished it).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

from tests.helpers import dist_harness

NODES, PER_NODE = 3, 2
WORLD = NODES * PER_NODE
pytestmark = pytest.mark.timeout(240)


def _state(step: int, rank: int) -> dict:
    import safeckpt

    return {
        "w": torch.arange(257, dtype=torch.float32) * step,      # replicated: bytes spread over the files
        "b": torch.full((33,), float(step), dtype=torch.float64),
        "mine": safeckpt.PerRank(torch.full((5,), float(100 * rank + step))),
        "v": step,
    }


def _same(a: dict, b: dict) -> bool:
    return (torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
            and torch.equal(a["mine"].value, b["mine"].value) and a["v"] == b["v"])


def _job(rank: int, world: int, root: str, nodes_dir: str, plan: list, per_node: int = PER_NODE) -> dict:
    """Run ``plan``: ("save", step[, wait]), ("restore", expected or None), ("close",),
    ("quarantine", step), ("nan", step). Returns what each step observed."""
    import safeckpt

    node = rank // per_node
    os.environ["GROUP_RANK"] = str(node)
    local = os.path.join(nodes_dir, f"node{node}")
    out: dict = {"restored": [], "warnings": [], "errors": []}
    mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=10, replicas=1, keep_last=None,
                                     check_finite=True, preemption_signals=(), timeout=30)
    for op in plan:
        if op[0] == "save":
            mgr.save(op[1], _state(op[1], rank))
            mgr.wait()
        elif op[0] == "nan":
            st = _state(op[1], rank)
            if rank == 1:
                st["mine"].value[3] = float("nan")
            mgr.save(op[1], st)
            try:
                mgr.wait()
                out["errors"].append(None)
            except safeckpt.CheckpointError as exc:
                out["errors"].append(f"{type(exc).__name__}: {exc}")
        elif op[0] == "restore":
            st = _state(0, rank)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = mgr.restore(st)
            out["warnings"] += [str(w.message) for w in caught]
            exp = op[1]
            out["restored"].append([got, exp is None or _same(st, _state(exp, rank))])
        elif op[0] == "quarantine":
            mgr.quarantine(op[1], "loss spiked")
        elif op[0] == "close":
            mgr.close()
    return out


def _run(plan: list, root, nodes_dir, world: int = WORLD, per_node: int = PER_NODE) -> list[dict]:
    outs = dist_harness.run(_job, world, str(root), str(nodes_dir), plan, per_node, timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
    return [o.value for o in outs]


def _step_dir(nodes_dir, node: int, step: int) -> str:
    base = os.path.join(nodes_dir, f"node{node}")
    (run,) = [n for n in os.listdir(base) if n.startswith("run-")]
    return os.path.join(base, run, f"step-{step:010d}")


def test_lost_node_restores_from_peers_without_root_and_a_bad_primary_is_resourced(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    # Job 1: step 10 durable (root), steps 11 and 12 on the local tier only; then it dies.
    _run([("save", 10), ("save", 11), ("save", 12)], root, nodes)
    assert sorted(os.listdir(root)) == ["step-0000000010"]
    for n in range(NODES):  # each node: its own 2 files + the 2 replicas of the previous node's
        rec = json.loads(open(os.path.join(_step_dir(nodes, n, 12), "tier.json")).read())
        prev = (n - 1) % NODES
        assert rec["own"] == [f"rank-{r:05d}.safetensors" for r in (2 * n, 2 * n + 1)]
        assert rec["replicas"] == [f"rank-{r:05d}.safetensors" for r in (2 * prev, 2 * prev + 1)]
    # Node 2 is lost (its directory wiped); root is gone too: step 12 must come from the nodes.
    shutil.rmtree(nodes / "node2")
    shutil.rmtree(root)
    # and one primary on node 0 has a flipped byte: that file alone is re-sourced (from node 1's replica)
    bad = os.path.join(_step_dir(nodes, 0, 12), "rank-00001.safetensors")
    data = bytearray(open(bad, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    outs = _run([("restore", 12)], root, nodes)
    for o in outs:
        assert o["restored"] == [[12, True]], o
    for o in outs:  # said on every rank, about that file alone
        bad_notes = [w for w in o["warnings"] if "failed verification" in w]
        assert bad_notes == ["restore of step 12: the copy of rank-00001.safetensors on node-0 failed "
                             "verification; taking it from another copy"], o["warnings"]
    # Every node now holds every file of step 12 again, verified (node 0's bad copy replaced).
    good = open(os.path.join(_step_dir(nodes, 1, 12), "rank-00001.safetensors"), "rb").read()
    assert open(bad, "rb").read() == good
    assert sorted(f for f in os.listdir(_step_dir(nodes, 2, 12)) if f.startswith("rank-")) == [
        f"rank-{r:05d}.safetensors" for r in range(WORLD)]
    assert not root.exists()  # nothing was read from (or written to) root


def test_root_is_used_where_no_node_holds_a_file_and_close_drains(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    # steps 10 (durable), 11 (local); close drains 11 to root.
    _run([("save", 10), ("save", 11), ("close",)], root, nodes)
    assert sorted(os.listdir(root)) == ["step-0000000010", "step-0000000011"]
    import safeckpt

    assert safeckpt.verify(str(root / "step-0000000011")).ok
    # Nodes 1 and 2 lost: node 0 holds files 0, 1 and the replicas of node 2 (4, 5); 2 and 3 come from root.
    shutil.rmtree(nodes / "node1")
    shutil.rmtree(nodes / "node2")
    outs = _run([("restore", 11)], root, nodes)
    for o in outs:
        assert o["restored"] == [[11, True]], o
    # World-size change: 2 ranks on one node restore the same step (files from node 0 and root).
    outs = _run([("restore", 11)], root, nodes, world=2, per_node=2)
    for o in outs:
        assert o["restored"] == [[11, None]] or o["restored"][0][0] == 11, o


def test_other_runs_local_data_is_ignored(tmp_path):
    nodes = tmp_path / "nodes"
    _run([("save", 10), ("save", 11)], tmp_path / "rootA", nodes)
    # Another root with the same local_dirs: a fresh run (nothing of run A is used) ...
    outs = _run([("restore", None), ("save", 1), ("restore", 1)], tmp_path / "rootB", nodes)
    for o in outs:
        assert o["restored"] == [[None, True], [1, True]], o
    # ... and a copy of run A's data dressed up under run B's directory name is refused too.
    for n in range(NODES):
        base = nodes / f"node{n}"
        runs = sorted(os.listdir(base))
        a = next(r for r in runs if os.path.exists(base / r / "step-0000000011"))
        b = next(r for r in runs if r != a)
        shutil.copytree(base / a / "step-0000000011", base / b / "step-0000000011")
    outs = _run([("restore", 1)], tmp_path / "rootB", nodes)
    for o in outs:
        assert o["restored"] == [[1, True]], o


def test_check_finite_refuses_and_quarantine_hides(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    outs = _run([("save", 10), ("save", 11), ("nan", 12), ("quarantine", 11), ("restore", 10)], root, nodes)
    for o in outs:
        assert o["errors"][0] is not None and "NaN/Inf in mine" in o["errors"][0], o
        assert o["restored"] == [[10, True]], o
    for n in range(NODES):
        assert not os.path.exists(_step_dir(nodes, n, 12))
    # quarantine reaches root too: a manager without a local tier skips the step there
    q = json.loads((root / ".safeckpt-quarantine.json").read_text())
    assert q == {"11": "loss spiked"}
