"""Cross-rank coordination: the only module that calls ``torch.distributed``.

Design:
- Checkpoint collectives run on a *dedicated gloo group* with a bounded timeout, created lazily
  by the first collective safeckpt call (which every rank makes at the same point), so the
  training job's own (often NCCL) group is never used or disturbed, and an absent peer costs at
  most ``timeout`` seconds instead of the 30-minute default.
- Every step runs as a *phase*: each rank runs its local work inside ``try``, then all ranks
  exchange outcomes. Any failure becomes the same exception on every rank, naming each failing
  rank and its error. Nothing is raised between collectives, so no rank is ever left waiting.
- Payloads travel as JSON inside uint8 tensors, never pickle: a load path never unpickles.
- When the transport itself fails (a peer died or timed out), arrival markers in the job's
  TCPStore tell which ranks never reached the phase. After that the group is poisoned (gloo
  cannot recover it) and later calls fail at once instead of hanging.

With no process group initialised everything degrades to a single process.
"""

from __future__ import annotations

import json
import os
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import PORTABLE_ERRORS, CheckpointError, RankFailure

DEFAULT_TIMEOUT = 600.0
TIMEOUT_ENV = "SAFECKPT_TIMEOUT"


def resolve_timeout(timeout: float | None) -> float:
    """Seconds a rank waits for the others: argument, else $SAFECKPT_TIMEOUT, else 600."""
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV)
        timeout = float(env) if env else DEFAULT_TIMEOUT
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    return float(timeout)


def distributed_active() -> bool:
    return dist.is_available() and dist.is_initialized()


class _GroupState:
    """A dedicated gloo group plus the bookkeeping that must stay in step across ranks."""

    def __init__(self, group: Any, uid: int) -> None:
        self.group = group
        self.uid = uid
        self.seq = 0
        self.broken: str | None = None


_GROUPS: dict[tuple[int, float, str], tuple[weakref.ref, _GroupState]] = {}
_GROUP_COUNTER = [0]
_GROUP_ATTEMPTS = [0]  # group creations on this rank (same count on every rank)


def _group_alive(group: Any) -> bool:
    try:
        return group in dist.distributed_c10d._world.pg_map
    except Exception:  # pragma: no cover - private API moved
        return True


def _cached_group(timeout: float, purpose: str) -> _GroupState | None:
    default_pg = dist.distributed_c10d._get_default_group()
    cached = _GROUPS.get((id(default_pg), timeout, purpose))
    if cached is not None and cached[0]() is default_pg and _group_alive(cached[1].group):
        return cached[1]
    return None


def _new_group(timeout: float, purpose: str) -> _GroupState:
    default_pg = dist.distributed_c10d._get_default_group()
    key = (id(default_pg), timeout, purpose)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    _GROUP_COUNTER[0] += 1
    state = _GroupState(group, _GROUP_COUNTER[0])
    _GROUPS[key] = (weakref.ref(default_pg), state)
    return state


def describe_exception(exc: BaseException) -> dict[str, Any]:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {
        "type": type(exc).__name__,
        "portable": type(exc).__name__ if isinstance(exc, PORTABLE_ERRORS) else None,
        "message": str(exc),
        "traceback": "".join(tb[-6:]),
    }


def _one_line(err: dict[str, Any]) -> str:
    msg = err["message"].strip()
    return f"{err['type']}: {msg}" if msg else err["type"]


class Coordinator:
    """Rank identity plus phase-wise, error-propagating exchanges between all ranks.

    Call sequence (all ranks): ``Coordinator(timeout)`` then the same ``run(...)`` calls in the
    same order. ``run`` is the only collective; ``is_coordinator`` selects the single process
    that creates, renames and deletes directories.
    """

    def __init__(self, timeout: float | None = None, *, purpose: str = "main", what: str = "checkpoint") -> None:
        self.timeout = resolve_timeout(timeout)
        self.what = what
        if distributed_active():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        self._state: _GroupState | None = None
        if self.world_size > 1:
            self._state = _cached_group(self.timeout, purpose)
            if self._state is None:
                # Creating the group is itself a collective (through the store): a rank that
                # never arrives must give RankFailure within the timeout, like any later phase.
                _GROUP_ATTEMPTS[0] += 1
                marker = f"safeckpt/group-{_GROUP_ATTEMPTS[0]}"
                self._mark_arrival(marker)
                try:
                    self._state = _new_group(self.timeout, purpose)
                except Exception as exc:
                    raise self._lost_peers("setup", marker, exc) from exc

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ phases
    def run(self, phase: str, fn: Callable[[], Any], *, hint: str = "") -> list[Any]:
        """Run ``fn`` locally, exchange outcomes, and return every rank's value (by rank).

        If ``fn`` raised on any rank, every rank raises the same error: the portable
        CheckpointError type when all failing ranks agree on it, else ``RankFailure``.
        """
        local_exc: BaseException | None = None
        try:
            payload: dict[str, Any] = {"ok": True, "value": fn()}
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            local_exc = exc
            payload = {"ok": False, "error": describe_exception(exc)}
        if self.world_size == 1:
            results = [payload]
        else:
            results = self._exchange(phase, payload)
        failures = {r: res["error"] for r, res in enumerate(results) if not res["ok"]}
        if failures and self.world_size == 1:
            if isinstance(local_exc, CheckpointError):
                raise local_exc
            text = f"{self.what} failed during {phase!r}: {_one_line(failures[0])}"
            raise RankFailure("\n".join([text] + ([hint] if hint else [])), {0: _one_line(failures[0])}) from local_exc
        if failures:
            raise self._error(phase, failures, hint) from local_exc
        return [res["value"] for res in results]

    def barrier(self, phase: str) -> None:
        self.run(phase, lambda: None)

    def _error(self, phase: str, failures: dict[int, dict[str, Any]], hint: str) -> CheckpointError:
        ranks = sorted(failures)
        kinds = {failures[r]["portable"] for r in ranks}
        lines = [f"  rank {r}: {_one_line(failures[r])}" for r in ranks]
        where = "rank" if len(ranks) == 1 else "ranks"
        head = (
            f"{self.what} failed on {where} {', '.join(map(str, ranks))} "
            f"(of {self.world_size}) during {phase!r}:"
        )
        text = "\n".join([head, *lines] + ([hint] if hint else []))
        if len(kinds) == 1 and None not in kinds:
            (kind,) = kinds
            cls = next(c for c in PORTABLE_ERRORS if c.__name__ == kind)
            err = cls.__new__(cls)
            Exception.__init__(err, text)
            if not hasattr(err, "path"):
                err.path = None  # type: ignore[attr-defined]
            return err
        return RankFailure(text, {r: _one_line(failures[r]) for r in ranks})

    # --------------------------------------------------------------- transport
    def any_true(self, flag: bool, phase: str = "flag") -> bool:
        """True on every rank if ``flag`` is true on any rank (one tiny all-reduce)."""
        if self.world_size == 1:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._transport(phase, lambda group: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))
        return bool(t.item())

    def _exchange(self, phase: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        return self._transport(phase, lambda group: self._all_gather_json(payload, group))

    def _transport(self, phase: str, op: Callable[[Any], Any]) -> Any:
        state = self._state
        assert state is not None
        if state.broken:
            raise RankFailure(
                f"{self.what}: the checkpoint process group is unusable since an earlier failure "
                f"({state.broken}); a rank died or timed out. Restart the job "
                "(the last committed checkpoint is intact).",
            )
        state.seq += 1
        marker = f"safeckpt/{state.uid}/arrived"
        self._mark_arrival(marker, state.seq)
        try:
            return op(state.group)
        except Exception as exc:  # transport failure: dead, hung or absent peer
            state.broken = f"{phase!r}: {str(exc).splitlines()[0][:200]}"
            raise self._lost_peers(phase, marker, exc, state.seq) from exc

    def _lost_peers(self, phase: str, marker: str, exc: BaseException, seq: int = 1) -> RankFailure:
        """The RankFailure for a transport failure: names the ranks that never reached ``marker``."""
        missing = self._missing_ranks(marker, seq)
        if missing:
            who = ", ".join(map(str, missing))
            text = (
                f"{self.what} failed: rank(s) {who} (of {self.world_size}) did not reach "
                f"phase {phase!r} within {self.timeout:.0f}s: the process died, hung, or "
                "raised outside safeckpt. Check that rank's log. No checkpoint was "
                "published by this call; the previous one is intact."
            )
            failures = {r: f"did not reach {phase!r} (died or hung)" for r in missing}
        else:
            text = (
                f"{self.what} failed during {phase!r}: lost contact with a peer rank "
                f"({str(exc).splitlines()[0][:300]}). No checkpoint was published by this "
                "call; the previous one is intact."
            )
            failures = {}
        return RankFailure(text, failures)

    def _mark_arrival(self, marker: str, seq: int = 1) -> None:
        """Record in the job's store that this rank reached collective ``seq`` of ``marker``.

        One key per rank, overwritten each time, so calling this every step stores nothing new.
        """
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{marker}/{self.rank}", str(seq))
        except Exception:
            pass

    def _missing_ranks(self, marker: str, seq: int = 1) -> list[int]:
        try:
            store = dist.distributed_c10d._get_default_store()
            missing = []
            for r in range(self.world_size):
                key = f"{marker}/{r}"
                if not store.check([key]) or int(store.get(key).decode()) < seq:
                    missing.append(r)
            return missing
        except Exception:
            # The store lives on rank 0; if it is unreachable, rank 0 is the likely casualty.
            return [0] if self.rank != 0 else []

    def _all_gather_json(self, payload: dict[str, Any], group: Any) -> list[dict[str, Any]]:
        data = json.dumps(payload, separators=(",", ":")).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=group)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(outs, buf, group=group)
        return [
            json.loads(bytes(o[: int(n.item())].numpy()).decode()) for o, n in zip(outs, sizes, strict=True)
        ]
