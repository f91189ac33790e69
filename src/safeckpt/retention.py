"""Which committed checkpoints to keep: pure functions, no I/O, no torch.

A checkpoint is kept if any rule keeps it: the newest ``keep_last``, the best ``keep_best`` by
``best_metric`` (``best_mode`` "min" or "max"; checkpoints without the metric never count as
best), every step divisible by ``keep_every``, and anything protected (the newest checkpoint
and the one this run restored from are always protected). ``keep_last=None`` keeps everything.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = 3
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best", "keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.keep_best is not None and not self.best_metric:
            raise ValueError("keep_best needs best_metric (the name of a metric passed to save())")

    def keep(self, checkpoints: Sequence[tuple[int, Mapping[str, Any]]], protect: Collection[int] = ()) -> set[int]:
        """Steps to keep among ``(step, metrics)`` pairs."""
        steps = sorted(s for s, _ in checkpoints)
        if self.keep_last is None or not steps:
            return set(steps)
        kept = set(steps[-self.keep_last:]) | {steps[-1]} | (set(protect) & set(steps))
        if self.keep_every:
            kept |= {s for s in steps if s % self.keep_every == 0}
        if self.keep_best and self.best_metric:
            scored = []
            for s, metrics in checkpoints:
                v = (metrics or {}).get(self.best_metric)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
                    scored.append((v if self.best_mode == "min" else -v, -s, s))
            kept |= {s for _, _, s in sorted(scored)[: self.keep_best]}
        return kept

    def delete(self, checkpoints: Sequence[tuple[int, Mapping[str, Any]]], protect: Collection[int] = ()) -> list[int]:
        keep = self.keep(checkpoints, protect)
        return sorted(s for s, _ in checkpoints if s not in keep)
