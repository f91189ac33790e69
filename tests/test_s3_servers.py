"""safeckpt against more than one real S3 server: moto's and SeaweedFS (``weed mini``), and
``rclone serve s3``, which ignores conditional writes.

On both servers with conditional writes (the ``endpoint`` fixture is parametrized): the
manifest's conditional PUT and the writer lease raced by two writers at the same instant (one
wins, every time, and the other is told), and a basic two-rank round trip (save, retention,
restore, a refused save over a committed checkpoint). On moto only (the heavier scenarios run
on one server): a rank file of 40,000 tiny tensors (its header and index are most of its
bytes), and DeleteObjects batches. On rclone: the server that ignores If-None-Match is
detected at the first save and said once. The servers run on free loopback ports and are
stopped after; a missing ``weed``/``rclone`` executable skips its tests saying which package
provides it.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import safeckpt
from safeckpt.coord.lease import writer_lease
from safeckpt.errors import CheckpointLocked, SafeckptWarning
from safeckpt.format.manifest import MANIFEST
from safeckpt.storage import s3 as _s3
from safeckpt.storage.base import storage_for
from tests.helpers import dist_harness, s3_harness
from tests.test_remote import _state

pytest.importorskip("s3fs")
pytest.importorskip("moto")

pytestmark = pytest.mark.timeout(300)

BUCKET = "servers"
RACES = 12  # rounds of two writers racing for one key


@pytest.fixture(scope="module", params=s3_harness.SERVERS)
def endpoint(request):
    with s3_harness.server(request.param) as ep:
        s3_harness.make_bucket(ep, BUCKET)
        yield ep


@pytest.fixture(scope="module")
def moto():
    with s3_harness.moto_server() as ep:
        s3_harness.make_bucket(ep, BUCKET)
        yield ep


def _race(n: int, fn) -> list:
    """Run ``fn(i)`` for i in range(n) in threads released together; each one's result or error."""
    gate = threading.Barrier(n)
    out: list = [None] * n

    def one(i: int) -> None:
        gate.wait(30)
        try:
            out[i] = ("ok", fn(i))
        except Exception as exc:  # noqa: BLE001 - judged by the test
            out[i] = (type(exc).__name__, str(exc))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_conditional_writes_hold_against_two_racing_writers(endpoint):
    opts = s3_harness.options(endpoint)
    stores = [storage_for(f"s3://{BUCKET}/race", opts, timeout=30) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SafeckptWarning)  # this server honours If-None-Match
        stores[0].put(f"s3://{BUCKET}/race/warm", b"x", exclusive=True)  # the first one probes
    assert stores[0].conditional_writes(f"s3://{BUCKET}/race/x")

    # The manifest's commit (publish without replace): one writer wins, the other is told.
    for r in range(RACES):
        final = f"s3://{BUCKET}/race/step-{r:010d}"
        got = _race(2, lambda i, final=final: stores[i].publish(final, final, f"manifest {i}".encode(),
                                                                replace=False))
        assert sorted(g[0] for g in got) == ["FileExistsError", "ok"], (r, got)
        winner = [i for i, g in enumerate(got) if g[0] == "ok"][0]
        assert stores[0].read(f"{final}/{MANIFEST}", 100) == f"manifest {winner}".encode()

    # The writer lease: two jobs taking it in the same instant; exactly one holds it.
    for r in range(RACES // 2):
        root = f"s3://{BUCKET}/lease-{r}"
        locks = [writer_lease(root, run_id=f"job-{i}", lease=30, store=stores[i]) for i in range(2)]
        try:
            got = _race(2, lambda i, locks=locks: locks[i].acquire())
            assert sorted(g[0] for g in got) == [CheckpointLocked.__name__, "ok"], (r, got)
            assert sum(lock.held for lock in locks) == 1
        finally:
            for lock in locks:
                lock.release()


def _roundtrip(rank: int, world: int, ep: str) -> dict:
    opts = s3_harness.options(ep)
    root = f"s3://{BUCKET}/run"
    out: dict = {}
    with safeckpt.CheckpointManager(root, keep_last=1, preemption_signals=(), storage_options=opts) as mgr:
        out["fresh"] = mgr.restore(_state(0.0, rank))
        for s in (1, 2):
            mgr.save(s, _state(float(s), rank, mib=2))
        out["listed"] = [i.step for i in mgr.list()]
        st = _state(0.0, rank, mib=2)
        out["restored"] = mgr.restore(st)
        want = _state(2.0, rank, mib=2)
        out["same"] = st["version"] == 2.0 and torch.equal(st["big"], want["big"]) and all(
            torch.equal(a, b) for a, b in zip(st["model"].state_dict().values(), want["model"].state_dict().values()))
    # Without overwrite, a committed checkpoint is never replaced (the manifest's conditional PUT).
    out["again"] = dist_harness.attempt(lambda: safeckpt.save(f"{root}/step-0000000002", _state(9.0, rank),
                                                              storage_options=opts))
    return out


def test_two_ranks_save_retention_restore_and_refused_overwrite(endpoint):
    outs = dist_harness.run(_roundtrip, 2, endpoint, timeout=180)
    for o in outs:
        assert o.ok, o.message
        v = o.value
        assert v["fresh"] is None and v["listed"] == [2] and v["restored"] == 2 and v["same"], v
        assert v["again"]["type"] == "CheckpointExists", v["again"]
    # Retention left no object of step 1 (SeaweedFS may keep their empty folders until
    # retention deletes through Storage.delete_many: see test_..._leaving_no_empty_prefix).
    fs = s3_harness.s3fs_for(endpoint)
    objects = [p.split("/", 2)[2] for p in fs.find(f"{BUCKET}/run")]
    assert objects and all(o.startswith("step-0000000002/") or o == ".safeckpt.lock" for o in objects), objects
    assert s3_harness.uploads(endpoint, BUCKET) == []


def test_a_rank_file_of_40000_tiny_tensors_is_uploaded_and_loaded_back(moto):
    # 40,000 scalars: 160 KB of tensors in a ~4.9 MB file (the header and the chunk index are
    # the rest). Parts sized from the tensors' bytes were under S3's 5 MiB minimum.
    opts = s3_harness.options(moto)
    n = 40_000
    state = {"many": {f"t{i}": torch.tensor(float(i)) for i in range(n)}}
    path = f"s3://{BUCKET}/tiny"
    info = safeckpt.save(path, state, storage_options=opts)
    assert info.nbytes > _s3.MIN_PART - (1 << 20)  # near the minimum part: the case that failed
    back = {"many": {f"t{i}": torch.tensor(-1.0) for i in range(n)}}
    safeckpt.load(path, back, storage_options=opts)
    assert all(float(back["many"][f"t{i}"]) == float(i) for i in range(n))
    assert s3_harness.uploads(moto, BUCKET, "tiny/") == []


@pytest.mark.parametrize("size", [0, 100, 5 << 20, (5 << 20) + 1, 60 << 20, 101 << 20, 600 << 30])
def test_parts_are_sized_from_the_whole_file(size):
    part = _s3.part_size(size)
    assert part >= _s3.MIN_PART
    if size < 2 * _s3.PART:
        assert part > size  # one PUT
    else:
        assert -(-size // part) <= _s3.MAX_PARTS


def test_the_file_size_is_read_from_the_header(tmp_path):
    from safeckpt.format.shardfile import stream_safetensors

    items = [(f"k{i}", torch.arange(i + 1, dtype=torch.float64 if i % 2 else torch.int8)) for i in range(50)]
    chunks: list[bytes] = []
    written = stream_safetensors(items, {"a": "b"}, lambda b: chunks.append(bytes(b)))
    assert _s3.file_size(memoryview(chunks[0])) == written.size == sum(map(len, chunks))
    assert _s3.file_size(memoryview(chunks[0])[:5]) is None


def test_a_checkpoint_is_deleted_in_one_bulk_request_leaving_no_empty_prefix(endpoint, monkeypatch):
    opts = s3_harness.options(endpoint)
    store = storage_for(f"s3://{BUCKET}/bulk", opts)
    ckpt = f"s3://{BUCKET}/bulk/step-0000000001"
    for i in range(64):
        store.put(f"{ckpt}/rank-{i:05d}.0123456789ab.safetensors", b"data")
    store.put(f"{ckpt}/{MANIFEST}", b"{}")
    calls: list[str] = []
    real = type(store.fs)._call_s3

    async def counting(self, method, *args, **kwargs):
        calls.append(method)
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(type(store.fs), "_call_s3", counting)
    store.delete_tree(ckpt)
    # the manifest first (the checkpoint stops being committed at once), then one request
    assert calls.count("delete_objects") == 1 and calls.count("delete_object") <= 2, calls
    assert store.list(ckpt) is None
    # SeaweedFS keeps a folder once its last object is gone: its marker is deleted too
    assert "step-0000000001" not in [i.name for i in store.list(f"s3://{BUCKET}/bulk") or ()]


def test_a_server_that_ignores_conditional_writes_is_detected_and_said_once():
    with s3_harness.rclone_server() as ep:
        s3_harness.make_bucket(ep, BUCKET)
        opts = s3_harness.rclone_options(ep)
        root = f"s3://{BUCKET}/run"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with safeckpt.CheckpointManager(root, keep_last=2, preemption_signals=(), storage_options=opts) as mgr:
                for s in (1, 2, 3):
                    mgr.save(s, _state(float(s)))
            safeckpt.save(f"s3://{BUCKET}/plain", _state(1.0), storage_options=opts)
            # Without conditional writes, the existence check before the PUT still refuses a
            # save over a committed checkpoint that is not raced.
            with pytest.raises(safeckpt.CheckpointExists):
                safeckpt.save(f"s3://{BUCKET}/plain", _state(2.0), storage_options=opts)
        said = [w for w in seen if issubclass(w.category, SafeckptWarning) and "If-None-Match" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in seen]
        text = str(said[0].message)
        assert ep in text and "writer lease" in text and "CheckpointExists" in text
        st = _state(0.0)
        with safeckpt.CheckpointManager(root, preemption_signals=(), storage_options=opts) as mgr:
            assert [i.step for i in mgr.list()] == [2, 3]
            assert mgr.restore(st) == 3 and st["version"] == 3.0
        assert not storage_for(root, opts).conditional_writes(f"{root}/x")
