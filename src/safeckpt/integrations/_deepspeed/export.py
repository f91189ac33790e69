"""Full fp32 weights from a ZeRO checkpoint saved by safeckpt, and their export.

The replacement for DeepSpeed's ``zero_to_fp32.py`` (which cannot read this format and would
unpickle): the per-rank flat fp32 partitions and the parameter shapes are read pickle-free,
then handed to DeepSpeed's own reconstruction functions, so the weights are exactly those
``zero_to_fp32`` would produce from a stock checkpoint of the same state. The export is then
written by safeckpt's :func:`~safeckpt.convert.consolidate` (one safetensors file) or
:func:`~safeckpt.convert.export_hf` (Hugging Face layout) from a temporary single-process
safeckpt checkpoint next to the output.

Offline: no process group is used (it also works on one rank of a running job). Memory: the
full fp32 model plus one rank's optimizer file at a time, like ``zero_to_fp32``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import uuid
from typing import Any

import torch

from ... import read_state_dict
from ...convert import consolidate, export_hf
from ...errors import CheckpointError, CheckpointExists, CheckpointNotFound
from . import codec
from .tags import INDEX, pick, read_index, remove_tree, save_local


def tag_dir_of(src: str | os.PathLike[str], tag: str | None = None) -> str:
    """The tag directory for ``src``: a tag directory itself, or a save directory (then
    ``tag``, or the newest committed tag saved with ``save_latest``)."""
    src = os.path.abspath(os.fspath(src))
    if os.path.isfile(os.path.join(src, INDEX)) and tag is None:
        return src
    picked = pick(src, tag)
    if not picked["candidates"]:
        why = "; ".join(picked["damaged"]) or "no committed tag saved by safeckpt"
        raise CheckpointNotFound(f"no usable tag{f' {tag!r}' if tag else ''} under {src}: {why}", path=src)
    return os.path.join(src, picked["candidates"][0])


def _natural(name: str) -> list[Any]:
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", name)]


def _read(tag_dir: str, name: str) -> dict[str, Any]:
    return codec.decode(read_state_dict(os.path.join(tag_dir, name), nested=True))


def get_fp32_state_dict(
    src: str | os.PathLike[str], tag: str | None = None, *, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The model's full fp32 ``state_dict`` from a ZeRO 1/2/3 checkpoint saved by safeckpt
    (the pickle-free counterpart of ``get_fp32_state_dict_from_zero_checkpoint``)."""
    from deepspeed.checkpoint.constants import (
        BUFFER_NAMES,
        DS_VERSION,
        FP32_FLAT_GROUPS,
        FROZEN_PARAM_FRAGMENTS,
        FROZEN_PARAM_SHAPES,
        OPTIMIZER_STATE_DICT,
        PARAM_ALIGNMENT_PADDINGS,
        PARAM_SHAPES,
        PARTITION_COUNT,
        SINGLE_PARTITION_OF_FP32_GROUPS,
        ZERO_STAGE,
    )
    from deepspeed.utils import zero_to_fp32 as z2f

    tag_dir = tag_dir_of(src, tag)
    files = sorted(read_index(tag_dir)["files"], key=_natural)
    model_files = [f for f in files if f.endswith("_model_states.pt")]
    optim_files = [f for f in files if f.endswith("_optim_states.pt")]
    if not model_files or not optim_files:
        raise CheckpointError(
            f"{tag_dir} has no ZeRO optimizer files (*_optim_states.pt): it was not saved with "
            "ZeRO; its model states hold the weights already (read them with "
            "safeckpt.read_state_dict)"
        )
    model_states = []
    for name in model_files:
        sd = _read(tag_dir, name)
        model_states.append(z2f.zero_model_state(
            buffers={k: v.float() if v.is_floating_point() else v
                     for k, v in sd["module"].items() if k in sd[BUFFER_NAMES]},
            param_shapes=sd[PARAM_SHAPES],
            shared_params=[[k, v] for k, v in (sd.get("shared_params") or {}).items()],
            ds_version=sd.get(DS_VERSION),
            frozen_param_shapes=sd.get(FROZEN_PARAM_SHAPES),
            frozen_param_fragments=sd.get(FROZEN_PARAM_FRAGMENTS),
        ))
    flat_groups, first = [], None
    for name in optim_files:
        osd = _read(tag_dir, name)[OPTIMIZER_STATE_DICT]
        first = first or osd
        stage = int(osd[ZERO_STAGE])
        flat_groups.append(osd[SINGLE_PARTITION_OF_FP32_GROUPS if stage <= 2 else FP32_FLAT_GROUPS])
    assert first is not None
    stage, world = int(first[ZERO_STAGE]), first[PARTITION_COUNT]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optim_files):
        raise CheckpointError(f"{tag_dir}: {len(optim_files)} optimizer files for {world} partitions")
    if stage <= 2:
        sd = z2f._get_fp32_state_dict_from_zero2_checkpoint(
            world, flat_groups, model_states, exclude_frozen_parameters, first.get(PARAM_ALIGNMENT_PADDINGS))
    else:
        sd = z2f._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, exclude_frozen_parameters)
    sd = z2f.to_torch_tensor(sd)
    if stage == 1 and not exclude_frozen_parameters:
        # ZeRO-1 records no frozen parameters (zero_to_fp32 drops them); its model states
        # hold every parameter in full, so take those from there, in fp32.
        for k, v in _read(tag_dir, model_files[0])["module"].items():
            if k not in sd:
                sd[k] = v.float() if v.is_floating_point() else v
    return sd


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
    exclude_frozen_parameters: bool = False, lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``, same signature,
    for a checkpoint saved by safeckpt (``lazy_mode`` is accepted; the tensors are real)."""
    return get_fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters)


def is_safeckpt_checkpoint(checkpoint_dir: Any) -> bool:
    """A save directory holding safeckpt tags, or one such tag (offline, cheap)."""
    try:
        d = os.fspath(checkpoint_dir)
    except TypeError:
        return False
    if os.path.isfile(os.path.join(d, INDEX)):
        return True
    try:
        names = os.listdir(d)
    except OSError:
        return False
    return any(os.path.isfile(os.path.join(d, n, INDEX)) for n in names if not n.startswith("."))


def serve_zero_to_fp32() -> None:
    """Make DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions (what ``zero_to_fp32.py``,
    Hugging Face's ``load_state_dict_from_zero_checkpoint`` and
    ``convert_zero_checkpoint_to_fp32_state_dict`` call) read safeckpt checkpoints: a directory
    holding safeckpt tags goes to :func:`get_fp32_state_dict_from_zero_checkpoint`, any other
    to DeepSpeed's own function, unchanged. Idempotent."""
    from deepspeed.utils import zero_to_fp32 as z2f

    original = z2f.get_fp32_state_dict_from_zero_checkpoint
    if getattr(original, "_safeckpt", False):
        return

    def dispatch(checkpoint_dir: Any, tag: Any = None, exclude_frozen_parameters: bool = False,
                 lazy_mode: bool = False) -> Any:
        if is_safeckpt_checkpoint(checkpoint_dir):
            return get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
        return original(checkpoint_dir, tag, exclude_frozen_parameters, lazy_mode)

    dispatch._safeckpt = True  # type: ignore[attr-defined]
    dispatch.__doc__ = original.__doc__
    z2f.get_fp32_state_dict_from_zero_checkpoint = dispatch


def export(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    hf: bool = False,
    max_shard_size: int | str = "5GB",
    exclude_frozen_parameters: bool = False,
    overwrite: bool = False,
) -> list[str]:
    """Export the full fp32 weights of a ZeRO checkpoint saved by safeckpt.

    ``src`` is a save directory (newest committed tag, or ``tag``) or one tag directory.
    Writes ``out`` as one safetensors file, or with ``hf=True`` the directory ``out`` in the
    Hugging Face layout (``model.safetensors`` or shards plus index). Names are the model's
    ``state_dict`` keys, so ``model.load_state_dict(safetensors.torch.load_file(out))``
    works. Returns the paths written.
    """
    out = os.path.abspath(os.fspath(out))
    if not hf and os.path.lexists(out) and not overwrite:
        raise CheckpointExists(f"{out} exists; pass overwrite=True to replace it")
    weights = get_fp32_state_dict(src, tag, exclude_frozen_parameters=exclude_frozen_parameters)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.safeckpt-export-{uuid.uuid4().hex[:12]}")
    try:
        save_local(tmp, {"model": weights}, metadata={"exported_from": os.fspath(src)}, timeout=None)
        if hf:
            return export_hf(tmp, out, only="model", max_shard_size=max_shard_size, overwrite=overwrite)
        return [consolidate(tmp, out, only="model").path]
    finally:
        remove_tree(tmp)


def main(argv: list[str] | None = None) -> int:
    """``python -m safeckpt.integrations.deepspeed SRC OUT``: the zero_to_fp32 replacement."""
    p = argparse.ArgumentParser(prog="python -m safeckpt.integrations.deepspeed",
                                description="Export full fp32 weights of a ZeRO checkpoint saved by safeckpt.")
    p.add_argument("src", help="save directory (newest tag) or one tag directory")
    p.add_argument("out", help="output .safetensors file (or directory with --hf)")
    p.add_argument("--tag", default=None)
    p.add_argument("--hf", action="store_true", help="Hugging Face layout (shards + index when large)")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--exclude-frozen-parameters", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    if os.path.lexists(a.out) and not a.overwrite and not (a.hf and os.path.isdir(a.out) and not os.listdir(a.out)):
        print(f"error: {a.out} exists; pass --overwrite to replace it", file=sys.stderr)
        return CheckpointExists.exit_code
    try:
        for path in export(a.src, a.out, tag=a.tag, hf=a.hf, max_shard_size=a.max_shard_size,
                           exclude_frozen_parameters=a.exclude_frozen_parameters, overwrite=a.overwrite):
            print(path)
    except (CheckpointError, OSError, ValueError) as exc:
        text = " ".join(str(exc).split()).replace("overwrite=True", "--overwrite")
        print(f"error: {text}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, CheckpointError) else 1
    return 0
