"""DeepSpeed integration with the real package: 2 ranks on CPU (gloo), ZeRO 1, 2 and 3.

DeepSpeed's import and initialize dominate the cost, so one test makes four launches: three
runs are each killed for real in the middle of a save (one ZeRO stage each, at a different
phase), and every next run first resumes the previous stage from its surviving tag, bit for
bit, and saves again; the last run resumes stage 3, then for every stage saves, re-saves a tag,
resumes into a fresh engine bit for bit, exports like zero_to_fp32, and checks the errors and
the fallback from a corrupt tag.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import pytest

import safeckpt
from safeckpt.integrations._deepspeed import tags
from tests.helpers import dist_harness
from tests.integrations import deepspeed_app as app

# find_spec, not importorskip: nothing here imports DeepSpeed before the workers check that
# safeckpt (and the integration's DeepSpeed-free modules) did not import it either
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")

STAGES = (1, 2, 3)
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


# ------------------------------------------------------------------ workers
def _resume_then_save_resave_export(rank: int, world: int, root: str, resume: int) -> dict:
    import torch.distributed as dist

    from safeckpt.integrations import deepspeed as sds

    out: dict = {"resumed": _resume_stage(rank, root, resume)}
    for stage in STAGES:
        d, stock = f"{root}/full{stage}", f"{root}/stock{stage}"
        res = out[stage] = {}
        a = app.make_engine(stage, seed=0)
        app.train(a, range(0, 2))
        a.save_checkpoint(d, client_state={"epoch": 2})  # tag global_step2
        s2 = app.snapshot(a)
        app.train(a, range(2, 3))
        a.save_checkpoint(d, tag="resave", client_state={"epoch": 3})
        app.train(a, range(3, 4))
        a.save_checkpoint(d, tag="resave", client_state={"epoch": 4})  # the same tag again
        s4 = app.snapshot(a)
        app.stock_save(a, stock, "resave")
        res["latest"], res["visible"], res["hidden"] = app.read_latest(d), app.visible(d), app.hidden(d)

        b = app.make_engine(stage, seed=1)
        path, client = b.load_checkpoint(d)  # no tag: the newest commit, "resave"
        res["loaded"] = (os.path.basename(os.path.dirname(path)), client["epoch"])
        res["load_diff"] = app.differences(s4, app.snapshot(b))
        app.train(a, range(4, 6))
        app.train(b, range(4, 6))
        res["resume_diff"] = app.differences(app.snapshot(a), app.snapshot(b))

        if rank == 0:
            res["export"] = _check_export(sds, d, stock, f"{root}/export{stage}", stage)
        dist.barrier()
        if stage == 1:
            res["errors"] = _check_errors(a, d, rank)
        if stage == 2:
            res["fallback"] = _check_fallback(d, rank, s2)
        if stage == 1:
            res["16bit"] = _check_16bit(a, f"{root}/16bit", rank)
            # a directory of stock DeepSpeed tags: refused (it needs unpickling), then migrated
            res["stock_refused"] = dist_harness.attempt(lambda b=b, stock=stock: b.load_checkpoint(stock))
            path, _ = sds.load_checkpoint(b, stock, allow_pickle=True)
            res["stock_loaded"] = (os.path.basename(os.path.dirname(path)), app.differences(s4, app.snapshot(b)))
        if stage == 3:
            sds.install_on_initialize()  # the entry point for engines built by Trainer/Accelerate
            c = app.make_engine(stage, seed=3, install=False)
            res["auto_installed"] = isinstance(c.checkpoint_engine, sds.SafeckptCheckpointEngine)
            c.load_checkpoint(d, tag="global_step2", load_optimizer_states=False)
            res["weights_only"] = _full_weights(c) == _saved_weights(d, "global_step2")
            res["nvme"] = _check_nvme_offload(b, c, d, f"{root}/swap", rank)
    if rank == 0:
        out["codec"] = _codec_round_trip()
    return out


def _check_export(sds, d: str, stock: str, out: str, stage: int) -> dict:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    ref = get_fp32_state_dict_from_zero_checkpoint(stock, tag="resave")
    written = sds.export(d, out + ".safetensors")
    got = load_file(written[0])
    torch.manual_seed(0)  # as the trained engine's model was built: frozen weights unchanged
    plain = app.Net()
    fresh = {k: v.clone() for k, v in plain.state_dict().items()}
    plain.load_state_dict(got)  # strict: every name of the plain module, nothing else
    hf = sds.export(d, out + "-hf", hf=True)
    # python -m safeckpt.integrations.deepspeed SRC OUT
    cli = (sds.main([d, out + "-cli.safetensors"]), sds.main([d + "-absent", out + "-none.safetensors"]))
    hf_got = load_file(os.path.join(out + "-hf", "model.safetensors"))
    # every tensor zero_to_fp32 gives, bit for bit; ZeRO-1 also gets the frozen parameters
    # zero_to_fp32 drops (DeepSpeed records none for stage 1), from the full model states
    extra = {"frozen.weight", "frozen.bias"} if stage == 1 else set()
    same = lambda x, y: set(x) == set(y) | extra and all(torch.equal(x[k], y[k]) for k in y)  # noqa: E731
    return {
        "keys": sorted(got),
        "equal_zero_to_fp32": same(got, ref),
        "frozen_equal": all(torch.equal(got[k], fresh[k]) for k in ("frozen.weight", "frozen.bias")),
        "hf_equal": same(hf_got, ref) and os.path.basename(hf[0]) == "model.safetensors",
        "in_memory_equal": same(dict(sds.get_fp32_state_dict(d)), ref),
        "fp32": all(v.dtype == torch.float32 for v in got.values()),
        "cli": (cli, same(load_file(out + "-cli.safetensors"), ref)),
    }


def _check_errors(engine, d: str, rank: int) -> dict:
    before = (app.visible(d), app.read_latest(d))
    res = {
        "not_json": dist_harness.attempt(lambda: engine.save_checkpoint(d, tag="bad", client_state={"x": object()})),
        "unsafe_tag": dist_harness.attempt(lambda: engine.save_checkpoint(d, tag="../escape")),
    }
    res["unchanged"] = (app.visible(d), app.read_latest(d), app.hidden(d)) == (*before, [])
    res["escaped"] = os.path.exists(os.path.join(os.path.dirname(d), "escape"))
    res["after"] = dist_harness.attempt(lambda: engine.save_checkpoint(d, tag="after"))
    res["latest_after"] = app.read_latest(d)
    return res


def _check_fallback(d: str, rank: int, s2: dict) -> dict:
    """Corrupt one byte of rank 1's optimizer data in the newest tag: every rank falls back."""
    import torch.distributed as dist

    if rank == 0:
        data = os.path.join(d, "resave", OPTIM.format(1), "rank-00000.safetensors")
        with open(data, "r+b") as f:
            at = 8 + int.from_bytes(f.read(8), "little") + 4  # inside the first tensor's bytes
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    c = app.make_engine(2, seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, client = c.load_checkpoint(d)
    return {
        "tag": os.path.basename(os.path.dirname(path)),
        "epoch": client["epoch"],
        "diff": app.differences(s2, app.snapshot(c)),
        "warned": [str(w.message)[:200] for w in caught if issubclass(w.category, safeckpt.SafeckptWarning)],
    }


def _check_16bit(engine, out: str, rank: int) -> dict:
    """save_16bit_model: a plain file rank 0 writes, safetensors for a .safetensors name, else
    what DeepSpeed writes (tensors only: torch.load(weights_only=True) reads it)."""
    import torch
    from safetensors.torch import load_file

    res = {"bin": dist_harness.attempt(lambda: engine.save_16bit_model(out))}
    res["st"] = dist_harness.attempt(lambda: engine.save_16bit_model(out, "model.safetensors"))
    if rank == 0:
        live = engine.module.state_dict()
        for key, got in (("equal", load_file(os.path.join(out, "model.safetensors"))),
                         ("bin_equal", torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True))):
            res[key] = sorted(got) == sorted(live) and all(torch.equal(got[k], live[k]) for k in got)
    res["files"] = sorted(os.listdir(out)) if os.path.isdir(out) else []
    return res


def _check_nvme_offload(saver, loader, d: str, swap: str, rank: int) -> dict:
    """NVMe offload files travel with the tag, each rank's in its own directory. No libaio
    here, so the engines get a stand-in swap folder (DeepSpeed's own save and load code runs
    its NVMe branches on it: the save's copy is safeckpt's, the load's copytree DeepSpeed's)."""
    import types

    src, dst = f"{swap}/save-{rank}", f"{swap}/load-{rank}"
    os.makedirs(f"{src}/sub")
    files = {"a.swp": os.urandom(1000 + rank), "sub/b.swp": os.urandom(10), "gradient.swp": b"skip"}
    for rel, data in files.items():
        with open(f"{src}/{rel}", "wb") as f:
            f.write(data)
    os.makedirs(dst)
    for engine, folder in ((saver, src), (loader, dst)):
        engine.zero_nvme_offload_optimizer = lambda: True
        engine.optimizer.optimizer_swapper = types.SimpleNamespace(swap_folder=folder)
        engine.optimizer.reset_swap_buffers = lambda: None
    saver.save_checkpoint(d, tag="nvme")
    published = f"{d}/nvme/offloaded_tensors/rank{rank:02d}"
    index = tags.read_index(f"{d}/nvme")
    loader.load_checkpoint(d, tag="nvme")
    restored = {rel: open(f"{dst}/{rel}", "rb").read() for rel in ("a.swp", "sub/b.swp")}
    return {
        "published": sorted(os.path.relpath(os.path.join(r, n), published)
                            for r, _, ns in os.walk(published) for n in ns),
        "index": sorted(index["offload"].get(f"rank{rank:02d}", {})),
        "restored": restored == {k: files[k] for k in restored},
    }


def _full_weights(engine) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.clone().tolist() for k, v in engine.module.state_dict().items() if k != "seen"}


def _saved_weights(d: str, tag: str) -> dict:
    from safeckpt.integrations import deepspeed as sds

    return {k: v.tolist() for k, v in sds.get_fp32_state_dict(d, tag).items() if k != "seen"}


def _codec_round_trip() -> bool:
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from safeckpt.integrations._deepspeed import codec

    scaler = DynamicLossScaler(2.0**16, 1000, 1.0, 2, False, dtype=torch.float16)
    value = {"s": scaler, "z": ZeroStageEnum.weights, "shape": torch.Size([3, 4]), "b": {"y": 1, "x": 2}}
    back = codec.decode(codec.encode(value))
    return (type(back["s"]) is DynamicLossScaler and vars(back["s"]) == vars(scaler)
            and back["z"] is ZeroStageEnum.weights and isinstance(back["shape"], torch.Size)
            and list(back["b"]) == ["y", "x"])


def _resume_then_crash(rank: int, world: int, root: str, resume: int | None, stage: int, where: str) -> dict:
    """Resume ZeRO stage ``resume`` (killed in the previous run); then for ``stage``: save
    global_step2, train to step 4 (snapshots of both kept for its resume), and die for real
    during the save of global_step4: where="write": rank 1 half-way through writing its
    optimizer file; "publish": rank 0 (the coordinator) after the index is written, just before
    publication; "start": rank 1 before writing anything."""
    out = {"deepspeed_imported_by_safeckpt": "deepspeed" in sys.modules}  # nothing imported it yet
    from safeckpt.format import shardfile as _shardfile
    from safeckpt.integrations import deepspeed as sds

    out["resumed"] = _resume_stage(rank, root, resume) if resume else None
    d = f"{root}/z{stage}"
    a = app.make_engine(stage, seed=0)
    app.train(a, range(0, 2))
    a.save_checkpoint(d)
    app.save_snapshot(app.snapshot(a), f"{root}/ref{stage}-2-{rank}.safetensors")
    app.train(a, range(2, 4))
    app.save_snapshot(app.snapshot(a), f"{root}/ref{stage}-4-{rank}.safetensors")

    if where == "write" and rank == 1:
        real = _shardfile.write_file

        def half_then_die(path, items, *args, **kwargs):
            if "optim_states" in path:
                with open(path, "wb") as f:
                    f.write(b"\0" * 4096)
                    f.flush()
                os._exit(9)
            return real(path, items, *args, **kwargs)

        _replace_everywhere("write_file", real, half_then_die)
    elif where == "start" and rank == 1:
        sds.save_local = lambda *a, **k: os._exit(9)
    elif where == "publish" and rank == 0:
        sds.publish_tag = lambda *a, **k: os._exit(9)
    out["crash"] = dist_harness.attempt(lambda: a.save_checkpoint(d))
    return out


def _replace_everywhere(name: str, original, replacement) -> None:
    """Patch ``name`` in every safeckpt module that holds ``original`` (however it was
    imported), so the crash hook survives refactors of who calls whom."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("safeckpt") and getattr(mod, name, None) is original:
            setattr(mod, name, replacement)


def _resume_stage(rank: int, root: str, stage: int) -> dict:
    """A fresh engine resumes the tag that survived the crash, bit for bit, trains on to the
    step the crashed run had reached (bit for bit again) and saves it."""
    d = f"{root}/z{stage}"
    b = app.make_engine(stage, seed=1)
    path, _ = b.load_checkpoint(d)
    res = {"tag": os.path.basename(os.path.dirname(path))}
    res["diff2"] = app.differences(app.load_snapshot(f"{root}/ref{stage}-2-{rank}.safetensors"), app.snapshot(b))
    app.train(b, range(2, 4))
    res["diff4"] = app.differences(app.load_snapshot(f"{root}/ref{stage}-4-{rank}.safetensors"), app.snapshot(b))
    b.save_checkpoint(d)
    res["after"] = (app.visible(d), app.hidden(d), app.read_latest(d))
    return res


# ------------------------------------------------------------------ tests
CRASHES = [(1, "write"), (2, "publish"), (3, "start")]  # (stage, where the run dies)


def _check_resumed(r: dict, stage: int, rank: int) -> None:
    where = f"ZeRO-{stage} rank {rank}"
    assert r["tag"] == "global_step2", (where, r)  # the crashed global_step4 never appeared
    assert r["diff2"] == [], f"{where}: resumed state differs: {r['diff2']}"
    assert r["diff4"] == [], f"{where}: training on from the resume differs: {r['diff4']}"
    # the next save swept the crashed save's leftovers and committed
    assert r["after"] == (["global_step2", "global_step4", "latest"], [], "global_step4"), (where, r)


@pytest.mark.timeout(900)
def test_zero_1_2_3_kill_resume_resave_export(tmp_path):
    root = str(tmp_path)
    resume = None
    for stage, where in CRASHES:
        outs = dist_harness.run(_resume_then_crash, 2, root, resume, stage, where, timeout=240, env=app.ENV)
        dead = 0 if where == "publish" else 1
        assert outs[dead].exitcode == 9 and not outs[dead].ok, (stage, outs[dead])
        survivor = outs[1 - dead]
        assert survivor.ok, (stage, survivor.error_type, survivor.message)
        assert not survivor.value["deepspeed_imported_by_safeckpt"]
        if resume:
            _check_resumed(survivor.value["resumed"], resume, 1 - dead)
        crash = survivor.value["crash"]
        assert not crash["ok"] and "RankFailure" in crash["mro"], (stage, crash)
        assert crash["elapsed"] < 30, crash  # a dead peer is seen promptly, not at the timeout
        d = tmp_path / f"z{stage}"
        assert app.visible(str(d)) == ["global_step2", "latest"], (stage, os.listdir(d))
        assert app.read_latest(str(d)) == "global_step2"
        assert [i.tag for i in tags.list_tags(d)] == ["global_step2"]
        resume = stage

    outs = dist_harness.run(_resume_then_save_resave_export, 2, root, resume, timeout=400, env=app.ENV)
    for o in outs:
        assert o.ok, f"rank {o.rank}: {o.error_type}: {o.message}"
    values = [o.value for o in outs]
    for rank, v in enumerate(values):
        _check_resumed(v["resumed"], resume, rank)
    for stage in STAGES:
        for rank, v in enumerate(values):
            r = v[stage]
            where = f"ZeRO-{stage} rank {rank}"
            # the same tag saved twice: one committed directory, replaced atomically
            assert r["visible"] == ["global_step2", "latest", "resave"], where
            assert r["hidden"] == [], where
            assert r["latest"] == "resave", where
            assert r["loaded"] == ("resave", 4), where
            assert r["load_diff"] == [], f"{where}: loaded state differs: {r['load_diff']}"
            assert r["resume_diff"] == [], f"{where}: resumed training differs: {r['resume_diff']}"
        ex = values[0][stage]["export"]
        assert ex["equal_zero_to_fp32"] and ex["hf_equal"] and ex["in_memory_equal"], ex
        assert ex["fp32"] and ex["frozen_equal"], ex
        assert ex["cli"] == ((0, 2), True), ex["cli"]  # exit 2: no checkpoint there
        assert ex["keys"] == sorted(["inp.weight", "inp.bias", "frozen.weight", "frozen.bias",
                                     "out.weight", "out.bias", "seen"])
        d = tmp_path / f"full{stage}"
        names = [i.tag for i in tags.list_tags(d)]  # commit order
        assert names[:2] == ["global_step2", "resave"], names
        for name in tags.read_index(str(d / "resave"))["files"]:
            # every file is a valid safeckpt checkpoint, but the one the fallback check damaged
            damaged = (stage, name) == (2, OPTIM.format(1))
            assert safeckpt.verify(d / "resave" / name).ok is not damaged, (stage, name)
        assert not (d / "zero_to_fp32.py").exists()  # it could not read this format
    for v in values:
        e = v[1]["errors"]
        assert not e["not_json"]["ok"] and "cannot checkpoint" in e["not_json"]["msg"], e["not_json"]
        assert not e["unsafe_tag"]["ok"] and "tag" in e["unsafe_tag"]["msg"], e["unsafe_tag"]
        assert e["unchanged"] and not e["escaped"], e
        assert e["after"]["ok"] and e["latest_after"] == "after", e
        f = v[2]["fallback"]
        assert (f["tag"], f["epoch"], f["diff"]) == ("global_step2", 2, []), f
        assert any("resave" in w for w in f["warned"]), f["warned"]
        assert v[3]["weights_only"], "ZeRO-3 load without optimizer state: weights differ"
        assert v[3]["auto_installed"], "install_on_initialize did not install"
        n = v[3]["nvme"]
        assert n["published"] == n["index"] == ["a.swp", "sub/b.swp"] and n["restored"], n
        assert "CheckpointNotFound" in v[1]["stock_refused"]["mro"], v[1]["stock_refused"]
        assert "allow_pickle=True" in v[1]["stock_refused"]["msg"], v[1]["stock_refused"]
        assert v[1]["stock_loaded"] == ("resave", []), v[1]["stock_loaded"]
    b16 = [v[1]["16bit"] for v in values]
    for b in b16:  # both names work on every rank (issue 22: no refusal), the write is rank 0's
        assert b["bin"]["ok"] and b["st"]["ok"], b
    assert b16[0]["equal"] and b16[0]["bin_equal"], b16[0]
    assert b16[0]["files"] == ["model.safetensors", "pytorch_model.bin"], b16[0]
    assert values[0]["codec"]
