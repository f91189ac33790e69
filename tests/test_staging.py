"""Copying an async save's tensors aside (src/safeckpt/engine/staging.py), on CPU (no GPU in CI)."""

from __future__ import annotations

import pytest
import torch

from safeckpt.engine import staging as _staging


def _pairs():
    srcs = [torch.randn(7, 3), torch.arange(10, dtype=torch.int64), torch.randn(5).to(torch.bfloat16),
            torch.tensor(True), torch.randn(4, 4).t()]  # last one not contiguous
    bufs = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    return bufs, srcs


def test_cpu_copies_are_done_on_return():
    bufs, srcs = _pairs()
    pending = _staging.copy_aside(bufs, srcs)
    assert pending.events == []  # nothing left running for CPU sources
    pending.wait()
    for b, s in zip(bufs, srcs, strict=True):
        assert torch.equal(b, s)
        assert b.data_ptr() != s.data_ptr()


def test_falls_back_to_one_copy_per_tensor(monkeypatch):
    def refuse(dsts, srcs):
        raise RuntimeError("no foreach here")

    monkeypatch.setattr(torch, "_foreach_copy_", refuse)
    bufs, srcs = _pairs()
    _staging.copy_aside(bufs, srcs)
    for b, s in zip(bufs, srcs, strict=True):
        assert torch.equal(b, s)


def test_mismatched_lists_are_refused():
    bufs, srcs = _pairs()
    with pytest.raises(ValueError):
        _staging.copy_aside(bufs[:-1], srcs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_copies_are_ordered_before_later_work():
    src = torch.randn(1 << 20, device="cuda")
    want = src.cpu()
    buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    pending = _staging.copy_aside([buf], [src])
    src.mul_(0)  # the training step's next write: on the current stream, after the copy
    pending.wait()
    assert torch.equal(buf, want)
