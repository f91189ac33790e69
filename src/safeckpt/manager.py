"""CheckpointManager: the one object a training loop holds.

One directory per step (``step-0000001200``, or the ``dirname`` pattern's name) under ``root``. Collective methods (every rank
calls them at the same point): ``save``, ``restore``, ``wait``, ``close``, ``preempted``.
Read-only methods (any process, no lock, no process group): ``list``, ``latest``.

Every decision taken from the filesystem (which step is newest, what retention deletes, which
leftovers to sweep) is taken on the coordinator and shared, never by each rank on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple

from .coord.dist import Coordinator, resolve_timeout
from .coord.lease import DEFAULT_LEASE, writer_lease
from .coord.preempt import PreemptionWatcher
from .engine import pick as picking
from .engine.background import AsyncSaver
from .engine.extra import WriteFiles
from .engine.frozen import check_frozen_mode
from .engine.gc_pause import paused_gc
from .engine.load import load
from .engine.local_tier import (
    RECORD_MAX,
    ROOT_QUARANTINE,
    RUN_FILE,
    NodeDir,
    NodeTierStorage,
    hidden_by,
    new_run_id,
    quarantine_entries,
    quarantine_mark,
    read_record,
    read_run,
    replica_shortfall,
    run_record,
    save_signature,
    step_files,
    tier_tag,
    tier_url,
)
from .engine.request import CommitHooks, NamedLayout, SaveRequest
from .engine.save import new_job
from .engine.staging import SnapshotPool
from .engine.tier import (
    drain,
    drain_from_tier,
    holders_of,
    refuse_non_finite,
    restore_local,
    save_local,
)
from .engine.tier import inventory as tier_inventory
from .errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    RankFailure,
    RankMismatch,
    SafeckptWarning,
    StorageError,
    StorageUnavailable,
)
from .format.manifest import MANIFEST, CheckpointInfo
from .format.step_names import step_from_name
from .retention import RetentionPolicy
from .storage.base import join, resolve, storage_for
from .storage.catalog import (
    DEFAULT_DIRNAME,
    committed,
    dirname_of,
    remove_entry,
    scan,
    sweep,
)
from .storage.posix import PosixStorage, remove_tree

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class CheckpointManager:
    """Save, restore, retain and list checkpoints of one training job under ``root``.

    Args:
        root: local or shared-filesystem directory, or an fsspec URL (``s3://bucket/prefix``;
            needs the ``remote`` extra and the scheme's filesystem package).
        keep_last: keep the newest N checkpoints (None keeps all).
        keep_best: also keep the N best checkpoints by ``best_metric``.
        best_metric: the name of a metric passed to save() (``metrics={...}``) that ranks them.
        best_mode: ``"min"`` (lower is better) or ``"max"``.
        keep_every: also keep every checkpoint whose step is divisible by this.
        async_save: save() returns once the state is copied aside; writing and committing
            happen in the background (see ``wait``).
        timeout: seconds any rank waits for the others (default 600 or $SAFECKPT_TIMEOUT).
        preemption_signals: signals that set ``preempted`` (default SIGTERM, SIGUSR1); () to
            leave signal handling alone.
        lease: seconds after its last heartbeat that a crashed writer's lock expires.
        storage_options: for a URL root, the fsspec filesystem's options (endpoint,
            credentials, ...; see docs/how-to/object-stores.md); ignored for local roots.
        retention: an object with ``delete(checkpoints, protect) -> steps`` (as
            :meth:`RetentionPolicy.delete`) used instead of the keep_* arguments, e.g. to apply
            a framework's own rotation rule; ``protect`` holds the step just saved and the
            restored one, and it may decide to delete the restored one.
        frozen: ``"fingerprint"`` (default): frozen parameters (``requires_grad=False``) of
            modules in the state are saved as fingerprints (xxh3 checksum, shape, dtype) and
            verified on restore; ``"full"``: saved like the rest (see ``safeckpt.engine.frozen``).
        dirname: the name pattern of the directories this manager commits, with one ``{step}``
            field: ``"step-{step:010d}"`` (default), ``"checkpoint-{step}"`` (Trainer's),
            ``"checkpoint_{step}"`` (Accelerate's) or another. Restore, retention and the sweep
            take every committed checkpoint under ``root`` with a known name (these three and
            this pattern), so a run that changes the pattern still resumes from the old ones.
        local_dir: node-local storage (a RAM disk or NVMe; may be a different path on every
            node) for the fast-recovery tier: every save() writes each rank's file there (and
            ``replicas`` copies on other nodes) in the background, and commits under ``root``
            only every ``durable_every``-th step, on preemption and at close; restore() takes
            the newest step complete across the nodes' copies and root, each file from the
            nearest verified copy (see docs/concepts/fast-recovery.md). A rank's node is
            torchrun's ``GROUP_RANK``, else the host name. After a failure,
            ``close(drain=False)`` closes without that last drain (the step stays local).
        durable_every: with ``local_dir``: commit under root every this many steps (by step
            number: a multiple of it, or the first save at or past the next multiple after the
            last step root holds, so that saves at 9, 19, 29 drain too; None: only on
            preemption and at close).
        replicas: with ``local_dir``: copies of each rank's file on other nodes.
        check_finite: refuse to commit (on any tier) a step whose floating tensors hold NaN or
            Inf; the error names them. True checks every tensor; a collection of state entry
            names checks only the tensors under those entries (and named files'), for states
            whose bookkeeping legitimately holds Inf (Lightning's ``ModelCheckpoint`` keeps
            ``kth_value = inf``).
        keep_local: with ``local_dir``: the newest steps each node keeps (never the newest).
        local_max_bytes: with ``local_dir``: a byte budget for a node's copies of this run;
            past it the oldest local steps go first.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int | None = 3,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_every: int | None = None,
        async_save: bool = False,
        timeout: float | None = None,
        *,
        preemption_signals: Iterable[int] = DEFAULT_SIGNALS,
        lease: float = DEFAULT_LEASE,
        storage_options: Mapping[str, Any] | None = None,
        retention: Any = None,
        frozen: str = "fingerprint",
        dirname: str | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        durable_every: int | None = 10,
        replicas: int = 0,
        check_finite: bool | Iterable[str] = False,
        keep_local: int | None = 2,
        local_max_bytes: int | None = None,
    ) -> None:
        self.root = resolve(root)
        self.dirname = dirname_of(dirname)
        self._dirnames = () if self.dirname == DEFAULT_DIRNAME else (self.dirname,)
        self.policy = retention if retention is not None else RetentionPolicy(
            keep_last, keep_best, best_metric, best_mode, keep_every)
        self.frozen = check_frozen_mode(frozen)
        self.timeout = resolve_timeout(timeout)
        # fsspec and the scheme's package are installed, or a clear error now
        self._options = dict(storage_options) if storage_options is not None else None
        self._store = storage_for(self.root, self._options, timeout=self.timeout)
        self.async_save = bool(async_save)
        self._saver = AsyncSaver() if async_save else None
        self._pool = SnapshotPool()
        self._lock = writer_lease(self.root, lease=lease, store=self._store)
        self._watcher = PreemptionWatcher(preemption_signals) if preemption_signals else None
        self._preempted = False
        self._restored: int | None = None
        self._restored_at: tuple[Any, str] | None = None  # (storage, path) of the restored copy
        self._closed = False
        # Dropped without close() (a trainer or accelerator garbage collected): release the
        # lease and the signal handlers all the same, so a new manager on this root can write.
        self._finalizer = weakref.finalize(self, _abandon, self._lock, self._watcher)
        self.check_finite: bool | frozenset[str] = (
            bool(check_finite) if isinstance(check_finite, bool) or check_finite is None
            else frozenset(str(e) for e in check_finite))
        self._tier: NodeDir | None = None
        if local_dir is not None:
            if durable_every is not None and (not isinstance(durable_every, int) or durable_every < 1):
                raise ValueError(f"durable_every must be a positive int or None, got {durable_every!r}")
            if not isinstance(replicas, int) or replicas < 0:
                raise ValueError(f"replicas must be a non-negative int, got {replicas!r}")
            self._tier = NodeDir(os.fspath(local_dir), self.root)
            self._saver = self._saver or AsyncSaver()
        self.durable_every = durable_every
        self.replicas = int(replicas)
        self.keep_local = keep_local
        self.local_max_bytes = local_max_bytes
        # the newest step whose background save succeeded: its job, and whether root has it
        self._last: dict[str, Any] | None = None
        self._last_local: dict[str, Any] | None = None  # the same, published on the local tier
        self._staged: Any = None  # the job whose bytes the host buffers hold
        self._abandon_after: int | None = None  # restored step: the next save drops newer local steps
        self._last_durable: int | None = None  # the newest step root holds (durable_every's schedule)
        self._marks: dict[str, Any] = {}  # root's quarantine marks (quarantine_entries), as the last pick read them
        self._placement_checked = False  # replicas vs the job's nodes: said once (first tier save)
        self._speculate = False  # the next async save may agree in the background (SaveJob.agree)
        self._heal_pending = False  # a restore's heal is the background job (restored_path waits for it)
        self._tier_nodes: list[str] | None = None  # every rank's node, from the run agreement
        self._run_pending: str | None = None  # a run id agreed without root: written at the first drain

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, policy={self.policy}, async_save={self.async_save})"

    # ----------------------------------------------------------- read-only
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints under root, oldest first (reads manifests; no lock)."""
        return [e.info for e in committed(self.root, self._store, self._dirnames) if e.info is not None]

    def latest(self) -> CheckpointInfo | None:
        found = self.list()
        return found[-1] if found else None

    # ----------------------------------------------------------- collective
    def _coord(self, purpose: str = "main", what: str = "checkpoint") -> Coordinator:
        return Coordinator(self.timeout, purpose=purpose, what=what)

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                strict: bool = True) -> int | None:
        """Load the newest committed checkpoint that loads cleanly (or ``step``) into ``state``.

        Returns its step, or None when the root holds no checkpoint (a fresh run). A checkpoint
        that fails verification is skipped with a warning naming the reason, on every rank
        together; if every one fails, CorruptCheckpoint is raised rather than starting fresh.
        Older checkpoints are verified only if the newer ones fail (see ``engine.pick``).
        """
        self._check_open()
        self.wait()
        if self._tier is not None:
            return self._restore_tiered(state, step, strict)
        return self._restore_root(state, step, strict)

    def _restore_root(self, state: MutableMapping[str, Any], step: int | None, strict: bool,
                      skip: set[int] | frozenset[int] = frozenset()) -> int | None:
        coord = self._coord(what=f"restore from {self.root}")
        picked = self._agreed_pick(coord, step)
        # Damaged history counts: if nothing loads, raise rather than report a fresh run.
        reasons = list(picked.get("damaged", []))
        if step is not None and not picked["candidates"] and not reasons:
            raise CheckpointNotFound(f"no committed checkpoint for step {step} under {self.root}", path=self.root)
        for cand_step, path in _Candidates(self, coord, picked, reasons):
            if cand_step in skip:  # quarantined
                continue
            try:  # frozen parameters saved as fingerprints are verified inside the load
                load(path, state, strict=strict, timeout=self.timeout, storage_options=self._options)
            except (CorruptCheckpoint, CheckpointNotFound) as exc:
                # A reason of the checkpoint (damaged, or deleted under us): the state is
                # unchanged (loads check everything before touching it), so try an older one.
                # IncompatibleCheckpoint is the caller's state not fitting: no fallback.
                reasons.append(f"step {cand_step}: {exc}")
                warnings.warn(
                    f"checkpoint step {cand_step} at {path} is corrupt, falling back to an older "
                    f"one: {exc}", SafeckptWarning, stacklevel=2,
                )
                continue
            self._restored = cand_step
            self._restored_at = (self._store, path)
            return cand_step
        if reasons:
            raise CorruptCheckpoint(
                f"no checkpoint under {self.root} could be loaded (refusing to start fresh when "
                "history exists):\n  " + "\n  ".join(reasons), path=self.root,
            )
        return None

    def _agreed_pick(self, coord: Coordinator, step: int | None) -> dict[str, Any]:
        """One exchange: the same root and step on every rank, then the coordinator's pick for
        all (``engine.pick.first_valid``: the newest checkpoint past the cheap checks, and the
        older ones not yet judged); warnings shown here."""
        def pick(asked: list[dict[str, Any]]) -> dict[str, Any] | None:
            for field, what in (("root", "roots"), ("step", "steps")):
                bad = [r for r, a in enumerate(asked) if a[field] != asked[0][field]]
                if bad:
                    # Rank 0 picks for everyone: a rank with another root would load rank 0's choice.
                    raise RankMismatch(
                        f"restore: ranks asked for different {what}, nothing was loaded: rank 0: "
                        f"{asked[0][field]!r}, " + ", ".join(f"rank {r}: {asked[r][field]!r}" for r in bad[:20])
                        + ". Every rank must create its CheckpointManager with the same root and call "
                        "restore with the same step."
                    )
            return self._pick(step, True)

        picked = coord.decide("pick", lambda: {"root": self.root, "step": step}, pick)
        for note in picked["warnings"]:
            warnings.warn(note, SafeckptWarning, stacklevel=3)
        return picked

    def resume_candidates(self, step: int | None = None) -> tuple[Iterable[tuple[int, str]], list[str]]:
        """The checkpoints :meth:`restore` would try, newest first, and why others were skipped
        (collective; the same answer on every rank). For callers whose load runs inside a
        framework's own flow (the Hugging Face Trainer): they load a candidate with one
        collective load, take the next one if it raises CorruptCheckpoint (a load checks every
        byte it reads and changes nothing on failure), and call :meth:`mark_restored`.

        The candidates come one at a time (iterate them once, on every rank together): the
        first was verified here, each older one is verified (collectively) only when the
        iteration reaches it, and the reasons of those that fail are appended to the list
        returned. The iterable is true when there is a first candidate."""
        self._check_open()
        self.wait()
        coord = self._coord(what=f"restore from {self.root}")
        picked = self._agreed_pick(coord, step)
        reasons = list(picked.get("damaged", []))
        return _Candidates(self, coord, picked, reasons), reasons

    @property
    def restored_path(self) -> str | None:
        """The checkpoint the last :meth:`restore` loaded, as a location for ``safeckpt.load``,
        ``safeckpt.read_state_dict`` or :func:`safeckpt.engine.reader.open_manifest` (the same
        string on every rank): root's checkpoint, or, restored from the local tier, a
        ``safeckpt-tier://`` location that each process reads from its own node's complete,
        verified copy of the step (valid in this process). Frameworks that load in two steps
        (the model now, the optimizers after setup) load the second from here. None before a
        restore, or when it found nothing. Waits for the node's heal after a restore from the
        local tier (a node that lost the step writes what it fetched after the restore returns)."""
        if self._heal_pending:
            self.wait()  # the heal never raises
        return self._restored_at[1] if self._restored_at is not None else None

    def restored_files(self) -> dict[str, bytes]:
        """The extra files (``save(..., extra_files=...)``) of the step the last :meth:`restore`
        loaded, name -> bytes, from this rank's copy (see :attr:`restored_path`: on every node
        after a restore from the local tier), each checked against the manifest's size and
        xxh3-128 (:class:`CorruptCheckpoint` otherwise). Not collective. ``{}`` when the step
        has none, or nothing was restored."""
        if self._restored_at is None:
            return {}
        import xxhash

        if self._heal_pending:
            self.wait()  # the node's heal after a restore from the local tier (never raises)
        store, path = self._restored_at
        man = store.read_manifest(path)
        out: dict[str, bytes] = {}
        for name, rec in sorted((man.get("extra") or {}).items()):
            data = store.read(store.join(path, name), int(rec["size"]) + 1)
            if data is None or len(data) != rec["size"] or xxhash.xxh3_128_hexdigest(data) != rec["xxh3_128"]:
                raise CorruptCheckpoint(f"{path}: the extra file {name} does not match its manifest record",
                                        path=path)
            out[name] = data
        return out

    def mark_restored(self, step: int) -> None:
        """``step`` was restored (by a caller of :meth:`resume_candidates`): retention keeps it."""
        self._restored = step

    def _pick(self, step: int | None, is_coordinator: bool,
              rest: list[list[Any]] | None = None) -> dict[str, Any] | None:
        """Coordinator: the newest checkpoint that verifies (``engine.pick.first_valid``), or,
        given ``rest`` (the ones a previous pick left unjudged), the next one among them."""
        if not is_coordinator:
            return None
        if rest is None:
            # The marks are read only when the pick's own listing of the root shows them.
            seen = _RootListing(self._store, self.root)
            got = picking.first_valid(seen, self.root, self._dirnames, step)
            self._marks = self._root_quarantine_entries() if ROOT_QUARANTINE in seen.names else {}
        else:
            got = picking.judge(self._store, rest)
        marks = self._marks
        while marks and got["candidates"]:
            cand, path = got["candidates"][0]
            why = hidden_by(marks, cand, self._root_sig(path)) if str(cand) in marks else None
            if why is None:  # not marked, or a later save of that step number than the one marked
                break
            more = picking.judge(self._store, got["rest"]) if got["rest"] else \
                {"candidates": [], "rest": [], "warnings": [], "damaged": []}
            got = {**more, "warnings": got["warnings"] + [f"skipping step {cand}: quarantined ({why})"]
                   + more["warnings"], "damaged": got["damaged"] + more["damaged"]}
        return got

    def _root_sig(self, path: str) -> str | None:
        """The save signature of root's checkpoint ``path`` (None when its manifest is unreadable:
        a quarantine mark then hides it, whatever save it names)."""
        try:
            return save_signature(self._store.read_manifest(path))
        except Exception:  # noqa: BLE001 - unknown: treated as the save marked
            return None

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        metrics: Mapping[str, Any] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        extra_files: Mapping[str, bytes] | None = None,
        write_files: WriteFiles | None = None,
        named: NamedLayout | None = None,
        name: str | None = None,
    ) -> CheckpointInfo | None:
        """Save ``state`` as ``step`` (collective). Returns its info, or None with async_save
        (the save then commits in the background; ``wait()`` returns its info).

        ``extra_files`` (name -> bytes; plain file names, not ``manifest.json`` nor ``rank-*``):
        files committed inside the checkpoint directory with it (a framework's own JSON, such
        as Trainer's ``trainer_state.json``), listed in the manifest with their checksum and
        checked by verify. The coordinator's (rank 0's) mapping is the one written.

        ``write_files(staging_dir) -> [relative paths]`` (every rank; synchronous saves on a
        filesystem only): files each rank writes itself into the checkpoint during the save,
        such as a DeepSpeed engine's own checkpoint; each rank reports (and hashes) the paths it
        returns, they are listed in the manifest and published with the same atomic rename, so a
        rank killed while writing them leaves nothing visible (see ``safeckpt.engine.extra``).

        ``named`` (a :class:`~safeckpt.engine.request.NamedLayout`; filesystem roots): some
        tensors laid out as safetensors files under the caller's names inside the checkpoint
        (Hugging Face's ``model.safetensors``), written once, committed with the rest.

        ``name``: the checkpoint's directory name under root for this step, instead of the
        ``dirname`` pattern's, for frameworks that name checkpoints themselves (Lightning's
        ``epoch=E-step=S.ckpt``). A name that holds a step (see :mod:`safeckpt.format.step_names`)
        must hold this one; restore and retention find a checkpoint by the step in its name, so
        one named without a step (``last.ckpt``) is left to the framework that named it."""
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if name is not None and (not isinstance(name, str) or not name or "/" in name or name.startswith(".")
                                 or step_from_name(name) not in (None, step)):
            raise ValueError(f"name {name!r}: not a plain directory name, or it holds another step than {step} "
                             "(safeckpt.format.step_names)")
        self.wait()  # one save in flight; raises the previous background save's error (and clears _speculate)
        # Agree speculatively (SaveJob.agree) only after a save that went through on every rank:
        # read after wait() (the previous save's background sets it), and off until this save's
        # background succeeds, so a failure anywhere (raised here, or by this save on one rank)
        # makes the next save agree in the blocking part, on every rank.
        speculate, self._speculate = self._speculate, False
        if write_files is not None and self._saver is not None:
            raise CheckpointError(
                "write_files needs a synchronous save to a filesystem: the files are written inside "
                "the save by every rank and published by its rename (not with async_save, not on "
                "an object store)")
        if self._tier is not None:
            if write_files is not None:  # (refused above: the tier saves in the background)
                raise CheckpointError("write_files is not supported with local_dir")
            if named is not None and not self._store.renames:
                raise CheckpointError(
                    "named files (model.safetensors) need a filesystem root: they keep their names "
                    "inside the checkpoint, published by its rename (not on an object store)")
            return self._save_tiered(step, state, metrics, metadata, extra_files or {}, named, name, speculate)
        path = join(self.root, name or self.dirname.format(step))
        request = SaveRequest(target=path, state=state, metadata=metadata, overwrite=True, step=step,
                              metrics=metrics, extra_files=extra_files or {}, write_files=write_files,
                              frozen=self.frozen, named=named)
        # Folded into the save's own two exchanges (the coordinator runs them): the lease and the
        # sweep before staging, retention after publishing.
        hooks = CommitHooks(before_stage=lambda: self._begin(True),
                            after_commit=lambda saved: self._retain(True, saved),
                            after_commit_hint=f"The checkpoint {path} is committed; only retention failed.")
        coord = self._coord(what=f"save of step {step} to {path}")
        job = new_job(coord, request, store=self._store, hooks=hooks)
        if self._saver is None:
            with paused_gc():  # the caller waits for all of it (see SaveJob.run)
                job.agree()
                if self.check_finite:
                    refuse_non_finite(coord, job, step, self.check_finite)
                return job.finish()
        with paused_gc():  # one pause for all the blocking part: a collection in between cost ~2 ms
            job.agree(speculate=speculate)
            job.snapshot(self._pool)
            if self.check_finite:  # on the staged bytes
                refuse_non_finite(coord, job, step, self.check_finite)
        # The background thread agrees on a gloo group of its own, one per root (the same name
        # on every rank, whatever other managers a rank made): two async managers in one process
        # (full state + best model) must not share one, or their threads interleave collectives.
        background = self._coord(f"async:{self.root}", what=f"background save of step {step} to {path}")
        self._submit_save(job, lambda: job.finish(background), f"step {step}")
        return None

    def _submit_save(self, job: Any, run: Callable[[], Any], label: str) -> None:
        """``run`` (the rest of ``job``'s save) on the background worker; once all of it went
        through, the next save may agree speculatively (``SaveJob.agree``; a failure raises
        before this, and wait() then clears the flag)."""
        assert self._saver is not None

        def run_then_allow() -> Any:
            result = run()
            self._speculate = job.speculable
            return result

        self._saver.submit(run_then_allow, label)


    # ----------------------------------------------------------- node-local tier
    def _save_tiered(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None,
                     metadata: Mapping[str, Any] | None, extra_files: Mapping[str, bytes],
                     named: NamedLayout | None, name: str | None, speculate: bool = False) -> None:
        """Agree and copy aside here (the only part that blocks), then in the background: the
        local tier's phases and, on a durable step, the drain to root (``engine.tier``). The
        one request (extra files and named layout included) serves both: a node's step is the
        checkpoint a save without the tier writes, split over the nodes, and the drain commits
        that checkpoint under root from the same staged bytes."""
        tier = self._tier
        assert tier is not None and self._saver is not None
        # Durable by step number, or because a rank was preempted: that flag is agreed in the
        # background's first exchange (an all-reduce here cost a collective in the blocking part).
        by_step = self._durable_by_step(step) or self._preempted
        if by_step:  # a drain attempted: the schedule goes on from here, whether root took it or not
            self._last_durable = step
        signalled = bool(self._watcher and self._watcher.flag)
        coord = self._coord(what=f"local save of step {step}")
        self._tier_run(coord)  # first: it agrees on tier.key, the URL's name of this node directory
        self._check_placement(coord)
        request = SaveRequest(target=tier_url(tier.key, step), state=state, metadata=metadata, overwrite=True,
                              step=step, metrics=metrics, frozen=self.frozen, extra_files=extra_files,
                              named=named)
        job = new_job(coord, request, store=NodeTierStorage(self.timeout))
        with paused_gc():
            job.agree(speculate=speculate)
            job.snapshot(self._pool)
        # The step close() drains is the newest one whose background save succeeded (never one
        # that check_finite refused or whose save failed): set by run() below, not here.
        last = {"job": job, "step": step, "durable": False, "name": name, "local": False}
        self._staged = job  # the job whose staged bytes the host buffers hold now
        background = self._coord(f"async:{self.root}", what=f"background local save of step {step}")
        protect = {s for s in (self._restored,) if s is not None}
        abandon = self._abandon_after

        def run() -> _TierResult:
            done = save_local(background, job, tier, step, replicas=self.replicas, check_finite=self.check_finite,
                              keep_local=self.keep_local, max_bytes=self.local_max_bytes, protect=protect,
                              signalled=signalled, abandon_after=abandon)
            self._abandon_after = None
            last["local"] = not done.get("skipped")
            self._last = last
            if last["local"]:
                self._last_local = last
            if not (by_step or done["preempted"]):
                return _TierResult(None, done["warnings"])
            try:
                info = self._drain(background, job, step, name)
            except CheckpointError as exc:  # root unreachable: the step is safe on the local tier
                if done.get("skipped") or not _storage_failure(exc):
                    raise
                return _TierResult(None, [*done["warnings"], f"step {step} was not committed under {self.root} "
                                          f"({exc}); it is on the node-local tier, and the next durable "
                                          "step (or close) tries root again"])
            last["durable"] = True
            return _TierResult(info, done["warnings"])

        self._submit_save(job, run, f"step {step}")
        return None

    def _check_placement(self, coord: Coordinator) -> None:
        """First tier save with ``replicas``: one exchange of the ranks' nodes; when fewer
        replicas than asked can be placed (one node: none), the same warning on every rank."""
        if self._placement_checked or not self.replicas or self._tier is None:
            return
        if self._tier_nodes is not None:  # known from the run agreement: no exchange
            note = replica_shortfall(self._tier_nodes, self.replicas)
        else:
            node = self._tier.node
            note = coord.decide("tier-placement", lambda: node,
                                lambda nodes: replica_shortfall(nodes, self.replicas))
        self._placement_checked = True
        if note:
            warnings.warn(note, SafeckptWarning, stacklevel=4)

    def _durable_by_step(self, step: int) -> bool:
        """``durable_every``: a multiple of it, or the first save at or past the next multiple
        after the last step root holds (a schedule saving at 9, 19, 29 drains 19, 29, ...):
        ``step // d > last // d``, with ``last`` the last step this manager drained (or tried
        to: a drain root refused is tried again at the next durable step), else the newest step
        root held at or before the restored step (the restored step when root held none, or
        could not be listed), else 0."""
        d = self.durable_every
        if d is None:
            return False
        last = self._last_durable if self._last_durable is not None else 0
        return step % d == 0 or step // d > last // d

    def _drain(self, coord: Coordinator, job: Any, step: int, name: str | None) -> CheckpointInfo:
        path = join(self.root, name or self.dirname.format(step))
        return drain(coord, job, self._store, path, lambda: self._begin(True),
                     lambda saved: self._retain(True, saved), step)

    def _drain_last(self) -> None:
        """At close: the newest step whose save succeeded to root, if root lacks it: from its
        staged bytes while the host buffers still hold them, else (a later save, e.g. one that
        ``check_finite`` refused, reused the buffers) from the nodes' copies of it."""
        last = self._last
        if self._tier is None or last is None:
            return
        if last["job"] is not self._staged:  # the buffers hold a later (failed) save's bytes
            last = self._last_local
            if last is None:
                return
        if last["durable"]:
            return
        coord = self._coord(what=f"drain of step {last['step']} to {self.root}")
        try:
            if last["job"] is self._staged:
                self._drain(coord, last["job"], last["step"], last["name"])
            else:
                path = join(self.root, last["name"] or self.dirname.format(last["step"]))
                drain_from_tier(coord, self._tier, self._store, path, last["step"], lambda: self._begin(True),
                                lambda saved: self._retain(True, saved))
        except CheckpointError as exc:
            if not _storage_failure(exc):
                raise
            raise StorageUnavailable(
                f"close: step {last['step']} was not committed under {self.root} (the storage failed: "
                f"{exc}); it is on the node-local tier, which a restore uses") from exc
        last["durable"] = True
        self._last_durable = last["step"]

    def _root_side(self, held: set[int] | None = None) -> dict[str, Any]:
        """Coordinator: root's committed steps and quarantine marks, and its damaged ones
        (history: a restore that finds nothing else raises rather than starting fresh); an
        unreachable root is a warning: the local tier still restores."""
        try:
            found = scan(self.root, store=self._store, leftovers=False, dirnames=self._dirnames)
            entries = [e for e in found if e.status == "committed" and e.step is not None]
            damaged = [[e.step, f"step {e.step} (root): {e.path}: {e.problem}"] for e in found
                       if e.status == "corrupt" and e.step is not None]
            paths = {str(e.step): e.path for e in sorted(entries, key=lambda e: e.path)}
            marks = self._root_quarantine_entries()
            sigs = {}
            for s, path in paths.items():  # root's save of a step the nodes hold too or a marked
                if int(s) in (held or ()) or s in marks:  # one: which save it is
                    with contextlib.suppress(Exception):
                        sigs[s] = save_signature(self._store.read_manifest(path))
            return {"steps": sorted({e.step for e in entries}), "paths": paths, "sigs": sigs,
                    "quarantine": marks,
                    "damaged": damaged, "warnings": [f"ignoring {why[len(f'step {s} (root): '):]}: corrupt"
                                                     for s, why in damaged]}
        except Exception as exc:  # noqa: BLE001 - root is one tier among several
            return {"steps": [], "warnings": [f"root {self.root} could not be listed ({type(exc).__name__}: "
                                              f"{exc}); restoring from the node-local tier only"]}

    def _root_quarantine(self) -> dict[str, str]:
        """Root's quarantine marks, step -> reason (see :meth:`_root_quarantine_entries`)."""
        return {k: v["reason"] for k, v in self._root_quarantine_entries().items()}

    def _root_quarantine_entries(self) -> dict[str, dict[str, Any]]:
        """Root's quarantine marks with the saves they name (``local_tier.quarantine_entries``);
        a damaged record (not JSON, too large or deep, not a regular file: read as the tier
        reads its records) holds none."""
        path = join(self.root, ROOT_QUARANTINE)
        if isinstance(self._store, PosixStorage):  # never blocking on a FIFO, never through a symlink
            return quarantine_entries(read_record(path))
        raw = self._store.read(path, RECORD_MAX + 1)
        if not raw or len(raw) > RECORD_MAX:
            return {}
        try:
            return quarantine_entries(json.loads(raw))
        except (ValueError, RecursionError):
            return {}

    def _root_file(self, path: str) -> Any:
        """Dest rank: the bytes of the file of root's checkpoint ``path`` whose checksum is ``xxh``."""

        def read(xxh: str) -> bytes | None:
            man = self._store.read_manifest(path)
            for name, rec in step_files(man).items():
                if rec.get("xxh3_128") == xxh:
                    return self._store.read(self._store.join(path, name), int(rec["size"]) + 1)
            return None

        return read

    def _restore_tiered(self, state: MutableMapping[str, Any], step: int | None, strict: bool) -> int | None:
        tier = self._tier
        assert tier is not None
        coord = self._coord(what=f"restore from the node-local tier of {self.root}")
        self._tier_run(coord)
        plan = tier_inventory(coord, tier, self._root_side)
        self._last_durable = None
        for note in plan["warnings"]:
            warnings.warn(note, SafeckptWarning, stacklevel=3)
        quarantined = set(plan["root_hidden"])  # root's saves the marks name
        # root's damaged checkpoints are history: nothing restored -> raise, never a fresh start
        reasons: list[str] = [why for s, why in plan.get("root_damaged", []) if step is None or s == step]
        for cand in plan["cands"]:
            if step is not None and cand != step:
                continue
            mhash, _, _ = holders_of(plan, cand)
            if mhash is None:  # only root has it: the ordinary restore from there
                try:
                    got = self._restore_root(state, cand, strict, skip=quarantined)
                except (CorruptCheckpoint, CheckpointNotFound) as exc:
                    reasons.append(f"step {cand} (root): {exc}")
                    continue
                if str(cand) in plan["inv"].get(tier.node, {}):  # another save than root's: stale
                    with contextlib.suppress(OSError):
                        remove_tree(tier.step_dir(cand))
                self._abandon_after = got
                self._last_durable = got
                return got
            root_file = self._root_file(plan["root_paths"][str(cand)]) if cand in plan["root"] else None
            got = restore_local(coord, tier, plan, cand, state, strict=strict, timeout=self.timeout,
                                root_file=root_file, reasons=reasons, keep_local=self.keep_local,
                                max_bytes=self.local_max_bytes, replicas=self.replicas, defer=self._heal_later)
            if got == "root":  # a node could not keep its healed copies: the step from root
                try:
                    got = self._restore_root(state, cand, strict, skip=quarantined)
                except (CorruptCheckpoint, CheckpointNotFound) as exc:
                    reasons.append(f"step {cand} (root): {exc}")
                    continue
                self._abandon_after = got
                self._last_durable = got
                return got
            if got:
                self._restored = cand
                self._restored_at = (NodeTierStorage(self.timeout), tier_url(tier.key, cand))
                self._abandon_after = cand
                self._last_durable = max((s for s in plan["root"] if s <= cand), default=cand)
                return cand
            warnings.warn(f"step {cand} could not be restored from any tier ({reasons[-1]}); trying an "
                          "older step", SafeckptWarning, stacklevel=2)
        if reasons:
            raise CorruptCheckpoint(
                f"no step of {self.root} could be restored from any tier (refusing to start fresh when "
                "history exists):\n  " + "\n  ".join(reasons), path=self.root)
        if step is not None:
            raise CheckpointNotFound(f"no copy of step {step} on any tier of {self.root}", path=self.root)
        return None

    def _heal_later(self, heal: Callable[[], list[str]]) -> None:
        """A restore's heal (the files a node of one rank loaded from memory, written to its
        disk) on the background worker: the next save, wait, restore or close joins it and
        shows its warnings; it never fails (a node that cannot keep them warns)."""
        assert self._saver is not None
        self._saver.submit(lambda: _TierResult(None, heal()), "heal of the node-local tier after the restore")
        self._heal_pending = True

    def quarantine(self, step: int, reason: str) -> None:
        """Mark ``step`` bad on every tier (collective): no restore picks it again. The marks live
        beside the checkpoints (``root/.safeckpt-quarantine.json`` and each node's local
        directory); the step's bytes are left for inspection."""
        self._check_open()
        self.wait()
        for last in (self._last, self._last_local):
            if last is not None and last["step"] == step:
                last["durable"] = True  # close() must not drain it to root
        tier = self._tier
        coord = self._coord(what=f"quarantine of step {step}")
        self._tier_run(coord)

        def held() -> str | None:  # the save of the step this node holds (its identity)
            rec = tier.step_record(int(step)) if tier is not None else None
            return rec["sig"] if rec is not None else None

        def root(sigs: list[str | None]) -> dict[str, Any]:
            # The mark names every save of the step any tier holds now: a later save of that
            # step number (after a rollback) is another save, not hidden (local_tier.hidden_by).
            found = {s for s in sigs if s is not None}
            with contextlib.suppress(Exception):  # root unreachable: the nodes' saves are named
                for e in committed(self.root, self._store, self._dirnames) if self._store.list(self.root) else ():
                    sig = self._root_sig(e.path) if e.step == step else None
                    if sig is not None:
                        found.add(sig)
            mark = {str(int(step)): quarantine_mark(str(reason), sorted(found))}
            try:
                if self._store.renames:  # a filesystem root that no save has created yet
                    os.makedirs(self.root, exist_ok=True)
                cur = self._root_quarantine_entries()
                self._store.put(join(self.root, ROOT_QUARANTINE),
                                json.dumps({**cur, **mark}, sort_keys=True).encode())
            except Exception as exc:  # noqa: BLE001 - the local marks still hide it
                if tier is None:
                    raise
                warnings.warn(f"quarantine of step {step}: root {self.root} not marked ({exc})",
                              SafeckptWarning, stacklevel=3)
            return mark

        mark = coord.decide("quarantine", held, root)
        if tier is not None:  # every rank: the same marks, written atomically
            coord.decide("quarantine-local", lambda: tier.quarantine(mark), lambda _: None)

    def _begin(self, is_coordinator: bool) -> None:
        """Coordinator: take the writer lease, sweep leftovers of crashed saves; a run id agreed
        while root was unreachable goes into root's run file (unless root has one by now)."""
        if not is_coordinator:
            return
        self._lock.acquire()
        sweep(self.root, self._store, self._dirnames)
        if self._run_pending is not None:
            with contextlib.suppress(FileExistsError):
                self._store.put(join(self.root, RUN_FILE), run_record(self._run_pending), exclusive=True)
            self._run_pending = None

    # ----------------------------------------------------------- run identity (node-local tier)
    def _tier_run(self, coord: Coordinator) -> None:
        """At this manager's first tier collective (local save, restore, quarantine): one
        exchange agrees on the run id (root's run file, created by the coordinator if absent;
        see ``engine.local_tier``) and on which nodes hold another run's data; only then, in a
        second exchange that only such a case costs, each of those nodes' first rank moves that
        data aside, before any rank of the node reads or writes its directory. So the local
        steps of an earlier run at the same root path are never restored."""
        tier = self._tier
        if tier is None or tier.run is not None:
            return
        d = coord.decide("tier-run", tier.recorded, self._agree_run,
                         hint="Nothing was saved or loaded; the state is unchanged.")
        self._tier_nodes = list(d["nodes"])
        self._run_pending = d["pending"]
        tier.rekey(d["key"])
        tier.unconfirmed = d["unconfirmed"]
        first = d["nodes"].index(tier.node) == coord.rank
        if d["fix"]:
            def fix() -> str | None:
                return tier.adopt(d["run"], d["legacy"]) if first else None

            def moved(paths: list[str | None]) -> list[str]:
                return [f"{p} ({d['nodes'][r]})" for r, p in enumerate(paths) if p]

            try:
                aside = coord.decide("tier-run-adopt", fix, moved,
                                     hint="Nothing was saved or loaded; the state is unchanged.")
            except BaseException:
                tier.run = None  # every rank agrees again at its next tier collective, together
                raise
            if aside:
                warnings.warn(
                    "local_dir holds steps of another run of this root (root was deleted or recreated); not "
                    f"used; moved to {', '.join(aside)}: delete it to free the space", SafeckptWarning,
                    stacklevel=3)
        tier.run = d["run"]
        if d["warning"]:
            warnings.warn(d["warning"], SafeckptWarning, stacklevel=3)

    def _agree_run(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Coordinator: the run id from root's run file, created exclusively (two managers racing
        agree on one) when root has none (a new root, or one deleted and made again: a new run).
        Root unreachable (its run file cannot be read or created): the id most nodes recorded,
        trusted with a warning and written to root at the first drain (``_begin``). Legacy data
        (recorded without an id) is this run's when root holds committed steps and no run file
        (a run upgrading), or root is unreachable and no node records an id."""
        nodes = [r["node"] for r in reports]
        first = {}  # node -> its first rank's report
        for r in reports:
            first.setdefault(r["node"], r)
        ids = [r["run"] for r in first.values() if r["run"]]
        legacy = any(r["mine"] and r["run"] is None and r["data"] for r in first.values())
        path = join(self.root, RUN_FILE)
        # ids agreed while root was unreachable that never reached root's run file: a run whose
        # root had never been reached, not a deleted root (see NodeDir.unconfirmed)
        unconfirmed = [r["run"] for r in first.values() if r["run"] and r.get("unconfirmed")]
        pending, note, confirmed = None, None, True
        try:
            run = read_run(self._store.read, path)
            if run is None:
                # legacy data before root has a run file: this run's if root holds its history
                legacy = legacy and bool(committed(self.root, self._store, self._dirnames))
                adopt = max(sorted(set(unconfirmed)), key=unconfirmed.count) if unconfirmed else None
                with contextlib.suppress(FileExistsError):
                    self._store.put(path, run_record(adopt or new_run_id()), exclusive=True)
                run = read_run(self._store.read, path)
                if run is None:
                    raise StorageError(f"{path} was created but cannot be read back")
            else:
                legacy = False
        except (OSError, CheckpointError) as exc:
            run = max(sorted(set(ids)), key=ids.count) if ids else new_run_id()
            legacy = legacy and not ids
            pending = run
            confirmed = bool(ids) and run not in unconfirmed
            if ids or legacy:
                note = (f"root {self.root} could not be read ({type(exc).__name__}: {exc}); the node-local tier "
                        f"is used as the run the nodes recorded ({run if ids else 'data of an older version'}) "
                        "says; if this is a new run at the same root path, delete local_dir's data of the old one")
        fix = any(r["present"] and not r["other_root"]
                  and (r["run"] != run or not r["mine"] or bool(r.get("unconfirmed")) == confirmed)
                  for r in first.values())
        # the URL key of this manager's node directory: one free on every rank (ranks may have
        # made their managers of this root in different orders)
        taken = {k for r in reports for k in r.get("taken", ())}
        tag = tier_tag(self.root)
        key, n = tag, 0
        while key in taken:
            n += 1
            key = f"{tag}~{n}"
        return {"run": run, "legacy": legacy, "nodes": nodes, "fix": fix, "pending": pending, "warning": note,
                "key": key, "unconfirmed": not confirmed}

    def _retain(self, is_coordinator: bool, saved: int | None = None) -> list[int]:
        if not is_coordinator:
            return []
        entries = committed(self.root, self._store, self._dirnames)
        # Never the restored checkpoint, nor the one just written (even if a stale checkpoint
        # with a higher step, from a run that got further, counts as "newest").
        protect = {s for s in (self._restored, saved) if s is not None}
        doomed = self.policy.delete([(e.step, e.info.metrics if e.info else {}) for e in entries], protect)
        gone = set(doomed)
        for e in entries:  # a step committed under two names (step-N and checkpoint-N): both
            if e.step in gone:
                remove_entry(e, self._store)
        return doomed

    def retain(self) -> list[int]:
        """Apply the retention policy now (collective; it also runs after every save).
        Returns the deleted steps."""
        self._check_open()
        self.wait()
        coord = self._coord(what=f"retention under {self.root}")
        return coord.decide("retain", lambda: None, lambda _: self._retain(True))

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """The storage options this manager was made with (a copy), for another writer."""
        return dict(self._options) if self._options is not None else None

    @contextlib.contextmanager
    def external_save(self, step: int, *, coordinator: bool) -> Iterator[str]:
        """Save ``step`` under this root with another writer that commits atomically itself
        (:func:`safeckpt.dcp.manager_writer` uses it for ``dcp.save``)::

            with mgr.external_save(step, coordinator=rank == 0) as path:
                my_writer.save(state, path)   # commits path (manifest.json) before returning

        Yields the step's path (``root`` / the manager's dirname) on every rank. Not collective:
        the writer's own protocol runs the ranks together; only the coordinator
        (``coordinator=True``, one rank) acts. On enter it waits for the manager's background
        save, takes the writer lease (kept until :meth:`close`, as :meth:`save` does) and sweeps
        leftovers of crashed saves. On a clean exit the step must be committed at the path
        (else :class:`CheckpointNotFound`, nothing deleted); then retention runs (never this
        step nor the restored one), and a failure of retention alone raises
        :class:`CheckpointError` saying the checkpoint is committed. On an exception nothing
        more is done: leftovers wait for the next save's sweep or ``safeckpt gc``.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self.wait()
        path = join(self.root, self.dirname.format(step))
        self._begin(bool(coordinator))
        yield path
        if not coordinator:
            return
        if self._store.size(self._store.join(path, MANIFEST)) is None:
            raise CheckpointNotFound(
                f"external_save({step}): the writer returned but nothing is committed at {path} "
                "(no manifest.json); retention did not run", path=path)
        try:
            self._retain(True, step)
        except Exception as exc:
            raise CheckpointError(f"the checkpoint {path} is committed; only retention failed: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def wait(self) -> CheckpointInfo | None:
        """Block until the pending background save is committed; raise its error if it failed."""
        if self._saver is None:
            return None
        self._heal_pending = False
        try:
            got = self._saver.wait()
        except BaseException:
            self._speculate = False  # the next save agrees in the blocking part (see save())
            raise
        if isinstance(got, _TierResult):  # the local tier's notes, shown here on the caller's thread
            for note in got.warnings:
                warnings.warn(note, SafeckptWarning, stacklevel=2)
            return got.info
        return got

    @property
    def preempted(self) -> bool:
        """True on every rank once any rank got a preemption signal (collective)."""
        if self._preempted:
            return True
        local = bool(self._watcher and self._watcher.flag)
        self._preempted = self._coord(what="preemption check").any_true(local, "preempted")
        return self._preempted

    def close(self, drain: bool = True) -> None:
        """Wait for the pending save (raising its error), release the lease and signal handlers.

        With ``local_dir``, ``close()`` first commits the newest local step under root if root
        lacks it (collective). ``close(drain=False)`` skips that drain: for a job ending after a
        failure, where a collective drain could wait on a rank that is gone; the newest step
        stays on the node-local tier, where a restart's restore finds it. Idempotent.

        The step drained is the newest one whose save succeeded: never one ``check_finite``
        refused or whose background save failed. When the pending save failed (its error
        raised here, on every rank), the newest good step is drained first (from the nodes'
        copies: the failed save reused the host buffers), then the error is raised; a drain
        that fails too is a warning then. After a rank died or timed out nothing is drained."""
        if self._closed:
            return
        try:
            try:
                self.wait()
            except CheckpointError as exc:
                # The pending save failed on every rank alike (check_finite refused it, ...): the
                # newest step that did succeed is still drained, then the save's error is raised.
                # Not after a rank died or timed out (the collective drain would wait on it).
                if drain and _agreed_failure(exc):
                    try:
                        self._drain_last()
                    except Exception as exc:  # noqa: BLE001 - the save's error stays the one raised
                        warnings.warn(f"close: the drain of the newest good step to {self.root} failed "
                                      f"too: {type(exc).__name__}: {exc}", SafeckptWarning, stacklevel=2)
                raise
            if drain:
                self._drain_last()
        finally:
            self._closed = True
            self._finalizer.detach()
            _abandon(self._lock, self._watcher)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:  # keep the original exception primary
            warnings.warn(f"while closing after an error: {close_exc}", SafeckptWarning, stacklevel=2)


def _agreed_failure(exc: BaseException) -> bool:
    """Every failing rank raised a checkpoint error of its own (check_finite's refusal, a
    storage error, ...) and reported it: every rank is alive and past the failed phase, so a
    collective (close()'s drain) can follow. False when a rank died, timed out or failed
    otherwise."""
    if not isinstance(exc, RankFailure):
        return isinstance(exc, CheckpointError)
    return _every_rank_raised(exc, CheckpointError, but=RankFailure)


def _storage_failure(exc: BaseException) -> bool:
    """The storage failed (root unreachable, refused), on whichever ranks failed: a StorageError,
    or a RankFailure whose every rank failed with one (the coordinator's own StorageError in a
    phase's decision arrives as such a RankFailure)."""
    if isinstance(exc, StorageError):
        return True
    return isinstance(exc, RankFailure) and _every_rank_raised(exc, StorageError)


def _every_rank_raised(exc: RankFailure, base: type, but: type | None = None) -> bool:
    """Every failing rank's reported error (``"TypeName: message"``) is ``base`` or a subclass
    of it other than ``but``; False when no rank reported one."""
    if not exc.failures:
        return False
    kinds, todo = set(), [base]
    while todo:
        cls = todo.pop()
        kinds.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    if but is not None:
        kinds.discard(but.__name__)
    return all(line.split(":", 1)[0] in kinds for line in exc.failures.values())


def _abandon(lock: Any, watcher: PreemptionWatcher | None) -> None:
    """Release what a manager holds (close(), or its finalizer when it is collected)."""
    try:
        lock.release()
    finally:
        if watcher:
            watcher.restore()


class _RootListing:
    """A storage that remembers the names its listing of ``root`` returned (everything else is
    the wrapped storage's), so the pick's one listing also says whether quarantine marks exist."""

    def __init__(self, store: Any, root: str) -> None:
        self._store, self._root, self.names = store, root, set()

    def list(self, path: str) -> Any:
        items = self._store.list(path)
        if path == self._root:
            self.names.update(i.name for i in items or ())
        return items

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class _TierResult(NamedTuple):
    """What a background save of the local tier returns: root's info on a durable step."""

    info: CheckpointInfo | None
    warnings: list[str]


class _Candidates:
    """The candidates of one pick, newest first, judged lazily: the first came verified with
    the pick; when the caller asks for the next (its load failed), the coordinator verifies the
    older ones just before, in one exchange, until one passes (see ``engine.pick``)."""

    def __init__(self, mgr: CheckpointManager, coord: Coordinator, picked: dict[str, Any],
                 reasons: list[str]) -> None:
        self._mgr = mgr
        self._coord = coord
        self._picked = picked
        self._reasons = reasons  # the caller's list of reasons: later failures are added to it

    def __bool__(self) -> bool:
        return bool(self._picked["candidates"])

    def __iter__(self) -> Iterator[tuple[int, str]]:
        picked = self._picked
        while True:
            for cand_step, path in picked["candidates"]:
                yield int(cand_step), path
            rest = picked.get("rest") or []
            if not rest:
                return
            picked = self._coord.decide("pick", lambda: None, lambda _, rest=rest: self._mgr._pick(None, True, rest))
            for note in picked["warnings"]:
                warnings.warn(note, SafeckptWarning, stacklevel=3)
            self._reasons.extend(picked.get("damaged", []))

