"""Lightning integration, with the real package on 2 processes (gloo, CPU): resume bit-exact
with top-k + save_last across two resumes (DDP with BatchNorm and dropout; FSDP2 through
ModelParallelStrategy + fully_shard), an agreed "last", kill -9 in the middle of a save, and
SIGTERM to one rank. Each scenario is one spawn (importing Lightning costs seconds per process).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import safeckpt  # noqa: E402
from safeckpt.engine.reader import open_manifest  # noqa: E402
from tests.helpers import dist_harness  # noqa: E402

ENV = {"SAFECKPT_TIMEOUT": "30", "PYTHONWARNINGS": "ignore"}


def _strategy(kind: str, world: int, **kw):
    from safeckpt.integrations import lightning as sl

    if kind == "ddp":
        return sl.SafeckptDDPStrategy(checkpoint_timeout=30, **kw)
    return sl.SafeckptModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                           checkpoint_timeout=30, **kw)


def _net(kind: str):
    from tests.integrations import lightning_app as app

    # BatchNorm under DDP (buffers synced from rank 0 before each save); FSDP2 ranks keep
    # their own BatchNorm statistics, which a replicated save refuses, so none there.
    return app.Net(sharded=kind != "ddp", bn=kind == "ddp")


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _topk_state(trainer, root: str) -> dict:
    """ModelCheckpoint's state with paths relative to the run's root (comparable across runs)."""
    cb = trainer.checkpoint_callback

    def rel(p):
        return os.path.relpath(p, root) if p else p

    return {
        "best_k_models": {rel(k): float(v) for k, v in cb.best_k_models.items()},
        "best_model_path": rel(cb.best_model_path),
        "best_model_score": float(cb.best_model_score),
        "kth_best_model_path": rel(cb.kth_best_model_path),
        "kth_value": float(cb.kth_value),
        "last_model_path": rel(cb.last_model_path),
    }


def _run(root: str, kind: str, world: int, epochs: int, resume_seed: int | None = None, ckpt_path=None,
         callbacks=None, strategy=None):
    """One fit in ``root`` from a fresh model; with ``resume_seed`` every RNG is moved away first."""
    from tests.integrations import lightning_app as app

    app.scramble(resume_seed or 0)
    model = _net(kind)
    trainer = app.trainer(root, strategy or _strategy(kind, world), epochs, world, callbacks=callbacks)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


# --------------------------------------------------------------------------- two resumes


def _resume_twice(rank: int, world: int, root: str, kind: str) -> dict:
    import torch.distributed as dist

    from safeckpt.integrations import lightning as sl
    from tests.integrations import lightning_app as app

    ref_root, run_root = os.path.join(root, "ref"), os.path.join(root, "run")
    model, trainer = _run(ref_root, kind, world, 4)
    ref = app.full_state(model, trainer)
    ref_topk = _topk_state(trainer, ref_root)

    _run(run_root, kind, world, 2)
    ckpts = os.path.join(run_root, "ckpts")
    # An older "last"-style checkpoint: Lightning's per-rank mtime rule could hand either file
    # to a rank; here rank 1 asks for it explicitly. Rank 0's choice (the newest) must win.
    if rank == 0:
        shutil.copytree(os.path.join(ckpts, "epoch=0-step=6.ckpt"), os.path.join(ckpts, "last-7.ckpt"))
    dist.barrier()
    first = "last" if rank == 0 else os.path.join(ckpts, "last-7.ckpt")
    _, trainer = _run(run_root, kind, world, 3, resume_seed=11, ckpt_path=first)
    resumed_from = [trainer.ckpt_path]
    model, trainer = _run(run_root, kind, world, 4, resume_seed=12, ckpt_path="last")
    resumed_from.append(trainer.ckpt_path)
    got = app.full_state(model, trainer)
    out = {
        "diff": _diff(ref, got),
        "ref_topk": ref_topk,
        "topk": _topk_state(trainer, run_root),
        "resumed_from": resumed_from,
        # numpy, not tensors: torch would pass tensors through shared memory that dies with us
        "ref_model": {k[len("model/"):]: v.numpy() for k, v in ref.items() if k.startswith("model/")},
        "io_error": dist_harness.attempt(
            lambda: sl.SafeckptIO().save_checkpoint({"state_dict": {}}, os.path.join(root, "io.ckpt"))),
    }
    if kind == "ddp":
        # Outside fit only the model (and Lightning's state) is loaded, from an older checkpoint.
        older = sorted(trainer.checkpoint_callback.best_k_models)[0]
        trainer.validate(model, ckpt_path=older, verbose=False)
        expected = sl.read_checkpoint(older)["state_dict"]
        out["validate_diff"] = _diff(expected, dict(model.state_dict()))
        # A weights-only checkpoint cannot resume training: a clear error on every rank; as the
        # newest checkpoint in the directory it is passed over by "last" for fit.
        weights = os.path.join(ckpts, "weights.ckpt")
        trainer.save_checkpoint(weights, weights_only=True)
        out["weights_only_fit"] = dist_harness.attempt(
            lambda: _run(os.path.join(root, "w"), kind, world, 5, resume_seed=1, ckpt_path=weights))
        _, trainer = _run(run_root, kind, world, 4, resume_seed=2, ckpt_path="last")
        out["last_for_fit"] = trainer.ckpt_path
        trainer.strategy.remove_checkpoint(weights)  # collective, atomic
        out["weights_left"] = os.path.exists(weights)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_resume_bit_exact_with_topk_and_last_across_two_resumes(tmp_path, kind):
    from safeckpt.integrations import lightning as sl
    from tests.integrations import lightning_app as app

    out = dist_harness.run(_resume_twice, 2, str(tmp_path), kind, timeout=200, env=ENV)
    for o in out:
        assert o.ok, o.message
    r0, r1 = out[0].value, out[1].value
    ckpts = tmp_path / "run" / "ckpts"
    for r in (r0, r1):
        # Model (BatchNorm buffers included), AdamW state, scheduler and RNG: bit for bit.
        assert r["diff"] == [], r["diff"]
        # ModelCheckpoint's top-k bookkeeping (keyed by file path) survived both resumes.
        assert r["topk"] == r["ref_topk"]
        # Both ranks resumed from the newest checkpoint, whatever each one asked for.
        assert r["resumed_from"] == [str(ckpts / "last.ckpt")] * 2
        assert r["io_error"]["type"] == "CheckpointError" and "rank 0 only" in r["io_error"]["msg"]
        if kind == "ddp":
            assert r["validate_diff"] == []
            assert r["weights_only_fit"]["type"] == "IncompatibleCheckpoint", r["weights_only_fit"]
            assert "save_weights_only" in r["weights_only_fit"]["msg"]
            assert r["last_for_fit"] == str(ckpts / "last.ckpt") and not r["weights_left"]
    assert r0["ref_topk"]["best_k_models"] and len(r0["ref_topk"]["best_k_models"]) == 2

    # On disk: exactly the top-k directories, last.ckpt and the planted copy; all committed
    # checkpoints that verify; no staging or trash leftovers.
    expected = {os.path.basename(p) for p in r0["topk"]["best_k_models"]} | {"last.ckpt", "last-7.ckpt"}
    assert set(os.listdir(ckpts)) == expected
    for name in expected:
        report = safeckpt.verify(ckpts / name)
        assert report.ok, report.problems
    assert dist_harness.leftovers(ckpts) == []

    last = ckpts / "last.ckpt"
    man = json.loads((last / "manifest.json").read_text())
    assert set(man["objects"]) == {"model", "optimizer_0", "lightning", "rng"}
    assert man["world_size"] == 2 and man["step"] == 24
    weight = man["tensors"]["model/net.0.weight"]
    assert weight["scope"] == ("replicated" if kind == "ddp" else "sharded")
    if kind == "fsdp2":  # sharded optimizer state keyed by parameter name (loads on any world size)
        assert "optimizer_0/state/net.0.weight/exp_avg" in man["tensors"]

    # The stored Lightning dict: best_k_models keyed by absolute file paths, exactly.
    ckpt = sl.read_checkpoint(last)
    cb_state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert {os.path.relpath(k, tmp_path / "run"): float(v) for k, v in cb_state["best_k_models"].items()} \
        == r0["topk"]["best_k_models"]
    assert ckpt["global_step"] == 24 and ckpt["epoch"] == 3
    assert ckpt["hyper_parameters"] == {"hidden": 16, "lr": 0.02, "sharded": kind != "ddp", "bn": kind == "ddp"}

    # load_from_checkpoint-style: a plain module (an FSDP2 checkpoint comes back unsharded).
    model = sl.load_from_checkpoint(app.Net, last, sharded=False)
    assert isinstance(model, app.Net) and not model.hparams.sharded
    ref_model = {k: torch.from_numpy(v) for k, v in r0["ref_model"].items()}
    assert _diff(model.state_dict(), ref_model) == []

    if kind == "fsdp2":
        # Damage the newest checkpoint's data (its manifest still looks fine): "last" must fall
        # back to the next newest that loads, and the 2-rank sharded checkpoint resumes on 1 rank.
        # (format 3: the manifest no longer lists chunks; the reader's format-2 view does)
        chunk = open_manifest(str(last))["tensors"]["model/net.0.weight"]["chunks"][0]
        data = last / chunk["file"]
        raw = bytearray(data.read_bytes())
        raw[(chunk["start"] + chunk["end"]) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        out = dist_harness.run(_resume_on_one_rank, 1, str(tmp_path), timeout=120, env=ENV)
        assert out[0].ok, out[0].message
        v = out[0].value
        assert v["resumed_from"] != str(last) and v["fell_back"], v
        assert v["diff"] == [] and v["restored_step"] == safeckpt.verify(v["resumed_from"]).step, v
        assert v["final_step"] == v["restored_step"] + 12, v  # one more epoch: 12 batches on 1 rank
        # ...and the 1-rank checkpoint it wrote resumes on 2 ranks: rank 1, which the saving run
        # did not have, gets rank 0's loops and callbacks.
        out = dist_harness.run(_resume_on_one_rank, 2, str(tmp_path), timeout=120, env=ENV)
        for o in out:
            assert o.ok, o.message
            assert o.value["diff"] == [] and o.value["restored_step"] == v["final_step"], o.value
            assert o.value["fell_back"] == [] and o.value["best_k_models"] == v["best_k_models"]


def _resume_on_one_rank(rank: int, world: int, root: str) -> dict:
    import warnings

    import lightning.pytorch as pl

    from safeckpt.integrations import lightning as sl
    from tests.integrations import lightning_app as app

    run_root = os.path.join(root, "run")
    seen: dict = {}

    class Restored(pl.Callback):
        def on_load_checkpoint(self, trainer, module, checkpoint):
            saved = sl.read_checkpoint(trainer.ckpt_path)
            expected = {f"model/{k}": v for k, v in saved["state_dict"].items()}
            for fqn, st in saved["optimizer_states"][0]["state"].items():
                expected.update({f"optim/{fqn}/{k}": v for k, v in st.items()})
            seen["expected"] = expected
            seen["restored_step"] = checkpoint["global_step"]
            seen["best_k_models"] = {k: float(v) for k, v in checkpoint["callbacks"][
                trainer.checkpoint_callback.state_key]["best_k_models"].items()}

        def on_train_start(self, trainer, module):
            # As with stock Lightning, callbacks' on_load_checkpoint runs before the optimizers
            # are restored (restore_training_state); by the first training hook all of it is.
            expected = seen.pop("expected")
            got = app.full_state(module, trainer)
            seen["diff"] = _diff(expected, {k: got[k] for k in expected if k in got})

    # One more epoch on one rank; on two ranks (after that) only the restore (epoch 5 reached).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trainer = _run(run_root, "fsdp2", world, 5, resume_seed=4, ckpt_path="last", callbacks=[Restored()])
    if "expected" in seen:  # nothing left to train (epoch 5 reached): the state is as restored
        expected = seen.pop("expected")
        got = app.full_state(trainer.lightning_module, trainer)
        seen["diff"] = _diff(expected, {k: got[k] for k in expected if k in got})
    fell_back = [str(w.message) for w in caught if "falling back" in str(w.message)]
    return {**seen, "resumed_from": trainer.ckpt_path, "fell_back": fell_back, "final_step": trainer.global_step}


# --------------------------------------------------------------------------- kill -9 mid-save


def _killed_mid_save(rank: int, world: int, root: str) -> None:
    """Rank 0 (the coordinator, who would clean up) is SIGKILLed right after its data file of the
    second last.ckpt save (step 12, replacing the one of step 6) is written and fsynced, before
    the commit. The hook is os.fsync, which every durable write goes through."""
    import signal

    real, seen = os.fsync, [0]

    def fsync_then_die(fd: int) -> None:
        real(fd)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if rank == 0 and "/.last.ckpt.safeckpt-staging-" in target and target.endswith(".safetensors"):
            seen[0] += 1
            if seen[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    os.fsync = fsync_then_die
    _run(os.path.join(root, "run"), "ddp", world, 4)


def _resume_after_kill(rank: int, world: int, root: str) -> dict:
    from tests.integrations import lightning_app as app

    model, trainer = _run(os.path.join(root, "ref"), "ddp", world, 4)
    ref = app.full_state(model, trainer)
    model, trainer = _run(os.path.join(root, "run"), "ddp", world, 4, resume_seed=3, ckpt_path="last")
    return {"diff": _diff(ref, app.full_state(model, trainer)), "resumed_from": trainer.ckpt_path}


@pytest.mark.timeout(240)
def test_kill_9_mid_save_keeps_previous_checkpoint_loadable(tmp_path):
    out = dist_harness.run(_killed_mid_save, 2, str(tmp_path), timeout=120, env=ENV)
    assert out[0].exitcode == -9, out[0]
    assert not out[1].ok and out[1].raised("RankFailure"), out[1].message
    ckpts = tmp_path / "run" / "ckpts"
    # The interrupted overwrite left a staging directory and the previous last.ckpt intact.
    assert [n for n in dist_harness.leftovers(ckpts) if n.startswith(".last.ckpt.")], os.listdir(ckpts)
    last = safeckpt.verify(ckpts / "last.ckpt")
    assert last.ok and last.step == 6, last
    newest = safeckpt.verify(ckpts / "epoch=1-step=12.ckpt")
    assert newest.ok and newest.step == 12, newest

    out = dist_harness.run(_resume_after_kill, 2, str(tmp_path), timeout=150, env=ENV)
    for o in out:
        assert o.ok, o.message
        # "last" is the newest valid checkpoint (step 12), not last.ckpt by name (step 6);
        # resuming from it ends bit-exact with the uninterrupted run.
        assert o.value["resumed_from"] == str(ckpts / "epoch=1-step=12.ckpt")
        assert o.value["diff"] == [], o.value["diff"]
    assert dist_harness.leftovers(ckpts) == []  # swept at resume


# --------------------------------------------------------------------------- SIGTERM to one rank
# DDP with BatchNorm: saved right after a training step, when each rank's BatchNorm statistics
# are its own until DDP's next forward; the strategy takes rank 0's first (as that forward would).


def _preempted(rank: int, world: int, root: str) -> dict:
    import signal

    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from safeckpt.integrations import lightning as sl
    from tests.integrations import lightning_app as app

    seen: dict = {}

    class Preemption(sl.SafeckptPreemption):
        def on_train_batch_end(self, trainer, module, *args):
            try:
                super().on_train_batch_end(trainer, module, *args)
            except SIGTERMException:
                seen["saved"] = app.full_state(module, trainer)
                seen["saved_step"] = trainer.global_step
                raise

    class SignalRank1(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if rank == 1 and trainer.global_step == 8:
                os.kill(os.getpid(), signal.SIGTERM)

    class Restored(pl.Callback):
        def on_load_checkpoint(self, trainer, module, checkpoint):
            seen["restored_step"] = checkpoint["global_step"]

    # DDP restores the module before setup (as stock Lightning does), the optimizers and RNG
    # when Lightning restores the training state: the state right after that is compared
    strategy = _strategy("ddp", world)
    restore_optimizers = strategy.load_optimizer_state_dict

    def restore_then_record(checkpoint):
        restore_optimizers(checkpoint)
        seen["restored"] = app.full_state(strategy.lightning_module, strategy.lightning_module.trainer)

    strategy.load_optimizer_state_dict = restore_then_record

    run_root = os.path.join(root, "run")
    pre = Preemption()
    try:
        _run(run_root, "ddp", world, 3, callbacks=[pre, SignalRank1()])
        raise AssertionError("training was not stopped")
    except SIGTERMException:  # a SystemExit: what a preempted script ends with
        pass
    _, trainer = _run(run_root, "ddp", world, 3, resume_seed=9, ckpt_path="last",
                      callbacks=[sl.SafeckptPreemption(), Restored()], strategy=strategy)
    return {
        "saved_path": pre.saved_path,
        "saved_step": seen["saved_step"],
        "restored_step": seen["restored_step"],
        "resumed_from": trainer.ckpt_path,
        # Model, optimizer and RNG as saved (the scheduler as saved is checked by the resume tests).
        "diff": _diff({k: v for k, v in seen["saved"].items() if not k.startswith("sched/")},
                      {k: v for k, v in seen["restored"].items() if not k.startswith("sched/")}),
        "final_step": trainer.global_step,
    }


@pytest.mark.timeout(240)
def test_sigterm_on_one_rank_every_rank_saves_the_same_step_and_stops(tmp_path):
    out = dist_harness.run(_preempted, 2, str(tmp_path), timeout=200, env=ENV)
    for o in out:
        assert o.ok, o.message
    path = str(tmp_path / "run" / "ckpts" / "last-preempted.ckpt")
    for o in out:
        v = o.value
        assert v["saved_path"] == path and v["saved_step"] == 9, v
        assert v["resumed_from"] == path and v["restored_step"] == 9
        # Model (BatchNorm statistics of this very step included) + optimizer + RNG as saved.
        assert v["diff"] == [], v["diff"]
        assert v["final_step"] == 18
    report = safeckpt.verify(path)
    assert report.ok and report.step == 9
