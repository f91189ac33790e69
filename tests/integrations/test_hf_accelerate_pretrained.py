"""Issue 30 item 4: Accelerate's ``save_state`` through safeckpt writes ``model.safetensors`` as
stock Accelerate does (the same tensor names, tied weights once), as files of the one commit,
the weights written once; ``load_state`` reads them back (verified). One process, CPU.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

# First: skips this module without transformers or accelerate, sets the offline environment.
from tests.integrations.hf_testing import (
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    reset_accelerate_state,
)

# isort: split
import torch
from torch import nn

import safeckpt

pytestmark = pytest.mark.timeout(300)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)) * self.scale)


def _tensors(path: str) -> dict[str, tuple[str, list[int]]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        hdr = json.loads(f.read(n))
    return {k: (v["dtype"], v["shape"]) for k, v in hdr.items() if k != "__metadata__"}


def _setup(cls: type, seed: int):  # noqa: ANN202
    reset_accelerate_state()
    torch.manual_seed(seed)
    acc = cls(cpu=True)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def test_save_state_writes_model_safetensors_once_and_load_state_reads_it(tmp_path) -> None:
    from accelerate import Accelerator

    from safeckpt.integrations.accelerate import SafeckptAccelerator

    stock_acc, stock_model, _ = _setup(Accelerator, 0)
    stock_acc.save_state(str(tmp_path / "stock"))

    acc, model, opt = _setup(SafeckptAccelerator, 0)
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    ours = str(tmp_path / "ours")
    acc.save_state(ours)
    assert _tensors(os.path.join(ours, "model.safetensors")) == \
        _tensors(os.path.join(str(tmp_path / "stock"), "model.safetensors"))
    man = json.load(open(os.path.join(ours, "manifest.json")))
    assert "model.safetensors" in man["files"]
    assert not any(k.startswith("model_0/") for k in _tensors(os.path.join(ours, "rank-00000.safetensors")))
    assert safeckpt.verify(ours).ok
    from safetensors.torch import load_file

    on_disk = load_file(os.path.join(ours, "model.safetensors"))
    sd = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(on_disk[k], sd[k]) for k in on_disk)

    acc2, model2, _ = _setup(SafeckptAccelerator, 1)  # another init: load_state must restore it
    acc2.load_state(ours)
    sd2 = acc2.unwrap_model(model2).state_dict()
    assert all(torch.equal(sd2[k], sd[k]) for k in sd)
    m2 = acc2.unwrap_model(model2)
    assert m2.head.weight is m2.emb.weight
