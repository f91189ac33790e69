"""The restore pick on an object store: it stops at the newest checkpoint that verifies.

A root of 20 kept checkpoints of 64 files each (``memory://``, one process; the files are
copies of one real rank file listed under 64 rank names in a re-sealed format-3 manifest, so
each checkpoint looks like a 64-rank one to the pick). Every storage call is counted by the
path it touches. Before, the pick verified every checkpoint: each manifest read twice and two
HEADs per file, one after another (2,562 lookups here; ~41,000 serial HEADs for 20 x 1,024
files on S3, past the timeout at every restart).
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
import warnings

import fsspec
import pytest
import torch

import safeckpt
from safeckpt.format.manifest import MANIFEST, encode_manifest
from safeckpt.storage.base import storage_for
from safeckpt.storage.fsspec_store import FsspecStorage

FILES = 64
STEPS = 20


def _state(value: float) -> dict:
    return {"m": {"w": torch.full((4,), value)}, "v": value}


def _build(root: str, steps=range(1, STEPS + 1), files: int = FILES) -> None:
    fs = fsspec.filesystem("memory")
    for s in steps:
        ckpt = f"{root}/step-{s:010d}"
        safeckpt.save(ckpt, _state(float(s)))
        man = json.loads(fs.cat_file(f"{ckpt}/{MANIFEST}"))
        assert man["format_version"] == 3
        ((name, rec),) = man["files"].items()
        data = fs.cat_file(f"{ckpt}/{name}")
        man.update(world_size=files, step=s)
        man["files"] = {}
        for r in range(files):
            other = name.replace("rank-00000", f"rank-{r:05d}")
            man["files"][other] = {**rec, "rank": r}
            if r:
                fs.pipe_file(f"{ckpt}/{other}", data)
        man.pop("manifest_xxh3_128")
        fs.pipe_file(f"{ckpt}/{MANIFEST}", encode_manifest(man))


class _Counter:
    """Counts FsspecStorage's size/read/fetch/list calls by the checkpoint directory they touch."""

    def __init__(self, monkeypatch, root: str) -> None:
        self.root = root
        self.calls: collections.Counter = collections.Counter()
        self.by_step: collections.Counter = collections.Counter()
        for meth in ("size", "read", "fetch", "list", "read_manifest"):
            real = getattr(FsspecStorage, meth)

            def counted(store, path, *args, _meth=meth, _real=real, **kwargs):
                self.calls[_meth] += 1
                rel = path[len(self.root) + 1 :] if path.startswith(self.root + "/") else ""
                if rel.startswith("step-") and _meth != "read_manifest":
                    self.by_step[int(rel.split("/")[0][5:])] += 1
                return _real(store, path, *args, **kwargs)

            monkeypatch.setattr(FsspecStorage, meth, counted)

    def reset(self) -> None:
        self.calls.clear()
        self.by_step.clear()


@pytest.fixture
def root():
    bucket = f"/pick-{uuid.uuid4().hex[:8]}"
    yield f"memory:/{bucket}/run"
    fs = fsspec.filesystem("memory")  # dropped directly: fs.rm of 1,300 objects takes seconds
    for key in [k for k in fs.store if k.startswith(bucket + "/")]:
        del fs.store[key]
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not (d == bucket or d.startswith(bucket + "/"))]


def test_restore_looks_at_one_checkpoint_of_twenty(root, monkeypatch):
    _build(root)
    count = _Counter(monkeypatch, root)
    st = _state(0.0)
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        assert mgr.restore(st) == STEPS
    assert st["v"] == float(STEPS) and torch.equal(st["m"]["w"], torch.full((4,), float(STEPS)))
    # Only the newest checkpoint was touched: one lookup per file for the pick, the files the
    # load opens, and its manifest read once by the pick and once by the load.
    assert set(count.by_step) == {STEPS}, count.by_step
    assert count.calls["size"] <= 2 * FILES, count.calls
    assert count.calls["read"] <= 2 and count.calls["read_manifest"] <= 2, count.calls
    assert count.calls["list"] <= 2, count.calls  # the root, listed once (plus the lease's look)


def test_older_checkpoints_are_judged_only_when_newer_ones_fail(root, monkeypatch):
    _build(root)
    fs = fsspec.filesystem("memory")
    # The newest lost a file (the pick's check sees it); the next one has the right sizes but
    # corrupt bytes (only its load can tell): the restore falls back to the third.
    newest = f"{root}/step-{STEPS:010d}"
    fs.rm_file(f"{newest}/{sorted(n for n in fs.ls(newest, detail=False) if 'rank-00007' in n)[0].rsplit('/', 1)[1]}")
    second = f"{root}/step-{STEPS - 1:010d}"
    rank0 = [n for n in fs.ls(second, detail=False) if "rank-00000" in n][0]
    data = bytearray(fs.cat_file(rank0))
    man = json.loads(fs.cat_file(f"{second}/{MANIFEST}"))
    start = next(iter(man["files"].values()))["data"]
    data[start] ^= 0x10  # the first byte of the tensor data: a checksum mismatch on load
    fs.pipe_file(rank0, bytes(data))
    count = _Counter(monkeypatch, root)
    st = _state(0.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
            assert mgr.restore(st) == STEPS - 2
    assert st["v"] == float(STEPS - 2)
    said = " | ".join(str(w.message) for w in seen)
    assert f"step {STEPS}" in said and "missing file" in said, said
    assert f"step {STEPS - 1}" in said and "corrupt" in said, said
    assert set(count.by_step) == {STEPS, STEPS - 1, STEPS - 2}, count.by_step
    assert count.calls["size"] <= 3 * 2 * FILES, count.calls


def test_resume_candidates_verifies_each_older_one_only_when_reached(root, monkeypatch):
    _build(root, steps=range(1, 4), files=8)
    count = _Counter(monkeypatch, root)
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        candidates, reasons = mgr.resume_candidates()
        assert candidates and reasons == []
        assert set(count.by_step) == {3}
        it = iter(candidates)
        assert next(it)[0] == 3 and set(count.by_step) == {3}
        # The caller's load of step 3 failed: the next one is verified now, not before.
        fs = fsspec.filesystem("memory")
        fs.rm_file([n for n in fs.ls(f"{root}/step-0000000002", detail=False) if "rank-00003" in n][0])
        with pytest.warns(safeckpt.SafeckptWarning, match="missing file"):
            assert next(it)[0] == 1
        assert set(count.by_step) == {1, 2, 3}
        assert len(reasons) == 1 and "step 2" in reasons[0] and "missing file" in reasons[0], reasons
        assert list(it) == []


def test_an_explicit_step_touches_only_that_checkpoint(root, monkeypatch):
    _build(root, steps=range(1, 6), files=4)
    count = _Counter(monkeypatch, root)
    st = _state(0.0)
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        assert mgr.restore(st, step=2) == 2
        with pytest.raises(safeckpt.CheckpointNotFound):
            mgr.restore(st, step=77)
    assert st["v"] == 2.0 and set(count.by_step) == {2}, count.by_step


def test_checkpoint_files_are_deleted_concurrently(root, monkeypatch):
    store = storage_for(root)
    ckpt = f"{root}/step-0000000001"
    for i in range(32):
        store.put(f"{ckpt}/rank-{i:05d}.0123456789ab.safetensors", b"x")
    store.put(f"{ckpt}/{MANIFEST}", b"{}")
    active, most, order = [0], [0], []
    lock = threading.Lock()
    real = FsspecStorage.delete

    def slow(self, path):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
            order.append(path.rsplit("/", 1)[1])
        time.sleep(0.02)
        real(self, path)
        with lock:
            active[0] -= 1

    monkeypatch.setattr(FsspecStorage, "delete", slow)
    store.delete_tree(ckpt)
    assert order[0] == MANIFEST  # alone and first: the checkpoint stops being committed at once
    assert 1 < most[0] <= 8, most  # the rest at once, bounded
    assert store.list(ckpt) is None


def test_retention_on_an_object_store_deletes_in_bulk(root, monkeypatch):
    """Retention removes a committed checkpoint's objects with one delete_many (S3 DeleteObjects
    batches; concurrent elsewhere) after its manifest, not one request per object."""
    from safeckpt.storage.fsspec_store import FsspecStorage

    calls: list[list[str]] = []
    real = FsspecStorage.delete_many

    def counting(self, paths):
        paths = list(paths)
        calls.append(paths)
        return real(self, paths)

    monkeypatch.setattr(FsspecStorage, "delete_many", counting)
    extra = {"a.json": b"{}", "b.json": b"[]"}
    with safeckpt.CheckpointManager(root, keep_last=1, preemption_signals=()) as mgr:
        mgr.save(1, _state(1.0), extra_files=extra)
        mgr.save(2, _state(2.0), extra_files=extra)
        assert [c.step for c in mgr.list()] == [2]
    bulk = [c for c in calls if any("step-0000000001" in p for p in c)]
    # one request for the data file and both extra files (the manifest went first, alone)
    assert len(bulk) == 1 and len(bulk[0]) >= 3, calls
