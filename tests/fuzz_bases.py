"""The real checkpoints the fuzzer damages, the states they hold, and exact comparison.

Each *base* is a root holding two committed checkpoints of the same state layout: an older one
(``step-0000000001``, state A) and a newer one (``step-0000000002``, state B, one optimizer step
and some value changes later). Mutants damage only the newer one, so ``restore`` on the root must
fall back to A (whose values differ from B, so a wrong fallback is visible).

- ``single``: saved by ``safeckpt.save`` in this process.
- ``ddp``: saved by 2 gloo ranks with a DDP-wrapped model (per-rank RNG, replicated chunks
  spread across two data files); loaded here by one process into the plain layout.

The state covers what users checkpoint: a module with several layers and buffers (an int64
0-d counter), AdamW after a step, an LR scheduler, ``RNGState``, a plain tensor, and a tree of
lists/tuples/int-keyed dicts, strings, floats (inf, -inf, nan, -0.0), a 0-d tensor, an empty
tensor, bf16/f16/int/bool tensors and one tensor referenced twice (tied: stored once).
"""

from __future__ import annotations

import copy
import math
import os
import random
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

import safeckpt

MANIFEST = "manifest.json"
BASES_VERSION = 2  # bump when build_state changes: stored bases of another layout are rebuilt
STEP_A = "step-0000000001"
STEP_B = "step-0000000002"


def build_state(seed: int, *, steps: int = 1, rank: int = 0, ddp: bool = False) -> dict[str, Any]:
    """A full training-like state; ``seed`` sets every value, ``steps`` the optimizer steps."""
    torch.manual_seed(seed)
    model: nn.Module = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
    )
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * seed)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    shared = torch.randn(3, 2)
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "rng": safeckpt.RNGState(),
        "t": torch.randn(5),
        "tree": {
            "a": [seed, 2.5, math.inf, -math.inf, math.nan, "s", None, True, -0.0, 1e-300],
            "b": (seed, (2, [3, "x"])),
            "c": {1: "one", 2: torch.tensor(float(seed)), -5: [1, {"k": 2}]},
            "z": torch.tensor(seed, dtype=torch.int64),
            "e": torch.empty(0, 3),
            "bf": torch.randn(2, 3).bfloat16(),
            "f16": torch.randn(4).half(),
            "i": torch.arange(6, dtype=torch.int32).reshape(2, 3) * seed,
            "i8": torch.tensor([-1, 2, seed], dtype=torch.int8),
            "mask": torch.tensor([True, False, seed % 2 == 0]),
            "s": f"run-{seed}/path with spaces",
            "nested": {"deep": {"x": [{"y": seed}, []], "empty": {}}},
            "step": seed * 100,
            "tied": [shared, shared],  # stored once: the second is an alias (alias_of)
        },
    }
    # Per-rank RNG streams (the RNG state is per-rank state); plain tensors above stay replicated.
    torch.manual_seed(seed * 1000 + rank)
    random.seed(seed * 1000 + rank)
    np.random.seed(seed * 1000 + rank)
    for _ in range(steps):
        train_step(state, rank)
    return state


def train_step(state: dict[str, Any], rank: int = 0) -> None:
    """One optimizer and scheduler step that changes every kind of value in the state."""
    model, opt = state["model"], state["optim"]
    g = torch.Generator().manual_seed(1234 + rank + int(state["tree"]["step"]))
    x = torch.randn(6, 4, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    state["sched"].step()
    with torch.no_grad():
        state["t"].add_(1.0)
        state["tree"]["i"].add_(1)
    state["tree"]["step"] += 1
    state["tree"]["a"][1] += 1.0
    random.random()
    torch.rand(3)


def write_single(root: str) -> None:
    """The ``single`` base: A and B saved by this process (no process group)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = build_state(1)
        safeckpt.save(os.path.join(root, STEP_A), state)
        train_step(state)
        safeckpt.save(os.path.join(root, STEP_B), state)


def _ddp_writer(rank: int, world_size: int, root: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = build_state(1, rank=rank, ddp=True)  # BatchNorm stats differ per rank: rank 0's are saved
        safeckpt.save(os.path.join(root, STEP_A), state)
        train_step(state, rank)
        safeckpt.save(os.path.join(root, STEP_B), state)


def write_ddp(root: str) -> None:
    """The ``ddp`` base: A and B saved by 2 gloo ranks (one spawned run, ~5-10 s)."""
    from tests import dist_harness

    outcomes = dist_harness.run(_ddp_writer, 2, root, timeout=120)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError(f"writing the ddp base failed: {[(o.rank, o.message) for o in bad]}")


_FRESH: list[dict[str, Any]] = []


def fresh_state() -> dict[str, Any]:
    """A load target with the bases' layout and values unlike both A and B (a deep copy of one
    built once: modules, optimizer and scheduler copied together keep their links)."""
    if not _FRESH:
        _FRESH.append(build_state(7))
    return copy.deepcopy(_FRESH[0])


# ------------------------------------------------------------------ snapshots and equality
def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of every value the caller would observe (RNG: the global generators)."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            out[name] = {k: t.detach().clone() for k, t in value.state_dict().items()}
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach().clone()
        elif hasattr(value, "state_dict"):
            out[name] = _copy(value.state_dict())
        else:
            out[name] = _copy(value)
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    return value


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (bit-exact tensors, type-exact scalars), or None."""
    if type(a) is not type(b) and not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{where or '<root>'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        ab = a.detach().reshape(-1).contiguous().view(torch.uint8)
        bb = b.detach().reshape(-1).contiguous().view(torch.uint8)
        return None if torch.equal(ab, bb) else f"{where}: tensor values differ"
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(repr, set(a) ^ set(b)))[:5]} differ"
        for k in a:
            diff = first_difference(a[k], b[k], f"{where}/{k}")
            if diff:
                return diff
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = first_difference(x, y, f"{where}/{i}")
            if diff:
                return diff
        return None
    if isinstance(a, float):
        same = (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
        return None if same else f"{where}: {a!r} vs {b!r}"
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays inside RNG states
        return None if (a.shape == b.shape and (a == b).all()) else f"{where}: array differs"
    return None if a == b else f"{where}: {a!r} vs {b!r}"
