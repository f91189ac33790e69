"""Kill matrix over the node-local tier (``kill_matrix --tier``; issue 28): the crash job uses
``CheckpointManager(root, local_dir=..., durable_every=2, replicas=1, keep_local=2)`` on
simulated nodes (``GROUP_RANK`` = rank // per_node, each node its own ``local_dir``), and one
rank is killed at one step of the tier's phases.

Each trial starts from a seed made once per layout: steps 1-3 saved through the tier (step 2
durable, so root holds 2; every node keeps 2 and 3 locally), the job killed without close();
then the last node's ``local_dir`` is wiped (a node lost before the trial), so the crash job's
start-up restore verifies, fetches step 3's files to that node from its peers and loads.
The crash job then saves steps 4 (durable: drained to root) and 5 (local only), waiting for
each, and closes (close drains 5 to root). One rank dies (SIGKILL or ``os._exit``) at:

- each decide of the tier (``local-write``, ``replicate``, ``local-publish``; the drain's
  ``durable-begin`` and ``write``; the restore's ``tier-run`` (the manager's first tier
  collective), ``tier-inventory``, ``tier-verify``, ``tier-plan``, ``tier-fetch``): at its
  entry, after its local part, at rank 0's resolve, after it;
- each step inside them: half of a data file written into the node's partial directory, that
  file's fsync; the replica transfer's entry, the first ``isend`` posted, everything received
  (before the checksum), a replica written before its rename; the node's manifest written
  before its rename, the partial directory's rename into place (before, after), local
  retention's first deletion; the drain's half-written root file, publish (before, after),
  root retention's first deletion; a node's copy being hashed by the restore's verify, the
  fetch's first ``isend``, a fetched file written before its rename; the load's apply.

``occurrence`` 1 is step 4's save (and its drain), 2 is step 5's (and the drain at close).
With ``lose_node`` the victim's node directory is wiped after the crash job (the whole node
lost, not only one process).

Then: every survivor raises a CheckpointError within ``timeout + slack``, blaming the victim
or nobody; root holds only valid checkpoints (verified deep, each exactly its step's values);
every published local step directory holds only files that match its manifest (never a torn
file under a published name); nothing known complete is lost (every step some rank saw
``wait()`` return for stays complete on some tier; every step known durable is in root);
a fresh restart restores exactly the newest step that is complete on some tier (the union of
the nodes' verified copies, or root), bit-exact (tensors and per-rank RNG), then saves one
more step and drains it to root at close.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from tests.stress import kill_inject
from tests.stress.kill_inject import Killer, make_state, set_step, state_matches

SEED_LAST = 3  # the seed saves steps 1..3 (2 durable)
CRASH_SAVES = 2  # the crash job saves 4 (durable) and 5 (local; drained at close)
DURABLE_EVERY = 2
KEEP_LOCAL = 2
LAYOUTS = ((2, 1), (3, 1), (2, 2))  # (nodes, ranks per node)

# Victims: ANY rank, rank 0 (R0: it resolves), the FIRST rank of a node (it publishes the
# node's step), a rank of the LACKING node (wiped before the trial: it receives the restore's
# fetches), a HOLDER (a rank of another node: it sends them).
ANY, R0, FIRST, LACKING, HOLDER = "any", "r0", "first", "lacking", "holder"
FIRST_HOLDER = "first-holder"  # the first rank of a node other than the lacking one

# point -> (decide phase, when, victim, per save (occurrence 1..2) or once)
TIER_POINTS: dict[str, tuple[str, str, str, bool]] = {
    "tier/agree": ("agree", "entry", ANY, True),  # the first save's in the blocking part, then speculative
    "tier/agree-after": ("agree", "after", ANY, True),
    "tier/agree-resolve": ("agree", "resolve", R0, True),
    "tier/agree-decided": ("agree", "decided", R0, True),
    "tier/local-write": ("local-write", "entry", ANY, True),
    "tier/local-write-mid-file": ("local-write", "inside", ANY, True),
    "tier/local-write-fsync": ("local-write", "inside", ANY, True),
    "tier/local-write-after": ("local-write", "after", ANY, True),
    "tier/local-write-resolve": ("local-write", "resolve", R0, True),
    "tier/local-write-decided": ("local-write", "decided", R0, True),
    "tier/replicate": ("replicate", "entry", ANY, True),
    "tier/replicate-send": ("replicate", "inside", ANY, True),
    "tier/replicate-mid-send": ("replicate", "inside", ANY, True),
    "tier/replicate-received": ("replicate", "inside", ANY, True),
    "tier/replicate-keep-rename": ("replicate", "inside", ANY, True),
    "tier/replicate-after": ("replicate", "after", ANY, True),
    "tier/replicate-resolve": ("replicate", "resolve", R0, True),
    "tier/replicate-decided": ("replicate", "decided", R0, True),
    "tier/publish": ("local-publish", "entry", ANY, True),
    "tier/publish-manifest-rename": ("local-publish", "inside", FIRST, True),
    "tier/publish-rename": ("local-publish", "inside", FIRST, True),
    "tier/publish-renamed": ("local-publish", "inside", FIRST, True),
    # local retention deletes on save 4 only (step 2; the restored step 3 is protected), and
    # not on the lacking node (it holds only 3 and 4 then)
    "tier/publish-retain": ("local-publish", "inside", FIRST_HOLDER, True),
    "tier/publish-after": ("local-publish", "after", ANY, True),
    "tier/publish-decided": ("local-publish", "decided", R0, True),
    "drain/begin": ("durable-begin", "entry", ANY, True),
    "drain/begin-resolve": ("durable-begin", "resolve", R0, True),
    "drain/begin-decided": ("durable-begin", "decided", R0, True),
    "drain/write": ("write", "entry", ANY, True),
    "drain/write-mid-file": ("write", "inside", ANY, True),
    "drain/write-after": ("write", "after", ANY, True),
    "drain/write-resolve": ("write", "resolve", R0, True),
    "drain/commit-before-publish": ("write", "inside", R0, True),
    "drain/commit-after-publish": ("write", "inside", R0, True),
    "drain/retain-mid": ("write", "inside", R0, True),
    "drain/write-decided": ("write", "decided", R0, True),
    "restore/tier-run": ("tier-run", "entry", ANY, False),
    "restore/tier-run-resolve": ("tier-run", "resolve", R0, False),
    "restore/tier-run-decided": ("tier-run", "decided", R0, False),
    "restore/tier-inventory": ("tier-inventory", "entry", ANY, False),
    "restore/tier-inventory-after": ("tier-inventory", "after", ANY, False),
    "restore/tier-inventory-resolve": ("tier-inventory", "resolve", R0, False),
    "restore/tier-inventory-decided": ("tier-inventory", "decided", R0, False),
    "restore/tier-verify": ("tier-verify", "entry", ANY, False),
    "restore/tier-verify-read": ("tier-verify", "inside", HOLDER, False),
    "restore/check-read": ("check", "inside", HOLDER, False),  # the load's check of a node's copy
    "restore/tier-verify-after": ("tier-verify", "after", ANY, False),
    "restore/tier-verify-resolve": ("tier-verify", "resolve", R0, False),
    "restore/tier-verify-decided": ("tier-verify", "decided", R0, False),
    "restore/tier-plan": ("tier-plan", "entry", ANY, False),
    "restore/tier-plan-after": ("tier-plan", "after", ANY, False),
    "restore/tier-plan-resolve": ("tier-plan", "resolve", R0, False),
    "restore/tier-plan-decided": ("tier-plan", "decided", R0, False),
    "restore/tier-fetch": ("tier-fetch", "entry", ANY, False),
    "restore/tier-fetch-mid-send": ("tier-fetch", "inside", HOLDER, False),
    "restore/tier-fetch-keep-rename": ("tier-fetch", "inside", LACKING, False),
    "restore/tier-fetch-after": ("tier-fetch", "after", ANY, False),
    "restore/tier-fetch-decided": ("tier-fetch", "decided", R0, False),
    "restore/apply": ("", "apply", ANY, False),
    "restore/apply-mid": ("", "apply-mid", ANY, False),
    "restore/apply-after": ("", "apply-after", ANY, False),
}
# Drawn only with ``overwrite`` (the crash job's first save re-saves the step it restored, as a
# job restarted from an older step does): a node's first rank between the two renames that
# replace a published local step (the old one moved aside, the new one not yet in place).
TIER_OVERWRITE_POINTS: dict[str, tuple[str, str, str, bool]] = {
    "tier/publish-mid-replace": ("local-publish", "inside", FIRST, True),
}
ALL_POINTS = {**TIER_POINTS, **TIER_OVERWRITE_POINTS}
# After rank 0 published the drained step under root: it must be there afterwards.
AFTER_PUBLISH = ("drain/commit-after-publish", "drain/retain-mid", "drain/write-decided")


def sample(seed: int, index: int, timeout: float, points: list[str] | None = None,
           cycle: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Trial ``index`` of ``seed`` (the same spec every time). ``cycle``: trial i kills at
    point i modulo the number of points (every point in turn), the rest drawn as usual.
    ``overwrite``: the crash job's first save re-saves the restored step (and
    ``TIER_OVERWRITE_POINTS`` may be drawn)."""
    rng = random.Random(f"kill-matrix-tier-{seed}-{index}")
    names = list(points or (ALL_POINTS if overwrite else TIER_POINTS))
    point = rng.choice(names)
    if cycle:
        point = names[index % len(names)]
    nodes, per_node = rng.choice(LAYOUTS)
    world = nodes * per_node
    role = ALL_POINTS[point][2]
    if role == R0:
        victim = 0
    elif role == FIRST:
        victim = per_node * rng.randrange(nodes)
    elif role == FIRST_HOLDER:
        victim = per_node * rng.randrange(nodes - 1)
    elif role == LACKING:
        victim = per_node * (nodes - 1) + rng.randrange(per_node)
    elif role == HOLDER:
        victim = rng.randrange(per_node * (nodes - 1))
    else:
        victim = rng.randrange(world)
    occurrence = rng.randint(1, CRASH_SAVES)
    if point == "tier/publish-retain" or point in TIER_OVERWRITE_POINTS:
        occurrence = 1
    spec = {"trial": index, "seed": seed, "tier": True, "world": world, "nodes": nodes, "per_node": per_node,
            "mode": "tier", "point": point, "victim": victim, "method": rng.choice(["sigkill", "exit"]),
            "occurrence": occurrence, "keep_last": rng.choice([1, 2]),
            "lose_node": rng.random() < 0.5, "timeout": timeout, "store_timeout": 60.0}
    if overwrite:
        spec["overwrite"] = True
    return spec


# ------------------------------------------------------------------------------ the killer


class TierKiller(Killer):
    """Kills at a point of ``TIER_POINTS`` (the same ``die``, ``kill.json`` and methods)."""

    def __init__(self, spec: dict[str, Any], rank: int, trial_dir: str, root: str, local_dir: str) -> None:
        super().__init__(spec, rank, trial_dir, root)
        self.local = os.path.realpath(local_dir)

    def install(self) -> None:
        phase, when, _, per_save = ALL_POINTS[self.point]
        where = self.point.split("/")[1]
        if when.startswith("apply"):
            self._patch_apply(when)
            return
        self._patch_tier_decide(phase, when, self.occurrence if per_save else 1)
        if where == "local-write-mid-file":
            self._patch_half_write(lambda p: self._under(p, self.local) and "/.partial-" in p)
        elif where == "local-write-fsync":
            self._patch_fsync(lambda p: self._under(p, self.local) and "/.partial-" in p)
        elif where in ("replicate-send", "replicate-received"):
            self._patch_send_recv(before=where == "replicate-send")
        elif where in ("replicate-mid-send", "tier-fetch-mid-send"):
            self._patch_isend()
        elif where in ("replicate-keep-rename", "tier-fetch-keep-rename"):
            self._patch_replace(lambda dst: self._under(dst, self.local) and os.path.basename(dst).startswith("rank-"))
            if where == "tier-fetch-keep-rename":
                self._arm_heal()  # a node of one rank keeps what it fetched after the restore
        elif where == "publish-manifest-rename":
            self._patch_replace(lambda dst: self._under(dst, self.local) and os.path.basename(dst) == "manifest.json")
        elif where == "publish-mid-replace":  # the old step moved aside, the new one not in place
            self._patch_rename(lambda dst: self._under(dst, self.local) and os.path.basename(dst).endswith(".old"),
                               after=True)
        elif where in ("publish-rename", "publish-renamed"):
            self._patch_rename(lambda dst: self._under(dst, self.local) and os.path.basename(dst).startswith("step-"),
                               after=where == "publish-renamed")
        elif where == "publish-retain":
            self._patch_rmtree(lambda p: self._under(p, self.local) and os.path.basename(p).startswith("step-"))
        elif self.point == "drain/write-mid-file":
            self._patch_file_writes()  # kill_inject's: half a data file under root's staging place
        elif where in ("commit-before-publish", "commit-after-publish"):
            self._patch_publish(before=where == "commit-before-publish")
        elif where == "retain-mid":
            self._patch_retention_delete()
        elif where == "tier-verify-read":
            self._patch_verified()
        elif where == "check-read":
            self._patch_load_check()

    @staticmethod
    def _under(path: Any, base: str) -> bool:
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p.startswith(base + os.sep)

    def _patch_tier_decide(self, phase: str, when: str, occurrence: int) -> None:
        from safeckpt.coord import dist as _dist

        real = _dist.Coordinator.decide
        killer = self
        calls: dict[str, int] = {}

        def decide(coord: Any, name: str, local: Any, resolve: Any, **kwargs: Any) -> Any:
            if name != phase:
                return real(coord, name, local, resolve, **kwargs)
            n = calls[name] = calls.get(name, 0) + 1
            killer.call = n
            if n < occurrence or (n > occurrence and when != "inside"):
                return real(coord, name, local, resolve, **kwargs)
            if when == "entry":
                killer.die()
            if when == "after":
                def local_then_die() -> Any:
                    local()
                    killer.die()
                return real(coord, name, local_then_die, resolve, **kwargs)
            if when == "resolve":
                def die_resolving(values: list[Any]) -> Any:
                    killer.die()
                return real(coord, name, local, die_resolving, **kwargs)
            if when == "decided":
                def resolve_then_die(values: list[Any]) -> Any:
                    resolve(values)
                    killer.die()
                return real(coord, name, local, resolve_then_die, **kwargs)

            return real(coord, name, killer._armed(local), killer._armed(resolve), **kwargs)

        _dist.Coordinator.decide = decide  # type: ignore[method-assign]

    def _fd_under(self, fd: int, match: Any) -> bool:
        try:
            return bool(match(os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            return False

    def _patch_half_write(self, match: Any) -> None:
        killer = self
        for name in ("write", "writev", "pwrite", "pwritev"):
            real = getattr(os, name, None)
            if real is None:
                continue

            def half_then_die(fd: int, data: Any, *rest: Any, _real: Any = real, _name: str = name) -> int:
                if not killer.armed or not killer._fd_under(fd, match):
                    return _real(fd, data, *rest)
                if _name.endswith("v"):
                    first = memoryview(data[0]).cast("B") if data else memoryview(b"")
                    _real(fd, [first[: max(1, len(first) // 2)]], *rest)
                else:
                    view = memoryview(data).cast("B")
                    _real(fd, view[: max(1, len(view) // 2)], *rest)
                killer.die()
                return 0

            setattr(os, name, half_then_die)

    def _patch_fsync(self, match: Any) -> None:
        killer = self
        real = os.fsync

        def fsync(fd: Any) -> None:
            if killer.armed and isinstance(fd, int) and killer._fd_under(fd, match):
                import stat

                if stat.S_ISREG(os.fstat(fd).st_mode):  # the data file, not a directory
                    killer.die()
            real(fd)

        os.fsync = fsync

    def _patch_send_recv(self, before: bool) -> None:
        import safeckpt.engine.tier as tier

        killer = self
        real = tier.send_recv

        def send_recv(coord: Any, sends: Any, recvs: Any) -> None:
            if killer.armed and before:
                killer.die()
            real(coord, sends, recvs)
            if killer.armed and (sends or recvs):
                killer.die()

        tier.send_recv = send_recv

    def _patch_isend(self) -> None:
        import torch.distributed as dist

        killer = self
        real = dist.isend

        def isend(*args: Any, **kwargs: Any) -> Any:
            work = real(*args, **kwargs)
            if killer.armed:  # posted: the peer may have part of the bytes
                killer.die()
            return work

        dist.isend = isend

    def _patch_replace(self, match: Any) -> None:
        killer = self
        real = os.replace

        def replace(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            if killer.armed and match(dst):  # the temp file written and fsynced, not renamed
                killer.die()
            real(src, dst, *a, **k)

        os.replace = replace

    def _armed(self, fn: Any) -> Any:
        """``fn``, run with the kill points of an "inside" point armed."""
        def run(*args: Any) -> Any:
            self.armed = True
            try:
                return fn(*args)
            finally:
                self.armed = False
        return run

    def _arm_heal(self) -> None:
        """Armed during a restore's deferred heal too (``CheckpointManager._heal_later``: a node
        of one rank writes the files it fetched on its background worker after the restore)."""
        from safeckpt import manager as _manager

        killer = self
        real = _manager.CheckpointManager._heal_later

        def heal_later(mgr: Any, heal: Any) -> None:
            return real(mgr, killer._armed(heal))

        _manager.CheckpointManager._heal_later = heal_later  # type: ignore[method-assign]

    def _patch_rename(self, match: Any, after: bool) -> None:
        killer = self
        real = os.rename

        def rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            hit = killer.armed and match(dst)
            if hit and not after:
                killer.die()
            real(src, dst, *a, **k)
            if hit:
                killer.die()

        os.rename = rename

    def _patch_rmtree(self, match: Any) -> None:
        killer = self
        real = shutil.rmtree

        def rmtree(path: Any, *a: Any, **k: Any) -> None:
            real(path, *a, **k)
            if killer.armed and match(path):
                killer.die()

        shutil.rmtree = rmtree  # type: ignore[assignment]

    def _patch_verified(self) -> None:
        from safeckpt.engine import local_tier

        killer = self
        real = local_tier.NodeDir.verified

        def verified(nd: Any, *args: Any, **kwargs: Any) -> bool:
            if killer.armed:  # a node's copy being hashed by the restore's verify
                killer.die()
            return real(nd, *args, **kwargs)

        local_tier.NodeDir.verified = verified  # type: ignore[method-assign]

    def _patch_load_check(self) -> None:
        from safeckpt.engine import load as _load

        killer = self
        real = _load._LoadJob.check

        def check(job: Any) -> None:
            if killer.armed:  # the load's check reading a node's copy of the step
                killer.die()
            return real(job)

        _load._LoadJob.check = check  # type: ignore[method-assign]


# ------------------------------------------------------------------------------- the job


def node_dir(trial_dir: str, node: int) -> str:
    return os.path.join(trial_dir, "nodes", f"node{node}")


def worker(job: str, rank: int, world: int, port: int, spec: dict[str, Any], root: str, trial_dir: str) -> None:
    """One rank of ``job`` ("seed", "crash" or "restart") on the local tier."""
    node = rank // spec["per_node"]
    os.environ.update(OMP_NUM_THREADS="1", SAFECKPT_TIMEOUT=str(spec["timeout"]), GROUP_RANK=str(node))
    import torch
    import torch.distributed as dist

    import safeckpt

    torch.set_num_threads(1)
    local = node_dir(trial_dir, node)
    out: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=spec["store_timeout"]))
        if job == "crash" and rank == spec["victim"]:
            TierKiller(spec, rank, trial_dir, root, local).install()
        state = make_state()
        keep = None if job == "seed" else spec["keep_last"]
        mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=DURABLE_EVERY, replicas=1,
                                         keep_last=keep, keep_local=KEEP_LOCAL, timeout=spec["timeout"],
                                         preemption_signals=())
        out["where"] = "restore"
        step = mgr.restore(state)
        out["restored"] = step
        if step is not None:
            out["restore_mismatch"] = state_matches(state, step, rank)
            _note(trial_dir, rank, "restored", step)  # this rank's node holds every file of it now
        start = 0 if step is None else step
        count = SEED_LAST if job == "seed" else CRASH_SAVES if job == "crash" else 1
        if job == "crash" and spec.get("overwrite") and step is not None:
            start, count = step - 1, CRASH_SAVES + 1  # the first save re-saves the restored step
        for s in range(start + 1, start + 1 + count):
            out["where"] = f"save {s}"
            set_step(state, s, rank)
            mgr.save(s, state)
            mgr.wait()  # s is published on every node with its replicas (and in root if durable)
            _note(trial_dir, rank, "local", s)
            if s % DURABLE_EVERY == 0:
                _note(trial_dir, rank, "durable", s)
        if job == "seed":
            kill_inject._write_json(os.path.join(trial_dir, f"out-{job}-{rank}.json"), {**out, "ok": True})
            os._exit(0)  # the seed job "dies": no close, its newest step is on the local tier only
        out["where"] = "close"
        mgr.close()  # drains the newest step to root
        _note(trial_dir, rank, "durable", start + count)
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.update(t_err=time.time(), type=type(exc).__name__, tb="".join(traceback.format_exception(exc))[-6000:],
                   mro=[c.__name__ for c in type(exc).__mro__], msg=str(exc)[:4000],
                   failures={str(k): v for k, v in (getattr(exc, "failures", None) or {}).items()})
    kill_inject._write_json(os.path.join(trial_dir, f"out-{job}-{rank}.json"), out)
    os._exit(0)


def _note(trial_dir: str, rank: int, kind: str, step: int) -> None:
    with open(os.path.join(trial_dir, f"{kind}-{rank}.txt"), "a") as f:
        f.write(f"{step}\n")


def _noted_ranks(trial_dir: str, kind: str) -> set[int]:
    return {int(n[len(kind) + 1:-4]) for n in os.listdir(trial_dir) if n.startswith(f"{kind}-") and n.endswith(".txt")}


def _noted(trial_dir: str, kind: str) -> set[int]:
    steps: set[int] = set()
    for name in os.listdir(trial_dir):
        if name.startswith(f"{kind}-") and name.endswith(".txt"):
            with open(os.path.join(trial_dir, name)) as f:
                steps.update(int(x) for x in f.read().split())
    return steps


# ------------------------------------------------------------------------------ checking


def inspect_nodes(trial_dir: str, nodes: int) -> dict[str, Any]:
    """Every published local step directory on every node: files that match the step's
    manifest (size and xxh3-128), torn ones (a file under a published name that does not),
    and which (step, manifest hash) have every file somewhere."""
    import xxhash

    good: dict[tuple[int, str], set[str]] = {}
    wanted: dict[tuple[int, str], set[str]] = {}
    torn: list[str] = []
    for n in range(nodes):
        base = node_dir(trial_dir, n)
        runs = [d for d in os.listdir(base) if d.startswith("run-")] if os.path.isdir(base) else []
        for run in runs:
            for name in sorted(os.listdir(os.path.join(base, run))):
                if not (name.startswith("step-") and name[5:].isdigit()):
                    continue
                d = os.path.join(base, run, name)
                try:
                    with open(os.path.join(d, "manifest.json"), "rb") as f:
                        raw = f.read()
                    man = json.loads(raw)
                except (OSError, ValueError):  # e.g. retention killed half-way through removing it:
                    continue                      # not a step to the restore (nor to this check)
                files = {**(man.get("files") or {}), **(man.get("extra") or {})}
                key = (int(name[5:]), xxhash.xxh3_128_hexdigest(raw))
                wanted[key] = set(files)
                for fname in os.listdir(d):
                    if fname not in files:
                        continue
                    with open(os.path.join(d, fname), "rb") as f:
                        data = f.read()
                    if len(data) == files[fname]["size"] and xxhash.xxh3_128_hexdigest(data) == files[fname]["xxh3_128"]:
                        good.setdefault(key, set()).add(fname)
                    else:
                        torn.append(f"node{n}/{name}/{fname}: does not match the manifest")
    complete = sorted({s for key, names in wanted.items() if names <= good.get(key, set()) for s in [key[0]]})
    return {"complete": complete, "torn": torn, "steps": sorted({k[0] for k in wanted})}


def run_trial(ctx: Any, spec: dict[str, Any], seeds: dict[tuple[int, int], str], workdir: str,
              slack: float, run_job: Any) -> dict[str, Any]:
    from tests.stress.kill_matrix import inspect_root

    trial_dir = os.path.join(workdir, "t")  # one path for every trial: the tier's run tag hashes root
    shutil.rmtree(trial_dir, ignore_errors=True)
    shutil.copytree(seeds[(spec["nodes"], spec["per_node"])], trial_dir, symlinks=True)
    root = os.path.join(trial_dir, "root")
    shutil.rmtree(node_dir(trial_dir, spec["nodes"] - 1))  # a node lost before the trial
    res: dict[str, Any] = {"spec": spec, "dir": trial_dir, "problems": []}
    problems = res["problems"]

    crash = run_job(ctx, "crash", spec, root, trial_dir, slack, target=worker)
    kill = crash["kill"]
    res["seconds_crash"] = crash["seconds"]
    res["killed"] = kill is not None
    if kill is None:
        problems.append("no-kill: the victim never reached its kill point")
    if crash["hung"]:
        problems.append(f"hang: ranks {crash['hung']} not done {spec['timeout'] + slack:.0f}s after the kill")
    res["hangs"] = len(crash["hung"])
    if spec["lose_node"]:  # the victim's whole node is lost, not only its process
        shutil.rmtree(node_dir(trial_dir, spec["victim"] // spec["per_node"]), ignore_errors=True)

    disk = inspect_root(root)
    res["disk"] = disk
    local = inspect_nodes(trial_dir, spec["nodes"])
    res["local"] = local
    complete = sorted(set(disk["valid"]) | set(local["complete"]))
    newest = max(complete, default=None)
    res["newest"] = newest
    known_local = _noted(trial_dir, "local") | {SEED_LAST}
    known_durable = _noted(trial_dir, "durable") | {DURABLE_EVERY}
    # Nodes whose copies are gone: the one wiped before the trial until the crash job's restore
    # healed it (its ranks restored: their node then holds every file of that step), and with
    # lose_node the victim's. replicas=1 promises nothing once two nodes are lost.
    lacking = spec["nodes"] - 1
    healed = any(r // spec["per_node"] == lacking for r in _noted_ranks(trial_dir, "restored"))
    gone = ({lacking} if not healed else set()) | ({spec["victim"] // spec["per_node"]} if spec["lose_node"] else set())
    res["nodes_gone"] = len(gone)
    res["lost"] = False
    if len(gone) <= 1 and (newest is None or newest < max(known_local)):
        res["lost"] = True
        problems.append(f"lost: the newest step complete on some tier is {newest}, but step {max(known_local)} "
                        "was complete on the local tier (wait() returned)")
    newest_durable = max(known_durable)
    if max(disk["valid"], default=-1) < newest_durable:  # retention may have removed it for a newer one
        res["lost"] = True
        problems.append(f"lost: step {newest_durable} was committed under root, root holds {disk['valid']}")
    phase, _, _, per_save = ALL_POINTS[spec["point"]]
    call = (kill or {}).get("call") or spec["occurrence"]
    first = SEED_LAST if spec.get("overwrite") and phase not in ("durable-begin", "write") else SEED_LAST + 1
    killed_step = first - 1 + call if kill and per_save else None  # drains: step 4, then 5 at close
    res["killed_step"] = killed_step
    if spec["point"] in AFTER_PUBLISH and killed_step is not None and killed_step not in disk["valid"]:
        res["lost"] = True
        problems.append(f"lost: rank 0 published step {killed_step} under root before the kill; root holds {disk['valid']}")
    if disk["partial"]:
        problems.append(f"partial visible in root: {disk['partial']}")
    if disk["wrong"]:
        problems.append(f"wrong values in root: {disk['wrong']}")
    if disk["odd_hidden"]:
        problems.append(f"unexpected hidden entries in root: {disk['odd_hidden']}")
    if local["torn"]:
        problems.append(f"torn local files under published names: {local['torn'][:5]}")

    res["survivors"] = {}
    for r in range(spec["world"]):
        if r == spec["victim"]:
            continue
        out = crash["outs"].get(r)
        if out is None:
            continue
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

    if newest is not None:
        restart = run_job(ctx, "restart", spec, root, trial_dir, slack, target=worker)
        outs = restart["outs"]
        bad = [f"rank {r}: {o.get('type')}: {o.get('msg', '')[:400]}" for r, o in sorted(outs.items()) if not o["ok"]]
        if bad and os.environ.get("KILL_TIER_TRACEBACKS"):  # where a restart failed, in full
            for r, o in sorted(outs.items()):
                if not o["ok"]:
                    print(f"--- restart rank {r} traceback:\n{o.get('tb', '')}", file=sys.stderr, flush=True)
        bad += [f"rank {r}: restored step {o.get('restored')}, the newest complete on some tier is {newest}"
                for r, o in sorted(outs.items()) if o.get("restored") != newest and "restored" in o]
        bad += [f"rank {r}: restored values differ: {o['restore_mismatch']}"
                for r, o in sorted(outs.items()) if o.get("restore_mismatch")]
        if len(outs) < spec["world"] or restart["hung"]:
            bad.append(f"restart: ranks missing {sorted(set(range(spec['world'])) - set(outs))}, hung "
                       f"{restart['hung']} (exit codes {restart['exitcodes']})")
        after = inspect_root(root)
        if not bad and newest + 1 not in after["valid"]:
            bad.append(f"restart: its save of step {newest + 1} was not drained to root at close ({after['valid']})")
        res["restart_failed"] = bool(bad)
        problems.extend(f"restart: {b}" for b in bad)
    return res


def make_seeds(ctx: Any, layouts: set[tuple[int, int]], workdir: str, timeout: float, run_job: Any) -> dict:
    """Per layout: steps 1..3 through the tier at ``workdir/t`` (the path every trial uses),
    kept as ``workdir/seed-<nodes>x<per_node>``."""
    seeds = {}
    for nodes, per_node in sorted(layouts):
        trial_dir = os.path.join(workdir, "t")
        shutil.rmtree(trial_dir, ignore_errors=True)
        os.makedirs(trial_dir)
        spec = {"world": nodes * per_node, "nodes": nodes, "per_node": per_node, "keep_last": None,
                "timeout": timeout, "store_timeout": 60.0, "victim": -1}
        out = run_job(ctx, "seed", spec, os.path.join(trial_dir, "root"), trial_dir, 30.0, target=worker)
        if len(out["outs"]) != spec["world"] or not all(o["ok"] for o in out["outs"].values()):
            raise RuntimeError(f"seeding {nodes}x{per_node} failed: {out}")
        for name in os.listdir(trial_dir):
            if name.endswith(".txt") or name.startswith("out-"):
                os.unlink(os.path.join(trial_dir, name))
        dest = os.path.join(workdir, f"seed-{nodes}x{per_node}")
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(trial_dir, dest)
        seeds[(nodes, per_node)] = dest
    return seeds

