"""Cross-rank coordination: the only module that calls ``torch.distributed``.

Design:
- Checkpoint collectives run on a *dedicated gloo group* with a bounded timeout, created lazily
  by the first collective safeckpt call (which every rank makes at the same point), so the
  training job's own (often NCCL) group is never used or disturbed, and an absent peer costs at
  most ``timeout`` seconds instead of the 30-minute default.
- Creating that group is bounded too. Ranks first meet in the job's store (each publishes who it
  is, see ``safeckpt.coord.liveness``) with their own deadline, so a rank that died before safeckpt's first
  call is named after ``timeout``. The group is then created with a connect timeout of
  ``timeout / 6`` (gloo waits up to 5x that for a peer that dies while connecting) and its
  collective timeout raised to ``timeout`` afterwards.
- Every step runs as a *phase*: each rank runs its local work inside ``try``, then all ranks
  exchange outcomes. Any failure becomes the same exception on every rank, naming each failing
  rank and its error. Nothing is raised between collectives, so no rank is ever left waiting.
- Payloads travel as JSON inside uint8 tensors, never pickle: a load path never unpickles.
- When the transport itself fails (a peer died or timed out), the error says what this rank saw
  (connection closed after N s, or no answer within the timeout) and which rank failed: a peer
  whose process is gone (checked by pid where comparable) and that did not see the failure
  itself (survivors leave a marker), else the ranks whose arrival marker in the job's store is
  missing; never a guess. A phase whose coordinator part may have completed (the commit's
  publish) says whether it did, or that this is unknown. After that the group is poisoned
  (gloo cannot recover it) and later calls fail at once instead of hanging.

With no process group initialised everything degrades to a single process.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._settings import resolve_timeout
from ..errors import PORTABLE_ERRORS, CheckpointError, RankFailure
from .liveness import is_gone, mark_survivor, process_state, self_record, survivor_note

CONNECT_SHARE = 6  # group connect timeout = timeout / 6: gloo's connect may wait 5x it
SETUP_HINT = "Nothing was saved or loaded by this call; committed checkpoints are intact."
DEFAULT_HINT = "Checkpoints committed before this call are intact."
DEATH_GRACE = 1.0  # seconds to wait for a peer whose socket closed to show up as exited


def _store_budget(timeout: float) -> float:
    """Seconds failure diagnosis waits for the store to answer."""
    return min(5.0, max(1.0, timeout / 4))



def distributed_active() -> bool:
    return dist.is_available() and dist.is_initialized()


class _GroupState:
    """A dedicated gloo group plus the bookkeeping that must stay in step across ranks."""

    def __init__(self, key: str, world_size: int) -> None:
        self.group: Any = None
        self.key = key  # prefix of this group's keys in the job's store
        self.peers: list[dict[str, Any] | None] = [None] * world_size
        self.seq = 0  # collectives run on the group; 0 while it is being created
        self.broken: str | None = None
        self.arrived: set[int] | None = None  # ranks seen at the setup rendezvous, while waiting
        # this rank's own part of the current phase: its name, the first collective's seq, how
        # long it took, and its error (a rank slower than the timeout is told so, see _late_text)
        self.local: dict[str, Any] | None = None
        self.behind: dict[int, int] = {}  # missing rank -> last collective it reached (diagnosis)

    @property
    def name(self) -> str:
        """This group's name, the same on every rank (``group-N``)."""
        return self.key.rsplit("/", 1)[-1]


_GROUPS: dict[tuple[int, float, str], tuple[weakref.ref, _GroupState]] = {}
_GROUP_ATTEMPTS = [0]  # group creations on this rank (same count on every rank)


def _group_alive(group: Any) -> bool:
    try:
        return group in dist.distributed_c10d._world.pg_map
    except Exception:  # pragma: no cover - private API moved
        return True


def _cached_group(timeout: float, purpose: str) -> _GroupState | None:
    default_pg = dist.distributed_c10d._get_default_group()
    cached = _GROUPS.get((id(default_pg), timeout, purpose))
    if cached is not None and cached[0]() is default_pg:
        state = cached[1]
        if state.broken or _group_alive(state.group):
            return state
    return None


class PhaseFailures(Exception):
    """Raised by a ``decide`` resolver to fail the phase naming ranks' own errors
    (``{rank: describe_exception(...)}``), as if those ranks had raised them."""

    def __init__(self, failures: dict[int, dict[str, Any]]) -> None:
        super().__init__(f"{len(failures)} rank(s) failed")
        self.failures = failures


class _PeerExited(Exception):
    """A peer's process was seen gone while this rank waited for it."""


def _known_peers(default_pg: Any, world_size: int) -> list[dict[str, Any] | None]:
    """The rank records of an existing group of this job (the same processes), or Nones."""
    for ref, state in _GROUPS.values():
        if ref() is default_pg and len(state.peers) == world_size and all(state.peers):
            return list(state.peers)
    return [None] * world_size


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _ask_store(query: Callable[[Any], Any], budget: float) -> Any:
    """``query(store)`` on the job's store, run in a helper thread and waited for at most
    ``budget`` seconds (TimeoutError after that).

    Reads from a store whose host is frozen or cut off (not dead: that fails at once) block
    for as long as TCP retries, ignoring the store's timeout (measured: >200 s against a
    SIGSTOPped host with a 2 s timeout). Only failure diagnosis reads the store after the
    rendezvous, so a failure is reported in bounded time even then; a stuck helper is left
    behind (daemon) in a job that is failing anyway.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:  # not a clone: connecting one to a dead host retries for the store's own timeout
            box["value"] = query(_store())
        except Exception as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    helper = threading.Thread(target=target, name="safeckpt-store-query", daemon=True)
    helper.start()
    helper.join(budget)
    if helper.is_alive():
        raise TimeoutError(f"the job's store did not answer within {budget:.0f}s (its host hangs or is cut off)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


JOB_KEY = "safeckpt/job"  # the job's identity in its store (see job_token)
_JOB_TOKENS: dict[int, tuple[weakref.ref, str]] = {}


def job_token(budget: float = 5.0) -> str | None:
    """This job's identity: the same string on every rank of the job, another in any other
    job. The first rank that asks draws a fresh token and the job's store keeps it (an atomic
    compare-and-set: the first writer wins, every later asker reads that one), so it needs no
    collective and any rank may ask at any time. The writer lease uses it where torchrun gives
    no rendezvous id (plain ``torchrun`` sets TORCHELASTIC_RUN_ID to ``none`` in every job).
    None without a process group, or when the store does not answer within ``budget``."""
    if not distributed_active():
        return None
    default_pg = dist.distributed_c10d._get_default_group()
    cached = _JOB_TOKENS.get(id(default_pg))
    if cached is not None and cached[0]() is default_pg:
        return cached[1]
    fresh = f"job-{uuid.uuid4().hex}"
    try:
        value = _ask_store(lambda store: store.compare_set(JOB_KEY, "", fresh), budget)
    except Exception:  # noqa: BLE001 - the caller falls back to an identity of its own
        return None
    token = value.decode() if isinstance(value, bytes) else str(value)
    if not token:
        return None
    _JOB_TOKENS[id(default_pg)] = (weakref.ref(default_pg), token)
    return token


LAZY_ENV = "SAFECKPT_LAZY_CONNECT"  # "auto" (default), "1" or "0"
LAZY_FROM = 33  # world size from which "auto" connects the group's pairs lazily


def lazy_connect(world_size: int) -> bool:
    """Whether the checkpoint group connects its pairs on first use instead of as a full mesh.

    Every exchange is a gather to rank 0 and a broadcast from it, so with lazy pairs a rank
    other than 0 holds one connection (to rank 0) instead of world_size - 1; rank 0 holds one
    per rank either way. A full mesh is kept for small jobs: creating the group then already
    proves every pair can connect (measured: 16 ranks, 16 sockets per rank full mesh, 3 lazy)."""
    mode = os.environ.get(LAZY_ENV, "auto").strip().lower()
    if mode in ("1", "true", "yes"):
        return True
    if mode in ("0", "false", "no"):
        return False
    return world_size >= LAZY_FROM


def _new_gloo_group(timeout: float) -> Any:
    """A gloo group over all ranks whose creation waits at most ~``timeout`` for a dead peer
    and whose collectives time out after ``timeout``."""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    if gloo is None or not hasattr(gloo, "_set_default_timeout"):  # pragma: no cover - old torch
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    lazy = lazy_connect(dist.get_world_size())
    before = os.environ.get("TORCH_GLOO_LAZY_INIT")
    if lazy:  # read by gloo when the group's device is created, just below
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout / CONNECT_SHARE))
    finally:
        if lazy:
            if before is None:
                os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
            else:
                os.environ["TORCH_GLOO_LAZY_INIT"] = before
    group._get_backend(torch.device("cpu"))._set_default_timeout(timedelta(seconds=timeout))
    return group


def _attempt(fn: Callable[[], Any]) -> tuple[dict[str, Any], BaseException | None]:
    """A phase's local step as the payload ranks exchange ({"ok", "value"} or {"ok", "error"}),
    and the exception it raised here (None when it returned)."""
    try:
        return {"ok": True, "value": fn()}, None
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        return {"ok": False, "error": describe_exception(exc)}, exc


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


def _first_line(exc: BaseException) -> str:
    """The gloo/c10d message without its C++ backtrace or build-path prefix."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[[^\]]*/(gloo|c10d)/[^\]]*\]\s*", "", text)[:300]


TIMEOUT_DOC = ("the argument, or $SAFECKPT_TIMEOUT; it bounds each phase, a rank's own work in "
               "it included: see docs/reference/index.md")
_DOING = {  # what a rank does in its own part of a phase, for people
    "write": "writing its share of the checkpoint",
    "agree": "preparing its state for the save",
    "check": "reading and verifying its part of the checkpoint",
    "apply": "applying the loaded state",
    "stage": "copying its state aside",
}


def _gist(line: str) -> str:
    """``Type: what happened`` of a one-line error, without the explanation that follows (which
    may guess a cause that does not apply, such as an unshared directory)."""
    kind, _, msg = line.partition(": ")
    head = re.split(r": |\. ", msg, maxsplit=1)[0] if msg else ""
    return f"{kind}: {head[:200]}" if head else kind


# The first exchange of a collective call: a rank that finished the exchange before it may still
# be outside safeckpt (in its training code, not yet in this call), not only in its own part.
_FIRST_PHASES = frozenset({"agree", "pick", "check", "preempted"})


def _doing(phase: str) -> str:
    return _DOING.get(phase, f"working on phase {phase!r}")


def _rank_list(raw: bytes | str) -> set[int]:
    """The ranks in an appended list (``"3,7,12,"``)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return {int(x) for x in text.split(",") if x.strip().isdigit()}


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


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
            self._state = _cached_group(self.timeout, purpose) or self._create_group(purpose)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ setup
    def _create_group(self, purpose: str) -> _GroupState:
        """Meet every rank in the store (bounded), then create the gloo group (bounded).

        Creating a group is itself a collective: a rank that never arrives, or dies while the
        group connects, gives RankFailure within the timeout, like any later phase.
        """
        default_pg = dist.distributed_c10d._get_default_group()
        _GROUP_ATTEMPTS[0] += 1
        state = _GroupState(f"safeckpt/group-{_GROUP_ATTEMPTS[0]}", self.world_size)
        # The processes of an earlier group of this job, if any: a peer that died since is
        # seen at once instead of after the timeout, and named even if the store is gone.
        state.peers = _known_peers(default_pg, self.world_size)
        # Cached at once: a failed creation poisons this group, so later calls fail fast.
        _GROUPS[(id(default_pg), self.timeout, purpose)] = (weakref.ref(default_pg), state)
        started = time.monotonic()
        try:
            keys = [f"{state.key}/peer/{r}" for r in range(self.world_size)]
            store = _store()
            # Before the record: once every record is there, every arrival marker is too, so
            # failure diagnosis reads all of them in one request (multi_get waits for absent keys).
            store.set(f"{state.key}/arrived/{self.rank}", "0")
            store.set(keys[self.rank], json.dumps(self_record()))
            store.append(f"{state.key}/joined", f"{self.rank},")  # who arrived: one key to read
            store.add(f"{state.key}/count", 1)  # how many arrived: what the others poll
            self._await_peers(state, store, keys, started)
            records = store.multi_get(keys)  # one request, whatever the world size
            for r, raw in enumerate(records):
                state.peers[r] = json.loads(raw)
            state.group = _new_gloo_group(self.timeout)
        except Exception as exc:  # a peer absent, dead, or the store gone
            raise self._lost_peers(state, "setup", SETUP_HINT, exc, started) from exc
        return state

    def _await_peers(self, state: _GroupState, store: Any, keys: list[str], started: float) -> None:
        """Wait (at most the timeout) until every rank published its record.

        A helper thread polls the store (bounded even if the store's host freezes) while this
        thread watches the processes known from an earlier group: one that exits fails the
        setup at once (the async group after a rank died in the snapshot, for instance). Now
        and then the helper notes which ranks have arrived, so a failure can name the absent
        ones even if the store is gone by then.
        """
        box: dict[str, Any] = {}
        stop = threading.Event()
        every = max(1.0, self.timeout / 10)

        def poll() -> None:  # check() returns at once and, unlike a timed-out wait, logs nothing
            try:
                # The shared (thread-safe) client, not a clone: connecting a clone to a dead
                # host retries for the store's own timeout.
                own = store
                pause, noted = 0.01, time.monotonic()
                while not stop.is_set():
                    if state.peers[0] is None and own.check(keys[:1]):
                        # rank 0 first: it usually hosts the store, so once it is gone its
                        # record could not be read any more
                        state.peers[0] = json.loads(own.get(keys[0]))
                    # O(1) requests per poll whatever the world size: the arrival counter, and
                    # now and then the list of who arrived
                    if int(own.add(f"{state.key}/count", 0)) >= self.world_size:
                        box["ok"] = True
                        return
                    if time.monotonic() - noted > every:
                        state.arrived = (state.arrived or {self.rank}) | _rank_list(own.get(f"{state.key}/joined"))
                        noted = time.monotonic()
                    stop.wait(pause)
                    pause = min(pause * 1.5, 0.2)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                box["error"] = exc

        helper = threading.Thread(target=poll, name="safeckpt-rendezvous", daemon=True)
        helper.start()
        deadline = started + self.timeout
        try:
            while True:
                helper.join(0.05)
                if "error" in box:
                    raise box["error"]
                if box.get("ok"):
                    return
                gone = [r for r, p in enumerate(state.peers) if r != self.rank and is_gone(p)]
                if gone:
                    raise _PeerExited(f"the process of rank(s) {_ranks(gone)} exited")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"wait timeout after {self.timeout:g}s for every rank's arrival")
        finally:
            stop.set()

    # ------------------------------------------------------------------ phases
    def run(self, phase: str, fn: Callable[[], Any], *, hint: str = "", done_hint: str = "") -> list[Any]:
        """Run ``fn`` locally, exchange outcomes, and return every rank's value (by rank).

        If ``fn`` raised on any rank, every rank raises the same error: the portable
        CheckpointError type when all failing ranks agree on it, else ``RankFailure``.
        ``hint`` (what the failure means for the checkpoint) ends every error message.
        ``done_hint`` replaces it when the coordinator's own part of the phase completed (the
        commit: it published) though the phase failed; when a peer was lost and whether the
        coordinator completed is unknown, the message says so and gives both.
        Every rank sends its ``phase`` with its value, as in :meth:`decide`: a rank in another
        phase than rank 0's (the ranks are out of step) fails the phase on every rank with the
        same RankFailure naming the ranks and their phases (each rank compares by itself: every
        rank has every rank's phase), whatever else failed.
        """
        payload, local_exc = self._local_step(phase, fn)
        if self.world_size == 1:
            results = [payload]
        else:
            results = self._exchange(phase, {**payload, "phase": phase}, hint, done_hint)
        # rank 0's phase, not this rank's: every rank then computes the same error
        lead = results[0].get("phase", phase)
        if done_hint and results[0]["ok"] and lead == phase:  # rank 0 completed this rank's phase
            hint = done_hint
        stray = _out_of_step(lead, results) if self.world_size > 1 else {}
        if stray:  # the values answer different calls: never returned, whatever else failed
            named = {int(r): err for r, err in _capped(stray).items()}  # as decide names them
            raise self._error(lead, named, hint) from local_exc
        failures = {r: res["error"] for r, res in enumerate(results) if not res["ok"]}
        if failures and self.world_size == 1:
            assert local_exc is not None
            self._raise_local(phase, local_exc, failures[0], hint)
        if failures:
            raise self._error(phase, failures, hint) from local_exc
        return [res["value"] for res in results]

    def barrier(self, phase: str) -> None:
        self.run(phase, lambda: None)

    def decide(self, phase: str, local: Callable[[], Any], resolve: Callable[[list[Any]], Any], *,
               hint: str = "", done_hint: str = "") -> Any:
        """Run ``local`` on every rank; the coordinator alone receives every rank's value and
        returns ``resolve(values)`` (the decision), which every rank then receives.

        Two collectives (a gather to the coordinator, a broadcast from it), each carrying at
        most SLOT bytes per rank in the common case: a non-coordinator sends its own value and
        receives the decision, whatever the world size. A failure of ``local`` on any rank, or
        of ``resolve``, raises the same error on every rank, as :meth:`run` does; ``done_hint``
        as in :meth:`run` (the coordinator's ``resolve`` completed, e.g. it published).
        Every rank sends its ``phase`` with its value: a rank in another phase than the
        coordinator's (the ranks are out of step) fails the phase on every rank with RankFailure
        naming the ranks and their phases, and ``resolve`` is not called.
        """
        payload, local_exc = self._local_step(phase, local)
        if self.world_size == 1:
            if local_exc is not None:
                self._raise_local(phase, local_exc, payload["error"], hint)
            try:
                return resolve([payload["value"]])
            except PhaseFailures as exc:
                raise self._error(phase, exc.failures, hint) from None
            except Exception as exc:  # noqa: BLE001
                self._raise_local(phase, exc, describe_exception(exc), hint)
        state = self._state
        assert state is not None
        # Every rank sends its phase's name with its value (a few bytes), so that the
        # coordinator can tell ranks that are out of step (see _out_of_step).
        data = json.dumps({**payload, "phase": phase}, separators=(",", ":")).encode()
        outs = self._transport(phase, lambda group: _gather_slots(data, group, self.rank, self.world_size, SLOT), hint)
        decision: dict[str, Any] | None = None
        rest: list[torch.Tensor] | None = None
        extra = max((_frame_len(o) - SLOT for o in outs), default=0) if outs is not None else 0
        if extra > 0:
            # Someone's value is longer than a slot (a layout description, a traceback): every
            # rank sends the rest of its value in one more gather, sized by this first answer.
            more = self._transport(phase, lambda group: _broadcast_json({"more": extra}, group, self.rank), hint)
            rest = self._transport(phase, lambda group: _gather_slots(data[SLOT:], group, self.rank,
                                                                      self.world_size, more["more"]), hint)
        if self.is_coordinator:
            assert outs is not None
            gathered = _decoded(outs, rest)
            failures = {r: res["error"] for r, res in enumerate(gathered) if not res["ok"]}
            stray = _out_of_step(phase, gathered)
            if stray:  # the values answer different calls: never resolved, whatever else failed
                decision = {"ok": False, "failures": _capped(stray)}
            elif failures:
                decision = {"ok": False, "failures": _capped(failures)}
            else:
                try:
                    decision = {"ok": True, "value": resolve([res["value"] for res in gathered])}
                except PhaseFailures as exc:  # resolve names the failing ranks itself
                    decision = {"ok": False, "failures": _capped(exc.failures)}
                except Exception as exc:  # noqa: BLE001 - reported to every rank
                    local_exc = exc
                    decision = {"ok": False, "failures": {"0": describe_exception(exc)}}
        done = bool(done_hint) and self.is_coordinator and bool(decision and decision["ok"])
        decision = self._transport(phase, lambda group: _broadcast_json(decision, group, self.rank), hint,
                                   done_hint, done)
        assert decision is not None
        if "more" in decision:  # rank 0 asks for the rest of the longer values
            self._transport(phase, lambda group: _gather_slots(data[SLOT:], group, self.rank, self.world_size,
                                                               decision["more"]), hint)
            decision = self._transport(phase, lambda group: _broadcast_json(None, group, self.rank), hint,
                                       done_hint, False)
        if decision["ok"]:
            return decision["value"]
        failures = {int(r): err for r, err in decision["failures"].items()}
        raise self._error(phase, failures, hint) from local_exc

    def _local_step(self, phase: str, fn: Callable[[], Any]) -> tuple[dict[str, Any], BaseException | None]:
        """``_attempt(fn)``, timed: how long this rank's own part of ``phase`` took is what tells
        it, if the exchange then fails at once, that the others gave up waiting for it."""
        started = time.monotonic()
        payload, exc = _attempt(fn)
        state = self._state
        if state is not None:
            state.local = {"phase": phase, "seq": state.seq + 1, "took": time.monotonic() - started,
                           "error": None if payload["ok"] else _one_line(payload["error"])}
        return payload, exc

    def mark_done(self) -> None:
        """Coordinator, inside a ``decide`` resolver: its decisive step (the publish) completed.
        Peers that lose the coordinator before its decision arrives then learn that it did,
        even if it dies during what the resolver does next (retention)."""
        state = self._state
        if state is not None and self.is_coordinator:
            self._mark(f"{state.key}/done/{state.seq + 1}", 1)  # the seq of the coming broadcast

    def _raise_local(self, phase: str, exc: BaseException, err: dict[str, Any], hint: str) -> None:
        """One process's failure: a CheckpointError as it is, anything else as RankFailure."""
        if isinstance(exc, CheckpointError):
            raise exc
        text = f"{self.what} failed during {phase!r}: {_one_line(err)}"
        raise RankFailure("\n".join([text] + ([hint] if hint else [])), {0: _one_line(err)}) from exc

    def _error(self, phase: str, failures: dict[int, dict[str, Any]], hint: str) -> CheckpointError:
        ranks = sorted(failures)
        kinds = {failures[r]["portable"] for r in ranks}
        lines = [f"  rank {r}: {_one_line(failures[r])}" for r in ranks]
        where = "rank" if len(ranks) == 1 else "ranks"
        head = (
            f"{self.what} failed on {where} {_ranks(ranks)} "
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
        self._transport(phase, lambda group: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), "")
        _count(4, 4)
        return bool(t.item())

    def _exchange(self, phase: str, payload: dict[str, Any], hint: str, done_hint: str) -> list[dict[str, Any]]:
        done = bool(done_hint) and self.is_coordinator and payload["ok"]
        return self._transport(phase, lambda group: self._all_gather_json(payload, group), hint,
                               done_hint, done)

    def _transport(self, phase: str, op: Callable[[Any], Any], hint: str, done_hint: str = "",
                   done: bool = False) -> Any:
        state = self._state
        assert state is not None
        if state.broken:
            raise RankFailure(
                f"{self.what}: the checkpoint process group is unusable since an earlier failure "
                f"({state.broken}). Restart the job. {hint or DEFAULT_HINT}",
            )
        state.seq += 1
        if done:  # before the exchange: a peer that loses us can still learn we completed
            self._mark(f"{state.key}/done/{state.seq}", 1)
        self._mark(f"{state.key}/arrived/{self.rank}", state.seq)
        started = time.monotonic()
        try:
            return op(state.group)
        except Exception as exc:  # transport failure: dead, hung or absent peer
            if done_hint:
                hint = self._settle_hint(state, phase, hint, done_hint, done, started)
            raise self._lost_peers(state, phase, hint, exc, started, done) from exc

    # -------------------------------------------------------------- diagnosis
    def _lost_peers(self, state: _GroupState, phase: str, hint: str, exc: BaseException,
                    started: float, done: bool = False) -> RankFailure:
        """The RankFailure for a transport failure: what this rank saw, and who failed."""
        elapsed = time.monotonic() - started
        raw = _first_line(exc)
        low = raw.lower()
        closed = any(s in low for s in ("closed", "reset by peer", "broken pipe", "failed to recv"))
        if isinstance(exc, _PeerExited):
            seen = f"a peer's process exited while this rank waited (noticed after {elapsed:.1f}s)"
        elif "timeout caused pair closure" in low:
            seen = f"a peer gave up waiting (its timeout expired) and closed the connection after {elapsed:.1f}s"
        elif closed:
            addr = re.search(r"\[([0-9a-fA-F.:]+)\]:(\d+)", raw)
            peer = f" ({addr.group(1)}:{addr.group(2)})" if addr else ""
            seen = f"the connection to a peer{peer} was closed after {elapsed:.1f}s"
        elif "connect timeout" in low:
            seen = f"a peer never finished connecting (gloo's connect timed out after {elapsed:.1f}s)"
        elif "timed out" in low or "timeout" in low:
            seen = f"no answer within the {self.timeout:g}s timeout, waited {elapsed:.1f}s"
        else:
            seen = f"{raw} (after {elapsed:.1f}s)"
        # Tell the others that this rank saw the failure (it is a survivor): in the store, and
        # on this host for when the store went with rank 0.
        self._mark_failed(state)
        mark_survivor(state.name, {"seq": state.seq, "done": done})
        gone, missing, alive, store_error = self._diagnose(state, closed)
        if store_error and state.seq == 0 and state.arrived is not None and elapsed >= 0.9 * self.timeout:
            # The store went away after this rank had waited (nearly) the whole timeout: the
            # ranks it had not seen arrive by then are the ones that never came.
            missing = [r for r in range(self.world_size) if r not in state.arrived]
            seen = (f"{seen}; the job's store then became unreachable ({store_error}), most likely "
                    "because rank 0 gave up on the same wait and exited")
        tail = hint or (SETUP_HINT if phase == "setup" else DEFAULT_HINT)
        n = self.world_size
        local = state.local if state.local and state.local["phase"] == phase else None
        gave_up = "timeout" in seen  # this rank, or the peer that closed, waited out the timeout
        if (local is not None and not gone and not missing and state.seq == local["seq"]
                and local["took"] >= 0.9 * self.timeout and elapsed < max(1.0, self.timeout / 2)):
            # This rank came late: its own part of the phase took longer than the others wait,
            # they gave up and closed the group just before it arrived.
            text, failures = self._late_text(state, phase, local, seen, tail)
        elif (local is not None and not gone and not missing and state.seq == local["seq"]
              and (gave_up or closed) and phase in _FIRST_PHASES and elapsed < max(1.0, self.timeout / 2)):
            # This rank's own part was quick, but it came to the call after the others had given
            # up on it: the time went outside safeckpt, before the call.
            text = (
                f"{self.what} failed: this rank ({self.rank}) came to phase {phase!r} after the other "
                f"ranks had given up waiting for it ({_gist(seen)}): it reached this call more than the "
                f"{self.timeout:g}s timeout after they did (its own code between calls was slow or "
                f"stuck, or the ranks run different numbers of steps). {tail}"
            )
            failures = {self.rank: f"came to {phase!r} more than the {self.timeout:g}s timeout late"}
        elif gone:
            before = [r for r in gone if r in missing]
            when = ("at or before" if store_error
                    else "before reaching" if len(before) == len(gone) else "during")
            text = (
                f"{self.what} failed: rank(s) {_ranks(gone)} (of {n}) exited or was killed "
                f"{when} phase {phase!r} (seen here: {seen}). Check that rank's log "
                f"(crash, out-of-memory kill, or an exception outside safeckpt). {tail}"
            )
            failures = {r: f"process exited {when} {phase!r}" for r in gone}
        elif missing:
            doing = _doing(phase)
            # still in its own part of this phase: it completed the exchange before it
            working = local is not None and all(state.behind.get(r) == local["seq"] - 1 for r in missing)
            if all(r in alive for r in missing):
                states = sorted({process_state(state.peers[r]) or "alive" for r in missing})
                if working and gave_up and phase in _FIRST_PHASES:
                    text = (
                        f"{self.what} failed: rank(s) {_ranks(missing)} (of {n}) had not finished its "
                        f"part of phase {phase!r} when the ranks waiting for it gave up after the "
                        f"{self.timeout:g}s timeout (seen here: {seen}; its process is alive: "
                        f"{', '.join(states)}): it was still {doing}, or it had not reached this call "
                        "yet (busy or hung in its own code: a slow or stuck training step, data "
                        f"loading, a different number of steps per rank). Check that rank's log. {tail}"
                    )
                elif working and gave_up:
                    text = (
                        f"{self.what} failed: rank(s) {_ranks(missing)} (of {n}) was still {doing} "
                        f"(its own part of phase {phase!r}; its process is alive: {', '.join(states)}) "
                        f"when the ranks waiting for it gave up after the {self.timeout:g}s timeout "
                        f"(seen here: {seen}). Either its {doing.split(' ')[0]} takes longer than "
                        f"`timeout` ({TIMEOUT_DOC}), or it hangs: check that rank's log. {tail}"
                    )
                    failures = {r: f"still {doing} ({phase!r}) after the {self.timeout:g}s timeout"
                                for r in missing}
                    who = f"rank(s) {_ranks(sorted(failures))}: "
                    state.broken = f"{phase!r}: {who}{seen}"
                    return RankFailure(text, failures)
                why = f"and is still alive ({', '.join(states)}): hung, stopped, or busy outside safeckpt"
            else:
                why = "(died, hung, or raised outside safeckpt)"
            text = (
                f"{self.what} failed: rank(s) {_ranks(missing)} (of {n}) did not reach phase "
                f"{phase!r} {why} (seen here: {seen}). Check that rank's log. {tail}"
            )
            failures = {r: f"did not reach {phase!r} ({seen})" for r in missing}
        elif store_error:
            host = process_state(state.peers[0]) if self.rank else None
            if host:
                guess = (f"rank 0's process is alive but {host}; if the store lives in rank 0 "
                         "(a job started without torchrun's agent), rank 0 is frozen")
            else:
                guess = ("without torchrun's agent the store lives in rank 0, so rank 0 has "
                         "most likely exited or its host is unreachable")
            text = (
                f"{self.what} failed during {phase!r}: lost contact with a peer rank ({seen}) and "
                f"the job's store{_store_address()} is unreachable ({store_error}): {guess}. "
                f"Which rank failed first cannot be told from here. {tail}"
            )
            stopped = host is not None and host.startswith("stopped")
            failures = {0: f"process {host} while its peers waited in {phase!r}"} if stopped else {}
        else:
            text = (
                f"{self.what} failed during {phase!r}: lost contact with a peer rank ({seen}; "
                f"{raw}). Every rank reached this phase and none is known to have exited; check "
                f"the other ranks' logs. {tail}"
            )
            failures = {}
        who = f"rank(s) {_ranks(sorted(failures))}: " if failures else ""
        state.broken = f"{phase!r}: {who}{seen}"
        return RankFailure(text, failures)

    def _late_text(self, state: _GroupState, phase: str, local: dict[str, Any], seen: str,
                   tail: str) -> tuple[str, dict[int, str]]:
        """The error of a rank whose own part of ``phase`` outlasted the timeout: the others
        gave up waiting for it, so what it sees (a closed connection, the staging directory
        removed, the store gone with rank 0) is the consequence, not a second failure."""
        doing = _doing(phase)
        others = [r for r in range(self.world_size) if r != self.rank]
        exited = [r for r in others if is_gone(state.peers[r])]
        after = f"; rank(s) {_ranks(exited)} then exited" if exited else ""
        own = (f" Its own step then ended with {_gist(local['error'])}: a consequence of the others "
               "giving up (rank 0 removes what the failed call wrote), not a second fault."
               if local["error"] else "")
        text = (
            f"{self.what} failed: this rank ({self.rank}) was still {doing} (its own part of phase "
            f"{phase!r} took {local['took']:.1f}s here) when the other ranks gave up waiting for it "
            f"after the {self.timeout:g}s timeout{after} (seen here: {seen}).{own} If its "
            f"{doing.split(' ')[0]} normally takes this long, raise `timeout` ({TIMEOUT_DOC}). {tail}"
        )
        return text, {self.rank: f"still {doing} ({phase!r}, {local['took']:.1f}s) after the others' "
                                 f"{self.timeout:g}s timeout"}

    def _settle_hint(self, state: _GroupState, phase: str, hint: str, done_hint: str, done: bool,
                     started: float) -> str:
        """Which hint is true after losing a peer in a phase whose coordinator part may have
        completed: wait (bounded) until the coordinator marked it done, reported the failure
        without completing, or is gone."""
        if self.is_coordinator:
            return done_hint if done else hint
        done_key, failed_key = f"{state.key}/done/{state.seq}", f"{state.key}/failed/0"
        deadline = started + self.timeout

        pause = [0.02]

        def poll(store: Any) -> str | None:
            while True:
                if store is not None:
                    try:
                        if store.check([done_key]):
                            return done_hint
                        if store.check([failed_key]):
                            return hint  # it saw the failure, and had not completed its part
                    except Exception:  # the store went with rank 0: its note here may tell
                        store = None
                note = survivor_note(state.peers[0], state.name)
                if note is not None and note.get("seq") == state.seq:
                    return done_hint if note.get("done") else hint
                if is_gone(state.peers[0]) or time.monotonic() > deadline:
                    return None  # rank 0 itself died: it may have completed just before
                time.sleep(pause[0])
                pause[0] = min(pause[0] * 1.5, 0.25)  # every survivor polls: keep the store's load low

        try:
            settled = _ask_store(poll, max(0.0, deadline - time.monotonic()) + 0.5)
        except Exception:
            settled = None
        return settled or (f"Whether rank 0 completed {phase!r} before contact was lost is "
                           f"unknown here. If it did: {done_hint} If not: {hint}")

    def _diagnose(self, state: _GroupState, closed: bool) -> tuple[list[int], list[int], list[int], str]:
        """(ranks whose process is gone and did not see the failure themselves, ranks that did
        not reach the failed collective, ranks known to be alive, the store's error if any).

        A survivor that saw the failure, raised and exited looks gone too; it left a "failed"
        marker in the store and, for when the store went with rank 0, a note on its host.
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        store_error = ""
        missing: list[int] = []
        survivors: set[int] = set()
        last: dict[int, int] = {}  # the last collective each missing rank reached

        def markers(store: Any) -> tuple[list[int], set[int], dict[int, Any]]:
            # O(1) requests whatever the world size (each survivor asks once; at 1,024 ranks a
            # request per peer was ~3M requests on the one store, past any budget): the list
            # of ranks that saw the failure, and every rank's arrival in one multi_get.
            failed_key = f"{state.key}/failed"
            saw = _rank_list(store.get(failed_key)) if store.check([failed_key]) else set()
            records: dict[int, Any] = {}
            if state.seq == 0:  # setup: arrived = published its record (then joined the list)
                joined_key = f"{state.key}/joined"
                joined = _rank_list(store.get(joined_key)) if store.check([joined_key]) else set()
                absent = [r for r in others if r not in joined]
                unknown = sorted(r for r in joined if r != self.rank and state.peers[r] is None)
                if unknown:  # their records exist (published before joining): one request
                    raws = store.multi_get([f"{state.key}/peer/{r}" for r in unknown])
                    records = {r: json.loads(raw) for r, raw in zip(unknown, raws, strict=True)}
            else:  # every arrival marker exists since setup (see _create_group)
                values = store.multi_get([f"{state.key}/arrived/{r}" for r in others])
                marks = {r: int(v.decode()) for r, v in zip(others, values, strict=True)}
                absent = [r for r in others if marks[r] < state.seq]
                last.update({r: marks[r] for r in absent})
            return absent, saw, records

        try:
            missing, survivors, records = _ask_store(markers, _store_budget(self.timeout))
            # A rank that saw the failure itself is a fellow survivor, not the one missing,
            # even if it failed at an earlier collective of the phase (the coordinator gives
            # up in the gather while the others wait for its broadcast).
            missing = [r for r in missing if r not in survivors]
            for r, record in records.items():
                state.peers[r] = state.peers[r] or record
        except Exception as exc:  # the store's host is gone (or unreachable)
            store_error = _first_line(exc)
        deadline = time.monotonic() + (DEATH_GRACE if closed else 0.0)
        while True:
            status = {r: is_gone(state.peers[r]) for r in others}
            gone = [r for r in others if status[r] and r not in survivors
                    and not survivor_note(state.peers[r], state.name)]
            if gone or time.monotonic() >= deadline or not any(v is False for v in status.values()):
                break  # found, out of time, or no peer whose exit could still show
            time.sleep(0.02)  # a killed peer's sockets close just before it shows as exited
        alive = [r for r in others if status[r] is False]
        state.behind = last
        return gone, missing, alive, store_error

    def _mark_failed(self, state: _GroupState) -> None:
        """Add this rank to the group's list of ranks that saw its failure (one key for all, so
        a survivor reads it in one request); rank 0 also sets its own key, which peers whose
        phase it may have completed poll (``_settle_hint``). Bounded: the store may hang."""
        def mark(store: Any) -> None:
            store.append(f"{state.key}/failed", f"{self.rank},")
            if self.rank == 0:
                store.set(f"{state.key}/failed/0", str(state.seq))

        try:
            _ask_store(mark, _store_budget(self.timeout))
        except Exception:
            pass

    def _mark(self, key: str, seq: int, bounded: bool = False) -> None:
        """Record in the job's store that this rank reached collective ``seq`` (or saw it fail).

        One key per rank, overwritten each time, so calling this every step stores nothing new.
        ``bounded`` (after a failure, when the store may hang): give up after a short while.
        """
        try:
            if bounded:
                _ask_store(lambda store: store.set(key, str(seq)), _store_budget(self.timeout))
            else:
                _store().set(key, str(seq))
        except Exception:
            pass

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
        _count(8, 8 * (self.world_size - 1))
        _count(longest, longest * (self.world_size - 1))
        return [
            json.loads(bytes(o[: int(n.item())].numpy()).decode()) for o, n in zip(outs, sizes, strict=True)
        ]


SLOT = 1024  # payload bytes each rank sends (and receives) in one gather (broadcast)
MAX_FAILURES = 64  # failures a decision names one by one (the others are counted)
STATS = {"rounds": 0, "sent": 0, "received": 0}  # this process's checkpoint collectives (bench)


def _capped(failures: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ranks = sorted(failures)
    out = {str(r): failures[r] for r in ranks[:MAX_FAILURES]}
    if len(ranks) > MAX_FAILURES:
        last = ranks[MAX_FAILURES]
        rest = len(ranks) - MAX_FAILURES
        out[str(last)] = {**failures[last], "message": f"(and {rest - 1} more ranks) " + str(failures[last].get("message", ""))}
    return out


OUT_OF_STEP = "the ranks' collectives are out of step (one rank skipped or repeated a call)"


def _out_of_step(phase: str, gathered: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The ranks whose ``decide`` or ``run`` is in another phase than the coordinator's (``phase``), each
    as the failure it is reported as (RankFailure: not an error a rank raised itself, so the
    ranks, out of step, are not taken to be past a phase they agree on)."""
    out = {}
    for r, res in enumerate(gathered):
        theirs = res.get("phase")
        if theirs != phase:
            message = f"rank {r} is in phase {theirs!r} while rank 0 is in {phase!r}: {OUT_OF_STEP}"
            out[r] = {"type": RankFailure.__name__, "portable": None, "message": message, "traceback": ""}
    return out


def _framed(data: bytes, size: int) -> torch.Tensor:
    """``data``'s first ``size`` bytes after an 8-byte length, in a uint8 tensor of 8 + size."""
    buf = torch.zeros(8 + size, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    part = data[:size]
    if part:
        buf[8 : 8 + len(part)] = torch.frombuffer(bytearray(part), dtype=torch.uint8)
    return buf


def _frame_len(buf: torch.Tensor) -> int:
    return int(buf[:8].view(torch.int64).item())


def _count(sent: int, received: int) -> None:
    STATS["rounds"] += 1
    STATS["sent"] += sent
    STATS["received"] += received


def _gather_slots(data: bytes, group: Any, rank: int, world: int, size: int) -> list[torch.Tensor] | None:
    """One gather of ``data``'s first ``size`` bytes (framed) from every rank to rank 0, into
    the rows of one buffer there (decoded with numpy: a torch slice per rank cost ~20 us)."""
    buf = _framed(data, size)
    outs = list(torch.empty((world, len(buf)), dtype=torch.uint8).unbind(0)) if rank == 0 else None
    dist.gather(buf, outs, dst=0, group=group)
    _count(len(buf) if rank else 0, len(buf) * (world - 1) if rank == 0 else 0)
    return outs


def _decoded(outs: list[torch.Tensor], rest: list[torch.Tensor] | None) -> list[dict[str, Any]]:
    """Every rank's JSON value from the gathered slots (and the rest of the longer ones)."""
    rows = outs[0]._base.numpy() if outs[0]._base is not None else torch.stack(outs).numpy()
    more = None
    if rest is not None:
        more = rest[0]._base.numpy() if rest[0]._base is not None else torch.stack(rest).numpy()
    out = []
    for r in range(len(outs)):
        row = rows[r]
        n = int.from_bytes(row[:8].tobytes(), "little")
        raw = row[8 : 8 + min(n, SLOT)].tobytes()
        if n > SLOT:
            assert more is not None
            raw += more[r][8 : 8 + n - SLOT].tobytes()
        out.append(json.loads(raw))
    return out


def _broadcast_json(decision: dict[str, Any] | None, group: Any, rank: int) -> dict[str, Any]:
    """Rank 0's ``decision`` on every rank: one broadcast of SLOT bytes, and a second one for
    the rest of a longer decision."""
    data = json.dumps(decision, separators=(",", ":")).encode() if rank == 0 else b""
    buf = _framed(data, SLOT)
    dist.broadcast(buf, src=0, group=group)
    n = _frame_len(buf)
    _count(len(buf) if rank == 0 else 0, len(buf) if rank else 0)
    raw = bytes(buf[8 : 8 + min(n, SLOT)].numpy()) if rank else data
    if n > SLOT:
        rest = torch.zeros(n - SLOT, dtype=torch.uint8)
        if rank == 0:
            rest[:] = torch.frombuffer(bytearray(data[SLOT:]), dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=group)
        _count(len(rest) if rank == 0 else 0, len(rest) if rank else 0)
        if rank:
            raw += bytes(rest.numpy())
    return json.loads(raw.decode())


def _store_address() -> str:
    try:
        store = _store()
        inner = getattr(store, "underlying_store", store)
        while hasattr(inner, "underlying_store"):
            inner = inner.underlying_store
        return f" at {inner.host}:{inner.port}"
    except Exception:
        return ""


def send_recv(coord: Coordinator, sends: list[tuple[int, int, torch.Tensor]],
              recvs: list[tuple[int, int, torch.Tensor]]) -> None:
    """Point-to-point transfers on ``coord``'s dedicated gloo group (the node-local tier's
    replicas and peer reads): ``sends`` are (destination rank, tag, uint8 tensor), ``recvs``
    (source rank, tag, preallocated uint8 tensor). Every rank calls it with its own lists, the
    pairs matching; bounded by the group's timeout (a dead peer raises at once, an absent one
    after the timeout), so the caller runs it inside a ``decide`` phase whose exchange turns a
    failure into the same error on every rank."""
    state = coord._state
    if state is None or state.group is None or not (sends or recvs):
        return
    works = [dist.isend(t, dst, group=state.group, tag=tag) for dst, tag, t in sends]
    works += [dist.irecv(t, src, group=state.group, tag=tag) for src, tag, t in recvs]
    for w in works:
        w.wait()
