"""safeckpt: correct-by-construction, fast, pickle-free checkpoints for distributed PyTorch.

Collective calls (every rank calls them identically): :func:`save`, :func:`load`, and the
:class:`CheckpointManager` methods. Offline calls (no process group): :func:`verify`,
:func:`read_state_dict`.
"""

from __future__ import annotations

from ._version import __version__
from .engine.load import load
from .engine.offline import VerifyReport, read_state_dict, verify
from .engine.save import save
from .errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointLocked,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    RankFailure,
    RankMismatch,
    SafeckptWarning,
    StorageError,
)
from .format.manifest import CheckpointInfo
from .manager import CheckpointManager
from .per_rank import PerRank
from .retention import RetentionPolicy
from .rng import RNGState

__all__ = [
    "CheckpointError",
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointLocked",
    "CheckpointManager",
    "CheckpointNotFound",
    "CorruptCheckpoint",
    "IncompatibleCheckpoint",
    "PerRank",
    "RNGState",
    "RankFailure",
    "RankMismatch",
    "RetentionPolicy",
    "SafeckptWarning",
    "StorageError",
    "VerifyReport",
    "__version__",
    "load",
    "read_state_dict",
    "save",
    "verify",
]
