"""A tiny Lightning training job for the Lightning integration tests (imported by workers).

Everything that decides the result is a pure function of seeds: data, init, dropout and
shuffling, so a resumed run can be compared with an uninterrupted one bit for bit.
"""

from __future__ import annotations

import os
import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_TRAIN, N_VAL, BATCH = 24, 8, 4  # per rank with 2 ranks: 6 training batches per epoch


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :2].sum(1, keepdim=True) > 0).float()
    return TensorDataset(x, y)


class Net(pl.LightningModule):
    """Linear-BatchNorm-Dropout-Linear; BatchNorm buffers and dropout RNG make resume exactness
    depend on buffers and RNG being checkpointed, AdamW + StepLR on optimizer/scheduler state."""

    def __init__(self, hidden: int = 16, lr: float = 0.02, sharded: bool = False, bn: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(8, hidden), nn.BatchNorm1d(hidden) if bn else nn.Identity(), nn.ReLU(),
            nn.Dropout(0.2), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1),
        )

    def configure_model(self) -> None:
        if not self.hparams.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self(x), y)
        # Epoch-dependent noise so that the top-k ranking changes over epochs.
        self.log("val_loss", loss + 0.05 * ((self.current_epoch * 7) % 5), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(N_TRAIN * 2, 1), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(N_VAL * 2, 2), batch_size=BATCH)


def trainer(root: str, strategy: Any, max_epochs: int, devices: int, callbacks: list | None = None,
            **kwargs: Any) -> pl.Trainer:
    """``devices`` must be passed: Lightning's environment deletes $WORLD_SIZE at teardown."""
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), monitor="val_loss", save_top_k=2,
                           save_last=True, filename="{epoch}-{step}")
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy,
        max_epochs=max_epochs, callbacks=[ckpt, *(callbacks or [])], logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        deterministic=True, default_root_dir=root, **kwargs,
    )


def scramble(seed: int) -> None:
    """Seed like a user script (``seed_everything(0)``, which also seeds the distributed
    sampler), then move every RNG elsewhere: only the checkpoint can bring the run back."""
    pl.seed_everything(0, verbose=False)
    if seed:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)


def full_state(module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Model and optimizer state as full CPU tensors (DTensors gathered), for exact comparison."""
    def full(t: Any) -> Any:
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t

    out = {f"model/{k}": full(v) for k, v in module.state_dict().items()}
    opt = trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = full(v)
    out["sched/last_epoch"] = torch.tensor(trainer.lr_scheduler_configs[0].scheduler.last_epoch)
    out["rng/torch"] = torch.get_rng_state()
    return out
