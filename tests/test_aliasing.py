"""Aliased tensors (tied weights) are stored once and come back tied (issue 12, item 3)."""

from __future__ import annotations

import json

import torch
from torch import nn

import safeckpt
from tests.helpers import dist_harness


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied, as in most language models


def _data_bytes(path) -> int:
    man = json.loads((path / "manifest.json").read_text())
    return sum(f["size"] for f in man["files"].values())


def test_tied_weights_stored_once_and_restored_tied(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    untied = TiedLM()
    untied.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())
    view_base = torch.arange(12.0)
    safeckpt.save(tmp_path / "tied", {"model": model, "views": {"a": view_base, "b": view_base, "part": view_base[2:5]}})
    safeckpt.save(tmp_path / "untied", {"model": untied})
    embed_bytes = model.embed.weight.numel() * 4
    assert _data_bytes(tmp_path / "untied") - _data_bytes(tmp_path / "tied") >= embed_bytes - 4096
    assert safeckpt.verify(tmp_path / "tied").ok

    man = json.loads((tmp_path / "tied" / "manifest.json").read_text())
    embed = {k: v for k, v in man["tensors"]["model/embed.weight"].items() if k != "pieces"}
    assert man["tensors"]["model/lm_head.weight"] == {**embed, "alias_of": "model/embed.weight"}  # no pieces
    assert "alias_of" not in man["tensors"]["views/part"]  # a different view is its own tensor

    flat = safeckpt.read_state_dict(tmp_path / "tied")
    assert flat["model/lm_head.weight"] is flat["model/embed.weight"]
    assert torch.equal(flat["model/embed.weight"], model.embed.weight)
    nested = safeckpt.read_state_dict(tmp_path / "tied", nested=True)
    assert nested["views"]["a"] is nested["views"]["b"] and torch.equal(nested["views"]["part"], view_base[2:5])

    fresh = TiedLM()
    target = {"model": fresh, "views": {"a": torch.zeros(12), "b": torch.zeros(12), "part": torch.zeros(3)}}
    safeckpt.load(tmp_path / "tied", target)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert torch.equal(target["views"]["b"], view_base)
    # An untied target loads a tied checkpoint too (each key gets the shared bytes).
    other = TiedLM()
    other.lm_head.weight = nn.Parameter(torch.zeros_like(other.embed.weight))
    safeckpt.load(tmp_path / "tied", {"model": other}, strict=False)
    assert torch.equal(other.lm_head.weight, model.embed.weight)


def _ddp_tied(rank: int, world: int, root: str) -> list[float]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TiedLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.module.lm_head(model.module.embed(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    info = safeckpt.save(f"{root}/ck", {"model": model, "optim": opt})
    fresh = TiedLM()
    safeckpt.load(f"{root}/ck", {"model": fresh}, strict=False)  # optimizer not loaded here
    assert fresh.lm_head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.module.embed.weight)
    return [info.nbytes, model.module.embed.weight.numel() * 4]


def test_tied_weights_under_ddp_two_ranks(tmp_path):
    outs = dist_harness.run(_ddp_tied, 2, str(tmp_path), timeout=120)
    assert all(o.ok for o in outs), [o.message for o in outs]
    nbytes, embed = outs[0].value
    # embed (tied) + body weight/bias + optimizer state (SGD: none): embed stored once
    assert nbytes < 2 * embed
