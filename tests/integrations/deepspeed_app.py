"""A tiny DeepSpeed training job for the DeepSpeed integration tests (CPU, gloo, 2 ranks).

Deterministic: the batch of step *i* on rank *r* is a pure function of (i, r), so a run resumed
from a checkpoint of step *N* must reach bit for bit the state of an uninterrupted run. The
model has a frozen parameter and a buffer the forward pass updates, so both travel through the
checkpoint too; a StepLR scheduler checks scheduler state.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

ENV = {"DS_ACCELERATOR": "cpu"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(16, 3)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.out(torch.relu(self.frozen(torch.relu(self.inp(x)))))


def make_engine(stage: int, seed: int, *, install: bool = True, config: dict[str, Any] | None = None) -> Any:
    """A DeepSpeed engine (ZeRO ``stage``) over a fresh Net initialised from ``seed``."""
    import deepspeed

    from safeckpt.integrations import deepspeed as sds

    deepspeed.init_distributed("gloo")
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        **(config or {}),
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    if install:
        sds.install(engine)
    return engine


def train(engine: Any, steps: range) -> None:
    rank = torch.distributed.get_rank()
    for i in steps:
        g = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(2, 8, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()


def snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Everything a resume must restore on this rank, as tensors: the optimizer's state (ZeRO
    partitions, fp32 master weights, Adam moments), the module's parameters (this rank's
    partition under ZeRO-3) and buffers, the scheduler and step counters."""
    out: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            out[path] = obj.detach().clone()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            out[path] = torch.tensor(float(obj), dtype=torch.float64)

    walk(engine.optimizer.state_dict(), "optim")
    for name, p in engine.module.named_parameters():
        out["param/" + name] = (p.ds_tensor if hasattr(p, "ds_tensor") else p).detach().clone()
    for name, b in engine.module.named_buffers():
        out["buffer/" + name] = b.detach().clone()
    walk(engine.lr_scheduler.state_dict(), "sched")
    out["global_steps"] = torch.tensor(engine.global_steps)
    out["global_samples"] = torch.tensor(engine.global_samples)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in any bit, dtype or shape (or exist on one side only)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
            bad.append(k)
    return bad


def save_snapshot(snap: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in snap.items()}, path)


def load_snapshot(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def stock_save(engine: Any, save_dir: str, tag: str) -> None:
    """Save with DeepSpeed's own (torch.save) checkpoint engine, as a reference."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    ours = engine.checkpoint_engine
    engine.checkpoint_engine = TorchCheckpointEngine(engine._config)
    try:
        type(engine).save_checkpoint(engine, save_dir, tag=tag)
    finally:
        engine.checkpoint_engine = ours


def visible(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def hidden(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("."))


def read_latest(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            return f.read()
    except FileNotFoundError:
        return None
