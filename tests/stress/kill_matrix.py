"""Kill matrix: kill one rank at a random point of a checkpointing job, then check everything.

Reproduce the README's table (>= 300 trials; roughly 5-15 s per trial on 2 busy cores)::

    .venv/bin/python -m tests.stress.kill_matrix --trials 300 --seed 1 --out kill-matrix-table.md

Each trial (drawn from the seed and its index, so ``--only 17,42`` reruns single trials):
a job of 2-4 gloo ranks (``--worlds``: any sizes, e.g. 8,16) starts on a root holding steps
1-3, restores the newest, saves three more steps through ``CheckpointManager`` (sync or
async, keep_last 1 or 2, so retention deletes), checks ``preempted`` and calls ``retain()``;
one rank (any, rank 0 included; rank 0 for the steps only it runs) is killed (SIGKILL or
``os._exit``) at one point of ``kill_inject.POINTS``: safeckpt's group creation (before the
first call, at the store rendezvous, in ``new_group``, inside gloo's connect), each
``Coordinator.decide`` of the protocol (restore's pick and check, each save's agree and
write, retain) at the entry of its local part, after it (before the gather), in rank 0's
resolve (at its start; rank 0's lease and sweep before staging; just before or after publish;
retention's start and first deletion) and after rank 0 resolved (before the broadcast); half
a data file written; a chunk read while the load checks; the load's apply (entry, half-way,
before its all-reduce); the async snapshot and the background group; the ``preempted``
all-reduce. At the retention points a third method, ``raise``, makes retention fail instead.
Then:

- hangs: every survivor must end within ``timeout + slack`` of the kill;
- survivors must raise a ``CheckpointError`` (RankFailure here), naming the killed rank or
  nobody, never another; time from the kill to each survivor's error is recorded; none may
  say "not published" for a checkpoint rank 0 published (unless it says the outcome is
  unknown); after a failed retention (``raise``) every rank says the checkpoint is committed
  and only retention failed;
- on disk: every visible entry is a checkpoint that verifies deep and holds exactly its
  step's values (no partial checkpoint); hidden leftovers only under staging/trash names;
  nothing known committed is lost (the newest valid step is at least the newest step any
  rank saw committed); a checkpoint rank 0 published before it died is there;
- a fresh restart of the job (same world size) restores the newest valid step bit-exactly
  (tensors, per-rank RNG) and saves one more.

``--tier`` runs the node-local tier's matrix instead (``tests/stress/kill_tier.py``: simulated
nodes with their own ``local_dir``, ``replicas=1``, ``durable_every=2``; kill points at every
step of the local write, replication, publish, drain to root and the tiered restore; the
restart must restore exactly the newest step complete on some tier); ``--cycle`` draws each of
its points in turn; with ``--overwrite`` the crash job's first save re-saves the step it
restored (each node replaces a published local step) and ``tier/publish-mid-replace`` is drawn
too.

Exit status 1 if any trial had a bad outcome.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.stress import kill_inject, kill_tier
from tests.stress.kill_inject import (
    AFTER_PUBLISH,
    OVERWRITE_POINTS,
    POINTS,
    RAISE_POINTS,
    SAVES,
    SEED_STEPS,
)

RUN_BUDGET = 180.0  # seconds a job may take before its kill (or in total, without one)
MISLEADING = ("No checkpoint was published", "Nothing was written")
RETENTION_ONLY = "is committed; only retention failed"
UNKNOWN = "is unknown here"  # the honest answer when the coordinator's outcome cannot be learnt


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(seed: int, index: int, timeout: float, worlds: Sequence[int] = (2, 3, 4),
           points: Sequence[str] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Trial ``index`` of ``seed``: the same spec every time. ``overwrite``: the crash job's
    first save overwrites the step it restored (and ``OVERWRITE_POINTS`` may be drawn)."""
    rng = random.Random(f"kill-matrix-{seed}-{index}")
    mode = rng.choice(["sync", "async"])
    drawable = [p for p in (points or POINTS) if overwrite or p not in OVERWRITE_POINTS]
    names = [p for p in drawable if mode in POINTS[p][0]]
    if not names:  # the chosen points exist only for the other mode
        mode = "async" if mode == "sync" else "sync"
        names = [p for p in drawable if mode in POINTS[p][0]]
    point = rng.choice(names)
    world = rng.choice(list(worlds))
    if point.endswith("/connect") and _lazy(world):
        # gloo connects nothing while a lazily connected group is created: no such point
        point = rng.choice([p for p in names if not p.endswith("/connect")] or names)
    victim = 0 if POINTS[point][1] else rng.randrange(world)
    methods = ["sigkill", "exit"] + (["raise"] if point in RAISE_POINTS else [])
    spec = {
        "trial": index, "seed": seed, "world": world, "mode": mode, "point": point,
        "victim": victim, "method": rng.choice(methods),
        "occurrence": rng.randint(1, SAVES - 1), "store_ops": rng.randint(1, 3),
        "keep_last": rng.choice([1, 2]), "timeout": timeout, "store_timeout": 60.0,
    }
    if overwrite:
        spec["overwrite"] = True
        if point in OVERWRITE_POINTS:
            spec["occurrence"] = 1  # only the first save is an overwrite
    return spec


def _lazy(world: int) -> bool:
    """Whether safeckpt connects its group's pairs lazily at this world size
    (SAFECKPT_LAZY_CONNECT, inherited by the jobs)."""
    from safeckpt.coord import dist as _dist

    lazy = getattr(_dist, "lazy_connect", None)
    return bool(lazy and lazy(world))


# ---------------------------------------------------------------------------- running jobs


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def run_job(ctx: Any, job: str, spec: dict[str, Any], root: str, trial_dir: str,
            slack: float, target: Callable[..., None] | None = None) -> dict[str, Any]:
    """Run one job's ranks (``target``: the worker, ``kill_inject.worker`` unless told); stop
    them if a survivor outlives ``kill + timeout + slack``."""
    world = spec["world"]
    port = free_port()
    procs = [ctx.Process(target=target or kill_inject.worker, args=(job, r, world, port, spec, root, trial_dir))
             for r in range(world)]
    started = time.time()
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    kill = None
    hung: list[int] = []
    def collect() -> None:
        for r in range(world):
            if r not in outs:
                out = _read_json(os.path.join(trial_dir, f"out-{job}-{r}.json"))
                if out is not None:
                    outs[r] = out

    while True:
        collect()
        if job == "crash" and kill is None:
            kill = _read_json(os.path.join(trial_dir, "kill.json"))
        pending = [r for r, p in enumerate(procs) if r not in outs and p.is_alive()]
        if not pending:
            collect()  # a rank that wrote its result and exited after the read above
            break
        limit = kill["t"] + spec["timeout"] + slack if kill else started + RUN_BUDGET
        if time.time() > limit:
            hung = pending
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    if job == "crash" and kill is None:
        kill = _read_json(os.path.join(trial_dir, "kill.json"))
    return {"outs": outs, "kill": kill, "hung": hung, "exitcodes": [p.exitcode for p in procs],
            "seconds": time.time() - started}


# ---------------------------------------------------------------------------- checking disk


def inspect_root(root: str) -> dict[str, Any]:
    """Visible checkpoints (each verified deep and compared with its step's values) and
    hidden leftovers."""
    import torch

    import safeckpt
    from safeckpt.format.manifest import STAGING_MARK, TRASH_MARK
    from safeckpt.storage.catalog import parse_step
    from safeckpt.storage.posix import replaced_final

    valid: list[int] = []
    partial: list[str] = []
    wrong: list[str] = []
    odd: list[str] = []
    names = sorted(os.listdir(root))
    for name in names:
        path = os.path.join(root, name)
        # An overwrite killed between its renames (no renameat2 flags): the old checkpoint under
        # its replaced name is the step's while that name is free (restore loads it from there).
        final = replaced_final(name)
        if final is not None and final not in names:
            step = parse_step(final)
        elif name.startswith("."):
            # the writer lease, and the run identity of a manager with local_dir (engine.local_tier)
            if (name not in (".safeckpt.lock", ".safeckpt-run.json") and STAGING_MARK not in name
                    and TRASH_MARK not in name and final is None):
                odd.append(name)
            continue
        else:
            step = parse_step(name)
        report = safeckpt.verify(path, deep=True)
        if step is None or not report.ok:
            partial.append(f"{name}: {'; '.join(report.problems)[:300]}")
            continue
        flat = safeckpt.read_state_dict(path)
        want = kill_inject.expected(step)
        bad = [k for k, v in want.items() if not (k in flat and torch.equal(flat[k], v))]
        if bad:
            wrong.append(f"{name}: {bad}")
        else:
            valid.append(step)
    return {"valid": valid, "partial": partial, "wrong": wrong, "odd_hidden": odd}


def _committed_steps(trial_dir: str) -> list[int]:
    steps = {SEED_STEPS}
    for name in os.listdir(trial_dir):
        if name.startswith("committed-"):
            with open(os.path.join(trial_dir, name)) as f:
                steps.update(int(x) for x in f.read().split())
    return sorted(steps)


# ------------------------------------------------------------------------------- one trial


def run_trial(ctx: Any, spec: dict[str, Any], seeds: dict[int, str], workdir: str,
              slack: float) -> dict[str, Any]:
    trial_dir = os.path.join(workdir, f"trial-{spec['trial']:05d}")
    shutil.rmtree(trial_dir, ignore_errors=True)
    os.makedirs(trial_dir)
    root = os.path.join(trial_dir, "root")
    shutil.copytree(seeds[spec["world"]], root, symlinks=True)
    res: dict[str, Any] = {"spec": spec, "dir": trial_dir, "problems": []}
    problems = res["problems"]

    crash = run_job(ctx, "crash", spec, root, trial_dir, slack)
    kill = crash["kill"]
    res["seconds_crash"] = crash["seconds"]
    res["killed"] = kill is not None
    if kill is None:
        problems.append("no-kill: the victim never reached its kill point")
    if crash["hung"]:
        problems.append(f"hang: ranks {crash['hung']} not done {spec['timeout'] + slack:.0f}s after the kill")
    res["hangs"] = len(crash["hung"])

    disk = inspect_root(root)
    res["disk"] = disk
    committed = _committed_steps(trial_dir)
    newest = max(disk["valid"], default=None)
    res["lost"] = newest is None or newest < max(committed)
    if res["lost"]:
        problems.append(f"lost: newest valid step {newest}, but step {max(committed)} was committed")
    if disk["partial"]:
        problems.append(f"partial visible: {disk['partial']}")
    if disk["wrong"]:
        problems.append(f"wrong values: {disk['wrong']}")
    if disk["odd_hidden"]:
        problems.append(f"unexpected hidden entries: {disk['odd_hidden']}")
    per_save = POINTS[spec["point"]][2]
    first = SEED_STEPS if spec.get("overwrite") else SEED_STEPS + 1  # the crash job's first save
    killed_step = first - 1 + (kill.get("call") or spec["occurrence"]) if per_save and kill else None
    res["killed_step"] = killed_step
    published = killed_step is not None and killed_step in disk["valid"]
    if spec.get("overwrite") and killed_step == SEED_STEPS:  # valid before the save: the old one
        published = spec["point"] in AFTER_PUBLISH
    raised = spec["method"] == "raise"
    if killed_step is not None and (spec["point"] in AFTER_PUBLISH or raised) and not published:
        res["lost"] = True
        problems.append(f"lost: rank 0 published step {killed_step} before the kill, but it is not a valid checkpoint")

    res["survivors"] = {}
    for r in range(spec["world"]):
        if r == spec["victim"] and not raised:  # a "raise" victim lives on: it must report too
            continue
        out = crash["outs"].get(r)
        if out is None:
            continue  # hung (counted above) or died on its own
        info: dict[str, Any] = {"type": out.get("type"), "where": out.get("where"), "msg": out.get("msg", "")}
        res["survivors"][r] = info
        if out.get("restore_mismatch"):
            problems.append(f"rank {r}: restored wrong values: {out['restore_mismatch']}")
        if out["ok"]:
            if kill is not None:
                problems.append(f"rank {r}: no error although rank {spec['victim']} was killed")
            continue
        if "CheckpointError" not in out["mro"]:
            problems.append(f"rank {r}: non-CheckpointError {out['type']}: {out['msg'][:300]}")
            info["non_checkpoint"] = True
        if kill is not None:
            info["tte"] = out["t_err"] - kill["t"]
        blamed = sorted(int(k) for k in out.get("failures", {}))
        info["blamed"] = blamed
        if blamed and blamed != [spec["victim"]]:
            info["wrong_blame"] = True
            problems.append(f"rank {r}: blamed ranks {blamed}, killed was {spec['victim']}: {out['msg'][:300]}")
        info["unknown"] = UNKNOWN in out["msg"]
        if raised and kill is not None:
            info["retention_only"] = RETENTION_ONLY in out["msg"]
            if not info["retention_only"]:
                problems.append(f"rank {r}: retention failed after publish, but the error does not say "
                                f"{RETENTION_ONLY!r}: {out['msg'][:300]}")
        if published and any(m in out["msg"] for m in MISLEADING) and not info["unknown"]:
            info["misleading"] = True
            problems.append(f"rank {r}: says nothing was published, but step {killed_step} was: {out['msg'][:300]}")

    if newest is not None:
        restart = run_job(ctx, "restart", spec, root, trial_dir, slack)
        outs = restart["outs"]
        bad = [f"rank {r}: {o.get('type')}: {o.get('msg', '')[:300]}" for r, o in sorted(outs.items()) if not o["ok"]]
        bad += [f"rank {r}: restored step {o.get('restored')}, newest valid is {newest}"
                for r, o in sorted(outs.items()) if o["ok"] and o.get("restored") != newest]
        bad += [f"rank {r}: restored values differ: {o['restore_mismatch']}"
                for r, o in sorted(outs.items()) if o.get("restore_mismatch")]
        if len(outs) < spec["world"] or restart["hung"]:
            bad.append(f"restart: ranks missing {sorted(set(range(spec['world'])) - set(outs))}, hung {restart['hung']} "
                       f"(exit codes {restart['exitcodes']})")
        after = inspect_root(root)
        if newest + 1 not in after["valid"]:
            bad.append(f"restart: its save of step {newest + 1} is not a valid checkpoint")
        res["restart_failed"] = bool(bad)
        problems.extend(f"restart: {b}" for b in bad)
    return res


# --------------------------------------------------------------------------------- the run


def make_seeds(ctx: Any, worlds: Sequence[int], workdir: str, timeout: float) -> dict[int, str]:
    """One root per world size holding steps 1..SEED_STEPS, saved by that many ranks."""
    seeds = {}
    for world in sorted(set(worlds)):
        seed_dir = os.path.join(workdir, f"seed-{world}")
        shutil.rmtree(seed_dir, ignore_errors=True)
        os.makedirs(seed_dir)
        root = os.path.join(seed_dir, "root")
        spec = {"world": world, "mode": "sync", "keep_last": None, "timeout": timeout,
                "store_timeout": 60.0, "victim": -1}
        out = run_job(ctx, "seed", spec, root, seed_dir, slack=30.0)
        if len(out["outs"]) != world or not all(o["ok"] for o in out["outs"].values()):
            raise RuntimeError(f"seeding {world} ranks failed: {out}")
        seeds[world] = root
    return seeds


def context() -> Any:
    ctx = mp.get_context("forkserver")  # fresh processes per job, without re-importing torch
    ctx.set_forkserver_preload(["torch", "torch.distributed", "safeckpt", "tests.stress.kill_inject",
                                "tests.stress.kill_tier"])
    return ctx


def run_matrix(trials: int, seed: int, *, timeout: float = 10.0, slack: float = 10.0,
               worlds: Sequence[int] = (2, 3, 4), points: Sequence[str] | None = None,
               only: Sequence[int] | None = None, overwrite: bool = False,
               environment: dict[str, Any] | None = None, tier: bool = False, cycle: bool = False,
               **kwargs: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run trials ``0..trials-1`` (or ``only``) of ``seed``; return (summary, per-trial results)."""
    indices = list(only) if only else list(range(trials))
    # environment: where the jobs run (kill_inject.worker applies it): "nofile" (RLIMIT_NOFILE),
    # "plain_torchrun" (TORCHELASTIC_RUN_ID=none: the lease tells jobs apart by a token),
    # "second_manager" (a second async manager in each process, saving every step too),
    # "mesh2d" (the model's tensors are DTensors on a 2x2 mesh; 4 ranks)
    if tier:  # the node-local tier's phases (kill_tier): its own layouts and points
        specs = [kill_tier.sample(seed, i, timeout, list(points) if points else None, cycle=cycle,
                                  overwrite=overwrite) for i in indices]
    else:
        specs = [{**sample(seed, i, timeout, worlds, points, overwrite), **(environment or {})} for i in indices]
    return run_specs(specs, seed=seed, timeout=timeout, slack=slack, **kwargs)


def run_specs(specs: Sequence[dict[str, Any]], *, seed: int, timeout: float, slack: float,
              workdir: str | None = None, keep: bool = False,
              log: Callable[[str], None] = lambda s: None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the given trials (see ``sample`` for a spec); return (summary, per-trial results)."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="safeckpt-killmatrix-")
    ctx = context()
    results = []
    t0 = time.time()
    try:
        seeds = make_seeds(ctx, [s["world"] for s in specs if not s.get("tier")], workdir, timeout)
        tier_seeds = kill_tier.make_seeds(ctx, {(s["nodes"], s["per_node"]) for s in specs if s.get("tier")},
                                          workdir, timeout, run_job)
        for n, spec in enumerate(specs, 1):
            if spec.get("tier"):
                res = kill_tier.run_trial(ctx, spec, tier_seeds, workdir, slack, run_job)
            else:
                res = run_trial(ctx, spec, seeds, workdir, slack)
            results.append(res)
            ttes = [s["tte"] for s in res["survivors"].values() if "tte" in s]
            layout = (f" {spec['nodes']}x{spec['per_node']}{' lose-node' if spec['lose_node'] else ''}"
                      if spec.get("tier") else "")
            log(f"[{n}/{len(specs)} {time.time() - t0:.0f}s] trial {spec['trial']} {spec['point']} "
                f"w={spec['world']}{layout} {spec['mode']} victim={spec['victim']} {spec['method']}: "
                f"{'OK' if not res['problems'] else 'BAD'} tte={max(ttes, default=0):.1f}s"
                + "".join(f"\n    {p}" for p in res["problems"]))
            if res["problems"] and keep and spec.get("tier"):  # every tier trial runs at one path
                shutil.rmtree(res["dir"] + f"-{spec['trial']:05d}", ignore_errors=True)
                os.rename(res["dir"], res["dir"] + f"-{spec['trial']:05d}")
            elif not res["problems"] or not keep:
                shutil.rmtree(res["dir"], ignore_errors=True)
    finally:
        if own and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(results, seed=seed, timeout=timeout, slack=slack, seconds=time.time() - t0)
    return summary, results


def summarize(results: list[dict[str, Any]], *, seed: int, timeout: float, slack: float,
              seconds: float) -> dict[str, Any]:
    survivors = [s for r in results for s in r["survivors"].values()]
    ttes = [s["tte"] for s in survivors if "tte" in s]
    by_point: dict[str, dict[str, Any]] = {}
    for r in results:
        p = by_point.setdefault(r["spec"]["point"], {"trials": 0, "bad": 0, "tte": []})
        p["trials"] += 1
        p["bad"] += bool(r["problems"])
        p["tte"] += [s["tte"] for s in r["survivors"].values() if "tte" in s]
    count = collections.Counter
    return {
        "seed": seed, "timeout": timeout, "slack": slack, "seconds": seconds,
        "trials": len(results),
        "kills": sum(r["killed"] for r in results),
        "worlds": dict(sorted(count(r["spec"]["world"] for r in results).items())),
        "modes": dict(sorted(count(r["spec"]["mode"] for r in results).items())),
        "methods": dict(sorted(count(r["spec"]["method"] for r in results).items())),
        "victim_rank0": sum(r["spec"]["victim"] == 0 for r in results),
        "points": len(by_point),
        "retention_only": sum(bool(s.get("retention_only")) for s in survivors),
        "raise_reports": sum("retention_only" in s for s in survivors),
        "lost": sum(r["lost"] for r in results),
        "partial": sum(bool(r["disk"]["partial"]) for r in results),
        "wrong_values": sum(bool(r["disk"]["wrong"]) for r in results),
        "odd_hidden": sum(bool(r["disk"]["odd_hidden"]) for r in results),
        "hangs": sum(r["hangs"] for r in results),
        "survivors": len(survivors),
        "error_types": dict(count(s["type"] or "none" for s in survivors).most_common()),
        "non_checkpoint": sum(bool(s.get("non_checkpoint")) for s in survivors),
        "no_error": sum(s["type"] is None for s in survivors),
        "wrong_blame": sum(bool(s.get("wrong_blame")) for s in survivors),
        "unnamed": sum(s.get("blamed") == [] for s in survivors),
        "misleading": sum(bool(s.get("misleading")) for s in survivors),
        "outcome_unknown": sum(bool(s.get("unknown")) for s in survivors),
        "restart_failed": sum(bool(r.get("restart_failed")) for r in results),
        "torn_local": sum(bool(r.get("local", {}).get("torn")) for r in results),
        "lose_node": sum(bool(r["spec"].get("lose_node")) for r in results),
        "two_nodes_gone": sum(r.get("nodes_gone", 0) > 1 for r in results),
        "layouts": dict(sorted(count(f"{r['spec']['nodes']}x{r['spec']['per_node']}" for r in results
                                     if r["spec"].get("tier")).items())),
        "no_kill": sum(not r["killed"] for r in results),
        "max_tte": max(ttes, default=0.0),
        "late": sum(t > timeout + 2.0 for t in ttes),
        "bad_trials": [r["spec"]["trial"] for r in results if r["problems"]],
        "by_point": {k: {"trials": v["trials"], "bad": v["bad"], "max_tte": max(v["tte"], default=0.0)}
                     for k, v in sorted(by_point.items())},
    }


def table_markdown(s: dict[str, Any], command: str) -> str:
    def fmt(d: dict[Any, int]) -> str:
        return ", ".join(f"{k}: {v}" for k, v in d.items())

    rows = [
        ("trials (one rank killed in each)", s["trials"]),
        ("world sizes", fmt(s["worlds"])),
        ("saves", fmt(s["modes"])),
        ("kill method", fmt({"SIGKILL": s["methods"].get("sigkill", 0), "os._exit": s["methods"].get("exit", 0),
                             "retention raises (rank 0)": s["methods"].get("raise", 0)})),
        ("kill points drawn", s["points"]),
        ("killed rank was rank 0 (hosts the store; resolves every decide)", s["victim_rank0"]),
        ("**checkpoints lost**", s["lost"]),
        ("**partial checkpoints visible**", s["partial"]),
        ("**wrong values** (visible checkpoint or restore)", s["wrong_values"]),
        (f"**hangs** (survivor not done {s['timeout']:g} s + {s['slack']:g} s after the kill)", s["hangs"]),
        ("**survivors raising a non-CheckpointError**", s["non_checkpoint"]),
        ("survivors that raised no error", s["no_error"]),
        ("survivor errors by type", fmt(s["error_types"])),
        ("errors blaming a rank that was not killed", s["wrong_blame"]),
        ("errors naming no rank (cause unknown to that rank)", s["unnamed"]),
        ('errors saying "not published" for a published checkpoint', s["misleading"]),
        ("errors saying whether rank 0 published is unknown (it was gone)", s["outcome_unknown"]),
        (f'failed retention: errors saying "{RETENTION_ONLY}"', f"{s['retention_only']} of {s['raise_reports']}"),
        ("restarts not restoring the newest valid checkpoint bit-exactly", s["restart_failed"]),
        ("unexpected hidden entries in the root", s["odd_hidden"]),
        *([("nodes x ranks per node", fmt(s["layouts"])),
           ("victim's node directory wiped after the kill (node lost)", s["lose_node"]),
           ("of which a second node's copies were gone too (more than replicas=1 covers)", s["two_nodes_gone"]),
           ("**torn local files under a published step name**", s["torn_local"])] if s["layouts"] else []),
        (f"max time from kill to a survivor's error (timeout {s['timeout']:g} s)", f"{s['max_tte']:.1f} s"),
        ("survivor errors later than timeout + 2 s after the kill", s["late"]),
    ]
    out = [
        f"Kill matrix: `{command}` ({s['seconds'] / 60:.0f} min on this machine)",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        "| kill point | trials | bad | max time to error (s) |",
        "|---|---:|---:|---:|",
        *[f"| {k} | {v['trials']} | {v['bad']} | {v['max_tte']:.1f} |" for k, v in s["by_point"].items()],
        "",
    ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.stress.kill_matrix", description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=10.0, help="SAFECKPT_TIMEOUT in the jobs (s)")
    ap.add_argument("--slack", type=float, default=10.0, help="hang = survivor not done timeout+slack after the kill")
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--points", default="", help="comma-separated subset of kill points")
    ap.add_argument("--only", default="", help="comma-separated trial indices of this seed to rerun")
    ap.add_argument("--out", default="", help="write the markdown table here")
    ap.add_argument("--json", default="", help="write every trial's result here")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the directories of bad trials")
    ap.add_argument("--overwrite", action="store_true",
                    help="the crash job's first save overwrites the restored step; draws "
                         "save/commit-mid-publish too (for a --workdir on NFS or a FUSE mount)")
    ap.add_argument("--nofile", type=int, default=0, help="RLIMIT_NOFILE of the jobs (a low descriptor limit)")
    ap.add_argument("--plain-torchrun", action="store_true",
                    help="TORCHELASTIC_RUN_ID=none in the jobs, as plain torchrun (no --rdzv-id) sets it")
    ap.add_argument("--mesh2d", action="store_true",
                    help="the model's tensors are DTensors on a 2x2 device mesh (implies --worlds 4)")
    ap.add_argument("--second-manager", action="store_true",
                    help="each process also saves every step through a second async manager (another root)")
    ap.add_argument("--tier", action="store_true",
                    help="the node-local tier (local_dir, replicas=1, durable_every=2) on simulated nodes; "
                         "kill points of tests/stress/kill_tier.py (local write, replicate, publish, drain, "
                         "tiered restore)")
    ap.add_argument("--cycle", action="store_true",
                    help="with --tier: trial i kills at point i modulo the number of points (each in turn)")
    args = ap.parse_args(argv)
    environment: dict[str, Any] = {}
    if args.nofile:
        environment["nofile"] = args.nofile
    if args.plain_torchrun:
        environment["plain_torchrun"] = True
    if args.second_manager:
        environment["second_manager"] = True
    if args.mesh2d:
        environment["mesh2d"] = True
        args.worlds = "4"
    points = [p for p in args.points.split(",") if p]
    known = kill_tier.ALL_POINTS if args.tier else POINTS
    unknown = set(points) - set(known)
    if unknown:
        ap.error(f"unknown kill points {sorted(unknown)}; known: {', '.join(known)}")
    summary, results = run_matrix(
        args.trials, args.seed, timeout=args.timeout, slack=args.slack,
        worlds=[int(w) for w in args.worlds.split(",")], points=points or None,
        only=[int(i) for i in args.only.split(",") if i], workdir=args.workdir, keep=args.keep,
        overwrite=args.overwrite, environment=environment, tier=args.tier, cycle=args.cycle,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    command = f".venv/bin/python -m tests.stress.kill_matrix --trials {args.trials} --seed {args.seed}"
    if args.worlds != "2,3,4":
        command += f" --worlds {args.worlds}"
    if args.timeout != 10.0:
        command += f" --timeout {args.timeout:g}"
    if args.overwrite:
        command += " --overwrite"
    if args.nofile:
        command += f" --nofile {args.nofile}"
    if args.plain_torchrun:
        command += " --plain-torchrun"
    if args.second_manager:
        command += " --second-manager"
    if args.mesh2d:
        command += " --mesh2d"
    if args.tier:
        command += " --tier" + (" --cycle" if args.cycle else "")
    if args.workdir:
        command += f" --workdir {args.workdir}"
    table = table_markdown(summary, command)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "trials": results}, f, indent=1, default=str)
    return 1 if summary["bad_trials"] else 0


if __name__ == "__main__":
    sys.exit(main())
