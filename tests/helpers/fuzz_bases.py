"""The real checkpoints the fuzzer damages, the states they hold, and exact comparison.

Each *base* is a root holding two committed checkpoints of the same state layout: an older one
(``step-0000000001``, state A) and a newer one (``step-0000000002``, state B, one optimizer step
and some value changes later). Mutants damage only the newer one, so ``restore`` on the root must
fall back to A (whose values differ from B, so a wrong fallback is visible).

- ``single``: saved by ``safeckpt.save`` in this process.
- ``ddp``: saved by 2 gloo ranks with a DDP-wrapped model (per-rank RNG, per-rank object trees
  in rank 1's index); loaded here by one process into the plain layout.
- ``fsdp``: saved by 2 gloo ranks through ``CheckpointManager.save`` with DTensors (a 1-d mesh
  and a 2-d one listing its ranks out of order: ``sharding``; explicit ``boxes`` come from
  consistent forged rewrites), replicated tensors cut into row ``pieces`` over both ranks (the
  plan's minimum piece lowered for the base) and two extra files; loaded here by one process
  into plain tensors.

Every base is also fuzzed in format 2 (``NAME.f2``: both checkpoints rewritten by
``tests.helpers.manifest_checks.as_format2``, chunks listed in the manifest), which readers keep reading.

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
BASES_VERSION = 3  # bump when build_state changes: stored bases of another layout are rebuilt
STEP_A = "step-0000000001"
STEP_B = "step-0000000002"


def build_state(seed: int, *, steps: int = 1, rank: int = 0, ddp: bool = False, sharded: bool = False
                ) -> dict[str, Any]:
    """A full training-like state; ``seed`` sets every value, ``steps`` the optimizer steps.
    ``sharded``: an entry ``sh`` of 2-d tensors (DTensors when a 2-rank group is up, else plain
    full tensors: the single-process load target of the ``fsdp`` base)."""
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
    if sharded:
        state["sh"] = _sharded_entry(seed)
    # Per-rank RNG streams (the RNG state is per-rank state); plain tensors above stay replicated.
    torch.manual_seed(seed * 1000 + rank)
    random.seed(seed * 1000 + rank)
    np.random.seed(seed * 1000 + rank)
    for _ in range(steps):
        train_step(state, 0 if sharded else rank)  # sharded: the replicated model equal on every rank
    return state


SHARDED_SHAPES = {"rule": (6, 4), "mesh2d": (3, 5), "rows": (400, 3)}


def _sharded_entry(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed * 31)
    full = {k: torch.randn(*shape, generator=g) for k, shape in SHARDED_SHAPES.items()}
    import torch.distributed as dist

    if not dist.is_initialized():
        return full
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def shard(t: torch.Tensor, mesh: Any, placements: list[Any], dim: int) -> Any:
        # from_local with this rank's torch.chunk piece (distribute_tensor scatters wrongly on a
        # mesh whose ranks are not in order)
        pos = mesh.get_coordinate()[-1]
        local = torch.chunk(t, mesh.size(), dim=dim)[pos].clone()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())

    return {
        "rule": shard(full["rule"], DeviceMesh("cpu", [0, 1]), [Shard(0)], 0),
        # 2-d, its ranks listed (not a range from 0)
        "mesh2d": shard(full["mesh2d"], DeviceMesh("cpu", [[1, 0]]), [Replicate(), Shard(1)], 1),
        "rows": full["rows"],  # replicated, cut into row pieces over both ranks
    }


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
    for t in state.get("sh", {}).values():
        with torch.no_grad():
            t.mul_(-1.0)  # DTensors: every rank negates its own shard
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
    from tests.helpers import dist_harness

    outcomes = dist_harness.run(_ddp_writer, 2, root, timeout=120)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError(f"writing the ddp base failed: {[(o.rank, o.message) for o in bad]}")


def _fsdp_writer(rank: int, world_size: int, root: str) -> None:
    from safeckpt.engine import plan as _plan

    _plan.MIN_PIECE = 64  # spread replicated rows over both ranks (only tiny tensors here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = build_state(1, rank=rank, sharded=True)  # a replicated model (no DDP), per-rank RNG
        with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
            extra = {"trainer_state.json": b'{"global_step": 1}', "notes.txt": b"x" * 300}
            mgr.save(1, state, extra_files=extra)
            train_step(state)
            extra = {"trainer_state.json": b'{"global_step": 2}', "notes.txt": b"y" * 300}
            mgr.save(2, state, extra_files=extra)


def write_fsdp(root: str) -> None:
    """The ``fsdp`` base: A and B saved by 2 gloo ranks with DTensors and extra files."""
    from tests.helpers import dist_harness

    outcomes = dist_harness.run(_fsdp_writer, 2, root, timeout=120)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError(f"writing the fsdp base failed: {[(o.rank, o.message) for o in bad]}")


WRITERS = {"single": write_single, "ddp": write_ddp, "fsdp": write_fsdp}
F2 = ".f2"  # suffix of a base rewritten in format 2


def layout_of(base: str) -> str:
    """The format-3 base whose state layout ``base`` has (``fsdp.f2`` -> ``fsdp``)."""
    return base.removesuffix(F2)


_FRESH: dict[bool, dict[str, Any]] = {}


def fresh_state(base: str = "single") -> dict[str, Any]:
    """A load target with ``base``'s layout and values unlike both A and B (a deep copy of one
    built once: modules, optimizer and scheduler copied together keep their links)."""
    sharded = layout_of(base) == "fsdp"
    if sharded not in _FRESH:
        _FRESH[sharded] = build_state(7, sharded=sharded)
    return copy.deepcopy(_FRESH[sharded])


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
