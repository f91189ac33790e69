"""A data file's safetensors header must agree with safeckpt's index of it (review of issue 30).

safeckpt reads a file by the byte ranges of its checked index, but every other safetensors
reader (``from_pretrained``, ``safe_open``) goes by the header's names and ``data_offsets``. A
renamed tensor or two same-shaped tensors' offsets swapped in the header leave every chunk
checksum intact, so before this check a load accepted the file while ``from_pretrained`` read
wrong weights. The index now carries the xxh3-64 of the header's tensor entries; every rank
checks it when it reads a file's index (one small read per file it needs), so a load raises
``CorruptCheckpoint`` and a manager's restore falls back to the previous step. Checkpoints
written before (no such checksum) still load.
"""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt.engine.request import NamedLayout
from safeckpt.format import fileindex
from safeckpt.format.fileindex import HEADER_ENTRY_BYTES, IndexBuilder
from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(180)

LAYOUT = {"model.safetensors": {"a.weight": "model/a.weight", "b.weight": "model/b.weight",
                                "b.bias": "model/b.bias"}}


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8)


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": Two(), "w": torch.randn(4, 4), "v": torch.randn(4, 4)}


def _mutate(path: str, kind: str, a: str, b: str) -> None:
    """Rewrite the header of ``path`` in place, keeping its length: ``rename`` changes the first
    letter of tensor ``a``'s name; ``swap`` swaps the data_offsets of ``a`` and ``b``."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8:8 + n])
    if kind == "rename":
        hdr["X" + a[1:]] = hdr.pop(a)
    else:
        hdr[a]["data_offsets"], hdr[b]["data_offsets"] = hdr[b]["data_offsets"], hdr[a]["data_offsets"]
    text = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(text) <= n
    with open(path, "wb") as f:
        f.write(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


def _fresh() -> dict:
    return _state(99)


@pytest.mark.parametrize("kind", ["rename", "swap"])
def test_a_damaged_rank_file_header_is_corrupt(tmp_path, kind) -> None:
    ck = str(tmp_path / "ck")
    safeckpt.save(ck, _state(0))
    _mutate(os.path.join(ck, "rank-00000.safetensors"), kind, "w", "v")
    with pytest.raises(safeckpt.CorruptCheckpoint, match="safetensors header does not match its index"):
        safeckpt.load(ck, _fresh())
    report = safeckpt.verify(ck)
    assert not report.ok and any("header" in p for p in report.problems), report.problems


@pytest.mark.parametrize("kind", ["rename", "swap"])
def test_a_damaged_named_file_header_is_corrupt_and_restore_falls_back(tmp_path, kind) -> None:
    root = str(tmp_path / "root")
    mgr = safeckpt.CheckpointManager(root, keep_last=3)
    saved = {}
    for step in (1, 2):
        state = _state(step)
        mgr.save(step, state, named=NamedLayout(LAYOUT))
        saved[step] = {k: v.clone() for k, v in state["model"].state_dict().items()}
    mgr.close()
    ck2 = os.path.join(root, sorted(os.listdir(root), key=lambda n: int(re.sub(r"\D", "", n) or 0))[-1])
    assert os.path.exists(os.path.join(ck2, "model.safetensors")), os.listdir(ck2)
    # a.weight and b.weight have the same shape and dtype: the swap keeps every chunk's
    # checksum and every range's dtype and shape right; only the names say which is which.
    _mutate(os.path.join(ck2, "model.safetensors"), kind, "a.weight", "b.weight")

    with pytest.raises(safeckpt.CorruptCheckpoint, match="model.safetensors"):
        safeckpt.load(ck2, _fresh())
    assert not safeckpt.verify(ck2).ok

    fresh = _fresh()
    mgr = safeckpt.CheckpointManager(root, keep_last=3)
    with pytest.warns(UserWarning, match="corrupt"):
        assert mgr.restore(fresh) == 1  # the previous step, loaded in full
    mgr.close()
    got = fresh["model"].state_dict()
    assert all(torch.equal(got[k], saved[1][k]) for k in saved[1])


def _two_ranks(rank: int, world: int, root: str, kind: str) -> dict:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Two())
    state = {"model": model, "mine": safeckpt.PerRank({"x": torch.full((4, 4), float(rank)),
                                                       "y": torch.full((4, 4), -1.0 - rank)})}
    safeckpt.save(f"{root}/ck", state)
    torch.distributed.barrier()
    if rank == 0:  # rank 1's own file: only rank 1 reads its per-rank tensors
        path = f"{root}/ck/rank-00001.safetensors"
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names = sorted(k for k in json.loads(f.read(n)) if k.startswith("mine"))
        assert len(names) == 2, names
        _mutate(path, kind, *names)
    torch.distributed.barrier()
    fresh = {"model": Two(), "mine": safeckpt.PerRank({"x": torch.zeros(4, 4), "y": torch.zeros(4, 4)})}
    try:
        safeckpt.load(f"{root}/ck", fresh)
    except safeckpt.CorruptCheckpoint as exc:
        return {"raised": "CorruptCheckpoint", "msg": str(exc)}
    return {"raised": None}


@pytest.mark.parametrize("kind", ["rename", "swap"])
def test_two_ranks_refuse_together_when_one_ranks_file_header_is_damaged(tmp_path, kind) -> None:
    # per-rank tensors make the two ranks' files differ; the damage is in rank 1's file, which
    # rank 0 never reads: rank 1 finds it and every rank raises.
    outs = dist_harness.run(_two_ranks, 2, str(tmp_path), kind, timeout=120)
    assert all(o.ok for o in outs), [o.message for o in outs]
    assert [o.value["raised"] for o in outs] == ["CorruptCheckpoint"] * 2, [o.value for o in outs]
    assert any("rank-00001.safetensors" in o.value["msg"] for o in outs), [o.value for o in outs]


def test_checkpoints_without_the_header_checksum_still_load(tmp_path, monkeypatch) -> None:
    # An index as written before the checksum: the same text without its "header" entry.
    new_call = IndexBuilder.__call__

    def old_call(self, names, spans, trees):  # type: ignore[no-untyped-def]
        tail = new_call(self, names, spans, trees)
        tail._texts[0] = re.sub(r',"header":"[0-9a-f]{16}"', "", tail._texts[0])
        tail.size -= HEADER_ENTRY_BYTES
        return tail

    monkeypatch.setattr(IndexBuilder, "__call__", old_call)
    ck = str(tmp_path / "old")
    state = _state(0)
    safeckpt.save(ck, state, named=NamedLayout(LAYOUT))
    monkeypatch.undo()
    with open(os.path.join(ck, "rank-00000.safetensors"), "rb") as f:
        assert b'"header":"' not in f.read()
    fresh = _fresh()
    safeckpt.load(ck, fresh)
    assert torch.equal(fresh["w"], state["w"])
    assert all(torch.equal(fresh["model"].state_dict()[k], v) for k, v in state["model"].state_dict().items())
    assert safeckpt.verify(ck).ok


def test_new_indexes_fit_the_bound_readers_before_the_checksum_applied(tmp_path) -> None:
    # A reader without the checksum bounds an index by the manifest without HEADER_ENTRY_BYTES:
    # the slack of its fixed allowance takes the new entry, so such readers still read new files.
    from safeckpt.format.v3 import Layout
    from safeckpt.storage.base import storage_for

    ck = str(tmp_path / "ck")
    safeckpt.save(ck, {"x": torch.zeros(1)})
    safeckpt.save(str(tmp_path / "n"), {"model": nn.Linear(1, 1, bias=False)},
                  named=NamedLayout({"m.safetensors": {"w": "model/weight"}}))
    for path in (ck, str(tmp_path / "n")):
        man = json.load(open(os.path.join(path, "manifest.json")))
        layout = Layout(man, path, storage_for(path), lambda d: 4)
        for name, rec in man["files"].items():
            start, end, _ = rec["index"]
            rank = int(rec["rank"])
            extra = HEADER_ENTRY_BYTES if rank < man["world_size"] else 2 * HEADER_ENTRY_BYTES
            assert end - start <= layout.index_limit(rank, int(rec["size"])) - extra, (path, name)
    assert fileindex.header_digest([("a", 0, 4, [1])]) != fileindex.header_digest([("b", 0, 4, [1])])
