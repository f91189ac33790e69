"""Budgets and degraded storage of the node-local tier (issue 28 item 5), on real processes
(simulated nodes: GROUP_RANK per rank, each node its own local_dir; gloo on 127.0.0.1):

- ``local_max_bytes`` smaller than one step's replicas: the oldest local steps go first, then
  the replicas, with a warning on every rank; never a crash; the newest step still restores;
- a node's local_dir on a filesystem that fills up (a real 64 KiB tmpfs where it can be
  mounted, else ENOSPC injected at the same writes): warnings, the durable step still reaches
  root, training goes on;
- an object-store root behind a proxy that is dropped: local saves and restores keep working,
  the drain's failure is a warning (close() raises StorageUnavailable), no local step is lost,
  and the next durable step reaches root once it is back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
import warnings

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(240)


def _state(step: int, rank: int, n: int = 3000) -> dict:
    import safeckpt

    return {"w": torch.arange(16, dtype=torch.float32) * step,  # replicated
            "mine": safeckpt.PerRank(torch.full((n,), float(100 * rank + step))), "v": step}  # n * 4 bytes a file


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["mine"].value, b["mine"].value) and a["v"] == b["v"]


def _saved(mgr, step: int, rank: int, out: dict, n: int = 3000) -> None:
    mgr.save(step, _state(step, rank, n))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.wait()
    out.setdefault("warnings", {})[step] = [str(w.message) for w in caught]


def _node_files(mgr) -> dict:
    nd = mgr._tier
    return {s: sorted(os.listdir(nd.step_dir(s))) for s in nd.steps()}


# --------------------------------------------------------------------------- byte budget


def _budget_job(rank: int, world: int, root: str, nodes: str) -> dict:
    import safeckpt

    os.environ["GROUP_RANK"] = str(rank)
    mgr = safeckpt.CheckpointManager(root, local_dir=os.path.join(nodes, f"node{rank}"), durable_every=None,
                                     replicas=1, keep_local=None, preemption_signals=(), timeout=30)
    out: dict = {}
    _saved(mgr, 1, rank, out)
    nd = mgr._tier
    d1 = nd.step_dir(1)
    replica = next(f for f in os.listdir(d1) if f.startswith("rank-") and f != f"rank-{rank:05d}.safetensors")
    out["step1"] = sorted(os.listdir(d1))
    step_bytes = nd.step_sizes()[-1][1]
    # room for a step's own file, manifest and record, not for its replica: less than one step
    import torch.distributed as dist

    room = torch.tensor([step_bytes - os.path.getsize(os.path.join(d1, replica)) + 200])
    dist.all_reduce(room, op=dist.ReduceOp.MAX)  # one budget for the job, as every option
    mgr.local_max_bytes = budget = int(room.item())
    for step in (2, 3):
        _saved(mgr, step, rank, out)
        out.setdefault("bytes", []).append([nd.nbytes(), budget])
    out["held"] = _node_files(mgr)
    st = _state(0, rank)
    out["restored"] = [mgr.restore(st), _same(st, _state(3, rank))]
    return out


def test_a_budget_smaller_than_one_steps_replicas_degrades_replication(tmp_path):
    outs = dist_harness.run(_budget_job, 3, str(tmp_path / "root"), str(tmp_path / "nodes"), timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        v = o.value
        assert v["warnings"][1] == [], v
        assert len(v["step1"]) == 4  # own file, the previous node's replica, manifest, record
        for step in (2, 3):  # every rank is told, about every node
            notes = v["warnings"][step]
            assert len(notes) == 3 and all(f"step {step}: local_max_bytes" in n and "not replicated there" in n
                                           for n in notes), notes
        for used, budget in v["bytes"]:
            assert used <= budget, v["bytes"]
        # the oldest steps went first; the newest holds this node's own file only
        assert v["held"] == {3: ["manifest.json", f"rank-{o.rank:05d}.safetensors", "tier.json"]}, v["held"]
        assert v["restored"] == [3, True]


# --------------------------------------------------------------------------- a full filesystem


def _full_job(rank: int, world: int, root: str, nodes: str, real: bool) -> dict:
    import safeckpt
    import safeckpt.engine.tier as tier

    os.environ["GROUP_RANK"] = str(rank)
    if rank == 1 and not real:  # no tmpfs here: the same writes fail with ENOSPC
        plain_atomic, plain_write = tier.write_bytes_atomic, tier.write_local

        def replica_full(path, data, plain=plain_atomic):
            if ".partial-" in path and os.path.basename(path).startswith("rank-"):
                raise OSError(errno.ENOSPC, "No space left on device", path)
            return plain(path, data)

        def own_full(job, staging, plain=plain_write):
            if job.step >= 2:
                raise OSError(errno.ENOSPC, "No space left on device", staging["path"])
            return plain(job, staging)

        tier.write_bytes_atomic, tier.write_local = replica_full, own_full
    mgr = safeckpt.CheckpointManager(root, local_dir=os.path.join(nodes, f"node{rank}"), durable_every=2,
                                     replicas=1, keep_local=1, preemption_signals=(), timeout=30)
    out: dict = {}
    for step in (1, 2, 3):
        _saved(mgr, step, rank, out, n=10000)  # 40 KB per rank's file
    out["held"] = _node_files(mgr)
    st = _state(0, rank, 10000)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out["restored"] = [mgr.restore(st, step=2), _same(st, _state(2, rank, 10000))]
    return out


@contextlib.contextmanager
def _tiny_tmpfs(path):
    path.mkdir(parents=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                            capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_a_full_local_filesystem_never_stops_training(tmp_path, how):
    root, nodes = tmp_path / "root", tmp_path / "nodes"
    (nodes / "node0").mkdir(parents=True)
    with _tiny_tmpfs(nodes / "node1") if how == "tmpfs" else contextlib.nullcontext(False) as real:
        if how == "tmpfs" and not real:
            pytest.skip("a tmpfs cannot be mounted here (not root); the injected case covers the same writes")
        outs = dist_harness.run(_full_job, 2, str(root), str(nodes), real, timeout=150)
        for o in outs:
            assert o.ok, (o.rank, o.error_type, o.message)
            w = o.value["warnings"]
            # step 1: node 1 kept its own file but not node 0's replica
            assert len(w[1]) == 1 and "rank-00000.safetensors (rank 0) could not be kept on node-1" in w[1][0], w
            assert "No space left" in w[1][0]
            # steps 2 and 3: node 1 cannot write its file: not on the local tier, training goes on
            for step in (2, 3):
                assert len(w[step]) == 1 and f"step {step} is not on the local tier" in w[step][0], w
            assert o.value["restored"] == [2, True]  # the durable step reached root all the same
        assert outs[1].value["held"] == {1: ["manifest.json", "rank-00001.safetensors", "tier.json"]}
        assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000002"]


# --------------------------------------------------------------------------- root unreachable


def _s3_job(rank: int, world: int, root: str, nodes: str, endpoint: str, phase: str) -> dict:
    import safeckpt
    from tests.helpers import s3_harness

    os.environ["GROUP_RANK"] = str(rank)
    mgr = safeckpt.CheckpointManager(root, local_dir=os.path.join(nodes, f"node{rank}"), durable_every=2,
                                     replicas=1, keep_local=3, preemption_signals=(), timeout=60,
                                     storage_options={**s3_harness.options(endpoint),  # fail fast when dropped
                                                      "config_kwargs": {"retries": {"max_attempts": 1}}})
    out: dict = {}
    if phase == "up":  # step 2 durable, step 3 local; the job dies without close()
        for step in (2, 3):
            _saved(mgr, step, rank, out)
        return out
    st = _state(0, rank)
    t = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["restored"] = [mgr.restore(st), _same(st, _state(3 if phase == "down" else 5, rank))]
    out["restore_warnings"] = [str(w.message) for w in caught]
    if phase == "down":
        for step in (4, 5):  # 4 is durable: its drain fails, a warning; the step stays local
            _saved(mgr, step, rank, out)
        st = _state(0, rank)
        out["again"] = [mgr.restore(st), _same(st, _state(5, rank))]
        try:
            mgr.close()
            out["close"] = None
        except safeckpt.CheckpointError as exc:
            out["close"] = [type(exc).__name__, str(exc)]
    else:  # root is back: the next durable step reaches it
        _saved(mgr, 6, rank, out)
        mgr.close()
    out["took"] = time.monotonic() - t
    out["held"] = sorted(_node_files(mgr))
    return out


def test_an_unreachable_object_store_root_leaves_the_local_tier_working(tmp_path):
    pytest.importorskip("s3fs")
    import safeckpt
    from tests.helpers import s3_harness

    with s3_harness.moto_server() as endpoint:
        s3_harness.make_bucket(endpoint, "tier")
        proxy = s3_harness.Proxy(endpoint)
        root, nodes = "s3://tier/run", str(tmp_path / "nodes")
        for phase in ("up", "down", "back"):
            if phase == "down":
                proxy.drop()
            elif phase == "back":
                proxy.restore()
            outs = dist_harness.run(_s3_job, 2, root, nodes, proxy.endpoint, phase, timeout=200)
            for o in outs:
                assert o.ok, (phase, o.rank, o.error_type, o.message)
                v = o.value
                if phase == "up":
                    assert v["warnings"] == {2: [], 3: []}, v
                elif phase == "down":
                    assert v["restored"] == [3, True], v  # from the nodes alone
                    assert any("could not be listed" in w for w in v["restore_warnings"]), v
                    assert v["warnings"][5] == [], v
                    assert len(v["warnings"][4]) == 1 and "step 4 was not committed under s3://tier/run" in \
                        v["warnings"][4][0], v
                    assert v["again"] == [5, True], v
                    assert v["close"] is not None and v["close"][0] == "StorageUnavailable", v
                    assert v["held"] == [3, 4, 5], v  # no local step lost
                else:
                    assert v["restored"] == [5, True] and v["warnings"] == {6: []}, v
        fs = s3_harness.s3fs_for(endpoint)
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("tier/run") if "step-" in p) == [
            "step-0000000002", "step-0000000006"]
        opts = s3_harness.options(endpoint)
        assert safeckpt.verify("s3://tier/run/step-0000000006", storage_options=opts).ok
        proxy.drop()


def test_a_full_local_filesystem_makes_room_from_older_steps(tmp_path):
    """ENOSPC at a node's own write: its older steps (never the newest) are removed and the
    write is tried once more, so the tier keeps saving on a disk that holds two steps."""
    import safeckpt

    with _tiny_tmpfs(tmp_path / "local") as real:
        if not real:
            pytest.skip("a tmpfs cannot be mounted here (not root)")
        with safeckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / "local", durable_every=None,
                                        keep_local=None, preemption_signals=()) as m:
            for step in (1, 2, 3, 4):  # 20 KB a step (n=5000): two fit in 64 KiB with the records, not three
                m.save(step, _state(step, 0, 5000))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    m.wait()
                assert [str(w.message) for w in caught] == [], step
            held = m._tier.steps()
            assert held[-1] == 4 and len(held) <= 2, held
            st = _state(0, 0, 5000)
            assert m.restore(st) == 4 and _same(st, _state(4, 0, 5000))
            m._last = None  # nothing drained to root
