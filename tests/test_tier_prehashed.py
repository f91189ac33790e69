"""A restore's verify keeps each node copy's chunk checksums for the load
(``engine.prehashed``): the load does not hash those chunks again, and a file replaced or
rewritten between the verify and the load is hashed again, never trusted.

File level (one process): the digests equal the file's; a replaced or rewritten file, or one
changed while it was hashed, is not served from what was recorded. Real processes (2 simulated nodes of one rank, gloo): a
restore whose load takes the recorded digests, and one whose node copy is damaged after the
verify, which then loads the previous step bit-exact instead of the damaged one."""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

from safeckpt.engine import prehashed
from safeckpt.storage.posix import digest_file
from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(300)

SPANS = [(0, 4096), (4096, 4096 + 10_000), (20_000, 1 << 20)]


def _file(tmp_path, name="f.bin", size=1 << 20):
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return str(path)


def test_digests_and_reads_are_the_files(tmp_path):
    path = _file(tmp_path)
    got, hashed = prehashed.hash_file(path, lambda _fd: SPANS)
    assert got == digest_file(path, SPANS)
    prehashed.remember(path, hashed)
    try:
        f = prehashed.open_file(path, 1 << 20)
        assert isinstance(f, prehashed.PrehashedFile)
        assert f.hash_range_local(*SPANS[2], 1 << 20) == got.spans[2]
        assert f.hash_runs(SPANS[:2]) == got.spans[:2]
        buf = bytearray(50_000)
        f.read_into(7, memoryview(buf))
        with open(path, "rb") as raw:
            raw.seek(7)
            assert bytes(buf) == raw.read(50_000)
        f.close()
    finally:
        prehashed.release(str(tmp_path))
    assert type(prehashed.open_file(path, 1 << 20)) is not prehashed.PrehashedFile


def test_a_file_replaced_after_the_verify_is_hashed_and_read_again(tmp_path):
    path = _file(tmp_path)
    got, hashed = prehashed.hash_file(path, lambda _fd: SPANS)
    prehashed.remember(path, hashed)
    try:
        damaged = bytearray(open(path, "rb").read())
        damaged[30_000] ^= 1
        other = tmp_path / "other.bin"
        other.write_bytes(bytes(damaged))
        os.replace(other, path)  # a new file under the name (what every tier write does)
        f = prehashed.open_file(path, 1 << 20)
        assert f.hash_range_local(*SPANS[2], 1 << 20) != got.spans[2]  # hashed again: damage seen
        buf = bytearray(1)
        f.read_into(30_000, memoryview(buf))
        assert buf[0] == damaged[30_000]  # read from the file opened
        f.close()
    finally:
        prehashed.release(str(tmp_path))


@pytest.mark.parametrize("mtime", ["moved on", "set back"])
def test_a_file_rewritten_in_place_after_the_verify_is_hashed_again(tmp_path, mtime):
    """A byte rewritten in place, its modification time moved on (a coarse clock: still a
    change), or set back as cp -p / rsync -t do: same inode, size and modification time, and
    the change time (which no program can set) tells it apart."""
    path = _file(tmp_path)
    got, hashed = prehashed.hash_file(path, lambda _fd: SPANS)
    prehashed.remember(path, hashed)
    try:
        st = os.stat(path)
        time.sleep(0.01)
        with open(path, "r+b") as f:
            f.seek(30_000)
            b = f.read(1)
            f.seek(30_000)
            f.write(bytes([b[0] ^ 1]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + (1_000_000 if mtime == "moved on" else 0)))
        assert os.stat(path).st_ino == st.st_ino
        f = prehashed.open_file(path, 1 << 20)
        assert f.hash_range_local(*SPANS[2], 1 << 20) != got.spans[2]
        f.close()
    finally:
        prehashed.release(str(tmp_path))


def test_a_file_changed_while_it_is_hashed_keeps_nothing(tmp_path, monkeypatch):
    path = _file(tmp_path)
    plain = prehashed.digest_fd

    def changing(fd, spans):
        got = plain(fd, spans)
        with open(path, "r+b") as f:  # another program writes into the file just hashed
            f.seek(30_000)
            f.write(b"\x00\x01")
        return got

    monkeypatch.setattr(prehashed, "digest_fd", changing)
    _, hashed = prehashed.hash_file(path, lambda _fd: SPANS)
    prehashed.remember(path, hashed)
    try:
        assert type(prehashed.open_file(path, 1 << 20)) is not prehashed.PrehashedFile
    finally:
        prehashed.release(str(tmp_path))


def test_the_digests_are_of_the_file_the_descriptor_read(tmp_path, monkeypatch):
    """Another program swaps a good copy in by name during the pass and the damaged one back:
    the pass read the descriptor it opened (the damaged file), so its digest is the damaged
    file's and nothing of the good copy is credited to it."""
    path = _file(tmp_path)
    good = open(path, "rb").read()
    damaged = bytearray(good)
    damaged[30_000] ^= 1
    with open(path, "wb") as f:
        f.write(damaged)
    plain = prehashed.digest_fd

    def swapping(fd, spans):
        aside = tmp_path / "aside.bin"
        os.replace(path, aside)
        (tmp_path / "good.bin").write_bytes(good)
        os.replace(tmp_path / "good.bin", path)
        got = plain(fd, spans)
        os.replace(aside, path)  # the damaged one back
        return got

    monkeypatch.setattr(prehashed, "digest_fd", swapping)
    got, hashed = prehashed.hash_file(path, lambda _fd: SPANS)
    assert got == digest_file(path, SPANS)  # the damaged file's digest
    prehashed.remember(path, hashed)
    try:
        f = prehashed.open_file(path, 1 << 20)
        assert f.hash_range_local(*SPANS[2], 1 << 20) == digest_file(path, SPANS).spans[2]
        f.close()
    finally:
        prehashed.release(str(tmp_path))


N = 1 << 16


def _state(step, rank):
    import safeckpt
    return {"w": torch.arange(N, dtype=torch.float32) * step,
            "mine": safeckpt.PerRank(torch.full((4,), 100.0 * rank + step))}


def _job(rank, world, root, nodes_dir, damage, node_of):
    import safeckpt
    import safeckpt.engine.tier as tier
    from safeckpt.engine import prehashed as ph

    node = node_of[rank]
    os.environ["GROUP_RANK"] = str(node)
    mk = lambda: safeckpt.CheckpointManager(root, local_dir=os.path.join(nodes_dir, f"node{node}"),  # noqa: E731
                                            durable_every=10, replicas=1, preemption_signals=(), timeout=20)
    mgr = mk()
    for step in (10, 11):  # 10 reaches root, 11 is on the nodes only
        mgr.save(step, _state(step, rank))
        mgr.wait()
    mgr._last = None  # a crash: 11 is not drained at close
    mgr.close()

    opened = []
    plain_open, plain_load = ph.open_file, tier.load

    def counted(path, size):
        f = plain_open(path, size)
        opened.append([os.path.basename(path), type(f).__name__ + ("+digests" if getattr(f, "_digests", None) else "")])
        return f

    def load_after_damage(*a, **k):  # between the verify and the load: node 0's own copy damaged
        if damage and rank == 0:
            d = mgr2._tier.step_dir(11)
            name = sorted(n for n in os.listdir(d) if n.startswith("rank-00000"))[0]
            with open(os.path.join(d, name), "rb") as f:
                data = bytearray(f.read())
            data[len(data) // 2] ^= 1
            with open(os.path.join(d, ".x"), "wb") as f:
                f.write(data)
            os.replace(os.path.join(d, ".x"), os.path.join(d, name))
        return plain_load(*a, **k)

    ph.open_file = counted
    tier.load = load_after_damage
    mgr2 = mk()
    st = {"w": torch.zeros(N), "mine": safeckpt.PerRank(torch.zeros(4))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = mgr2.restore(st)
    want = _state(got, rank)
    exact = torch.equal(st["w"], want["w"]) and torch.equal(st["mine"].value, want["mine"].value)
    mgr2._last = None
    mgr2.close()
    return {"step": got, "exact": exact, "opened": opened, "warnings": [str(w.message)[:600] for w in caught]}


def _run(tmp_path, damage, node_of=(0, 1)):
    outs = dist_harness.run(_job, len(node_of), str(tmp_path / "root"), str(tmp_path / "nodes"), damage,
                            list(node_of), timeout=180)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
    return [o.value for o in outs]


def test_a_restore_loads_the_node_copies_through_the_recorded_digests(tmp_path):
    for v in _run(tmp_path, damage=False):
        assert v["step"] == 11 and v["exact"], v
        assert v["opened"] and all(o == "PrehashedFile+digests" for _, o in v["opened"]), v["opened"]


def test_on_a_node_of_two_ranks_each_rank_verifies_its_own_file_for_its_load(tmp_path):
    """Node 0: rank 0; node 1: ranks 1 and 2 (it holds rank 0's file as a replica, which sorts
    first). A node's files are hashed by its ranks in the verify, each data file by its own rank
    where that rank is on the node, so each rank's load of its own file takes the digests its
    verify kept (the others' files it reads are hashed by its load)."""
    for rank, v in enumerate(_run(tmp_path, damage=False, node_of=(0, 1, 1))):
        assert v["step"] == 11 and v["exact"], v
        own = [o for name, o in v["opened"] if name == f"rank-{rank:05d}.safetensors"]
        assert own and all(o == "PrehashedFile+digests" for o in own), (rank, v["opened"])


def test_a_copy_damaged_between_the_verify_and_the_load_is_never_loaded(tmp_path):
    outs = _run(tmp_path, damage=True)
    for v in outs:
        assert v["step"] == 10 and v["exact"], v  # the previous step, bit-exact, on every rank
    for v in outs:  # found by the load's own check of the file it opened
        assert any("step 11 could not be restored" in w and "CorruptCheckpoint" in w for w in v["warnings"]), v
