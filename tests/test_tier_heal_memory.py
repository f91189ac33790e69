"""A restore whose node cannot keep the files it fetches (ENOSPC on local_dir): files held in
memory serve only the process that holds them and are released on every way out; a damaged
copy left on disk is never read. Regressions of the adversarial review of the tier's
restore (real processes: 2 simulated nodes of 1 or 2 ranks, GROUP_RANK per node, gloo)."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(300)

N = 1 << 16


def _state(step, rank, tag=0.0):
    import safeckpt
    return {"w": torch.arange(N, dtype=torch.float32) * step + tag,
            "mine": safeckpt.PerRank(torch.full((4,), 100.0 * rank + step + tag)), "v": step}


def _job(rank, world, root, nodes_dir, plan, kw, per_node):
    import safeckpt
    import safeckpt.engine.tier as tier

    node = rank // per_node
    os.environ["GROUP_RANK"] = str(node)
    opts = dict(durable_every=10, replicas=1, keep_last=None, preemption_signals=(), timeout=20, **kw)
    mgr = safeckpt.CheckpointManager(root, local_dir=os.path.join(nodes_dir, f"node{node}"), **opts)
    plain_write = tier.write_bytes_atomic
    plain_read = tier.read_file
    out = []
    for op in plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = None
                if op[0] == "save":
                    mgr.save(op[1], _state(op[1], rank, op[2] if len(op) > 2 else 0.0))
                    mgr.wait()
                elif op[0] == "close":
                    mgr.close(drain=op[1])
                elif op[0] == "enospc":  # node op[1]'s disk is full (its heal fails)
                    if node == op[1]:
                        def nospace(*a, **k):
                            raise OSError(28, "No space left on device")
                        tier.write_bytes_atomic = nospace
                elif op[0] == "disk-ok":
                    tier.write_bytes_atomic = plain_write
                elif op[0] == "gate":  # node op[1]'s writes wait until "open-gate"
                    if node == op[1]:
                        import threading
                        gate = threading.Event()

                        def gated(*a, _gate=gate, **k):
                            assert _gate.wait(60), "gate never opened"
                            return plain_write(*a, **k)
                        tier.write_bytes_atomic = gated
                elif op[0] == "open-gate":
                    if node == op[1]:
                        gate.set()
                elif op[0] == "files":  # this node's data files of step op[1] on disk now
                    d = mgr._tier.step_dir(op[1])
                    got = sorted(n for n in os.listdir(d) if n.startswith("rank-")) if os.path.isdir(d) else None
                elif op[0] == "wait":
                    mgr.wait()
                elif op[0] == "restore-part":  # one entry (op[2]), strict="entries": files read in part
                    import safeckpt
                    key = op[2]
                    st = {"w": torch.zeros(N)} if key == "w" else {"mine": safeckpt.PerRank(torch.zeros(4))}
                    got = mgr.restore(st, step=op[1], strict="entries")
                    want = _state(op[1], rank)[key]
                    got = [got, torch.equal(st["w"], want) if key == "w" else torch.equal(st["mine"].value, want.value)]
                elif op[0] == "count-held":  # the buffers this rank receives fetched files into
                    from safeckpt.engine import held_files
                    log = []
                    plain_buffer = held_files.receive_buffer

                    def counted(size, _log=log, _plain=plain_buffer):
                        _log.append(size)
                        return _plain(size)
                    held_files.receive_buffer = counted
                    held_log = log
                elif op[0] == "held-sizes":
                    got = list(held_log)
                elif op[0] == "zeros-from":  # node op[1] sends zeros for file op[2] (gone meanwhile)
                    if node == op[1]:
                        def zeros(path, size, _name=op[2]):
                            if os.path.basename(path) == _name:
                                return torch.zeros(size, dtype=torch.uint8)
                            return plain_read(path, size)
                        tier.read_file = zeros
                elif op[0] == "reads-ok":
                    tier.read_file = plain_read
                elif op[0] == "flip":  # damage every data file of step op[1] on node op[2] (same size)
                    if node == op[2] and rank % per_node == 0:
                        d = os.path.join(mgr._tier.step_dir(op[1]))
                        for n in sorted(os.listdir(d)):
                            if n.startswith("rank-"):
                                p = os.path.join(d, n)
                                with open(p, "r+b") as f:
                                    f.seek(os.path.getsize(p) // 2)
                                    b = f.read(1)
                                    f.seek(os.path.getsize(p) // 2)
                                    f.write(bytes([b[0] ^ 0xFF]))
                    torch.distributed.barrier()
                elif op[0] == "held":
                    from safeckpt.engine import held_files
                    got = sorted(os.path.relpath(k, nodes_dir) for k in held_files._HELD)
                elif op[0] == "restore":
                    st = _state(0, rank)
                    got = mgr.restore(st, step=op[3] if len(op) > 3 else None)
                    exp = _state(got if got is not None else 0, rank, op[2])
                    got = [got, torch.equal(st["w"], exp["w"]), torch.equal(st["mine"].value, exp["mine"].value)]
                out.append([op[0], got, None])
            except Exception as exc:  # noqa: BLE001 - recorded
                out.append([op[0], None, f"{type(exc).__name__}: {str(exc)[:600]}"])
        out[-1].append([str(w.message)[:300] for w in caught])
    return out


def _run(plan, tmp_path, world=2, per_node=1, **kw):
    outs = dist_harness.run(_job, world, str(tmp_path / "root"), str(tmp_path / "nodes"), plan, kw, per_node,
                            timeout=180)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
    return [o.value for o in outs]


def test_a_damaged_copy_on_a_full_node_of_two_ranks_is_never_loaded(tmp_path):
    """2 nodes x 2 ranks; node 1's copies of step 11 (local only) are damaged and its disk is
    full: the fetched files cannot be kept, and the damaged copies are not loaded unhashed by the
    node's other rank. The step cannot be served (a node's second rank would lack the bytes),
    so every rank restores step 10 from root, bit-exact."""
    _run([("save", 10), ("save", 11), ("close", False)], tmp_path, world=4, per_node=2)
    outs = _run([("flip", 11, 1), ("enospc", 1), ("restore", 10, 0.0), ("close", False)], tmp_path, world=4,
                per_node=2)
    for out in outs:
        assert out[2][1] == [10, True, True] and out[2][2] is None, out[2]
        assert any("could not keep" in w for w in out[2][3]), out[2][3]


def test_a_lost_node_of_two_ranks_with_a_full_disk_falls_back_never_raises(tmp_path):
    """2 nodes x 2 ranks, node 1 lost step 11 (local only) and its disk is full: files held in
    one process cannot serve the node's other rank, so the restore takes step 10 from root."""
    import shutil

    _run([("save", 10), ("save", 11), ("close", False)], tmp_path, world=4, per_node=2)
    shutil.rmtree(tmp_path / "nodes" / "node1")
    outs = _run([("enospc", 1), ("restore", 10, 0.0), ("close", False)], tmp_path, world=4, per_node=2)
    for out in outs:
        assert out[1][1] == [10, True, True] and out[1][2] is None, out[1]


def test_held_files_are_released_when_the_restore_falls_back(tmp_path):
    """Node 1 lost step 11 and its disk is full; one file of 11 arrives damaged from every
    source, so the restore falls back to 10: nothing stays held in memory, and after the disk
    is fine again a new save of step 11 is restored in the same process (no stale bytes)."""
    import shutil

    _run([("save", 10), ("save", 11), ("close", False)], tmp_path)
    shutil.rmtree(tmp_path / "nodes" / "node1")
    outs = _run([("enospc", 1), ("zeros-from", 0, "rank-00001.safetensors"), ("restore", 10, 0.0),
                 ("held",), ("disk-ok",), ("reads-ok",), ("save", 11, 0.5), ("restore", 11, 0.5, 11),
                 ("close", False)], tmp_path)
    for out in outs:
        assert out[2][1] == [10, True, True], out[2]
        assert out[3][1] == [], out[3]
        assert out[7][1] == [11, True, True] and out[7][2] is None, out[7]


def test_a_single_rank_node_with_a_full_disk_loads_from_memory(tmp_path):
    """Node 1 (one rank) lost step 11 (local only) and its disk is full: the fetched files,
    received into memory files and verified on arrival, are loaded from there: step 11, not
    10; the heal after the restore (joined by close) cannot keep them and says so on node 1."""
    import shutil

    _run([("save", 10), ("save", 11), ("close", False)], tmp_path)
    shutil.rmtree(tmp_path / "nodes" / "node1")
    outs = _run([("enospc", 1), ("restore", 11, 0.0), ("held",), ("close", False)], tmp_path)
    for rank, out in enumerate(outs):
        assert out[1][1] == [11, True, True] and out[1][2] is None, out[1]
        assert out[2][1] == [], out[2]
        assert out[3][2] is None and len([w for w in out[3][3] if "could not keep" in w]) == (rank == 1), out[3]


def test_a_lost_single_rank_node_returns_before_its_heal(tmp_path):
    """Node 1 (one rank) lost step 11 (local only): its restore loads the fetched files from the
    memory files it received them into and returns while the heal (writing them to its disk)
    is still held back; mgr.wait() joins the heal, after which node 1 holds every file of the
    step again, identical to node 0's."""
    import shutil

    _run([("save", 10), ("save", 11), ("close", False)], tmp_path)
    shutil.rmtree(tmp_path / "nodes" / "node1")
    outs = _run([("gate", 1), ("restore", 11, 0.0), ("files", 11), ("held",), ("open-gate", 1), ("wait",),
                 ("files", 11), ("close", False)], tmp_path)
    for out in outs:
        assert [o[2] for o in out] == [None] * 8, out
        assert out[1][1] == [11, True, True], out[1]  # restored, bit-exact, heal not done yet
        assert out[3][1] == [], out[3]  # nothing left in the registry after the load
    both = ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert outs[1][2][1] in (None, []), outs[1][2]  # node 1: not on disk when restore returned
    assert outs[1][6][1] == both and outs[0][6][1] == both, (outs[0][6], outs[1][6])
    runs = [os.path.join(tmp_path, "nodes", f"node{n}") for n in (0, 1)]
    dirs = [os.path.join(r, os.listdir(r)[0], "step-0000000011") for r in runs]
    for name in both:
        assert open(os.path.join(dirs[0], name), "rb").read() == open(os.path.join(dirs[1], name), "rb").read()


def _flip_in_tensor(path, prefix):
    """Flip one byte inside the first tensor of the data file ``path`` whose name starts with
    ``prefix`` (a safetensors header: 8-byte length, JSON with data_offsets)."""
    import json
    import struct

    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        start = next(8 + n + rec["data_offsets"][0] for k, rec in header.items() if k.startswith(prefix))
        f.seek(start)
        b = f.read(1)
        f.seek(start)
        f.write(bytes([b[0] ^ 0xFF]))


def test_damage_where_a_partial_load_does_not_read_is_still_resourced(tmp_path):
    """A restore that reads a file only in part (strict="entries", "w" alone) still verifies the
    node's copies whole: damage in rank 0's per-rank entry of node 0's copy of rank-00000 (the
    file rank 0 reads for "w", but not that entry) is found and that file re-sourced, so the step
    keeps both copies and survives the loss of node 1 afterwards (review: leaving the copies a
    rank's load reads to its chunk check lost that redundancy silently, and the later restore
    fell back to step 10)."""
    import glob
    import shutil

    _run([("save", 10), ("save", 11), ("close", False)], tmp_path)
    (bad,) = glob.glob(str(tmp_path / "nodes" / "node0" / "*" / "step-0000000011" / "rank-00000.safetensors"))
    _flip_in_tensor(bad, "mine")
    outs = _run([("restore-part", 11, "w"), ("close", False)], tmp_path)
    for out in outs:
        assert out[0][1] == [11, True] and out[0][2] is None, out[0]
        assert any("rank-00000.safetensors on node-0 failed verification" in w for w in out[0][3]), out[0][3]
    (good,) = glob.glob(str(tmp_path / "nodes" / "node1" / "*" / "step-0000000011" / "rank-00000.safetensors"))
    assert open(bad, "rb").read() == open(good, "rb").read()
    shutil.rmtree(tmp_path / "nodes" / "node1")
    outs = _run([("restore", 11, 0.0), ("close", False)], tmp_path)
    for out in outs:
        assert out[0][1] == [11, True, True] and out[0][2] is None, out[0]


def test_a_lost_single_rank_node_holds_in_memory_only_what_its_load_reads(tmp_path):
    """Node 1 (one rank) lost its directory; restoring only its per-rank entry, its load reads
    its own file alone, so that is the only fetched file it holds in memory: the replica it
    keeps for node 0 is written as it arrives (review: every fetched file was held until the
    heal, up to (replicas + 1) times what the load needs)."""
    import glob
    import shutil

    _run([("save", 10), ("save", 11), ("close", False)], tmp_path)
    shutil.rmtree(tmp_path / "nodes" / "node1")
    outs = _run([("count-held",), ("restore-part", 11, "mine"), ("held-sizes",), ("close", False)], tmp_path)
    for out in outs:
        assert out[1][1] == [11, True] and out[1][2] is None, out[1]
    assert outs[0][2][1] == [], outs[0][2]  # node 0 fetched nothing
    mine = glob.glob(str(tmp_path / "nodes" / "node1" / "*" / "step-0000000011" / "rank-*.safetensors"))
    assert sorted(os.path.basename(m) for m in mine) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert len(outs[1][2][1]) == 1, outs[1][2]  # fetched both files, held one
