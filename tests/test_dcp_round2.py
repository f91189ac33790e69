"""safeckpt.dcp, issue 29: what DCP users' frameworks need (bytes items, DCP's .metadata, a
failed save's staging removed, framework step names, a pointer either way between stock DCP
and safeckpt checkpoints). Real DCP, real processes (gloo on 127.0.0.1, hard timeouts)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import safeckpt
from tests.helpers import dist_harness
from tests.test_dcp import _forbid_unpickling

dcp = pytest.importorskip("torch.distributed.checkpoint")
import safeckpt.dcp  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class Custom:
    pass


def _state(rank: int) -> dict:
    torch.manual_seed(0)
    return {
        "w": torch.randn(6, 4),
        # torchtitan's dataloader: each rank's own position, pickle.dumps bytes; empty bytes too
        "dataloader": {f"dp_rank_{rank}": pickle.dumps({"rank": rank, "yielded": 40 + rank}), "world_size": 2},
        "blobs": {"empty": b"", "shared": bytes(range(256)) * 3},
        "epoch": 5,
    }


def _blank(rank: int) -> dict:
    return {"w": torch.zeros(6, 4), "dataloader": {f"dp_rank_{rank}": b"", "world_size": 0},
            "blobs": {"empty": b"x", "shared": b""}, "epoch": 0}


def _two_ranks(rank, world, root):
    import torch.distributed as dist

    out = {}
    ckpt = os.path.join(root, "step-6")  # torchtitan's name: the manifest records step 6
    dcp.save(_state(rank), storage_writer=safeckpt.dcp.StorageWriter(ckpt, dot_metadata=True))
    target = _blank(rank)
    dcp.load(target, storage_reader=safeckpt.dcp.StorageReader(ckpt))
    out["loaded"] = {"dl": target["dataloader"], "blobs": target["blobs"], "epoch": target["epoch"],
                     "w": torch.equal(target["w"], _state(rank)["w"])}

    # Stock DCP's reader: one line naming safeckpt.dcp.StorageReader, nothing copied
    target = _blank(rank)
    try:
        dcp.load(target, checkpoint_id=ckpt)
        out["stock"] = "no error"
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException
        out["stock"] = str(exc)
    out["stock_untouched"] = not target["w"].any() and target["dataloader"][f"dp_rank_{rank}"] == b""

    # A save that fails on rank 1 only (an object JSON cannot hold): RankFailure on both
    # ranks naming rank 1 and the key, nothing published, no staging left (rank 0 removed it)
    bad = _state(rank)
    if rank == 1:
        bad["extra"] = Custom()
    else:
        bad["extra"] = 3
    out["failed"] = dist_harness.attempt(lambda: _translated(bad, os.path.join(root, "failed")))
    dist.barrier()
    out["failed_leftovers"] = dist_harness.leftovers(root)
    out["failed_exists"] = os.path.exists(os.path.join(root, "failed"))

    # Saving over an existing checkpoint: refused with overwrite=False, replaced by default (as
    # stock DCP overwrites)
    again = _state(rank)
    again["epoch"] = 6
    out["exists"] = dist_harness.attempt(lambda: _translated(again, ckpt, overwrite=False))
    dcp.save(again, storage_writer=safeckpt.dcp.StorageWriter(ckpt))
    target = _blank(rank)
    dcp.load(target, storage_reader=safeckpt.dcp.StorageReader(ckpt))
    out["replaced_epoch"] = target["epoch"]
    dist.barrier()
    out["leftovers"] = dist_harness.leftovers(root)
    return out


def _translated(state, path, **kw):
    with safeckpt.dcp.translate_errors():
        dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(path, **kw))


def test_bytes_dot_metadata_failed_save_and_overwrite_at_two_ranks(tmp_path, monkeypatch):
    root = str(tmp_path)
    outs = dist_harness.run(_two_ranks, 2, root, timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message, o.exitcode)
    for rank, o in enumerate(outs):
        v = o.value
        # bytes come back as the same bytes, each rank its own, the shared and the empty ones too
        assert v["loaded"]["dl"] == _state(rank)["dataloader"], v["loaded"]
        assert v["loaded"]["blobs"] == {"empty": b"", "shared": bytes(range(256)) * 3}
        assert v["loaded"]["epoch"] == 5 and v["loaded"]["w"]
        # stock FileSystemReader: the pointer line, not an unpickling error, and nothing copied
        assert "safeckpt.dcp.StorageReader" in v["stock"] and "safeckpt checkpoint" in v["stock"], v["stock"]
        assert "npickl" not in v["stock"] and "invalid load key" not in v["stock"], v["stock"]
        assert v["stock_untouched"]
        f = v["failed"]
        assert not f["ok"] and f["type"] == "RankFailure", f
        assert "rank(s) 1" in f["msg"] and "'extra'" in f["msg"] and "Custom" in f["msg"], f["msg"]
        assert "staging directory was removed" in f["msg"], f["msg"]
        assert v["failed_leftovers"] == [] and not v["failed_exists"]
        assert not v["exists"]["ok"] and v["exists"]["type"] == "CheckpointExists", v["exists"]
        assert v["replaced_epoch"] == 6
        assert v["leftovers"] == []
    ckpt = os.path.join(root, "step-6")
    assert sorted(os.listdir(ckpt)) == [".metadata", "dcp_metadata.json", "manifest.json",
                                        "rank-00000.safetensors", "rank-00001.safetensors"]
    report = safeckpt.verify(ckpt)
    assert report.ok and report.step == 6, report
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert man["step"] == 6
    dot = man["extra"][".metadata"]  # covered by the manifest's checksums: verify checks it
    raw = open(os.path.join(ckpt, ".metadata"), "rb").read()
    import xxhash

    assert dot == {"size": len(raw), "xxh3_128": xxhash.xxh3_128_hexdigest(raw)}
    # .metadata is DCP's own Metadata: what tools that read it (format_utils, torchtitan) expect
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

    meta = pickle.loads(raw)
    assert isinstance(meta, Metadata)
    assert isinstance(meta.state_dict_metadata["w"], TensorStorageMetadata)
    assert isinstance(meta.state_dict_metadata["dataloader.dp_rank_1"], BytesStorageMetadata)
    assert all(i.transform_descriptors[0].startswith("this is a safeckpt checkpoint")
               for i in meta.storage_data.values())
    # offline: the bytes as a uint8 tensor (safeckpt never unpickles them)
    flat = safeckpt.read_state_dict(ckpt)
    assert bytes(flat["dataloader/dp_rank_1"].numpy()) == _state(1)["dataloader"]["dp_rank_1"]
    assert flat["blobs/empty"].dtype == torch.uint8 and flat["blobs/empty"].numel() == 0
    # one process, nothing unpickled (the reader never opens .metadata): rank 1's bytes
    _forbid_unpickling(monkeypatch)
    target = _blank(1)
    dcp.load(target, storage_reader=safeckpt.dcp.StorageReader(ckpt), no_dist=True)
    assert target["dataloader"]["dp_rank_1"] == _state(1)["dataloader"]["dp_rank_1"]
    assert target["epoch"] == 6




# ----------------------------------------------------------------------------- single process
def _save1(path, state, **kw):
    dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(path, **kw), no_dist=True)


def test_damaged_bytes_are_corrupt_checkpoint_and_target_untouched(tmp_path):
    path = str(tmp_path / "c")
    blob = b"\x01\x02" * 500
    _save1(path, {"w": torch.ones(4), "blob": blob})
    man = json.load(open(os.path.join(path, "manifest.json")))
    rec = man["tensors"]["blob"]["chunks"][0]
    with open(os.path.join(path, rec["file"]), "r+b") as f:
        f.seek(rec["start"] + 3)
        f.write(b"\xff")
    target = {"w": torch.zeros(4), "blob": b""}
    with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum mismatch"):
        with safeckpt.dcp.translate_errors():
            dcp.load(target, storage_reader=safeckpt.dcp.StorageReader(path), no_dist=True)
    assert target == {"w": target["w"], "blob": b""} and not target["w"].any()  # nothing copied


def test_other_objects_still_refused_with_their_key(tmp_path):
    with pytest.raises(BaseException) as info:
        _save1(str(tmp_path / "c"), {"w": torch.ones(2), "state": {"buf": bytearray(b"ab")}})
    assert "'state.buf'" in str(info.value) and "bytearray" in str(info.value)
    assert os.listdir(tmp_path) == []  # no checkpoint, no staging


def test_step_from_framework_names(tmp_path):
    for name, step in (("step-6", 6), ("checkpoint-40", 40), ("checkpoint_7", 7), ("global_step12", 12),
                       ("epoch=1-step=30.ckpt", 30), ("step-0000000200", 200), ("last.ckpt", None)):
        path = str(tmp_path / name)
        _save1(path, {"w": torch.ones(2)})
        assert json.load(open(os.path.join(path, "manifest.json")))["step"] == step, name
    _save1(str(tmp_path / "step-9x"), {"w": torch.ones(2)}, step=3)  # given: wins over the name
    assert json.load(open(str(tmp_path / "step-9x" / "manifest.json")))["step"] == 3


def test_stock_dcp_checkpoint_with_safeckpt_reader_points_to_the_importer(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=path, no_dist=True)
    with pytest.raises(safeckpt.CheckpointError) as info:
        with safeckpt.dcp.translate_errors():
            dcp.load({"w": torch.zeros(3)}, storage_reader=safeckpt.dcp.StorageReader(path), no_dist=True)
    msg = str(info.value)
    assert f"safeckpt convert --from dcp {path} " in msg and "\n" not in msg, msg
    # and the importer it names works on it
    from safeckpt import cli

    assert cli.main(["convert", "--from", "dcp", path, str(tmp_path / "imported")]) == 0
    assert torch.equal(safeckpt.read_state_dict(str(tmp_path / "imported"))["model/w"], torch.ones(3))


def test_dot_metadata_is_refused_on_an_object_store_url():
    pytest.importorskip("fsspec")
    with pytest.raises(ValueError, match="dot_metadata"):
        safeckpt.dcp.StorageWriter("memory://bucket/ckpt", dot_metadata=True)


def test_dot_metadata_is_checked_by_verify(tmp_path):
    """DCP's .metadata is listed in the manifest's extra files with its size and checksum, so
    `safeckpt verify` (and a restore's pick) notice it changed; safeckpt never reads it to load."""
    path = str(tmp_path / "step-3")
    dcp.save({"w": torch.arange(6.0)}, storage_writer=safeckpt.dcp.StorageWriter(path), no_dist=True)
    assert safeckpt.verify(path).ok
    dot = os.path.join(path, ".metadata")
    raw = bytearray(open(dot, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(dot, "wb").write(bytes(raw))
    report = safeckpt.verify(path)
    assert not report.ok and any(".metadata" in p for p in report.problems), report.problems
    target = {"w": torch.zeros(6)}  # loading never opens it
    dcp.load(target, storage_reader=safeckpt.dcp.StorageReader(path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(6.0))
