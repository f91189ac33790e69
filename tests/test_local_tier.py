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
from pathlib import Path

import pytest
import torch

from safeckpt.engine.local_tier import SCHEME
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
    """Run ``plan``: ("save", step), ("restore", expected step or None), ("close",),
    ("quarantine", step), ("nan", step) (rank 1's per-rank tensor holds a NaN), ("root", path)
    (a new manager on another root, same local_dir). Returns what each step observed."""
    import safeckpt

    node = rank // per_node
    os.environ["GROUP_RANK"] = str(node)
    local = os.path.join(nodes_dir, f"node{node}")
    out: dict = {"restored": [], "warnings": [], "errors": []}

    def manager(where: str) -> safeckpt.CheckpointManager:
        return safeckpt.CheckpointManager(where, local_dir=local, durable_every=10, replicas=1, keep_last=None,
                                          check_finite=True, preemption_signals=(), timeout=30)

    mgr = manager(root)
    for op in plan:
        if op[0] == "root":
            mgr = manager(op[1])
        elif op[0] == "save":
            mgr.save(op[1], _state(op[1], rank))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mgr.wait()
            out["warnings"] += [str(w.message) for w in caught]
        elif op[0] == "die-in-replicate":  # node 2's ranks are killed while step op[1] replicates
            import time

            import safeckpt.engine.tier as tier

            if node == 2:
                tier.send_recv = lambda *a, **k: os._exit(9)
            mgr.save(op[1], _state(op[1], rank))
            t = time.monotonic()
            try:
                mgr.wait()
                out["errors"].append(None)
            except safeckpt.CheckpointError as exc:
                out["errors"].append([type(exc).__name__, str(exc), time.monotonic() - t])
        elif op[0] == "corrupt-replica" and rank == 0:  # the next replica rank 0 sends is damaged on the way
            import safeckpt.engine.tier as tier

            plain = tier.as_tensor

            def damaged(data: bytes, plain=plain) -> torch.Tensor:
                t = plain(data).clone()
                t[len(t) // 2] ^= 1
                tier.as_tensor = plain
                return t

            tier.as_tensor = damaged
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
            out["restored"].append([got, _same(st, _state(0 if exp is None else exp, rank))])
        elif op[0] == "quarantine":
            mgr.quarantine(op[1], "loss spiked")
        elif op[0] == "close":
            mgr.close()
    return out


def _run(plan: list, root, nodes_dir, world: int = WORLD, per_node: int = PER_NODE, dead: tuple = ()) -> list:
    outs = dist_harness.run(_job, world, str(root), str(nodes_dir), plan, per_node, timeout=150)
    for o in outs:
        if o.rank in dead:
            assert not o.ok and o.exitcode == 9, (o.rank, o.exitcode, o.error_type, o.message)
        else:
            assert o.ok, (o.rank, o.error_type, o.message)
    return [o.value for o in outs]


def _step_dir(nodes_dir, node: int, step: int, root=None) -> str:
    from safeckpt.engine.local_tier import tier_tag

    base = os.path.join(nodes_dir, f"node{node}")
    runs = [n for n in os.listdir(base) if n.startswith("run-")]
    run = tier_tag(str(root)) if root is not None else runs[0]
    assert root is not None or len(runs) == 1, runs
    return os.path.join(base, run, f"step-{step:010d}")


def _root_away(root, away) -> None:
    """Make root's checkpoints unreadable, as if root were lost, but keep its run identity
    (``.safeckpt-run.json``; without it the nodes' data is another run's): everything else
    under root is moved to ``away``."""
    from safeckpt.engine.local_tier import RUN_FILE

    os.makedirs(away, exist_ok=True)
    for name in os.listdir(root):
        if name != RUN_FILE:
            os.rename(os.path.join(root, name), os.path.join(away, name))


def _root_steps(root) -> list:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def test_lost_node_restores_from_peers_without_root_and_a_bad_primary_is_resourced(tmp_path):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    # Job 1: step 10 durable (root), steps 11 and 12 on the local tier only; then node 2's
    # ranks are killed while step 13 replicates: every other rank raises, well within timeout.
    outs = _run([("save", 10), ("save", 11), ("save", 12), ("die-in-replicate", 13)], root, nodes, dead=(4, 5))
    for o in outs[:4]:
        kind, text, took = o["errors"][0]
        assert kind == "RankFailure" and "replicate" in text and took < 20, o["errors"]
    assert _root_steps(root) == ["step-0000000010"]
    assert not list(Path.cwd().glob(f"{SCHEME}*"))  # the tier URL never lands as a relative path
    for n in range(NODES):  # keep_local=2: the newest two steps; 13 never published on any node
        base = os.path.dirname(_step_dir(nodes, n, 12))
        assert [x for x in sorted(os.listdir(base)) if not x.startswith(".partial-step-0000000013-")] == [
            "step-0000000011", "step-0000000012", "tier.json"]
    for n in range(NODES):  # each node: its own 2 files + the 2 replicas of the previous node's
        rec = json.loads(open(os.path.join(_step_dir(nodes, n, 12), "tier.json")).read())
        prev = (n - 1) % NODES
        assert rec["own"] == [f"rank-{r:05d}.safetensors" for r in (2 * n, 2 * n + 1)]
        assert rec["replicas"] == [f"rank-{r:05d}.safetensors" for r in (2 * prev, 2 * prev + 1)]
    # Node 2 is lost (its directory wiped); root's checkpoints are gone too (its run identity
    # kept): step 12 must come from the nodes.
    shutil.rmtree(nodes / "node2")
    _root_away(root, tmp_path / "root-away")
    # and one primary on node 0 has a flipped byte: that file alone is re-sourced (from node 1's replica)
    bad = os.path.join(_step_dir(nodes, 0, 12), "rank-00001.safetensors")
    data = bytearray(open(bad, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    outs = _run([("restore", 12)], root, nodes)  # 12, never a torn 13
    for o in outs:
        assert o["restored"] == [[12, True]], o
    for o in outs:  # said on every rank, about that file alone
        bad_notes = [w for w in o["warnings"] if "failed verification" in w]
        assert bad_notes == ["restore of step 12: the copy of rank-00001.safetensors on node-0 failed "
                             "verification; taking it from another copy"], o["warnings"]
    # Every node now holds every file of step 12 again, verified (node 0's bad copy replaced).
    good = open(os.path.join(_step_dir(nodes, 1, 12), "rank-00001.safetensors"), "rb").read()
    assert open(bad, "rb").read() == good
    # The lost node fetched what its ranks' loads read and what a save places there (no more: a
    # restore's bytes per node do not grow with the world size): its own ranks' files (4, 5), the
    # replicas it holds of node 1 (2, 3), and rank 0's, which holds the replicated tensors.
    man = json.loads(open(os.path.join(_step_dir(nodes, 1, 12), "manifest.json")).read())
    holders = {piece[0] for rec in man["tensors"].values() for piece in rec.get("pieces", ())}
    assert holders == {0}  # the small replicated tensors went to rank 0's file
    assert sorted(f for f in os.listdir(_step_dir(nodes, 2, 12)) if f.startswith("rank-")) == [
        f"rank-{r:05d}.safetensors" for r in (0, 2, 3, 4, 5)]
    assert os.listdir(root) == [".safeckpt-run.json"]  # nothing was read from (or written to) root


def test_root_fills_what_no_node_holds_other_runs_are_ignored_finite_and_quarantine(tmp_path):
    import safeckpt
    from safeckpt.engine.local_tier import TIER_FILE, tier_tag

    root, other, nodes = tmp_path / "root", tmp_path / "other", tmp_path / "nodes"
    # Job 1: steps 10 (durable), 11 (local; the replica rank 0 sends is damaged on the way, the
    # #5281 case: caught at save); close drains 11 to root from the staged bytes.
    outs = _run([("save", 10), ("corrupt-replica",), ("save", 11), ("close",)], root, nodes)
    for o in outs:
        assert o["warnings"] == ["step 11: the replica of rank-00000.safetensors (rank 0) received by rank 2 "
                                 "on node-1 does not match its checksum: not kept"], o
    rec = json.loads(open(os.path.join(_step_dir(nodes, 1, 11), "tier.json")).read())
    assert rec["replicas"] == ["rank-00001.safetensors"]
    assert not os.path.exists(os.path.join(_step_dir(nodes, 1, 11), "rank-00000.safetensors"))
    assert _root_steps(root) == ["step-0000000010", "step-0000000011"]
    assert safeckpt.verify(str(root / "step-0000000011")).ok
    # Nodes 1 and 2 lost: node 0 holds files 0, 1 and node 2's replicas (4, 5); 2 and 3 come from root.
    shutil.rmtree(nodes / "node1")
    shutil.rmtree(nodes / "node2")
    # A copy of this run's step 11 dressed up as another root's data (its tier record names
    # this root) must not be used by that other root's manager.
    src = _step_dir(nodes, 0, 11)
    fake = nodes / "node0" / tier_tag(str(other))
    fake.mkdir()
    (fake / TIER_FILE).write_text(json.dumps({"format": "safeckpt-local-tier", "root": str(other)}))
    shutil.copytree(src, fake / "step-0000000011")
    # Job 2: restore 11; then another root on the same local dirs: a fresh run; NaN refused on
    # every tier; a quarantined step skipped.
    outs = _run([("restore", 11), ("root", str(other)), ("restore", None), ("save", 1), ("nan", 2),
                 ("save", 3), ("quarantine", 3), ("restore", 1), ("close",)], root, nodes)
    for o in outs:
        assert o["restored"] == [[11, True], [None, True], [1, True]], o
        assert o["errors"][0] is not None and "NaN/Inf in mine" in o["errors"][0], o
    for n in range(NODES):
        assert not os.path.exists(os.path.join(nodes, f"node{n}", tier_tag(str(other)), "step-0000000002"))
    assert json.loads((other / ".safeckpt-quarantine.json").read_text())["3"]["reason"] == "loss spiked"
    # close drained nothing: the newest step (3) is quarantined, 1 and 2 were never durable
    assert not [n for n in os.listdir(other) if n.startswith("step-")]
    # Job 3, another world size: 2 ranks on one node restore step 11 from node 0's files and root.
    outs = _run([("restore", 11)], root, nodes, world=2, per_node=2)
    for o in outs:
        assert o["restored"] == [[11, True]], o


def test_quarantine_without_local_tier_hides_a_root_step(tmp_path):
    import safeckpt

    with safeckpt.CheckpointManager(tmp_path, keep_last=None, preemption_signals=()) as m:
        m.save(1, _state(1, 0))
        m.save(2, _state(2, 0))
        m.quarantine(2, "diverged")
        st = _state(0, 0)
        with pytest.warns(safeckpt.SafeckptWarning, match="skipping step 2: quarantined .diverged."):
            assert m.restore(st) == 1
        assert _same(st, _state(1, 0))
        assert m.restore(_state(0, 0), step=1) == 1


def test_single_process_local_tier_budget_and_ls(tmp_path, capsys):
    """One process (no process group): the local tier alone restores; keep_local and the byte
    budget bound it; ``safeckpt ls`` shows root's quarantine marks and a local_dir's tier."""
    import safeckpt
    from safeckpt.cli import app as cli

    root, local = tmp_path / "root", tmp_path / "local"
    with safeckpt.CheckpointManager(root, local_dir=local, durable_every=2, keep_local=3, local_max_bytes=1,
                                    preemption_signals=()) as m:
        for s in (1, 2, 3):
            m.save(s, _state(s, 0))
        m.wait()
        run = local / os.listdir(local)[0]
        # past the byte budget the oldest steps go first, never the newest
        assert sorted(n for n in os.listdir(run) if n.startswith("step-")) == ["step-0000000003"]
        m.local_max_bytes = None
        for s in (4, 5):
            m.save(s, _state(s, 0))
        m.wait()
        assert sorted(n for n in os.listdir(run) if n.startswith("step-")) == [
            "step-0000000003", "step-0000000004", "step-0000000005"]
        m.quarantine(4, "loss spike")
        st = _state(0, 0)
        assert m.restore(st) == 5 and _same(st, _state(5, 0))
    # durable steps 2 and 4, and 5 drained at close
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == [
        "step-0000000002", "step-0000000004", "step-0000000005"]
    assert cli.main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    line4 = next(ln for ln in out.splitlines() if ln.startswith("step-0000000004"))
    assert "quarantined (loss spike)" in line4
    assert cli.main(["ls", str(local)]) == 0
    out = capsys.readouterr().out
    assert f"(root {root})" in out and "all files here" in out
    # root newer than the local tier (a fresh local_dir): from root
    with safeckpt.CheckpointManager(root, local_dir=tmp_path / "fresh", preemption_signals=()) as m:
        st = _state(0, 0)
        assert m.restore(st) == 5 and _same(st, _state(5, 0))


def test_restore_from_the_local_tier_while_root_cannot_be_listed(tmp_path, monkeypatch):
    import safeckpt
    import safeckpt.manager as manager
    from safeckpt.errors import StorageError

    root, local = tmp_path / "root", tmp_path / "local"
    with safeckpt.CheckpointManager(root, local_dir=local, durable_every=None, preemption_signals=()) as m:
        m.save(7, _state(7, 0))
    assert [n for n in os.listdir(root) if n.startswith("step-")] == ["step-0000000007"]  # drained at close

    def unreachable(*a, **k):
        raise StorageError("endpoint unreachable")

    monkeypatch.setattr(manager, "scan", unreachable)  # root's listing for the tier
    with safeckpt.CheckpointManager(root, local_dir=local, preemption_signals=()) as m:
        st = _state(0, 0)
        with pytest.warns(safeckpt.SafeckptWarning, match="could not be listed.*node-local tier only"):
            assert m.restore(st) == 7
        assert _same(st, _state(7, 0))


def test_a_full_local_disk_or_an_unreachable_root_degrade_with_a_warning(tmp_path, monkeypatch):
    """ENOSPC on the local tier: that step is not local (a warning), its drain to root still
    happens; root unreachable at a durable step: the step stays local (a warning) and close()
    drains it once root is back. Training never sees an exception."""
    import errno

    import safeckpt
    import safeckpt.engine.tier as tier
    from safeckpt.errors import StorageError

    root, local = tmp_path / "root", tmp_path / "local"
    m = safeckpt.CheckpointManager(root, local_dir=local, durable_every=2, preemption_signals=())
    plain_write, plain_begin = tier.write_local, tier._commit.begin

    def full(job, staging):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier, "write_local", full)
    m.save(2, _state(2, 0))
    with pytest.warns(safeckpt.SafeckptWarning, match="step 2 is not on the local tier.*No space left"):
        m.wait()
    run = local / os.listdir(local)[0]
    assert not [n for n in os.listdir(run) if n.startswith(("step-", ".partial"))]
    assert [n for n in os.listdir(root) if n.startswith("step-")] == ["step-0000000002"]
    monkeypatch.setattr(tier, "write_local", plain_write)

    def unreachable(store, target, overwrite):
        if target.startswith(SCHEME):  # the local tier's own agreement
            return plain_begin(store, target, overwrite)
        raise StorageError(f"{target}: endpoint unreachable")

    monkeypatch.setattr(tier._commit, "begin", unreachable)
    m.save(4, _state(4, 0))
    with pytest.warns(safeckpt.SafeckptWarning, match="step 4 was not committed under .*unreachable"):
        m.wait()
    assert [n for n in os.listdir(root) if n.startswith("step-")] == ["step-0000000002"]
    assert os.path.isdir(run / "step-0000000004")
    monkeypatch.setattr(tier._commit, "begin", plain_begin)
    m.close()  # root is back: the newest step is drained from its staged bytes
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000002", "step-0000000004"]
    assert safeckpt.verify(str(root / "step-0000000004")).ok
    st = _state(0, 0)
    assert safeckpt.load(str(root / "step-0000000004"), st) and _same(st, _state(4, 0))


@pytest.mark.parametrize("async_save", [False, True])
def test_check_finite_without_local_tier_refuses_the_save(tmp_path, async_save):
    import safeckpt

    with safeckpt.CheckpointManager(tmp_path, check_finite=True, async_save=async_save, preemption_signals=()) as m:
        m.save(1, _state(1, 0))
        m.wait()
        bad = _state(2, 0)
        bad["w"][5] = float("inf")
        with pytest.raises(safeckpt.CheckpointError, match="check_finite: step 2 holds NaN/Inf in w"):
            m.save(2, bad)
        m.save(3, _state(3, 0))
        m.wait()
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".safeckpt")) == [
        "step-0000000001", "step-0000000003"]  # nothing of step 2, no staging left


def _dtensor_job(rank: int, world: int, root: str, nodes_dir: str) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import safeckpt

    os.environ["GROUP_RANK"] = str(rank)  # one rank per node
    mesh = init_device_mesh("cpu", (world,))

    def state(v: float) -> dict:
        full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5) * v  # uneven shards: 4 + 3 rows
        return {"d": distribute_tensor(full, mesh, [Shard(0)]), "w": torch.full((9,), v)}

    local = os.path.join(nodes_dir, f"node{rank}")
    with safeckpt.CheckpointManager(root, local_dir=local, durable_every=None, replicas=1,
                                    preemption_signals=()) as m:
        m.save(1, state(1.0))
        m.save(2, state(2.0))
        m.wait()
        m._last = None  # the job "dies": nothing drained to root
    dist.barrier()
    if rank == 1:  # node 1 lost
        shutil.rmtree(local)
    dist.barrier()
    st = state(0.0)
    with safeckpt.CheckpointManager(root, local_dir=local, preemption_signals=()) as m:
        got = m.restore(st)
    want = state(2.0)
    return [got, torch.equal(st["d"].to_local(), want["d"].to_local()), torch.equal(st["w"], want["w"])]


def test_dtensor_state_restored_from_a_peer_after_node_loss(tmp_path):
    outs = dist_harness.run(_dtensor_job, 2, str(tmp_path / "root"), str(tmp_path / "nodes"), timeout=120)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        got, shard_ok, w_ok = o.value
        assert got == 2 and shard_ok and w_ok, o.value
    root = tmp_path / "root"  # never drained: the restore had nothing but the nodes' copies
    assert not root.exists() or not [n for n in os.listdir(root) if n.startswith("step-")]


def test_a_preempted_job_drains_its_next_save_to_root(tmp_path):
    import signal

    import safeckpt

    root = tmp_path / "root"
    with safeckpt.CheckpointManager(root, local_dir=tmp_path / "local", durable_every=None,
                                    preemption_signals=(signal.SIGUSR1,)) as m:
        m.save(1, _state(1, 0))
        m.wait()
        assert not root.exists() or not [n for n in os.listdir(root) if n.startswith("step-")]
        os.kill(os.getpid(), signal.SIGUSR1)
        m.save(2, _state(2, 0))  # preempted: this one goes to root too
        m.wait()
        assert [n for n in os.listdir(root) if n.startswith("step-")] == ["step-0000000002"]
        assert m.preempted
