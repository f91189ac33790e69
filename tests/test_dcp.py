"""safeckpt.dcp: torch.distributed.checkpoint's dcp.save / async_save / load through safeckpt.

Real DCP, real processes (gloo on 127.0.0.1, hard timeouts from tests.helpers.dist_harness). Each
multi-rank run does several things, so the file stays quick on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from torch import nn

import safeckpt
from tests.helpers import dist_harness

dcp = pytest.importorskip("torch.distributed.checkpoint")
import safeckpt.dcp  # noqa: E402  (after the skip: needs torch.distributed.checkpoint)

pytestmark = pytest.mark.timeout(240)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 5), nn.ReLU(), nn.Linear(5, 1))


def _fsdp(seed: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = _model(seed)
    mesh = init_device_mesh("cpu", (world,))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(value):
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    return value


def _lists(d):
    """Tensors as nested lists: tensors through the harness queue need the worker alive."""
    return {k: _full(v).tolist() for k, v in d.items()}


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _teardown(*objs) -> None:
    import gc

    import torch.distributed as dist

    del objs
    gc.collect()
    dist.barrier()


# ----------------------------------------------------------------------------- 4 ranks: save
def _save_4(rank, world, root):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _fsdp(0, world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "trainer": {"epoch": 3, "betas": (0.9, 0.99), "name": "run-1"}}
    path = os.path.join(root, "ckpt")
    dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(path, metadata={"job": "t"}))
    full = _lists(msd)
    exp_avg = _lists({k: v["exp_avg"] for k, v in osd["state"].items()})

    # async_save, thread mode, to another path, with the same writer class
    fut = dcp.async_save(state, storage_writer=safeckpt.dcp.StorageWriter(os.path.join(root, "async")))
    fut.result(timeout=60)

    # Field report 5: each rank computes its own path from its clock -> different paths.
    own = os.path.join(root, f"report5-{rank}")
    t0 = time.monotonic()
    report5 = dist_harness.attempt(lambda: _translated_save(state, own))
    report5["elapsed"] = time.monotonic() - t0
    try:
        dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(own))
        raw = {"ok": True}
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raw = {"type": type(exc).__name__, "msg": str(exc),
               "inner": [type(f[0]).__name__ for f in exc.failures.values()]}
    dist.barrier()

    # A CheckpointManager root of DCP checkpoints: steps 10, 20, 30, keep_last=2 (retention
    # runs on the coordinator right after each commit), then ranks asking for different steps.
    mgr = safeckpt.CheckpointManager(os.path.join(root, "mgr"), keep_last=2)
    steps, kept = {}, {}
    for step in (10, 20, 30):
        _train(model, opt, 1)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "trainer": {"epoch": step, "betas": (0.9, 0.99), "name": "m"}},
                 storage_writer=safeckpt.dcp.manager_writer(mgr, step))
        steps[step] = _lists(msd)
        kept[step] = [i.step for i in mgr.list()]
    other_step = dist_harness.attempt(lambda: _translated_managed_save(
        {"model": msd}, mgr, 40 + rank))
    mgr.close()
    _teardown(model, opt)
    return {"full": full if rank == 0 else None, "exp_avg": exp_avg if rank == 0 else None,
            "report5": report5, "raw": raw, "steps": steps if rank == 0 else None, "kept": kept,
            "other_step": other_step}


def _translated_managed_save(state, mgr, step):
    with safeckpt.dcp.translate_errors():
        dcp.save(state, storage_writer=safeckpt.dcp.manager_writer(mgr, step))


def _translated_save(state, path):
    with safeckpt.dcp.translate_errors():
        dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(path))


# ----------------------------------------------------------------------------- 2 ranks: load
def _load_2(rank, world, root, damaged):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _fsdp(1, world)  # other init: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    _train(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "trainer": {"epoch": 0, "betas": None, "name": ""}}
    dcp.load(state, storage_reader=safeckpt.dcp.StorageReader(os.path.join(root, "ckpt")))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd2, osd2 = get_state_dict(model, opt)
    out = {
        "full": _lists(msd2),
        "exp_avg": _lists({k: v["exp_avg"] for k, v in osd2["state"].items()}),
        "lr": osd2["param_groups"][0]["lr"],
        "trainer": state["trainer"],
    }
    # the async (thread) checkpoint loads too
    again = {"model": get_state_dict(model, opt)[0]}
    dcp.load(again, storage_reader=safeckpt.dcp.StorageReader(os.path.join(root, "async")))
    out["async_equal"] = all(_full(again["model"][k]).tolist() == out["full"][k] for k in out["full"])
    # ranks reading different paths: RankMismatch on every rank, nothing read
    try:
        with safeckpt.dcp.translate_errors():
            dcp.load(again, storage_reader=safeckpt.dcp.StorageReader(
                os.path.join(root, "ckpt" if rank == 0 else "async")))
        out["load_mismatch"] = "no error"
    except safeckpt.RankMismatch as exc:
        out["load_mismatch"] = str(exc)

    # safeckpt.load of the DCP-written checkpoint straight into FSDP2 modules (no get_state_dict)
    model2 = _fsdp(2, world)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    _train(model2, opt2, 1)
    trainer = {"epoch": 0, "betas": None, "name": ""}
    safeckpt.load(os.path.join(root, "ckpt"), {"model": model2, "optim": opt2, "trainer": trainer})
    msd3, osd3 = get_state_dict(model2, opt2)
    out["sk_full"] = _lists(msd3)
    out["sk_exp_avg"] = _lists({k: v["exp_avg"] for k, v in osd3["state"].items()})
    out["sk_lr"] = osd3["param_groups"][0]["lr"]
    out["sk_trainer"] = trainer

    # CheckpointManager over a root of DCP checkpoints whose newest (step 30) has a damaged
    # data byte: restore falls back to step 20; preemption on rank 1 only is seen by both; the
    # preemption save through manager_writer keeps the restored step (retention's protect).
    import warnings

    mgr = safeckpt.CheckpointManager(damaged, keep_last=2)
    model3 = _fsdp(3, world)
    opt3 = torch.optim.AdamW(model3.parameters(), lr=0.5)
    _train(model3, opt3, 1)
    trainer3 = {"epoch": 0, "betas": None, "name": ""}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["restored"] = mgr.restore({"model": model3, "optim": opt3, "trainer": trainer3})
    out["restore_warnings"] = [str(w.message) for w in caught if "corrupt" in str(w.message)]
    out["restored_full"] = _lists(get_state_dict(model3, opt3)[0])
    out["restored_trainer"] = trainer3
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # the manager's watcher only sets a flag
        time.sleep(0.2)
    out["preempted"] = mgr.preempted
    if out["preempted"]:
        msd4, osd4 = get_state_dict(model3, opt3)
        dcp.save({"model": msd4, "optim": osd4, "trainer": trainer3},
                 storage_writer=safeckpt.dcp.manager_writer(mgr, 40))
    out["listed"] = [i.step for i in mgr.list()]
    mgr.close()
    _teardown(model, opt, model2, opt2, model3, opt3)
    return out


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp4"))
    outs = dist_harness.run(_save_4, 4, root, timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message, o.exitcode)
    return root, [o.value for o in outs]


def test_fsdp2_save_at_4_is_a_safeckpt_checkpoint(saved4):
    root, outs = saved4
    ckpt = os.path.join(root, "ckpt")
    assert sorted(os.listdir(root)) == ["async", "ckpt", "mgr"]  # report 5's paths: nothing at all
    # .metadata: DCP's own (pickled) Metadata, for tools that look for it (issue 29); no
    # safeckpt reader opens it
    assert sorted(os.listdir(ckpt)) == [".metadata", "dcp_metadata.json", "manifest.json"] + [
        f"rank-0000{r}.safetensors" for r in range(4)]
    report = safeckpt.verify(ckpt)
    assert report.ok, report.problems
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert man["format_version"] == 2 and man["world_size"] == 4
    assert man["metadata"]["job"] == "t"
    assert man["tensors"]["model/0.weight"]["scope"] == "sharded"
    assert len(man["tensors"]["model/0.weight"]["chunks"]) == 4
    flat = safeckpt.read_state_dict(ckpt)
    full = outs[0]["full"]
    for k, v in full.items():
        assert torch.equal(flat[f"model/{k}"], _t(v)), k
    assert safeckpt.read_state_dict(ckpt, nested=True)["model"].keys() == full.keys()
    for k, v in outs[0]["exp_avg"].items():
        assert torch.equal(flat[f"optim/state/{k}/exp_avg"], _t(v)), k
    assert flat["trainer/epoch"] == 3 and flat["trainer/betas"] == (0.9, 0.99)
    assert flat["optim/param_groups"][0]["lr"] == 0.01
    # no pickle anywhere in the checkpoint but DCP's own .metadata (issue 29: for tools that look
    # for it; no safeckpt reader opens it): JSON and safetensors only
    for name in os.listdir(ckpt):
        if name == ".metadata":
            continue
        with open(os.path.join(ckpt, name), "rb") as f:
            head = f.read(2)
        assert head[:1] != b"\x80", name  # pickle protocol 2+ opcode PROTO
    json.load(open(os.path.join(ckpt, "dcp_metadata.json")))


def test_field_report_5_per_rank_paths_raise_rank_mismatch_everywhere(saved4):
    root, outs = saved4
    for rank, o in enumerate(outs):
        r5 = o["report5"]
        assert not r5["ok"] and r5["type"] == "RankMismatch", (rank, r5)
        for r in range(4):
            assert f"report5-{r}" in r5["msg"], r5["msg"]
        assert "rank 0" in r5["msg"] and "rank 3" in r5["msg"]
        assert r5["elapsed"] < 30
        raw = o["raw"]  # without translate_errors: DCP's CheckpointException carrying it
        assert raw["type"] == "CheckpointException" and raw["inner"] == ["RankMismatch"], raw
        assert "different checkpoint paths" in raw["msg"]
    assert not [n for n in os.listdir(root) if "report5" in n]  # nothing written, no staging


def _flip_data_byte(ckpt: str) -> None:
    """Flip one byte inside the first tensor chunk of the checkpoint's first data file."""
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    rec = man["tensors"]["model/0.weight"]["chunks"][0]
    with open(os.path.join(ckpt, rec["file"]), "r+b") as f:
        f.seek(rec["start"] + 1)
        b = f.read(1)
        f.seek(rec["start"] + 1)
        f.write(bytes([b[0] ^ 0x40]))


def test_manager_root_of_dcp_checkpoints_retention_and_step_agreement(saved4):
    root, outs = saved4
    mgr_root = os.path.join(root, "mgr")
    for o in outs:
        assert o["kept"] == {10: [10], 20: [10, 20], 30: [20, 30]}, o["kept"]
        bad = o["other_step"]  # ranks passing steps 40..43: RankMismatch everywhere, nothing written
        assert not bad["ok"] and bad["type"] == "RankMismatch", bad
        assert "step-0000000040" in bad["msg"] and "step-0000000043" in bad["msg"], bad["msg"]
    assert sorted(n for n in os.listdir(mgr_root) if not n.startswith(".safeckpt.lock")) == [
        "step-0000000020", "step-0000000030"]
    for step in (20, 30):
        ckpt = os.path.join(mgr_root, f"step-{step:010d}")
        assert os.path.isfile(os.path.join(ckpt, "dcp_metadata.json"))
        assert json.load(open(os.path.join(ckpt, "manifest.json")))["step"] == step
        assert safeckpt.verify(ckpt).ok
    # one process: restore the newest into a plain model and optimizer
    model = _model(9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    trainer = {"epoch": 0, "betas": None, "name": ""}
    with safeckpt.CheckpointManager(mgr_root) as mgr:
        assert mgr.restore({"model": model, "optim": opt, "trainer": trainer}) == 30
    for k, v in outs[0]["steps"][30].items():
        assert torch.equal(model.state_dict()[k], _t(v)), k
    assert trainer == {"epoch": 30, "betas": (0.9, 0.99), "name": "m"}
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.01
    assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3, 4, 5]


def test_load_at_2_ranks_and_async_checkpoint(saved4, tmp_path):
    import shutil

    root, outs4 = saved4
    damaged = str(tmp_path / "mgr")
    shutil.copytree(os.path.join(root, "mgr"), damaged,
                    ignore=shutil.ignore_patterns(".safeckpt.lock*"))
    _flip_data_byte(os.path.join(damaged, "step-0000000030"))
    outs = dist_harness.run(_load_2, 2, root, damaged, timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
    for o in outs:
        v = o.value
        assert v["sk_full"] == outs4[0]["full"]
        assert v["sk_exp_avg"] == outs4[0]["exp_avg"]
        assert v["sk_lr"] == 0.01
        assert v["sk_trainer"] == {"epoch": 3, "betas": (0.9, 0.99), "name": "run-1"}
        assert v["restored"] == 20
        assert v["restore_warnings"] and "step 30" in v["restore_warnings"][0], v["restore_warnings"]
        assert v["restored_full"] == outs4[0]["steps"][20]
        assert v["restored_trainer"] == {"epoch": 20, "betas": (0.9, 0.99), "name": "m"}
        assert v["preempted"] is True
        assert v["listed"] == [20, 30, 40]  # keep_last=2, but the restored step is protected
    step40 = os.path.join(damaged, "step-0000000040")
    assert safeckpt.verify(step40).ok and os.path.isfile(os.path.join(step40, "dcp_metadata.json"))
    flat = safeckpt.read_state_dict(step40)
    for k, t in outs4[0]["steps"][20].items():
        assert torch.equal(flat[f"model/{k}"], _t(t)), k
    for o in outs:
        v = o.value
        assert v["full"] == outs4[0]["full"]
        assert v["exp_avg"] == outs4[0]["exp_avg"]
        assert v["lr"] == 0.01
        assert v["trainer"] == {"epoch": 3, "betas": (0.9, 0.99), "name": "run-1"}
        assert v["async_equal"]
        assert "different checkpoint paths" in v["load_mismatch"], v["load_mismatch"]


def test_load_at_1_process_into_a_plain_model_without_unpickling(saved4, monkeypatch):
    root, outs4 = saved4
    model = _model(5)
    state = {"model": model.state_dict(), "trainer": {"epoch": 0, "betas": None, "name": ""}}
    _forbid_unpickling(monkeypatch)
    dcp.load(state, storage_reader=safeckpt.dcp.StorageReader(os.path.join(root, "ckpt")))
    for k, t in outs4[0]["full"].items():
        assert torch.equal(model.state_dict()[k], _t(t)), k
    assert state["trainer"] == {"epoch": 3, "betas": (0.9, 0.99), "name": "run-1"}


def _forbid_unpickling(monkeypatch):
    import pickle

    def refuse(*a, **k):
        raise AssertionError("unpickled something")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)


def test_forbid_unpickling_catches_dcp_own_reader(tmp_path, monkeypatch):
    """The no-pickle check above can fail: DCP's own FileSystemReader trips it."""
    state = {"w": torch.ones(3), "epoch": 4}
    dcp.save(state, checkpoint_id=str(tmp_path / "fs"), no_dist=True)
    _forbid_unpickling(monkeypatch)
    with pytest.raises(BaseException, match="unpickled something"):
        dcp.load({"w": torch.zeros(3), "epoch": 0}, checkpoint_id=str(tmp_path / "fs"), no_dist=True)


def test_cli_reads_a_dcp_checkpoint(saved4, tmp_path, capsys):
    from safeckpt import cli

    ckpt = os.path.join(saved4[0], "ckpt")
    assert cli.main(["verify", ckpt]) == 0
    assert cli.main(["inspect", ckpt]) == 0
    assert "model/0.weight" in capsys.readouterr().out
    out = tmp_path / "model.safetensors"
    assert cli.main(["consolidate", ckpt, "-o", str(out), "--only", "model"]) == 0
    from safetensors.torch import load_file

    loaded = load_file(str(out))
    for k, t in saved4[1][0]["full"].items():
        assert torch.equal(loaded[k], _t(t)), k
    hf = tmp_path / "hf"
    assert cli.main(["convert", ckpt, str(hf), "--to", "hf"]) == 0
    exported = load_file(str(hf / "model.safetensors"))
    assert exported.keys() == saved4[1][0]["full"].keys()
    for k, t in saved4[1][0]["full"].items():
        assert torch.equal(exported[k], _t(t)), k


# ----------------------------------------------------------------------------- crash
def _crash(rank, world, root):
    import torch.distributed as dist

    from safeckpt.format import shardfile as _shardfile

    torch.manual_seed(0)
    state = {"w": torch.randn(1 << 18), "b": torch.randn(1 << 18), "step": 1}
    dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(os.path.join(root, "good")))
    dist.barrier()
    if rank == 1:
        real = _shardfile._write_all

        def die_midway(fd, bufs):
            total = sum(len(b) for b in bufs)
            if total > 1 << 16:  # a data piece, not the header: write half of it, then die
                os.write(fd, bytes(bufs[0][: len(bufs[0]) // 2]))
                os.kill(os.getpid(), signal.SIGKILL)
            real(fd, bufs)

        _shardfile._write_all = die_midway
    state["step"] = 2
    state["w"].add_(1)
    t0 = time.monotonic()
    try:
        dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(os.path.join(root, "next")))
        return {"ok": True}
    except BaseException as exc:  # noqa: BLE001
        return {"ok": False, "type": type(exc).__name__, "elapsed": time.monotonic() - t0}


def test_sigkill_mid_write_leaves_previous_loadable_and_nothing_visible(tmp_path):
    root = str(tmp_path)
    outs = dist_harness.run(_crash, 2, root, timeout=90, pg_timeout=30)
    assert outs[1].exitcode == -signal.SIGKILL, outs[1]
    assert outs[0].value is not None and not outs[0].value["ok"], outs[0]
    # gloo's "Connection closed by peer" from DCP's own gather (0.07 s on the dev VM)
    assert outs[0].value["type"] == "RuntimeError" and outs[0].value["elapsed"] < 10, outs[0].value
    assert not os.path.exists(os.path.join(root, "next"))
    leftovers = dist_harness.leftovers(root)
    assert all(n.startswith(".next.safeckpt-staging-") for n in leftovers), leftovers
    assert safeckpt.verify(os.path.join(root, "good")).ok
    torch.manual_seed(0)
    w, b = torch.randn(1 << 18), torch.randn(1 << 18)
    target = {"w": torch.zeros(1 << 18), "b": torch.zeros(1 << 18), "step": 0}
    dcp.load(target, storage_reader=safeckpt.dcp.StorageReader(os.path.join(root, "good")))
    assert torch.equal(target["w"], w) and torch.equal(target["b"], b) and target["step"] == 1
    from safeckpt import cli

    assert cli.main(["gc", root]) == 0  # the crashed save's staging is swept
    assert dist_harness.leftovers(root) == []


# ----------------------------------------------------------------------------- single process
def _save1(path, state, **kw):
    dcp.save(state, storage_writer=safeckpt.dcp.StorageWriter(path, **kw), no_dist=True)


def _state():
    torch.manual_seed(3)
    return {"model": {"w": torch.randn(64, 8), "b": torch.randn(8).to(torch.bfloat16)},
            "meta": {"epoch": 2, "tags": ["a", "b"], "inf": float("inf"), "pairs": ({1: "x"}, None)}}


def test_damage_is_corrupt_checkpoint_and_target_untouched(tmp_path):
    path = str(tmp_path / "c")
    _save1(path, _state())
    data = os.path.join(path, "rank-00000.safetensors")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:  # flip one byte of tensor data (the tail of the file)
        f.seek(size - 5)
        byte = f.read(1)
        f.seek(size - 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = {"model": {"w": torch.zeros(64, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}}
    with pytest.raises(safeckpt.CorruptCheckpoint, match="checksum mismatch"):
        with safeckpt.dcp.translate_errors():
            dcp.load(target, storage_reader=safeckpt.dcp.StorageReader(path), no_dist=True)
    assert not target["model"]["w"].any() and not target["model"]["b"].any()  # nothing copied
    assert not safeckpt.verify(path).ok


@pytest.mark.parametrize("victim", ["dcp_metadata.json", "manifest.json"])
def test_damaged_metadata_is_corrupt_checkpoint(tmp_path, victim):
    path = str(tmp_path / "c")
    _save1(path, _state())
    p = os.path.join(path, victim)
    raw = bytearray(open(p, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(p, "wb").write(bytes(raw))
    with pytest.raises(BaseException) as info:
        dcp.load({"model": {"w": torch.zeros(64, 8)}}, storage_reader=safeckpt.dcp.StorageReader(path), no_dist=True)
    # single process: DCP re-raises what set_up_storage_reader raised
    err = safeckpt.dcp.safeckpt_error(info.value) or info.value
    assert isinstance(err, safeckpt.CorruptCheckpoint), repr(info.value)


def test_values_round_trip_as_json_and_objects_are_refused(tmp_path):
    path = str(tmp_path / "c")
    _save1(path, _state())
    doc = json.load(open(os.path.join(path, "dcp_metadata.json")))
    # a tuple is one DCP item (DCP would pickle it): JSON with tags here, int keys kept
    assert doc["entries"]["meta.pairs"] == {"value": {"@tuple": [{"@dict": [[1, "x"]]}, None]}}
    target = {"model": {"w": torch.zeros(64, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
              "meta": {"epoch": 0, "tags": [], "inf": 0.0, "pairs": None}}
    dcp.load(target, storage_reader=safeckpt.dcp.StorageReader(path), no_dist=True)
    assert target["meta"] == {"epoch": 2, "tags": ["a", "b"], "inf": float("inf"), "pairs": ({1: "x"}, None)}
    assert torch.equal(target["model"]["b"], _state()["model"]["b"])

    class Custom:
        pass

    bad = str(tmp_path / "bad")
    writer = safeckpt.dcp.StorageWriter(bad)
    with pytest.raises(BaseException) as info:
        dcp.save({"w": torch.ones(2), "obj": Custom()}, storage_writer=writer, no_dist=True)
    assert "'obj'" in str(info.value) and "JSON" in str(info.value) and "Custom" in str(info.value)
    assert not os.path.exists(bad)
    # issue 29: a failed save removes its staging (it used to stay, hidden, until the next save)
    assert dist_harness.leftovers(str(tmp_path)) == []
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)  # the same writer saves again
    assert dist_harness.leftovers(str(tmp_path)) == [] and safeckpt.verify(bad).ok


def test_existing_target_overwrite_and_empty_directory(tmp_path):
    path = str(tmp_path / "c")
    os.makedirs(path)  # pre-created, empty (as field report 5's script does): not in the way
    _save1(path, {"w": torch.ones(3)})
    with pytest.raises(BaseException) as info:  # refused when asked to (issue 29: the default replaces)
        _save1(path, {"w": torch.full((3,), 2.0)}, overwrite=False)
    assert isinstance(safeckpt.dcp.safeckpt_error(info.value) or info.value, safeckpt.CheckpointExists)
    assert torch.equal(safeckpt.read_state_dict(path)["w"], torch.ones(3))
    _save1(path, {"w": torch.full((3,), 2.0)})
    assert torch.equal(safeckpt.read_state_dict(path)["w"], torch.full((3,), 2.0))
    assert dist_harness.leftovers(str(tmp_path)) == []
    # not a safeckpt checkpoint (e.g. DCP's own directory): refused even with overwrite
    other = str(tmp_path / "fs")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=other, no_dist=True)
    with pytest.raises(BaseException) as info:
        _save1(other, {"w": torch.ones(3)}, overwrite=True)
    assert "not a safeckpt checkpoint" in str(info.value)


def test_manager_root_sees_steps(tmp_path):
    root = str(tmp_path)
    for step in (10, 20, 30):
        _save1(os.path.join(root, f"step-{step:010d}"), {"w": torch.full((2,), float(step))})
    mgr = safeckpt.CheckpointManager(root, keep_last=2)
    try:
        assert [i.step for i in mgr.list()] == [10, 20, 30]
        assert mgr.latest().step == 30
    finally:
        mgr.close()
    from safeckpt import cli

    assert cli.main(["gc", root, "--keep-last", "2"]) == 0
    assert sorted(os.listdir(root)) == ["step-0000000020", "step-0000000030"]


def test_import_does_not_load_dcp():
    import subprocess
    import sys

    code = "import sys, safeckpt; print('torch.distributed.checkpoint' in sys.modules, 'safeckpt.dcp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out


# ----------------------------------------------------------------------------- async, process mode
def _async_process(rank, world, root):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    torch.manual_seed(11)
    state = {"w": torch.randn(64, 16), "b": torch.randn(7), "step": 5}
    fut = dcp.async_save(state, storage_writer=safeckpt.dcp.StorageWriter(os.path.join(root, "proc")),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    fut.result(timeout=120)
    return True


def test_async_save_process_mode(tmp_path):
    root = str(tmp_path)
    outs = dist_harness.run(_async_process, 2, root, timeout=180)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
    ckpt = os.path.join(root, "proc")
    assert safeckpt.verify(ckpt).ok
    torch.manual_seed(11)
    w, b = torch.randn(64, 16), torch.randn(7)
    flat = safeckpt.read_state_dict(ckpt)
    assert torch.equal(flat["w"], w) and torch.equal(flat["b"], b) and flat["step"] == 5
    assert dist_harness.leftovers(root) == []


def test_manager_writer_refuses_process_mode_and_bad_steps(tmp_path):
    import pickle

    with safeckpt.CheckpointManager(str(tmp_path)) as mgr:
        writer = safeckpt.dcp.manager_writer(mgr, 7)
        assert writer.path == os.path.join(str(tmp_path), "step-0000000007") and writer.step == 7
        with pytest.raises(safeckpt.CheckpointError, match="process mode"):
            pickle.dumps(writer)
        with pytest.raises(ValueError, match="non-negative int"):
            safeckpt.dcp.manager_writer(mgr, -1)
