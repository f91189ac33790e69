"""Issue 28's loss patterns not covered by tests/test_local_tier.py, on real processes (gloo,
simulated nodes with their own local_dir): two lost nodes that hold no replica of each other
(every file still on a peer), and a root newer than every node's local steps.

Reuses test_local_tier's job (``_run``: a plan of saves, restores, closes per rank).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.test_local_tier import _root_away, _run, _step_dir

pytestmark = pytest.mark.timeout(240)


def test_two_lost_nodes_that_hold_no_replica_of_each_other_restore_from_peers(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    # 4 nodes x 1 rank, replicas=1: each node's file also on one other node. Step 10 is
    # durable, 11 only on the nodes; then the job dies without draining.
    _run([("save", 10), ("save", 11)], root, nodes, world=4, per_node=1)
    holders = {}
    for n in range(4):
        for name in os.listdir(_step_dir(nodes, n, 11)):
            if name.startswith("rank-"):
                holders.setdefault(name, set()).add(n)
    # Two nodes neither of which holds the other's file: both lost, every file still on a peer.
    lost = next((a, b) for a in range(4) for b in range(a + 1, 4)
                if not ({a, b} >= holders[f"rank-{a:05d}.safetensors"]
                        or {a, b} >= holders[f"rank-{b:05d}.safetensors"]))
    assert all(len(h - set(lost)) >= 1 for h in holders.values()), (holders, lost)
    for n in lost:
        shutil.rmtree(nodes / f"node{n}")
    # and root's checkpoints are gone (its run identity kept): step 11 can only come from the
    # surviving peers
    _root_away(root, tmp_path / "root-away")
    outs = _run([("restore", 11)], root, nodes, world=4, per_node=1)
    for o in outs:
        assert o["restored"] == [[11, True]], o
    assert os.listdir(root) == [".safeckpt-run.json"]


def test_root_newer_than_the_local_steps_wins_and_older_root_loses(tmp_path):
    root, nodes, other_nodes = tmp_path / "root", tmp_path / "nodes", tmp_path / "other-nodes"
    # Job 1 on `nodes`: 10 durable, 11 and 12 local only (dies without draining).
    _run([("save", 10), ("save", 11), ("save", 12)], root, nodes)
    # Job 2 runs elsewhere (other local dirs): restores 10 from root (its nodes are empty; root
    # is older than job 1's local steps but job 2 cannot see them), trains on to 20 (durable).
    _run([("restore", 10), ("save", 20)], root, other_nodes)
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000010", "step-0000000020"]
    # Job 3 back on `nodes`: root's 20 is newer than the local 12, so 20 is restored.
    outs = _run([("restore", 20)], root, nodes)
    for o in outs:
        assert o["restored"] == [[20, True]], o
    # With 20 quarantined, the local 12 (newer than root's 10) is restored, from the nodes.
    outs = _run([("quarantine", 20), ("restore", 12)], root, nodes)
    for o in outs:
        assert o["restored"] == [[12, True]], o
