"""Lightning 2.6 (real package) saving and resuming through safeckpt.dcp on 2 processes (gloo, CPU).

``SafeckptDCPModelParallelStrategy`` is Lightning's ``ModelParallelStrategy`` (FSDP2 through
``fully_shard`` in ``configure_model``) with its DCP save/load going through
``safeckpt.dcp``: the checkpoint directories are DCP checkpoints and safeckpt checkpoints, with
no pickled ``meta.pt``. One spawn runs: an uninterrupted 3-epoch reference; a 2-epoch run; a
resume from ``last`` to 3 epochs with ``torch.load`` replaced by a function that fails. The
stock strategy does not save RNG states, so a callback reseeds every step: the resumed run
must then match the reference bit for bit (model, AdamW state, scheduler, top-k bookkeeping).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import safeckpt  # noqa: E402
from tests.helpers import dist_harness  # noqa: E402

ENV = {"SAFECKPT_TIMEOUT": "30", "PYTHONWARNINGS": "ignore"}
pytestmark = pytest.mark.timeout(300)


def _reseed():
    import lightning.pytorch as pl

    class Reseed(pl.Callback):
        """Seed dropout per step and rank (the stock strategy does not checkpoint RNG; per epoch
        is not enough: a resumed run draws the dataloader's base seed at another point)."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.manual_seed(1000 + 10 * trainer.global_step + trainer.global_rank)

    return Reseed()


def _fit(root, world, epochs, ckpt_path=None):
    from safeckpt.integrations.lightning_dcp import SafeckptDCPModelParallelStrategy
    from tests.integrations import lightning_app as app

    app.scramble(0)
    model = app.Net(sharded=True, bn=False)
    strategy = SafeckptDCPModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = app.trainer(root, strategy, epochs, world, callbacks=[_reseed()])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def _topk(trainer, root):
    cb = trainer.checkpoint_callback
    return {
        "best_k_models": {os.path.relpath(k, root): float(v) for k, v in cb.best_k_models.items()},
        "best_model_path": os.path.relpath(cb.best_model_path, root),
        "last_model_path": os.path.relpath(cb.last_model_path, root),
        "best_model_score": float(cb.best_model_score),
    }


def _run(rank, world, root, forbid_torch_load=True):
    from tests.integrations import lightning_app as app

    ref_root, run_root = os.path.join(root, "ref"), os.path.join(root, "run")
    model, trainer = _fit(ref_root, world, 3)
    ref, ref_topk = app.full_state(model, trainer), _topk(trainer, ref_root)
    _fit(run_root, world, 2)

    def no_torch_load(*a, **k):
        raise AssertionError("torch.load called while resuming")

    real_load = torch.load
    if forbid_torch_load:
        torch.load = no_torch_load
    try:
        model, trainer = _fit(run_root, world, 3, ckpt_path="last")
    finally:
        torch.load = real_load
    got = app.full_state(model, trainer)
    diff = sorted(k for k in set(ref) | set(got) if k != "rng/torch" and (
        k not in ref or k not in got or not torch.equal(ref[k], got[k])))
    return {"diff": diff, "n": len(ref), "ref_topk": ref_topk, "topk": _topk(trainer, run_root),
            "ckpt_path": trainer.ckpt_path, "epoch": trainer.current_epoch, "step": trainer.global_step,
            "ref_model": {k[len("model/"):]: v.numpy() for k, v in ref.items() if k.startswith("model/")}}


def test_lightning_model_parallel_saves_and_resumes_through_safeckpt_dcp(tmp_path):
    out = dist_harness.run(_run, 2, str(tmp_path), timeout=280, env=ENV)
    for o in out:
        assert o.ok, (o.rank, o.error_type, o.message, o.exitcode)
    ckpts = tmp_path / "run" / "ckpts"
    for o in out:
        v = o.value
        assert v["n"] > 10 and v["diff"] == [], v["diff"]  # model, AdamW state, scheduler
        assert v["topk"] == v["ref_topk"], (v["topk"], v["ref_topk"])
        assert v["ckpt_path"] == str(ckpts / "last.ckpt")
        assert (v["epoch"], v["step"]) == (3, 18)
    # On disk: ModelCheckpoint's top-2 and last, each a committed safeckpt checkpoint with DCP's
    # metadata as JSON, Lightning's dict inside it, no meta.pt, nothing pickled, no leftovers.
    names = set(os.listdir(ckpts))
    assert names == {os.path.basename(p) for p in out[0].value["topk"]["best_k_models"]} | {"last.ckpt"}
    for name in names:
        ckpt = ckpts / name
        files = sorted(os.listdir(ckpt))
        assert files == [".metadata", "dcp_metadata.json", "manifest.json", "rank-00000.safetensors",
                         "rank-00001.safetensors"], files
        assert safeckpt.verify(str(ckpt)).ok
        for f in files:  # nothing pickled but DCP's own .metadata, which no safeckpt reader opens
            assert (ckpt / f).read_bytes()[:1] != b"\x80" or f == ".metadata", f
    assert dist_harness.leftovers(str(ckpts)) == []

    from safeckpt.integrations.lightning_dcp import read_lightning_state

    meta = read_lightning_state(ckpts / "last.ckpt")
    assert (meta["epoch"], meta["global_step"]) == (out[0].value["epoch"], 18)  # as Lightning records them
    assert meta["hyper_parameters"] == {"hidden": 16, "lr": 0.02, "sharded": True, "bn": False}
    assert "state_dict" not in meta and "optimizer_states" not in meta
    (cb_state,) = [v for k, v in meta["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert isinstance(cb_state["best_model_score"], torch.Tensor)
    assert {os.path.basename(k) for k in cb_state["best_k_models"]} == names - {"last.ckpt"}
    assert meta["lr_schedulers"][0]["last_epoch"] == 18

    # Outside Lightning: the full model through safeckpt (consolidated weights equal the
    # reference run's), and the manifest says who wrote it.
    flat = safeckpt.read_state_dict(str(ckpts / "last.ckpt"))
    for k, v in out[0].value["ref_model"].items():
        assert torch.equal(flat[f"state_dict/{k}"], torch.from_numpy(v)), k
    man = json.loads((ckpts / "last.ckpt" / "manifest.json").read_text())
    assert man["world_size"] == 2 and "safeckpt.dcp" in man["metadata"]


def test_refuses_full_torch_save_checkpoints():
    from safeckpt.integrations.lightning_dcp import SafeckptDCPModelParallelStrategy

    with pytest.raises(safeckpt.CheckpointError, match="pickled"):
        SafeckptDCPModelParallelStrategy(save_distributed_checkpoint=False)
