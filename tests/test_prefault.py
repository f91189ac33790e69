"""Pages of a load's destination tensors are faulted in ahead of the copy, changing nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import time

import pytest
import torch

import safeckpt
import safeckpt.engine.load
from safeckpt.engine import prefault as _prefault
from safeckpt.engine.prefault import Prefault, page_ranges

PAGE = mmap.PAGESIZE
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def _resident_pages(t: torch.Tensor) -> int:
    """How many of the pages holding ``t`` are in memory (mincore)."""
    start = t.data_ptr() // PAGE * PAGE
    end = -(-(t.data_ptr() + t.nbytes) // PAGE) * PAGE
    n = (end - start) // PAGE
    vec = ctypes.create_string_buffer(n)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    assert libc.mincore(start, end - start, vec) == 0
    return sum(b & 1 for b in vec.raw)


_MAPS: list[mmap.mmap] = []  # kept open for the tensors that view them


def _untouched(nbytes: int) -> torch.Tensor:
    """A float32 tensor over a new anonymous map: its pages were never touched (the allocator
    may hand out reused memory, so torch.empty is not enough)."""
    m = mmap.mmap(-1, nbytes)
    _MAPS.append(m)
    t = torch.frombuffer(m, dtype=torch.float32)
    assert _resident_pages(t) == 0
    return t


def test_page_ranges_are_aligned_and_merged():
    base = torch.zeros(_prefault.MIN_TENSOR + 4 * PAGE, dtype=torch.uint8)
    a, b = base[10:-100], base[50 : -PAGE - 5]  # overlapping views of one buffer
    c = torch.zeros(512, 512).t()  # strided: the bytes it can reach
    ranges = page_ranges([a, b, c, torch.zeros(0), torch.zeros(1000)])  # the last two: too small
    assert ranges == sorted(ranges)
    for (start, end), nxt in zip(ranges, ranges[1:] + [None], strict=True):
        assert start % PAGE == 0 and end % PAGE == 0 and end > start
        assert nxt is None or nxt[0] > end  # merged: no two ranges overlap or touch
    lo, hi = base.data_ptr() + 10, base.data_ptr() + base.numel() - 100
    assert any(s <= lo and hi <= e for s, e in ranges)  # a and b in one range
    assert any(s <= c.data_ptr() and c.data_ptr() + 512 * 512 * 4 <= e for s, e in ranges)
    assert len(ranges) <= 2


def _populate_supported() -> bool:
    """MADV_POPULATE_WRITE is Linux 5.14+; older kernels refuse it (EINVAL)."""
    libc = _prefault._get_libc()
    if not libc:
        return False
    buf = mmap.mmap(-1, PAGE)  # freed with the process (a ctypes view pins it)
    return libc[0](ctypes.addressof(ctypes.c_char.from_buffer(buf)), PAGE, _prefault.MADV_POPULATE_WRITE) == 0


@linux_only
def test_prefault_populates_untouched_pages_and_keeps_contents():
    if not _populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    t = _untouched(48 << 20)
    t[: PAGE // 4].fill_(7.0)  # the first page written, the rest never touched
    pf = Prefault([t])
    assert pf.thread is not None, "a 48 MiB untouched tensor should be prefaulted"
    pf.thread.join()
    assert _resident_pages(t) == t.numel() * 4 // PAGE + (1 if t.data_ptr() % PAGE else 0)
    assert torch.equal(t[: PAGE // 4], torch.full((PAGE // 4,), 7.0))
    assert not t[PAGE // 4 :].any()  # untouched pages read as zeros, as before


@linux_only
def test_resident_and_small_targets_start_no_thread():
    assert Prefault([torch.ones(12 << 20)]).thread is None  # 48 MiB, every page written
    assert Prefault([torch.empty(1 << 20)]).thread is None  # 4 MiB: below MIN_BYTES


@linux_only
def test_stop_ends_the_thread_early(monkeypatch):
    calls = []
    real = _prefault._get_libc()
    if not real:
        pytest.skip("no madvise here")

    def slow_madvise(at, n, advice):
        calls.append(n)
        time.sleep(0.02)  # 32 calls would take 0.64 s
        return 0

    monkeypatch.setattr(_prefault, "_libc", (slow_madvise, real[1]))
    t = _untouched(256 << 20)
    pf = Prefault([t])
    pf.stop()
    assert pf.thread is None and len(calls) <= 3  # of 32 pieces


@linux_only
def test_load_into_untouched_targets_and_failed_load_changes_nothing(tmp_path, monkeypatch):
    started = []

    class Recording(Prefault):
        def __init__(self, tensors):
            super().__init__(tensors)
            started.append(self.thread is not None)

    monkeypatch.setattr(safeckpt.engine.load, "Prefault", Recording)
    torch.manual_seed(0)
    state = {"big": torch.randn(10 << 20), "small": torch.randn(100)}  # 40 MiB
    safeckpt.save(tmp_path / "ck", state)
    fresh = {"big": _untouched(40 << 20), "small": torch.empty(100)}
    safeckpt.load(tmp_path / "ck", fresh)
    assert started == [True], "the load should prefault its 40 MiB of untouched targets"
    assert torch.equal(fresh["big"], state["big"]) and torch.equal(fresh["small"], state["small"])

    # a flipped byte late in the data file: the load fails; untouched targets stay zeros
    data = tmp_path / "ck" / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1000] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = {"big": _untouched(40 << 20), "small": torch.full((100,), 3.0)}
    target["big"][:8].fill_(5.0)
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.load(tmp_path / "ck", target)
    assert started == [True, True]
    assert torch.equal(target["big"][:8], torch.full((8,), 5.0)) and not target["big"][8:].any()
    assert torch.equal(target["small"], torch.full((100,), 3.0))


@linux_only
def test_populate_faults_in_a_fresh_tensor_at_once_keeping_contents():
    if not _populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    t = _untouched(8 << 20)
    t[:10].fill_(3.0)
    _prefault.populate(t)
    assert _resident_pages(t) == (8 << 20) // PAGE
    assert torch.equal(t[:10], torch.full((10,), 3.0)) and not t[10:].any()
    small = _untouched(_prefault.MIN_TENSOR // 2)  # below the size worth a call: left alone
    _prefault.populate(small)
    assert _resident_pages(small) == 0


class _Holder:
    """A stateful object: its state is read into new tensors (not copied in place)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict) -> None:
        self.tensors = dict(sd)


def test_new_tensors_of_a_load_are_populated_before_the_read(tmp_path, monkeypatch):
    import safeckpt.engine.reader

    seen = []
    real = safeckpt.engine.reader.populate

    def recording(t: torch.Tensor) -> None:  # (bytes, whether the saved values are in it yet)
        seen.append((t.nbytes, t.shape == saved["big"].shape and torch.equal(t, saved["big"])))
        real(t)

    monkeypatch.setattr(safeckpt.engine.reader, "populate", recording)
    torch.manual_seed(0)
    saved = {"big": torch.randn(1 << 20), "tiny": torch.randn(10)}
    safeckpt.save(tmp_path / "ck", {"holder": _Holder(**saved)})
    holder = _Holder()
    safeckpt.load(tmp_path / "ck", {"holder": holder})
    assert torch.equal(holder.tensors["big"], saved["big"]) and torch.equal(holder.tensors["tiny"], saved["tiny"])
    assert (4 << 20, False) in seen  # the 4 MiB tensor, before its bytes were read into it
