"""A restore from the node-local tier moves only what each node's ranks load and what a save
places there: a node lost from an FSDP-style job (every tensor sharded, the same world size)
gets back its own ranks' files and the replicas it held, nothing else, and the surviving nodes
fetch nothing, so a restore's bytes per node do not
grow with the world size. Real processes: 4 simulated nodes x 1 rank (GROUP_RANK per rank,
each node with its own local_dir), gloo on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(240)
WORLD = 4


def _job(rank: int, world: int, root: str, nodes_dir: str) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import safeckpt

    os.environ["GROUP_RANK"] = str(rank)  # one rank per node
    mesh = init_device_mesh("cpu", (world,))

    def state(v: float) -> dict:
        full = torch.arange(64 * 33, dtype=torch.float32).reshape(64, 33) * v
        return {"d": distribute_tensor(full, mesh, [Shard(0)]), "mine": safeckpt.PerRank(torch.full((7,), v + rank))}

    local = os.path.join(nodes_dir, f"node{rank}")
    with safeckpt.CheckpointManager(root, local_dir=local, durable_every=None, replicas=1,
                                    preemption_signals=()) as m:
        m.save(3, state(3.0))
        m.wait()
        m._last = None  # the job "dies": nothing drained to root
    dist.barrier()
    if rank == 2:  # node 2 lost
        shutil.rmtree(local)
    dist.barrier()
    st = state(0.0)
    with safeckpt.CheckpointManager(root, local_dir=local, durable_every=None, replicas=1,
                                    preemption_signals=()) as m:
        got = m.restore(st)
    want = state(3.0)
    ok = torch.equal(st["d"].to_local(), want["d"].to_local()) and torch.equal(st["mine"].value, want["mine"].value)
    return [got, ok]


def _files(nodes, n: int) -> list[str]:
    d = nodes / f"node{n}"
    (run,) = [x for x in os.listdir(d) if x.startswith("run-")]
    step = d / run / "step-0000000003"
    return sorted(f for f in os.listdir(step) if f.startswith("rank-"))


def test_a_lost_node_fetches_only_what_its_ranks_load_and_what_a_save_placed_there(tmp_path):
    nodes = tmp_path / "nodes"
    outs = dist_harness.run(_job, WORLD, str(tmp_path / "root"), str(nodes), timeout=180)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        got, ok = o.value
        assert got == 3 and ok, o.value
    man = json.loads(open(nodes / "node0" / [x for x in os.listdir(nodes / "node0") if x.startswith("run-")][0]
                          / "step-0000000003" / "manifest.json").read())
    assert all(rec["scope"] in ("sharded", "per_rank") for rec in man["tensors"].values()), man["tensors"]
    # Node 2 lost everything; it got back what the save had placed there (its rank's file and
    # the replica of node 1's), nothing else; the surviving nodes fetched nothing.
    for n in range(WORLD):
        held = _files(nodes, n)
        assert held == sorted([f"rank-{n:05d}.safetensors", f"rank-{(n - 1) % WORLD:05d}.safetensors"]), (n, held)
    root = tmp_path / "root"  # never drained: the restore had nothing but the nodes' copies
    assert not root.exists() or not [x for x in os.listdir(root) if x.startswith("step-")]
