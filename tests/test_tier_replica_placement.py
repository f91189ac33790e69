"""replicas asked for but not placeable (one node: replica_targets caps at nodes - 1): one
warning, on every rank, at the first save; none when the nodes suffice. Real processes, gloo on
127.0.0.1, simulated nodes through GROUP_RANK."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(180)


def _job(rank: int, world: int, base: str, per_node: int, replicas: int) -> dict:
    import safeckpt

    os.environ["GROUP_RANK"] = str(rank // per_node)
    mgr = safeckpt.CheckpointManager(os.path.join(base, "root"), local_dir=os.path.join(base, f"n{rank // per_node}"),
                                     durable_every=None, replicas=replicas, preemption_signals=(), timeout=30)
    notes = []
    for step in (1, 2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(step, {"w": torch.full((8,), float(step)), "r": safeckpt.PerRank(torch.ones(2) * rank)})
            mgr.wait()
        notes.append([str(w.message) for w in caught if issubclass(w.category, safeckpt.SafeckptWarning)])
    mgr.close(drain=False)
    return {"notes": notes}


def test_replicas_on_one_node_warn_once_on_every_rank(tmp_path):
    outs = dist_harness.run(_job, 2, str(tmp_path), 2, 1, timeout=150)  # 2 ranks, one node
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        first, second = o.value["notes"]
        assert len(first) == 1 and "replicas=1, but the job runs on 1 node(s) (node-0): only 0" in first[0], first
        assert "a lost node loses" in first[0]
        assert second == [], second  # once


def test_enough_nodes_no_warning(tmp_path):
    outs = dist_harness.run(_job, 2, str(tmp_path), 1, 1, timeout=150)  # 2 nodes, replicas=1: placeable
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        assert o.value["notes"] == [[], []], o.value
    outs = dist_harness.run(_job, 2, str(tmp_path / "b"), 1, 2, timeout=150)  # 2 nodes, replicas=2: one
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        assert len(o.value["notes"][0]) == 1 and "replicas=2, but the job runs on 2 node(s)" in o.value["notes"][0][0]
