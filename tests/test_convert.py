"""Consolidation and format conversion (safeckpt.convert).

One 2-rank FSDP2 run saves the same trained state with safeckpt and with
torch.distributed.checkpoint (DCP); everything else runs in the test process: consolidate to
one safetensors file (names usable by the plain module), DCP import, torch.save import (only
with allow_pickle), Hugging Face export (single file and sharded with an index), bounded
memory while consolidating, and refusal of pickles that would run code.
"""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import safeckpt
from safeckpt import convert as _convert
from safeckpt.convert.consolidate import _pieces
from tests.helpers import dist_harness
from tests.test_sharded import (
    _fsdp,
    _model,
    _ok,
    _portable,
    _train,
    assert_same,
    by_name,
    full_state,
)

pytestmark = pytest.mark.timeout(180)


def _save_both(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _fsdp(seed=3, world=world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 2, seed=3, rank=rank)
    safeckpt.save(os.path.join(root, "ck"), {"model": model, "optim": opt, "epoch": 3}, step=20)
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd, "extra": {"epoch": 3}}, checkpoint_id=os.path.join(root, "dcp"))
    saved = full_state(model, opt)
    return _portable(saved) if rank == 0 else None


def _model_part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model/"):]: v for k, v in state.items() if k.startswith("model/")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("convert"))
    values = _ok(dist_harness.run(_save_both, 2, root, timeout=120))
    return root, values[0]


def test_consolidate_fsdp2_checkpoint(saved, tmp_path):
    root, ref = saved
    ck = os.path.join(root, "ck")
    calls = []
    out = _convert.consolidate(ck, tmp_path / "model.safetensors", only="model",
                               progress=lambda done, total, name: calls.append((done, total, name)))
    plain = _model(seed=0)
    plain.load_state_dict(load_file(out.path), strict=True)  # names fit the plain module
    assert_same(full_state(plain, None), {k: v for k, v in ref.items() if k.startswith("model/")}, "consolidated")
    assert calls[-1][0] == calls[-1][1] == out.nbytes and len(calls) == len(out.names)
    with safe_open(out.path, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["safeckpt.step"] == "20"

    # everything: the checkpoint's keys, values equal to read_state_dict, JSON values in metadata
    full = _convert.consolidate(ck, tmp_path / "all.safetensors", buffer_bytes=64)
    flat = safeckpt.read_state_dict(ck)
    loaded = load_file(full.path)
    assert sorted(loaded) == sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor))
    assert_same(by_name(loaded, plain), ref, "consolidated, all entries, 64-byte pieces")
    with safe_open(full.path, "pt") as f:
        values = json.loads(f.metadata()["safeckpt.values"])
    assert values["epoch"] == 3 and values["optim/param_groups"][0]["params"][0] == "0.weight"

    with pytest.raises(safeckpt.CheckpointError, match="only='nope'"):
        _convert.consolidate(ck, tmp_path / "x.safetensors", only="nope")


def test_import_dcp_then_load_and_consolidate(saved, tmp_path):
    root, ref = saved
    info = _convert.import_dcp(os.path.join(root, "dcp"), tmp_path / "imported")
    assert info.metadata["imported_from"] == "torch.distributed.checkpoint"
    assert safeckpt.verify(tmp_path / "imported").ok
    plain = _model(seed=0)
    assert_same(by_name(safeckpt.read_state_dict(tmp_path / "imported"), plain), ref, "DCP import")
    # DCP's FQN-keyed optimizer state loads into a plain module + optimizer
    opt = torch.optim.AdamW(plain.parameters(), lr=1.0)
    state = {"model": plain, "optim": opt, "extra": {"epoch": 0}}
    safeckpt.load(tmp_path / "imported", state)
    assert_same(full_state(plain, opt), ref, "DCP import -> plain module and AdamW")
    assert state["extra"] == {"epoch": 3} and opt.param_groups[0]["lr"] == 0.01
    _train(plain, opt, 1, seed=1)  # usable state
    # round trip: DCP -> safeckpt -> consolidate equals the safeckpt original consolidated
    a = load_file(_convert.consolidate(tmp_path / "imported", tmp_path / "a.safetensors", only="model").path)
    b = load_file(_convert.consolidate(os.path.join(root, "ck"), tmp_path / "b.safetensors", only="model").path)
    assert_same(a, b, "DCP -> safeckpt -> consolidate")


def test_import_dcp_of_a_plain_optimizer_state_dict_attaches_its_state(tmp_path):
    """The recipe before ``get_state_dict``: ``dcp.save({"model": m.state_dict(), "optim":
    opt.state_dict()})``. DCP stringifies the state keys ("0", "1"...) while the param groups keep
    the ints; the import gives the keys back, so a strict load into a plain AdamW attaches every
    entry and training continues exactly as it would have."""
    import torch.distributed.checkpoint as dcp
    from torch import nn

    def make(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
        opt = torch.optim.AdamW([{"params": model[0].parameters()},
                                 {"params": model[2].parameters(), "lr": 0.02, "weight_decay": 0.0}],
                                lr=0.01, weight_decay=0.1)
        return model, opt

    def step(model, opt, seed):
        torch.manual_seed(seed)
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        opt.step()

    model, opt = make(0)
    for i in range(3):
        step(model, opt, 100 + i)
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": 3}},
                 checkpoint_id=str(src))
    raw = _convert.load_dcp(src)  # what DCP itself gives back: keys no param group names
    assert sorted(raw["optim"]["state"]) == ["0", "1", "2", "3"]
    assert [g["params"] for g in raw["optim"]["param_groups"]] == [[0, 1], [2, 3]]

    # saved as DCP returns it, a strict load refuses (the state would attach to nothing)
    safeckpt.save(tmp_path / "unfixed", {"model": raw["model"], "optim": raw["optim"]})
    fresh, fresh_opt = make(1)
    with pytest.raises(safeckpt.CheckpointError):
        safeckpt.load(tmp_path / "unfixed", {"model": fresh, "optim": fresh_opt})

    _convert.import_dcp(src, tmp_path / "imported")
    fresh, fresh_opt = make(1)
    state = {"model": fresh, "optim": fresh_opt, "extra": {"epoch": 0}}
    safeckpt.load(tmp_path / "imported", state)
    assert state["extra"] == {"epoch": 3}
    assert len(fresh_opt.state) == 4
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        assert set(fresh_opt.state[q]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    for g, h in zip(opt.param_groups, fresh_opt.param_groups, strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in h.items() if k != "params"}
    step(model, opt, 7)
    step(fresh, fresh_opt, 7)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_rekey_optimizer_states_only_touches_position_keyed_state():
    state = {"exp_avg": torch.ones(1)}
    plain = {"state": {"0": state, "1": state}, "param_groups": [{"params": [0]}, {"params": [1, 2]}]}
    by_name = {"state": {"w": state, "0": state}, "param_groups": [{"params": ["w", "0"]}]}
    clash = {"state": {"0": state, 0: state, "7": state}, "param_groups": [{"params": [0, 1]}]}
    tree = {"optim": plain, "nested": [{"opt": by_name}], "clash": clash}
    assert _convert.rekey_optimizer_states(tree) == 2
    assert list(plain["state"]) == [0, 1]
    assert list(by_name["state"]) == ["w", "0"]  # keyed by parameter name: left alone
    assert list(clash["state"]) == ["0", 0, "7"]  # an int key already there, "7" names no param


def test_export_hf_single_and_sharded(saved, tmp_path):
    root, ref = saved
    ck = os.path.join(root, "ck")
    want = _model_part(ref)
    files = _convert.export_hf(ck, tmp_path / "hf1")
    assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    assert_same(load_file(files[0]), want, "HF single file")

    files = _convert.export_hf(ck, tmp_path / "hf2", max_shard_size=300)
    names = [os.path.basename(f) for f in files]
    assert names[-1] == "model.safetensors.index.json" and len(names) >= 3
    index = json.load(open(files[-1]))
    got = {}
    for fname in sorted(set(index["weight_map"].values())):
        got.update(load_file(tmp_path / "hf2" / fname))
    assert_same(got, want, "HF sharded")
    assert sorted(index["weight_map"]) == sorted(want)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())
    assert all(os.path.basename(f).startswith(f"model-0000{i + 1}-of-") for i, f in enumerate(files[:-1]))

    with pytest.raises(safeckpt.CheckpointExists):
        _convert.export_hf(ck, tmp_path / "hf2")
    _convert.export_hf(ck, tmp_path / "hf2", overwrite=True)  # one file now: stale shards go
    assert sorted(os.listdir(tmp_path / "hf2")) == ["model.safetensors"]


def test_import_torch_save_needs_allow_pickle(tmp_path):
    model = _model(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.03)
    _train(model, opt, 2, seed=5)
    src = tmp_path / "legacy.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 7}, src)
    with pytest.raises(safeckpt.CheckpointError, match="unpickling"):
        _convert.import_torch_save(src, tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck")

    _convert.import_torch_save(src, tmp_path / "ck", allow_pickle=True)
    model2 = _model(seed=6)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    state = {"model": model2, "optim": opt2, "epoch": 0}
    safeckpt.load(tmp_path / "ck", state)
    assert_same(full_state(model2, opt2), full_state(model, opt), "torch.save import")
    assert state["epoch"] == 7

    # a bare state_dict becomes the "model" entry; consolidate gives back the same tensors
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    _convert.import_torch_save(tmp_path / "bare.pt", tmp_path / "bare", allow_pickle=True)
    out = _convert.consolidate(tmp_path / "bare", tmp_path / "bare.safetensors", only="model")
    assert_same(load_file(out.path), dict(model.state_dict()), "torch.save -> safeckpt -> consolidate")


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_import_never_runs_pickled_code(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    evil = tmp_path / "evil_dcp"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(safeckpt.CheckpointError, match="refusing to unpickle"):
        _convert.import_dcp(evil, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()

    # a DCP value that torch's restricted unpickler refuses needs allow_pickle
    import argparse

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(2)}, "extra": {"ns": argparse.Namespace(a=1)}},
                 checkpoint_id=str(tmp_path / "custom"))
    with pytest.raises(safeckpt.CheckpointError, match="allow_pickle=True"):
        _convert.import_dcp(tmp_path / "custom", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_consolidate_memory_is_bounded(tmp_path):
    """A 128 MiB tensor consolidates with far less than 128 MiB of extra peak memory, and
    a flipped byte is caught."""
    n = 32 << 20  # float32 elements: 128 MiB
    big = torch.arange(n, dtype=torch.float32).reshape(4096, -1)
    safeckpt.save(tmp_path / "ck", {"model": {"big": big, "small": torch.ones(3)}})
    del big
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS counter (VmHWM)
    except OSError:
        pytest.skip("cannot reset the peak RSS counter here")
    base = _vm("VmRSS")
    out = _convert.consolidate(tmp_path / "ck", tmp_path / "out.safetensors", only="model", buffer_bytes=8 << 20)
    grew = _vm("VmHWM") - base
    assert grew < 48 << 20, f"peak memory grew by {grew >> 20} MiB"
    with safe_open(out.path, "pt") as f:
        assert torch.equal(f.get_slice("big")[4000:4096], torch.arange(n, dtype=torch.float32).reshape(4096, -1)[4000:])
        assert torch.equal(f.get_tensor("small"), torch.ones(3))

    # flip one byte of the stored tensor: consolidate refuses
    data = tmp_path / "ck" / "rank-00000.safetensors"
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(safeckpt.CorruptCheckpoint):
        _convert.consolidate(tmp_path / "ck", tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("shape", [[], [0], [5], [3, 0, 2], [7, 3], [2, 3, 5], [1, 1, 9]])
@pytest.mark.parametrize("limit", [1, 4, 12, 40, 1 << 20])
def test_pieces_tile_memory_in_order(shape, limit):
    """Consolidation pieces are consecutive byte ranges covering the tensor exactly once."""
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    got = []
    for offsets, sizes in _pieces(shape, 4, limit):
        idx = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        piece = full[idx]
        assert piece.numel() * 4 <= max(limit, 4) or len(shape) == 0
        got.append(piece.reshape(-1))
    flat = torch.cat(got) if got else torch.empty(0)
    assert torch.equal(flat, full.reshape(-1))
