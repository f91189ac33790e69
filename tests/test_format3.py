"""Format 3 (src/safeckpt/format/v3.py): a manifest of O(tensors + files) with chunk records in
per-file indexes, and a collective protocol whose per-rank cost does not grow with the world.

The 1,024-rank test builds the commit records the save path builds (the same plan code, the
same index and manifest encoders) for an FSDP2 layout of 2,000 tensors without running 1,024
processes; the others save and load for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt.coord import dist as _dist
from safeckpt.engine.plan import MeshInfo, build_plan
from safeckpt.engine.save import manifest_head
from safeckpt.format.manifest import CHECKSUM_FIELD, dtype_size, encode_manifest, parse_manifest
from safeckpt.format.sharding import Mesh, box_at, overlapping, writes
from safeckpt.format.tree import Leaf
from safeckpt.format.v3 import Layout
from tests.helpers import dist_harness
from tests.helpers.proc_sockets import open_sockets

# ----------------------------------------------------------------- synthesized


class _FakeMesh:
    def __init__(self, world: int) -> None:
        self.mesh = torch.arange(world)
        self.shape = (world,)
        self.mesh_dim_names = ("dp",)


class _FakeDTensor:
    """What the plan reads of an FSDP2 DTensor: mesh, placements, global shape."""

    def __init__(self, shape: list[int], mesh: _FakeMesh) -> None:
        from torch.distributed.tensor import Shard

        self.device_mesh = mesh
        self.placements = (Shard(0),)
        self.shape = torch.Size(shape)
        self.dtype = torch.bfloat16

    def element_size(self) -> int:
        return 2


def _llama_like(n: int) -> list[tuple[str, list[int]]]:
    """``n`` tensor shapes like a 70B model's params + AdamW state (keys of realistic length)."""
    shapes = [[8192, 8192], [1024, 8192], [28672, 8192], [8192, 28672], [8192]]
    out = []
    for i in range(n):
        layer, kind = divmod(i, len(shapes))
        for state in ("", "/exp_avg", "/exp_avg_sq"):
            out.append((f"optim/state/model.layers.{layer}.mlp.proj_{kind}.weight{state}", shapes[kind]))
    return out[:n]


def _synthesized(world: int, n_tensors: int) -> tuple[bytes, dict[str, int]]:
    """(manifest bytes, index bytes of every file) of an FSDP2 save of ``n_tensors`` at
    ``world`` ranks, as the save path builds them."""
    mesh = _FakeMesh(world)
    shapes = _llama_like(n_tensors)
    leaves = {k: Leaf(k, _FakeDTensor(shape, mesh), "sharded") for k, shape in shapes}
    mesh_rec = {"shape": [world], "start": 0}
    meshes = {id(mesh): MeshInfo(mesh_rec, json.dumps(mesh_rec, sort_keys=True), Mesh(mesh_rec))}
    plan = build_plan(leaves, {}, {}, meshes, set(), 0, world)
    m = Mesh(plan.meshes[0])
    files, index_bytes = {}, {}
    for r in range(world):  # what each rank's plan writes, and its index
        names, spans, pos = [], [], 0
        records = {}
        for k, shape in shapes:
            box = writes(k, shape, m, [["S", 0]], r)
            if box is None:
                continue
            name = f"{k}@" + ",".join(map(str, box[0]))
            nbytes = 2 * box[1][0] * (shape[1] if len(shape) > 1 else 1)
            names.append(name)
            spans.append((pos, pos + nbytes))
            records[name] = (k, box[0], box[1])
            pos += nbytes
        builder = type(plan.index)(records)
        tail = builder(names, spans, {})
        index = tail.render(["0123456789abcdef"] * len(names))
        data = 8 + 4096
        index_bytes[f"rank-{r:05d}.safetensors"] = len(index)
        files[f"rank-{r:05d}.safetensors"] = {"size": data + pos + len(index), "xxh3_128": "0" * 32, "rank": r,
                                              "data": data, "index": [data + pos, data + pos + len(index), "0" * 16]}
    head = manifest_head(step=100, world_size=world, metadata={}, metrics={}, files=files, rank_trees=[],
                         meshes=plan.meshes)
    objects = {"optim": {"kind": "tree", "tree": {"state": {k: {"@tensor": k} for k in leaves}}}}
    from safeckpt.format.manifest_text import encode

    return encode(head, objects, plan.tensors_json), index_bytes


@pytest.mark.timeout(300)
def test_manifest_of_a_1024_rank_fsdp2_layout_of_2000_tensors_is_small_and_a_rank_reads_one_index(tmp_path):
    world, n = 1024, 2000
    raw, index_bytes = _synthesized(world, n)
    # Format 2 needed ~119 bytes per (tensor, rank) chunk: 2,000 x 1,024 x 119 = 244 MB here.
    assert len(raw) <= 4 << 20, len(raw)
    man = parse_manifest(raw, str(tmp_path))  # a valid manifest: checksum and every field
    assert man["format_version"] == 3 and len(man["files"]) == world and len(man["tensors"]) == n
    layout = Layout(man, str(tmp_path), None, dtype_size)
    total = sum(index_bytes.values())
    for rank in (0, 1, 511, 1023):  # a rank loading its own shards at the same world size
        mesh = Mesh(man["meshes"][0])
        targets = [(k, list(box_at(rec["shape"], mesh.shape, mesh.coord_of(rank), rec["sharding"]["dims"])))
                   for k, rec in man["tensors"].items()]
        need = layout.files_for(targets, rank)
        assert need == {f"rank-{rank:05d}.safetensors"}
        assert sum(index_bytes[f] for f in need) <= 0.01 * total
    # A rank of a 512-rank job (resharding) needs the two files its rows come from.
    rec = man["tensors"][next(iter(man["tensors"]))]
    box = box_at(rec["shape"], [512], [7], [["S", 0]])
    assert sorted({r for r, _ in overlapping("k", rec["shape"], Mesh({"shape": [1024], "start": 0}),
                                             [["S", 0]], box)}) == [14, 15]


def test_the_rule_gives_dtensor_boxes_and_one_writer_per_replica():
    mesh = Mesh({"shape": [2, 3], "start": 0})  # HSDP: replicate over 2, shard over 3
    dims = [["R"], ["S", 0]]
    shape = [10, 4]
    boxes = {r: writes("w", shape, mesh, dims, r) for r in range(6)}
    written = [b for b in boxes.values() if b is not None]
    assert sorted(b[0][0] for b in written) == [0, 4, 8] and sum(b[1][0] for b in written) == 10
    assert len([r for r, b in boxes.items() if b is not None]) == 3  # one replica writes each box
    assert sorted(r for r, _ in overlapping("w", shape, mesh, dims, None)) == sorted(
        r for r, b in boxes.items() if b is not None)
    # torch.chunk's rule: 10 rows over 4 -> 3, 3, 3, 1; 2 rows over 4 -> 1, 1, 0, 0
    assert [box_at([10], [4], [i], [["S", 0]])[1][0] for i in range(4)] == [3, 3, 3, 1]
    assert [box_at([2], [4], [i], [["S", 0]])[1][0] for i in range(4)] == [1, 1, 0, 0]


# ------------------------------------------------------------- real save/load


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_damaged_index_is_corrupt_everywhere_it_is_read(tmp_path):
    path = tmp_path / "ck"
    safeckpt.save(path, {"model": _model()})
    man = json.loads((path / "manifest.json").read_text())
    (name, rec), = man["files"].items()
    start, end, _ = rec["index"]
    data = bytearray((path / name).read_bytes())
    i = data.index(b'"xxh3', start) if b'"xxh3' in data[start:end] else start + 20
    data[i] ^= 0x01
    (path / name).write_bytes(bytes(data))
    assert not safeckpt.verify(path, deep=False).ok
    with pytest.raises(safeckpt.CorruptCheckpoint, match="index"):
        safeckpt.load(path, {"model": _model()})
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.read_state_dict(path)


def test_an_index_that_disagrees_with_the_manifest_is_corrupt_even_when_resigned(tmp_path):
    """A tool that rewrites the index and its checksum consistently still cannot move a chunk
    somewhere the manifest does not place it, or drop one."""
    path = tmp_path / "ck"
    safeckpt.save(path, {"model": _model()})
    man = json.loads((path / "manifest.json").read_text())
    (name, rec), = man["files"].items()
    start, end, _ = rec["index"]
    data = (path / name).read_bytes()
    idx = json.loads(data[start:end])
    for mutate in ("drop", "move"):
        bad = json.loads(json.dumps(idx))
        if mutate == "drop":
            bad["chunks"].pop()
        else:
            bad["chunks"][0][1] = [1] + bad["chunks"][0][1][1:]
        text = json.dumps(bad, separators=(",", ":")).encode()
        new = data[:start] + text
        import xxhash

        m = json.loads(json.dumps(man))
        m["files"][name].update(size=len(new), index=[start, start + len(text), xxhash.xxh3_64_hexdigest(text)],
                                xxh3_128=xxhash.xxh3_128_hexdigest(new))
        (path / name).write_bytes(new)
        (path / "manifest.json").write_bytes(encode_manifest({k: v for k, v in m.items() if k != CHECKSUM_FIELD}))
        with pytest.raises(safeckpt.CorruptCheckpoint):
            safeckpt.load(path, {"model": _model()})
        assert not safeckpt.verify(path).ok


def test_a_huge_integer_in_the_manifest_is_corrupt_not_a_value_error(tmp_path):
    path = tmp_path / "ck"
    safeckpt.save(path, {"model": _model(), "meta": {"n": 1}})
    raw = (path / "manifest.json").read_bytes()
    (path / "manifest.json").write_bytes(raw.replace(b'"n":1', b'"n":' + b"7" * 5001))
    report = safeckpt.verify(path)
    assert not report.ok and "JSON" in report.problems[0]
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.read_state_dict(path)
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.load(path, {"model": _model(), "meta": {"n": 0}})
    cli = subprocess.run([sys.executable, "-m", "safeckpt.cli", "inspect", str(path)], capture_output=True, text=True)
    assert cli.returncode not in (0, 70), cli.stderr  # a damaged checkpoint, not an internal error
    assert "Traceback" not in cli.stderr


def _fsdp_rounds(rank: int, world: int, root: str) -> dict:
    """Save and load an FSDP2 model; count this rank's collectives and bytes per call, and
    which files' indexes the load read."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "rng": safeckpt.RNGState()}
    out = {}
    safeckpt.save(f"{root}/warm", state)  # the checkpoint group is created by the first call
    for what, call in (("save", lambda: safeckpt.save(f"{root}/ck", state)),
                       ("load", lambda: safeckpt.load(f"{root}/ck", state))):
        before = dict(_dist.STATS)
        read = []
        orig = Layout.read_index
        Layout.read_index = lambda self, name, orig=orig, read=read: (read.append(name), orig(self, name))[1]
        try:
            call()
        finally:
            Layout.read_index = orig
        out[what] = {k: _dist.STATS[k] - before[k] for k in before}
        out[what + "_indexes"] = sorted(set(read))
    return out


@pytest.mark.timeout(240)
def test_fsdp2_save_and_load_take_four_and_three_rounds_and_read_two_indexes(tmp_path):
    by_world = {}
    for world in (2, 4):
        root = tmp_path / f"w{world}"
        out = dist_harness.run(_fsdp_rounds, world, str(root), timeout=180)
        assert all(o.ok for o in out), [o.message for o in out]
        by_world[world] = [o.value for o in out]
        for o in out:
            v = o.value
            assert v["save"]["rounds"] == 4, v  # agree: gather + broadcast; commit: the same
            assert v["load"]["rounds"] == 3, v  # check: gather + broadcast; apply: one all-reduce
            # its own file (its shards, its RNG state) and rank 0's, which holds the small
            # replicated state (AdamW's step scalars: too small to spread over the ranks)
            assert v["load_indexes"] == sorted({f"rank-{o.rank:05d}.safetensors", "rank-00000.safetensors"}), v
        man = json.loads((root / "ck" / "manifest.json").read_text())
        assert man["format_version"] == 3
        assert all("chunks" not in rec for rec in man["tensors"].values())
    # What a non-coordinator receives does not grow with the world size.
    for what in ("save", "load"):
        assert by_world[2][1][what]["received"] == by_world[4][3][what]["received"], by_world


def _resharded(rank: int, world: int, root: str) -> bool:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(10, 7) for _ in range(3)])  # rows that do not divide evenly
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    if world == 3:
        safeckpt.save(f"{root}/ck", {"model": model})
        return True
    for p in model.parameters():
        p.data.zero_()
    safeckpt.load(f"{root}/ck", {"model": model})
    torch.manual_seed(1)
    ref = nn.Sequential(*[nn.Linear(10, 7) for _ in range(3)])
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return all(torch.equal(full[k], v) for k, v in ref.state_dict().items())


@pytest.mark.timeout(240)
def test_uneven_fsdp2_shards_saved_at_3_ranks_load_at_2(tmp_path):
    out = dist_harness.run(_resharded, 3, str(tmp_path), timeout=120)
    assert all(o.ok for o in out), [o.message for o in out]
    out = dist_harness.run(_resharded, 2, str(tmp_path), timeout=120)
    assert all(o.ok and o.value for o in out), [o.message for o in out]
    man = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert {json.dumps(r.get("sharding")) for r in man["tensors"].values()} == {json.dumps({"mesh": 0, "dims": [["S", 0]]})}
    assert os.path.exists(tmp_path / "ck" / "rank-00002.safetensors")


def test_extra_files_are_committed_with_the_checkpoint_and_verified(tmp_path):
    path = str(tmp_path / "ck")
    safeckpt.save(path, {"model": _model()}, step=3, extra_files={"trainer_state.json": b'{"global_step": 3}'})
    assert (tmp_path / "ck" / "trainer_state.json").read_bytes() == b'{"global_step": 3}'
    assert safeckpt.verify(path).ok
    (tmp_path / "ck" / "trainer_state.json").write_bytes(b'{"global_step": 4}')
    report = safeckpt.verify(path)
    assert not report.ok and "trainer_state.json" in report.problems[0]
    with pytest.raises(safeckpt.CheckpointError, match="not allowed"):
        safeckpt.save(str(tmp_path / "bad"), {"model": _model()}, step=3, extra_files={"manifest.json": b"{}"})
    assert not (tmp_path / "bad").exists()
    assert not (tmp_path / "bad").exists()


def _lazy_group(rank: int, world: int, root: str) -> dict:
    before = open_sockets()
    state = {"w": torch.arange(8.0), "rng": safeckpt.RNGState()}
    safeckpt.save(f"{root}/a", state)
    safeckpt.load(f"{root}/a", state)
    added = open_sockets() - before
    if rank == 5:
        os._exit(3)  # dies before the next save
    err = dist_harness.attempt(lambda: safeckpt.save(f"{root}/b", state))
    return {"added": added, "err": err}


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets through /proc")
def test_lazily_connected_group_holds_one_pair_per_rank_and_still_fails_fast(tmp_path):
    out = dist_harness.run(_lazy_group, 8, str(tmp_path), timeout=120,
                           env={"SAFECKPT_LAZY_CONNECT": "1", "SAFECKPT_TIMEOUT": "20"})
    for o in out:
        if o.rank == 5:
            continue
        assert o.ok, o.message
        v = o.value
        # rank 0 connects to every rank; any other rank to rank 0 and its children in gloo's
        # binomial-tree broadcast (plus a store client), where the full mesh adds one socket per
        # peer and gloo's listener: 8 here (measured: 8 on every rank full, 4-6 lazily)
        assert v["added"] <= 8 if o.rank == 0 else v["added"] < 8, (o.rank, v)
        assert v["err"]["type"] == "RankFailure" and sorted(v["err"]["failures"]) == [5], v["err"]
        assert v["err"]["elapsed"] < 20, v["err"]  # the exit is seen, not waited out
    assert not (tmp_path / "b").exists()


def _warned(rank: int, world: int, root: str) -> dict:
    import warnings

    state = {"w": torch.full((4,), float(rank)), "same": torch.ones(3)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safeckpt.save(f"{root}/ck", state, check_replicas="warn")
    return {"warned": [str(w.message) for w in caught if issubclass(w.category, safeckpt.SafeckptWarning)]}


@pytest.mark.timeout(120)
def test_differing_replicas_in_warn_mode_warn_on_every_rank_and_save(tmp_path):
    out = dist_harness.run(_warned, 2, str(tmp_path), timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        (msg,) = o.value["warned"]
        assert "rank 1: w" in msg and "same" not in msg, msg
    flat = safeckpt.read_state_dict(tmp_path / "ck")
    assert torch.equal(flat["same"], torch.ones(3)) and flat["w"].shape == (4,)


def test_a_forged_dtype_that_the_index_contradicts_makes_restore_fall_back(tmp_path):
    """Fuzz finding: a re-signed manifest saying F64 for an F32 tensor raised
    IncompatibleCheckpoint (the state's fault: no fallback) before the index was read."""
    import warnings

    state = {"t": torch.ones(4)}
    with safeckpt.CheckpointManager(tmp_path, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(1, state)
        mgr.save(2, {"t": torch.full((4,), 2.0)})
    newest = tmp_path / "step-0000000002" / "manifest.json"
    man = json.loads(newest.read_text())
    man["tensors"]["t"]["dtype"] = "F64"
    newest.write_bytes(encode_manifest({k: v for k, v in man.items() if k != CHECKSUM_FIELD}))
    target = {"t": torch.zeros(4, dtype=torch.float64)}
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.load(tmp_path / "step-0000000002", target)
    assert torch.equal(target["t"], torch.zeros(4, dtype=torch.float64))
    state = {"t": torch.zeros(4)}
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with safeckpt.CheckpointManager(tmp_path, preemption_signals=()) as mgr:
            assert mgr.restore(state) == 1
    assert torch.equal(state["t"], torch.ones(4))


def _uneven(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = torch.ones(3 if rank == 0 else 1, 2)  # 3 + 1 rows where the chunk rule gives 2 + 2
    t = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size([4, 2]), stride=(2, 1), run_check=False)
    return dist_harness.attempt(lambda: safeckpt.save(f"{root}/ck", {"w": t}))


@pytest.mark.timeout(120)
def test_uneven_from_local_shards_are_refused_on_every_rank_before_writing(tmp_path):
    out = dist_harness.run(_uneven, 2, str(tmp_path), timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        assert not o.value["ok"] and "uneven shards" in o.value["msg"], o.value
    assert not (tmp_path / "ck").exists()
