"""The fuzz suite over node-local copies (issue 28): the same mutants as ``tests.stress.fuzz``,
applied to a step held on the node-local tier, read by the tiered restore.

    .venv/bin/python -m tests.stress.fuzz_tier --mutants 300 --seed 1 --out FILE.md

For each mutant a workspace holds ``root`` with the base's older checkpoint (step 1, durable)
and a ``local_dir`` whose run directory holds the base's newer checkpoint as local step 2 (its
manifest and data files, plus the tier's own records: the run's ``tier.json`` and the step's),
damaged by the mutant. Besides the fuzz suite's mutants (manifest, index, data files,
directory), ``tier.*`` mutants damage what only the tier reads: the step's and the run's
``tier.json``, the node's ``quarantine.json``, a manifest that is valid JSON but not an object,
file records that are not objects or lack their checksum.

The calls are the fuzz suite's (``verify`` deep and shallow, ``read_state_dict``, ``load`` of the
damaged local step directory) with ``restore`` replaced by
``CheckpointManager(root, local_dir=...).restore`` (one process, the node its host), classified
by the same oracle (``tests.helpers.fuzz_oracle.classify``): the tiered restore must load step 2
exactly as saved or fall back to step 1 from root, or raise a CheckpointError where the plain
load does for a consistent forged checkpoint; never another exception, never different values;
no read of a file outside the workspace nor under its ``outside`` directory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

from tests.helpers import fuzz_oracle
from tests.helpers.fuzz_bases import (
    MANIFEST,
    STEP_A,
    STEP_B,
    first_difference,
    fresh_state,
    snapshot,
)
from tests.helpers.fuzz_files import apply
from tests.helpers.fuzz_mutants import BaseView, Mutant, generate
from tests.helpers.fuzz_pool import CANARY, Pool
from tests.stress.fuzz import findings, make_bases, table

CALLS = ("verify_deep", "verify_shallow", "read", "load", "restore")
_OUTSIDE_DIR: list[str] = []  # the workspace's "outside" directory while a mutant runs
_OUTSIDE_READS: list[str] = []


def _audit_outside(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not _OUTSIDE_DIR:
        return
    try:
        path, flags = args[0], (args[2] if len(args) > 2 and isinstance(args[2], int) else 0)
        if isinstance(path, (str, bytes, os.PathLike)):
            p = os.path.abspath(os.fsdecode(path))
            if flags & os.O_NOFOLLOW:  # a final symlink fails with ELOOP: only the parent is followed
                real = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
            else:
                real = os.path.realpath(p)
            if real.startswith(_OUTSIDE_DIR[0] + os.sep):
                _OUTSIDE_READS.append(real)
    except BaseException:  # noqa: BLE001 - an audit hook must never raise into the caller
        pass


# ---------------------------------------------------------------------- tier-only mutants


def tier_mutants(views: dict[str, BaseView], start: int) -> list[Mutant]:
    """Damage to what only the tier reads (paths relative to the local step directory)."""
    out: list[Mutant] = []
    name = sorted(views)[0]
    v = views[name]
    data = sorted(v.manifest["files"])[0]
    good_rec = v.manifest["files"][data]
    cases: list[tuple[str, str, tuple[tuple[Any, ...], ...], bool]] = [
        ("tier.step_record", "the step's tier.json is a JSON list", (("write", "tier.json", b"[]"),), False),
        ("tier.step_record", "the step's tier.json is not JSON", (("write", "tier.json", b"{\x00"),), False),
        ("tier.step_record", "the step's tier.json names another root",
         (("write", "tier.json", b'{"root": "/elsewhere", "step": 2, "node": "x", "own": [], "replicas": []}'),), False),
        ("tier.step_record", "the step's tier.json names another step",
         (("write", "tier.json", b'{"root": "@ROOT", "step": 3, "node": "x", "own": [], "replicas": []}'),), False),
        ("tier.step_record", "the step's tier.json removed", (("remove", "tier.json"),), False),
        ("tier.run_record", "the run's tier.json is a JSON string", (("write", "../tier.json", b'"x"'),), False),
        ("tier.run_record", "the run's tier.json names another root",
         (("write", "../tier.json", b'{"format": "safeckpt-local-tier", "root": "/elsewhere"}'),), False),
        ("tier.quarantine", "the node's quarantine.json is a JSON list", (("write", "../quarantine.json", b"[2]"),), False),
        ("tier.quarantine", "the node's quarantine.json maps step 2 to a list",
         (("write", "../quarantine.json", b'{"2": ["x"]}'),), False),
        ("tier.manifest_shape", "the manifest is a JSON list", (("write", MANIFEST, b"[]"),), True),
        ("tier.manifest_shape", "the manifest is a JSON string", (("write", MANIFEST, b'"x"'),), True),
        ("tier.manifest_shape", "the manifest is a JSON number", (("write", MANIFEST, b"7"),), True),
        ("tier.manifest_shape", "files is a list", (("write", MANIFEST, json.dumps({**v.manifest, "files": []}).encode()),), True),
        ("tier.manifest_shape", "a file record is a number",
         (("write", MANIFEST, json.dumps({**v.manifest, "files": {**v.manifest["files"], data: 5}}).encode()),), True),
        ("tier.manifest_shape", "a file record lacks its xxh3_128",
         (("write", MANIFEST, json.dumps({**v.manifest, "files": {**v.manifest["files"], data: {
             k: x for k, x in good_rec.items() if k != "xxh3_128"}}}).encode()),), True),
        ("tier.manifest_shape", "a file record's size is a string",
         (("write", MANIFEST, json.dumps({**v.manifest, "files": {**v.manifest["files"], data: {
             **good_rec, "size": str(good_rec["size"])}}}).encode()),), True),
    ]
    for i, (cls, desc, ops, changed) in enumerate(cases):
        out.append(Mutant(start + i, name, cls, desc, ops, changed=changed))
    return out


# ------------------------------------------------------------------------------- worker


def run_tier_mutant(m: Mutant, base_root: str, refs: fuzz_oracle.Refs, scratch: str, progress: Any) -> dict[str, Any]:
    from safeckpt.engine.local_tier import TIER_FILE, NodeDir

    ws = tempfile.mkdtemp(prefix=f"t{m.id}-", dir=scratch)
    try:
        root, local, outside = (os.path.join(ws, n) for n in ("root", "local", "outside"))
        os.makedirs(root)
        os.makedirs(outside)
        shutil.copytree(os.path.join(base_root, STEP_A), os.path.join(root, STEP_A), symlinks=True)
        nd = NodeDir(local, root)
        nd.ensure()
        ckpt = nd.step_dir(2)
        shutil.copytree(os.path.join(base_root, STEP_B), ckpt, symlinks=True)
        files = sorted(n for n in os.listdir(ckpt) if n != MANIFEST)
        with open(os.path.join(ckpt, TIER_FILE), "w") as f:
            json.dump({"root": root, "step": 2, "node": nd.node, "own": files, "replicas": []}, f)
        # The fuzz suite's mutants name the damaged checkpoint itself "@root/<STEP_B>": here it
        # is the local step directory (an absolute name: apply joins it to nothing).
        def here(a: Any) -> Any:
            if isinstance(a, bytes):
                return a.replace(b"@ROOT", root.encode())
            if isinstance(a, str) and (a == f"@root/{STEP_B}" or a.startswith(f"@root/{STEP_B}/")):
                return ckpt + a[len(f"@root/{STEP_B}"):]
            return a

        ops = tuple(tuple(here(a) for a in op) for op in m.ops)
        progress("apply")
        apply(ops, ws, ckpt)
        rss0 = fuzz_oracle._maxrss_mb()
        calls: dict[str, dict[str, Any]] = {}
        outside_reads: dict[str, list[str]] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in CALLS:
                progress(name)
                del fuzz_oracle._OUTSIDE[:]
                del _OUTSIDE_READS[:]
                # the plain readers are given the step directory itself (fuzz_oracle's watch);
                # the restore only root and local_dir: nothing under "outside" is its to read
                _OUTSIDE_DIR[:] = [os.path.realpath(outside)] if name == "restore" else []
                try:
                    if name == "restore":
                        calls[name] = _tier_restore(ws, root, local, refs)
                    else:
                        calls[name] = fuzz_oracle._call(name, ckpt, root, refs, progress)
                finally:
                    _OUTSIDE_DIR[:] = []
                # A name relative to a directory descriptor (openat: the posix storage walks a
                # path one component at a time) comes to the audit hook without its directory
                # and reads as relative to the working directory: the worker runs in an empty
                # directory of its own (checked empty below), and such names are dropped.
                cwd = os.getcwd() + os.sep
                seen = sorted({p for p in set(fuzz_oracle._OUTSIDE) | set(_OUTSIDE_READS)
                               if not p.startswith(cwd)})
                if os.listdir(cwd):
                    seen.append(f"the working directory is not empty: {os.listdir(cwd)[:3]}")
                if seen:
                    outside_reads[name] = seen[:3]
        rss = fuzz_oracle._maxrss_mb() - rss0
    finally:
        progress("cleanup")
        fuzz_oracle.cleanup(ws)
    return fuzz_oracle.classify(m, calls, outside_reads, rss)


def _tier_restore(ws: str, root: str, local: str, refs: fuzz_oracle.Refs) -> dict[str, Any]:
    """The tiered restore (one process); the result in the shape of the oracle's ``restore``."""
    import gc

    import safeckpt

    out: dict[str, Any] = {"ok": False}
    state = fresh_state(refs.base)
    before = snapshot(state)
    fuzz_oracle._WATCH = (os.path.abspath(ws), os.path.realpath(ws))  # root, local dir: both in ws
    rss0 = fuzz_oracle._maxrss_mb()
    peak0 = fuzz_oracle._reset_peak()
    t0 = time.monotonic()
    try:
        mgr = safeckpt.CheckpointManager(root, local_dir=local, keep_last=None, preemption_signals=())
        try:
            step = mgr.restore(state)
        finally:
            mgr.close()
        ref = {1: refs.state_a, 2: refs.state_b}.get(step)
        diff = first_difference(ref, snapshot(state)) if ref is not None else None
        out.update(ok=True, step=step, diff=diff)
    except Exception as exc:  # noqa: BLE001 - classified by the oracle
        out["exc"] = fuzz_oracle._describe(exc)
        out["modified"] = first_difference(before, snapshot(state))
    finally:
        gc.collect()
        fuzz_oracle._WATCH = None
        out["secs"] = round(time.monotonic() - t0, 3)
        out["rss_mb"] = round(fuzz_oracle._maxrss_mb() - rss0)
        out["peak_mb"] = round(fuzz_oracle._call_peak_mb(peak0))
    return out


def worker_main(conn: Any, bases: dict[str, str], scratch: str, calls: tuple[str, ...] = CALLS) -> None:
    """fuzz_oracle.worker_main, with the tier's workspace and restore."""
    try:
        os.chdir(tempfile.mkdtemp(prefix="cwd-", dir=scratch))  # empty: see run_tier_mutant
        sys.addaudithook(fuzz_oracle._audit)
        sys.addaudithook(_audit_outside)
        import torch

        torch.set_num_threads(1)
        refs = {name: fuzz_oracle.Refs(root, name) for name, root in bases.items()}
        conn.send(("ready", os.getpid()))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        conn.send(("error", "".join(traceback.format_exception(exc))))
        return
    while True:
        m = conn.recv()
        if m is None:
            return
        try:
            result = run_tier_mutant(m, bases[m.base], refs[m.base], scratch, lambda s: conn.send(("call", s)))
        except Exception as exc:  # noqa: BLE001 - the harness itself failed on this mutant
            result = {"mutant": fuzz_oracle.mutant_dict(m), "outcome": "BAD", "calls": {},
                      "bad": {"CRASH": "fuzzer error: " + "".join(traceback.format_exception(exc))[-600:]},
                      "rss_mb": 0.0}
        conn.send(("done", result))


class TierPool(Pool):
    """The fuzz suite's pool (one worker, HANG and CRASH detection) running this worker."""

    def _start_once(self) -> None:
        import tests.helpers.fuzz_pool as fuzz_pool

        real = fuzz_pool.worker_main
        fuzz_pool.worker_main = worker_main  # the pool starts fuzz_pool.worker_main
        try:
            super()._start_once()
        finally:
            fuzz_pool.worker_main = real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.stress.fuzz_tier", description=__doc__.split("\n")[0])
    ap.add_argument("--mutants", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bases", default="", help="where the fuzz bases are kept (default: a temp dir)")
    ap.add_argument("--no-ddp", action="store_true", help="the single-process bases only")
    ap.add_argument("--only", default="", help="comma-separated mutant ids to rerun")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    workdir = args.bases or tempfile.mkdtemp(prefix="safeckpt-fuzz-tier-bases-")
    t0 = time.monotonic()
    bases = make_bases(workdir, ddp=not args.no_ddp)
    views = {name: BaseView.load(name, root) for name, root in bases.items()}
    mutants = list(generate(views, args.seed, args.mutants))
    mutants += tier_mutants(views, args.mutants)
    if args.only:
        wanted = {int(i) for i in args.only.split(",")}
        mutants = [m for m in mutants if m.id in wanted]
    results = []
    with TierPool(bases, call_timeout=30.0) as pool:
        for n, m in enumerate(mutants, 1):
            results.append(pool.run(m))
            if n % 50 == 0:
                print(f"{n} mutants, {sum(bool(r['bad']) for r in results)} bad, {time.monotonic() - t0:.0f}s",
                      file=sys.stderr, flush=True)
        canary = pool.run(CANARY, timeout=3)
        if "blocked" not in canary["bad"].get("HANG", ""):
            raise RuntimeError(f"the fuzzer's hang detection is broken: {canary}")
    command = f"python -m tests.stress.fuzz_tier --mutants {args.mutants} --seed {args.seed}" + (
        " --no-ddp" if args.no_ddp else "")
    text = (f"Fuzz over the local tier: {len(results)} mutants ({args.mutants} of the fuzz suite + "
            f"{len(results) - args.mutants if not args.only else '?'} tier.*), seed {args.seed}, bases "
            f"{', '.join(sorted(bases))}, {time.monotonic() - t0:.0f}s. Command: `{command}`.\n\n"
            + table(results) + "\n\n" + findings(results))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 1 if any(r["bad"] for r in results) else 0


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    sys.exit(main())
