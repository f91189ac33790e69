"""Mark state as per-rank: each rank saves and restores its own copy.

Tensors that are not sharded (DTensor) count as *replicated* and are written once for all
ranks. A plain tensor or value that legitimately differs between ranks (a rank's data-loader
position, a per-rank buffer) must be wrapped, or the replica check refuses the save (it never
keeps one rank's copy silently). Restored onto another world size, rank r gets what rank r
saved; ranks the saving run did not have keep their current value (a warning says so).
"""

from __future__ import annotations

from typing import Any

from .format.tree import PER_RANK_ATTR


class PerRank:
    """A value (tensor, JSON tree of tensors and plain values) kept separately for every rank.

    ``state["cursor"] = safeckpt.PerRank(torch.tensor([rank_position]))``; after a load,
    ``state["cursor"].value`` holds this rank's saved value.
    """

    def __init__(self, value: Any) -> None:
        setattr(self, PER_RANK_ATTR, True)
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict["value"]

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"
