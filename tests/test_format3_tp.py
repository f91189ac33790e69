"""FSDP2 over tensor parallelism keeps format 3's size guarantee (issue 27, item 8).

FSDP2 gives TP-sharded weights ``_StridedShard`` placements (the TP mesh dim cuts first, then
the FSDP one). They were refused by the sharding rule, so each was stored as per-rank boxes that
went through the agree gather, the broadcast to every rank and the manifest (boxes = tensors x
world). Now ``["SS", dim, split_factor]`` is part of the rule: no per-rank boxes, and what a
non-coordinator receives per save is the same as on a 1-D FSDP2 mesh.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt.coord import dist as _dist
from safeckpt.format.sharding import Mesh, box_at, overlapping, strided_box, writes
from tests.helpers import dist_harness

LAYERS = 24  # 12 colwise + 12 rowwise: enough strided tensors that their boxes pass a slot


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 14) if i % 2 == 0 else nn.Linear(14, 16) for i in range(LAYERS)])


def _train(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return opt


def _tp(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(LAYERS)}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    opt = _train(model)
    state = {"model": model, "optim": opt}
    safeckpt.save(f"{root}/warm", state)  # the checkpoint group is created by the first call
    before = dict(_dist.STATS)
    safeckpt.save(f"{root}/ck", state)
    received = _dist.STATS["received"] - before["received"]
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, f"{root}/full.pt")
    placements = {k: str(v.placements) for k, v in model.state_dict().items()}
    # Load back into the same 2x2 layout (the reader's strided rule), zeroed first.
    for p in model.parameters():
        p.data.zero_()
    safeckpt.load(f"{root}/ck", {"model": model}, strict="entries")
    again = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"received": received, "placements": placements,
            "same": all(torch.equal(full[k], again[k]) for k in full)}


def _one_d(rank: int, world: int, root: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    state = {"model": model, "optim": _train(model)}
    safeckpt.save(f"{root}/warm", state)
    before = dict(_dist.STATS)
    safeckpt.save(f"{root}/ck", state)
    return {"received": _dist.STATS["received"] - before["received"]}


def _load_1d(rank: int, world: int, root: str) -> bool:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    for p in model.parameters():
        p.data.zero_()
    safeckpt.load(f"{root}/ck", {"model": model}, strict="entries")
    full = torch.load(f"{root}/full.pt")
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full)


@pytest.mark.timeout(600)
def test_fsdp2_over_tp_is_described_by_the_rule_and_reshards_bit_exactly(tmp_path):
    tp_root, d1_root = tmp_path / "tp", tmp_path / "d1"  # the same length: the same messages
    out = dist_harness.run(_tp, 4, str(tp_root), timeout=300)
    assert all(o.ok for o in out), [o.message for o in out]
    assert "_StridedShard" in out[0].value["placements"]["0.weight"], out[0].value["placements"]
    assert all(o.value["same"] for o in out), [o.value for o in out]
    man = json.loads((tp_root / "ck" / "manifest.json").read_text())
    assert not [k for k, rec in man["tensors"].items() if "boxes" in rec]  # before: every strided tensor
    dims = {json.dumps(rec["sharding"]["dims"]) for rec in man["tensors"].values() if "sharding" in rec}
    assert json.dumps([["SS", 0, 2], ["S", 0]]) in dims and json.dumps([["S", 0], ["S", 1]]) in dims, dims
    ref = dist_harness.run(_one_d, 4, str(d1_root), timeout=300)
    assert all(o.ok for o in ref), [o.message for o in ref]
    for o, r in zip(out[1:], ref[1:], strict=True):  # a non-coordinator: the same bytes as on 1-D
        assert o.value["received"] == r.value["received"], (o.value["received"], r.value["received"])
    loaded = dist_harness.run(_load_1d, 2, str(tp_root), timeout=200)
    assert all(o.ok and o.value for o in loaded), [o.message for o in loaded]
    assert safeckpt.verify(tp_root / "ck").ok


def test_the_strided_rule_matches_torch_and_tiles():
    """Every rank's box by the rule equals torch's own, for FSDP2-over-TP shapes (uneven too),
    and the boxes of all ranks tile the tensor; overlapping() finds exactly the writers."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    checked = set()
    for rows in (8, 13, 16, 3, 1):
        for dp, tp in ((2, 2), (2, 4), (4, 2), (3, 2)):
            mesh = Mesh({"shape": [dp, tp], "start": 0})
            for dims, places in (([["SS", 0, tp], ["S", 0]], [_StridedShard(0, split_factor=tp), Shard(0)]),
                                 ([["S", 0], ["S", 1]], [Shard(0), Shard(1)]),
                                 ([["S", 0], ["R"]], [Shard(0), Replicate()])):
                shape = [rows, 5]
                coords = [mesh.coord_of(r) for r in range(dp * tp)]
                if any(strided_box(shape, [dp, tp], c, dims) is None for c in coords):
                    continue  # torch's region is not a box for some rank: the save refuses it
                checked.add((rows, dp, tp, dims[0][0]))
                boxes = []
                for r, coord in enumerate(coords):
                    size, offset = _compute_local_shape_and_global_offset(shape, [dp, tp], coord, places)
                    box = strided_box(shape, [dp, tp], coord, dims)
                    assert list(box[1]) == list(size), (rows, dp, tp, dims, coord, box, size)
                    if 0 not in box[1]:
                        assert list(box[0]) == list(offset), (rows, dp, tp, dims, coord, box, offset)
                    assert list(box_at(shape, [dp, tp], coord, dims)) == list(box)
                    w = writes("k", shape, mesh, dims, r)
                    if w is not None:
                        boxes.append(w)
                cells = sorted((i, j) for o, n in boxes for i in range(o[0], o[0] + n[0])
                               for j in range(o[1], o[1] + n[1]))
                assert cells == [(i, j) for i in range(rows) for j in range(5)], (rows, dp, tp, dims)
                want = ([rows // 2, 1], [1, 2])
                found = sorted(r for r, _ in overlapping("k", shape, mesh, dims, want))
                expect = sorted(r for r in range(dp * tp) if (b := writes("k", shape, mesh, dims, r)) is not None
                                and b[0][0] <= want[0][0] < b[0][0] + b[1][0] and b[0][1] < 3 and b[0][1] + b[1][1] > 1)
                assert found == expect, (rows, dp, tp, dims, found, expect)
    assert {(8, 2, 2, "SS"), (13, 2, 2, "SS"), (16, 2, 4, "SS")} <= checked, sorted(checked)
