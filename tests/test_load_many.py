"""Loads of many small tensors take shortcuts; each must behave exactly like the general path.
(The manifest validation's fast path is tested in test_validation.py.)

- small whole chunks lying back to back in a file are verified with one read per run and
  copied in place with one ``preadv`` per run: a flipped byte in any one of them still fails
  the load before the state is touched, and fresh tensors (stateful objects,
  ``read_state_dict``) are still verified as they are read;
- short reads, gaps between the needed chunks, non-contiguous and large targets still load the
  right values; GC is paused for the load and back on afterwards, whatever happened.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import safeckpt
from safeckpt.engine import reader as _reader
from safeckpt.engine.reader import open_manifest

DATA = "rank-00000.safetensors"


def _flat(n: int, seed: int, shape: tuple[int, ...] = (64, 64)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(shape, generator=g) for i in range(n)}


def _manifest(path) -> dict:
    """The manifest with every chunk (format 3 keeps them in the files' indexes)."""
    return open_manifest(str(path))


def _by_file_order(man: dict) -> list[tuple[str, dict]]:
    chunks = [(k, c) for k, rec in man["tensors"].items() for c in rec.get("chunks", ())]
    return sorted(chunks, key=lambda kc: kc[1]["start"])


def _flip(path, pos: int) -> None:
    with open(path / DATA, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


class _Holder:
    """A stateful object whose state is a dict of tensors (read into fresh tensors)."""

    def __init__(self, n: int, seed: int) -> None:
        self.sd = _flat(n, seed, (4, 4))

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = dict(sd)


@pytest.fixture
def many(tmp_path):
    """300 tensors of 16 KiB: more than one run of 4 MiB (256 chunks) in the file."""
    path = tmp_path / "ck"
    safeckpt.save(path, _flat(300, 1))
    return path


@pytest.mark.parametrize("nth", [0, 1, 255, 256, 299])
def test_flipped_byte_in_one_of_many_small_chunks_fails_with_state_unchanged(many, nth):
    key, c = _by_file_order(_manifest(many))[nth]
    _flip(many, c["start"] + 100)
    state = _flat(300, 2)
    before = {k: v.clone() for k, v in state.items()}
    with pytest.raises(safeckpt.CorruptCheckpoint, match=f"checksum mismatch .*tensor '{key}'"):
        safeckpt.load(many, state)
    assert all(torch.equal(state[k], before[k]) for k in state)
    with pytest.raises(safeckpt.CorruptCheckpoint, match=f"tensor '{key}'"):
        safeckpt.read_state_dict(many)  # fresh tensors: hashed as they are read
    assert safeckpt.load(many, state, verify_checksums=False)  # the damaged bytes, unverified
    assert not torch.equal(state[key], _flat(300, 1)[key])


def test_reader_verifies_a_run_before_copying_into_it_even_without_a_check(many):
    """fill_many's contract, as fill_box's: every chunk is verified before anything is copied
    out of it, also when no check_many ran first (a load always runs one)."""
    key, c = _by_file_order(_manifest(many))[10]
    _flip(many, c["start"] + 1)
    state = _flat(300, 2)
    before = {k: v.clone() for k, v in state.items()}
    reader = _reader.TensorReader(str(many), _manifest(many))
    reader.threads = 1
    try:
        with pytest.raises(safeckpt.CorruptCheckpoint, match=f"tensor '{key}'"):
            reader.fill_many(list(state.items()))
    finally:
        reader.close()
    run = [k for k, _ in _by_file_order(_manifest(many))[:256]]  # the run holding the damage
    assert all(torch.equal(state[k], before[k]) for k in run)


def test_flipped_byte_in_fresh_tensors_of_a_stateful_object_fails_before_any_is_loaded(tmp_path):
    path = tmp_path / "ck"
    safeckpt.save(path, {"holder": _Holder(200, 1), "w": torch.ones(3)})
    man = _manifest(path)
    key, c = next((k, c) for k, c in _by_file_order(man) if k.startswith("holder/"))
    _flip(path, c["start"] + 5)
    holder, w = _Holder(200, 2), torch.zeros(3)
    before = dict(holder.sd)
    with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum mismatch"):
        safeckpt.load(path, {"holder": holder, "w": w})
    assert holder.sd == before and torch.equal(w, torch.zeros(3))


def test_many_small_tensors_are_read_in_runs(many, monkeypatch):
    calls = []
    real = os.preadv

    def counting(fd, bufs, offset, *args):
        calls.append(len(bufs))
        return real(fd, bufs, offset, *args)

    monkeypatch.setattr(os, "preadv", counting)
    state = _flat(300, 2)
    safeckpt.load(many, state)
    assert all(torch.equal(state[k], v) for k, v in _flat(300, 1).items())
    assert len(calls) < 20, calls  # header, 2 runs verified, 2 runs copied (was 600+)
    assert max(calls) == 256


def test_short_reads_are_completed(many, monkeypatch):
    real = os.preadv

    def short(fd, bufs, offset, *args):
        if len(bufs) > 1:  # a vectored read stops half-way through its second buffer
            return real(fd, [bufs[0], memoryview(bufs[1])[: len(memoryview(bufs[1])) // 2]], offset)
        return real(fd, bufs, offset, *args)

    monkeypatch.setattr(os, "preadv", short)
    state = _flat(300, 2)
    safeckpt.load(many, state)
    assert all(torch.equal(state[k], v) for k, v in _flat(300, 1).items())
    back = safeckpt.read_state_dict(many)
    assert all(torch.equal(back[k], v) for k, v in _flat(300, 1).items())


def test_mixed_targets_load_the_right_values(tmp_path, monkeypatch):
    """Large chunks, a scalar, an empty tensor, bf16, a non-contiguous target, a subset of the
    saved tensors (gaps between runs), and a small chunk limit that splits runs."""
    monkeypatch.setattr(_reader, "SMALL_CHUNK", 64 << 10)
    g = torch.Generator().manual_seed(3)
    saved = {**_flat(50, 4, (8, 8)), "big": torch.randn(512, 256, generator=g), "scalar": torch.tensor(7.0),
             "empty": torch.empty(0, 4), "half": torch.randn(33, generator=g).to(torch.bfloat16),
             "wide": torch.randn(4, 8, generator=g)}
    path = tmp_path / "ck"
    safeckpt.save(path, saved)
    state = {k: torch.zeros_like(v) for k, v in saved.items()}
    state["wide"] = torch.zeros(8, 4).t()  # non-contiguous target: read through the general path
    for k in [k for k in state if k.startswith("t")][::3]:
        del state[k]  # not loaded: the runs skip their chunks
    info = safeckpt.load(path, state, strict=False)
    assert info.skipped
    for k, v in state.items():
        assert torch.equal(v, saved[k]), k
    assert not state["wide"].is_contiguous()


def test_gc_is_paused_during_a_load_and_on_again_after(many):
    seen = []

    class Probe:
        def state_dict(self) -> dict:
            return {"n": 1}

        def load_state_dict(self, sd: dict) -> None:
            seen.append(gc.isenabled())

    safeckpt.save(many.parent / "probe", {"p": Probe()})
    assert gc.isenabled()
    safeckpt.load(many.parent / "probe", {"p": Probe()})
    assert seen == [False] and gc.isenabled()
    _flip(many, _by_file_order(_manifest(many))[3][1]["start"])
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.load(many, _flat(300, 2))
    assert gc.isenabled()


def test_unmappable_files_are_hashed_through_reads(tmp_path, monkeypatch):
    # Some FUSE mounts refuse mmap: checksums are then computed from preadv reads, and a
    # damaged chunk is still refused before anything is copied.
    from safeckpt.format import shardfile as _shardfile

    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(300_000, generator=g), **{f"s{i}": torch.randn(50, generator=g) for i in range(20)}}
    safeckpt.save(tmp_path / "ck", state)
    tried = []
    real_mmap = _shardfile.mmap.mmap

    def refuse(fd, size, access=None, **kw):
        if access == _shardfile.mmap.ACCESS_READ:
            tried.append(size)
            raise OSError(19, "No such device")
        return real_mmap(fd, size, access=access, **kw)

    monkeypatch.setattr(_shardfile.mmap, "mmap", refuse)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    safeckpt.load(tmp_path / "ck", target)
    assert tried  # the mapping was refused, so the read path ran
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    for flip in (-5, 4096):  # a byte of the last small tensor, then of the big one
        data = next(p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors")
        raw = bytearray(data.read_bytes())
        raw[flip] ^= 0xFF
        data.write_bytes(bytes(raw))
        before = {k: v.clone() for k, v in target.items()}
        with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum mismatch"):
            safeckpt.load(tmp_path / "ck", target)
        for k, v in before.items():
            assert torch.equal(target[k], v), k
        raw[flip] ^= 0xFF
        data.write_bytes(bytes(raw))



def _mapped_rss(path: str) -> int | None:
    """Resident bytes of this process's mappings of ``path`` (None: not mapped)."""
    found, total = False, 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) >= 6 and head[5] == path
                found = found or inside
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total if found else None


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc")
def test_hashing_in_place_keeps_file_pages_out_of_resident_memory(tmp_path, monkeypatch):
    # The checksum pass hashes through a mapping of the data file; hashed pages are unmapped
    # again (every RELEASE_BYTES and at the end of each call), so the process's resident
    # memory does not grow by the file.
    from safeckpt.format import shardfile as _shardfile

    monkeypatch.setattr(_shardfile, "RELEASE_BYTES", 4 << 20)
    state = {"big": torch.randn(48 << 20 >> 2), "small": torch.randn(1000)}  # 48 MiB
    safeckpt.save(tmp_path / "ck", state)
    during, after = [], []
    real_update = _shardfile.xxhash.xxh3_64

    class Spy:  # wraps the streaming hash to look at the mapping while it is being hashed
        def __init__(self):
            self.h = real_update()

        def update(self, data):
            self.h.update(data)
            during.append(_mapped_rss(path))

        def hexdigest(self):
            return self.h.hexdigest()

    real = _shardfile.MappedFile._hash_mapped

    def watch(self, mm, spans, step, keep):
        out = real(self, mm, spans, step, keep)
        after.append(_mapped_rss(self.path))
        return out

    monkeypatch.setattr(_shardfile.xxhash, "xxh3_64", Spy)
    monkeypatch.setattr(_shardfile.MappedFile, "_hash_mapped", watch)
    path = str(next(p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors").resolve())
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    safeckpt.load(tmp_path / "ck", target)
    assert after and during and None not in during, "the in-place hash did not run"
    # each reading thread keeps at most RELEASE_BYTES + one step mapped: 2 x 8 MiB of 48
    bound = 2 * (4 << 20) + 2 * _shardfile.HASH_BUFFER
    seen = max(during + [a or 0 for a in after])
    assert seen <= bound, f"{seen >> 20} MiB of the 48 MiB file mapped while hashing"
    assert _mapped_rss(path) is None  # and the mapping is gone once the load returns
    assert torch.equal(target["big"], state["big"])



def test_unmapping_hashed_pages_at_the_end_of_a_file(tmp_path):
    # Ranges that end at (or start at) the end of a page-aligned file: madvise refuses a start
    # at the very end, so an empty range there must be skipped, not passed on (ValueError).
    import mmap as _mmap

    from safeckpt.format.shardfile import _unmap

    path = tmp_path / "f"
    path.write_bytes(b"x" * (2 * _mmap.PAGESIZE))
    with open(path, "rb") as f, _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ) as mm:
        assert mm[0] == ord("x")
        _unmap(mm, 2 * _mmap.PAGESIZE, 2 * _mmap.PAGESIZE)  # empty, at the end
        _unmap(mm, _mmap.PAGESIZE + 5, 2 * _mmap.PAGESIZE)  # the last page, from mid-page
        _unmap(mm, 3, 3)
        assert mm[-1] == ord("x")  # pages come back from the page cache
