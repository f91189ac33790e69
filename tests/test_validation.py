"""The validation layer (issue 8): everything read from disk is checked before it is used.

- an edited manifest value is caught by the manifest's own checksum;
- symlinks and special files (FIFO) are refused without following or blocking;
- a failed load leaves the caller's state as it was, on every rank;
- any string key round-trips (escaped ``/``, ``@``, ``%``), and ``read_state_dict(nested=True)``
  gives the saved trees back;
- a plain tensor that differs between ranks is refused (never collapsed), ``PerRank`` keeps it
  per rank;
- a strict load refuses optimizer state attached to no parameter.
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt.engine.reader import open_manifest
from safeckpt.format.manifest import CHECKSUM_FIELD, encode_manifest
from tests.helpers import dist_harness
from tests.helpers.manifest_checks import as_format2

DATA = "rank-00000.safetensors"


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "extra": {"t": torch.arange(6) + seed, "n": seed}}


def _snapshot(state: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optim": json.dumps(state["optim"].state_dict()["param_groups"]),
        "exp_avg": [s["exp_avg"].clone() for s in state["optim"].state.values()],
        "t": state["extra"]["t"].clone(),
        "n": state["extra"]["n"],
    }


def _same(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and a["optim"] == b["optim"]
        and all(torch.equal(x, y) for x, y in zip(a["exp_avg"], b["exp_avg"], strict=True))
        and torch.equal(a["t"], b["t"])
        and a["n"] == b["n"]
    )


def _manifest(path) -> dict:
    """The checkpoint's manifest, rewritten as format 2 (every chunk in the manifest): these
    tests edit chunk records; format 3's own checks are in test_format3."""
    return as_format2(str(path))


def _signed(path, man: dict) -> None:
    (path / "manifest.json").write_bytes(encode_manifest({k: v for k, v in man.items() if k != CHECKSUM_FIELD}))


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ck"
    safeckpt.save(path, _state(0))
    return path


def test_any_unsigned_value_edit_is_detected(ckpt):
    original = _manifest(ckpt)
    edits = [
        lambda m: m.__setitem__("step", 8),
        lambda m: m["objects"]["extra"]["tree"].__setitem__("n", 1),
        lambda m: next(iter(m["tensors"].values()))["chunks"][0].__setitem__("xxh3_64", "0" * 16),
        lambda m: m["metadata"].__setitem__("note", "added"),
    ]
    for edit in edits:
        man = json.loads(json.dumps(original))
        edit(man)
        (ckpt / "manifest.json").write_text(json.dumps(man))  # checksum left as it was
        with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum"):
            safeckpt.load(ckpt, _state(1))
        report = safeckpt.verify(ckpt, deep=False)
        assert not report.ok and "checksum" in report.problems[0]
    # Whitespace is not an edit; the order of keys is (dicts come back in their saved order).
    (ckpt / "manifest.json").write_text(json.dumps(original, indent=2))
    assert safeckpt.verify(ckpt).ok
    safeckpt.load(ckpt, _state(1))
    (ckpt / "manifest.json").write_text(json.dumps(original, sort_keys=True))
    assert not safeckpt.verify(ckpt).ok


def test_dict_key_order_round_trips(tmp_path):
    tree = {"zeta": 1, "alpha": {"b": torch.ones(1), "a": 2}, "mid": [3, {"y": 1, "x": 2}]}
    safeckpt.save(tmp_path / "ck", {"tree": tree})
    back = safeckpt.read_state_dict(tmp_path / "ck", nested=True)["tree"]
    assert list(back) == ["zeta", "alpha", "mid"]
    assert list(back["alpha"]) == ["b", "a"] and list(back["mid"][1]) == ["y", "x"]


def test_signed_structural_damage_is_named(ckpt):
    """Edits with a recomputed checksum still fail, naming the field, before anything is read."""
    man = _manifest(ckpt)
    key = "model/0.weight"
    rec = man["tensors"][key]
    rec["chunks"].append(dict(rec["chunks"][0]))  # the same box twice: overlap
    _signed(ckpt, man)
    with pytest.raises(safeckpt.CorruptCheckpoint, match="overlap|hold"):
        safeckpt.read_state_dict(ckpt)
    man = _manifest(ckpt)
    man["tensors"][key]["chunks"] = man["tensors"][key]["chunks"][:1]
    man["world_size"] = "abc"
    _signed(ckpt, man)
    report = safeckpt.verify(ckpt)
    assert not report.ok and "world_size" in report.problems[0]
    # The manager lists it as damaged instead of raising.
    mgr_root = ckpt.parent / "root"
    mgr_root.mkdir()
    os.rename(ckpt, mgr_root / "step-0000000001")
    with safeckpt.CheckpointManager(mgr_root, preemption_signals=()) as mgr:
        assert mgr.list() == []


def test_symlinked_manifest_and_fifo_data_are_refused_without_blocking(ckpt, tmp_path):
    target = tmp_path / "copy.json"
    target.write_bytes((ckpt / "manifest.json").read_bytes())
    (ckpt / "manifest.json").unlink()
    os.symlink(target, ckpt / "manifest.json")
    with pytest.raises(safeckpt.CorruptCheckpoint, match="symlink"):
        safeckpt.read_state_dict(ckpt)
    os.unlink(ckpt / "manifest.json")
    os.rename(target, ckpt / "manifest.json")
    (ckpt / DATA).unlink()
    os.mkfifo(ckpt / DATA)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        calls = [
            pool.submit(safeckpt.read_state_dict, ckpt),
            pool.submit(safeckpt.load, ckpt, _state(1)),
            pool.submit(safeckpt.verify, ckpt),
        ]
        for call in calls[:2]:
            with pytest.raises(safeckpt.CorruptCheckpoint, match="FIFO"):
                call.result(timeout=20)  # a blocking open() would time out here
        report = calls[2].result(timeout=20)
        assert not report.ok and any("FIFO" in p for p in report.problems)


def test_oversized_manifest_is_refused(ckpt, monkeypatch):
    monkeypatch.setenv("SAFECKPT_MAX_MANIFEST_BYTES", "1000")
    with pytest.raises(safeckpt.CorruptCheckpoint, match="more than the 1000"):
        safeckpt.read_state_dict(ckpt)


def test_failed_load_leaves_state_unchanged(ckpt):
    man = _manifest(ckpt)
    # Damage the data of the LAST tensor read in place, so a load that copied as it verified
    # would already have overwritten the others.
    chunk = man["tensors"]["extra/t"]["chunks"][0]
    with open(ckpt / DATA, "r+b") as f:
        f.seek(chunk["start"])
        byte = f.read(1)
        f.seek(chunk["start"])
        f.write(bytes([byte[0] ^ 0xFF]))
    target = _state(5)
    before = _snapshot(target)
    with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum"):
        safeckpt.load(ckpt, target)
    assert _same(before, _snapshot(target))
    # A target that does not fit fails in the plan, also untouched.
    target["extra"]["t"] = torch.zeros(7, dtype=torch.int64)
    before = _snapshot(target)
    with pytest.raises(safeckpt.IncompatibleCheckpoint):
        safeckpt.load(ckpt, target)
    assert _same(before, _snapshot(target))


def test_any_string_key_round_trips(tmp_path):
    tree = {
        "a/b": torch.tensor([1.0]),
        "a": {"b": torch.tensor([2.0])},
        "a%2Fb": torch.tensor([3.0]),
        "x@0": torch.tensor([4.0]),
        "/ckpts/epoch=1.ckpt": {"score": torch.tensor(0.5), "path": "/ckpts/epoch=1.ckpt"},
        "100%": 1,
    }
    safeckpt.save(tmp_path / "ck", {"cb": tree})
    back = safeckpt.read_state_dict(tmp_path / "ck", nested=True)["cb"]
    assert set(back) == set(tree)
    for k in ("a/b", "a%2Fb", "x@0"):
        assert torch.equal(back[k], tree[k])
    assert torch.equal(back["a"]["b"], tree["a"]["b"])
    assert back["/ckpts/epoch=1.ckpt"]["path"] == "/ckpts/epoch=1.ckpt"
    flat = safeckpt.read_state_dict(tmp_path / "ck")
    assert torch.equal(flat["cb/a%2Fb"], tree["a/b"]) and torch.equal(flat["cb/a/b"], tree["a"]["b"])
    assert torch.equal(flat["cb/a%252Fb"], tree["a%2Fb"])
    target = {"cb": {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in tree.items()}}
    target["cb"]["a"] = {"b": torch.zeros(1)}
    target["cb"]["/ckpts/epoch=1.ckpt"] = {"score": torch.tensor(0.0), "path": ""}
    safeckpt.load(tmp_path / "ck", target)
    assert torch.equal(target["cb"]["a/b"], tree["a/b"]) and torch.equal(target["cb"]["a"]["b"], tree["a"]["b"])
    assert target["cb"]["/ckpts/epoch=1.ckpt"]["path"] == "/ckpts/epoch=1.ckpt"


class _DcpStyleOptimState:
    """What a DCP import of ``opt.state_dict()`` looked like: digit-string state keys."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.sd = opt.state_dict()

    def state_dict(self) -> dict:
        return {**self.sd, "state": {str(k): v for k, v in self.sd["state"].items()}}

    def load_state_dict(self, sd: dict) -> None:  # pragma: no cover - never loaded into
        raise AssertionError


def test_strict_load_refuses_optimizer_state_attached_to_no_parameter(tmp_path):
    src = _state(0)
    safeckpt.save(tmp_path / "ck", {"optim": _DcpStyleOptimState(src["optim"])})
    dst = _state(1)
    with pytest.raises(safeckpt.IncompatibleCheckpoint, match="no param group"):
        safeckpt.load(tmp_path / "ck", {"optim": dst["optim"]})


# ------------------------------------------------------------------ multi-process


def _per_rank_values(rank: int, world: int, root: str) -> dict:
    out = {}
    differing = {"cursor": torch.tensor([100 + rank])}
    out["plain"] = dist_harness.attempt(lambda: safeckpt.save(f"{root}/plain", differing))
    out["plain_written"] = os.path.exists(f"{root}/plain")
    wrapped = {"cursor": safeckpt.PerRank(torch.tensor([100 + rank])), "same": torch.tensor([7])}
    safeckpt.save(f"{root}/wrapped", wrapped)
    target = {"cursor": safeckpt.PerRank(torch.tensor([0])), "same": torch.tensor([0])}
    safeckpt.load(f"{root}/wrapped", target)
    out["restored"] = [int(target["cursor"].value.item()), int(target["same"].item())]
    # All-or-nothing across ranks: damage only rank 1's per-rank copy. Rank 0 could read its
    # own part, but must not apply it while rank 1 fails.
    if rank == 0:
        man = open_manifest(f"{root}/wrapped")  # format 3: chunk places from the files' indexes
        (chunk,) = [c for c in man["tensors"]["cursor/value"]["chunks"] if c["rank"] == 1]
        with open(f"{root}/wrapped/{chunk['file']}", "r+b") as f:
            f.seek(chunk["start"])
            f.write(b"\xff")
    torch.distributed.barrier()
    target = {"cursor": safeckpt.PerRank(torch.tensor([-1])), "same": torch.tensor([-1])}
    out["damaged"] = dist_harness.attempt(lambda: safeckpt.load(f"{root}/wrapped", target))
    out["after_damaged"] = [int(target["cursor"].value.item()), int(target["same"].item())]
    return out


def test_per_rank_plain_tensor_is_refused_or_kept_per_rank(tmp_path):
    outs = dist_harness.run(_per_rank_values, 2, str(tmp_path), timeout=120)
    for o in outs:
        assert o.ok, o.message
        v = o.value
        assert not v["plain"]["ok"] and "RankMismatch" in v["plain"]["mro"], v["plain"]
        assert "PerRank" in v["plain"]["msg"] and "cursor" in v["plain"]["msg"]
        assert not v["plain_written"]
        assert v["restored"] == [100 + o.rank, 7]
        assert not v["damaged"]["ok"] and "CorruptCheckpoint" in v["damaged"]["mro"], v["damaged"]
        assert v["after_damaged"] == [-1, -1]


def _ddp_batchnorm(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # each rank its own batch: BatchNorm running stats diverge
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
    mean = net[1].running_mean.clone()
    out = {"differs": None}
    gathered = [torch.zeros(8) for _ in range(world)]
    torch.distributed.all_gather(gathered, mean)
    out["differs"] = not torch.equal(gathered[0], gathered[1])
    safeckpt.save(f"{root}/bn", {"model": model, "optim": opt})
    saved = safeckpt.read_state_dict(f"{root}/bn")["model/1.running_mean"]
    out["saved_is_rank0s"] = torch.equal(saved, gathered[0])
    # broadcast_buffers=False: each rank keeps its own stats; saving them once would lose the
    # others', so the replica check refuses and says how to keep them.
    own = nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
    res = dist_harness.attempt(lambda: safeckpt.save(f"{root}/own", {"model": own}))
    out["own"] = [res["ok"], res.get("type"), "running_mean" in res.get("msg", "")]
    return out


def test_ddp_batchnorm_buffers_come_from_rank0(tmp_path):
    outs = dist_harness.run(_ddp_batchnorm, 2, str(tmp_path), timeout=120)
    for o in outs:
        assert o.ok, o.message
        assert o.value["differs"] is True  # the scenario is real
        assert o.value["saved_is_rank0s"] is True
        assert o.value["own"] == [False, "RankMismatch", True]


def test_large_edited_manifest_is_refused_before_parsing(ckpt):
    """An edited manifest too large to compare by content is refused from its bytes, without
    building its JSON in memory (a 24 MiB manifest of small records is ~10x that as objects)."""
    import tracemalloc

    man = _manifest(ckpt)
    man["metadata"]["junk"] = [{"a": i} for i in range(2_000_000)]  # ~24 MiB of JSON
    (ckpt / "manifest.json").write_text(json.dumps(man))
    tracemalloc.start()
    try:
        with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum"):
            safeckpt.read_state_dict(ckpt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 80 << 20, peak  # the raw bytes (and a copy), never the parsed objects


def test_device_fingerprint_detects_any_changed_word():
    """The replica digest used for accelerator tensors (no device-to-host copy of the data) is
    plain torch ops; on CPU here: equal tensors agree, any changed element or dtype view differs."""
    from safeckpt.engine.replicas import device_fingerprint

    t = torch.randn(1000, 7)
    base = device_fingerprint(t, block=1024)
    assert device_fingerprint(t.clone(), block=1024) == base
    for i in (0, 3500, 6999):
        u = t.clone().view(-1)
        u[i] += 1.0
        assert device_fingerprint(u.view(1000, 7), block=1024) != base
    odd = torch.arange(5, dtype=torch.uint8)  # not a multiple of 4 bytes: padded
    assert device_fingerprint(odd) != device_fingerprint(torch.arange(1, 6, dtype=torch.uint8))


def test_forged_object_without_tree_and_odd_param_ids_fail_cleanly(ckpt):
    """Found by the fuzzer with re-signed manifests: an object record without a tree, and an
    optimizer param id that is a list, must be CheckpointErrors, not KeyError/TypeError."""
    man = _manifest(ckpt)
    del man["objects"]["extra"]["tree"]
    man["tensors"].pop("extra/t")
    _signed(ckpt, man)
    assert not safeckpt.verify(ckpt).ok
    with pytest.raises(safeckpt.CorruptCheckpoint, match="no tree"):
        safeckpt.read_state_dict(ckpt)
    other = ckpt.parent / "other"
    safeckpt.save(other, _state(0))
    man = _manifest(other)
    man["objects"]["optim"]["tree"]["param_groups"][0]["params"][0] = [4]
    _signed(other, man)
    target = _state(1)
    before = _snapshot(target)
    with pytest.raises(safeckpt.IncompatibleCheckpoint, match="optim"):
        safeckpt.load(other, target)
    assert _same(before, _snapshot(target))


def _rich_manifest(tmp_path) -> dict:
    """A manifest with every kind of record: single-chunk tensors (0-d optimizer steps, an empty
    tensor, bf16), tied weights (aliases), per-rank state, nested trees, and (edited in) a
    tensor of three row chunks."""
    tied = nn.Module()
    tied.a = nn.Linear(3, 3, bias=False)
    tied.b = nn.Linear(3, 3, bias=False)
    tied.b.weight = tied.a.weight
    state = {**_state(0), "tied": tied, "rng": safeckpt.RNGState(),
             "tree": {"x": [torch.empty(0, 3), 2.5], "y": torch.ones(2, dtype=torch.bfloat16)},
             "big": torch.arange(12.0).view(6, 2)}
    safeckpt.save(tmp_path / "rich", state)
    man = _manifest(tmp_path / "rich")
    rec = man["tensors"]["big"]
    (c,) = rec["chunks"]
    rec["chunks"] = [{**c, "start": c["start"] + 16 * i, "end": c["start"] + 16 * (i + 1),
                      "offsets": [2 * i, 0], "sizes": [2, 2]} for i in range(3)]
    return man


def _outcome(man: dict) -> str:
    from safeckpt.format.manifest import dtype_size
    from safeckpt.format.validate import check_manifest

    try:
        check_manifest(man, "M", "ckpt", file_ok=lambda n: None, dtype_size=dtype_size)
    except safeckpt.CorruptCheckpoint as exc:
        return f"error: {exc}"
    return "ok"


def test_validation_fast_paths_agree_with_the_full_checks(tmp_path, monkeypatch):
    """The per-tensor and per-object checks have fast paths (no message built per field, for
    manifests of thousands of tensors). On any manifest, valid or edited, validation must give
    the same outcome and message without them."""
    import copy

    from safeckpt.format import validate as _validate
    from tests.helpers.fuzz_json import get, value_edits, walk

    base = _rich_manifest(tmp_path)

    def edited(path):  # a copy of base where the record ``path`` leads into may be edited
        part = path[0]
        return {**base, part: {**base[part], path[1]: copy.deepcopy(base[part][path[1]])}}

    extra = {"rank": 0, "rank_trees": {"1": {"@tensor": "big"}}, "alias_of": "big", "xxh3_64": "0" * 16}
    mutants = [base, {**base, "world_size": 2}, {**base, "world_size": 3}]  # per-rank copies missing
    for part in ("tensors", "objects", "files"):
        mutants += [{**base, part: new} for _, new in value_edits(base[part])]
        for path, value in walk(base[part], (part,)):
            if len(path) < 2 or any(isinstance(p, int) and p > 3 for p in path) or (part == "objects" and len(path) > 4):
                continue  # deep in object trees are plain values (the fast path sees objects' tops)
            for _, new in value_edits(value):
                m = edited(path)
                get(m, path[:-1])[path[-1]] = new
                mutants.append(m)
            if isinstance(path[-1], str) and len(path) > 2:  # a key of a record: drop it
                m = edited(path)
                del get(m, path[:-1])[path[-1]]
                mutants.append(m)
            if isinstance(value, dict):  # keys a record or chunk may have, added where it has not
                for k, v in extra.items():
                    if k not in value:
                        m = edited(path)
                        get(m, path)[k] = v
                        mutants.append(m)
    fast = [_outcome(m) for m in mutants]
    monkeypatch.setattr(_validate, "_tensor_ok", lambda *a: False)
    monkeypatch.setattr(_validate, "_single_ref", lambda obj: None)
    full = [_outcome(m) for m in mutants]
    assert fast[0] == "ok" and sum(o != "ok" for o in full) > 500, len(mutants)
    bad = [(i, f, s) for i, (f, s) in enumerate(zip(fast, full, strict=True)) if f != s]
    assert not bad, bad[:5]


def _entries_load(rank: int, world: int, path: str) -> dict:
    """strict="entries" on 2 ranks: the model alone from a training checkpoint; then a model
    of another shape, which must be refused with model and optimizer untouched."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    safeckpt.load(path, {"model": model}, strict="entries")  # "optim" and "step" left out
    saved = torch.load(path + ".ref.pt")
    loaded = torch.equal(model.weight, saved["weight"]) and torch.equal(model.bias, saved["bias"])
    wide = nn.Linear(8, 5)
    opt = torch.optim.SGD(wide.parameters(), lr=0.1)
    before = [p.detach().clone() for p in wide.parameters()]
    error = ""
    try:
        safeckpt.load(path, {"model": wide, "optim": opt}, strict="entries")
    except safeckpt.IncompatibleCheckpoint as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, b) for a, b in zip(wide.parameters(), before, strict=True))
    return {"loaded": loaded, "error": error, "unchanged": unchanged and not opt.state_dict()["state"]}


@pytest.mark.timeout(120)
def test_strict_entries_loads_a_subset_exactly_and_refuses_before_changing_anything(tmp_path):
    torch.manual_seed(1)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    path = str(tmp_path / "ck")
    safeckpt.save(path, {"model": model, "optim": opt, "step": 3})
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path + ".ref.pt")
    out = dist_harness.run(_entries_load, 2, path, timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        assert o.value["loaded"]
        assert "does not fit" in o.value["error"] and "model/weight" in o.value["error"], o.value
        assert "Nothing was loaded" in o.value["error"] and o.value["unchanged"]
    with pytest.raises(ValueError, match="strict must be"):
        safeckpt.load(path, {"model": model}, strict="entry")  # type: ignore[arg-type]
    with pytest.raises(safeckpt.IncompatibleCheckpoint, match="unexpected entry 'optim'"):
        safeckpt.load(path, {"model": model, "step": 0})  # strict=True still wants every entry


# ------------------------------------------------------ issue 27: items 5 and 11 (sizes)


def _boxes_manifest(tmp_path, boxes: list[list], shape: list[int]) -> bytes:
    """A signed format-3 manifest whose one tensor is stored as explicit ``boxes``."""
    safeckpt.save(tmp_path / "ck", {"w": torch.zeros(1)})
    man = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    rec = man["tensors"]["w"]
    rec.pop("pieces", None)
    rec.update(scope="sharded", shape=shape, boxes=boxes)
    return encode_manifest({k: v for k, v in man.items() if k != CHECKSUM_FIELD})


@pytest.mark.parametrize("k", [6000, 20000])
def test_a_manifest_of_many_boxes_validates_in_linear_time_and_bad_tilings_are_refused(tmp_path, k):
    """Boxes sharing offsets[0] were compared pairwise: 6,000 took 67 s, 8,000 70 s."""
    import time

    from safeckpt.format.manifest import parse_manifest

    cases = {
        "exact": [[0, [0, j], [1, 1]] for j in range(k)],
        # the same volume as the tensor: one box twice, one missing (only the box check sees it)
        "overlap": [[0, [0, j], [1, 1]] for j in range(k) if j != k // 2] + [[0, [0, k // 2 + 1], [1, 1]]],
        "overlap2": [[0, [0, 0], [1, k // 2 + 1]], [0, [0, k // 2], [1, k // 2 - 1]]],  # two halves meeting
        "gap": [[0, [0, j], [1, 1]] for j in range(k) if j != k // 2],  # fewer elements
        "grid": [[0, [i, j], [1, k // 100]] for i in range(100) for j in range(0, k, k // 100)],
    }
    for name, boxes in cases.items():
        shape = [100, k] if name == "grid" else [1, k]
        raw = _boxes_manifest(tmp_path / name, boxes, shape)
        t0 = time.perf_counter()
        if name in ("exact", "grid"):
            man = parse_manifest(raw, str(tmp_path / name / "ck"))
            assert len(man["tensors"]["w"]["boxes"]) == len(boxes)
        else:
            with pytest.raises(safeckpt.CorruptCheckpoint, match="overlap or leave a gap" if "overlap" in name
                               else "elements"):
                parse_manifest(raw, str(tmp_path / name / "ck"))
        elapsed = time.perf_counter() - t0
        assert elapsed < 5, (name, k, elapsed)


def test_an_index_larger_than_the_manifest_allows_is_refused_before_it_is_read(tmp_path):
    """A 32 MiB JSON index (valid, re-signed) cost +771 MiB RSS when parsed; a forged 256 MiB
    one ~6 GB on every rank. Its size is bounded by the chunks the manifest places in the file."""
    import tracemalloc

    import xxhash

    path = tmp_path / "ck"
    safeckpt.save(path, {"w": torch.arange(8.0)})
    man = json.loads((path / "manifest.json").read_text())
    rec = man["files"][DATA]
    start, end, _ = rec["index"]
    data = (path / DATA).read_bytes()
    idx = json.loads(data[start:end])
    idx["trees"] = {"pad": list(range(4_000_000))}  # ~31 MiB of JSON
    text = json.dumps(idx, separators=(",", ":")).encode()
    new = data[:start] + text
    rec.update(size=len(new), index=[start, start + len(text), xxhash.xxh3_64_hexdigest(text)],
               xxh3_128=xxhash.xxh3_128_hexdigest(new))
    (path / DATA).write_bytes(new)
    (path / "manifest.json").write_bytes(encode_manifest({k: v for k, v in man.items() if k != CHECKSUM_FIELD}))
    del data, new, text, idx
    target = {"w": torch.zeros(8)}
    tracemalloc.start()
    try:
        with pytest.raises(safeckpt.CorruptCheckpoint, match="index of .* bytes, more than"):
            safeckpt.load(path, target)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the index was never read, let alone parsed
    assert torch.equal(target["w"], torch.zeros(8))
    assert not safeckpt.verify(path).ok
