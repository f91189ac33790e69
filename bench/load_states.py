"""States for the load benchmark (bench_load.py): transformer-like shapes, replicated and FSDP2.

Values are deterministic (seeded), so every rank of a replicated state holds the same bytes.
Loaded values are checked against an xxh3-64 fingerprint of each tensor's local bytes taken
right after the state was built, so the originals need not stay in memory while loads are timed.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

import torch
import xxhash
from torch import nn

MiB = 1 << 20

# 12 tensors per layer: attention (qkv, out), MLP (up, down), their biases, two norms
_LAYER = {
    "attn.qkv.weight": (3, 1), "attn.qkv.bias": (3,),
    "attn.out.weight": (1, 1), "attn.out.bias": (1,),
    "mlp.up.weight": (4, 1), "mlp.up.bias": (4,),
    "mlp.down.weight": (1, 4), "mlp.down.bias": (1,),
    "norm1.weight": (1,), "norm1.bias": (1,), "norm2.weight": (1,), "norm2.bias": (1,),
}
LAYER_MODULE = re.compile(r"layers\.\d+")


def transformer_shapes(d: int, layers: int, vocab: int, positions: int = 1024) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a GPT-like model: 4 + 12 * ``layers`` tensors."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d), "pos_embed.weight": (positions, d)}
    for i in range(layers):
        for k, mult in _LAYER.items():
            shapes[f"layers.{i}.{k}"] = tuple(m * d for m in mult)
    shapes["final_norm.weight"] = (d,)
    shapes["final_norm.bias"] = (d,)
    return shapes


def shapes_for_bytes(target_bytes: int) -> tuple[dict[str, tuple[int, ...]], str]:
    """float32 transformer shapes of about ``target_bytes``, with a description."""
    if target_bytes >= 512 * MiB:
        d, vocab = 1024, 32000
    else:
        d, vocab = (512, 8000) if target_bytes >= 128 * MiB else (256, 8000)
    fixed = (vocab + 1024) * d * 4 + 2 * d * 4
    per_layer = sum(torch.Size(transformer_shapes(d, 1, vocab)[f"layers.0.{k}"]).numel() for k in _LAYER) * 4
    layers = max(1, round((target_bytes - fixed) / per_layer))
    return transformer_shapes(d, layers, vocab), f"d_model={d}, {layers} layers, vocab {vocab}"


def many_tensor_shapes(d: int) -> dict[str, tuple[int, ...]]:
    """Exactly 1,000 tensors: embeddings, 83 layers of attention/MLP weights, biases and norms."""
    return transformer_shapes(d, 83, vocab=8000, positions=1024)


def nbytes_of(shapes: dict[str, tuple[int, ...]], itemsize: int = 4) -> int:
    return sum(torch.Size(s).numel() for s in shapes.values()) * itemsize


def random_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _module_from(shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, nn.Parameter(torch.empty(shape)))
    return root


def fsdp2_model(shapes: dict[str, tuple[int, ...]], world: int, rank: int, seed: int = 0) -> nn.Module:
    """A module with these parameters, ``fully_shard``ed per layer and at the root on a CPU mesh.

    Built on the meta device and materialised shard by shard, so no rank ever holds the full
    model; each rank fills its shards with its own seeded values.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = _module_from(shapes)
    for name, mod in model.named_modules():
        if LAYER_MODULE.fullmatch(name):
            fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(generator=g)
    return model


# --------------------------------------------------------------------------- targets and checks
def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(t: torch.Tensor) -> Any:
    """The local bytes of ``t`` as a numpy uint8 array (no copy when contiguous)."""
    return local(t).detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def local_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in state.values())


def fingerprint(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: xxhash.xxh3_64_hexdigest(local_bytes(t)) for k, t in state.items()}


def check(state: dict[str, torch.Tensor], want: dict[str, str], what: str) -> None:
    """Raise unless every tensor's local bytes match the fingerprint taken from the original."""
    got = fingerprint(state)
    bad = sorted(k for k in want if got.get(k) != want[k])
    if bad or set(got) != set(want):
        raise AssertionError(f"{what}: {len(bad)} of {len(want)} tensors differ from the saved values "
                             f"after the load (e.g. {bad[:3]}); the benchmark would time a broken load")


def meta_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shapes and dtypes of plain tensors without their memory (a template for fresh_like)."""
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}


def fresh_like(template: dict[str, torch.Tensor], *, touch: bool = False) -> dict[str, torch.Tensor]:
    """Newly allocated targets with the template's shapes and shardings; never touched unless
    ``touch`` (then every page is written once, as in targets that already existed)."""
    out: dict[str, torch.Tensor] = {}
    for k, t in template.items():
        if hasattr(t, "to_local"):
            from torch.distributed.tensor import DTensor

            loc = t.to_local()
            out[k] = DTensor.from_local(torch.empty(loc.shape, dtype=loc.dtype), t.device_mesh, t.placements,
                                        run_check=False, shape=t.shape, stride=t.stride())
        else:
            out[k] = torch.empty(t.shape, dtype=t.dtype)
    if touch:
        zero_(out)
    return out


def zero_(state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in state.values():
            local(t).zero_()


def release_memory() -> None:
    """Give freed heap pages back to the OS, so the next fresh allocation faults new pages."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
