"""Worker side of the kill matrix: the training job, and the patches that kill one rank.

Every kill is real: the victim process ends with SIGKILL or ``os._exit`` at the chosen point,
from whichever thread reaches it (async saves write and commit in a background thread). Just
before dying it writes ``kill.json`` (wall time, point) so the parent can time the survivors.

Kill points (``POINTS``) are named ``area/where``. Phase points wrap ``Coordinator.run``: die
at the phase's entry (before its local work) or after the local work, before the exchange.
The others patch the step they name (group creation, gloo's connect, a data-file write half
done, publish, a retention delete, a tensor read, the async snapshot).
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

# name -> (modes it applies to, victim must be rank 0, occurs once per save)
POINTS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "setup/before-first-call": (("sync", "async"), False, False),
    "setup/rendezvous": (("sync", "async"), False, False),
    "setup/new-group": (("sync", "async"), False, False),
    "setup/connect": (("sync", "async"), False, False),
    "async-setup/new-group": (("async",), False, False),
    "async-setup/connect": (("async",), False, False),
    "restore/pick": (("sync", "async"), False, False),
    "restore/pick-after": (("sync", "async"), False, False),
    "restore/open": (("sync", "async"), False, False),
    "restore/plan": (("sync", "async"), False, False),
    "restore/read": (("sync", "async"), False, False),
    "restore/apply": (("sync", "async"), False, False),
    "save/begin": (("sync", "async"), False, True),
    "save/agree": (("sync", "async"), False, True),
    "async/snapshot": (("async",), False, True),
    "async/snapshot-after": (("async",), False, True),
    "save/stage": (("sync", "async"), False, True),
    "save/stage-after": (("sync", "async"), False, True),
    "save/write": (("sync", "async"), False, True),
    "save/write-mid-file": (("sync", "async"), False, True),
    "save/write-after": (("sync", "async"), False, True),
    "save/commit": (("sync", "async"), False, True),
    "save/commit-before-publish": (("sync", "async"), True, True),
    "save/commit-after-publish": (("sync", "async"), True, True),
    "save/commit-after": (("sync", "async"), False, True),
    "save/retain": (("sync", "async"), False, True),
    "save/retain-mid": (("sync", "async"), True, True),
    "save/retain-after": (("sync", "async"), False, True),
}


# ------------------------------------------------------------------------- state and values


def make_state() -> dict[str, Any]:
    import torch
    from torch import nn

    import safeckpt

    return {"model": nn.Linear(64, 64), "big": torch.zeros(BIG), "rng": safeckpt.RNGState(),
            "meta": {"step": -1}}


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
        state["model"].weight.copy_(want["model/weight"])
        state["model"].bias.copy_(want["model/bias"])
        state["big"].copy_(want["big"])
    state["meta"] = {"step": step}
    torch.manual_seed(rng_seed(step, rank))


def state_matches(state: dict[str, Any], step: int, rank: int) -> str:
    """'' if ``state`` holds exactly step ``step``'s values (RNG of this rank included)."""
    import torch

    want = expected(step)
    got = {"model/weight": state["model"].weight, "model/bias": state["model"].bias, "big": state["big"]}
    bad = [k for k in want if not torch.equal(got[k].detach(), want[k])]
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
        self.local = threading.local()  # which armed phase this thread is inside

    def die(self) -> None:
        rec = {"t": time.time(), "point": self.point, "rank": self.rank, "method": self.method,
               "thread": threading.current_thread().name}
        tmp = os.path.join(self.trial_dir, f"kill.json.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, os.path.join(self.trial_dir, "kill.json"))
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
        phase = {"pick-after": "pick", "write-mid-file": "write", "stage-after": "stage",
                 "write-after": "write", "commit-after": "commit", "retain-after": "retain",
                 "commit-before-publish": "commit", "commit-after-publish": "commit",
                 "retain-mid": "retain", "read": "check"}.get(where, where)
        self._patch_run(phase, "after" if where.endswith("-after") else "entry"
                        if where in ("pick", "open", "plan", "apply", "begin", "agree", "stage",
                                     "write", "commit", "retain") else "inside")
        if where == "write-mid-file":
            self._patch_file_writes()
        elif where in ("commit-before-publish", "commit-after-publish"):
            self._patch_publish(before=where == "commit-before-publish")
        elif where == "retain-mid":
            self._patch_retention_delete()
        elif where == "read":
            self._patch_read()

    # -- phases
    def _patch_run(self, phase: str, when: str) -> None:
        from safeckpt import _dist

        real = _dist.Coordinator.run
        killer = self
        # restore phases happen once (the start-up restore); save phases once per save
        occurrence = self.occurrence if POINTS[self.point][2] else 1

        def run(coord: Any, name: str, fn: Any, **kwargs: Any) -> list[Any]:
            if name != phase:
                return real(coord, name, fn, **kwargs)
            n = killer.phase_calls[name] = killer.phase_calls.get(name, 0) + 1
            # "inside" points stay armed after their occurrence: a retention with nothing to
            # delete (the restored step is protected) leaves the kill to the next save's
            if n < occurrence or (n > occurrence and when != "inside"):
                return real(coord, name, fn, **kwargs)
            if when == "entry":
                killer.die()
            if when == "after":
                def fn_then_die() -> Any:
                    fn()
                    killer.die()
                return real(coord, name, fn_then_die, **kwargs)

            def armed() -> Any:  # "inside": the step patched below kills while fn runs
                killer.local.armed = True
                try:
                    return fn()
                finally:
                    killer.local.armed = False
            return real(coord, name, armed, **kwargs)

        _dist.Coordinator.run = run  # type: ignore[method-assign]

    def _armed(self) -> bool:
        return bool(getattr(self.local, "armed", False))

    # -- group creation
    def _patch_group_creation(self, nth: int, where: str) -> None:
        from safeckpt import _dist

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
    def _patch_file_writes(self) -> None:
        killer = self
        for name in ("write", "writev", "pwrite", "pwritev"):
            real = getattr(os, name, None)
            if real is None:
                continue

            def half_then_die(fd: int, data: Any, *rest: Any, _real: Any = real, _name: str = name) -> int:
                if not killer._armed() or not killer._in_root(fd):
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

    def _in_root(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
        except OSError:
            return False

    def _patch_publish(self, before: bool) -> None:
        import safeckpt._commit as commit_mod
        import safeckpt._save as save_mod

        killer = self
        for mod in (save_mod, commit_mod):
            real = getattr(mod, "publish", None)
            if real is None:
                continue

            def publish(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                if not killer._armed():
                    return _real(*args, **kwargs)
                if before:
                    killer.die()
                _real(*args, **kwargs)
                killer.die()

            mod.publish = publish

    def _patch_retention_delete(self) -> None:
        import safeckpt.manager as manager_mod

        killer = self
        real = manager_mod.remove_entry

        def remove_entry(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            if killer._armed():
                killer.die()
            return out

        manager_mod.remove_entry = remove_entry

    def _patch_read(self) -> None:
        from safeckpt import _reader

        killer = self
        cls = _reader.TensorReader
        name = "_compare"  # every chunk a load reads is checked against its checksum here
        real = getattr(cls, name)
        reads = [0]

        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            reads[0] += 1
            if reads[0] >= 2:  # one chunk read and verified, die having read the next
                killer.die()
            return real(self, *args, **kwargs)

        setattr(cls, name, read)  # reads happen only in the start-up restore

    def _patch_snapshot(self, after: bool) -> None:
        from safeckpt import _save

        killer = self
        real = _save._SaveJob.snapshot
        calls = [0]

        def snapshot(job: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] != killer.occurrence:
                return real(job, *args, **kwargs)
            if not after:
                killer.die()
            real(job, *args, **kwargs)
            killer.die()

        _save._SaveJob.snapshot = snapshot


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
        state = make_state()
        keep = None if job == "seed" else spec["keep_last"]
        mgr = safeckpt.CheckpointManager(root, keep_last=keep, async_save=spec["mode"] == "async",
                                         timeout=spec["timeout"], preemption_signals=())
        out["where"] = "restore"
        step = mgr.restore(state)
        out["restored"] = step
        if step is not None:
            out["restore_mismatch"] = state_matches(state, step, rank)
            if job == "crash":
                _committed(trial_dir, rank, step)
        start = 0 if step is None else step
        count = SEED_STEPS if job == "seed" else SAVES if job == "crash" else 1
        for i, s in enumerate(range(start + 1, start + 1 + count)):
            out["where"] = f"save {s}"
            set_step(state, s, rank)
            mgr.save(s, state)
            if spec["mode"] == "sync":
                _committed(trial_dir, rank, s)
            elif i:  # an async save() first waits for the previous one, raising its error
                _committed(trial_dir, rank, s - 1)
        out["where"] = "preempted"
        _ = mgr.preempted  # one more collective: a peer lost after the last save shows here
        out["where"] = "close"
        mgr.close()
        _committed(trial_dir, rank, start + count)
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.update(t_err=time.time(), type=type(exc).__name__,
                   mro=[c.__name__ for c in type(exc).__mro__], msg=str(exc)[:4000],
                   failures={str(k): v for k, v in (getattr(exc, "failures", None) or {}).items()})
    _write_json(os.path.join(trial_dir, f"out-{job}-{rank}.json"), out)
    os._exit(0)  # no teardown: a process group with a dead peer may abort at exit (NOTES 5)
