"""The replica check's inputs: which replicated tensors DDP takes from rank 0, and a digest of a
tensor's bytes that ranks compare (xxh3 on the CPU, a fingerprint computed on an accelerator)."""

from __future__ import annotations

from typing import Any

import torch
import xxhash
from torch import nn

from ..format.shardfile import tensor_bytes
from ..format.tree import escape_key


def ddp_broadcast_buffers(name: str, value: Any) -> list[str]:
    """Tensor keys of the buffers of a DDP module that broadcasts them (the default): DDP
    copies rank 0's buffers to every rank at the start of each forward, so between a step and
    the next forward the ranks legitimately differ (BatchNorm running stats) and rank 0's
    values are the model's. They are written from rank 0 and left out of the replica check."""
    seen = value
    while isinstance(seen, nn.Module) and not isinstance(seen, nn.parallel.DistributedDataParallel):
        seen = getattr(seen, "_orig_mod", None)
    if not isinstance(seen, nn.parallel.DistributedDataParallel) or not getattr(seen, "broadcast_buffers", False):
        return []
    prefix = escape_key(name)
    return [f"{prefix}/{escape_key(fqn)}" for fqn, _ in seen.module.named_buffers()]


def replica_digest(t: torch.Tensor) -> str:
    """A digest of a tensor's bytes for the replica check: xxh3-64 on the CPU; for an
    accelerator tensor a position-weighted sum computed on the device (no device-to-host copy of
    the tensor, only of the 8-byte result)."""
    if t.device.type == "cpu":
        return xxhash.xxh3_64_hexdigest(tensor_bytes(t))
    return f"dev-{device_fingerprint(t)}"


def device_fingerprint(t: torch.Tensor, block: int = 1 << 24) -> int:
    """Sum over int32 words w_i of w_i * (2*i + 1) (mod 2**63): any single changed word changes
    it (odd weights), computed in blocks to bound temporary memory. Works on any device."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-data.numel()) % 4
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), block):
        w = words[lo : lo + block].to(torch.int64)
        weights = torch.arange(lo, lo + w.numel(), device=t.device, dtype=torch.int64) * 2 + 1
        total += (w * weights).sum()
    return int(total.item()) ^ (t.numel() << 1)
