"""Several CheckpointManagers in one process (issue 27, item 3): a full-state manager and a
best-model manager, both async, beside a sync one, saving interleaved on 2 real gloo ranks.

Before the fix the two async managers' background threads shared one cached gloo group (keyed
by process group, timeout and the purpose "async"): their collectives interleaved, both saves
failed after ``timeout`` and the group was poisoned. Each async manager now agrees on a group
of its own (named by its root, the same on every rank).
"""

from __future__ import annotations

import torch

from safeckpt import CheckpointManager
from tests.helpers import dist_harness


def _interleaved(rank: int, world: int, base: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    full = CheckpointManager(f"{base}/full", keep_last=2, async_save=True, timeout=20)
    best = CheckpointManager(f"{base}/best", keep_best=1, best_metric="loss", keep_last=1,
                             async_save=True, timeout=20)
    plain = CheckpointManager(f"{base}/plain", keep_last=1, timeout=20)
    # Big enough that the background writes overlap: each save's thread is still writing when
    # the next manager's save starts.
    extra = {"blob": torch.arange(500_000, dtype=torch.float32) + rank * 0}
    for step in range(1, 4):
        with torch.no_grad():
            model.weight.fill_(step)
        full.save(step, {"model": model, "extra": extra, "step": step})
        best.save(step, {"model": model}, metrics={"loss": 10.0 - step})
        plain.save(step, {"model": model, "step": step})
    for m in (full, best, plain):
        m.close()
    out = {}
    for name in ("full", "best", "plain"):
        mgr = CheckpointManager(f"{base}/{name}", keep_last=None, timeout=20)
        out[name] = [c.step for c in mgr.list()]
        target = torch.nn.Linear(64, 32)
        state = {"model": target}
        if name == "full":
            state.update(extra={"blob": torch.zeros(500_000)}, step=0)
        elif name == "plain":
            state.update(step=0)
        assert mgr.restore(state) == 3
        assert bool((target.weight == 3).all())
        mgr.close()
    return out


def test_two_async_managers_and_a_sync_one_in_one_process(tmp_path):
    outs = dist_harness.run(_interleaved, 2, str(tmp_path), timeout=150)
    for o in outs:
        assert o.ok, o.message
        assert o.value == {"full": [2, 3], "best": [3], "plain": [3]}
