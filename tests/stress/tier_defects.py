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
   The same unvalidated parse (no size bound, no special-file or symlink check, no name
   check, plain ``json.loads``) gives: a manifest nested 100,000 deep -> RecursionError, the
   same failure; a FIFO as the manifest -> the restore blocks forever (``open`` in
   ``step_record``); a 1 GiB sparse manifest -> read whole (root's reader refuses past
   ``SAFECKPT_MAX_MANIFEST_BYTES``, 64 MiB); a file name ``../../../../../etc/hostname`` in the
   manifest -> that file, outside the node directory, is opened and hashed by the verify.

2. Every copy damaged and history present: a fresh ``local_dir`` (a new node) and root's only
   checkpoint with a damaged manifest -> the tiered restore returns None (a fresh start), where
   the same root without ``local_dir`` raises CorruptCheckpoint ("refusing to start fresh when
   history exists"): root's listing for the tier (``manager._root_side`` through ``committed``)
   leaves the damaged step out, so there is no candidate and no reason to raise.

Each case runs in a subprocess with a timeout (a hang is reported as such).

Fixed (every case prints ``ok``): the tier reads a node's manifest, ``tier.json`` and quarantine
records with root's checks (``NodeDir.read_manifest``, ``local_tier.read_record``), a copy that
fails them is a damaged copy (warned, re-sourced), and root's damaged checkpoints count as
history for the tiered restore. Regression tests: ``tests/test_local_tier_hostile.py``.
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
        m.close(drain=False)  # the job dies: nothing drained
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
    m.close(drain=False)
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
    1001: restore gives 1001 (node 0's files from node 1)."""
    from tests.helpers import dist_harness

    d = tempfile.mkdtemp()
    try:
        outs = dist_harness.run(_two_node_job, 2, os.path.join(d, "root"), os.path.join(d, "nodes"), timeout=120)
        vals = [o.value if o.ok else [o.error_type, o.message[:200]] for o in outs]
        good = all(v[0] == "ok" and v[1] == 1001 and v[2] == 2 for v in vals)
        return "ok" if good else f"DEFECT: {vals}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _setup() -> tuple[str, str, str, str]:
    """Root holding step 1000 (durable), local_dir holding 1000 and 1001; the job died."""
    import safeckpt

    d = tempfile.mkdtemp()
    root, local = os.path.join(d, "root"), os.path.join(d, "local")
    m = safeckpt.CheckpointManager(root, local_dir=local, durable_every=1000, preemption_signals=())
    m.save(1000, _state(1))
    m.save(1001, _state(2))
    m.wait()
    m.close(drain=False)
    return d, root, local, glob.glob(os.path.join(local, "run-*", "step-0000001001"))[0]


def _restore(root: str, local: str | None) -> tuple:
    import safeckpt

    st = _state(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kw = {"local_dir": local} if local else {}
            with safeckpt.CheckpointManager(root, preemption_signals=(), **kw) as m:
                return ("ok", m.restore(st), st["v"])
    except Exception as exc:  # noqa: BLE001 - reported
        return (type(exc).__name__, str(exc).splitlines()[0][:200])


def nesting() -> str:
    d, root, local, step = _setup()
    try:
        with open(os.path.join(step, "manifest.json"), "wb") as f:
            f.write(b"[" * 100_000 + b"]" * 100_000)
        got = _restore(root, local)
        return "ok" if got[:2] == ("ok", 1000) else f"DEFECT: {got}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def fifo() -> str:
    d, root, local, step = _setup()
    try:
        os.remove(os.path.join(step, "manifest.json"))
        os.mkfifo(os.path.join(step, "manifest.json"))
        got = _restore(root, local)  # blocks here while the defect is there
        return "ok" if got[:2] == ("ok", 1000) else f"DEFECT: {got}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def huge() -> str:
    import resource

    d, root, local, step = _setup()
    try:
        with open(os.path.join(step, "manifest.json"), "r+b") as f:
            f.truncate(1 << 30)  # a sparse hole: 1 GiB of NULs
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
        got = _restore(root, local)
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10) - before
        if grew > 200:
            return f"DEFECT: peak RSS grew by {grew} MiB reading a 1 GiB local manifest (restore gave {got})"
        return "ok" if got[:2] == ("ok", 1000) else f"DEFECT: {got}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def traversal() -> str:
    import json

    d, root, local, step = _setup()
    try:
        target = "/etc/hostname"
        with open(os.path.join(step, "manifest.json")) as f:
            man = json.load(f)
        rec = dict(next(iter(man["files"].values())))
        rec["size"] = os.path.getsize(target)
        man["files"] = {os.path.relpath(target, step): rec}
        with open(os.path.join(step, "manifest.json"), "w") as f:
            json.dump(man, f)
        opened: list[str] = []

        def audit(event: str, args: tuple) -> None:
            if event == "open" and args and isinstance(args[0], (str, bytes)) and "hostname" in os.fsdecode(args[0]):
                opened.append(os.fsdecode(args[0]))

        sys.addaudithook(audit)
        got = _restore(root, local)
        if opened:
            return f"DEFECT: opened {sorted(set(opened))} (outside the node directory); restore gave {got}"
        return "ok" if got[:2] == ("ok", 1000) else f"DEFECT: {got}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def fresh_start() -> str:
    d, root, _, _ = _setup()
    try:
        with open(os.path.join(root, "step-0000001000", "manifest.json"), "wb") as f:
            f.write(b"{}")
        plain = _restore(root, None)
        got = _restore(root, os.path.join(d, "fresh-local"))
        if got[:2] == ("ok", None):
            return (f"DEFECT: the tiered restore returned None (a fresh start) with root's only step damaged; "
                    f"without local_dir: {plain}")
        return "ok" if got[0] == "CorruptCheckpoint" else f"DEFECT: {got}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


CASES = {
    **{f"shape-{i}": (lambda c=c: one_process(c)) for i, c in enumerate(SHAPES)},
    "nesting": nesting, "fifo": fifo, "huge": huge, "traversal": traversal,
    "two-nodes": two_nodes, "fresh-start": fresh_start,
}


def main(argv: list[str] | None = None) -> int:
    import subprocess

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--case":
        print(CASES[argv[1]]())
        return 0
    bad = 0
    for name in CASES:
        try:
            r = subprocess.run([sys.executable, "-m", "tests.stress.tier_defects", "--case", name],
                               capture_output=True, text=True, timeout=60)
            res = (r.stdout.strip().splitlines() or [f"no output (exit {r.returncode}): {r.stderr[-300:]}"])[-1]
        except subprocess.TimeoutExpired:
            res = "DEFECT: did not return within 60 s (hang)"
        bad += res != "ok"
        print(f"{name}: {res}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
