"""Run mutants in a worker process, one at a time, so that no mutant can stall or kill the fuzzer.

The worker (:func:`tests.helpers.fuzz_oracle.worker_main`) reports each call before making it; a call
that does not return within the limit is a HANG (the worker is killed, and whether it was
blocked or busy on CPU is noted), a worker that dies is a CRASH, and the next mutant gets a
fresh worker. Every run ends with :data:`CANARY`, which must come back as a blocked HANG.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

from tests.helpers.fuzz_mutants import Mutant
from tests.helpers.fuzz_oracle import CALLS, cleanup, mutant_dict, worker_main

CANARY = Mutant(-1, "single", "canary", "the harness itself blocks (opens a FIFO for writing)",
                (("fifo", "@outside/canary"), ("append", "@outside/canary", b"x")))
"""Run last by every fuzz run: it must come back as a blocked HANG, or hang detection is broken."""


def _cpu_seconds(pid: int) -> float:
    """CPU time used so far by process ``pid`` (0 if unknown): tells a slow call from a blocked one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class Pool:
    """One worker process at a time; a call over ``call_timeout`` seconds is a HANG."""

    def __init__(self, bases: dict[str, str], *, call_timeout: float = 30.0, start_timeout: float = 300.0,
                 calls: tuple[str, ...] = CALLS) -> None:
        self.bases = bases
        self.calls = calls
        self.call_timeout = call_timeout
        self.start_timeout = start_timeout
        self.scratch = tempfile.mkdtemp(prefix="safeckpt-fuzz-")
        self.proc: Any = None
        self.conn: Any = None
        self.restarts = 0

    def _start(self, attempts: int = 6) -> None:
        """Start a worker; retry a few times (src/ may be caught mid-edit by a worker's imports)."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                time.sleep(10)

    def _start_once(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            self.proc = ctx.Process(target=worker_main, args=(child, self.bases, self.scratch, self.calls), daemon=True)
            self.proc.start()
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        child.close()
        if not self.conn.poll(self.start_timeout):
            self._kill()
            raise RuntimeError("fuzz worker did not start")
        try:
            kind, info = self.conn.recv()
        except (EOFError, OSError):
            kind, info = "error", f"worker died at start (exit code {self.proc.exitcode})"
        if kind != "ready":
            self._kill()
            raise RuntimeError(f"fuzz worker failed to start:\n{info}")

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
        self.proc = None
        self.restarts += 1

    def run(self, m: Mutant, timeout: float | None = None) -> dict[str, Any]:
        """Run one mutant; ``timeout`` overrides the per-call limit (for the canary)."""
        limit = self.call_timeout if timeout is None else timeout
        if self.proc is None:
            self._start()
        self.conn.send(m)
        current = "send"
        t0 = time.monotonic()
        cpu0 = _cpu_seconds(self.proc.pid)
        while True:
            if not self.conn.poll(limit):
                used = _cpu_seconds(self.proc.pid) - cpu0
                how = (f"busy: {used:.0f}s of CPU, slow rather than blocked" if used > limit / 4
                       else f"blocked: {used:.1f}s of CPU")
                self._kill()
                return self._failed(m, "HANG", f"{current} did not return within {limit:.0f}s ({how})")
            try:
                kind, info = self.conn.recv()
            except (EOFError, OSError):
                code = self.proc.exitcode if self.proc is not None else None
                self._kill()
                return self._failed(m, "CRASH", f"worker died (exit code {code}) during {current}")
            if kind == "call":
                current = info
                cpu0 = _cpu_seconds(self.proc.pid)
                continue
            info["secs"] = round(time.monotonic() - t0, 2)
            if info["rss_mb"] > 50:  # keep the next mutant's peak-RSS baseline honest
                self._kill()
            return info

    @staticmethod
    def _failed(m: Mutant, label: str, detail: str) -> dict[str, Any]:
        return {"mutant": mutant_dict(m), "bad": {label: detail}, "outcome": "BAD",
                "calls": {}, "rss_mb": 0.0}

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.conn.send(None)
                self.proc.join(10)
            except OSError:
                pass
            if self.proc.is_alive():
                self.proc.kill()
        self.proc = None
        cleanup(self.scratch)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
