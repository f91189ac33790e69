"""Lightning strategies with frozen parameters (issue 22 req. 7): a LoRA-like LightningModule
(a frozen base loaded by the module itself, a small trainable adapter) on 2 DDP ranks (gloo).

By default a checkpoint holds the trainable tensors and fingerprints of the frozen ones (size ~
what trains); resume verifies the live base and ends bit-exact with an uninterrupted run; a
different base is IncompatibleCheckpoint naming the tensor on every rank, with nothing loaded;
``frozen="full"`` stores the base; ``Model.load_from_checkpoint`` verifies and fills the base.
One spawn for everything (importing Lightning costs seconds per process).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

import safeckpt  # noqa: E402
from tests.helpers import dist_harness  # noqa: E402

ENV = {"SAFECKPT_TIMEOUT": "30", "PYTHONWARNINGS": "ignore"}
DIM, RANK_R = 384, 4


def _lora_class():
    import lightning.pytorch as pl
    from torch import nn

    class LoraNet(pl.LightningModule):
        """y = head(base(x) + B(A(x))): ``base`` (DIM x DIM) is frozen and built from
        ``base_seed`` (a stand-in for from_pretrained); A, B and head train."""

        def __init__(self, base_seed: int = 7) -> None:
            super().__init__()
            self.save_hyperparameters()
            g = torch.Generator().manual_seed(base_seed)
            self.base = nn.Linear(DIM, DIM)
            with torch.no_grad():
                self.base.weight.copy_(torch.randn(DIM, DIM, generator=g) / DIM**0.5)
                self.base.bias.copy_(torch.randn(DIM, generator=g))
            self.base.requires_grad_(False)
            self.lora_a = nn.Linear(DIM, RANK_R, bias=False)
            self.lora_b = nn.Linear(RANK_R, DIM, bias=False)
            self.head = nn.Linear(DIM, 1)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return self.head(self.drop(self.base(x) + self.lora_b(self.lora_a(x))))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)

        def train_dataloader(self):
            from torch.utils.data import DataLoader, TensorDataset

            g = torch.Generator().manual_seed(1)
            x = torch.randn(32, DIM, generator=g)
            return DataLoader(TensorDataset(x, x[:, :1].clone()), batch_size=4, shuffle=True)

    return LoraNet


def _override_class():
    base = _lora_class()

    class LoraNetOverride(base):
        """Overrides load_state_dict: Lightning's own call gets the state dict (frozen base
        included, verified), not the in-place load."""

        calls = 0

        def load_state_dict(self, state_dict, strict=True, assign=False):
            type(self).calls += 1
            assert "base.weight" in state_dict and "lora_a.weight" in state_dict, sorted(state_dict)
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    return LoraNetOverride


def _fit(root: str, epochs: int, world: int, ckpt_path=None, frozen: str = "fingerprint",
         base_seed: int = 7, scramble: int = 0, cls=None):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from safeckpt.integrations.lightning import SafeckptDDPStrategy

    pl.seed_everything(0, verbose=False)
    if scramble:
        torch.manual_seed(scramble)
    model = (cls or _lora_class())(base_seed=base_seed)
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), save_top_k=-1, save_last=True,
                           filename="{epoch}-{step}")
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=SafeckptDDPStrategy(checkpoint_timeout=30, frozen=frozen),
        max_epochs=epochs, callbacks=[ckpt], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True, default_root_dir=root,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


def _state(model, trainer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in trainer.optimizers[0].state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    out["rng"] = torch.get_rng_state()
    return out


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    ref_model, ref_trainer = _fit(os.path.join(root, "ref"), 4, world)
    ref = _state(ref_model, ref_trainer)

    # 2 epochs with checkpoints, then a fresh process-like start (RNG moved away) resumes to 4.
    run = os.path.join(root, "run")
    _fit(run, 2, world)
    dist.barrier()
    last = os.path.join(run, "ckpts", "last.ckpt")
    out["entries"] = sorted(safeckpt.read_state_dict(last, nested=True)) if rank == 0 else None
    out["size"] = _size(last)

    # A different base: refused on every rank before anything changes, naming the tensor.
    def other_base():
        _fit(run, 4, world, ckpt_path="last", base_seed=8, scramble=5)

    out["other_base"] = dist_harness.attempt(other_base)
    model, trainer = _fit(run, 4, world, ckpt_path="last", scramble=3)
    out["resumed_from"] = trainer.ckpt_path
    out["diff"] = _diff(ref, _state(model, trainer))

    # A load_state_dict override: loaded through Lightning's call with a complete state dict.
    model, trainer = _fit(os.path.join(root, "override"), 4, world, scramble=4, cls=_override_class(),
                          ckpt_path=os.path.join(run, "ckpts", "epoch=1-step=8.ckpt"))
    out["override_calls"] = type(model).calls
    out["override_diff"] = _diff(ref, _state(model, trainer))

    # frozen="full": the base is stored, and the checkpoint has no fingerprints.
    full = os.path.join(root, "full")
    _fit(full, 1, world, frozen="full")
    dist.barrier()
    out["full_size"] = _size(os.path.join(full, "ckpts", "last.ckpt"))
    out["full_entries"] = sorted(safeckpt.read_state_dict(os.path.join(full, "ckpts", "last.ckpt"), nested=True))

    # Lightning's classmethod (offline, no process group needed): base verified and filled in.
    cls = _lora_class()
    loaded = cls.load_from_checkpoint(last)
    out["offline_diff"] = _diff({k: v for k, v in ref_model.state_dict().items()},
                                {k: v for k, v in loaded.state_dict().items()})
    out["offline_class"] = type(loaded).__name__
    out["offline_other"] = dist_harness.attempt(lambda: cls.load_from_checkpoint(last, base_seed=9))
    out["trainable_bytes"] = sum(p.numel() * p.element_size() for p in ref_model.parameters() if p.requires_grad)
    out["frozen_bytes"] = sum(p.numel() * p.element_size() for p in ref_model.parameters() if not p.requires_grad)
    return out


@pytest.mark.timeout(300)
def test_lora_like_module_checkpoints_trainable_tensors_and_verifies_the_base(tmp_path):
    from safeckpt.engine.frozen import ENTRY

    outs = dist_harness.run(_scenario, 2, str(tmp_path), timeout=240, env=ENV)
    for o in outs:
        assert o.ok, o.message
    v = [o.value for o in outs]
    ckpts = tmp_path / "run" / "ckpts"
    for r in v:
        other = r["other_base"]
        assert not other["ok"] and "IncompatibleCheckpoint" in other["mro"], other
        assert "'base.weight'" in other["msg"] and "'base.bias'" in other["msg"], other["msg"]
        # the newest valid checkpoint (step 8: last.ckpt and epoch=1-step=8.ckpt are the same step)
        assert r["resumed_from"] in (str(ckpts / "last.ckpt"), str(ckpts / "epoch=1-step=8.ckpt")), r["resumed_from"]
        assert r["diff"] == [], r["diff"]  # bit-exact with the uninterrupted run
        assert r["override_calls"] == 1 and r["override_diff"] == [], r
        assert r["offline_diff"] == [] and r["offline_class"] == "LoraNet", r["offline_diff"]
        off = r["offline_other"]
        assert not off["ok"] and "IncompatibleCheckpoint" in off["mro"] and "'base.weight'" in off["msg"], off
    r = v[0]
    assert ENTRY in r["entries"] and ENTRY not in r["full_entries"], (r["entries"], r["full_entries"])
    assert not any(k.startswith("base") for k in safeckpt.read_state_dict(ckpts / "last.ckpt", nested=True)["model"])
    # Size: trainable tensors + AdamW's two moments, plus manifest/Lightning state overhead;
    # the frozen base (DIM*DIM fp32, 590 KB) is not in it. Full mode stores it.
    stored = 3 * r["trainable_bytes"]
    assert r["size"] < stored + 48 * 1024, (r["size"], stored)
    assert r["full_size"] > r["size"] + r["frozen_bytes"], (r["full_size"], r["size"], r["frozen_bytes"])
    assert safeckpt.verify(ckpts / "last.ckpt").ok
