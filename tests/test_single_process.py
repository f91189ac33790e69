"""save/load with no process group: every kind of state round-trips exactly, errors are clear.

SPEC "Public names" (single process works without a process group), behaviours 8 and 10.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import safeckpt
from safeckpt.format.manifest import STAGING_MARK, TRASH_MARK


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (so NaN payloads and -0.0 compare exactly)."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(_bits(a), _bits(b))


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 3))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 8, generator=g)
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def _assert_same_module(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert_bit_equal(sa[k], sb[k])


def _entries(root) -> list[str]:
    return sorted(os.listdir(root))


# --------------------------------------------------------------------------- modules


def test_plain_module_round_trip(tmp_path):
    src = _net(0)
    src.train()
    src(torch.randn(4, 8))  # BatchNorm running stats and num_batches_tracked (int64, 0-d)
    path = tmp_path / "ck"
    info = safeckpt.save(path, {"model": src}, metadata={"note": "x"})
    assert info.path == str(path)
    assert info.world_size == 1
    assert info.nbytes > 0
    assert info.created_at
    assert info.metadata == {"note": "x"}
    assert _entries(path) == ["manifest.json", "rank-00000.safetensors"]
    assert _entries(tmp_path) == ["ck"]

    dst = _net(1)
    linfo = safeckpt.load(path, {"model": dst})
    _assert_same_module(src, dst)
    assert linfo.world_size == 1
    assert linfo.metadata == {"note": "x"}
    assert linfo.skipped == ()
    # Tensors were copied in place: the module's parameters are the same objects as before.
    assert safeckpt.verify(path).ok


def test_compiled_module_round_trip(tmp_path):
    try:
        compiled = torch.compile(_net(0), backend="eager")
    except Exception as exc:  # pragma: no cover - platform without dynamo
        pytest.skip(f"torch.compile unavailable: {exc}")
    assert hasattr(compiled, "_orig_mod")
    path = tmp_path / "ck"
    safeckpt.save(path, {"model": compiled})
    flat = safeckpt.read_state_dict(path)
    assert not any("_orig_mod" in k for k in flat), sorted(flat)
    assert "model/0.weight" in flat

    plain = _net(5)
    safeckpt.load(path, {"model": plain})  # compiled -> plain
    _assert_same_module(compiled._orig_mod, plain)

    with torch.no_grad():
        plain[0].weight.mul_(3)
    safeckpt.save(tmp_path / "ck2", {"model": plain})
    compiled2 = torch.compile(_net(7), backend="eager")
    safeckpt.load(tmp_path / "ck2", {"model": compiled2})  # plain -> compiled
    _assert_same_module(plain, compiled2._orig_mod)


# ------------------------------------------------------------------------ optimizers


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1),
    ],
    ids=["sgd", "adam", "adamw"],
)
def test_optimizer_round_trip_before_and_after_first_step(tmp_path, make_opt):
    model = _net(0)
    opt = make_opt(model.parameters())

    # Before the first step the optimizer state is empty.
    assert opt.state_dict()["state"] == {}
    safeckpt.save(tmp_path / "empty", {"model": model, "optim": opt})
    model_e = _net(3)
    opt_e = make_opt(model_e.parameters())
    safeckpt.load(tmp_path / "empty", {"model": model_e, "optim": opt_e})
    assert opt_e.state_dict()["state"] == {}
    assert opt_e.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    _assert_same_module(model, model_e)

    # After steps: state tensors (momentum, exp_avg, 0-d step) and hyperparameters.
    for i in range(3):
        _train_step(model, opt, seed=i)
    safeckpt.save(tmp_path / "stepped", {"model": model, "optim": opt})
    model2 = _net(4)
    opt2 = make_opt(model2.parameters())
    for g in opt2.param_groups:
        g["lr"] = 123.0  # must be replaced by the saved value
    safeckpt.load(tmp_path / "stepped", {"model": model2, "optim": opt2})
    _assert_same_module(model, model2)
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"]
    assert sd1["state"].keys() == sd2["state"].keys()
    for pid, st in sd1["state"].items():
        assert st.keys() == sd2["state"][pid].keys()
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert_bit_equal(v, sd2["state"][pid][k])
            else:
                assert v == sd2["state"][pid][k]

    # Training continues identically from the restored state.
    _train_step(model, opt, seed=10)
    _train_step(model2, opt2, seed=10)
    _assert_same_module(model, model2)


def test_lr_scheduler_round_trip(tmp_path):
    model = _net(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for i in range(5):
        _train_step(model, opt, seed=i)
        step.step()
    state = {"model": model, "optim": opt, "sched": step}
    safeckpt.save(tmp_path / "ck", state)

    model2 = _net(1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=1.0)
    step2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    safeckpt.load(tmp_path / "ck", {"model": model2, "optim": opt2, "sched": step2})
    assert step2.state_dict() == step.state_dict()
    assert step2.get_last_lr() == step.get_last_lr() == [0.25]
    for i in range(5, 9):
        _train_step(model, opt, seed=i)
        step.step()
        _train_step(model2, opt2, seed=i)
        step2.step()
        assert step2.get_last_lr() == step.get_last_lr()
    _assert_same_module(model, model2)


def test_cosine_scheduler_round_trip(tmp_path):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.01)
    for _ in range(4):
        opt.step()
        sched.step()
    safeckpt.save(tmp_path / "ck", {"optim": opt, "sched": sched})
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.3)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10, eta_min=0.01)
    safeckpt.load(tmp_path / "ck", {"optim": opt2, "sched": sched2})
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_grad_scaler_round_trip(tmp_path):
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    except Exception as exc:  # pragma: no cover - old torch
        pytest.skip(f"CPU GradScaler unavailable: {exc}")
    model = _net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(4):  # grows the scale once and leaves a non-zero growth tracker
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    sd = scaler.state_dict()
    assert sd["scale"] == 2048.0 and sd["_growth_tracker"] == 1, sd
    safeckpt.save(tmp_path / "ck", {"scaler": scaler})

    scaler2 = torch.amp.GradScaler("cpu")
    safeckpt.load(tmp_path / "ck", {"scaler": scaler2})
    assert scaler2.state_dict() == sd
    assert scaler2.get_scale() == 2048.0


def test_rng_state_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)  # advance the streams a little
    safeckpt.save(tmp_path / "ck", {"rng": safeckpt.RNGState()})
    expect = (random.random(), np.random.rand(3).tolist(), torch.rand(3), random.gauss(0, 1))

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    safeckpt.load(tmp_path / "ck", {"rng": safeckpt.RNGState()})
    got = (random.random(), np.random.rand(3).tolist(), torch.rand(3), random.gauss(0, 1))
    assert got[0] == expect[0]
    assert got[1] == expect[1]
    assert torch.equal(got[2], expect[2])
    assert got[3] == expect[3]


# ----------------------------------------------------------------- plain values, trees


def test_nested_json_values_and_tensors_round_trip(tmp_path):
    t_a = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    t_b = torch.randn(4, 5)
    src = {
        "step": 1234,
        "name": "run-α",
        "cfg": {
            "lr": 3e-4,
            "flags": [True, False, None],
            "sizes": (1, 2, (3, 4)),
            "inf": float("inf"),
            "ninf": float("-inf"),
            "nan": float("nan"),
            "by_id": {0: "zero", 7: "seven"},
            "deep": [{"t": t_a}, [t_b, "x", 2.5]],
        },
        "vec": torch.linspace(0, 1, 7),
    }
    safeckpt.save(tmp_path / "ck", src)

    tgt_a, tgt_b, tgt_vec = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(4, 5), torch.zeros(7)
    dst = {
        "step": 0,
        "name": "",
        "cfg": {
            "lr": 0.0, "flags": [], "sizes": (), "inf": 0.0, "ninf": 0.0, "nan": 0.0,
            "by_id": {}, "deep": [{"t": tgt_a}, [tgt_b, "y", 0.0]],
        },
        "vec": tgt_vec,
    }
    safeckpt.load(tmp_path / "ck", dst)
    assert dst["step"] == 1234 and dst["name"] == "run-α"
    cfg = dst["cfg"]
    assert cfg["lr"] == 3e-4
    assert cfg["flags"] == [True, False, None]
    assert cfg["sizes"] == (1, 2, (3, 4)) and isinstance(cfg["sizes"][2], tuple)
    assert cfg["inf"] == math.inf and cfg["ninf"] == -math.inf and math.isnan(cfg["nan"])
    assert cfg["by_id"] == {0: "zero", 7: "seven"}
    assert cfg["deep"][1][1:] == ["x", 2.5]
    # Tensors were copied into the existing tensors, in place.
    assert cfg["deep"][0]["t"] is tgt_a and torch.equal(tgt_a, t_a)
    assert cfg["deep"][1][0] is tgt_b and torch.equal(tgt_b, t_b)
    assert dst["vec"] is tgt_vec and torch.equal(tgt_vec, src["vec"])

    # Offline reading gives the same values without any target.
    flat = safeckpt.read_state_dict(tmp_path / "ck")
    assert flat["step"] == 1234
    assert torch.equal(flat["cfg/deep"][0]["t"], t_a)
    assert flat["cfg/sizes"] == (1, 2, (3, 4))


def _all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(3, 5, generator=g)
    special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1e-45, 3.4e38])
    out = {
        "f32": f32,
        "f64": torch.randn(4, generator=g, dtype=torch.float64),
        "bf16": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "special_f32": special,
        "special_bf16": special.to(torch.bfloat16),
        "special_f16": torch.tensor([float("nan"), -0.0, 65504.0, float("inf")], dtype=torch.float16),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0, -1]),
        "i32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "i16": torch.tensor([-(2**15), 7], dtype=torch.int16),
        "i8": torch.tensor([-128, 127, 0], dtype=torch.int8),
        "u8": torch.tensor([0, 255, 17], dtype=torch.uint8),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar_f32": torch.tensor(2.5),
        "scalar_i64": torch.tensor(-7),
        "scalar_bool": torch.tensor(True),
        "scalar_bf16": torch.tensor(-0.0, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "empty_1d_i64": torch.empty(0, dtype=torch.int64),
        "noncontig": f32.t(),  # strided view: saved by value
        "c64": torch.complex(torch.randn(3, generator=g), torch.randn(3, generator=g)),
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["f8"] = torch.randn(5, generator=g).to(torch.float8_e4m3fn)
    return out


def test_dtypes_round_trip_bit_exact(tmp_path):
    src = _all_dtypes()
    safeckpt.save(tmp_path / "ck", {"t": src})

    # In place into existing tensors of the same dtype/shape.
    dst = {"t": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in src.items()}}
    before = {k: v for k, v in dst["t"].items()}
    safeckpt.load(tmp_path / "ck", dst)
    for k, v in src.items():
        assert dst["t"][k] is before[k], k
        assert_bit_equal(dst["t"][k], v.contiguous())

    # Offline, as fresh tensors.
    flat = safeckpt.read_state_dict(tmp_path / "ck")
    for k, v in src.items():
        assert_bit_equal(flat[f"t/{k}"], v.contiguous())


# -------------------------------------------------------------------- strictness


class _Two(nn.Module):
    def __init__(self, hidden: int = 3, extra: bool = False, dtype=torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(4, hidden).to(dtype)
        self.b = nn.Linear(hidden, 2)
        if extra:
            self.c = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2))


def _saved_two(tmp_path):
    torch.manual_seed(0)
    src = _Two()
    path = tmp_path / "ck"
    safeckpt.save(path, {"model": src, "epoch": 3, "extra_entry": torch.ones(1)})
    return src, path


def test_strict_load_lists_every_problem_and_touches_nothing(tmp_path):
    src, path = _saved_two(tmp_path)

    torch.manual_seed(1)
    tgt = _Two(hidden=5, extra=True)  # a.*, b.weight shapes differ; c.* missing from ckpt
    del tgt.scale  # buffer in the checkpoint, not in the target
    tgt.b.bias.data = tgt.b.bias.data.to(torch.float16)  # dtype mismatch
    snapshot = {k: v.clone() for k, v in tgt.state_dict().items()}
    state = {"model": tgt, "epoch": 0, "new_entry": 1}
    with pytest.raises(safeckpt.IncompatibleCheckpoint) as ei:
        safeckpt.load(path, state)
    msg = str(ei.value)
    assert "unexpected entry 'extra_entry'" in msg
    assert "missing entry 'new_entry'" in msg
    assert "missing key 'model/c.weight'" in msg and "missing key 'model/c.bias'" in msg
    assert "unexpected key 'model/scale'" in msg
    assert "'model/a.weight'" in msg and "[3, 4]" in msg and "[5, 4]" in msg
    assert "'model/b.bias'" in msg and "F32" in msg and "F16" in msg
    assert "strict=False" in msg  # says what to do
    # Nothing was loaded: the state is exactly as before.
    assert state["epoch"] == 0
    for k, v in tgt.state_dict().items():
        assert_bit_equal(v, snapshot[k])


def test_non_strict_load_loads_the_intersection(tmp_path):
    src, path = _saved_two(tmp_path)
    torch.manual_seed(1)
    tgt = _Two(hidden=5, extra=True)
    c_before = tgt.c.weight.clone()
    a_before = tgt.a.weight.clone()
    state = {"model": tgt, "epoch": 0, "new_entry": 1}
    info = safeckpt.load(path, state, strict=False)
    # What fits is loaded ...
    assert torch.equal(tgt.b.bias, src.b.bias)
    assert torch.equal(tgt.scale, src.scale)
    assert state["epoch"] == 3
    # ... what does not is left alone and reported.
    assert torch.equal(tgt.a.weight, a_before)
    assert torch.equal(tgt.c.weight, c_before)
    assert state["new_entry"] == 1
    skipped = "\n".join(info.skipped)
    assert "model/a.weight" in skipped and "model/b.weight" in skipped
    assert "model/c.weight" in skipped
    assert "extra_entry" in skipped and "new_entry" in skipped
    assert "model/b.bias" not in skipped


# ---------------------------------------------------------------- path errors


def test_save_over_existing_without_overwrite_raises_checkpoint_exists(tmp_path):
    path = tmp_path / "ck"
    safeckpt.save(path, {"x": torch.ones(3)})
    with pytest.raises(safeckpt.CheckpointExists) as ei:
        safeckpt.save(path, {"x": torch.zeros(3)})
    assert isinstance(ei.value, FileExistsError)
    assert "overwrite=True" in str(ei.value)
    assert torch.equal(safeckpt.read_state_dict(path)["x"], torch.ones(3))
    assert _entries(tmp_path) == ["ck"]

    # overwrite=True replaces it atomically.
    safeckpt.save(path, {"x": torch.zeros(3)}, overwrite=True)
    assert torch.equal(safeckpt.read_state_dict(path)["x"], torch.zeros(3))
    assert _entries(tmp_path) == ["ck"]


def test_overwrite_refuses_to_replace_a_non_checkpoint_directory(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    (path / "precious.txt").write_text("keep me")
    with pytest.raises(safeckpt.CheckpointExists):
        safeckpt.save(path, {"x": torch.ones(1)}, overwrite=True)
    assert (path / "precious.txt").read_text() == "keep me"
    assert _entries(tmp_path) == ["data"]


def test_load_missing_path_raises_checkpoint_not_found(tmp_path):
    with pytest.raises(safeckpt.CheckpointNotFound) as ei:
        safeckpt.load(tmp_path / "nope", {"x": torch.ones(1)})
    assert isinstance(ei.value, FileNotFoundError)
    assert "nope" in str(ei.value)
    # A directory without a manifest (e.g. an interrupted save) is not a checkpoint either.
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "rank-00000.safetensors").write_bytes(b"")
    with pytest.raises(safeckpt.CheckpointNotFound):
        safeckpt.load(tmp_path / "half", {"x": torch.ones(1)})
    with pytest.raises(safeckpt.CheckpointNotFound):
        safeckpt.read_state_dict(tmp_path / "nope")
    assert not safeckpt.verify(tmp_path / "nope").ok


# -------------------------------------------------------------- unsupported values


def _assert_nothing_written(tmp_path):
    leftovers = [n for n in os.listdir(tmp_path) if STAGING_MARK in n or TRASH_MARK in n]
    assert leftovers == []
    assert not (tmp_path / "ck").exists()


def test_non_json_metadata_is_a_clear_error(tmp_path):
    with pytest.raises(safeckpt.CheckpointError) as ei:
        safeckpt.save(tmp_path / "ck", {"x": torch.ones(1)}, metadata={"when": {1, 2}})
    msg = str(ei.value).replace(str(tmp_path), "<tmp>")
    assert "metadata" in msg and "set" in msg and "JSON" in msg
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    "value, where, what",
    [
        ({"fn": lambda x: x}, "cfg/fn", "function"),
        ({"ok": 1, "obj": object()}, "cfg/obj", "object"),
        ({"nested": [1, {"s": {1, 2}}]}, "cfg/nested/1/s", "set"),
    ],
    ids=["lambda", "object", "set"],
)
def test_unpicklable_only_values_are_a_clear_error(tmp_path, value, where, what):
    with pytest.raises(safeckpt.CheckpointError) as ei:
        safeckpt.save(tmp_path / "ck", {"cfg": value, "x": torch.ones(1)})
    msg = str(ei.value).replace(str(tmp_path), "<tmp>")
    assert where in msg and what in msg and "pickle" in msg
    _assert_nothing_written(tmp_path)


def test_stateful_object_with_unsupported_state_is_a_clear_error(tmp_path):
    class Bad:
        def state_dict(self):
            return {"cb": print}

        def load_state_dict(self, sd):  # pragma: no cover
            pass

    with pytest.raises(safeckpt.CheckpointError) as ei:
        safeckpt.save(tmp_path / "ck", {"bad": Bad()})
    assert "'bad/cb'" in str(ei.value).replace(str(tmp_path), "<tmp>")
    _assert_nothing_written(tmp_path)


def test_tree_tensors_are_filled_in_place_and_misfits_left_alone(tmp_path):
    path = tmp_path / "ck"
    saved = {"p": torch.arange(3.0), "q": torch.ones(2), "extra": torch.ones(1), "tu": (torch.ones(1), 5)}
    safeckpt.save(path, {"tree": saved})

    def target():
        return {"tree": {"p": nn.Parameter(torch.zeros(3)), "q": torch.zeros(5), "tu": (torch.zeros(1), 0)}}

    state = target()
    with pytest.raises(safeckpt.IncompatibleCheckpoint):
        safeckpt.load(path, state)
    assert torch.equal(state["tree"]["p"].detach(), torch.zeros(3))

    state = target()
    p, q, tu0 = state["tree"]["p"], state["tree"]["q"], state["tree"]["tu"][0]
    info = safeckpt.load(path, state, strict=False)
    tree = state["tree"]
    # The caller's objects stay (a Parameter stays a Parameter), filled in place.
    assert tree["p"] is p and isinstance(tree["p"], nn.Parameter) and p.requires_grad
    assert torch.equal(p.detach(), torch.arange(3.0))
    assert tree["tu"][0] is tu0 and torch.equal(tu0, torch.ones(1)) and tree["tu"][1] == 5
    # What was reported as skipped was really skipped.
    assert tree["q"] is q and torch.equal(q, torch.zeros(5))
    assert "extra" not in tree
    skipped = "\n".join(info.skipped)
    assert "tree/q" in skipped and "tree/extra" in skipped
