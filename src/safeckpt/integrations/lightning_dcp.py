"""Lightning's FSDP2 / tensor-parallel strategy keeping its own DCP checkpoints, through safeckpt.dcp.

Lightning 2.6's ``ModelParallelStrategy`` (``fully_shard`` / tensor parallel in
``configure_model``) saves a sharded checkpoint with
``torch.distributed.checkpoint.save(converted_state, checkpoint_id=path)`` straight into the
directory, then rank 0 writes the rest of Lightning's dict (loops, callbacks, schedulers,
hyper-parameters) as a pickled ``meta.pt`` into it; ``load_checkpoint`` runs two ``dcp.load``
calls and a ``torch.load`` of that pickle. :class:`SafeckptDCPModelParallelStrategy` changes
only those two methods; the checkpoint stays a DCP checkpoint (``dcp.load`` with
:class:`safeckpt.dcp.StorageReader` reads it outside Lightning) and is a safeckpt checkpoint
(``safeckpt verify / inspect / consolidate / convert --to hf``)::

    from safeckpt.integrations.lightning_dcp import SafeckptDCPModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=8)                # before
    strategy = SafeckptDCPModelParallelStrategy(data_parallel_size=8)     # after

- save: one ``dcp.save(..., storage_writer=safeckpt.dcp.StorageWriter(path, overwrite=True))``
  of model, optimizers and rank 0's remaining dict under the entry ``lightning``, so it is
  committed with the shards by one atomic rename (no ``meta.pt``; tensors such as
  ``best_model_score`` as tensors, everything else as JSON, configs such as
  ``argparse.Namespace`` or OmegaConf as the tagged JSON of ``safeckpt.integrations.lightning``).
  Re-saving ``last.ckpt`` swaps the new checkpoint in after it is committed.
- load: one ``dcp.load`` of model and optimizers (every chunk checked before it is copied),
  Lightning's ``load_state_dict`` / ``set_optimizer_state_dict`` as the stock strategy does, and
  the ``lightning`` entry read from the same checkpoint (rank 0's, as ``meta.pt`` was). Nothing
  is unpickled. A stock checkpoint (with ``meta.pt``) still loads through the base class.

What it does not change (the stock strategy's behaviour): RNG states are not saved,
``remove_checkpoint`` is Lightning's (rank 0 deletes the directory), and ``ckpt_path="last"``
is Lightning's choice. For all of those, plus a safeckpt (not DCP) layout, use
``safeckpt.integrations.lightning.SafeckptModelParallelStrategy``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

import safeckpt.dcp
from safeckpt.engine.reader import TensorReader, open_manifest
from safeckpt.errors import CheckpointError
from safeckpt.format.tree import decode as decode_tree

from ._lightning.values import TYPE
from ._lightning.values import decode as decode_values
from ._lightning.values import encode as encode_values

__all__ = ["SafeckptDCPModelParallelStrategy", "read_lightning_state"]

LIGHTNING = "lightning"  # the entry holding Lightning's dict without model and optimizers


class SafeckptDCPModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose DCP checkpoints go through :mod:`safeckpt.dcp`.

    ``save_distributed_checkpoint=False`` (one full ``torch.save`` file) is Lightning's own path
    and is refused: it pickles, and safeckpt cannot make that file atomic or pickle-free here.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is False:
            raise CheckpointError(
                "SafeckptDCPModelParallelStrategy saves distributed (DCP) checkpoints only; "
                "save_distributed_checkpoint=False writes a pickled torch.save file")
        super().__init__(*args, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        import torch.distributed.checkpoint as dcp

        path = os.fspath(self.broadcast(os.fspath(filepath)))  # rank 0's path, as the base class
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optim_state
        if self.global_rank == 0:  # what the base class pickles into meta.pt (rank 0's only)
            state[LIGHTNING] = _for_dcp(encode_values(checkpoint, LIGHTNING))
        writer = safeckpt.dcp.StorageWriter(path, overwrite=True)
        with safeckpt.dcp.translate_errors():
            dcp.save(state, storage_writer=writer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(os.fspath(checkpoint_path)))
        if not (path / safeckpt.dcp.DCP_FILE).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        module = self.model
        state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        for i, optim in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optim)
        with safeckpt.dcp.translate_errors():
            dcp.load(state, storage_reader=safeckpt.dcp.StorageReader(path),
                     planner=DefaultLoadPlanner(allow_partial_load=not strict))
        module.load_state_dict(state["state_dict"], strict=strict)
        options = StateDictOptions(cpu_offload=True)
        for i, optim in enumerate(self.optimizers):
            set_optimizer_state_dict(module, optim, optim_state_dict=state[f"optimizer_{i}"], options=options)
        return read_lightning_state(path)


def read_lightning_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Lightning's dict without model and optimizers (what ``meta.pt`` held), from a checkpoint
    written by :class:`SafeckptDCPModelParallelStrategy`; any machine, no process group, no pickle."""
    ckpt = os.fspath(path)
    man = open_manifest(ckpt)
    obj = man["objects"].get(LIGHTNING)
    if obj is None:
        raise CheckpointError(f"{ckpt} holds no '{LIGHTNING}' entry: not saved by SafeckptDCPModelParallelStrategy")
    reader = TensorReader(ckpt, man, rank=0, verify=True)
    try:
        tree = decode_tree(obj["tree"], reader.new)
    finally:
        reader.close()
    return decode_values(_from_dcp(tree))


# DCP flattens nested dicts with str(key) and drops empty dicts; so that Lightning's dict comes
# back as it was, a dict that is empty or has a key that is not a string is stored as the
# tagged list of pairs of safeckpt.integrations.lightning's value encoding.
def _for_dcp(value: Any) -> Any:
    if isinstance(value, dict):
        if value and all(type(k) is str for k in value):
            return {k: _for_dcp(v) for k, v in value.items()}
        return {TYPE: "dict", "items": [[k, _for_dcp(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_for_dcp(v) for v in value]
    if isinstance(value, tuple) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in value):
        return [_for_dcp(v) for v in value]  # DCP walks into it and rebuilds a list
    return value


def _from_dcp(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get(TYPE) == "dict" and isinstance(value.get("items"), list):
            return {TYPE: "dict", "items": [[k, _from_dcp(v)] for k, v in value["items"]]}
        return {k: _from_dcp(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_dcp(v) for v in value]
    return value
