"""Many-tensor saves for bench_load.py: safeckpt.save vs one writev of the same bytes.

The raw reference is the disk's speed for these bytes: one file, the tensors' own memory handed
to ``os.writev`` (``IOV_MAX`` buffers per call), then fsync. Its buffer list is built before the
clock starts; only the write and the fsync are timed. Both outputs are removed, and
``os.sync()`` called, between runs, outside the timed region.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash
from bench_save import remove, settle
from load_states import check, fingerprint, fresh_like, local_bytes

import safeckpt

IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)


def writev_all(fd: int, bufs: list[Any]) -> int:
    """Write every buffer, in order, with as few ``os.writev`` calls as the kernel allows."""
    views = [memoryview(b).cast("B") for b in bufs]
    total = 0
    while views:
        batch = views[:IOV_MAX]
        n = os.writev(fd, batch)
        total += n
        done = 0
        while done < len(batch) and n >= len(batch[done]):  # drop fully written buffers
            n -= len(batch[done])
            done += 1
        views = views[done:]
        if views and n:
            views[0] = views[0][n:]
    return total


def raw_write(bufs: list[Any], path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writev_all(fd, bufs)
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_raw_file(path: str, bufs: list[Any]) -> None:
    want = xxhash.xxh3_128()
    for b in bufs:
        want.update(b)
    got = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            got.update(chunk)
    if got.digest() != want.digest():
        raise AssertionError(f"raw write: {path} does not hold the tensors' bytes")


def bench_many_sync(state: dict[str, torch.Tensor], root: str, reps: int,
                    log: Callable[[str], None]) -> dict[str, list[float]]:
    """Sync ``safeckpt.save`` vs raw writev + fsync, alternating which goes first."""
    bufs = [local_bytes(t) for t in state.values()]
    want = fingerprint(state)
    res: dict[str, list[float]] = {"raw": [], "safeckpt": []}
    fns = {"raw": lambda p: raw_write(bufs, p), "safeckpt": lambda p: safeckpt.save(p, state)}
    for rnd in range(reps + 1):  # round 0: untimed warm-up, results checked
        order = ["raw", "safeckpt"] if rnd % 2 else ["safeckpt", "raw"]
        for name in order:
            p = os.path.join(root, f"many-{name}")
            settle()
            t0 = time.perf_counter()
            fns[name](p)
            dt = time.perf_counter() - t0
            if rnd == 0:
                if name == "raw":
                    _check_raw_file(p, bufs)
                else:
                    back = fresh_like(state)
                    safeckpt.load(p, back)
                    check(back, want, "safeckpt.save (many tensors)")
            else:
                res[name].append(dt)
            remove(p)
        if rnd:
            log(f"  sync rep {rnd}/{reps}: raw {res['raw'][-1]:.3f}s, safeckpt {res['safeckpt'][-1]:.3f}s")
    return res


def verify_async(state: dict[str, torch.Tensor], root: str) -> None:
    """An async save holds the values of the moment ``save()`` returned, even if the training
    loop overwrites the tensors right after. Overwrites ``state`` (run it last)."""
    want = fingerprint(state)
    path = os.path.join(root, "async-check")
    with safeckpt.CheckpointManager(path, keep_last=1, async_save=True, preemption_signals=()) as mgr:
        mgr.save(1, state)
        with torch.no_grad():
            for t in state.values():
                t.fill_(-1.0)
        mgr.wait()
        back = fresh_like(state)
        if mgr.restore(back) != 1:
            raise AssertionError("async save: step 1 not restored")
    check(back, want, "async CheckpointManager.save (many tensors)")
    remove(path)
