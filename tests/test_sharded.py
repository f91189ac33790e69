"""Sharded state (FSDP2 / DTensor): every rank writes only its shards; loads reshard.

Scenarios are combined into few real gloo runs (a spawn costs seconds):

- the test process (no process group) trains a plain model and saves ``plain``;
- 2 ranks: ``plain`` -> FSDP2 (plain -> sharded), train, save ``fsdp2`` and ``fresh`` (an
  optimizer before its first step);
- 4 ranks: ``fsdp2`` -> FSDP2 (2 -> 4, per-rank RNG 2 -> 4, bytes read == own shards), train,
  save ``fsdp4``; ``fresh`` -> FSDP2 optimizer with state (empty state restored); save an
  HSDP model (2x2 mesh, replicated shards written once, spread over the replicas) as ``hsdp``;
- 2 ranks: ``fsdp4`` -> FSDP2 (4 -> 2) and -> plain modules on each rank, then a training step;
  ``hsdp`` -> FSDP2;
- the test process: ``fsdp4`` -> plain module + AdamW (4 -> 1, no process group).

After each load, full values (params, exp_avg, exp_avg_sq, step) are compared bit for bit with
the values the saving run had, which also equal ``read_state_dict`` of the checkpoint.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch import nn

import safeckpt
from tests.helpers import dist_harness
from tests.helpers.manifest_checks import assert_canonical

pytestmark = pytest.mark.timeout(240)


def _model(seed: int) -> nn.Module:
    # Shard sizes along dim 0: 13 -> 7/6 (2 ranks), 4/4/4/1 (4 ranks); 6 -> 2/2/2/0; 1 -> 1/0/0/0
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(10, 13), nn.ReLU(), nn.Linear(13, 6), nn.ReLU(), nn.Linear(6, 1))
    m.register_buffer("scale", torch.arange(3, dtype=torch.float32) + seed)
    return m


def _fsdp(seed: int, world: int, hsdp: bool = False) -> nn.Module:
    """FSDP2 over all ranks, or with ``hsdp`` HSDP on a (2, world/2) mesh: shards replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    m = _model(seed)
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int, rank: int = 0) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(1000 * seed + 10 * i + rank)
        model(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Full values keyed like read_state_dict of an FQN-keyed checkpoint (collective for FSDP2)."""
    out = {f"model/{k}": _full(p) for k, p in model.named_parameters()}
    out.update({f"model/{k}": _full(b) for k, b in model.named_buffers()})
    if opt is not None:
        for k, p in model.named_parameters():
            for field, v in opt.state.get(p, {}).items():
                out[f"optim/state/{k}/{field}"] = _full(v)
    return out


def by_name(flat: dict, model: nn.Module) -> dict[str, torch.Tensor]:
    """read_state_dict output with optimizer state keyed by parameter name, tensors only."""
    names = [k for k, _ in model.named_parameters()]
    out = {}
    for k, v in flat.items():
        if not isinstance(v, torch.Tensor) or not k.startswith(("model/", "optim/state/")):
            continue
        parts = k.split("/")
        if parts[0] == "optim" and parts[2].isdigit():
            parts[2] = names[int(parts[2])]
        out["/".join(parts)] = v
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k} differs"


def _count_reads(log: list[int]) -> None:
    from safeckpt.engine import reader as _reader

    orig = _reader.TensorReader.close

    def close(self):  # type: ignore[no-untyped-def]
        log.append(self.nbytes_read)
        orig(self)

    _reader.TensorReader.close = close  # type: ignore[method-assign]


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _local_bytes(model: nn.Module, opt: torch.optim.Optimizer, rng: bool) -> int:
    """What a rank must read to restore its own part: its shards of params and Adam moments,
    the 0-d steps, the (replicated) buffers and its RNG state."""
    n = _tensor_bytes(safeckpt.RNGState().state_dict()) if rng else 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        n += 3 * local.numel() * local.element_size()
        n += opt.state[p]["step"].numel() * 4
    return n + sum(b.numel() * b.element_size() for b in model.buffers())


# ---------------------------------------------------------------------- workers (spawned)
def _run_2_ranks_save(rank, world, root):
    model = _fsdp(seed=7, world=world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    # plain -> FSDP2 (the checkpoint's optimizer state is keyed by position)
    info = safeckpt.load(os.path.join(root, "plain"), {"model": model, "optim": opt})
    assert info.world_size == 1
    after_plain = full_state(model, opt)
    _train(model, opt, 2, seed=2, rank=rank)
    # FSDP2 optimizer state is DTensor; its step is a plain tensor
    p0 = next(model.parameters())
    assert type(opt.state[p0]["exp_avg"]).__name__ == "DTensor"
    torch.manual_seed(500 + rank)
    safeckpt.save(os.path.join(root, "fsdp2"), {"model": model, "optim": opt, "rng": safeckpt.RNGState(), "epoch": 3})
    rng_next = torch.rand(3)
    saved = full_state(model, opt)
    # An optimizer before its first step: saving must not create state (no hidden step()).
    fresh = _fsdp(seed=8, world=world)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.02)
    safeckpt.save(os.path.join(root, "fresh"), {"model": fresh, "optim": fresh_opt})
    assert len(fresh_opt.state) == 0
    out = {"after_plain": after_plain, "saved": saved, "rng_next": rng_next} if rank == 0 else {"rng_next": rng_next}
    return _portable(out)


def _run_4_ranks(rank, world, root):
    reads: list[int] = []
    _count_reads(reads)
    model = _fsdp(seed=11, world=world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 1, seed=9, rank=rank)  # so the load has something to overwrite
    torch.manual_seed(900 + rank)
    before = torch.get_rng_state()
    state = {"model": model, "optim": opt, "rng": safeckpt.RNGState(), "epoch": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safeckpt.load(os.path.join(root, "fsdp2"), state)
    rng_msgs = [str(w.message) for w in caught if issubclass(w.category, safeckpt.SafeckptWarning)]
    rng_kept = torch.equal(torch.get_rng_state(), before)
    rng_next = torch.rand(3) if rank < 2 else None
    loaded = full_state(model, opt)
    nread, need = reads[-1], _local_bytes(model, opt, rng=rank < 2)
    _train(model, opt, 1, seed=4, rank=rank)
    safeckpt.save(os.path.join(root, "fsdp4"), {"model": model, "optim": opt, "rng": safeckpt.RNGState(), "epoch": 4})
    saved = full_state(model, opt)
    # An empty optimizer state (saved before the first step) replaces existing state.
    safeckpt.load(os.path.join(root, "fresh"), {"model": model, "optim": opt})
    fresh_empty = len(opt.state) == 0 and opt.param_groups[0]["lr"] == 0.02
    fresh = full_state(model, None)
    # HSDP (replicated shards): each distinct shard is written once
    hsdp = _fsdp(seed=21, world=world, hsdp=True)
    hsdp_opt = torch.optim.AdamW(hsdp.parameters(), lr=0.01)
    _train(hsdp, hsdp_opt, 1, seed=21, rank=rank // 2)
    safeckpt.save(os.path.join(root, "hsdp"), {"model": hsdp, "optim": hsdp_opt})
    hsdp_saved = full_state(hsdp, hsdp_opt)
    out = {"rng_msgs": rng_msgs, "rng_kept": rng_kept, "rng_next": rng_next, "nread": nread,
           "need": need, "epoch": state["epoch"], "fresh_empty": fresh_empty}
    if rank == 0:
        out.update(loaded=loaded, saved=saved, fresh=fresh, hsdp_saved=hsdp_saved)
    return _portable(out)


def _run_2_ranks_load(rank, world, root):
    reads: list[int] = []
    _count_reads(reads)
    model = _fsdp(seed=12, world=world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safeckpt.load(os.path.join(root, "fsdp4"), {"model": model, "optim": opt, "rng": safeckpt.RNGState(), "epoch": 0})
    msgs = [str(w.message) for w in caught if issubclass(w.category, safeckpt.SafeckptWarning)]
    fsdp_loaded = full_state(model, opt)
    nread, need = reads[-1], _local_bytes(model, opt, rng=True)
    _train(model, opt, 1, seed=5, rank=rank)  # the resharded optimizer state is usable
    steps = {float(s["step"]) for s in opt.state.values()}
    # FSDP2 -> plain module on every rank (as under DDP)
    plain = _model(seed=13)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    safeckpt.load(os.path.join(root, "fsdp4"), {"model": plain, "optim": plain_opt, "rng": safeckpt.RNGState(), "epoch": 0})
    plain_loaded = full_state(plain, plain_opt)
    # HSDP on 4 ranks -> FSDP2 on 2
    model = _fsdp(seed=22, world=world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    safeckpt.load(os.path.join(root, "hsdp"), {"model": model, "optim": opt})
    hsdp_loaded = full_state(model, opt)
    out = {"msgs": msgs, "nread": nread, "need": need, "steps": steps}
    if rank == 0:
        out.update(fsdp_loaded=fsdp_loaded, plain_loaded=plain_loaded, hsdp_loaded=hsdp_loaded)
    return _portable(out)


def _portable(value):
    """Tensors -> numpy arrays for the trip back to the test (torch would pass shared memory
    file descriptors, which vanish when the worker exits)."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    return value


def _tensors(value):
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _tensors(v) for k, v in value.items()}
    return value


def _ok(outcomes):
    assert all(o.ok for o in outcomes), "\n".join(f"rank {o.rank}: {o.message}" for o in outcomes)
    return [_tensors(o.value) for o in outcomes]


# ---------------------------------------------------------------------------- the test
def test_fsdp2_reshard_2_4_2_1_and_plain(tmp_path):
    root = str(tmp_path)
    # plain model, no process group
    plain = _model(seed=1)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    _train(plain, plain_opt, 2, seed=1)
    safeckpt.save(os.path.join(root, "plain"), {"model": plain, "optim": plain_opt})
    plain_ref = full_state(plain, plain_opt)
    assert_same(by_name(safeckpt.read_state_dict(os.path.join(root, "plain")), plain), plain_ref, "plain read")

    # 2 ranks: plain -> FSDP2, train, save
    v2 = _ok(dist_harness.run(_run_2_ranks_save, 2, root, timeout=120))
    assert_same(v2[0]["after_plain"], plain_ref, "plain -> FSDP2 (2 ranks)")
    ck2 = os.path.join(root, "fsdp2")
    assert safeckpt.verify(ck2).ok
    flat2 = safeckpt.read_state_dict(ck2)
    assert_same(by_name(flat2, plain), v2[0]["saved"], "read_state_dict of the FSDP2 checkpoint")
    man = assert_canonical(ck2)  # chunks of one tensor from two ranks, in (rank, offsets) order
    rec = man["tensors"]["model/0.weight"]
    assert rec["scope"] == "sharded" and rec["placement"]["placements"] == ["S(0)"]
    assert sorted((c["file"], c["offsets"], c["sizes"]) for c in rec["chunks"]) == [
        ("rank-00000.safetensors", [0, 0], [7, 10]), ("rank-00001.safetensors", [7, 0], [6, 10])]
    # the optimizer is keyed by parameter name; the 1-row tensor was written once
    assert "optim/state/0.weight/exp_avg" in man["tensors"]
    assert [c["sizes"] for c in man["tensors"]["optim/state/4.weight/exp_avg"]["chunks"]] == [[1, 6]]
    fresh_man = json.load(open(os.path.join(root, "fresh", "manifest.json")))
    assert fresh_man["objects"]["optim"]["tree"]["state"] == {}

    # 4 ranks: 2 -> 4, train, save 4
    v4 = _ok(dist_harness.run(_run_4_ranks, 4, root, timeout=150))
    assert_same(v4[0]["loaded"], v2[0]["saved"], "FSDP2 2 -> 4 ranks")
    for r, v in enumerate(v4):
        assert v["nread"] == v["need"], f"rank {r} read {v['nread']} bytes, needs {v['need']}"
        assert v["epoch"] == 3
        assert v["fresh_empty"]
    # per-rank RNG 2 -> 4: ranks 0, 1 get their own saved stream, ranks 2, 3 keep theirs
    assert torch.equal(v4[0]["rng_next"], v2[0]["rng_next"]) and torch.equal(v4[1]["rng_next"], v2[1]["rng_next"])
    assert [v["rng_kept"] for v in v4] == [False, False, True, True]
    assert any("rank r restores the state saved by rank r" in m for m in v4[0]["rng_msgs"])
    assert any("keeps its current state" in m for m in v4[3]["rng_msgs"])
    assert not v4[1]["rng_msgs"]
    fresh_model = _model(seed=8)
    assert_same(v4[0]["fresh"], full_state(fresh_model, None), "fresh FSDP2 checkpoint 2 -> 4")
    ck4 = os.path.join(root, "fsdp4")
    assert_same(by_name(safeckpt.read_state_dict(ck4), plain), v4[0]["saved"], "read_state_dict 4 ranks")

    hsdp = os.path.join(root, "hsdp")
    man = assert_canonical(hsdp)
    assert man["tensors"]["model/0.weight"]["placement"]["placements"] == ["R", "S(0)"]
    writers = set()
    for key, rec in man["tensors"].items():
        if rec["scope"] == "sharded":
            assert len(rec["chunks"]) == len({tuple(c["offsets"]) for c in rec["chunks"]}), key
            writers |= {c["file"] for c in rec["chunks"]}
    assert len(writers) == 4  # both replicas of each shard share the writing
    assert_same(by_name(safeckpt.read_state_dict(hsdp), plain), v4[0]["hsdp_saved"], "read_state_dict HSDP")

    # 2 ranks: 4 -> 2 into FSDP2 and into plain modules
    w2 = _ok(dist_harness.run(_run_2_ranks_load, 2, root, timeout=120))
    assert_same(w2[0]["fsdp_loaded"], v4[0]["saved"], "FSDP2 4 -> 2 ranks")
    assert_same(w2[0]["plain_loaded"], v4[0]["saved"], "FSDP2 (4 ranks) -> plain module on 2 ranks")
    assert_same(w2[0]["hsdp_loaded"], v4[0]["hsdp_saved"], "HSDP (2x2) -> FSDP2 on 2 ranks")
    for r, v in enumerate(w2):
        assert v["nread"] == v["need"], f"rank {r} read {v['nread']} bytes, needs {v['need']}"
        assert v["steps"] == {6.0}  # 2 (plain) + 2 (2 ranks) + 1 (4 ranks) saved, +1 here
    assert any("copies saved by ranks 2-3 are not used" in m for m in w2[0]["msgs"])

    # 4 -> 1: plain module and optimizer, no process group
    model1 = _model(seed=99)
    opt1 = torch.optim.AdamW(model1.parameters(), lr=0.5)
    st = {"model": model1, "optim": opt1, "rng": safeckpt.RNGState(), "epoch": 0}
    with pytest.warns(safeckpt.SafeckptWarning, match="saved by 4 rank"):
        safeckpt.load(ck4, st)
    assert_same(full_state(model1, opt1), v4[0]["saved"], "FSDP2 4 ranks -> plain process")
    assert st["epoch"] == 4 and opt1.param_groups[0]["lr"] == 0.01
    _train(model1, opt1, 1, seed=3)
    assert {float(s["step"]) for s in opt1.state.values()} == {6.0}


def test_optimizer_mismatch_is_reported(tmp_path):
    """A checkpoint whose optimizer does not fit (other parameters) raises on a strict load and
    is skipped on a non-strict one, leaving the optimizer untouched."""
    m = _model(seed=1)
    opt = torch.optim.AdamW(m.parameters())
    _train(m, opt, 1, seed=1)
    safeckpt.save(tmp_path / "ck", {"optim": opt})
    other = nn.Linear(3, 3)
    other_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(safeckpt.IncompatibleCheckpoint):
        safeckpt.load(tmp_path / "ck", {"optim": other_opt})
    assert len(other_opt.state) == 0
