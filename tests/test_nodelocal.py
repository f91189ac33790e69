"""Two "nodes" on this machine: two ``torchrun --nnodes 2`` launches joined by a c10d rendezvous
on 127.0.0.1, one process each.

- A shared directory: saves on one node, restores on both.
- Node-local disks under the same path (the realistic case: ``/local_nvme/ckpts`` on every
  node): node 1 runs in its own mount namespace where that path is bind-mounted to another
  directory (``unshare -rm``; skipped where unprivileged namespaces are not allowed). The first
  save must refuse before any rank writes data, saying what to use instead.
- Per-node directory names (each node given its own root): refused at the first call, the
  start-up restore (rank 0 picks the checkpoint for every rank, so roots must agree).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from tests.helpers import dist_harness

SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    import safeckpt

    shared, local, pernode, out, with_local = sys.argv[1:6]
    dist.init_process_group("gloo")
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    res = {"node": node}

    def state(v):
        return {"w": torch.full((256,), float(v)), "v": v, "rng": safeckpt.RNGState()}

    def attempt(fn):
        try:
            return ["ok", fn()]
        except safeckpt.CheckpointError as exc:
            return [type(exc).__name__, str(exc)]

    with safeckpt.CheckpointManager(shared, keep_last=2, preemption_signals=(), timeout=30) as m:
        res["fresh"] = m.restore(state(0))
        m.save(1, state(1))
        m.save(2, state(2))
        st = state(-1)
        res["restored"] = [m.restore(st), st["v"], float(st["w"][0])]

    def save_to(root):
        with safeckpt.CheckpointManager(root, preemption_signals=(), timeout=30) as m:
            m.restore(state(0))
            return m.save(1, state(1)).step

    if with_local == "1":
        res["local"] = attempt(lambda: save_to(local))
    res["pernode"] = attempt(lambda: save_to(os.path.join(pernode, f"node{node}")))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
''')


def _unshare_works(tmp_path) -> bool:
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir()
    b.mkdir()
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount --bind "{b}" "{a}"'], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_two_nodes_shared_directory_works_node_local_disks_are_refused(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(SCRIPT)
    shared, local, disk1, pernode = (tmp_path / n for n in ("shared", "local", "disk1", "pernode"))
    for d in (local, disk1, pernode):
        d.mkdir()
    with_local = _unshare_works(tmp_path)
    out = tmp_path / "result"
    port = dist_harness.free_port()
    run_id = f"nodelocal-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAFECKPT_TIMEOUT": "30", "PYTHONUNBUFFERED": "1"}

    def torchrun(node: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host={int(node == 0)}", "--max-restarts", "0",
                str(script), str(shared), str(local), str(pernode), str(out), str(int(with_local))]

    node1 = torchrun(1)
    if with_local:  # node 1 sees its own disk at the same path
        node1 = ["unshare", "-rm", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
                 str(disk1), str(local), *node1]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (torchrun(0), node1)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("the two-node run hung") from None
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)

    results = [json.loads((tmp_path / f"result.{r}").read_text()) for r in (0, 1)]
    assert sorted(r["node"] for r in results) == [0, 1]
    for r in results:
        assert r["fresh"] is None and r["restored"] == [2, 2, 2.0]
        kind, msg = r["pernode"]
        assert kind == "RankMismatch" and "different roots" in msg and "nothing was loaded" in msg, r
        assert "node0" in msg and "node1" in msg, msg
        if with_local:
            kind, msg = r["local"]
            # seen when the rank that does not share the directory comes to write its file
            # (the save's second exchange; rank 0's staged file is removed again)
            assert kind == "RankFailure" and "'write'" in msg, r
            assert "shared filesystem" in msg and "object store" in msg, msg
    assert sorted(os.listdir(shared)) == ["step-0000000001", "step-0000000002"]
    # Nothing was written for the refused saves: no step, no staging leftover, no lease.
    for d in (local, disk1, pernode / "node0", pernode / "node1"):
        assert not d.exists() or os.listdir(d) == [], (d, os.listdir(d))
    if not with_local:
        pytest.skip("unprivileged mount namespaces (unshare -rm) unavailable: node-local disks under "
                    "one path not exercised (the shared and per-node cases were)")
