"""On-disk format (SPEC behaviour 8, 3 and 10): damage is detected, never unpickled, never followed.

Every kind of damage makes ``load`` and ``read_state_dict`` raise CorruptCheckpoint, and makes
``verify(path).ok`` False with a problem that names the damaged file. Loading never unpickles
(checked with pickle and torch.load disabled in real 2-rank workers), and the data files are plain
safetensors files.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.serialization
from safetensors import safe_open
from torch import nn

import safeckpt
from safeckpt.format.manifest import CHECKSUM_FIELD, encode_manifest
from tests.helpers import dist_harness
from tests.helpers.manifest_checks import as_format2, assert_canonical

DATA = "rank-00000.safetensors"


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


@pytest.fixture
def ckpt(tmp_path):
    """A committed single-process checkpoint and the model it holds."""
    model = _model(0)
    path = tmp_path / "ck"
    safeckpt.save(path, {"model": model, "step": 7, "extra": {"t": torch.arange(10)}})
    assert safeckpt.verify(path).ok
    return path, model


def _manifest(path) -> dict:
    """The checkpoint's manifest, rewritten as format 2 (every chunk in the manifest): these
    tests edit chunk records; format 3's own checks are in test_format3."""
    return as_format2(str(path))


def _write_manifest(path, man: dict, *, sign: bool = True) -> None:
    """Write an edited manifest. ``sign`` recomputes its checksum (as a tool that knows the
    format would), so the deeper validation is what must catch the damage."""
    man = {k: v for k, v in man.items() if k != CHECKSUM_FIELD}
    if sign:
        (path / "manifest.json").write_bytes(encode_manifest(man))
    else:
        (path / "manifest.json").write_text(json.dumps(man))


def _assert_corrupt(path, *, names: str) -> safeckpt.VerifyReport:
    """load and read_state_dict raise CorruptCheckpoint; verify reports a problem naming ``names``."""
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.load(path, {"model": _model(1), "step": 0, "extra": {"t": torch.zeros(10, dtype=torch.int64)}})
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.read_state_dict(path)
    report = safeckpt.verify(path)
    assert report.ok is False
    assert not report
    assert any(names in p for p in report.problems), report.problems
    return report


def _flip(file, pos: int, mask: int) -> None:
    """XOR the byte at ``pos`` of ``file`` with ``mask`` (size unchanged: only checksums tell)."""
    with open(file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))


def _chunk(man: dict, key: str) -> dict:
    (chunk,) = man["tensors"][key]["chunks"]
    return chunk


def test_truncated_data_file(ckpt):
    path, _ = ckpt
    f = path / DATA
    size = f.stat().st_size
    os.truncate(f, size - 100)
    report = _assert_corrupt(path, names=DATA)
    assert any("truncated" in p for p in report.problems)


def test_data_file_cut_to_zero(ckpt):
    path, _ = ckpt
    os.truncate(path / DATA, 0)
    _assert_corrupt(path, names=DATA)


def test_bit_flip_in_data_is_caught_by_checksums(ckpt):
    path, model = ckpt
    man = _manifest(path)
    c = _chunk(man, "model/0.weight")
    _flip(path / DATA, (c["start"] + c["end"]) // 2, 0x10)
    report = _assert_corrupt(path, names=DATA)
    assert any("checksum" in p for p in report.problems), report.problems

    # A shallow verify checks sizes only, so it does not see the flip ...
    assert safeckpt.verify(path, deep=False).ok
    # ... and verify_checksums=False skips the checksum: the damaged value loads as stored.
    target = _model(1)
    safeckpt.load(path, {"model": target, "step": 0, "extra": {"t": torch.zeros(10, dtype=torch.int64)}},
                  verify_checksums=False)
    diff = (target[0].weight != model[0].weight).sum().item()
    assert diff == 1
    torch.testing.assert_close(target[2].weight, model[2].weight, rtol=0, atol=0)
    flat = safeckpt.read_state_dict(path, verify_checksums=False)
    assert (flat["model/0.weight"] != model[0].weight).sum().item() == 1


@pytest.mark.parametrize("where", ["first", "last"])
def test_bit_flip_in_state_read_into_fresh_tensors(tmp_path, where):
    """Optimizer state and read_state_dict's tensors are fresh, so they are verified in the same
    pass that reads them (piece by piece): a flip in any piece of a multi-piece chunk still
    fails the load, and the optimizer and model keep their state."""
    from safeckpt.format.shardfile import HASH_BUFFER

    model = nn.Linear(1024, 3 * HASH_BUFFER // 4096 + 7)  # weight chunk spans several pieces
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()
    path = tmp_path / "ck"
    safeckpt.save(path, {"model": model, "opt": opt})
    key = next(k for k in _manifest(path)["tensors"] if k.startswith("opt/") and k.endswith("exp_avg_sq")
               and _manifest(path)["tensors"][k]["shape"][0] > 1)
    c = _chunk(_manifest(path), key)
    assert c["end"] - c["start"] > 2 * HASH_BUFFER
    _flip(path / DATA, c["start"] + 1 if where == "first" else c["end"] - 2, 0x01)
    target = nn.Linear(1024, model.out_features)
    target_opt = torch.optim.Adam(target.parameters())
    target(torch.ones(2, 1024)).sum().backward()
    target_opt.step()
    before_model = {k: v.clone() for k, v in target.state_dict().items()}
    before_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in target_opt.state_dict()["state"].items()}
    with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum mismatch"):
        safeckpt.load(path, {"model": target, "opt": target_opt})
    for k, v in target.state_dict().items():
        assert torch.equal(v, before_model[k]), k
    for i, s in target_opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, before_opt[i][k]), (i, k)
    with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum mismatch"):
        safeckpt.read_state_dict(path)
    assert safeckpt.read_state_dict(path, verify_checksums=False)[key].shape == target.weight.shape


def test_missing_data_file(ckpt):
    path, _ = ckpt
    (path / DATA).unlink()
    report = _assert_corrupt(path, names=DATA)
    assert any("missing" in p for p in report.problems)


@pytest.mark.parametrize("bad_name", ["../x", "/etc/passwd", "sub/rank-00000.safetensors", "..", ""],
                         ids=["dotdot", "absolute", "separator", "parent", "empty"])
def test_manifest_with_unsafe_file_name(ckpt, bad_name):
    path, _ = ckpt
    # Put a readable decoy where '../x' would lead, so following the name would "work".
    (path.parent / "x").write_bytes((path / DATA).read_bytes())
    man = _manifest(path)
    man["files"][bad_name] = man["files"].pop(DATA)
    for rec in man["tensors"].values():
        for c in rec["chunks"]:
            c["file"] = bad_name
    _write_manifest(path, man)
    report = _assert_corrupt(path, names=repr(bad_name))
    assert any("unsafe" in p for p in report.problems), report.problems


def test_symlinked_data_file_is_refused(ckpt, tmp_path):
    path, _ = ckpt
    # The link points at an identical copy, so only the refusal to follow it can fail the load.
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes((path / DATA).read_bytes())
    (path / DATA).unlink()
    os.symlink(elsewhere, path / DATA)
    report = _assert_corrupt(path, names=DATA)
    assert any("symlink" in p for p in report.problems), report.problems


def test_manifest_not_json_and_unknown_version(ckpt):
    path, _ = ckpt
    man = _manifest(path)
    (path / "manifest.json").write_text('{"format": "safeckpt", "files": ')
    _assert_corrupt(path, names="manifest.json")
    man["format_version"] = 999
    _write_manifest(path, man)
    report = _assert_corrupt(path, names="manifest.json")
    assert any("upgrade" in p for p in report.problems)


def test_byte_range_past_end_of_file(ckpt):
    path, _ = ckpt
    man = _manifest(path)
    c = _chunk(man, "model/2.bias")
    c["end"] = man["files"][DATA]["size"] + 64
    _write_manifest(path, man)
    _assert_corrupt(path, names="model/2.bias")


def test_undamaged_checkpoint_verifies_and_files_are_plain_safetensors(ckpt):
    path, model = ckpt
    report = safeckpt.verify(path)
    assert report.ok and report.problems == [] and report.step is None
    assert report.nbytes == (path / DATA).stat().st_size
    with safe_open(str(path / DATA), framework="pt") as f:
        assert f.metadata() == {"format": "safeckpt"}
        # format 3: the file's index of chunks and checksums is one more (U8) tensor, last
        assert set(f.keys()) == {"model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias", "extra/t",
                                 "__safeckpt_index__"}
        for k, v in model.state_dict().items():
            assert torch.equal(f.get_tensor(f"model/{k}"), v)
        assert torch.equal(f.get_tensor("extra/t"), torch.arange(10))
    man = _manifest(path)
    assert man["format"] == "safeckpt"
    # Non-tensor values live in the JSON manifest, not in a pickle.
    assert man["objects"]["step"]["tree"] == 7


# ----------------------------------------------------------- multi-rank, pickle disabled


def _forbidden(*args, **kwargs):
    raise AssertionError("safeckpt.load unpickled something")


class _NoUnpickler:
    def __init__(self, *args, **kwargs):
        raise AssertionError("safeckpt.load created an Unpickler")


def _pickle_free_load(rank, world, root):
    import random

    import numpy as np

    path = os.path.join(root, "ck")
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    state = {
        "model": model, "optim": opt, "sched": sched, "rng": safeckpt.RNGState(),
        "meta": {"step": 11, "tags": ["a", "b"], "pair": (1, 2.5), "t": torch.full((3,), float(7))},
    }
    safeckpt.save(path, state)
    expect_rand = (random.random(), float(np.random.rand()), torch.rand(1).item())

    model2 = _model(5)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    target = {
        "model": model2, "optim": opt2, "sched": sched2, "rng": safeckpt.RNGState(),
        "meta": {"step": 0, "tags": [], "pair": (0, 0.0), "t": torch.zeros(3)},
    }
    saved = (pickle.load, pickle.loads, pickle.Unpickler, torch.load, torch.serialization.load)
    pickle.load = pickle.loads = _forbidden
    pickle.Unpickler = _NoUnpickler
    torch.load = torch.serialization.load = _forbidden
    try:
        safeckpt.load(path, target)
        flat = safeckpt.read_state_dict(path)
        report = safeckpt.verify(path)
    finally:
        pickle.load, pickle.loads, pickle.Unpickler, torch.load, torch.serialization.load = saved
    got_rand = (random.random(), float(np.random.rand()), torch.rand(1).item())
    same_model = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    osd, osd2 = opt.state_dict(), opt2.state_dict()
    same_opt = osd["param_groups"] == osd2["param_groups"] and all(
        torch.equal(osd["state"][i][k], osd2["state"][i][k]) for i in osd["state"] for k in osd["state"][i]
    )
    return {
        "same_model": same_model,
        "same_opt": same_opt,
        "same_sched": sched.state_dict() == sched2.state_dict(),
        "rng": got_rand == expect_rand,
        "meta": [target["meta"]["step"], target["meta"]["tags"], list(target["meta"]["pair"]),
                 target["meta"]["t"].tolist()],
        "flat_keys": sorted(flat),
        "verify_ok": report.ok,
    }


def test_load_never_unpickles_and_rank_files_are_plain_safetensors(tmp_path):
    out = dist_harness.run(_pickle_free_load, 2, str(tmp_path), timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        v = o.value
        assert v["same_model"] and v["same_opt"] and v["same_sched"], v
        assert v["rng"], "per-rank RNG state not restored"
        assert v["meta"] == [11, ["a", "b"], [1, 2.5], [7.0, 7.0, 7.0]]
        assert v["verify_ok"]
        assert "model/0.weight" in v["flat_keys"]

    # Every rank's file opens with plain safetensors and the pieces add up to the model.
    path = tmp_path / "ck"
    man = _manifest(path)
    assert sorted(man["files"]) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    stored = 0
    for name in man["files"]:
        with safe_open(str(path / name), framework="pt") as f:
            assert f.metadata() == {"format": "safeckpt"}
            for k in f.keys():
                if k != "__safeckpt_index__":  # the file's own index of chunks (format 3)
                    stored += f.get_tensor(k).numel()
    expected = sum(
        int(torch.Size(rec["shape"]).numel()) * (2 if rec["scope"] == "per_rank" else 1)
        for rec in man["tensors"].values()
    )
    assert stored == expected


def test_device_destinations_are_read_through_a_host_buffer(tmp_path, monkeypatch):
    """Tensors that are not in host memory (CUDA) cannot take a preadv: their chunks are read
    (and for fresh tensors verified) in a host buffer and copied over. No GPU here, so CPU
    tensors stand in for device ones; the path, checks and values are the same."""
    from safeckpt.engine import reader as _reader

    staged = []

    def host_buffer_for(t):
        staged.append(tuple(t.shape))
        return torch.empty(t.shape, dtype=t.dtype)

    monkeypatch.setattr(_reader, "host_addressable", lambda t: False)
    monkeypatch.setattr(_reader, "host_buffer_for", host_buffer_for)
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 32)).sum().backward()
    opt.step()
    path = tmp_path / "ck"
    safeckpt.save(path, {"model": model, "opt": opt})
    target = _model(1)
    target_opt = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
    safeckpt.load(path, {"model": target, "opt": target_opt})
    assert (64, 32) in staged and len(staged) >= 8  # weights and momenta staged
    for a, b in zip(model.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), target_opt.state.values(), strict=True):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    flat = safeckpt.read_state_dict(path)
    assert torch.equal(flat["model/0.weight"], model[0].weight)
    # a flip in fresh (optimizer) state is still caught on the staged path
    man = _manifest(path)
    key = next(k for k in man["tensors"] if k.startswith("opt/") and man["tensors"][k]["shape"] == [64, 32])
    c = _chunk(man, key)
    _flip(path / DATA, c["start"] + 3, 0x08)
    other = _model(2)
    with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum mismatch"):
        safeckpt.load(path, {"model": other, "opt": torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)})


def test_manifest_is_canonical_and_follows_each_save(tmp_path):
    """The save path assembles manifest.json from JSON pieces cached per plan: the bytes must
    be the canonical encoding of their content, and a repeated save of the same layout must
    carry that save's checksums and values (not the cached ones)."""
    state = {f"t{i}": torch.randn(8, 4) for i in range(5)}
    state["é"] = torch.zeros(3, dtype=torch.bfloat16)  # non-ASCII key: escaped like json.dumps
    state["empty"] = torch.zeros(0, 4)  # a zero-length chunk
    state["tied"] = state["t1"]  # an alias record
    state["model"] = nn.Linear(3, 2)
    seen = set()
    for step in range(3):
        with torch.no_grad():
            state["t0"].fill_(float(step))
        state["step"] = step
        state["flag"] = [True, 1, 1.0][step]  # equal under ==, different JSON: nothing cached by ==
        path = tmp_path / f"s{step}"
        safeckpt.save(path, state, metadata={"note": "ü" * step}, step=step, metrics={"loss": 1.0 / (step + 1)})
        man = assert_canonical(str(path))
        assert man["step"] == step and man["metadata"] == {"note": "ü" * step}
        assert man["objects"]["step"]["tree"] == step
        (empty,) = man["tensors"]["empty"]["chunks"]
        assert empty["start"] == empty["end"] and man["tensors"]["tied"]["alias_of"] == "t1"
        seen.add(man["tensors"]["t0"]["chunks"][0]["xxh3_64"])
        back = {k: (torch.full_like(v, -1.0) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
                if k != "model"}
        back["model"], back["step"], back["flag"] = nn.Linear(3, 2), None, None
        safeckpt.load(path, back)
        assert back["step"] == step and torch.equal(back["t0"], state["t0"])
        assert back["flag"] == state["flag"] and type(back["flag"]) is type(state["flag"])
        assert torch.equal(back["model"].weight, state["model"].weight)
    assert len(seen) == 3  # t0 changed every save: three different checksums
