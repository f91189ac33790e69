"""CheckpointManager on real multi-process gloo jobs: resume, fallback, retention, leftovers of
crashed runs, the writer lease, readers racing a writer, and preemption.

Crashes are real (SIGKILL of the worker processes); every job runs under a hard timeout.
Covers SPEC behaviours 5 and 6 and BZ-20, BZ-21, BZ-22, BZ-28, BZ-29, BZ-30, BZ-31, BZ-26.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings

import pytest
import torch

import safeckpt
from safeckpt import CheckpointLocked, CheckpointManager, CheckpointNotFound, CorruptCheckpoint
from safeckpt.engine.reader import open_manifest
from tests.helpers import dist_harness

LOCK = ".safeckpt.lock"
KEYS = {"model/w", "model/v", "model/b", "step"}


def make_state(step: int) -> dict:
    """A state whose every value is ``step``; its tensors land in different ranks' files."""
    return {
        "model": {
            "w": torch.full((3000,), float(step)),
            "v": torch.full((2000,), float(step)),
            "b": torch.full((500,), step, dtype=torch.int64),
        },
        "step": step,
    }


def state_step(state: dict) -> int:
    """The single step a loaded state holds; fails if its parts disagree."""
    vals = {int(t.unique().item()) for t in state["model"].values() if t.unique().numel() == 1}
    assert len(vals) == 1 and all(t.unique().numel() == 1 for t in state["model"].values()), state
    (v,) = vals
    assert v == state["step"], (v, state["step"])
    return v


def flat_step(sd: dict) -> int:
    """Same for a flat dict from read_state_dict (per-rank RNG state, if any, aside)."""
    sd = {k: v for k, v in sd.items() if not k.startswith("rng/")}
    assert set(sd) == KEYS, sorted(sd)
    for k in KEYS - {"step"}:
        t = sd[k]
        assert t.numel() > 0 and bool((t == sd["step"]).all()), (k, t.unique(), sd["step"])
    return sd["step"]


def step_dir(root, step: int) -> str:
    return os.path.join(str(root), f"step-{step:010d}")


def hidden(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def assert_all_ok(out):
    assert all(o.ok for o in out), "\n".join(f"rank {o.rank}: exit {o.exitcode} {o.message}" for o in out)


def reader_manager(root) -> CheckpointManager:
    return CheckpointManager(root, preemption_signals=())


# ------------------------------------------------------------------ resume/fallback/retention
LOSS_RUN1 = {1: 0.1, 2: 0.5, 3: 0.4, 4: 0.3, 5: 0.6}
LOSS_RUN2 = {5: 0.2, 6: 0.7, 7: 0.8}


def _first_run(rank, world, root):
    mgr = CheckpointManager(root, keep_last=2, keep_best=1, best_metric="loss", keep_every=3)
    st = make_state(-1)
    restored = mgr.restore(st)  # a fresh run: nothing there (the root does not even exist)
    lists = []
    for s in range(1, 6):
        torch.manual_seed(1000 * s + rank)
        info = mgr.save(s, {**make_state(s), "rng": safeckpt.RNGState()}, metrics={"loss": LOSS_RUN1[s]})
        assert info.step == s and info.path == step_dir(root, s)
        lists.append([i.step for i in mgr.list()])
    mgr.close()
    return {"restored": restored, "lists": lists}


def _second_run(rank, world, root):
    # A new job on the same root, with another policy (no keep_every): retention must apply to
    # the earlier run's checkpoints too.
    mgr = CheckpointManager(root, keep_last=2, keep_best=1, best_metric="loss")
    res = {}
    st = {**make_state(-1), "rng": safeckpt.RNGState()}
    res["at3"] = mgr.restore(st, step=3)
    res["at3_state"] = state_step(st)
    for missing in (2, 77):  # 2 was deleted by retention in the first run; 77 never existed
        try:
            mgr.restore(st, step=missing)
            res[f"at{missing}"] = "no error"
        except CheckpointNotFound as exc:
            res[f"at{missing}"] = type(exc).__name__
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr.restore(st, step=5)  # explicitly asking for the corrupt one must not fall back
        res["at5"] = "no error"
    except CorruptCheckpoint as exc:
        res["at5"] = type(exc).__name__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res["restored"] = mgr.restore(st)
    res["warnings"] = [str(w.message) for w in caught if issubclass(w.category, safeckpt.SafeckptWarning)]
    res["restored_state"] = state_step(st)
    res["rng_ok"] = torch.equal(torch.randint(0, 2**30, (4,)), _rng_draw(4, rank))  # rank's own
    res["lists"] = []
    for s in (5, 6, 7):  # training continues from 4: step 5 is saved again over the corrupt one
        info = mgr.save(s, {**make_state(s), "rng": safeckpt.RNGState()}, metrics={"loss": LOSS_RUN2[s]})
        if s == 5:
            res["new5"] = flat_step(safeckpt.read_state_dict(info.path))
        res["lists"].append([i.step for i in mgr.list()])
    mgr.close()
    return res


def _rng_draw(step, rank):
    torch.manual_seed(1000 * step + rank)
    return torch.randint(0, 2**30, (4,))


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def corrupt_rank1_only_chunk(ckpt: str) -> str:
    """Flip a bit inside rank 1's *per-rank* RNG state: a chunk only rank 1 reads on restore,
    so only rank 1 can notice, and every rank must still fall back together."""
    man = open_manifest(ckpt)  # format 3: chunk places from the files' indexes
    (chunk,) = [c for c in man["tensors"]["rng/torch"]["chunks"] if c.get("rank") == 1]
    assert man["tensors"]["rng/torch"]["scope"] == "per_rank"
    path = os.path.join(ckpt, chunk["file"])
    flip_byte(path, (chunk["start"] + chunk["end"]) // 2)
    return path


def test_resume_fallback_and_retention_across_runs(tmp_path):
    root = tmp_path / "ckpts"
    out = dist_harness.run(_first_run, 2, str(root), timeout=90)
    assert_all_ok(out)
    for o in out:
        assert o.value["restored"] is None
        # keep_last=2 | best loss (step 1, the oldest) | every 3rd step
        assert o.value["lists"] == [[1], [1, 2], [1, 2, 3], [1, 3, 4], [1, 3, 4, 5]], o.value
    assert hidden(root) == []  # no staging/trash leftovers; lease released by close()

    # Things that are not committed checkpoints and must be left alone (BZ-31, behaviour 6).
    (root / "notes").mkdir()
    (root / "notes" / "a.txt").write_text("mine")
    (root / "README.txt").write_text("mine")
    (root / "step-12").mkdir()  # not a safeckpt step name
    no_manifest = root / "step-0000000099"  # newer than everything, but never committed
    no_manifest.mkdir()
    (no_manifest / "rank-00000.safetensors").write_bytes(b"\0" * 64)
    garbage = root / "step-0000000098"
    garbage.mkdir()
    (garbage / "manifest.json").write_text("{not json")
    # Bit flip in rank 1's file of the newest checkpoint: the manifest still parses and sizes
    # match, so only a checksum can tell, and only rank 1 reads those bytes.
    assert corrupt_rank1_only_chunk(step_dir(root, 5)).endswith("rank-00001.safetensors")
    assert safeckpt.verify(step_dir(root, 5), deep=False).ok
    assert not safeckpt.verify(step_dir(root, 5), deep=True).ok
    foreign = {"notes", "README.txt", "step-12", "step-0000000099", "step-0000000098"}

    ro = reader_manager(root)
    assert [i.step for i in ro.list()] == [1, 3, 4, 5]  # the garbage dirs are not listed
    assert ro.latest().step == 5

    out = dist_harness.run(_second_run, 2, str(root), timeout=120)
    assert_all_ok(out)
    for o in out:
        v = o.value
        assert v["at3"] == 3 and v["at3_state"] == 3
        assert v["at2"] == "CheckpointNotFound" and v["at77"] == "CheckpointNotFound"
        assert v["at5"] == "CorruptCheckpoint"
        # every rank falls back to the same older step, with a warning naming the reason
        assert v["restored"] == 4 and v["restored_state"] == 4, v
        assert v["rng_ok"]  # the rank's own RNG stream of step 4 came back
        corrupt = [w for w in v["warnings"] if "step 5" in w and "corrupt" in w]
        assert corrupt, v["warnings"]
        assert "failed on rank 1 (of 2)" in corrupt[0]  # only rank 1 could see it
        assert v["new5"] == 5
        # keep_last=2 | best (step 1) | restored (step 4, protected); step 3 of the first run
        # is deleted by the second run's policy.
        assert v["lists"] == [[1, 4, 5], [1, 4, 5, 6], [1, 4, 6, 7]], v["lists"]

    names = set(os.listdir(root))
    assert names == foreign | {f"step-{s:010d}" for s in (1, 4, 6, 7)}, names
    assert (root / "notes" / "a.txt").read_text() == "mine"
    assert (garbage / "manifest.json").read_text() == "{not json"
    assert os.listdir(no_manifest) == ["rank-00000.safetensors"]
    for s in (1, 4, 6, 7):
        assert flat_step(safeckpt.read_state_dict(step_dir(root, s))) == s
        assert safeckpt.verify(step_dir(root, s), deep=True).ok
    assert [i.step for i in ro.list()] == [1, 4, 6, 7]
    assert ro.latest().metrics == {"loss": 0.8}


# ------------------------------------------------------------------ crashed run leftovers
def wait_for_every_rank(sync: str, marker: str, world: int, seconds: float) -> None:
    """Wait until every rank created ``sync/<marker>-<rank>``, for ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(
        os.path.exists(os.path.join(sync, f"{marker}-{r}")) for r in range(world)
    ):
        time.sleep(0.01)


def run_killed_job(job, tmp_path) -> tuple:
    """Run ``job(rank, world, root, sync)`` on 2 ranks with a fresh checkpoint root and a marker
    folder; both ranks must end killed by SIGKILL. Returns ``(root, sync)``."""
    root, sync = tmp_path / "ckpts", tmp_path / "sync"
    sync.mkdir()
    out = dist_harness.run(job, 2, str(root), str(sync), timeout=90)
    assert [o.exitcode for o in out] == [-signal.SIGKILL] * 2, [(o.exitcode, o.message) for o in out]
    return root, sync


def _crash_mid_write(rank, world, root, sync):
    import safeckpt.format.shardfile as sf

    mgr = CheckpointManager(root, keep_last=3)
    mgr.save(1, make_state(1))
    real = sf._write_all
    calls = [0]

    def dying_write(fd, data):
        calls[0] += 1
        if calls[0] == 2:  # the header is written; now half of the first tensor, then die
            real(fd, data[: len(data) // 2])
            open(os.path.join(sync, f"writing-{rank}"), "w").close()
            wait_for_every_rank(sync, "writing", world, 20)
            if rank == 0:
                with open(os.path.join(sync, "pid0"), "w") as f:
                    f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd, data)

    sf._write_all = dying_write
    mgr.save(2, make_state(2))
    return "survived"


def _resume_after_crash(rank, world, root):
    mgr = CheckpointManager(root, keep_last=3)
    res = {"listed": [i.step for i in mgr.list()], "latest": mgr.latest().step}
    st = make_state(-1)
    res["restored"] = mgr.restore(st)
    res["restored_state"] = state_step(st)
    res["hidden_before"] = hidden(root)
    # every rank looked before rank 0's save sweeps the leftover (else a slower rank may miss it)
    torch.distributed.barrier()
    info = mgr.save(2, make_state(2))  # the very step whose save was killed
    res["saved"] = info.step
    res["hidden_after"] = hidden(root)
    with open(os.path.join(root, LOCK)) as f:
        res["lock_pid"] = json.load(f)["pid"]
    res["pid"] = os.getpid()
    res["listed_after"] = [i.step for i in mgr.list()]
    torch.distributed.barrier()  # every rank looked before rank 0 releases the lease
    mgr.close()
    return res


def test_sigkill_mid_write_leftovers_and_dead_lease(tmp_path):
    root, sync = run_killed_job(_crash_mid_write, tmp_path)
    staging = [n for n in hidden(root) if ".safeckpt-staging-" in n]
    assert len(staging) == 1 and staging[0].startswith(".step-0000000002"), hidden(root)
    assert sorted(os.listdir(root / staging[0])) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    # The crashed job still "holds" the lease: fresh heartbeat, but a dead pid on this host.
    with open(root / LOCK) as f:
        holder = json.load(f)
    assert holder["pid"] == int((sync / "pid0").read_text())
    assert time.time() - os.path.getmtime(root / LOCK) < holder["lease"]

    ro = reader_manager(root)
    assert [i.step for i in ro.list()] == [1]
    assert ro.latest().step == 1

    out = dist_harness.run(_resume_after_crash, 2, str(root), timeout=90)
    assert_all_ok(out)
    for o in out:
        v = o.value
        assert v["listed"] == [1] and v["latest"] == 1
        assert v["restored"] == 1 and v["restored_state"] == 1
        assert staging[0] in v["hidden_before"]
        assert v["saved"] == 2
        assert v["hidden_after"] == [LOCK], v["hidden_after"]  # the leftover is gone
        assert v["listed_after"] == [1, 2]
    # the dead holder's lease was taken over by the new job's coordinator
    assert out[0].value["lock_pid"] == out[0].value["pid"]
    assert hidden(root) == []
    assert flat_step(safeckpt.read_state_dict(step_dir(root, 2))) == 2
    assert safeckpt.verify(step_dir(root, 2), deep=True).ok


# ------------------------------------------------------------------ lease + concurrent reader
N_SAVES = 40


def _wait_file(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)


def _writer_job(rank, world, root, sync):
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(0, make_state(0))
    if rank == 0:
        with open(os.path.join(sync, "held.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(sync, "held.tmp"), os.path.join(sync, "held"))
    _wait_file(os.path.join(sync, "go"))
    for s in range(1, N_SAVES + 1):
        mgr.save(s, make_state(s))
    final = [i.step for i in mgr.list()]
    if rank == 0:
        open(os.path.join(sync, "done"), "w").close()
    _wait_file(os.path.join(sync, "release"))  # keep the lease until the parent is done probing
    mgr.close()
    return final


def test_lease_refuses_second_writer_and_readers_never_see_partial(tmp_path):
    root, sync = tmp_path / "ckpts", tmp_path / "sync"
    sync.mkdir()

    # Readers take no lock: not on a missing root, not on an empty one.
    for r in (root, tmp_path / "empty"):
        if r.name == "empty":
            r.mkdir()
        mgr = reader_manager(r)
        assert mgr.list() == [] and mgr.latest() is None
        assert mgr.restore({}) is None
        mgr.close()
    assert not root.exists()
    assert os.listdir(tmp_path / "empty") == []

    box: dict = {}
    job = threading.Thread(
        target=lambda: box.setdefault("out", dist_harness.run(_writer_job, 2, str(root), str(sync), timeout=150)),
    )
    job.start()
    try:
        _wait_file(sync / "held", timeout=90)
        holder_pid = int((sync / "held").read_text())
        lock_before = (root / LOCK).read_text()
        assert json.loads(lock_before)["pid"] == holder_pid

        # Another process: construct + list/latest/restore work while the job holds the lease,
        # and take no lock.
        ro = reader_manager(root)
        assert [i.step for i in ro.list()] == [0]
        assert ro.latest().step == 0
        st = make_state(-1)
        assert ro.restore(st) == 0 and state_step(st) == 0
        assert flat_step(safeckpt.read_state_dict(ro.latest().path)) == 0
        ro.close()
        assert (root / LOCK).read_text() == lock_before

        # A second writer on the same root is refused, and writes nothing.
        intruder = reader_manager(root)
        with pytest.raises(CheckpointLocked) as exc_info:
            intruder.save(100, make_state(100))
        assert str(holder_pid) in str(exc_info.value)
        assert (root / LOCK).read_text() == lock_before
        assert not os.path.exists(step_dir(root, 100))
        assert not [n for n in hidden(root) if n != LOCK]

        # Now the job saves N_SAVES times with keep_last=1 while we poll latest() + read.
        (sync / "go").touch()
        reader = reader_manager(root)
        good, vanished, seen, nones, refused, i = 0, 0, set(), 0, 0, 0
        deadline = time.monotonic() + 120
        while not (sync / "done").exists() and job.is_alive() and time.monotonic() < deadline:
            i += 1
            if i % 100 == 0:
                # the intruder is refused while the job is mid-save too (its staging dir and
                # checkpoints untouched: the job's saves all succeed, asserted below)
                with pytest.raises(CheckpointLocked):
                    intruder.save(100 + i, make_state(100 + i))
                refused += 1
            info = reader.latest()
            if info is None:  # there is always a committed checkpoint: new ones publish first
                nones += 1
                continue
            try:
                sd = safeckpt.read_state_dict(info.path)
            except (CheckpointNotFound, CorruptCheckpoint) as exc:
                # Only acceptable because retention deleted it after latest() returned.
                assert not os.path.exists(info.path), f"committed checkpoint unreadable: {exc}"
                vanished += 1
                continue
            assert flat_step(sd) == info.step, (info, sd["step"])
            good += 1
            seen.add(info.step)
        assert (sync / "done").exists(), "the job did not finish its saves"
        with pytest.raises(CheckpointLocked):
            intruder.save(99, make_state(99))
        intruder.close()
    finally:
        (sync / "release").touch()
        job.join(180)
    out = box["out"]
    assert_all_ok(out)
    assert nones == 0
    assert all(o.value == [N_SAVES] for o in out)
    assert good >= 5 and len(seen) >= 3, (good, vanished, sorted(seen))
    assert refused >= 1
    print(f"reader: {good} good reads of {len(seen)} steps, {vanished} vanished, {refused} refused")
    assert [n for n in os.listdir(root)] == [f"step-{N_SAVES:010d}"]  # lease released, no leftovers


# ------------------------------------------------------------------ preemption
def _preempt_job(rank, world, root_a, root_b, sync):
    calls = []

    def user_handler(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGTERM, user_handler)
    res = {}

    # Loop 1: rank 1 gets SIGTERM (from itself) at step 5.
    mgr = CheckpointManager(root_a, keep_last=2)
    stop = None
    for step in range(1, 200):
        state = make_state(step)
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        if mgr.preempted:
            mgr.save(step, state)
            stop = step
            break
    res["stop_a"] = stop
    res["latest_a"] = mgr.latest().step
    mgr.close()
    res["calls_a"] = list(calls)
    res["handler_restored_a"] = signal.getsignal(signal.SIGTERM) is user_handler

    # Loop 2: the parent test process sends SIGTERM to rank 2 at a time it chooses.
    mgr = CheckpointManager(root_b, keep_last=2)
    if rank == 2:
        with open(os.path.join(sync, "pid2.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(sync, "pid2.tmp"), os.path.join(sync, "pid2"))
    stop = None
    for step in range(1, 3000):
        time.sleep(0.005)
        state = make_state(step)
        if mgr.preempted:
            assert mgr.preempted  # stays set
            mgr.save(step, state)
            stop = step
            break
    res["stop_b"] = stop
    res["latest_b"] = mgr.latest().step
    mgr.close()
    res["calls_b"] = calls[len(res["calls_a"]):]
    res["handler_restored_b"] = signal.getsignal(signal.SIGTERM) is user_handler
    return res


def test_preemption_on_one_rank_stops_all_at_same_step(tmp_path):
    root_a, root_b, sync = tmp_path / "a", tmp_path / "b", tmp_path / "sync"
    sync.mkdir()
    sent = {}

    def send_sigterm():
        try:
            _wait_file(sync / "pid2", timeout=90)
        except TimeoutError:
            return
        time.sleep(0.7)
        pid = int((sync / "pid2").read_text())
        sent["t"] = time.monotonic()
        os.kill(pid, signal.SIGTERM)

    killer = threading.Thread(target=send_sigterm, daemon=True)
    killer.start()
    out = dist_harness.run(_preempt_job, 3, str(root_a), str(root_b), str(sync), timeout=120)
    killer.join(5)
    assert_all_ok(out)
    assert "t" in sent
    va = [o.value for o in out]
    assert [v["stop_a"] for v in va] == [5, 5, 5], va
    assert [v["latest_a"] for v in va] == [5, 5, 5]
    stops_b = {v["stop_b"] for v in va}
    assert len(stops_b) == 1 and None not in stops_b, va
    (stop_b,) = stops_b
    assert stop_b > 1
    assert [v["latest_b"] for v in va] == [stop_b] * 3
    # the user's own SIGTERM handler was chained: called once, on the signalled rank only
    assert [v["calls_a"] for v in va] == [[], [signal.SIGTERM], []]
    assert [v["calls_b"] for v in va] == [[], [], [signal.SIGTERM]]
    assert all(v["handler_restored_a"] and v["handler_restored_b"] for v in va)
    for root, step in ((root_a, 5), (root_b, stop_b)):
        ro = reader_manager(root)
        assert ro.latest().step == step
        assert flat_step(safeckpt.read_state_dict(step_dir(root, step))) == step
        assert safeckpt.verify(step_dir(root, step), deep=True).ok


# ------------------------------------------------------------------ lock-free listing race
def test_listing_racing_publish_and_retention_never_misses_the_newest(tmp_path, monkeypatch):
    """A reader's listing taken just before a writer publishes step N and retention moves step
    N-1 aside must not report "no checkpoint" (a reader would think the run starts fresh)."""
    import safeckpt.storage.catalog as catalog

    root = tmp_path / "ckpts"
    mgr = CheckpointManager(root, keep_last=None, preemption_signals=())
    mgr.save(1, make_state(1))
    mgr.save(2, make_state(2))
    mgr.close()
    staged = root / ".step-0000000002.safeckpt-staging-0123abcd"
    os.rename(step_dir(root, 2), staged)  # step 2 is staged, not yet published
    real_listdir = os.listdir
    raced = []

    def stale_listdir(path):
        names = real_listdir(path)
        if os.fspath(path) == str(root) and not raced:
            raced.append(names)
            # the writer publishes step 2, then retention moves step 1 aside
            os.rename(staged, step_dir(root, 2))
            os.rename(step_dir(root, 1), root / ".step-0000000001.safeckpt-trash-0123abcd")
        return names

    monkeypatch.setattr(catalog.os, "listdir", stale_listdir)
    ro = reader_manager(root)
    info = ro.latest()
    assert raced, "the race was not exercised"
    assert info is not None and info.step == 2
    assert flat_step(safeckpt.read_state_dict(info.path)) == 2


def test_read_of_checkpoint_deleted_mid_open_says_not_found(tmp_path, monkeypatch):
    """read_state_dict racing retention: the directory passes the existence checks, then is
    moved aside before the manifest is opened. The reader must get CheckpointNotFound (a
    safeckpt error it can count and retry), never a raw OSError."""
    import safeckpt.format.manifest as manifest_mod

    root = tmp_path / "ckpts"
    mgr = CheckpointManager(root, keep_last=None, preemption_signals=())
    info = mgr.save(3, make_state(3))
    mgr.close()
    real = manifest_mod.read_manifest

    def racing_read_manifest(path):
        os.rename(path, root / ".step-0000000003.safeckpt-trash-0123abcd")  # retention
        return real(path)

    monkeypatch.setattr(manifest_mod, "read_manifest", racing_read_manifest)
    with pytest.raises(CheckpointNotFound):
        safeckpt.read_state_dict(info.path)


def test_retention_interrupted_half_way_never_leaves_a_committed_looking_dir(tmp_path, monkeypatch):
    """Retention dies after it started deleting (simulated: rmtree removes one data file, keeps
    the manifest, then the process 'dies'): the half-deleted checkpoint is never listed or
    restored, and the next save sweeps what is left."""
    import shutil

    import safeckpt.storage.commit as commit

    root = tmp_path / "ckpts"
    mgr = CheckpointManager(root, keep_last=1, preemption_signals=())
    mgr.save(1, make_state(1))
    real_rmtree = shutil.rmtree

    def dying_rmtree(path, ignore_errors=False):
        names = sorted(os.listdir(path))
        os.unlink(os.path.join(path, names[-1]))  # a data file goes, the manifest stays; dies
        raise SystemExit("killed during retention")

    monkeypatch.setattr(commit.shutil, "rmtree", dying_rmtree)
    with pytest.raises(SystemExit):
        mgr.save(2, make_state(2))
    monkeypatch.setattr(commit.shutil, "rmtree", real_rmtree)
    mgr._lock.release()  # the "dead" process's lease

    ro = reader_manager(root)
    assert [i.step for i in ro.list()] == [2]
    st = make_state(-1)
    assert ro.restore(st) == 2 and state_step(st) == 2
    assert not os.path.exists(step_dir(root, 1))
    trash = [n for n in hidden(root) if ".safeckpt-trash-" in n]
    assert len(trash) == 1 and trash[0].startswith(".step-0000000001")

    mgr = CheckpointManager(root, keep_last=1, preemption_signals=())
    mgr.save(3, make_state(3))
    mgr.close()
    assert sorted(os.listdir(root)) == [f"step-{3:010d}"]


def _damage(ckpt: str, how: str) -> None:
    f = os.path.join(ckpt, "rank-00000.safetensors")
    if how == "bitflip":  # sizes match: only loading (checksums) can tell
        flip_byte(f, os.path.getsize(f) - 1)
    elif how == "manifest":  # a damaged manifest: history that cannot even be read
        with open(os.path.join(ckpt, "manifest.json"), "r+b") as fh:
            fh.truncate(100)
    elif how == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) - 8)
    else:
        os.unlink(f)


@pytest.mark.parametrize("how", ["bitflip", "truncate", "missing", "manifest"])
def test_restore_never_starts_fresh_when_every_checkpoint_is_damaged(tmp_path, how):
    """BZ-22: history exists but none of it loads -> CorruptCheckpoint naming each one, never
    None (which a training script takes as "fresh run"). Asking for a damaged step explicitly
    says it is corrupt, not that it does not exist."""
    root = tmp_path / "ckpts"
    mgr = CheckpointManager(root, keep_last=None, preemption_signals=())
    for s in (1, 2):
        mgr.save(s, make_state(s))
    mgr.close()
    # Only the newest is damaged: fall back to step 1 with a warning.
    _damage(step_dir(root, 2), how)
    ro = reader_manager(root)
    st = make_state(-1)
    with pytest.warns(safeckpt.SafeckptWarning, match="step.0*2"):
        assert ro.restore(st) == 1
    assert state_step(st) == 1
    with pytest.raises(CorruptCheckpoint), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ro.restore(make_state(-1), step=2)
    # Every one damaged: an error, not a fresh start.
    _damage(step_dir(root, 1), how)
    with pytest.raises(CorruptCheckpoint) as exc_info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ro.restore(make_state(-1))
    assert "step 1" in str(exc_info.value) and "step 2" in str(exc_info.value), str(exc_info.value)


def test_retention_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    """BZ-29/BZ-30: a run that resumes from an older step (checkpoints of a run that got further
    are still there) must not delete each checkpoint right after writing it because a stale,
    higher-numbered one counts as "newest"."""
    root = tmp_path / "ckpts"
    mgr = CheckpointManager(root, keep_last=3, preemption_signals=())
    for s in (8, 9, 10, 11):
        mgr.save(s, make_state(s))
    mgr.close()
    mgr = CheckpointManager(root, keep_last=1, preemption_signals=())
    assert mgr.restore(make_state(-1), step=9) == 9  # branch off an earlier step
    info = mgr.save(10, make_state(10))  # replaces the old 10
    assert info.step == 10
    assert [i.step for i in mgr.list()] == [9, 10, 11]  # restored, just written, numerically newest
    assert flat_step(safeckpt.read_state_dict(info.path)) == 10
    mgr.close()


def _restore_other_roots(rank, world, base):
    root = os.path.join(base, f"root-{rank}")
    state = {"w": torch.full((4,), float(rank))}
    with safeckpt.CheckpointManager(os.path.join(base, "root-0"), keep_last=None) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    with safeckpt.CheckpointManager(root, keep_last=None) as mgr:
        try:
            mgr.restore(state)
        except safeckpt.RankMismatch as exc:
            return {"error": str(exc), "w": state["w"].tolist()}
    return {"error": None, "w": state["w"].tolist()}


@pytest.mark.timeout(120)
def test_restore_refuses_ranks_with_different_roots(tmp_path):
    """Rank 0 picks the checkpoint for everyone: a rank given another root (a per-node path)
    must not silently load rank 0's pick; every rank raises and keeps its state."""
    out = dist_harness.run(_restore_other_roots, 2, str(tmp_path), timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        assert o.value["error"] and "different roots" in o.value["error"]
        assert "root-1" in o.value["error"]
        assert o.value["w"] == [float(o.rank)] * 4


def _save_other_shape(rank, world, base):
    state = {"model": {"w": torch.zeros(4 if rank == 0 else 5), "b": torch.zeros(2)}, "step": 1}
    try:
        safeckpt.save(os.path.join(base, "ck"), state)
    except safeckpt.RankMismatch as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_save_names_the_tensor_whose_layout_differs(tmp_path):
    """Same entries, one tensor of another shape on rank 1: RankMismatch on every rank names
    that tensor and both shapes, and nothing is written."""
    out = dist_harness.run(_save_other_shape, 2, str(tmp_path), timeout=90)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        assert o.value and "'model/w'" in o.value and "[4]" in o.value and "[5]" in o.value, o.value
        assert "'model/b'" not in o.value
    assert not (tmp_path / "ck").exists()


def test_a_manifest_changed_after_a_listing_is_read_again(tmp_path):
    """Listings remember the manifests they validated (retention lists after every save); a
    manifest rewritten afterwards, even with its old size and mtime, is read and judged again."""
    root = tmp_path / "root"
    with safeckpt.CheckpointManager(root, keep_last=None) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.save(2, {"w": torch.ones(4)})
        assert [i.step for i in mgr.list()] == [1, 2]
        man = root / "step-0000000002" / "manifest.json"
        st = os.stat(man)
        raw = man.read_bytes()
        man.write_bytes(raw.replace(b'"step":2', b'"step":3'))  # same size, checksum now wrong
        os.utime(man, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(man).st_size == st.st_size and os.stat(man).st_mtime_ns == st.st_mtime_ns
        assert [i.step for i in mgr.list()] == [1]
        man.write_bytes(raw)
        assert [i.step for i in mgr.list()] == [1, 2]
