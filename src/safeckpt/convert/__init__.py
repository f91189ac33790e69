"""Consolidate sharded checkpoints, and convert to and from other formats.

Offline functions (one process; :func:`consolidate` and :func:`export_hf` need no process
group and work on any machine, like :func:`safeckpt.read_state_dict`):

- :func:`consolidate`        a checkpoint -> one full safetensors file, streamed
- :func:`export_hf`          a checkpoint's model -> Hugging Face style safetensors files
- :func:`import_dcp`         a ``torch.distributed.checkpoint`` directory -> a checkpoint
- :func:`import_torch_save`  a ``torch.save`` file -> a checkpoint (needs ``allow_pickle=True``)

Streaming: outputs are written tensor by tensor, and each tensor piece by piece (at most
``buffer_bytes`` of tensor data in memory at a time, plus one piece's worth of mapped file
pages, which are dropped after each piece). Each piece is assembled from the overlapping parts
of the stored chunks (shards of any world size), so a checkpoint of any size consolidates in
bounded memory. Every file is written under a temporary name, fsynced and renamed into place.
"""

from __future__ import annotations

from .consolidate import DEFAULT_BUFFER, Progress, WrittenSafetensors, consolidate
from .hf_export import HF_INDEX, HF_SHARD, HF_SINGLE, export_hf, parse_size
from .importers import import_dcp, import_torch_save, load_dcp, rekey_optimizer_states

__all__ = [
    "DEFAULT_BUFFER",
    "Progress",
    "WrittenSafetensors",
    "consolidate",
    "HF_INDEX",
    "HF_SHARD",
    "HF_SINGLE",
    "export_hf",
    "parse_size",
    "import_dcp",
    "import_torch_save",
    "load_dcp",
    "rekey_optimizer_states",
]
