"""Lightning with the fast-recovery tier (issue 28 item 7): ``SafeckptDDPStrategy(local_dir=...,
durable_every=..., replicas=...)`` on 2 real ranks (2 simulated nodes: GROUP_RANK per rank, each
its own local_dir; gloo, CPU). The job is SIGKILLed after two epochs whose checkpoints are on the
nodes only; one node's local_dir is wiped; ``ckpt_path="last"`` resumes the newest step from the
other node's copies and replicas, and the run ends bit-exact with an uninterrupted one. And
``check_finite`` without the tier: Lightning's bookkeeping (``kth_value = inf``) passes, a NaN in
the module is refused on every rank, naming the tensor.
"""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("lightning")

from tests.helpers import dist_harness  # noqa: E402

ENV = {"SAFECKPT_TIMEOUT": "30", "PYTHONWARNINGS": "ignore"}


def _strategy(nodes: str, rank: int):
    from safeckpt.integrations import lightning as sl

    return sl.SafeckptDDPStrategy(checkpoint_timeout=30, local_dir=os.path.join(nodes, f"node{rank}"),
                                  durable_every=100, replicas=1, keep_local=2, check_finite=True)


def _fit(root: str, nodes: str, rank: int, world: int, epochs: int, seed: int = 0, ckpt_path=None,
         callbacks=None):
    import lightning.pytorch as pl

    from tests.integrations import lightning_app as app

    class Node(pl.Callback):
        """Each rank its own simulated node. Set once Lightning has placed the ranks (its
        environment reads GROUP_RANK as the node rank too, which would make rank 1 rank 3)."""

        def setup(self, trainer, module, stage) -> None:
            os.environ["GROUP_RANK"] = str(rank)

        def teardown(self, trainer, module, stage) -> None:
            os.environ.pop("GROUP_RANK", None)  # the next Trainer of this process places its ranks again

    app.scramble(seed)
    model = app.Net(bn=True)
    trainer = app.trainer(root, _strategy(nodes, rank), epochs, world, callbacks=[Node(), *(callbacks or [])])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def _killed_after_two_epochs(rank: int, world: int, root: str, nodes: str) -> None:
    import lightning.pytorch as pl

    class Kill(pl.Callback):
        def on_train_epoch_start(self, trainer, module) -> None:
            if trainer.current_epoch == 2:  # steps 6 and 12 saved (locally): wait, then die
                import torch.distributed as dist

                for mgr in trainer.strategy._managers.values():
                    mgr.wait()
                dist.barrier()  # both ranks are here: neither is inside a collective the other left
                os.kill(os.getpid(), signal.SIGKILL)

    _fit(os.path.join(root, "run"), nodes, rank, world, 4, callbacks=[Kill()])


def _resume(rank: int, world: int, root: str, nodes: str) -> dict:
    import torch

    from tests.integrations import lightning_app as app

    ckpts = os.path.join(root, "run", "ckpts")
    # the checkpoints (not root's run file, .safeckpt-run.json, which the tier writes)
    before = sorted(n for n in os.listdir(ckpts) if not n.startswith(".")) if os.path.isdir(ckpts) else []
    model, trainer = _fit(os.path.join(root, "run"), nodes, rank, world, 4, seed=11, ckpt_path="last")
    got = app.full_state(model, trainer)
    resumed_from = trainer.ckpt_path
    ref_model, ref_trainer = _fit(os.path.join(root, "ref"), os.path.join(nodes, "ref"), rank, world, 4)
    ref = app.full_state(ref_model, ref_trainer)
    diff = sorted(k for k in set(ref) | set(got) if k not in ref or k not in got or not torch.equal(ref[k], got[k]))
    return {"before": before, "resumed_from": resumed_from, "diff": diff, "after": sorted(os.listdir(ckpts))}


@pytest.mark.timeout(300)
def test_lightning_resumes_a_local_only_step_after_a_node_is_lost(tmp_path):
    import shutil

    import safeckpt
    from safeckpt.engine.local_tier import tier_tag, tier_url

    root, nodes = tmp_path, tmp_path / "nodes"
    out = dist_harness.run(_killed_after_two_epochs, 2, str(root), str(nodes), timeout=150, env=ENV)
    for o in out:
        assert not o.ok and o.exitcode == -signal.SIGKILL, (o.rank, o.exitcode, o.message)
    ckpts = root / "run" / "ckpts"
    tag = tier_tag(str(ckpts))
    held = sorted(n for n in os.listdir(nodes / "node0" / tag) if n.startswith("step-"))
    assert held == ["step-0000000006", "step-0000000012"]  # keep_local=2
    shutil.rmtree(nodes / "node1")  # node 1 lost with its local_dir
    out = dist_harness.run(_resume, 2, str(root), str(nodes), timeout=240, env=ENV)
    for o in out:
        assert o.ok, (o.rank, o.error_type, o.message)
        v = o.value
        assert v["before"] == [], v  # nothing durable: the resume had the nodes' copies only
        assert v["resumed_from"] == tier_url(tag, 12), v
        assert v["diff"] == [], v["diff"]  # model, BatchNorm buffers, AdamW, scheduler, RNG: bit for bit
        # the newest step was committed at the end of training, under Lightning's name for it
        assert "epoch=3-step=24.ckpt" in v["after"], v
    assert safeckpt.verify(ckpts / "epoch=3-step=24.ckpt").ok


def _finite_only(rank: int, world: int, root: str) -> dict:
    import torch

    import safeckpt
    from safeckpt.integrations import lightning as sl
    from tests.integrations import lightning_app as app

    app.scramble(0)
    model = app.Net(bn=True)
    strategy = sl.SafeckptDDPStrategy(checkpoint_timeout=30, check_finite=True)  # no local_dir
    trainer = app.trainer(root, strategy, 1, world)
    trainer.fit(model)  # ModelCheckpoint keeps kth_value = inf: not a tensor check_finite refuses
    ckpts = os.path.join(root, "ckpts")
    with torch.no_grad():
        model.net[0].weight[0, 0] = float("nan")
    poisoned = os.path.join(ckpts, "poisoned.ckpt")
    try:
        trainer.save_checkpoint(poisoned)
        refused = None
    except safeckpt.CheckpointError as exc:
        refused = [type(exc).__name__, str(exc)]
    return {"names": sorted(n for n in os.listdir(ckpts) if not n.startswith(".")),  # not the manager's lease
            "refused": refused}


@pytest.mark.timeout(200)
def test_lightning_check_finite_without_the_tier(tmp_path):
    import safeckpt

    out = dist_harness.run(_finite_only, 2, str(tmp_path), timeout=150, env=ENV)
    for o in out:
        assert o.ok, (o.rank, o.error_type, o.message)
        v = o.value
        assert v["names"] == ["epoch=0-step=6.ckpt", "last.ckpt"], v
        assert v["refused"] is not None and "check_finite" in v["refused"][1], v
        assert "NaN/Inf in model/net.0.weight" in v["refused"][1], v
    for name in ("epoch=0-step=6.ckpt", "last.ckpt"):
        assert safeckpt.verify(tmp_path / "ckpts" / name).ok
    assert not (tmp_path / "ckpts" / "poisoned.ckpt").exists()


def _preempted(rank: int, world: int, root: str, nodes: str) -> dict:
    import lightning.pytorch as pl

    from safeckpt.integrations import lightning as sl

    class Signal(pl.Callback):  # rank 1 alone is "signalled" (the handler's flag) at step 8
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if rank == 1 and trainer.global_step == 8:
                preempt.flag = True

    preempt = sl.SafeckptPreemption()
    try:
        _fit(os.path.join(root, "run"), nodes, rank, world, 4, callbacks=[Signal(), preempt])
        stopped = False
    except SystemExit:  # Lightning's SIGTERMException, on every rank
        stopped = True
    return {"stopped": stopped, "saved": preempt.saved_path}


def _resume_from_root(rank: int, world: int, root: str, nodes: str) -> dict:
    model, trainer = _fit(os.path.join(root, "run"), nodes, rank, world, 1, seed=3, ckpt_path="last")
    return {"resumed_from": trainer.ckpt_path, "step": trainer.global_step}


@pytest.mark.timeout(300)
def test_lightning_preemption_with_the_tier_commits_the_step_to_the_directory(tmp_path):
    """The preemption save of a tier strategy is durable at once (nodes are often lost with a
    preemption): committed in the checkpoint directory under a name with its step, before
    training stops; with every node's local_dir gone, "last" resumes it from there."""
    import shutil

    import safeckpt

    nodes = tmp_path / "nodes"
    out = dist_harness.run(_preempted, 2, str(tmp_path), str(nodes), timeout=150, env=ENV)
    for o in out:
        assert o.ok and o.value["stopped"], (o.rank, o.error_type, o.message, o.value)
    ckpts = tmp_path / "run" / "ckpts"
    assert (ckpts / "step-0000000008").is_dir()  # durable_every=100: only the preemption made it durable
    assert safeckpt.verify(ckpts / "step-0000000008").ok
    shutil.rmtree(nodes)  # every node lost
    out = dist_harness.run(_resume_from_root, 2, str(tmp_path), str(nodes), timeout=150, env=ENV)
    for o in out:
        assert o.ok, (o.rank, o.error_type, o.message)
        assert o.value["resumed_from"] == str(ckpts / "step-0000000008"), o.value
