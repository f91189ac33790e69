"""torchtitan 0.3.0's own CheckpointManager through safeckpt.dcp, against stock DCP, in one run.

Real torchtitan code end to end (its CheckpointManager, ModelWrapper, OptimizersContainer of
AdamW, LRSchedulersContainer, ParallelAwareDataloader whose state is ``pickle.dumps`` bytes), a
tiny FSDP2 model, 2 ranks on gloo (CPU). The only change is the one a user makes: the ``dcp``
module torchtitan's checkpointer calls gets safeckpt's writer and reader (``_SafeckptDCP``).
Every phase runs twice in the same processes, once with stock DCP and once through safeckpt, and
the states they restore must be bit-identical:

1. save (sync, interval 2, keep_latest_k=2) steps 2 and 4; a restarted job resumes through
   torchtitan's own discovery (``load()``: the newest ``step-N`` holding ``.metadata``);
2. a restart from step 2 (``load(step=2)``) trains on and saves step 4 again (an existing
   checkpoint: replaced, as stock DCP does), then step 6; retention leaves steps 4 and 6;
3. async (thread) mode: saves at 2 and 4, resumed by discovery after ``close()``;
4. model-only export at the last step (``last_save_model_only``), loaded by a new job through
   ``initial_load_path``.

torchtitan's unit tests mock DCP; nothing here is mocked.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torchtitan.components.checkpoint")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

import safeckpt  # noqa: E402
import safeckpt.dcp  # noqa: E402
from tests.helpers import dist_harness  # noqa: E402

pytestmark = pytest.mark.timeout(240)


class _SafeckptDCP:
    """What torchtitan's checkpointer sees as ``dcp`` after the user's change: ``dcp.save`` /
    ``dcp.async_save`` given ``safeckpt.dcp.StorageWriter(checkpoint_id)``, ``dcp.load`` given ``safeckpt.dcp.StorageReader(checkpoint_id)``."""

    calls: list[str] = []

    @staticmethod
    def _writer(storage_writer, checkpoint_id):
        if storage_writer is not None:  # torchtitan's HF export: its own writer
            return storage_writer
        _SafeckptDCP.calls.append(f"save {os.path.basename(checkpoint_id)}")
        return safeckpt.dcp.StorageWriter(checkpoint_id)  # the defaults: replace, commit .metadata

    @staticmethod
    def save(state_dict, *, storage_writer=None, checkpoint_id=None, **kw):
        return dcp.save(state_dict, storage_writer=_SafeckptDCP._writer(storage_writer, checkpoint_id),
                        checkpoint_id=checkpoint_id, **kw)

    @staticmethod
    def async_save(state_dict, *, storage_writer=None, checkpoint_id=None, **kw):
        return dcp.async_save(state_dict, storage_writer=_SafeckptDCP._writer(storage_writer, checkpoint_id),
                              checkpoint_id=checkpoint_id, **kw)

    @staticmethod
    def load(state_dict, *, checkpoint_id=None, storage_reader=None, **kw):
        if storage_reader is None:
            _SafeckptDCP.calls.append(f"load {os.path.basename(checkpoint_id)}")
            storage_reader = safeckpt.dcp.StorageReader(checkpoint_id)
        return dcp.load(state_dict, storage_reader=storage_reader, **kw)


# ----------------------------------------------------------------------------- a tiny trainer
class _Data(torch.utils.data.IterableDataset):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        i = 0
        while True:
            yield torch.sin(torch.arange(8.0) * (i + 1) + 100.0 * self.rank)
            i += 1


class _TrainState:
    """Stands in for torchtitan's trainer state: a step and a tensor (the global losses)."""

    def __init__(self) -> None:
        self.step = 0
        self.losses = torch.zeros(8)

    def state_dict(self):
        return {"step": self.step, "losses": self.losses}

    def load_state_dict(self, sd):
        self.step = sd["step"]
        self.losses = sd["losses"].clone()


class _Job:
    """One torchtitan training job: FSDP2 model, its optimizer, scheduler, dataloader, manager."""

    def __init__(self, rank, world, seed, **ckpt_config):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import OptimizersContainer
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.opt = OptimizersContainer(OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
            implementation="for-loop"), model_parts=[self.model])
        self.sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.opt, training_steps=12)
        self.data = ParallelAwareDataloader(_Data(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
        self.train_state = _TrainState()
        self.ckpt = CheckpointManager(
            CheckpointManager.Config(enable=True, **ckpt_config), dataloader=self.data,
            model_parts=[self.model], optimizers=self.opt, lr_schedulers=self.sched,
            states={"train_state": self.train_state}, sd_adapter=None)
        self._it = None

    def train(self, upto: int, save: bool = True) -> None:
        if self._it is None:
            self._it = iter(self.data)
        while self.train_state.step < upto:
            step = self.train_state.step + 1
            x = next(self._it)
            loss = self.model(x).pow(2).mean()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.train_state.step = step
            global_loss = loss.detach().clone()  # a plain tensor in DCP is one value for all ranks
            torch.distributed.all_reduce(global_loss)
            self.train_state.losses[step % 8] = global_loss
            if save:
                self.ckpt.save(step, last_step=False)

    def snapshot(self) -> dict:
        """Everything a resume restores, as plain CPU tensors and values (full, unsharded)."""
        def full(v):
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            return v.detach().clone() if isinstance(v, torch.Tensor) else v

        out = {f"model/{k}": full(v) for k, v in self.model.state_dict().items()}
        for k, v in self.opt.state_dict().items():
            out[f"optim/{k}"] = full(v)
        out["sched"] = repr(self.sched.state_dict())
        out["data"] = self.data.state_dict()[f"dp_rank_{self.data.dp_rank}"]
        out["train"] = (self.train_state.step, self.train_state.losses.clone())
        out["next_batch"] = next(self._it if self._it is not None else iter(self.data))  # where it resumes
        return out

    def close(self) -> None:
        self.ckpt.close()


def _diff(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors: dtype, shape and every bit)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if k == "train":
            same = x[0] == y[0] and torch.equal(x[1], y[1])
        elif isinstance(x, torch.Tensor):
            same = (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y))
        else:
            same = x == y
        if not same:
            bad.append(k)
    return bad


def _steps(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


# ----------------------------------------------------------------------------- the run
def _phases(rank, world, root, backend):
    """Every phase with one backend; returns the snapshots and what was on disk."""
    import torch.distributed as dist
    import torchtitan.components.checkpointer.dcp as tt_dcp

    tt_dcp.dcp = _SafeckptDCP if backend == "safeckpt" else dcp
    base = os.path.join(root, backend)
    out: dict = {}
    try:
        sync = dict(folder=os.path.join(base, "sync"), interval=2, keep_latest_k=2, last_save_model_only=False)
        # 1. steps 1-4, saves at 2 and 4; a restarted job resumes by torchtitan's discovery
        job = _Job(rank, world, 0, **sync)
        job.train(4)
        out["trained4"] = job.snapshot()
        job.close()
        job = _Job(rank, world, 1, **sync)  # other init: everything must come from the checkpoint
        out["found"] = job.ckpt.load()
        out["resumed4"] = job.snapshot()
        job.close()
        # 2. restart from step 2: step 4 is saved again over the existing one, then step 6
        job = _Job(rank, world, 2, **sync)
        out["found2"] = job.ckpt.load(step=2)
        job.train(6)
        out["trained6"] = job.snapshot()
        job.close()
        dist.barrier()
        out["sync_steps"] = _steps(sync["folder"])
        job = _Job(rank, world, 3, **sync)
        out["found6"] = job.ckpt.load()
        out["resumed6"] = job.snapshot()
        job.close()

        # 3. async (thread) mode
        asy = dict(folder=os.path.join(base, "async"), interval=2, keep_latest_k=0, async_mode="async",
                   last_save_model_only=False)
        job = _Job(rank, world, 0, **asy)
        job.train(4)
        job.ckpt.maybe_wait_for_saving()  # torchtitan's close() does not wait for it
        out["async_trained4"] = job.snapshot()
        job.close()
        job = _Job(rank, world, 4, **asy)
        out["async_found"] = job.ckpt.load()
        out["async_resumed4"] = job.snapshot()
        job.close()
        dist.barrier()
        out["async_steps"] = _steps(asy["folder"])

        # 4. model-only export at the last step, loaded by a new job through initial_load_path
        export = dict(folder=os.path.join(base, "export"), interval=100, keep_latest_k=0,
                      last_save_model_only=True, export_dtype="float32")
        job = _Job(rank, world, 0, **export)
        job.train(3, save=False)
        job.ckpt.save(3, last_step=True)
        out["export_model"] = {k: v for k, v in job.snapshot().items() if k.startswith("model/")}
        job.close()
        dist.barrier()
        fresh = dict(folder=os.path.join(base, "fresh"), interval=100, keep_latest_k=0,
                     initial_load_path=os.path.join(export["folder"], "step-3"), initial_load_model_only=True)
        job = _Job(rank, world, 5, **fresh)
        out["initial_found"] = job.ckpt.load()
        out["initial_model"] = {k: v for k, v in job.snapshot().items() if k.startswith("model/")}
        job.close()
        dist.barrier()
    finally:
        tt_dcp.dcp = dcp
    return out


def _run(rank, world, root):
    import gc

    import torch.distributed as dist

    got = {b: _phases(rank, world, root, b) for b in ("stock", "safeckpt")}
    s, k = got["stock"], got["safeckpt"]
    report = {"calls": list(_SafeckptDCP.calls)}
    for key in s:
        if isinstance(s[key], dict):
            report[f"diff {key}"] = _diff(s[key], k[key])
        else:
            report[key] = (s[key], k[key])
    # the runs themselves: a resume restores what was trained
    for trained, resumed in (("trained4", "resumed4"), ("trained6", "resumed6"),
                             ("async_trained4", "async_resumed4")):
        for b in ("stock", "safeckpt"):
            report[f"{b} {trained}->{resumed}"] = _diff(got[b][trained], got[b][resumed])
    for b in ("stock", "safeckpt"):
        report[f"{b} export->initial"] = _diff(got[b]["export_model"], got[b]["initial_model"])
    del got, s, k
    gc.collect()
    dist.barrier()
    return report


def test_torchtitan_checkpoint_manager_through_safeckpt_dcp(tmp_path):
    root = str(tmp_path)
    outs = dist_harness.run(_run, 2, root, timeout=200)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message, o.exitcode)
    for o in outs:
        r = o.value
        # every restored state is bit-identical to stock DCP's, phase by phase
        for key, v in r.items():
            if key.startswith("diff "):
                assert v == [], (o.rank, key, v)
        # ... and to the state that was saved (the runs really resumed)
        for key, v in r.items():
            # the dataloader's position is torchdata's business (its naive fast-forward of an
            # IterableDataset after a resume); it is compared with stock DCP's above
            if "->" in key:
                assert [k for k in v if k not in ("data", "next_batch")] == [], (o.rank, key, v)
        assert r["found"] == (True, True) and r["found2"] == (True, True) and r["found6"] == (True, True)
        assert r["async_found"] == (True, True) and r["initial_found"] == (True, True)
        assert r["sync_steps"] == (["step-4", "step-6"], ["step-4", "step-6"]), r["sync_steps"]
        assert r["async_steps"] == (["step-2", "step-4"], ["step-2", "step-4"]), r["async_steps"]
        calls = r["calls"]
        # torchtitan's saves and loads went through safeckpt (the step-4 save twice: replaced)
        assert calls.count("save step-4") == 3 and "load step-4" in calls and "load step-2" in calls, calls
        assert "load step-3" in calls and "save step-3" in calls, calls
    # What torchtitan wrote through safeckpt: safeckpt checkpoints with the step from the name,
    # DCP's .metadata beside them, nothing else (no staging left over anywhere).
    for sub in ("sync/step-4", "sync/step-6", "async/step-2", "async/step-4", "export/step-3"):
        ckpt = os.path.join(root, "safeckpt", sub)
        report = safeckpt.verify(ckpt)
        assert report.ok, (sub, report.problems)
        assert report.step == int(sub.rsplit("-", 1)[1]), (sub, report.step)
        assert sorted(os.listdir(ckpt)) == [".metadata", "dcp_metadata.json", "manifest.json",
                                            "rank-00000.safetensors", "rank-00001.safetensors"], sub
    for folder in ("sync", "async", "export", "fresh"):
        path = os.path.join(root, "safeckpt", folder)
        if os.path.isdir(path):
            assert dist_harness.leftovers(path) == [], (folder, os.listdir(path))
    # The dataloader's pickle.dumps bytes are stored as bytes (a uint8 tensor), never unpickled.
    flat = safeckpt.read_state_dict(os.path.join(root, "safeckpt", "sync", "step-6"))
    blob = flat["dataloader/dp_rank_0"]
    assert blob.dtype == torch.uint8 and blob.dim() == 1 and bytes(blob.numpy())[:1] == b"\x80"
    # Stock DCP's reader on a safeckpt checkpoint: one line naming safeckpt.dcp.StorageReader.
    with pytest.raises(BaseException, match=r"safeckpt\.dcp\.StorageReader") as info:
        dcp.load({"train_state": {"step": 0, "losses": torch.zeros(8)}},
                 checkpoint_id=os.path.join(root, "safeckpt", "sync", "step-6"), no_dist=True)
    assert "Unpickling" not in str(info.value) and "pickle" not in str(info.value).lower().split(
        "safeckpt.dcp.storagereader")[-1], str(info.value)[-600:]
