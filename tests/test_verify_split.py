"""Ranks of one machine share the verification of replicated chunks (src/safeckpt/coord/verify_split.py).

Each chunk is hashed by one rank that reads it through the same page cache; a corrupt chunk
still fails the load on every rank, with every rank's state unchanged, including ranks that
did not hash that chunk themselves. Ranks that do not share a page cache verify everything.
"""

from __future__ import annotations

import pytest
import torch

import safeckpt
from safeckpt.coord.verify_split import page_cache_id, shares_complete, split_shared
from safeckpt.engine.reader import open_manifest
from tests.helpers import dist_harness

DATA = "rank-00000.safetensors"


def test_each_shared_chunk_is_verified_by_exactly_one_local_rank():
    shared = [(("f", i, i + n), n) for i, n in enumerate([100, 5, 60, 60, 1, 30])]
    splits = [split_shared(shared, r, 3) for r in range(3)]
    mine = [m for m, _ in splits]
    assert sorted(c for m in mine for c in m) == sorted(c for c, _ in shared)  # each exactly once
    for m, others in splits:
        assert sorted(m + others) == sorted(c for c, _ in shared)
    loads = [sum(n for c, n in shared if c in m) for m in mine]
    assert max(loads) - min(loads) <= 100, loads  # spread, largest first
    assert [split_shared(shared, r, 3) for r in range(3)] == splits  # the same on every rank


def test_a_split_counts_only_when_the_whole_machine_took_part_with_the_same_chunks():
    def share(cache, local, n, digest="d"):
        return {"cache": cache, "local": [local, n], "shared": digest}

    assert shares_complete([share("A", 0, 2), share("A", 1, 2), share("B", 0, 1)])
    assert shares_complete([share("A", 0, 2), share("A", 1, 2), None])  # a rank that shared nothing
    assert not shares_complete([share("A", 0, 2), share("B", 1, 2)])  # LOCAL_* say one machine, caches two
    assert not shares_complete([share("A", 0, 2), share("A", 1, 2, "other")])  # different chunk lists
    assert not shares_complete([share("A", 0, 3), share("A", 1, 3)])  # a local rank missing


def test_page_cache_id_names_the_directory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = page_cache_id(str(tmp_path / "a"))
    assert a is not None and a == page_cache_id(str(tmp_path / "a"))
    assert a != page_cache_id(str(tmp_path / "b"))
    assert page_cache_id(str(tmp_path / "missing")) is None


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": {f"t{i}": torch.randn(64, 256, generator=g) for i in range(8)}}


def _load_counting(rank: int, world: int, path: str, split_hosts: bool) -> dict:
    """Load into a state of other values; report which chunks this rank hashed, and whether
    the state is the saved one or unchanged."""
    import safeckpt.engine.load as load_mod
    import safeckpt.engine.reader as reader

    if split_hosts:  # pretend every rank is on its own machine
        load_mod.page_cache_id = lambda d, r=rank: f"host-{r}"
    hashed = []
    orig = reader.TensorReader._compare

    def counting(self, key, c, digest):  # every chunk hashed is compared here, by any read path
        hashed.append((c["start"], c["end"]))
        return orig(self, key, c, digest)

    reader.TensorReader._compare = counting
    state = _state(99)
    before = {k: v.clone() for k, v in state["w"].items()}
    error = None
    try:
        safeckpt.load(path, state)
    except safeckpt.CheckpointError as exc:
        error = type(exc).__name__
    saved = _state(1)["w"]
    return {
        "hashed": sorted(hashed),
        "error": error,
        "unchanged": all(torch.equal(state["w"][k], before[k]) for k in before),
        "loaded": all(torch.equal(state["w"][k], saved[k]) for k in saved),
    }


def _save(tmp_path) -> str:
    path = tmp_path / "ck"
    safeckpt.save(path, _state(1))
    return str(path)


def _chunks(path: str) -> list[tuple[int, int]]:
    man = open_manifest(path)  # format 3: chunks from the files' indexes
    return sorted((c["start"], c["end"]) for rec in man["tensors"].values() for c in rec["chunks"])


@pytest.mark.timeout(120)
def test_two_ranks_of_one_machine_split_the_hashing(tmp_path):
    path = _save(tmp_path)
    out = dist_harness.run(_load_counting, 2, path, False, timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    a, b = (o.value for o in out)
    assert a["loaded"] and b["loaded"] and a["error"] is None is b["error"]
    assert a["hashed"] and b["hashed"] and not set(a["hashed"]) & set(b["hashed"])
    assert sorted(a["hashed"] + b["hashed"]) == _chunks(path)


@pytest.mark.timeout(120)
def test_ranks_without_a_shared_page_cache_each_verify_everything(tmp_path):
    path = _save(tmp_path)
    out = dist_harness.run(_load_counting, 2, path, True, timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        assert o.value["loaded"] and o.value["hashed"] == _chunks(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", [0, -1])
def test_a_chunk_only_the_other_rank_hashed_still_fails_the_load_everywhere(tmp_path, which):
    path = _save(tmp_path)
    start, end = _chunks(path)[which]
    with open(f"{path}/{DATA}", "r+b") as f:
        f.seek((start + end) // 2)
        b = f.read(1)
        f.seek((start + end) // 2)
        f.write(bytes([b[0] ^ 0x20]))
    out = dist_harness.run(_load_counting, 2, path, False, timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    hashers = [o.rank for o in out if any(s == start for s, _ in o.value["hashed"])]
    assert len(hashers) == 1  # exactly one rank hashed the damaged chunk ...
    for o in out:  # ... and both refuse the checkpoint with their state untouched
        assert o.value["error"] == "CorruptCheckpoint", o.value
        assert o.value["unchanged"]


def _trained(seed: int, steps: int) -> dict:
    """A model and an AdamW optimizer after ``steps`` steps (0: no optimizer state yet)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
    return {"model": model, "optim": opt}


def _load_optim_counting(rank: int, world: int, path: str) -> dict:
    """Load into a fresh model and optimizer (the optimizer's state is read into new tensors):
    which chunks this rank hashed, and whether the state is the saved one or unchanged."""
    import safeckpt.engine.reader as reader

    hashed = []
    orig = reader.TensorReader._compare

    def counting(self, key, c, digest):
        hashed.append((c["start"], c["end"]))
        return orig(self, key, c, digest)

    reader.TensorReader._compare = counting
    state = _trained(5, 0)
    before = [p.detach().clone() for p in state["model"].parameters()]
    error = None
    try:
        safeckpt.load(path, state)
    except safeckpt.CheckpointError as exc:
        error = type(exc).__name__
    want = _trained(1, 2)["optim"].state_dict()["state"]
    got = state["optim"].state_dict()["state"]
    return {
        "hashed": sorted(hashed), "error": error,
        "unchanged": not got and all(torch.equal(a, b) for a, b in zip(state["model"].parameters(), before)),
        "loaded": got.keys() == want.keys() and all(torch.equal(got[i][k], want[i][k]) for i in want for k in want[i]),
    }


def _save_trained(tmp_path) -> str:
    path = str(tmp_path / "ck")
    safeckpt.save(path, _trained(1, 2))
    return path


@pytest.fixture(scope="module")
def trained_load(tmp_path_factory) -> tuple[str, list]:
    """A saved model + AdamW and one clean 2-rank load of it (what each rank hashed)."""
    path = _save_trained(tmp_path_factory.mktemp("trained"))
    return path, dist_harness.run(_load_optim_counting, 2, path, timeout=90)


@pytest.mark.timeout(120)
def test_optimizer_state_read_into_new_tensors_is_hashed_by_one_rank(trained_load):
    path, out = trained_load
    assert all(o.ok for o in out), [o.message for o in out]
    a, b = (o.value for o in out)
    assert a["loaded"] and b["loaded"] and a["error"] is None is b["error"]
    assert not set(a["hashed"]) & set(b["hashed"])
    big = [c for c in _chunks(path) if c[1] - c[0] >= 128 * 64 * 4]  # exp_avg/exp_avg_sq of the weights
    assert len(big) >= 4 and set(big) <= set(a["hashed"]) | set(b["hashed"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1])
def test_optimizer_chunk_hashed_by_the_other_rank_still_fails_everywhere(trained_load, tmp_path, rank):
    import shutil

    clean_path, clean = trained_load
    assert all(o.ok for o in clean), [o.message for o in clean]
    path = str(tmp_path / "ck")
    shutil.copytree(clean_path, path)
    big = [c for c in _chunks(path) if c[1] - c[0] >= 128 * 64 * 4]
    start, end = next(c for c in big if c in clean[rank].value["hashed"])  # rank `rank` hashes it
    with open(f"{path}/{DATA}", "r+b") as f:
        f.seek((start + end) // 2)
        b = f.read(1)
        f.seek((start + end) // 2)
        f.write(bytes([b[0] ^ 0x20]))
    out = dist_harness.run(_load_optim_counting, 2, path, timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:  # the other rank read those bytes unhashed; both refuse, state untouched
        assert o.value["error"] == "CorruptCheckpoint", o.value
        assert o.value["unchanged"], o.value


def test_reader_threads_shrink_with_the_ranks_on_one_machine(monkeypatch):
    from safeckpt.engine import reader as _reader

    monkeypatch.setattr(_reader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert [_reader.read_threads(n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    monkeypatch.setattr(_reader.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert _reader.read_threads(8) == _reader.READ_THREADS
