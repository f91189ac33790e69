"""safeckpt.dcp on an object store: dcp.save / dcp.load through a real S3 HTTP server (moto's,
on 127.0.0.1) with s3fs, at 2 ranks (gloo), hard timeouts.

- run A: an FSDP2 model + AdamW + plain values saved and loaded back at 2 ranks (and in this
  process, 1 rank, into a plain model), async_save (thread and process mode), overwrite, and a
  CheckpointManager root of DCP checkpoints with retention: what is left under each prefix
  is exactly the manifest and the data objects it names.
- run B: rank 1 SIGKILLed after the first part of its multipart upload: nothing is visible at
  the new path (no manifest; both readers say CheckpointNotFound), the previous checkpoint
  still loads, and ``safeckpt gc`` removes the leftovers, the killed upload included.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

import safeckpt
from safeckpt import cli
from tests.helpers import dist_harness, s3_harness

pytest.importorskip("s3fs")
pytest.importorskip("moto")
dcp = pytest.importorskip("torch.distributed.checkpoint")
import safeckpt.dcp  # noqa: E402  (after the skip: needs torch.distributed.checkpoint)
from safeckpt.storage.base import storage_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SMALL_PART = 5 << 20  # S3's minimum part size: a rank's 12 MiB shard is a 3-part upload


@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def endpoint(request):
    """moto's S3 server and SeaweedFS (a real S3 server enforcing conditional writes)."""
    with s3_harness.server(request.param) as ep:
        yield ep


def _model(seed: int, wide: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    if wide:  # 24 MiB of weight: 12 MiB per rank
        return nn.Sequential(nn.Linear(1024, 6144, bias=False))
    return nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 5))


def _fsdp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, model[0].in_features, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full(sd: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist() for k, v in sd.items()}


def _objects(endpoint: str, prefix: str) -> list[str]:
    fs = s3_harness.s3fs_for(endpoint)
    fs.invalidate_cache()
    return sorted(p[len(prefix) + 1 :] for p in fs.find(prefix))


# --------------------------------------------------------------------------- run A
def _run_a(rank: int, world: int, ep: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    opts = s3_harness.options(ep)
    model = _fsdp(_model(0), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "trainer": {"epoch": 3, "betas": (0.9, 0.99)}}
    url = "s3://dcp/run/ckpt"
    dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(url, storage_options=opts, metadata={"job": "s3"}))
    out: dict = {"saved": _full(msd)}

    fresh = _fsdp(_model(5), world)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    _train(fresh, fopt)
    fmsd, fosd = get_state_dict(fresh, fopt)
    back = {"model": fmsd, "optim": fosd, "trainer": {"epoch": -1, "betas": None}}
    dcp.load(back, storage_reader=safeckpt.dcp.StorageReader(url, storage_options=opts))
    set_state_dict(fresh, fopt, model_state_dict=back["model"], optim_state_dict=back["optim"])
    out["loaded"] = _full(get_state_dict(fresh, fopt)[0])
    out["trainer"] = back["trainer"]
    out["exp_avg_equal"] = all(
        torch.equal(_dense(osd["state"][k]["exp_avg"]), _dense(back["optim"]["state"][k]["exp_avg"]))
        for k in osd["state"])

    # async_save (thread mode) to another prefix, then overwrite=True of the first one.
    fut = dcp.async_save(state, storage_writer=safeckpt.dcp.StorageWriter("s3://dcp/run/async", storage_options=opts))
    fut.result(timeout=60)
    # process mode: the writer crosses into DCP's background process (its storage does not)
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    fut = dcp.async_save({"model": msd}, storage_writer=safeckpt.dcp.StorageWriter("s3://dcp/run/proc", storage_options=opts),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    fut.result(timeout=120)
    _train(model, opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "trainer": {"epoch": 4, "betas": (0.9, 0.99)}}
    out["exists"] = dist_harness.attempt(lambda: _translated(state, url, opts, overwrite=False))
    dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(url, storage_options=opts))
    out["overwritten"] = _full(msd)

    # A manager root on the object store: retention after each commit (keep_last=1).
    mgr = safeckpt.CheckpointManager("s3://dcp/mgr", keep_last=1, preemption_signals=(), storage_options=opts)
    for step in (10, 20):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "trainer": {"epoch": step, "betas": (0.9, 0.99)}},
                 storage_writer=safeckpt.dcp.manager_writer(mgr, step))
    out["kept"] = [i.step for i in mgr.list()]
    mgr.close()
    dist.barrier()
    return out


def _dense(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _translated(state, url, opts, **kw):
    with safeckpt.dcp.translate_errors():
        dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(url, storage_options=opts, **kw))


def test_dcp_on_s3_two_ranks_save_load_async_overwrite_manager(endpoint):
    s3_harness.make_bucket(endpoint, "dcp")
    outs = dist_harness.run(_run_a, 2, endpoint, timeout=240)
    for o in outs:
        assert o.ok, o.message
    a, b = outs[0].value, outs[1].value
    assert a["saved"] == b["saved"] and a["loaded"] == a["saved"] and b["loaded"] == b["saved"]
    assert a["exp_avg_equal"] and b["exp_avg_equal"]
    assert a["trainer"] == {"epoch": 3, "betas": (0.9, 0.99)}
    for v in (a, b):
        assert v["exists"]["type"] == "CheckpointExists", v["exists"]
        assert v["kept"] == [20]

    # Each prefix holds its manifest and the data objects it names, nothing else (the DCP
    # metadata is inside the manifest: the overwrite and retention left no stray object).
    opts = s3_harness.options(endpoint)
    for prefix in ("dcp/run/ckpt", "dcp/run/async", "dcp/run/proc", "dcp/mgr/step-0000000020"):
        names = _objects(endpoint, prefix)
        info = safeckpt.verify(f"s3://{prefix}", storage_options=opts)
        assert info.ok, info
        files = set(storage_for(f"s3://{prefix}", opts).read_manifest(f"s3://{prefix}")["files"])
        assert names == sorted({"manifest.json"} | files), (prefix, names)
        assert all(n.startswith("rank-") and n.endswith(".safetensors") for n in files), files
    assert [p.rsplit("/", 1)[-1] for p in s3_harness.s3fs_for(endpoint).ls("dcp/mgr")] == ["step-0000000020"]
    assert s3_harness.uploads(endpoint, "dcp") == []

    # One process, no process group: the 2-rank checkpoint into a plain model.
    plain = _model(9)
    sd = plain.state_dict()
    dcp.load({"model": sd}, storage_reader=safeckpt.dcp.StorageReader("s3://dcp/run/ckpt", storage_options=opts),
             no_dist=True)
    assert {k: v.tolist() for k, v in sd.items()} == a["overwritten"]

    # A damaged object is CorruptCheckpoint, the target untouched.
    fs = s3_harness.s3fs_for(endpoint)
    chunk = storage_for("s3://dcp/run/async", opts).read_manifest("s3://dcp/run/async")["tensors"]["model/2.weight"]["chunks"][-1]
    raw = bytearray(fs.cat_file(f"dcp/run/async/{chunk['file']}"))
    raw[chunk["start"] + 3] ^= 0xFF
    fs.pipe_file(f"dcp/run/async/{chunk['file']}", bytes(raw))
    before = {k: v.clone() for k, v in sd.items()}
    with pytest.raises(safeckpt.CorruptCheckpoint), safeckpt.dcp.translate_errors():
        dcp.load({"model": sd}, storage_reader=safeckpt.dcp.StorageReader(
            "s3://dcp/run/async", storage_options=opts), no_dist=True)
    assert all(torch.equal(before[k], sd[k]) for k in sd)


# --------------------------------------------------------------------------- run B
def _run_b(rank: int, world: int, ep: str) -> dict:
    import time

    from safeckpt.storage import s3 as _storage_s3

    _storage_s3.PART = SMALL_PART
    opts = s3_harness.options(ep)
    model = _fsdp(_model(0, wide=True), world)
    sd = {"model": dict(model.state_dict()), "step": 1}
    dcp.save(sd, storage_writer=safeckpt.dcp.StorageWriter("s3://dcp-kill/run/good", storage_options=opts))
    torch.distributed.barrier()
    if rank == 1:
        real = _storage_s3.MultipartWriter.upload_part

        def dying(self, number, body):
            fut = real(self, number, body)
            fut.result()
            os.kill(os.getpid(), signal.SIGKILL)

        _storage_s3.MultipartWriter.upload_part = dying
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    sd = {"model": dict(model.state_dict()), "step": 2}
    t0 = time.monotonic()
    try:
        dcp.save(sd, storage_writer=safeckpt.dcp.StorageWriter("s3://dcp-kill/run/next", storage_options=opts))
        return {"ok": True}
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return {"ok": False, "type": type(exc).__name__, "elapsed": time.monotonic() - t0}


def test_dcp_on_s3_killed_rank_leaves_nothing_visible(endpoint, capsys):
    s3_harness.make_bucket(endpoint, "dcp-kill")
    outs = dist_harness.run(_run_b, 2, endpoint, timeout=200, pg_timeout=30)
    assert outs[1].exitcode == -signal.SIGKILL, outs[1]
    assert outs[0].value is not None and not outs[0].value["ok"], outs[0]
    assert outs[0].value["elapsed"] < 20, outs[0].value
    opts = s3_harness.options(endpoint)
    # Nothing visible at the new path: no manifest, both readers refuse.
    assert "manifest.json" not in _objects(endpoint, "dcp-kill/run/next")
    assert s3_harness.uploads(endpoint, "dcp-kill", "run/next/") != []  # the killed rank's parts
    target = {"model": {"0.weight": torch.zeros(6144, 1024)}, "step": 0}
    with pytest.raises(safeckpt.CheckpointNotFound), safeckpt.dcp.translate_errors():
        dcp.load(target, storage_reader=safeckpt.dcp.StorageReader("s3://dcp-kill/run/next", storage_options=opts),
                 no_dist=True)
    with pytest.raises(safeckpt.CheckpointNotFound):
        safeckpt.read_state_dict("s3://dcp-kill/run/next", storage_options=opts)
    # The previous checkpoint verifies and loads.
    assert safeckpt.verify("s3://dcp-kill/run/good", storage_options=opts).ok
    dcp.load(target, storage_reader=safeckpt.dcp.StorageReader("s3://dcp-kill/run/good", storage_options=opts),
             no_dist=True)
    assert target["step"] == 1 and torch.equal(target["model"]["0.weight"], _model(0, wide=True)[0].weight)
    # gc removes the leftovers: rank 0's object and rank 1's unfinished upload.
    args = ["--storage-option", f"endpoint_url={endpoint}", "--storage-option", "key=testing",
            "--storage-option", "secret=testing", "--storage-option", "client_kwargs.region_name=us-east-1"]
    assert cli.main([*args, "gc", "s3://dcp-kill/run"]) == 0, capsys.readouterr()
    assert s3_harness.uploads(endpoint, "dcp-kill") == []
    left = _objects(endpoint, "dcp-kill/run")
    assert len(left) == 3 and all(n.startswith("good/") for n in left), left
