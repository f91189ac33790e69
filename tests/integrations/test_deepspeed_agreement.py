"""DeepSpeed integration, issue 22 requirement 1 and 5: every refusal or error of an entry
point (``save_checkpoint``, ``load_checkpoint``, ``save_16bit_model``) is raised on every rank,
whichever rank failed, promptly (no rank returns while another raises, no hang), as DeepSpeed's
own exception when DeepSpeed's code failed on every rank; DeepSpeed's
``tag_validation`` modes; DeepSpeed's own ``zero_to_fp32`` functions on safeckpt tags; the
export CLI's one-line errors. One 2-rank launch (gloo, CPU, ZeRO-2) holds every check, and a
rank killed inside ``save_16bit_model`` ends it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import warnings

import pytest

from tests.helpers import dist_harness
from tests.integrations import deepspeed_app as app

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")

PROMPT = 20.0  # seconds: a failed peer is reported well before the 30 s timeout


def _worker(rank: int, world: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    import safeckpt
    from safeckpt.integrations import deepspeed as sds

    out: dict = {}
    e = app.make_engine(2, seed=0, config={"checkpoint": {"tag_validation": "FAIL"}})
    app.train(e, range(0, 1))
    b16 = f"{root}/b16"

    # save_16bit_model: ranks naming different files refuse on every rank, before anything is gathered
    out["b16_mismatch"] = dist_harness.attempt(lambda: e.save_16bit_model(b16, f"model{rank}.safetensors"))
    out["b16_mismatch_files"] = sorted(os.listdir(b16)) if os.path.isdir(b16) else []
    # rank 0's write fails: every rank raises, nothing published
    real_plain = sds._save_plain
    if rank == 0:
        def disk_full(*a, **k):
            raise OSError(28, "No space left on device (injected)")
        sds._save_plain = disk_full
    out["b16_write_fails"] = dist_harness.attempt(lambda: e.save_16bit_model(b16, "model.safetensors"))
    sds._save_plain = real_plain
    dist.barrier()
    out["b16_after_fail"] = sorted(os.listdir(b16)) if os.path.isdir(b16) else []
    # rank 1 fails before DeepSpeed's create (while building the state dict): the same
    if rank == 1:
        e.module_state_dict = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("gather failed (injected)"))
    out["b16_rank1_fails"] = dist_harness.attempt(lambda: e.save_16bit_model(b16, "model.safetensors"))
    e.__dict__.pop("module_state_dict", None)
    out["b16_ok"] = dist_harness.attempt(lambda: e.save_16bit_model(b16, "model.safetensors"))
    if rank == 0:
        from safetensors.torch import load_file

        got = load_file(f"{b16}/model.safetensors")
        live = e.module.state_dict()
        out["b16_equal"] = sorted(got) == sorted(live) and all(torch.equal(got[k], live[k]) for k in got)
    # DeepSpeed's default name (pytorch_model.bin, what its own tests and HF-style loaders use):
    # the weights torch.save'd as DeepSpeed does, published the same way (issue 22: no refusal)
    out["b16_bin"] = dist_harness.attempt(lambda: e.save_16bit_model(b16))
    if rank == 0:
        got = torch.load(f"{b16}/pytorch_model.bin", weights_only=True)
        out["b16_bin_equal"] = sorted(got) == sorted(live) and all(torch.equal(got[k], live[k]) for k in got)
    dist.barrier()
    out["b16_files"] = sorted(os.listdir(b16))

    # save_checkpoint: different tags under tag_validation FAIL (DeepSpeed's default is WARN)
    d = f"{root}/ckpt"
    out["tags_fail"] = dist_harness.attempt(lambda: e.save_checkpoint(d, tag=f"r{rank}"))
    # DeepSpeed itself raises on rank 1 only, between create and commit
    if rank == 1:
        e._save_zero_checkpoint = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("zero save failed (injected)"))
    out["ds_raises_rank1"] = dist_harness.attempt(lambda: e.save_checkpoint(d, tag="broken"))
    e.__dict__.pop("_save_zero_checkpoint", None)
    dist.barrier()
    out["after_failures"] = (app.visible(d) if os.path.isdir(d) else [], app.hidden(d) if os.path.isdir(d) else [])
    out["good"] = dist_harness.attempt(lambda: e.save_checkpoint(d, tag="good"))
    snap = app.snapshot(e)

    # load_checkpoint: DeepSpeed's own load raises on rank 1 only
    f = app.make_engine(2, seed=1)
    if rank == 1:
        f._load_checkpoint = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("load failed (injected)"))
    out["load_rank1"] = dist_harness.attempt(lambda: f.load_checkpoint(d))
    # ... and on every rank (DeepSpeed refusing, e.g. another DP size): DeepSpeed's own type, as stock
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    f._load_checkpoint = lambda *a, **k: (_ for _ in ()).throw(ZeRORuntimeException("refused (injected)"))
    out["load_all"] = dist_harness.attempt(lambda: f.load_checkpoint(d))
    f.__dict__.pop("_load_checkpoint", None)
    path, _ = f.load_checkpoint(d)
    out["load_after"] = (os.path.basename(os.path.dirname(path)), app.differences(snap, app.snapshot(f)))

    # tag_validation WARN / IGNORE: DeepSpeed proceeds; safeckpt saves under rank 0's tag
    for mode in ("WARN", "IGNORE"):
        g = app.make_engine(2, seed=0, config={"checkpoint": {"tag_validation": mode}})
        app.train(g, range(0, 1))
        dm = f"{root}/{mode}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = dist_harness.attempt(lambda g=g, dm=dm, t=f"{mode}{rank}": g.save_checkpoint(dm, tag=t))
        res["warned"] = [str(w.message) for w in caught if issubclass(w.category, safeckpt.SafeckptWarning)]
        dist.barrier()
        res["visible"], res["latest"] = app.visible(dm), app.read_latest(dm)
        h = app.make_engine(2, seed=1)
        p, _ = h.load_checkpoint(dm)
        res["loaded"] = (os.path.basename(os.path.dirname(p)), app.differences(app.snapshot(g), app.snapshot(h)))
        out[mode] = res

    if rank == 0:
        out["zero_to_fp32"] = _zero_to_fp32(sds, d, root)
        out["cli"] = _cli(sds, d, root)
    dist.barrier()
    with open(f"{root}/rank{rank}.json", "w") as fh:  # rank 1 does not return: read back by the test
        json.dump(out, fh)

    # last: rank 1 dies inside save_16bit_model (before create); rank 0 raises promptly
    if rank == 1:
        e.module_state_dict = lambda *a, **k: os._exit(9)
    out["peer_killed"] = dist_harness.attempt(lambda: e.save_16bit_model(b16, "model.safetensors"))
    return out


def _zero_to_fp32(sds, d: str, root: str) -> dict:
    """DeepSpeed's own functions (what zero_to_fp32.py, Hugging Face and Lightning's converter
    call) on a save directory of safeckpt tags."""
    import torch
    from deepspeed.utils import zero_to_fp32 as z2f
    from safetensors.torch import load_file

    ours = sds.get_fp32_state_dict(d)
    same = lambda x: sorted(x) == sorted(ours) and all(torch.equal(x[k], ours[k]) for k in ours)  # noqa: E731
    model = app.Net()
    z2f.load_state_dict_from_zero_checkpoint(model, d)
    z2f.convert_zero_checkpoint_to_fp32_state_dict(d, f"{root}/z2f-out", safe_serialization=True)
    converted = {}
    for name in os.listdir(f"{root}/z2f-out"):
        if name.endswith(".safetensors"):
            converted.update(load_file(f"{root}/z2f-out/{name}"))
    return {
        "get": same(dict(z2f.get_fp32_state_dict_from_zero_checkpoint(d, tag="good"))),
        "compat": same(dict(sds.get_fp32_state_dict_from_zero_checkpoint(d))),
        "load_into_model": same({k: v for k, v in model.state_dict().items()}),
        "convert": same(converted),
    }


def _cli(sds, d: str, root: str) -> dict:
    res = {}
    existing = f"{root}/exists.safetensors"
    with open(existing, "wb") as fh:
        fh.write(b"x")
    for name, argv in {"file": [d, existing], "hf": [d, existing, "--hf"],
                       "absent": [d + "-absent", f"{root}/none.safetensors"]}.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = sds.main(argv)
        res[name] = (code, err.getvalue())
    return res


@pytest.mark.timeout(420)
def test_every_entry_point_fails_on_every_rank(tmp_path):
    outs = dist_harness.run(_worker, 2, str(tmp_path), timeout=360, env=app.ENV)
    assert outs[1].exitcode == 9, (outs[1].error_type, outs[1].message)
    assert outs[0].ok, f"rank 0: {outs[0].error_type}: {outs[0].message}"
    v = outs[0].value
    # the last check: rank 0 is told that rank 1 died, promptly
    k = v["peer_killed"]
    assert not k["ok"] and "RankFailure" in k["mro"] and k["elapsed"] < PROMPT, k
    assert "rank 1" in k["msg"] or "rank(s) 1" in k["msg"], k["msg"]
    for rank in (0, 1):  # every check before the kill, as each rank saw it
        with open(tmp_path / f"rank{rank}.json") as fh:
            _check(json.load(fh), rank)


def _check(v: dict, rank: int) -> None:
    where = f"rank {rank}"
    b = v["b16_mismatch"]
    assert not b["ok"] and "RankMismatch" in b["mro"] and "model1.safetensors" in b["msg"], (where, b)
    assert v["b16_mismatch_files"] == [], (where, v["b16_mismatch_files"])
    w = v["b16_write_fails"]
    assert not w["ok"] and "No space left" in w["msg"] and "rank 0" in w["msg"] and w["elapsed"] < PROMPT, (where, w)
    assert v["b16_after_fail"] == [], (where, v["b16_after_fail"])  # nothing published, no temp file
    r1 = v["b16_rank1_fails"]
    assert not r1["ok"] and "gather failed" in r1["msg"] and "rank 1" in r1["msg"] and r1["elapsed"] < PROMPT, (where, r1)
    assert v["b16_ok"]["ok"] and v["b16_bin"]["ok"], (where, v["b16_ok"], v["b16_bin"])
    assert v["b16_files"] == ["model.safetensors", "pytorch_model.bin"], (where, v["b16_files"])
    if rank == 0:
        assert v["b16_equal"] and v["b16_bin_equal"]
    t = v["tags_fail"]
    assert not t["ok"] and {"TagMismatch", "RankMismatch", "AssertionError"} <= set(t["mro"]), (where, t)
    assert "rank 0: 'r0'" in t["msg"] and "rank 1: 'r1'" in t["msg"], (where, t["msg"])
    f = v["ds_raises_rank1"]
    assert not f["ok"] and "zero save failed" in f["msg"] and "rank 1" in f["msg"] and f["elapsed"] < PROMPT, (where, f)
    assert v["after_failures"] == [[], []], (where, v["after_failures"])
    assert v["good"]["ok"], (where, v["good"])
    ld = v["load_rank1"]
    assert not ld["ok"] and "load failed" in ld["msg"] and "rank 1" in ld["msg"] and ld["elapsed"] < PROMPT, (where, ld)
    la = v["load_all"]
    assert not la["ok"] and la["type"] == "ZeRORuntimeException" and la["elapsed"] < PROMPT, (where, la)
    assert v["load_after"] == ["good", []], (where, v["load_after"])
    for mode in ("WARN", "IGNORE"):
        m = v[mode]
        assert m["ok"], (where, mode, m)
        assert m["visible"] == [f"{mode}0", "latest"] and m["latest"] == f"{mode}0", (where, mode, m)
        assert m["loaded"] == [f"{mode}0", []], (where, mode, m["loaded"])
        if mode == "WARN":
            assert any(f"'{mode}1'" in w and "rank 0's tag" in w for w in m["warned"]), (where, m["warned"])
        else:
            assert m["warned"] == [], (where, m["warned"])
    if rank == 0:
        assert v["zero_to_fp32"] == {"get": True, "compat": True, "load_into_model": True, "convert": True}, v
        for name, (code, err) in v["cli"].items():  # noqa: B007
            assert code != 0 and err.startswith("error: ") and err.count("\n") == 1, (name, code, err)
            assert "Traceback" not in err, (name, err)
        assert "--overwrite" in v["cli"]["file"][1] and "--overwrite" in v["cli"]["hf"][1], v["cli"]
        assert v["cli"]["absent"][0] == 2, v["cli"]["absent"]
