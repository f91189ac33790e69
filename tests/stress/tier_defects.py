"""Reproductions of defects found in the node-local tier by ``fuzz_tier`` (not part of the CI
suite; run by hand, exit status 1 while a defect reproduces)::

    .venv/bin/python -m tests.stress.tier_defects

1. A node's local manifest that is valid JSON of the wrong shape (a list, a string, a number;
   or a file record that is not an object, or lacks ``xxh3_128``) makes every restart fail:
   ``CheckpointManager.restore`` raises ``RankFailure`` wrapping ``AttributeError`` (in the
   ``tier-inventory`` phase: ``local_tier.step_files`` / ``NodeDir.step_record`` call ``.get``
   on it) or ``KeyError`` (``tier-verify``: ``man["files"][f]["xxh3_128"]``), on every rank,
   instead of treating that node's copy as damaged: with 2 nodes the step is complete from the
   other node's copies (replicas=1), and root holds an older valid step. Expected (the
   contract, issue 28 item 4 and docs/concepts/fast-recovery.md): the damaged copy is replaced
   by another one, or every rank moves to the next older step; never a job that cannot restart.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import warnings

SHAPES = (b"[]", b'"x"', b"7", b'{"files": {"rank-00000.safetensors": 5}}')


def _state(v: float) -> dict:
    import torch

    return {"w": torch.full((8,), float(v)), "v": v}


def one_process(content: bytes) -> str:
    """One node: local step 1001 damaged, root holds 1000: restore should give 1000."""
    import safeckpt

    d = tempfile.mkdtemp()
    try:
        root, local = os.path.join(d, "root"), os.path.join(d, "local")
        m = safeckpt.CheckpointManager(root, local_dir=local, durable_every=1000, preemption_signals=())
        m.save(1000, _state(1))  # durable
        m.save(1001, _state(2))  # local only
        m.wait()
        m._last = None  # the job dies: close() drains nothing
        m.close()
        man = glob.glob(os.path.join(local, "run-*", "step-0000001001", "manifest.json"))[0]
        with open(man, "wb") as f:
            f.write(content)
        st = _state(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with safeckpt.CheckpointManager(root, local_dir=local, preemption_signals=()) as m2:
                    got = m2.restore(st)
        except Exception as exc:  # noqa: BLE001 - the defect
            return f"DEFECT: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return "ok" if got == 1000 and st["v"] == 1 else f"DEFECT: restored {got} ({st['v']})"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _two_node_job(rank: int, world: int, root: str, nodes: str) -> list:
    import torch.distributed as dist

    import safeckpt

    os.environ["GROUP_RANK"] = str(rank)
    local = os.path.join(nodes, f"node{rank}")
    m = safeckpt.CheckpointManager(root, local_dir=local, durable_every=1000, replicas=1, preemption_signals=())
    m.save(1000, _state(1))
    m.save(1001, _state(2))
    m.wait()
    m._last = None
    m.close()
    dist.barrier()
    if rank == 0:  # node 0's copy of the manifest is damaged; node 1 holds both files intact
        man = glob.glob(os.path.join(local, "run-*", "step-0000001001", "manifest.json"))[0]
        with open(man, "wb") as f:
            f.write(b"[]")
    dist.barrier()
    st = _state(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with safeckpt.CheckpointManager(root, local_dir=local, preemption_signals=()) as m2:
                return ["ok", m2.restore(st), st["v"]]
    except safeckpt.CheckpointError as exc:
        return ["raised", type(exc).__name__, str(exc).splitlines()[0][:200]]


def two_nodes() -> str:
    """Two nodes, replicas=1: node 0's manifest of 1001 damaged; node 1 holds every file of
    1001: restore should give 1001 (or at worst 1000 from root)."""
    from tests.helpers import dist_harness

    d = tempfile.mkdtemp()
    try:
        outs = dist_harness.run(_two_node_job, 2, os.path.join(d, "root"), os.path.join(d, "nodes"), timeout=120)
        vals = [o.value if o.ok else [o.error_type, o.message[:200]] for o in outs]
        good = all(v[0] == "ok" and v[1] in (1000, 1001) and v[2] == {1000: 1, 1001: 2}[v[1]] for v in vals)
        return "ok" if good else f"DEFECT: {vals}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    bad = 0
    for content in SHAPES:
        res = one_process(content)
        bad += res != "ok"
        print(f"1 node, local manifest {content!r}: {res}")
    res = two_nodes()
    bad += res != "ok"
    print(f"2 nodes, node 0's local manifest b'[]': {res}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
