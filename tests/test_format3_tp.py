"""FSDP2 over tensor parallelism keeps format 3's size guarantee (issue 27, item 8).

FSDP2 gives TP-sharded weights ``_StridedShard`` placements (the TP mesh dim cuts first, then
the FSDP one). They were refused by the sharding rule, so each was stored as per-rank boxes that
went through the agree gather, the broadcast to every rank and the manifest (boxes = tensors x
world). Now ``["SS", dim, split_factor]`` is part of the rule: no per-rank boxes, and what a
non-coordinator receives per save is the same as on a 1-D FSDP2 mesh.
"""

from __future__ import annotations

import json
import math
import shutil
from typing import Any

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
    # A forged split factor (not the 2 ranks of the later mesh dim sharding dim 0) is refused by
    # validation, before any box is computed from it
    from safeckpt.format.manifest import encode_manifest

    forged = json.loads(json.dumps(man).replace('["SS", 0, 2]', '["SS", 0, 1]'))
    forged.pop("manifest_xxh3_128", None)
    bad = tmp_path / "forged"
    shutil.copytree(tp_root / "ck", bad)
    (bad / "manifest.json").write_bytes(encode_manifest(forged))
    report = safeckpt.verify(str(bad))
    assert not report.ok and "split factor" in " ".join(report.problems), report.problems
    ref = dist_harness.run(_one_d, 4, str(d1_root), timeout=300)
    assert all(o.ok for o in ref), [o.message for o in ref]
    for o, r in zip(out[1:], ref[1:], strict=True):  # a non-coordinator: the same bytes as on 1-D
        assert o.value["received"] == r.value["received"], (o.value["received"], r.value["received"])
    loaded = dist_harness.run(_load_1d, 2, str(tp_root), timeout=200)
    assert all(o.ok and o.value for o in loaded), [o.message for o in loaded]
    assert safeckpt.verify(tp_root / "ck").ok


def _fsdp2_rows(rows: int, dp: int, tp: int, i: int, j: int) -> list[int]:
    """The rows FSDP2 over TP gives the rank at (dp i, tp j): TP's torch.chunk first, then
    FSDP2's torch.chunk of that shard (computed on an index tensor, not by the rule)."""
    idx = torch.arange(rows)
    tps = torch.chunk(idx, tp)
    mine = tps[j] if j < len(tps) else idx[:0]
    dps = torch.chunk(mine, dp)
    return (dps[i] if i < len(dps) else idx[:0]).tolist()


def test_the_strided_rule_matches_fsdp2_and_torch_and_tiles():
    """Every rank's box by the rule holds the rows FSDP2 over TP gives it (uneven too), equals
    torch's own box for Shard/Replicate and wherever FSDP2's shards are even, and the boxes of
    all ranks tile the tensor; overlapping() finds exactly the writers."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    checked, torch_differs = set(), set()
    for rows in (8, 13, 16, 3, 1, 7):
        for dp, tp in ((2, 2), (2, 4), (4, 2), (3, 2)):
            mesh = Mesh({"shape": [dp, tp], "start": 0})
            for dims, places in (([["SS", 0, tp], ["S", 0]], [_StridedShard(0, split_factor=tp), Shard(0)]),
                                 ([["S", 0], ["S", 1]], [Shard(0), Shard(1)]),
                                 ([["S", 0], ["R"]], [Shard(0), Replicate()])):
                shape = [rows, 5]
                coords = [mesh.coord_of(r) for r in range(dp * tp)]
                checked.add((rows, dp, tp, dims[0][0]))
                boxes = []
                for r, coord in enumerate(coords):
                    size, offset = _compute_local_shape_and_global_offset(shape, [dp, tp], coord, places)
                    box = strided_box(shape, [dp, tp], coord, dims)
                    torch_box = (list(offset) if 0 not in size else list(box[0]), list(size))
                    if dims[0][0] == "SS":
                        held = _fsdp2_rows(rows, dp, tp, *coord)
                        assert list(range(box[0][0], box[0][0] + box[1][0])) == held, (rows, dp, tp, coord, box)
                        assert box[1][1] == 5 and box[0][1] == 0
                        if rows % (dp * tp) == 0:  # even: torch's function agrees
                            assert (list(box[0]), list(box[1])) == torch_box, (rows, dp, tp, coord, box, size)
                        elif (list(box[0]), list(box[1])) != torch_box:
                            torch_differs.add((rows, dp, tp))
                    else:
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
                for want in (([rows // 2, 1], [1, 2]), ([0, 0], [rows, 5]), ([rows - 1, 4], [1, 1])):
                    found = sorted(r for r, _ in overlapping("k", shape, mesh, dims, want))
                    expect = sorted(r for r in range(dp * tp) if (b := writes("k", shape, mesh, dims, r)) is not None
                                    and all(b[0][x] < want[0][x] + want[1][x] and want[0][x] < b[0][x] + b[1][x]
                                            for x in range(2)))
                    assert found == expect, (rows, dp, tp, dims, want, found, expect)
                    assert all(b == writes("k", shape, mesh, dims, r)
                               for r, b in overlapping("k", shape, mesh, dims, want))
    assert {(8, 2, 2, "SS"), (13, 2, 2, "SS"), (16, 2, 4, "SS"), (7, 3, 2, "SS")} <= checked, sorted(checked)
    # torch's function is not the truth for uneven FSDP2 shards (the old rule copied it)
    assert {(7, 3, 2), (13, 3, 2)} <= torch_differs, sorted(torch_differs)


def test_a_split_factor_fsdp2_never_gives_is_not_the_rule():
    """``["SS", d, f]`` means FSDP2's layout only when f is the product of the later mesh sizes
    sharding d; a manifest with another f is refused, not read by a guess."""
    from safeckpt.errors import CorruptCheckpoint

    mesh = Mesh({"shape": [3, 2], "start": 0})
    for dims in ([["SS", 0, 3], ["S", 0]], [["SS", 0, 2], ["S", 1]], [["SS", 0, 2], ["R"]]):
        with pytest.raises(CorruptCheckpoint, match="splitting it"):
            box_at([12, 4], [3, 2], [1, 1], dims)
        with pytest.raises(CorruptCheckpoint, match="splitting it"):
            list(overlapping("k", [12, 4], mesh, dims, None))
    # HSDP over TP (Replicate, SS, S) and 2-D TP (SS over two Shards): the later shards cut first
    assert box_at([13, 4], [2, 3, 2], [1, 2, 1], [["R"], ["SS", 0, 2], ["S", 0]]) == ([11, 0], [2, 4])
    assert box_at([13, 4], [3, 2, 2], [2, 1, 0], [["SS", 0, 4], ["S", 0], ["S", 0]]) == ([9, 0], [1, 4])
    assert box_at([7, 4], [3, 2, 2], [1, 1, 1], [["SS", 0, 4], ["S", 0], ["S", 0]]) == ([7, 0], [0, 4])
    assert box_at([13, 4], [3, 2, 2], [0, 1, 0], [["SS", 0, 4], ["S", 0], ["S", 0]]) == ([7, 0], [1, 4])


# Shapes FSDP2 over TP really gives, on torch's fake process group (one process plays every
# rank in turn): every row count 1..40 and GPT-2's vocabulary, as a ColwiseParallel Linear
# (weight, and bias for a few: SS) and as RowwiseParallel ones ([S0, S1] and [S0, R]).
_ROWS = [*range(1, 41), 50257]
_BIASED = (7, 13, 50257)
_MESHES = [(2, 2), (3, 2), (8, 2), (3, 3), (2, 4), (2, 3, 2)]  # the grid: the next test


def _fake_pg_mismatches(meshes: list[tuple[int, ...]]) -> tuple[list[Any], int, list[Any]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from safeckpt.format.sharding import dims_of

    bad, seen, torch_wrong = [], 0, []
    for shape in meshes:
        world = math.prod(shape)
        names = ("rep", "dp", "tp")[-len(shape):]
        for rank in range(world):
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            try:
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
                layers = [nn.Linear(2, r, bias=r in _BIASED) for r in _ROWS] + [nn.Linear(7, 13), nn.Linear(13, 7)]
                model = nn.Sequential(*layers)
                full = {}
                with torch.no_grad():  # values name their positions
                    for k, p in model.named_parameters():
                        p.copy_(torch.arange(p.numel(), dtype=torch.float64).view(p.shape))
                        full[k] = p.detach().clone()
                plan = {str(i): ColwiseParallel() for i in range(len(_ROWS))}
                plan.update({str(len(_ROWS)): RowwiseParallel(), str(len(_ROWS) + 1): RowwiseParallel()})
                # src_data_rank=None: each rank cuts its own copy (a fake group moves no data)
                parallelize_module(model.double(), mesh["tp"], plan, src_data_rank=None)
                fully_shard(model, mesh=mesh[names[:-1]] if len(shape) == 3 else mesh["dp"])
                # the fresh mesh's coordinate: torch reuses an equal mesh object (with the first
                # rank's coordinate) for the DTensors of the later ranks of this one process
                coord = list(mesh.get_coordinate())
                for k, p in model.named_parameters():
                    dims = dims_of(p)
                    box = box_at(list(p.shape), list(shape), coord, dims)
                    local = p.to_local()
                    want = full[k][tuple(slice(o, o + n) for o, n in zip(*box, strict=True))]
                    seen += 1
                    if list(local.shape) != box[1] or not torch.equal(local, want):
                        bad.append((shape, rank, k, list(p.shape), dims, box, list(local.shape)))
                    size, offset = _compute_local_shape_and_global_offset(p.shape, shape, coord, p.placements)
                    if list(size) != box[1] or (0 not in box[1] and list(offset) != box[0]):
                        torch_wrong.append((shape, rank, k))
            finally:
                dist.destroy_process_group()
    return bad, seen, torch_wrong


def _unruled_strided() -> list[Any]:
    """Rank 1 of 2 (fake group) holding a ``_StridedShard(0, sf=2)`` alone (no FSDP2 layout):
    torch's split gives it rows [1] of 3 (a box) and rows [2, 3, 6, 7] of 8 (not a box)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from safeckpt.errors import CheckpointError
    from safeckpt.format.sharding import dims_of, local_box

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        out: list[Any] = []
        for rows, local in ((3, 1), (8, 4)):
            t = DTensor.from_local(torch.zeros(local, 3), mesh, [_StridedShard(0, split_factor=2)],
                                   shape=torch.Size([rows, 3]), stride=(3, 1), run_check=False)
            try:
                out.append((dims_of(t), local_box(t)))
            except CheckpointError as exc:
                out.append((dims_of(t), str(exc)))
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_every_rank_of_real_fsdp2_over_tp_holds_the_rules_box():
    """FSDP2 (+HSDP) over TP built by parallelize_module + fully_shard, even and uneven: each
    rank's local shard is exactly the full tensor's part in the rule's box (the old rule, which
    copied torch's function, gave 50257 rows on 8x2 a non-box and 7 rows on 3x2 wrong rows)."""
    import concurrent.futures
    import multiprocessing

    # in a fresh process: torch keeps the fake group's meshes, which would stay with this one
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        bad, seen, torch_wrong = ex.submit(_fake_pg_mismatches, _MESHES).result(timeout=280)
        unruled = ex.submit(_unruled_strided).result(timeout=60)
    assert not bad, (len(bad), bad[:5])
    assert seen == sum(math.prod(m) for m in _MESHES) * (len(_ROWS) + len(_BIASED) + 4)
    # the uneven shapes are there: where torch's function (the old rule) is not FSDP2's layout
    assert {(s, k) for s, _, k in torch_wrong} >= {((3, 2), "6.weight"), ((8, 2), f"{len(_ROWS) - 1}.weight"),
                                                  ((3, 2), "12.bias"), ((3, 3), "10.weight"), ((2, 3, 2), "6.weight")}, torch_wrong[:10]
    # a split factor FSDP2 never gives is not the rule's: torch's own split, kept as a per-rank
    # box where it is one, refused where it is not (torch's function names the box [2, 4) there)
    assert unruled[0] == (None, [[1, 0], [1, 3]]), unruled
    assert unruled[1][0] is None and "not one box" in unruled[1][1], unruled


def test_the_rule_is_fsdp2s_layout_for_every_small_uneven_shape():
    """The same truth without torch's objects (torch.chunk of torch.chunk) over the whole grid:
    rows 1..40 and 50257, dp 2..8, tp 2..4, every rank."""
    bad = []
    for rows in _ROWS:
        for dp in range(2, 9):
            for tp in range(2, 5):
                for i in range(dp):
                    for j in range(tp):
                        box = box_at([rows, 3], [dp, tp], [i, j], [["SS", 0, tp], ["S", 0]])
                        held = _fsdp2_rows(rows, dp, tp, i, j)
                        if list(range(box[0][0], box[0][0] + box[1][0])) != held:
                            bad.append((rows, dp, tp, i, j, box, held[:3]))
    assert not bad, (len(bad), bad[:5])


# A real save of uneven FSDP2 over TP (7 and 13 rows on a 3x2 mesh: the old rule refused the
# save on every rank), loaded back into 3x2, into 2x3 and into a plain model, bit-exactly.
def _uneven_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 13), nn.Linear(13, 13), nn.Linear(13, 5))


def _uneven_sharded(dp: int, tp: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _uneven_model()
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(),
                                           "2": ColwiseParallel(), "3": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, full


def _uneven_tp(rank: int, world: int, root: str) -> dict:
    from safeckpt.format.sharding import local_box

    model, full = _uneven_sharded(3, 2)
    truth = {k: v.to_local().clone() for k, v in model.state_dict().items()}  # torch's own shards
    held = all(torch.equal(v.to_local(), full[k][tuple(slice(o, o + n) for o, n in zip(*local_box(v), strict=True))])
               for k, v in model.state_dict().items())
    safeckpt.save(f"{root}/ck", {"model": model})
    placements = {k: str(v.placements) for k, v in model.state_dict().items()}
    out = {"placements": placements, "held": held}
    # the same 3x2 layout, zeroed first
    for p in model.parameters():
        p.data.zero_()
    safeckpt.load(f"{root}/ck", {"model": model}, strict="entries")
    out["same"] = all(torch.equal(v.to_local(), truth[k]) for k, v in model.state_dict().items())
    # another layout: 2x3 (TP 3 ways, FSDP2 2 ways), its shards cut by torch from the same weights
    other, _ = _uneven_sharded(2, 3)
    want = {k: v.to_local().clone() for k, v in other.state_dict().items()}
    for p in other.parameters():
        p.data.zero_()
    safeckpt.load(f"{root}/ck", {"model": other}, strict="entries")
    out["other"] = all(torch.equal(v.to_local(), want[k]) for k, v in other.state_dict().items())
    # a plain model: the whole tensors
    plain = _uneven_model()
    for p in plain.parameters():
        p.data.zero_()
    safeckpt.load(f"{root}/ck", {"model": plain}, strict="entries")
    out["plain"] = all(torch.equal(v, full[k]) for k, v in plain.state_dict().items())
    return out


@pytest.mark.timeout(300)
def test_uneven_fsdp2_over_tp_saves_and_reshards_bit_exactly(tmp_path):
    out = dist_harness.run(_uneven_tp, 6, str(tmp_path), timeout=240)
    assert all(o.ok for o in out), [o.message for o in out]
    assert "_StridedShard" in out[0].value["placements"]["0.weight"], out[0].value["placements"]
    assert all(o.value["held"] for o in out), [o.value for o in out]
    for what in ("same", "other", "plain"):
        assert all(o.value[what] for o in out), (what, [o.value for o in out])
    man = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    recs = man["tensors"]
    assert not [k for k, rec in recs.items() if "boxes" in rec], recs  # all by the rule
    assert recs["model/0.weight"]["sharding"]["dims"] == [["SS", 0, 2], ["S", 0]]
    assert recs["model/2.bias"]["sharding"]["dims"] == [["SS", 0, 2], ["S", 0]]
    assert safeckpt.verify(tmp_path / "ck").ok
