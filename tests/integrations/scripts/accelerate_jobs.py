"""A custom Accelerate training loop for the Accelerate tests (every rank of a torchrun job)."""

from __future__ import annotations

import os
import signal
from typing import Any

import hf_tiny as tiny
import torch
from accelerate import DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader

from safeckpt.errors import CheckpointError
from safeckpt.integrations.accelerate import SafeckptAccelerator

STEPS, SAVE_EVERY, PER_EPOCH = 12, 4, 8  # 32 samples, 2 ranks, batch 2: 8 steps per epoch


class Progress:
    """Registered for checkpointing: the loop's position (JSON only)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


class Opaque:
    """Registered for checkpointing, but its state is not tensors/JSON: must be refused."""

    def state_dict(self) -> dict[str, Any]:
        return {"when": object()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:  # pragma: no cover
        pass


def job(out: str, *, resume: bool = False, signal_at: int | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    acc = SafeckptAccelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True,
                                            total_limit=2),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11),
    )
    model = tiny.model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    # Its own generator: a fresh iterator then draws nothing from the global RNG that
    # load_state() restored, so a mid-epoch resume is bit-exact (README, Accelerate section).
    dl = DataLoader(tiny.TokenData(32, 5), batch_size=2, shuffle=True,
                    generator=torch.Generator().manual_seed(0))
    progress = Progress()
    acc.register_for_checkpointing(progress)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    loaded_iteration = None
    if resume:
        acc.load_state()
        loaded_iteration = acc.project_configuration.iteration
    losses: list[list[float]] = []
    saved: list[str] = []
    preempted = False
    model.train()
    while progress.step < STEPS and not preempted:
        epoch, skip = divmod(progress.step, PER_EPOCH)
        dl.set_epoch(epoch)
        batches = acc.skip_first_batches(dl, skip) if skip else dl
        for batch in batches:
            if signal_at is not None and progress.step + 1 == signal_at and acc.process_index == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # real SIGTERM, rank 1 only, mid-step
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.step += 1
            losses.append([progress.step, acc.reduce(loss.detach(), "mean").item()])
            preempted = acc.preempted
            if progress.step % SAVE_EVERY == 0 or preempted:
                saved.append(acc.save_state())
            if preempted or progress.step == STEPS:
                break
    refused = None
    if signal_at is None:
        acc.register_for_checkpointing(Opaque())
        try:
            acc.save_state()
        except CheckpointError as exc:
            refused = f"{type(exc).__name__}: {exc}"
        acc._custom_objects.pop()
    rng = torch.get_rng_state()
    from safetensors.torch import save_file

    save_file({"torch": rng}, os.path.join(out, f"rng-acc-rank{acc.process_index}.safetensors"))
    acc.safeckpt_close()
    result = {"losses": losses, "saved": saved, "preempted": preempted, "refused": refused,
              "loaded_iteration": loaded_iteration, "final_step": progress.step,
              "iteration": acc.project_configuration.iteration}
    return result
