"""Lightning strategy, issue 22 requirements 1 and 3, on 2 processes (gloo, CPU, DDP): every
entry point (save, load "last" and the optimizers' in-place load, remove, the hyper-parameter
check at fit start) fails on every rank, promptly, when one rank fails; the checkpoint is
restored before ``on_fit_start`` as stock DDP does; a user's ``load_state_dict`` override is
called with Lightning's ``strict``. One spawn holds every check."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from tests.helpers import dist_harness  # noqa: E402
from tests.integrations import lightning_app as app  # noqa: E402

ENV = {"SAFECKPT_TIMEOUT": "30", "PYTHONWARNINGS": "ignore"}
PROMPT = 20.0


class _Opaque:
    pass


class WithOpaque(app.Net):
    def __init__(self, handle: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()


class Recording(app.Net):
    """Records what Lightning passes to load_state_dict (test_strict_loading's check)."""

    strict_seen: list = []

    def load_state_dict(self, state_dict, strict=True, assign=False):
        type(self).strict_seen.append((strict, sorted(state_dict)[:1]))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


class AtFitStart(pl.Callback):
    """What on_fit_start sees (test_callbacks_state_fit_ckpt_path's check)."""

    def __init__(self) -> None:
        self.weights = None
        self.best_k = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.best_k = dict(trainer.checkpoint_callback.best_k_models)


def _strategy():
    from safeckpt.integrations import lightning as sl

    return sl.SafeckptDDPStrategy(checkpoint_timeout=30)


def _worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import safeckpt
    from safeckpt.format import shardfile as _shardfile
    from safeckpt.integrations import lightning as sl
    from safeckpt.integrations._lightning import resume as _lightning_resume

    out: dict = {}
    app.scramble(0)
    model = app.Net()
    trainer = app.trainer(root, _strategy(), 1, world)
    trainer.fit(model)
    ckpts = os.path.join(root, "ckpts")
    last = os.path.join(ckpts, "last.ckpt")
    saved = sl.read_checkpoint(last)

    # restore before on_fit_start; a load_state_dict override gets Lightning's call
    app.scramble(5)
    seen = AtFitStart()
    rec = Recording()
    t2 = app.trainer(root, _strategy(), 2, world, callbacks=[seen])
    t2.fit(rec, ckpt_path=last)
    out["fit_start_weights"] = all(torch.equal(seen.weights[k], v) for k, v in saved["state_dict"].items())
    out["fit_start_best_k"] = sorted(os.path.basename(p) for p in seen.best_k)
    out["strict_seen"] = Recording.strict_seen[:]
    out["resumed_step"] = t2.global_step

    # save: rank 1's write fails -> every rank raises, nothing visible
    real_write = _shardfile.write_file
    if rank == 1:
        def failing(path, *a, **k):
            raise OSError(28, "No space left on device (injected)")
        _replace(safeckpt, "write_file", real_write, failing)
    target = os.path.join(ckpts, "manual.ckpt")
    out["save_rank1"] = dist_harness.attempt(lambda: t2.save_checkpoint(target))
    _replace(safeckpt, "write_file", failing if rank == 1 else real_write, real_write)
    dist.barrier()
    out["save_rank1_visible"] = os.path.exists(target)
    out["save_ok"] = dist_harness.attempt(lambda: t2.save_checkpoint(target))

    # remove: the coordinator's delete fails -> every rank raises, the checkpoint stays
    real_remove = sl.remove
    if rank == 0:
        sl.remove = lambda path: (_ for _ in ()).throw(PermissionError(13, "Permission denied (injected)"))
    out["remove_rank0"] = dist_harness.attempt(lambda: t2.strategy.remove_checkpoint(target))
    sl.remove = real_remove
    dist.barrier()
    out["remove_kept"] = os.path.isdir(target)

    # load "last": rank 0 fails choosing the checkpoint -> every rank raises, before training
    real_pick = _lightning_resume._pick
    if rank == 0:
        _lightning_resume._pick = lambda *a, **k: (_ for _ in ()).throw(OSError(5, "I/O error (injected)"))
    t3 = app.trainer(root, _strategy(), 3, world)
    out["load_pick_rank0"] = dist_harness.attempt(lambda: t3.fit(app.Net(), ckpt_path="last"))
    _lightning_resume._pick = real_pick
    out["load_pick_step"] = t3.global_step

    # the optimizers' in-place load after setup: rank 1 fails -> every rank raises
    real_rng = safeckpt.RNGState.load_state_dict
    if rank == 1:
        def bad_rng(self, state):
            raise RuntimeError("rng restore failed (injected)")
        safeckpt.RNGState.load_state_dict = bad_rng
    t4 = app.trainer(root, _strategy(), 3, world)
    out["load_optim_rank1"] = dist_harness.attempt(lambda: t4.fit(app.Net(), ckpt_path=last))
    safeckpt.RNGState.load_state_dict = real_rng
    out["load_optim_step"] = t4.global_step

    # hyper-parameters no checkpoint can hold: refused at fit start on every rank, nothing trained
    t5 = app.trainer(os.path.join(root, "opaque"), _strategy(), 1, world)
    out["hparams"] = dist_harness.attempt(lambda: t5.fit(WithOpaque(handle=_Opaque())))
    out["hparams_step"] = t5.global_step
    out["hparams_dir"] = os.path.exists(os.path.join(root, "opaque", "ckpts"))
    return out


def _replace(package, name, original, replacement) -> None:
    import sys

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith(package.__name__) and getattr(mod, name, None) is original:
            setattr(mod, name, replacement)


@pytest.mark.timeout(300)
def test_every_entry_point_fails_on_every_rank_and_restore_precedes_on_fit_start(tmp_path):
    outs = dist_harness.run(_worker, 2, str(tmp_path), timeout=240, env=ENV)
    for o in outs:
        assert o.ok, f"rank {o.rank}: {o.error_type}: {o.message}"
    for rank, v in enumerate(o.value for o in outs):
        where = f"rank {rank}"
        assert v["fit_start_weights"], where  # stock DDP restores before on_fit_start
        assert v["fit_start_best_k"], (where, v["fit_start_best_k"])  # ModelCheckpoint restored too
        assert v["strict_seen"] and all(s is True for s, _ in v["strict_seen"]), (where, v["strict_seen"])
        assert v["resumed_step"] == 12, (where, v["resumed_step"])
        for key, text, failing in (("save_rank1", "No space left", 1), ("remove_rank0", "Permission denied", 0),
                                   ("load_pick_rank0", "I/O error", 0), ("load_optim_rank1", "rng restore failed", 1),
                                   ("hparams", "_Opaque at", None)):
            r = v[key]
            assert not r["ok"] and text in r["msg"], (where, key, r)
            assert "CheckpointError" in r["mro"], (where, key, r)
            assert r["elapsed"] < PROMPT, (where, key, r["elapsed"])
            if failing is not None:
                assert f"rank {failing}" in r["msg"], (where, key, r["msg"])
        assert not v["save_rank1_visible"] and v["save_ok"]["ok"], (where, v["save_ok"])
        assert v["remove_kept"], where
        # nothing trained: no step at all, or none beyond the restored loops' step
        assert v["load_pick_step"] == 0 and v["load_optim_step"] == 12, where
        assert v["hparams_step"] == 0 and not v["hparams_dir"], where
