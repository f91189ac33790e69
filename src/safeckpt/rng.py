"""Per-rank random number generator state as a stateful object.

Saved per rank (each rank keeps its own stream). Restored onto a different world size, ranks
that existed in the saving run get their own saved state; new ranks keep their current state
and a warning says so.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from .format.tree import PER_RANK_ATTR


class RNGState:
    """Python, NumPy, torch CPU (and CUDA when present) RNG state of this rank."""

    def __init__(self) -> None:
        setattr(self, PER_RANK_ATTR, True)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        sd: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        try:
            import numpy as np

            np_state = np.random.get_state(legacy=False)
            sd["numpy"] = {
                "bit_generator": np_state["bit_generator"],
                "key": torch.from_numpy(np_state["state"]["key"].astype("int64")),
                "pos": int(np_state["state"]["pos"]),
                "has_gauss": int(np_state["has_gauss"]),
                "gauss": float(np_state["gauss"]),
            }
        except ImportError:  # pragma: no cover
            pass
        if torch.cuda.is_available():
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        py = sd["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        torch.set_rng_state(sd["torch"])
        if "numpy" in sd:
            import numpy as np

            n = sd["numpy"]
            np.random.set_state({
                "bit_generator": n["bit_generator"],
                "state": {"key": n["key"].numpy().astype("uint32"), "pos": n["pos"]},
                "has_gauss": n["has_gauss"],
                "gauss": n["gauss"],
            })
        if "cuda" in sd and torch.cuda.is_available():
            states = sd["cuda"]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
