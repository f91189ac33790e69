"""A read that fails for a reason that can pass (out of descriptors, an I/O error, a stale NFS
handle) is not evidence of damage (issue 27, item 4).

Before: every OSError of opening a data file but ELOOP/EACCES/EPERM was CorruptCheckpoint, so
one EMFILE on a file of step 200 made ``restore`` fall back to step 100 ("step 200 is
corrupt"), and a DDP load holding one descriptor per data file made every checkpoint look
corrupt under a 1,024 ``ulimit -n`` at ~1,000 ranks. Now such an error is tried again a few
times and then raised as ``StorageUnavailable`` (a ``StorageError``) on every rank, never a
fallback, and a reader keeps only a bounded number of data files open.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import safeckpt
from safeckpt.storage.base import StorageError
from tests.helpers import dist_harness


def _failing_open(match: str, err: int, times: int | None = None):
    """An ``os.open`` that raises ``err`` for paths containing ``match`` (``times`` times, or
    always), and a list that records each failure."""
    real = os.open
    failed: list[str] = []

    def fake(path, flags, *args, **kwargs):
        if match in os.fspath(path) and (times is None or len(failed) < times):
            failed.append(os.fspath(path))
            raise OSError(err, os.strerror(err), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    return fake, failed


def _two_steps(root) -> None:
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(100, {"w": torch.full((64,), 1.0)})
        mgr.save(200, {"w": torch.full((64,), 2.0)})


@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENFILE, errno.EIO, errno.ESTALE])
def test_a_transient_open_error_is_a_storage_error_and_restore_does_not_fall_back(tmp_path, monkeypatch, err):
    _two_steps(tmp_path)
    fake, failed = _failing_open("step-0000000200" + os.sep + "rank-", err)
    monkeypatch.setattr(os, "open", fake)
    state = {"w": torch.zeros(64)}
    with safeckpt.CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        with pytest.raises(StorageError) as info:
            mgr.restore(state)
    assert not isinstance(info.value, safeckpt.CorruptCheckpoint)
    assert info.value.exit_code == 74 and "says nothing about the checkpoint" in str(info.value)
    assert len(failed) >= 2  # tried again before giving up
    assert torch.equal(state["w"], torch.zeros(64))  # nothing loaded, no fallback to step 100


def test_an_open_error_that_passes_is_retried_and_the_newest_step_loads(tmp_path, monkeypatch):
    _two_steps(tmp_path)
    fake, failed = _failing_open("step-0000000200" + os.sep + "rank-", errno.EMFILE, times=2)
    monkeypatch.setattr(os, "open", fake)
    state = {"w": torch.zeros(64)}
    with safeckpt.CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        assert mgr.restore(state) == 200
    assert len(failed) == 2 and torch.equal(state["w"], torch.full((64,), 2.0))


def test_damage_is_still_corrupt_and_restore_falls_back(tmp_path):
    _two_steps(tmp_path)
    (tmp_path / "step-0000000200" / "rank-00000.safetensors").unlink()  # a missing file is damage
    state = {"w": torch.zeros(64)}
    with pytest.warns(safeckpt.SafeckptWarning), \
            safeckpt.CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        assert mgr.restore(state) == 100
    assert torch.equal(state["w"], torch.full((64,), 1.0))


def test_an_io_error_while_reading_is_retried_then_a_storage_error(tmp_path, monkeypatch):
    from safeckpt.format.shardfile import MappedFile

    safeckpt.save(tmp_path / "ck", {"w": torch.arange(1000.0)})
    path = str(tmp_path / "ck" / "rank-00000.safetensors")
    f = MappedFile(path, os.path.getsize(path))
    real = os.preadv
    calls = []

    def eio(fd, bufs, at, *args):
        calls.append(at)
        if fd == f.fd and len(calls) <= 2:  # fails twice, then reads
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, at, *args)

    monkeypatch.setattr(os, "preadv", eio)
    try:
        assert len(f.read(0, 64)) == 64 and len(calls) == 3
        calls.clear()
        monkeypatch.setattr(os, "preadv", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
        with pytest.raises(safeckpt.errors.StorageUnavailable, match="Input/output error") as info:
            f.read(0, 64)
        assert isinstance(info.value, StorageError) and info.value.errno == errno.EIO
    finally:
        f.close()


# ------------------------------------------------------------------------- 2 real ranks


def _restore_with_fault(rank: int, world: int, root: str, err: int, fault_rank: int) -> dict:
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(100, {"w": torch.full((64,), 1.0)})
        mgr.save(200, {"w": torch.full((64,), 2.0)})
    if rank == fault_rank:
        fake, _ = _failing_open("step-0000000200" + os.sep + "rank-", err)
        os.open = fake
    state = {"w": torch.zeros(64)}
    mgr = safeckpt.CheckpointManager(root, preemption_signals=())
    out = dist_harness.attempt(lambda: mgr.restore(state))
    out["unchanged"] = torch.equal(state["w"], torch.zeros(64))
    mgr.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("err,fault_rank", [(errno.EMFILE, 1), (errno.EIO, 0)])
def test_an_injected_error_on_one_rank_is_a_storage_error_on_every_rank_not_a_fallback(tmp_path, err, fault_rank):
    out = dist_harness.run(_restore_with_fault, 2, str(tmp_path), err, fault_rank, timeout=180)
    for o in out:
        assert o.ok, o.message
        v = o.value
        assert not v["ok"], v  # before: restore fell back and returned 100
        assert "StorageError" in v["mro"] and "CorruptCheckpoint" not in v["mro"], v
        assert f"rank {fault_rank}" in v["msg"], v["msg"]
        assert v["unchanged"], v


# -------------------------------------------------------------- a low open-file limit


def _sharded_save(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = torch.arange(rank * 8.0, rank * 8.0 + 8).reshape(2, 4)
    safeckpt.save(f"{root}/ck", {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)})


def _load_under_low_limit(rank: int, world: int, root: str, headroom: int) -> dict:
    import resource

    safeckpt.save(f"{root}/warm-{world}", {"x": torch.zeros(1)})  # the checkpoint group exists now
    used = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + headroom, hard))
    target = {"w": torch.zeros(16, 4)}
    out = dist_harness.attempt(lambda: safeckpt.load(f"{root}/ck", target))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    out["exact"] = torch.equal(target["w"], torch.arange(64.0).reshape(16, 4))
    return out


@pytest.mark.timeout(400)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_load_reading_more_files_than_descriptors_left_succeeds(tmp_path):
    """8 data files, each rank reading all of them, with 5 descriptors left per rank."""
    out = dist_harness.run(_sharded_save, 8, str(tmp_path), timeout=240)
    assert all(o.ok for o in out), [o.message for o in out]
    assert len([n for n in os.listdir(tmp_path / "ck") if n.startswith("rank-")]) == 8
    out = dist_harness.run(_load_under_low_limit, 2, str(tmp_path), 5, timeout=150)
    for o in out:
        assert o.ok, o.message
        assert o.value["ok"] and o.value["exact"], o.value


def test_a_reader_keeps_at_most_max_open_files_open(tmp_path, monkeypatch):
    """The bound itself, single process: six data files read whole, at most two open at once."""
    import json
    import shutil

    from safeckpt.engine import reader as reader_mod
    from safeckpt.format import shardfile

    ck = tmp_path / "ck"
    safeckpt.save(ck, {f"t{i}": torch.full((8,), float(i)) for i in range(6)})
    (name, rec), = json.loads((ck / "manifest.json").read_text())["files"].items()
    for r in range(1, 6):  # the one data file under five more names: tensor i is read from file i
        shutil.copy(ck / name, ck / f"rank-{r:05d}.safetensors")
    view = reader_mod.open_manifest(str(ck))
    view["files"] = {f"rank-{r:05d}.safetensors": {**rec, "rank": r} for r in range(6)}
    for i, key in enumerate(sorted(view["tensors"])):
        for c in view["tensors"][key]["chunks"]:
            c["file"] = f"rank-{i:05d}.safetensors"
    opened, live, peak = [], set(), [0]
    real_init, real_close = shardfile.MappedFile.__init__, shardfile.MappedFile.close

    def init(self, path, size):
        real_init(self, path, size)
        opened.append(path)
        live.add(id(self))
        peak[0] = max(peak[0], len(live))

    def close(self):
        live.discard(id(self))
        real_close(self)

    monkeypatch.setattr(shardfile.MappedFile, "__init__", init)
    monkeypatch.setattr(shardfile.MappedFile, "close", close)
    monkeypatch.setattr(reader_mod, "MAX_OPEN_FILES", 2)
    reader = reader_mod.TensorReader(str(ck), view)
    # One reading thread: with T of them, T files can be in use at once and files in use stay
    # open, so the bound is max(MAX_OPEN_FILES, T) (CI's 2 cores: 4 threads, a peak of 3 seen).
    reader.threads = 1
    out = reader.new_many(sorted(view["tensors"]))
    reader.close()
    assert {k: float(v[0]) for k, v in out.items()} == {f"t{i}": float(i) for i in range(6)}
    assert len(set(opened)) == 6 and peak[0] <= 2, (opened, peak)


class _Sampler:
    """A data position kept per rank: empty on rank 0, long on rank 1 (a legitimate per-rank
    tree far larger than rank 0's)."""

    def __init__(self, rank: int, n: int) -> None:
        self.seen = list(range(n)) if rank == 1 else []

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.seen = sd["seen"]


def _large_rank_tree(rank: int, world: int, root: str, n: int) -> dict:
    import safeckpt

    path = os.path.join(root, "ck")
    safeckpt.save(path, {"w": torch.ones(4), "sampler": _Sampler(rank, n)}, timeout=60)
    target = _Sampler(0, 0)
    target.seen = None
    safeckpt.load(path, {"w": torch.zeros(4), "sampler": target}, timeout=60)
    report = safeckpt.verify(path)
    return {"loaded": len(target.seen), "verify": (report.ok, report.problems[:2])}


def test_a_rank_tree_larger_than_rank_0s_is_not_taken_for_a_forged_index(tmp_path):
    """The index bound (item 11) must not refuse a legitimate checkpoint whose rank 1 keeps a
    1.4 MB tree of its own while rank 0's is empty (it did: CorruptCheckpoint on every rank, and
    a manager's restore fell back to the older step)."""
    n = 200_000
    outs = dist_harness.run(_large_rank_tree, 2, str(tmp_path), n, timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        assert o.value["verify"][0], o.value["verify"]
    assert outs[1].value["loaded"] == n and outs[0].value["loaded"] == 0


def _steps_100_and_200(root) -> None:
    with safeckpt.CheckpointManager(str(root), keep_last=None, preemption_signals=()) as mgr:
        mgr.save(100, {"w": torch.full((4,), 1.0)})
        mgr.save(200, {"w": torch.full((4,), 2.0)})


@pytest.mark.parametrize("err", [errno.EMFILE, errno.EIO, errno.ESTALE])
def test_a_transient_error_on_the_manifest_is_no_fallback(tmp_path, monkeypatch, err):
    """The restore pick read a StorageUnavailable opening step 200's manifest as 'corrupt' and
    fell back to step 100 (found by review): the storage failed, not the checkpoint."""
    _steps_100_and_200(tmp_path)
    real = os.open

    def failing(path, flags, *args, **kwargs):
        p = os.fspath(path)
        if "step-0000000200" in p and p.endswith("manifest.json"):
            raise OSError(err, os.strerror(err), p)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing)
    state = {"w": torch.zeros(4)}
    with safeckpt.CheckpointManager(str(tmp_path), preemption_signals=()) as mgr:
        with pytest.raises(StorageError):
            mgr.restore(state)
    assert not state["w"].any()


@pytest.mark.parametrize("err", [errno.ESTALE, errno.EIO])
def test_a_transient_lstat_in_the_pick_is_no_missing_file(tmp_path, monkeypatch, err):
    """One ESTALE/EIO from lstat of a data file (NFS) was 'missing file' and a fallback to step
    100; it is tried again (and raised as a storage error if it persists)."""
    _steps_100_and_200(tmp_path)
    real = os.lstat
    failed = []

    def once(path, *args, **kwargs):
        p = os.fspath(path)
        if "step-0000000200" in p and "rank-" in p and not failed:
            failed.append(p)
            raise OSError(err, os.strerror(err), p)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", once)
    state = {"w": torch.zeros(4)}
    with safeckpt.CheckpointManager(str(tmp_path), preemption_signals=()) as mgr:
        assert mgr.restore(state) == 200
    assert failed and torch.equal(state["w"], torch.full((4,), 2.0))
