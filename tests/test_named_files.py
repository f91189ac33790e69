"""Named files (issue 30 item 4): some tensors of a save laid out as safetensors files under the
caller's names inside the commit, written once, listed and checksummed, read back by loads.

The core capability the Hugging Face integrations use for ``model.safetensors``; tested here on
plain modules, in one process and on 2 real ranks (gloo on 127.0.0.1, hard timeouts).
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import safeckpt
from safeckpt.engine.request import NamedLayout
from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(180)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed.weight


def _names(path: str) -> dict[str, tuple[str, list[int]]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
    return {k: (v["dtype"], v["shape"]) for k, v in hdr.items() if k != "__metadata__"}


# safeckpt alone stores a tied pair under the first key in sorted order ("model/embed.weight");
# the named file holds the other one, so the pair must be re-rooted there.
LAYOUT = {"weights.safetensors": {"w.lm": "model/lm_head.weight", "w.body": "model/body.weight"},
          "bias.safetensors": {"b": "model/body.bias"}}


def test_named_files_hold_exactly_their_tensors_and_load_back(tmp_path) -> None:
    torch.manual_seed(0)
    m = Tied()
    opt = torch.optim.AdamW(m.parameters())
    m.lm_head(m.body(m.embed(torch.tensor([1, 2])))).sum().backward()
    opt.step()
    ck = str(tmp_path / "ck")
    safeckpt.save(ck, {"model": m, "optim": opt}, named=NamedLayout(LAYOUT))
    assert {"weights.safetensors", "bias.safetensors", "rank-00000.safetensors"} <= set(os.listdir(ck))
    got = load_file(os.path.join(ck, "weights.safetensors"))
    assert set(got) == {"w.lm", "w.body"}  # nothing else: no index tensor
    assert torch.equal(got["w.lm"], m.embed.weight) and torch.equal(got["w.body"], m.body.weight)
    with safe_open(os.path.join(ck, "weights.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"
    rank_names = _names(os.path.join(ck, "rank-00000.safetensors"))
    assert not any(k.startswith("model/") for k in rank_names)  # written once: not here too
    man = json.load(open(os.path.join(ck, "manifest.json")))
    assert man["files"]["weights.safetensors"]["writer"] == 0 and man["files"]["weights.safetensors"]["rank"] >= 1
    # the tied pair is stored once, under the key the named file holds
    assert man["tensors"]["model/embed.weight"]["alias_of"] == "model/lm_head.weight"
    assert safeckpt.verify(ck).ok

    torch.manual_seed(1)
    fresh = Tied()
    opt2 = torch.optim.AdamW(fresh.parameters())
    safeckpt.load(ck, {"model": fresh, "optim": opt2})
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), fresh.state_dict().values(), strict=True))
    assert fresh.lm_head.weight is fresh.embed.weight
    assert opt2.state_dict()["state"][0]["exp_avg"].abs().sum() > 0
    assert set(safeckpt.read_state_dict(ck)) >= {"model/embed.weight", "model/body.weight", "model/body.bias"}


def test_damage_in_a_named_file_is_reported_and_refused(tmp_path) -> None:
    ck = str(tmp_path / "ck")
    m = Tied()
    safeckpt.save(ck, {"model": m}, named=NamedLayout(LAYOUT))
    path = os.path.join(ck, "weights.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # a byte of the last tensor's data
        f.seek(size - 3)
        b = f.read(1)
        f.seek(size - 3)
        f.write(bytes([b[0] ^ 0x55]))
    report = safeckpt.verify(ck)
    assert not report.ok and any("weights.safetensors" in p for p in report.problems), report.problems
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.load(ck, {"model": Tied()})
    # damage in the header's index (the metadata loaders ignore) is caught too
    ck2 = str(tmp_path / "ck2")
    safeckpt.save(ck2, {"model": Tied()}, named=NamedLayout(LAYOUT))
    path = os.path.join(ck2, "bias.safetensors")
    raw = open(path, "rb").read()
    at = raw.index(b'\\"chunks\\"')
    with open(path, "r+b") as f:
        f.seek(at + 3)
        f.write(b"H")  # "chunks" -> "cHunks", same size
    assert not safeckpt.verify(ck2).ok
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.load(ck2, {"model": Tied()})


def test_layouts_that_cannot_be_named_files_are_refused_before_writing(tmp_path) -> None:
    with pytest.raises(ValueError, match="rank-"):
        NamedLayout({"rank-00001.safetensors": {"a": "model/body.weight"}})
    with pytest.raises(ValueError, match="safetensors"):
        NamedLayout({"sub/model.bin": {"a": "model/body.weight"}})
    with pytest.raises(ValueError, match="two named files"):
        NamedLayout({"a.safetensors": {"x": "model/body.weight"}, "b.safetensors": {"y": "model/body.weight"}})
    with pytest.raises(safeckpt.CheckpointError, match="does not hold"):
        safeckpt.save(str(tmp_path / "x"), {"model": Tied()}, named=NamedLayout({"a.safetensors": {"x": "model/nope"}}))
    with pytest.raises(safeckpt.CheckpointError, match="laid out twice"):
        safeckpt.save(str(tmp_path / "y"), {"model": Tied()}, named=NamedLayout(
            {"a.safetensors": {"x": "model/embed.weight", "y": "model/lm_head.weight"}}))
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


def _two_ranks(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layout = {"model-00001-of-00002.safetensors": {"0.weight": "model/0.weight", "0.bias": "model/0.bias"},
              "model-00002-of-00002.safetensors": {"1.weight": "model/1.weight", "1.bias": "model/1.bias"}}
    safeckpt.save(f"{root}/ck", {"model": model, "optim": opt}, named=layout)
    torch.manual_seed(rank + 5)
    fresh = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    safeckpt.load(f"{root}/ck", {"model": fresh}, strict=False)
    same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                  model.module.state_dict().values(), strict=True))
    return {"same": same}


def test_named_files_are_spread_over_two_ranks(tmp_path) -> None:
    outs = dist_harness.run(_two_ranks, 2, str(tmp_path), timeout=120)
    assert all(o.ok for o in outs), [o.message for o in outs]
    assert all(o.value["same"] for o in outs)
    ck = str(tmp_path / "ck")
    man = json.load(open(os.path.join(ck, "manifest.json")))
    writers = {man["files"][n]["writer"] for n in man["files"] if n.startswith("model-")}
    assert writers == {0, 1}
    assert set(load_file(os.path.join(ck, "model-00002-of-00002.safetensors"))) == {"1.weight", "1.bias"}
    assert safeckpt.verify(ck).ok
