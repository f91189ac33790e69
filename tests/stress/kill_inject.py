"""Worker side of the kill matrix: the training job, and the patches that kill one rank.

Every kill is real: the victim process ends with SIGKILL or ``os._exit`` at the chosen point,
from whichever thread reaches it (async saves write and commit in a background thread). Just
before dying it writes ``kill.json`` (wall time, point) so the parent can time the survivors.
A third method, ``raise`` (retention points only), makes the step fail with an exception
instead, to check the "committed; only retention failed" report of every rank.

Kill points (``POINTS``) are named ``area/where`` and follow the collective protocol: every
collective step is a ``Coordinator.decide`` (each rank runs its local part; one gather to rank
0; rank 0 alone resolves; one broadcast). Phase points wrap ``Coordinator.decide``:

- ``<phase>`` (entry): die before the local part;
- ``<phase>-after``: die after the local part, before the gather;
- ``<phase>-resolve`` (rank 0 only): die when rank 0 starts resolving, every value gathered;
- ``<phase>-decided`` (rank 0 only): die after rank 0 resolved, before the broadcast.

With ``overwrite`` in the spec the crash job's first save re-saves the step it restored (an
overwrite, as a restarted job that saves its first step again does), and the point
``save/commit-mid-publish`` kills rank 0 between the two renames such an overwrite takes where
renameat2's flags are refused (NFS, FUSE).

The phases: ``pick`` and ``check`` (the start-up restore; the load's ``apply`` is local plus
one all-reduce), ``agree`` and ``write`` (each managed save; rank 0 stages in agree's resolve
and publishes and applies retention in write's resolve), ``retain`` (``mgr.retain()``). Other
points patch the step they name inside a phase (rank 0's lease and sweep before staging, a data
file half written, just before / after publish, retention's entry or first deletion, a chunk
read while the load checks, the load's apply), safeckpt's group creation (before the first
call, at the store rendezvous, entering ``new_group``, inside gloo's connect; ``async-setup``:
the background group), the async snapshot, and the ``preempted`` all-reduce.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

SEED_STEPS = 3  # steps 1..3 exist (keep all) before every trial's job starts
SAVES = 3  # saves each job makes after its start-up restore
BIG = 1 << 16  # floats in the replicated "big" tensor (256 KiB)

ANY, R0 = False, True  # victim: any rank, or rank 0 only (the step runs on rank 0 alone)
BOTH = ("sync", "async")

# name -> (modes it applies to, victim must be rank 0, occurs once per save)
POINTS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "setup/before-first-call": (BOTH, ANY, False),
    "setup/rendezvous": (BOTH, ANY, False),
    "setup/new-group": (BOTH, ANY, False),
    "setup/connect": (BOTH, ANY, False),
    "restore/pick": (BOTH, ANY, False),
    "restore/pick-after": (BOTH, ANY, False),
    "restore/pick-resolve": (BOTH, R0, False),
    "restore/pick-decided": (BOTH, R0, False),
    "restore/check": (BOTH, ANY, False),
    "restore/check-read": (BOTH, ANY, False),
    "restore/check-after": (BOTH, ANY, False),
    "restore/check-decided": (BOTH, R0, False),
    "restore/apply": (BOTH, ANY, False),
    "restore/apply-mid": (BOTH, ANY, False),
    "restore/apply-after": (BOTH, ANY, False),
    "save/agree": (BOTH, ANY, True),
    "save/agree-after": (BOTH, ANY, True),
    "save/agree-resolve": (BOTH, R0, True),
    "save/agree-sweep": (BOTH, R0, True),
    "save/agree-staged": (BOTH, R0, True),
    "async/snapshot": (("async",), ANY, True),
    "async/snapshot-after": (("async",), ANY, True),
    "async-setup/new-group": (("async",), ANY, False),
    "async-setup/connect": (("async",), ANY, False),
    "save/write": (BOTH, ANY, True),
    "save/write-mid-file": (BOTH, ANY, True),
    "save/write-after": (BOTH, ANY, True),
    "save/write-resolve": (BOTH, R0, True),
    "save/commit-before-publish": (BOTH, R0, True),
    "save/commit-after-publish": (BOTH, R0, True),
    "save/commit-mid-publish": (BOTH, R0, True),
    "save/retain": (BOTH, R0, True),
    "save/retain-mid": (BOTH, R0, True),
    "save/write-decided": (BOTH, R0, True),
    "retain/retain": (BOTH, ANY, False),
    "retain/retain-after": (BOTH, ANY, False),
    "retain/retain-resolve": (BOTH, R0, False),
    "retain/retain-decided": (BOTH, R0, False),
    "close/preempted": (BOTH, ANY, False),
}
# Points drawn only for overwrites (``--overwrite``) on a filesystem that refuses renameat2's
# flags (``--workdir`` on NFS or a FUSE mount): between the two renames of an overwrite.
OVERWRITE_POINTS = ("save/commit-mid-publish",)
# Points where method "raise" applies: the step raises (OSError) instead of the process dying.
RAISE_POINTS = ("save/retain", "save/retain-mid")
# Points after rank 0 published the killed save (the checkpoint must be on disk afterwards)
AFTER_PUBLISH = ("save/commit-after-publish", "save/retain", "save/retain-mid", "save/write-decided")

# Phase points: point -> (decide phase, when). "inside": the step patched below kills (or
# raises) while the phase's local part or rank 0's resolve runs.
PHASE_POINTS: dict[str, tuple[str, str]] = {
    "restore/pick": ("pick", "entry"),
    "restore/pick-after": ("pick", "after"),
    "restore/pick-resolve": ("pick", "resolve"),
    "restore/pick-decided": ("pick", "decided"),
    "restore/check": ("check", "entry"),
    "restore/check-read": ("check", "inside"),
    "restore/check-after": ("check", "after"),
    "restore/check-decided": ("check", "decided"),
    "save/agree": ("agree", "entry"),
    "save/agree-after": ("agree", "after"),
    "save/agree-resolve": ("agree", "resolve"),
    "save/agree-sweep": ("agree", "inside"),
    "save/agree-staged": ("agree", "decided"),
    "save/write": ("write", "entry"),
    "save/write-mid-file": ("write", "inside"),
    "save/write-after": ("write", "after"),
    "save/write-resolve": ("write", "resolve"),
    "save/commit-before-publish": ("write", "inside"),
    "save/commit-after-publish": ("write", "inside"),
    "save/commit-mid-publish": ("write", "inside"),
    "save/retain": ("write", "inside"),
    "save/retain-mid": ("write", "inside"),
    "save/write-decided": ("write", "decided"),
    "retain/retain": ("retain", "entry"),
    "retain/retain-after": ("retain", "after"),
    "retain/retain-resolve": ("retain", "resolve"),
    "retain/retain-decided": ("retain", "decided"),
}


# ------------------------------------------------------------------------- state and values


def make_state(mesh2d: bool = False) -> dict[str, Any]:
    """The job's state. ``mesh2d`` (4 ranks): the model's weight and bias are DTensors on a 2x2
    device mesh (weight sharded on both dims, bias on one and replicated on the other), the
    layout of FSDP2 over tensor parallelism's 2-D meshes; the keys and values are the same."""
    import torch
    from torch import nn

    import safeckpt

    if not mesh2d:
        return {"model": nn.Linear(64, 64), "big": torch.zeros(BIG), "rng": safeckpt.RNGState(),
                "meta": {"step": -1}}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    model = {"weight": distribute_tensor(torch.zeros(64, 64), mesh, [Shard(0), Shard(1)]),
             "bias": distribute_tensor(torch.zeros(64), mesh, [Shard(0), Replicate()])}
    return {"model": model, "big": torch.zeros(BIG), "rng": safeckpt.RNGState(), "meta": {"step": -1}}


def _local_part(full: Any, dtensor: Any) -> Any:
    """This rank's part of ``full`` under ``dtensor``'s placements, computed locally."""
    from safeckpt.format.sharding import local_box

    offsets, sizes = local_box(dtensor)
    part = full
    for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        part = part.narrow(dim, o, n)
    return part


def _model_tensors(state: dict[str, Any]) -> dict[str, Any]:
    model = state["model"]
    if isinstance(model, dict):
        return {"model/weight": model["weight"], "model/bias": model["bias"]}
    return {"model/weight": model.weight, "model/bias": model.bias}


def expected(step: int) -> dict[str, Any]:
    import torch

    return {
        "model/weight": torch.arange(64 * 64, dtype=torch.float32).view(64, 64) * 1e-3 + step,
        "model/bias": torch.full((64,), float(step)),
        "big": torch.arange(BIG, dtype=torch.float32) * 1e-6 + step,
    }


def rng_seed(step: int, rank: int) -> int:
    return 1000 * step + rank


def set_step(state: dict[str, Any], step: int, rank: int) -> None:
    import torch

    want = expected(step)
    with torch.no_grad():
        for key, t in _model_tensors(state).items():
            if hasattr(t, "device_mesh"):  # a DTensor: this rank's shard (no collective: a rank
                t.to_local().copy_(_local_part(want[key], t))  # may be dead when this runs)
            else:
                t.copy_(want[key])
        state["big"].copy_(want["big"])
    state["meta"] = {"step": step}
    torch.manual_seed(rng_seed(step, rank))


def state_matches(state: dict[str, Any], step: int, rank: int) -> str:
    """'' if ``state`` holds exactly step ``step``'s values (RNG of this rank included)."""
    import torch

    want = expected(step)
    got = {**_model_tensors(state), "big": state["big"]}
    bad = [k for k in want if not torch.equal(
        got[k].to_local() if hasattr(got[k], "device_mesh") else got[k].detach(),
        _local_part(want[k], got[k]) if hasattr(got[k], "device_mesh") else want[k])]
    if state["meta"] != {"step": step}:
        bad.append(f"meta={state['meta']}")
    draw = torch.rand(4)
    torch.manual_seed(rng_seed(step, rank))
    if not torch.equal(draw, torch.rand(4)):
        bad.append("rng")
    return ", ".join(bad)


# ----------------------------------------------------------------------------- the kill


class Killer:
    """Installs the patches for one kill point on the victim and kills it there."""

    def __init__(self, spec: dict[str, Any], rank: int, trial_dir: str, root: str) -> None:
        self.point = spec["point"]
        self.method = spec["method"]
        self.occurrence = spec["occurrence"]
        self.store_ops = spec.get("store_ops", 1)
        self.rank = rank
        self.trial_dir = trial_dir
        self.root = os.path.realpath(root)
        self.phase_calls: dict[str, int] = {}
        # Set while the armed phase's local part or resolve runs. Process-wide, not per
        # thread: a load reads and hashes chunks in worker threads. Nothing patched runs
        # outside a phase at the same time (one save in flight; the next waits for it).
        self.armed = False
        self.call = 0  # which call of the patched phase (per save: which save) the kill hit
        # --second-manager: the second manager's calls (its root beside this one) are neither
        # counted nor killed, so a kill point's occurrence still names the main manager's save
        self.ignore = self.root + "-second" if spec.get("second_manager") else ""

    def ignored(self, text: Any) -> bool:
        return bool(self.ignore) and self.ignore in str(text)

    def die(self) -> None:
        rec = {"t": time.time(), "point": self.point, "rank": self.rank, "method": self.method,
               "thread": threading.current_thread().name, "call": self.call}
        tmp = os.path.join(self.trial_dir, f"kill.json.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, os.path.join(self.trial_dir, "kill.json"))
        if self.method == "raise":  # the step fails; the process goes on
            self.armed = False
            raise OSError(f"kill matrix: injected failure at {self.point}")
        if self.method == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(43)

    def install(self) -> None:
        area, where = self.point.split("/")
        if self.point == "setup/before-first-call":
            self.die()
        if area in ("setup", "async-setup"):
            self._patch_group_creation(1 if area == "setup" else 2, where)
            return
        if area == "async":
            self._patch_snapshot(after=where == "snapshot-after")
            return
        if self.point == "close/preempted":
            self._patch_any_true("preempted")
            return
        if where.startswith("apply"):
            self._patch_apply(where)
            return
        phase, when = PHASE_POINTS[self.point]
        self._patch_decide(phase, when)
        if where == "check-read":
            self._patch_read()
        elif where == "agree-sweep":
            self._patch_sweep()
        elif where == "write-mid-file":
            self._patch_file_writes()
        elif where in ("commit-before-publish", "commit-after-publish"):
            self._patch_publish(before=where == "commit-before-publish")
        elif where == "commit-mid-publish":
            self._patch_mid_publish()
        elif where == "retain":
            self._patch_retention_entry()
        elif where == "retain-mid":
            self._patch_retention_delete()

    # -- phases
    def _patch_decide(self, phase: str, when: str) -> None:
        from safeckpt.coord import dist as _dist

        real = _dist.Coordinator.decide
        killer = self
        # restore and retain phases happen once (the start-up restore, mgr.retain()); save
        # phases once per save
        occurrence = self.occurrence if POINTS[self.point][2] else 1

        def decide(coord: Any, name: str, local: Any, resolve: Any, **kwargs: Any) -> Any:
            if name != phase or killer.ignored(getattr(coord, "what", "")):
                return real(coord, name, local, resolve, **kwargs)
            n = killer.phase_calls[name] = killer.phase_calls.get(name, 0) + 1
            killer.call = n
            # "inside" points stay armed after their occurrence: a retention with nothing to
            # delete (the restored step is protected) leaves the kill to the next save's
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

            def armed(fn: Any) -> Any:  # "inside": the step patched below kills while fn runs
                def run(*args: Any) -> Any:
                    killer.armed = True
                    try:
                        return fn(*args)
                    finally:
                        killer.armed = False
                return run
            return real(coord, name, armed(local), armed(resolve), **kwargs)

        _dist.Coordinator.decide = decide  # type: ignore[method-assign]

    def _patch_any_true(self, phase: str) -> None:
        from safeckpt.coord import dist as _dist

        real = _dist.Coordinator.any_true
        killer = self

        def any_true(coord: Any, flag: bool, name: str = "flag") -> bool:
            if name == phase:
                killer.die()
            return real(coord, flag, name)

        _dist.Coordinator.any_true = any_true  # type: ignore[method-assign]

    # -- group creation
    def _patch_group_creation(self, nth: int, where: str) -> None:
        from safeckpt.coord import dist as _dist

        killer = self
        calls = [0]
        if where == "rendezvous":
            real_record = _dist.self_record

            def record() -> dict[str, Any]:
                calls[0] += 1
                if calls[0] == nth:
                    killer.die()
                return real_record()

            _dist.self_record = record
            return
        real_new = _dist._new_gloo_group

        def new_group(timeout: float) -> Any:
            calls[0] += 1
            if calls[0] != nth:
                return real_new(timeout)
            if where == "new-group":
                killer.die()
            killer._die_inside_gloo_connect()
            return real_new(timeout)

        _dist._new_gloo_group = new_group

    def _die_inside_gloo_connect(self) -> None:
        """Die after gloo's k-th store operation while the group connects (its address
        published, the others connecting to it): the case where gloo waited 5x the timeout."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        real_prefix = c10d.PrefixStore
        killer = self
        ops = [0]
        after = self.store_ops  # 1..3: right after publishing its address, or a little later

        class DyingStore(dist.Store):
            def __init__(self, prefix: str, store: Any) -> None:
                super().__init__()
                self.inner = real_prefix(prefix, store)

            def _tick(self) -> None:
                ops[0] += 1
                if ops[0] >= after:
                    killer.die()

            def set(self, key: str, value: Any) -> None:
                self.inner.set(key, value)
                self._tick()

            def get(self, key: str) -> bytes:
                value = self.inner.get(key)
                self._tick()
                return value

            def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
                self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

            def add(self, key: str, n: int) -> int:
                return self.inner.add(key, n)

            def check(self, keys: list[str]) -> bool:
                return self.inner.check(keys)

            def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
                return self.inner.compare_set(key, expected, desired)

            def delete_key(self, key: str) -> bool:
                return self.inner.delete_key(key)

            def num_keys(self) -> int:
                return self.inner.num_keys()

            def set_timeout(self, timeout: timedelta) -> None:
                self.inner.set_timeout(timeout)

        c10d.PrefixStore = DyingStore

    # -- steps inside phases
    def _patch_read(self) -> None:
        from safeckpt.engine import reader as _reader

        killer = self
        cls = _reader.TensorReader
        name = "_compare"  # every chunk a load reads is checked against its checksum here
        real = getattr(cls, name)

        def compare(self: Any, *args: Any, **kwargs: Any) -> Any:
            if killer.armed:  # a chunk read and hashed while the load checks: die before comparing
                killer.die()
            return real(self, *args, **kwargs)

        setattr(cls, name, compare)

    def _patch_sweep(self) -> None:
        import safeckpt.manager as manager_mod

        killer = self
        real = manager_mod.sweep

        def sweep(*args: Any, **kwargs: Any) -> Any:
            if killer.armed:  # rank 0 holds the writer lease, nothing staged yet
                killer.die()
            return real(*args, **kwargs)

        manager_mod.sweep = sweep

    def _patch_file_writes(self) -> None:
        from safeckpt.format.manifest import STAGING_MARK

        killer = self
        for name in ("write", "writev", "pwrite", "pwritev"):
            real = getattr(os, name, None)
            if real is None:
                continue

            def half_then_die(fd: int, data: Any, *rest: Any, _real: Any = real, _name: str = name) -> int:
                if not killer.armed or STAGING_MARK not in killer._fd_path(fd):
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

    def _fd_path(self, fd: int) -> str:
        """The file behind ``fd`` if it lies under the trial's root, else ''."""
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""
        return path if path.startswith(self.root + os.sep) else ""

    def _patch_publish(self, before: bool) -> None:
        import safeckpt.storage.commit as commit_mod

        killer = self
        real = commit_mod.publish

        def publish(*args: Any, **kwargs: Any) -> Any:
            if not killer.armed or killer.ignored(args):
                return real(*args, **kwargs)
            if before:
                killer.die()
            real(*args, **kwargs)
            killer.die()

        commit_mod.publish = publish

    def _patch_mid_publish(self) -> None:
        """Between an overwrite's two renames (no atomic swap): the old checkpoint moved to its
        replaced name, the new one not yet in place."""
        import safeckpt.storage.posix as posix_mod

        killer = self
        real = posix_mod._rename

        def rename(src: str, dst: str) -> None:
            real(src, dst)
            if killer.armed and posix_mod.replaced_final(os.path.basename(dst)) is not None:
                killer.die()

        posix_mod._rename = rename

    def _patch_retention_entry(self) -> None:
        import safeckpt.manager as manager_mod

        killer = self
        real = manager_mod.CheckpointManager._retain

        def retain(mgr: Any, *args: Any, **kwargs: Any) -> Any:
            if killer.armed and not killer.ignored(mgr.root):  # the checkpoint is published; retention has not deleted anything
                killer.die()
            return real(mgr, *args, **kwargs)

        manager_mod.CheckpointManager._retain = retain  # type: ignore[method-assign]

    def _patch_retention_delete(self) -> None:
        import safeckpt.manager as manager_mod

        killer = self
        real = manager_mod.remove_entry

        def remove_entry(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            if killer.armed and not killer.ignored(args):
                killer.die()
            return out

        manager_mod.remove_entry = remove_entry

    def _patch_apply(self, where: str) -> None:
        """``apply``: entry of the load's apply step (every rank's check passed);
        ``apply-mid``: stateful objects loaded, before the in-place copies; ``apply-after``:
        applied, before the all-reduce that tells whether every rank applied."""
        from safeckpt.engine import load as _load
        from safeckpt.engine import reader as _reader

        killer = self
        real = _load._LoadJob.apply

        def apply(job: Any) -> Any:
            if where == "apply":
                killer.die()
            killer.armed = where == "apply-mid"
            try:
                real(job)
            finally:
                killer.armed = False
            if where == "apply-after":
                killer.die()

        _load._LoadJob.apply = apply  # type: ignore[method-assign]
        if where == "apply-mid":
            real_fill = _reader.TensorReader.fill_many

            def fill_many(reader: Any, *args: Any, **kwargs: Any) -> Any:
                if killer.armed:
                    killer.die()
                return real_fill(reader, *args, **kwargs)

            _reader.TensorReader.fill_many = fill_many  # type: ignore[method-assign]

    def _patch_snapshot(self, after: bool) -> None:
        from safeckpt.engine import save as _save

        killer = self
        real = _save.SaveJob.snapshot
        calls = [0]

        def snapshot(job: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            killer.call = calls[0]
            if calls[0] != killer.occurrence:
                return real(job, *args, **kwargs)
            if not after:
                killer.die()
            real(job, *args, **kwargs)
            killer.die()

        _save.SaveJob.snapshot = snapshot


# ------------------------------------------------------------------------------- the jobs


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _committed(trial_dir: str, rank: int, step: int) -> None:
    """Note (append-only, survives this rank's death) that ``step`` is known committed."""
    with open(os.path.join(trial_dir, f"committed-{rank}.txt"), "a") as f:
        f.write(f"{step}\n")


def worker(job: str, rank: int, world: int, port: int, spec: dict[str, Any], root: str,
           trial_dir: str) -> None:
    """One rank of ``job`` ("seed", "crash" or "restart"); writes out-{job}-{rank}.json."""
    os.environ.update(OMP_NUM_THREADS="1", SAFECKPT_TIMEOUT=str(spec["timeout"]))
    if spec.get("plain_torchrun"):
        os.environ["TORCHELASTIC_RUN_ID"] = "none"
    if spec.get("nofile"):
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"], resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import torch
    import torch.distributed as dist

    import safeckpt

    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=spec["store_timeout"]))
        if job == "crash" and rank == spec["victim"]:
            Killer(spec, rank, trial_dir, root).install()
        state = make_state(bool(spec.get("mesh2d")))
        keep = None if job == "seed" else spec["keep_last"]
        mgr = safeckpt.CheckpointManager(root, keep_last=keep, async_save=spec["mode"] == "async",
                                         timeout=spec["timeout"], preemption_signals=())
        second = None
        if spec.get("second_manager") and job != "seed":  # full state + a best-model manager
            second = safeckpt.CheckpointManager(root + "-second", keep_last=1, async_save=True,
                                                timeout=spec["timeout"], preemption_signals=())
        out["where"] = "restore"
        step = mgr.restore(state)
        out["restored"] = step
        if step is not None:
            out["restore_mismatch"] = state_matches(state, step, rank)
            if job == "crash":
                _committed(trial_dir, rank, step)
        start = 0 if step is None else step
        if job == "crash" and spec.get("overwrite") and step is not None:
            start = step - 1  # the first save re-saves the restored step: an overwrite
        count = SEED_STEPS if job == "seed" else SAVES if job == "crash" else 1
        for i, s in enumerate(range(start + 1, start + 1 + count)):
            out["where"] = f"save {s}"
            set_step(state, s, rank)
            mgr.save(s, state)
            if second is not None:
                second.save(s, {"model": state["model"]})
            if spec["mode"] == "sync":
                _committed(trial_dir, rank, s)
            elif i:  # an async save() first waits for the previous one, raising its error
                _committed(trial_dir, rank, s - 1)
        out["where"] = "preempted"
        _ = mgr.preempted  # an all-reduce while an async save is still in flight
        out["where"] = "retain"
        mgr.retain()  # waits for an async save first (raising its error), then "retain"
        _committed(trial_dir, rank, start + count)
        out["where"] = "close"
        mgr.close()
        if second is not None:
            second.close()
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.update(t_err=time.time(), type=type(exc).__name__,
                   mro=[c.__name__ for c in type(exc).__mro__], msg=str(exc)[:4000],
                   failures={str(k): v for k, v in (getattr(exc, "failures", None) or {}).items()})
    _write_json(os.path.join(trial_dir, f"out-{job}-{rank}.json"), out)
    os._exit(0)  # no teardown: a process group with a dead peer may abort at exit (NOTES 5)
