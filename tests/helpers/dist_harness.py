"""Run a function on N real processes joined by a gloo process group on 127.0.0.1.

Every run has a hard timeout: a hang becomes a test failure, never a stuck CI job. Each
worker's outcome (return value, or exception type/message/failing ranks, or exit code when it
died) comes back to the test for assertions.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import re
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT = 90.0

# What a gloo process prints when it aborts at interpreter exit with a DDP/FSDP module or a
# process group still alive (NOTES.md section 5: about 1 in 20 processes, safeckpt or not).
TEARDOWN_ABORT = "terminate called without an active exception"
_FRAME = re.compile(r'File "([^"]+)"')


def is_gloo_teardown_abort(output: str) -> bool:
    """True when a torchrun job's only failure is that teardown abort: a rank died by SIGABRT
    with the message above, and the only Python traceback is torchrun's own report of it
    (an exception in the job's code or in safeckpt has frames elsewhere: a real failure)."""
    if TEARDOWN_ABORT not in output or not re.search(r"exitcode\s*:\s*-6\b", output):
        return False
    frames = _FRAME.findall(output)
    return all(f.startswith("<frozen ") or "torch/distributed/" in f.replace(os.sep, "/")
               for f in frames)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    rank: int
    ok: bool = False
    value: Any = None
    error_type: str | None = None
    error_mro: list[str] = field(default_factory=list)
    message: str = ""
    failures: dict[int, str] = field(default_factory=dict)
    exitcode: int | None = None

    def raised(self, name: str) -> bool:
        return name in self.error_mro


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, env: dict[str, str],
            args: tuple, queue: Any, pg_timeout: float) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    out = Outcome(rank)
    try:
        if world_size > 0:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
        out.value = fn(rank, world_size, *args)
        out.ok = True
    except BaseException as exc:  # noqa: BLE001
        out.error_type = type(exc).__name__
        out.error_mro = [c.__name__ for c in type(exc).__mro__]
        out.message = str(exc) + "\n" + "".join(traceback.format_exception(exc)[-3:])
        out.failures = dict(getattr(exc, "failures", {}) or {})
    queue.put(out)
    gc.collect()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
        env: dict[str, str] | None = None, pg_timeout: float = 60.0) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; outcomes by rank.

    Raises AssertionError if the run does not finish within ``timeout`` seconds (a hang).
    Ranks that died without reporting get ``exitcode`` set and ``ok=False``.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    base_env = {"SAFECKPT_TIMEOUT": "30", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, base_env, args, queue, pg_timeout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcomes = collect(procs, queue, deadline)
    hung = [r for r, p in enumerate(procs) if r not in outcomes and p.is_alive()]
    for p in procs:
        p.join(timeout=max(0.5, deadline - time.monotonic()) if not hung else 0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s (hang)")
    result = []
    for r, p in enumerate(procs):
        o = outcomes.get(r, Outcome(r))
        o.exitcode = p.exitcode
        result.append(o)
    return result


def collect(procs: list[Any], queue: Any, deadline: float) -> dict[int, Outcome]:
    """The outcomes ``procs`` put on ``queue`` by ``deadline`` (fewer if some died or hung)."""
    import queue as queue_mod

    outcomes: dict[int, Outcome] = {}
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        try:
            o = queue.get(timeout=0.2)
            outcomes[o.rank] = o
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    return outcomes


def attempt(fn: Callable[[], Any]) -> dict:
    """Run ``fn``; describe its outcome (picklable) with the time it took."""
    import time

    t0 = time.monotonic()
    try:
        value = fn()
        return {"ok": True, "value": value, "elapsed": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {
            "ok": False,
            "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "msg": str(exc),
            "failures": dict(getattr(exc, "failures", {}) or {}),
            "elapsed": time.monotonic() - t0,
        }


def leftovers(root: Any) -> list[str]:
    """Staging/trash leftovers directly under ``root``."""
    from safeckpt.format.manifest import STAGING_MARK, TRASH_MARK

    return sorted(n for n in os.listdir(root) if STAGING_MARK in n or TRASH_MARK in n)
