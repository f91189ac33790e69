"""The streamed writer's early writeback (sync_file_range + page-cache drop) keeps files exact."""

from __future__ import annotations

import pytest
import torch

import safeckpt
from safeckpt.format import shardfile as _shardfile


def _assert_round_trip(path, state):
    """The checkpoint at ``path`` verifies deep and loads back exactly ``state``."""
    assert safeckpt.verify(path, deep=True).ok
    target = {k: torch.empty_like(v) for k, v in state.items()}
    safeckpt.load(path, target)
    for k, v in state.items():
        assert torch.equal(target[k], v), k


def test_small_writeback_windows_round_trip(tmp_path, monkeypatch):
    # Tiny windows and pieces so that every code path (start, wait, drop) runs many times,
    # including windows that end in the middle of a tensor.
    monkeypatch.setattr(_shardfile, "WRITEBACK_WINDOW", 12_288)
    monkeypatch.setattr(_shardfile, "PIECE", 5_000)
    calls = []
    real = _shardfile._EarlyWriteback.advance

    def spy(self, pos):
        calls.append(pos)
        real(self, pos)

    monkeypatch.setattr(_shardfile._EarlyWriteback, "advance", spy)
    g = torch.Generator().manual_seed(0)
    state = {
        "a": torch.randn(97, 53, generator=g),
        "b": torch.randn(3001, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 1 << 40, (777,), generator=g),
        "d": torch.zeros(0, 4),
    }
    safeckpt.save(tmp_path / "ck", state)
    assert calls == sorted(calls) and len(calls) >= 6
    _assert_round_trip(tmp_path / "ck", state)


def test_short_writes_are_resumed(tmp_path, monkeypatch):
    # The kernel may write less than asked (a signal, a full pipe of a FUSE mount): every
    # buffer must still land once, in order, including one cut in the middle.
    real = _shardfile.os.writev
    sizes = []

    def short_writev(fd, bufs):
        bufs = list(bufs)
        sizes.append(len(bufs))
        head = memoryview(bufs[0]).cast("B")
        return real(fd, [head[: max(1, len(head) // 3)]] if len(sizes) % 2 else bufs[:2])

    monkeypatch.setattr(_shardfile.os, "writev", short_writev)
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(i + 1, 7, generator=g) for i in range(40)}
    safeckpt.save(tmp_path / "ck", state)
    assert len(sizes) > 40  # the short writes really happened
    _assert_round_trip(tmp_path / "ck", state)


def test_a_tensor_resized_during_the_save_publishes_nothing(tmp_path, monkeypatch):
    # The header is written before the bytes; a tensor whose bytes no longer match the header
    # (resized by another thread mid-save) must fail the save, never publish a torn file.
    real = _shardfile.tensor_bytes
    monkeypatch.setattr(_shardfile, "tensor_bytes", lambda t: real(t)[:-4] if t.numel() == 10 else real(t))
    with pytest.raises(safeckpt.CheckpointError, match="changed size while it was being saved"):
        safeckpt.save(tmp_path / "ck", {"a": torch.ones(10), "b": torch.ones(3)})
    assert not (tmp_path / "ck").exists()
