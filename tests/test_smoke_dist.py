import os

import torch
from torch import nn

import safeckpt
from tests.helpers import dist_harness
from tests.helpers.manifest_checks import assert_canonical


def _save_load(rank, world, root):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    rng = safeckpt.RNGState()
    torch.manual_seed(100 + rank)
    info = safeckpt.save(os.path.join(root, "ck"), {"model": model, "optim": opt, "rng": rng, "step": 3})
    expect_rand = torch.rand(2)
    torch.manual_seed(1)
    model2 = nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 4))
    opt2 = torch.optim.AdamW(model2.parameters())
    st = {"model": model2, "optim": opt2, "rng": safeckpt.RNGState(), "step": 0}
    safeckpt.load(os.path.join(root, "ck"), st)
    assert torch.equal(torch.rand(2), expect_rand)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    return info.nbytes, st["step"]


def test_save_load_3_ranks(tmp_path):
    out = dist_harness.run(_save_load, 3, str(tmp_path), timeout=60)
    assert all(o.ok for o in out), [o.message for o in out]
    assert {o.value[1] for o in out} == {3}
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files == ["manifest.json", "rank-00000.safetensors", "rank-00001.safetensors", "rank-00002.safetensors"]
    man = assert_canonical(str(tmp_path / "ck"))  # chunks from 3 ranks, per-rank RNG records
    assert [c["rank"] for c in man["tensors"]["rng/torch"]["chunks"]] == [0, 1, 2]
