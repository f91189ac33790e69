"""What one collective save is asked to do, in one immutable object, and what a caller such as
the manager folds into the save's own exchanges.

A :class:`SaveRequest` is built once, keyword by keyword, and checked when built (bad options
raise before any collective starts); the save job only reads it. :class:`CommitHooks` are run by
the coordinator inside the save's two exchanges, so the manager's lease, sweep and retention cost
no extra round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .extra import WriteFiles, safe_extra_name
from .frozen import check_frozen_mode

CHECK_REPLICAS = ("auto", "error", "warn", "off")


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """One save. ``target``: the resolved checkpoint location (a directory or a URL).

    ``check_replicas``: "auto" (error with more than one rank), "error", "warn" or "off".
    ``extra_files``: small files (plain name -> bytes) the coordinator commits inside the
    checkpoint, listed with their checksum. ``write_files(staging_dir) -> [relative paths]``:
    files every rank writes itself into the checkpoint during the save (synchronous saves on a
    filesystem only). ``frozen``: "full" saves frozen parameters like the rest; "fingerprint"
    saves a fingerprint of each instead (see :mod:`safeckpt.engine.frozen`).
    """

    target: str
    state: Mapping[str, Any]
    metadata: Mapping[str, Any] | None = None
    overwrite: bool = False
    step: int | None = None
    metrics: Mapping[str, Any] | None = None
    check_replicas: str = "auto"
    extra_files: Mapping[str, bytes] = field(default_factory=dict)
    write_files: WriteFiles | None = None
    frozen: str = "full"

    def __post_init__(self) -> None:
        if self.check_replicas not in CHECK_REPLICAS:
            raise ValueError(f"check_replicas must be one of {CHECK_REPLICAS}, got {self.check_replicas!r}")
        check_frozen_mode(self.frozen)
        if self.step is not None and (not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0):
            raise ValueError(f"step must be a non-negative int, got {self.step!r}")
        extra = {}
        for name, data in (self.extra_files or {}).items():
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"extra_files[{name!r}] must be bytes, got {type(data).__name__}")
            extra[safe_extra_name(name)] = bytes(data)
        object.__setattr__(self, "extra_files", extra)


@dataclass(frozen=True)
class CommitHooks:
    """Run by the coordinator inside a save's exchanges: ``before_stage`` before the staging
    place is created (the manager takes the writer lease and sweeps leftovers), ``after_commit``
    with the saved step right after the checkpoint is published (retention). An error in
    ``after_commit`` is raised on every rank with ``after_commit_hint`` (the checkpoint stays
    committed)."""

    before_stage: Callable[[], None] | None = None
    after_commit: Callable[[int | None], Any] | None = None
    after_commit_hint: str = ""


NO_HOOKS = CommitHooks()
