"""One collective save: agree (and stage) -> write (and commit).

Two exchanges, each a gather to the coordinator and a broadcast of its decision (see
``Coordinator.decide``), so a rank sends and receives O(1) bytes whatever the world size:

1. agree  (all ranks)    encode the state; send path, step, a hash of the layout (keys, dtypes,
                         shapes, scopes, DTensor placements), a combined digest of the replicated
                         tensors, the hash of the object trees, and the boxes of any shard the
                         DTensor rule does not describe (usually none).
          (coordinator)  compare; a mismatch asks every rank for the details (one more
                         exchange, only then) and raises RankMismatch naming them, nothing
                         written. Else check the target and prepare the staging place.
2. commit (all ranks)    write this rank's file (its share of replicated bytes, its shards, its
                         per-rank state, and the file's index of chunks and checksums: see
                         ``safeckpt.format.fileindex``), durably; send its size, checksum and index location.
          (coordinator)  check every file, write the format-3 manifest (``safeckpt.format.v3``),
                         publish atomically, and tell every rank.

The storage steps are ``safeckpt.storage.commit``'s, on the path's :class:`~safeckpt.storage.base.Storage`
(a local directory or an object store): one job class serves both. On any failure the
coordinator removes what the save wrote after all ranks have reported (never raising over the
save's error); the previous checkpoint at the path is never touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import torch
import xxhash
from torch import nn

from .._version import __version__
from ..coord.dist import Coordinator, resolve_timeout
from ..errors import CheckpointError, RankMismatch
from ..format.manifest import FORMAT, FORMAT_VERSION, MANIFEST, CheckpointInfo
from ..format.manifest_text import encode as encode_manifest_text
from ..format.sharding import Mesh, box_at, dims_of, mesh_record
from ..format.sharding import local_box as _local_box
from ..format.step_names import step_from_name
from ..format.tree import EncodedObject, Leaf, encode_state, escape_key, local_of, param_names
from ..storage import commit as _commit
from ..storage.base import Storage, resolve, storage_for
from ..storage.catalog import remember_published
from . import extra as _extra
from . import frozen as _frozen
from .extra import WriteFiles
from .gc_pause import paused_gc
from .plan import MeshInfo, NamedPlan, SavePlan, build_plan, cached_plan, find_aliases
from .replicas import ddp_broadcast_buffers, replica_digest
from .request import INDEX_META, NO_HOOKS, CommitHooks, NamedLayout, SaveRequest
from .staging import PendingCopies, SnapshotPool, copy_aside


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float | None = None,
    step: int | None = None,
    metrics: Mapping[str, Any] | None = None,
    check_replicas: str = "auto",
    storage_options: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    write_files: WriteFiles | None = None,
    frozen: str = "full",
    collective: bool = True,
    named: NamedLayout | None = None,
) -> CheckpointInfo:
    """Save ``state`` to the directory ``path`` (collective: every rank calls it identically).

    The checkpoint appears atomically and complete, or not at all. ``check_replicas`` controls
    the check that replicated tensors are identical on every rank (each is written once, from
    one rank): ``"auto"`` (``"error"`` whenever there is more than one rank, off for one),
    ``"error"`` (RankMismatch naming the tensors, nothing written), ``"warn"`` or ``"off"``.
    ``storage_options``: the fsspec filesystem's options for a URL ``path`` (endpoint,
    credentials; see docs/how-to/object-stores.md); ignored for local paths. ``step``: recorded in
    the manifest; by default the one in the directory's name where it is a name frameworks use
    (``step-100``, ``checkpoint-100``, ``global_step100``, ``epoch=2-step=100``: see
    :mod:`safeckpt.format.step_names`).

    ``extra_files`` (name -> bytes; plain file names, not ``manifest.json`` nor ``rank-*``):
    small files committed inside the checkpoint (a framework's own JSON), listed in the
    manifest with their checksum; rank 0's mapping is the one written. ``write_files(staging_dir)
    -> [relative paths]`` (every rank; synchronous saves on a filesystem only): files each rank
    writes itself into the checkpoint during the save, published with it (see
    :mod:`safeckpt.engine.extra`). ``frozen="fingerprint"`` saves each frozen parameter
    (``requires_grad=False``) of a module as a fingerprint instead of its bytes; a load verifies
    the live model's frozen parameters against them (see :mod:`safeckpt.engine.frozen`).
    ``named`` (a :class:`~safeckpt.engine.request.NamedLayout`; filesystem targets): some
    tensors laid out as safetensors files under the caller's names inside the checkpoint
    (``model.safetensors`` as Hugging Face's ``save_pretrained`` writes it), written once.
    """
    target = resolve(path)
    if step is None:  # the step in a name frameworks use (step-100, checkpoint-100, ...), if any
        step = step_from_name(target.rstrip("/").rsplit("/", 1)[-1])
    request = SaveRequest(target=target, state=state, metadata=metadata, overwrite=overwrite, step=step,
                          metrics=metrics, check_replicas=check_replicas, extra_files=extra_files or {},
                          write_files=write_files, frozen=frozen, named=named)
    what = f"save to {request.target}"
    coord = Coordinator(timeout, what=what) if collective else _ThisProcess(timeout, what)
    store = storage_for(request.target, storage_options, timeout=coord.timeout)
    return new_job(coord, request, store=store).run()


class _ThisProcess(Coordinator):
    """A Coordinator for a save this process makes on its own, even inside a process group."""

    def __init__(self, timeout: float | None, what: str) -> None:
        self.timeout = resolve_timeout(timeout)
        self.what = what
        self.rank, self.world_size, self._state = 0, 1, None


def new_job(coord: Coordinator, request: SaveRequest, *, store: Storage | None = None,
            hooks: CommitHooks = NO_HOOKS) -> SaveJob:
    """The save job of ``request`` on ``store`` (default: the storage of its target without
    options), agreeing through ``coord``."""
    if request.named is not None and store is not None and not store.renames:
        raise CheckpointError(
            "named files (model.safetensors) need a filesystem target: they keep their names "
            "inside the checkpoint, published by its rename (not on an object store)")
    if request.write_files is not None and store is not None and not store.renames:
        raise CheckpointError(
            "write_files needs a synchronous save to a filesystem: the files are written inside "
            "the save by every rank and published by its rename (not on an object store)")
    store = store or storage_for(request.target, timeout=getattr(coord, "timeout", None))
    return SaveJob(coord, request, store, hooks)


class SaveJob:
    """One save in progress: :meth:`agree` (and, for an async save, :meth:`snapshot`), then
    :meth:`finish`; :meth:`run` does all of it for a synchronous save."""

    def __init__(self, coord: Coordinator, request: SaveRequest, store: Storage, hooks: CommitHooks) -> None:
        self.coord = coord
        self.request = request
        self.store = store
        self.hooks = hooks
        self.target = request.target
        self.named = request.named
        # Frozen parameters as fingerprints: the state the core saves has them replaced (not
        # where a named file must hold them: that save keeps frozen parameters in full).
        self.state = _frozen.for_save(request.state, _frozen_mode(request))
        self.metadata = dict(request.metadata or {})
        self.metrics = dict(request.metrics or {})
        self.overwrite = request.overwrite
        self.step = request.step
        self.check_replicas = request.check_replicas
        self.extra_files = request.extra_files
        self.write_files = request.write_files
        self.objects: list[EncodedObject] = []
        self.leaves: dict[str, Leaf] = {}
        self.items: list[tuple[str, torch.Tensor]] = []
        self.aliases: dict[str, str] = {}  # key -> the key whose bytes it shares (stored once)
        self.from_rank0: set[str] = set()  # replicated keys written by rank 0 alone, unchecked
        self.copies = PendingCopies()  # snapshot copies still running on a GPU
        self.staging: dict[str, str] | None = None  # set by the agreement (the coordinator staged)
        self.irregular: dict[str, list[list[Any]]] = {}  # key -> [[writer rank, offsets, sizes]]
        self.rank0_trees = ""  # hash of rank 0's object trees (see _agree)
        self.rank0_tree_hashes: dict[str, str] = {}  # rank 0's hash of each tree, when some rank's differ
        self.plan: SavePlan | None = None
        self.named_items: list[tuple[NamedPlan, list[tuple[str, torch.Tensor]]]] = []  # this rank's
        self._pending: dict[str, Any] | None = None  # a speculative agreement's own part (see agree)
        self._pending_layout: list[Any] | None = None
        self._pending_error: Exception | None = None  # this rank's part of a speculative agree failed

    # ------------------------------------------------------------------ phases
    def run(self) -> CheckpointInfo:
        """A synchronous save: the caller waits for all of it, so GC stays paused throughout
        (the commit of 4,000 tensors allocates ~40k objects; collections ran inside it)."""
        with paused_gc():
            self.agree()
            return self.finish()

    def agree(self, speculate: bool = False) -> None:
        """Phase 1 (all ranks): encode, check agreement; the coordinator stages.

        ``speculate`` (an async save whose previous save agreed without irregular shards, the
        same on every rank; see ``CheckpointManager``): only this rank's part runs here (encode,
        layout, replica digests: every local check), the snapshot is planned as if the ranks
        agreed, and the exchange itself runs in the background (:meth:`confirm`) before anything
        is written. A training loop saves the same layout every time, so the collective (and the
        slowest rank's arrival) leaves the part that blocks training; a mismatch still fails the
        save on every rank with nothing written, raised where a background save's error is."""
        with paused_gc():
            if speculate:
                try:
                    self._pending = self._agree()
                except Exception as exc:  # noqa: BLE001 - raised by the exchange, on every rank, as a plain agree does
                    self._pending, self._pending_error = {}, exc
                    return
                self._pending_layout = self.layout  # for a description of a mismatch, after the plan
                self.irregular = {}
                return
            self._adopt(self.coord.decide("agree", self._agree, self._resolve_agree, hint="Nothing was written."))

    def confirm(self, coord: Coordinator | None = None) -> None:
        """The exchange a speculative :meth:`agree` left for later (a no-op after a plain one):
        every rank's path, step, layout and replica digests compared, the staging prepared.
        Runs before any write, so a mismatch leaves nothing behind."""
        if coord is not None:
            self.coord = coord
        pending, self._pending = self._pending, None
        if pending is None:
            return

        def resolve(agreed: list[dict[str, Any]]) -> dict[str, Any]:
            changed = sorted(r for r, a in enumerate(agreed) if a["irregular"])
            if changed:  # the snapshot was planned for none: it is not what these ranks hold
                raise CheckpointError(
                    f"save to {self.target}: ranks {changed} hold shards their DTensor placements do "
                    "not describe, which the previous save did not have; this save copied its state "
                    "planned without them, so nothing was written. The next save agrees on them "
                    "before it copies.")
            return self._resolve_agree(agreed)

        error, self._pending_error = self._pending_error, None

        def local() -> dict[str, Any]:
            if error is not None:
                raise error
            return pending

        self.layout = self._pending_layout  # what _explain's description of a mismatch reads
        try:
            self._adopt(self.coord.decide("agree", local, resolve, hint="Nothing was written."))
        finally:
            self.layout = self._pending_layout = None

    def _adopt(self, decision: dict[str, Any]) -> None:
        if "ask" in decision:  # the ranks disagree: one more exchange to say exactly how
            decision = self._explain(decision["ask"])
        self.staging = decision["staging"]
        self.irregular = decision["irregular"]
        self.rank0_trees = decision["trees"]
        self.rank0_tree_hashes = decision.get("tree_hashes", {})

    @property
    def speculable(self) -> bool:
        """Whether the next save of the same state may agree speculatively (see :meth:`agree`):
        this one agreed on no irregular shards, and a mismatch of replicas raises (a "warn"
        would have to be shown from the background)."""
        return self.staging is not None and not self.irregular and self._replica_mode() != "warn"

    def snapshot(self, pool: SnapshotPool) -> None:
        """Copy this rank's write items aside (into reusable buffers from ``pool``), so the
        caller may change the live state while the rest of the save runs in the background."""
        if self._pending_error is not None:  # nothing to copy: the exchange fails the save everywhere
            return
        self._plan()
        items = self.items + [(f"@named/{nf.name}/{n}", t) for nf, its in self.named_items for n, t in its]
        srcs = [t for _, t in items]  # plain tensors: shards are local already
        with paused_gc():
            staged, bufs = pool.staged(self.plan_key, items)
            self.copies = copy_aside(bufs, srcs)  # GPU copies may still run: finish() waits
        self.items = staged[:len(self.items)]
        rest = iter(staged[len(self.items):])
        self.named_items = [(nf, [(n, next(rest)[1]) for n, _ in its]) for nf, its in self.named_items]
        self.leaves = {}  # drop references to live tensors; the manifest needs only the layout
        self.state = {}

    def finish(self, coord: Coordinator | None = None) -> CheckpointInfo:
        """Phase 2: write (all ranks), then check, write the manifest and publish (coordinator).
        ``coord``: where this phase agrees, when not where the save began (an async save's
        background thread has a group of its own)."""
        self.confirm(coord)
        self.copies.wait()  # an async save's device-to-host copies
        staging = self.staging
        try:
            info = self.coord.decide(
                "write", lambda: self._write(staging), lambda written: self._commit(staging, written),
                hint="No checkpoint was published; the previous one (if any) is intact.",
                done_hint=f"Rank 0 published the checkpoint {self.target} before the failure: "
                "it is complete and loadable.",
            )
        except BaseException:
            if self.coord.is_coordinator and staging:
                _commit.discard(self.store, self.target, staging)
            raise
        incomplete = info.pop("incomplete_error", None)
        after = info.pop("after_commit_error", None)
        if incomplete is not None:  # published, so the failure hint of the phase would be wrong
            raise CheckpointError(f"{self.coord.what}: {incomplete}" + (f"; then {after}" if after else ""))
        if after is not None:
            raise CheckpointError(f"{self.coord.what}: {after}. {self.hooks.after_commit_hint}".rstrip())
        return CheckpointInfo(**{**info, "metrics": self.metrics, "metadata": self.metadata})

    # ---------------------------------------------------------------- agreement
    def _agree(self) -> dict[str, Any]:
        if not isinstance(self.state, Mapping):
            raise TypeError(f"state must be a dict of name -> value, got {type(self.state).__name__}")
        for what in ("metadata", "metrics"):
            try:  # fail early, say which argument is at fault; keep what a reader will parse
                setattr(self, what, json.loads(json.dumps(getattr(self, what), allow_nan=True)))
            except (TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"{what} must be JSON (numbers, strings, bools, None, lists, dicts with "
                    f"string keys): {exc}. Nothing was written."
                ) from None
        leaves: list[Leaf] = []
        names = param_names(self.state)
        self.objects = encode_state(self.state, leaves, names)
        self.leaves = {leaf.key: leaf for leaf in leaves}
        if len(self.leaves) != len(leaves):
            raise CheckpointError(f"two tensors map to the same key {_first_duplicate(leaves)!r}; rename one")
        self.aliases = find_aliases(self.leaves)
        if self.named is not None:
            self.aliases = _check_named(self.named, self.leaves, self.aliases)
        self.from_rank0 = {k for name, v in self.state.items() if isinstance(v, nn.Module)
                           for k in ddp_broadcast_buffers(name, v)
                           if k in self.leaves and self.leaves[k].scope == "replicated" and k not in self.aliases}
        self.meshes: dict[int, MeshInfo] = {}  # id(device mesh) -> its record, this save
        layout = self._layout()
        self.layout = layout
        # A digest for the other ranks to compare with theirs; one rank agrees with itself, and
        # for 4,000 tensors the digest costs 3 ms of the time an async save blocks.
        single = self.coord.world_size == 1
        self.layout_hash = "" if single else hashlib.sha256(json.dumps(layout).encode()).hexdigest()
        self.digests = self._replica_digests() if self._replica_mode() != "off" else None
        combined = None if self.digests is None else xxhash.xxh3_128_hexdigest(json.dumps(sorted(self.digests.items())).encode())
        self.my_trees = {o.name: o.tree for o in self.objects if not _single_ref(o.tree)}
        self.tree_hashes = {} if single else {
            name: xxhash.xxh3_64_hexdigest(json.dumps(tree, sort_keys=True, allow_nan=True, default=str).encode())
            for name, tree in self.my_trees.items()}
        self.trees_hash = "" if single else xxhash.xxh3_64_hexdigest(json.dumps(sorted(self.tree_hashes.items())).encode())
        return {
            "path": self.target,
            "step": self.step,
            "overwrite": self.overwrite,
            "layout_hash": self.layout_hash,
            "digest": combined,
            "trees": self.trees_hash,
            "irregular": self._irregular_boxes(),
        }

    def _layout(self) -> list[Any]:
        objs = [[o.name, o.kind] for o in self.objects]
        tensors = [
            [k, leaf.dtype, leaf.shape, leaf.scope, self.aliases.get(k), self._sharding_of(leaf)]
            for k, leaf in sorted(self.leaves.items())
        ]
        layout = [objs, tensors, sorted(self.from_rank0)]
        if self.named is not None:
            layout.append(sorted([f, sorted(names.items())] for f, names in self.named.files.items()))
        return layout

    def _sharding_of(self, leaf: Leaf) -> list[Any] | None:
        """[mesh record as JSON, placements] of a sharded leaf (None: not sharded)."""
        if leaf.scope != "sharded":
            return None
        t = leaf.tensor
        mesh = t.device_mesh
        known = self.meshes.get(id(mesh))
        if known is None:
            rec = mesh_record(t)
            known = self.meshes[id(mesh)] = MeshInfo(rec, json.dumps(rec, sort_keys=True), Mesh(rec))
        return [known.json, dims_of(t) or [str(p) for p in t.placements]]

    def _irregular_boxes(self) -> dict[str, Any]:
        """This rank's box of every sharded tensor the DTensor rule does not describe here."""
        out = {}
        rank = self.coord.rank
        for k, leaf in self.leaves.items():
            if leaf.scope != "sharded" or k in self.aliases:
                continue
            box = _local_box(leaf.tensor)
            if list(local_of(leaf.tensor).shape) != box[1]:
                raise CheckpointError(
                    f"DTensor {k!r}: its local shard has shape {list(local_of(leaf.tensor).shape)} but its "
                    f"placements {list(leaf.tensor.placements)} give this rank {box[1]} (uneven shards "
                    "from DTensor.from_local are not supported: every reader would refuse them). "
                    "Nothing was written.")
            dims = dims_of(leaf.tensor)
            if dims is not None:
                mesh = self.meshes[id(leaf.tensor.device_mesh)].mesh
                coord = mesh.coord_of(rank)
                if coord is not None and list(box_at(leaf.shape, mesh.shape, coord, dims)) == box:
                    continue
            out[k] = box
        return out

    def _replica_mode(self) -> str:
        """``auto``: refuse differing replicas whenever there is more than one rank. A
        replicated tensor is written once, from one rank; if ranks held different values, all
        but one would be lost silently."""
        if self.check_replicas != "auto":
            return self.check_replicas
        return "error" if self.coord.world_size > 1 else "off"

    def _replica_digests(self) -> dict[str, str]:
        return {
            k: replica_digest(leaf.tensor)
            for k, leaf in self.leaves.items()
            if leaf.scope == "replicated" and k not in self.aliases and k not in self.from_rank0
        }

    def _resolve_agree(self, agreed: list[dict[str, Any]]) -> dict[str, Any]:
        """Coordinator: compare what every rank sent; stage, or ask for details of a mismatch."""
        ref = agreed[0]
        problems = []
        for field in ("path", "step", "overwrite"):
            for r, a in enumerate(agreed):
                if a[field] != ref[field]:
                    problems.append(f"rank {r} was called with {field}={a[field]!r} but rank 0 with {ref[field]!r}")
        if problems:
            raise self._mismatch(problems)
        self._agreed = agreed  # kept for staging after a "warn" about replicas
        if any(a["layout_hash"] != ref["layout_hash"] for a in agreed):
            return {"ask": "layout"}
        if self._replica_mode() != "off" and any(a["digest"] != ref["digest"] for a in agreed):
            return {"ask": "replicas"}
        return self._stage(agreed)

    def _mismatch(self, problems: list[str]) -> RankMismatch:
        return RankMismatch(
            f"save to {self.target}: ranks disagree, nothing was written:\n  "
            + "\n  ".join(problems[:20])
            + "\nEvery rank must call save() with the same path/step and the same state "
            "structure (compute paths on one rank, or from the step, not from a clock)."
        )

    def _explain(self, what: str) -> dict[str, Any]:
        """The second exchange after a mismatch of layouts or replicas: every rank sends the
        full description, the coordinator names the differences (and, for replicas in "warn"
        mode, warns and stages after all)."""
        if what == "layout":
            self.coord.decide("describe-layout", lambda: self.layout,
                              lambda layouts: _raise(self._mismatch(_layout_differences(layouts))),
                              hint="Nothing was written.")
            raise AssertionError("unreachable: describe-layout always raises")
        decision = self.coord.decide("describe-replicas", lambda: self.digests, self._replicas_differ,
                                     hint="Nothing was written.")
        import warnings

        from ..errors import SafeckptWarning

        warnings.warn(decision["warning"], SafeckptWarning, stacklevel=4)
        return decision

    def _replicas_differ(self, digests: list[dict[str, str]]) -> dict[str, Any]:
        ref = digests[0]
        bad = sorted({f"rank {r}: {k}" for r, d in enumerate(digests) for k, v in (d or {}).items()
                      if ref.get(k) != v})
        msg = (
            f"save to {self.target}: replicated tensors differ from rank 0's on "
            + "; ".join(bad[:10])
            + ". A tensor that is not sharded is saved once for all ranks, so the "
            "other ranks' values would be lost. If it is meant to differ per rank, wrap "
            "its entry in safeckpt.PerRank(...) (kept per rank); if not, the ranks have "
            "diverged (different init seeds, a rank-local update). Nothing was written."
        )
        if self._replica_mode() == "error":
            raise RankMismatch(msg)
        return {**self._stage(self._agreed), "warning": msg}

    def _stage(self, agreed: list[dict[str, Any]]) -> dict[str, Any]:
        """Coordinator: writers of irregular shards, then the manager's hook and the staging."""
        irregular = self._owners([a["irregular"] for a in agreed])
        if self.hooks.before_stage is not None:
            self.hooks.before_stage()
        staging = _commit.begin(self.store, self.target, self.overwrite)
        # Rank 0's hash of each object tree, only when some rank's trees differ from them (RNG
        # states, data positions): each such rank then stores just the trees that differ.
        differ = any(a["trees"] != agreed[0]["trees"] for a in agreed)
        return {"staging": staging, "irregular": irregular, "trees": agreed[0]["trees"],
                "tree_hashes": getattr(self, "tree_hashes", {}) if differ else {}}

    def _owners(self, boxes: list[dict[str, Any]]) -> dict[str, list[list[Any]]]:
        """For each shard not described by the DTensor rule on some rank: every rank's box (the
        rule's where it held), one writer per distinct box (replicas spread by key)."""
        keys = sorted({k for b in boxes for k in b})
        out: dict[str, list[list[Any]]] = {}
        for k in keys:
            leaf = self.leaves[k]
            dims = dims_of(leaf.tensor)
            mesh = self.meshes[id(leaf.tensor.device_mesh)].mesh
            holders: dict[str, list[int]] = {}
            for r, b in enumerate(boxes):
                box = b.get(k)
                if box is None and dims is not None:
                    coord = mesh.coord_of(r)
                    box = list(box_at(leaf.shape, mesh.shape, coord, dims)) if coord is not None else None
                if box is not None and 0 not in box[1]:
                    holders.setdefault(json.dumps(box), []).append(r)
            out[k] = [[ranks[zlib.crc32(k.encode()) % len(ranks)], *json.loads(box)]
                      for box, ranks in sorted(holders.items())]
        return out

    # --------------------------------------------------------------------- plan
    def _plan(self) -> None:
        """This rank's write items and, from a cache keyed by the agreed layout (a training loop
        saves the same layout every time), the manifest's tensor records and the file index."""
        if self.plan is not None:
            return
        layout, self.layout = self.layout, None  # freed now if an equal plan is cached (8,000 lists)
        key = (layout, json.dumps(self.irregular, sort_keys=True), self.coord.rank, self.coord.world_size)
        self.plan_key, cached = cached_plan(key, lambda: build_plan(
            self.leaves, self.aliases, self.irregular, self.meshes, self.from_rank0, self.coord.rank,
            self.coord.world_size, self.named.files if self.named is not None else None))
        self.plan = cached
        items = []
        leaves = self.leaves
        for name, key_, how in cached.specs:
            t = leaves[key_].tensor
            if how is not None:
                t = local_of(t) if how == "local" else t.narrow(0, *how)
            items.append((name, t))
        self.items = items
        self.named_items = [(nf, [(n, leaves[k].tensor) for n, k, _ in nf.specs])
                            for nf in cached.named if nf.writer == self.coord.rank]

    # -------------------------------------------------------------------- write
    def _write(self, staging: dict[str, str] | None) -> dict[str, Any]:
        assert staging is not None, "finish() before agree()"
        # First, before anything that could fail on this rank alone: the hook may run
        # collectives of its own (a DeepSpeed save), which every rank must enter.
        hooked = None
        if self.write_files is not None:
            hooked = _extra.records(staging["path"], self.write_files(staging["path"]))
        self._plan()
        assert self.plan is not None
        # Trees that differ from rank 0's (RNG states, data positions) go into this rank's index.
        trees = {} if self.trees_hash == self.rank0_trees else {
            name: tree for name, tree in self.my_trees.items()
            if self.tree_hashes.get(name) != self.rank0_tree_hashes.get(name)}
        named = [self._write_named(staging, nf, items) for nf, items in self.named_items]
        builder = self.plan.index
        fname, written = _retry_missing_dir(
            lambda: _commit.write(self.store, staging, self.coord.rank, self.items, {"format": FORMAT},
                                  index=lambda names, spans: builder(names, spans, trees)),
            staging["path"],
        )
        report = {"file": fname, "size": written.size, "xxh3_128": written.xxh3_128,
                  "data": written.data_start, "index": list(written.index), "trees": bool(trees)}
        if hooked is not None:
            report["written"] = hooked
        if named:
            report["named"] = named
        return report

    def _write_named(self, staging: dict[str, str], nf: NamedPlan, items: list[tuple[str, torch.Tensor]]
                     ) -> dict[str, Any]:
        """One named file: a plain safetensors file of just its tensors, its chunk index (with
        each chunk's checksum, hashed first, in memory) in the header's metadata."""
        assert self.named is not None
        index, digests = named_index(items, nf.index)
        meta = {**self.named.metadata, INDEX_META: index}
        path = self.store.join(staging["path"], nf.name)
        written = _retry_missing_dir(lambda: self.store.write(path, items, meta, None), staging["path"])
        if list(written.digests) != digests:
            raise CheckpointError(f"a tensor of {nf.name} changed while it was being saved; nothing was "
                                  "published. Do not change the model during a save.")
        enc = json.dumps(index).encode()  # as it stands in the header (ASCII, escaped)
        at = bytes(written.header).find(enc)
        if at < 0:  # pragma: no cover - the header is json.dumps of the metadata
            raise CheckpointError(f"{nf.name}: its index is not where it was written")
        return {"file": nf.name, "slot": nf.slot, "size": written.size, "xxh3_128": written.xxh3_128,
                "data": written.data_start, "index": [at, at + len(enc), xxhash.xxh3_64_hexdigest(enc)]}

    def _commit(self, staging: dict[str, str] | None, written: list[dict[str, Any]]) -> dict[str, Any]:
        assert staging is not None and self.plan is not None
        files = _commit.check_written(self.store, staging, written)
        files.update(self._check_named_written(staging, written))
        head = self._head(files, written, staging)
        extras = dict(self.extra_files)  # names checked by the request
        raw = self._encode(head)
        late = _commit.commit(self.store, self.target, staging, raw, overwrite=self.overwrite, files=files,
                              extras=extras)
        remember_published(self.store, self.target, head)
        info = self._committed_info(head, files)
        if late is not None:
            info["incomplete_error"] = late
        if self.hooks.after_commit is not None:
            mark = getattr(self.coord, "mark_done", None)
            if mark is not None:
                mark()  # published: a peer that loses rank 0 during retention can tell
            try:
                self.hooks.after_commit(self.step)
            except Exception as exc:  # noqa: BLE001 - the checkpoint is committed: say so on every rank
                info["after_commit_error"] = f"{type(exc).__name__}: {exc}"
        return info

    def _head(self, files: dict[str, Any], written: list[dict[str, Any]],
              staging: dict[str, str] | None) -> dict[str, Any]:
        """The manifest's top-level fields of this save: ``files``, the coordinator's ``extra``
        files and (with a staging place to check them in) the ``written`` ones."""
        head = self._manifest_head(files, [r for r, w in enumerate(written) if w["trees"]])
        if self.extra_files:
            head["extra"] = {name: {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
                             for name, data in sorted(self.extra_files.items())}
        if self.write_files is not None:  # one record per file, from the rank that wrote it
            assert staging is not None
            head["written"] = _extra.merge([w.get("written") for w in written],
                                           {*files, *self.extra_files, MANIFEST}, self.store, staging["path"])
        return head

    def _encode(self, head: dict[str, Any]) -> bytes:
        assert self.plan is not None
        objects = {o.name: {"kind": o.kind, "tree": o.tree} for o in self.objects}
        return encode_manifest_text(head, objects, self.plan.tensors_json)

    # ------------------------------------------- for writers of other places (engine.tier)
    # The node-local tier agrees and snapshots a job as any async save, then writes each rank's
    # files into its node's directory (:meth:`write_to`, under a place named with
    # :attr:`staging_token`, after :meth:`drop_staging`), builds the manifest from the reports
    # (:meth:`files_of`, :meth:`manifest_bytes`: no rank sees another node's files), and later
    # commits the same staged bytes under root (:meth:`retarget`, then :meth:`finish`). These
    # calls are its whole use of the job; nothing else of it is touched from outside.

    @property
    def staging_token(self) -> str:
        """The token of the staging place the agreement prepared (the same on every rank)."""
        assert self.staging is not None, "agree() first"
        return self.staging["token"]

    def drop_staging(self) -> None:
        """Coordinator (a no-op elsewhere): remove the staging place the agreement prepared, for
        a caller that writes this job somewhere else. Never raises (see ``commit.discard``)."""
        if self.coord.is_coordinator and self.staging:
            _commit.discard(self.store, self.target, self.staging)

    def retarget(self, target: str, store: Storage, staging: dict[str, str], hooks: CommitHooks) -> None:
        """Commit this (agreed, snapshotted) job at ``target`` on ``store`` instead, through
        ``staging`` (what ``commit.begin`` returned there on the coordinator, shared by every
        rank), replacing a checkpoint there; :meth:`finish` then writes the staged bytes again
        and publishes them with ``hooks``."""
        self.target, self.store, self.staging, self.overwrite, self.hooks = target, store, staging, True, hooks

    def write_items(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor this rank writes in this save (after :meth:`snapshot`: the staged
        copies), named as the save names them: its data file's items by key, its named files'
        as ``@<file>:<name in file>`` (``@`` never starts a key)."""
        if self._pending_error is not None:  # nothing planned: the exchange fails the save everywhere
            return []
        self._plan()
        return self.items + [(f"@{nf.name}:{n}", t) for nf, its in self.named_items for n, t in its]

    def write_to(self, staging: dict[str, str]) -> dict[str, Any]:
        """This rank's part of the write phase into ``staging`` (``{"token", "path"}`` on this
        job's storage): its data file and the named files it writes (not ``write_files``:
        those run inside :meth:`finish` only). Returns its report for :meth:`files_of`."""
        if self.write_files is not None:
            raise CheckpointError("write_files runs inside a save's own commit only")
        return self._write(staging)

    def file_names(self) -> list[str]:
        """The names of the files :meth:`write_to` writes on this rank (its data file, the named
        files it writes), for a caller cleaning up after a failed write."""
        assert self.staging is not None, "agree() first"
        self._plan()
        return [self.store.data_name(self.coord.rank, self.staging["token"]),
                *(nf.name for nf, _ in self.named_items)]

    @staticmethod
    def report_files(report: Mapping[str, Any]) -> list[tuple[str, int, str]]:
        """(name, size, xxh3-128) of every file a rank's report of :meth:`write_to` names."""
        return [(report["file"], report["size"], report["xxh3_128"]),
                *((n["file"], n["size"], n["xxh3_128"]) for n in report.get("named", ()))]

    def files_of(self, written: list[dict[str, Any]]) -> dict[str, Any]:
        """Coordinator: the manifest's ``files`` from every rank's report, as the commit records
        them (without checking the storage: the caller checks its own copies)."""
        files: dict[str, Any] = {}
        for r, w in enumerate(written):
            files[w["file"]] = {"size": w["size"], "xxh3_128": w["xxh3_128"], "rank": r,
                                "data": w["data"], "index": w["index"]}
        for r, w in enumerate(written):  # after the data files, as the commit lists them
            for rec in w.get("named", ()):
                files[rec["file"]] = {"size": rec["size"], "xxh3_128": rec["xxh3_128"], "rank": rec["slot"],
                                      "writer": r, "data": rec["data"], "index": rec["index"]}
        if self.named is not None:
            missing = sorted(set(self.named.files) - set(files))
            if missing:
                raise CheckpointError(f"no rank reported the named file(s) {missing}")
        return files

    def manifest_bytes(self, files: dict[str, Any], written: list[dict[str, Any]]) -> bytes:
        """Coordinator: the manifest a commit of these files would publish (``extra`` included;
        ``created_at`` is now)."""
        return self._encode(self._head(files, written, None))

    def _check_named_written(self, staging: dict[str, str], written: list[dict[str, Any]]) -> dict[str, Any]:
        """Coordinator: every named file reported by its writer and there with its size; their
        records for the manifest's ``files`` (slot as ``rank``, the writer as ``writer``)."""
        if self.named is None:
            return {}
        out: dict[str, Any] = {}
        for r, w in enumerate(written):
            for rec in w.get("named", ()):
                actual = self.store.size(self.store.join(staging["path"], rec["file"]))
                if actual != rec["size"]:
                    raise CheckpointError(
                        f"rank {r} wrote {rec['file']} ({rec['size']} bytes) but the coordinator sees "
                        f"{actual} bytes in {staging['path']}. {_commit.NOT_SHARED}")
                out[rec["file"]] = {"size": rec["size"], "xxh3_128": rec["xxh3_128"], "rank": rec["slot"],
                                    "writer": r, "data": rec["data"], "index": rec["index"]}
        missing = sorted(set(self.named.files) - set(out))
        if missing:
            raise CheckpointError(f"no rank reported the named file(s) {missing}")
        return out

    def _committed_info(self, manifest: dict[str, Any], files: dict[str, Any]) -> dict[str, Any]:
        """What every rank learns about the checkpoint just published."""
        return {
            "path": self.target,
            "step": self.step,
            "world_size": self.coord.world_size,
            "created_at": manifest["created_at"],
            "nbytes": sum(f["size"] for f in files.values()),
        }

    def _manifest_head(self, files: dict[str, Any], rank_trees: list[int]) -> dict[str, Any]:
        assert self.plan is not None
        return manifest_head(step=self.step, world_size=self.coord.world_size, metadata=self.metadata,
                             metrics=self.metrics, files=files, rank_trees=rank_trees, meshes=self.plan.meshes)


def _frozen_mode(request: SaveRequest) -> str:
    """The request's frozen mode, but "full" where a named file lays out a frozen parameter."""
    if request.named is None or request.frozen == "full":
        return request.frozen
    keys = set(request.named.key_files())
    for name, value in request.state.items():
        if isinstance(value, nn.Module):
            if any(f"{escape_key(name)}/{escape_key(p)}" in keys for p in _frozen.frozen_tensors(value)):
                return "full"
    return request.frozen


def _check_named(named: NamedLayout, leaves: Mapping[str, Leaf], aliases: dict[str, str]) -> dict[str, str]:
    """Raise unless every tensor ``named`` lays out is a whole replicated tensor of the save;
    the aliases re-rooted so that of tied tensors the one a named file holds is stored (as
    ``save_pretrained`` keeps ``embed_tokens.weight``, not the tied ``lm_head.weight``)."""
    keys = named.key_files()
    for k, (fname, name) in keys.items():
        leaf = leaves.get(k)
        if leaf is None:
            raise CheckpointError(f"named file {fname}: tensor {name!r} is {k!r}, which this save does not hold. "
                                  "Nothing was written.")
        if leaf.scope != "replicated":
            raise CheckpointError(
                f"named file {fname}: {k!r} is {leaf.scope}; named files hold whole replicated tensors "
                "(a DDP or one-process model). Gather FSDP2 shards into full tensors first, or save without "
                "named files. Nothing was written.")
    if not aliases:
        return aliases
    groups: dict[str, list[str]] = {}
    for k, root in aliases.items():
        groups.setdefault(root, [root]).append(k)
    out = dict(aliases)
    for root, members in groups.items():
        held = [m for m in members if m in keys]
        if len(held) > 1:
            raise CheckpointError(f"tied tensors {held} are laid out twice in named files; a file holds one "
                                  "of them (as save_pretrained does). Nothing was written.")
        if held and held[0] != root:
            new = held[0]
            for m in members:
                out.pop(m, None)
                if m != new:
                    out[m] = new
    return out


def named_index(items: list[tuple[str, torch.Tensor]], builder: Any) -> tuple[str, list[str]]:
    """A named file's index text (chunk byte ranges relative to the data, as the file will be
    laid out) and its chunks' xxh3-64 in file order, hashed from memory before the write."""
    from ..format.shardfile import _header, tensor_bytes

    layout = _header(items, {})
    base = len(layout.header)
    spans = [(a - base, b - base) for a, b in layout.spans]
    digests = [xxhash.xxh3_64_hexdigest(tensor_bytes(items[i][1])) for i in layout.order]
    return builder(layout.names, spans, {}).render(digests).decode(), digests


def _single_ref(tree: Any) -> bool:
    """A tree that is one tensor reference (fixed by the layout, so never differs by rank)."""
    return type(tree) is dict and len(tree) == 1 and "@tensor" in tree


def _raise(exc: BaseException) -> Any:
    raise exc


def _first_duplicate(leaves: list[Leaf]) -> str:
    """The first key that two of ``leaves`` share."""
    seen: set[str] = set()
    for leaf in leaves:
        if leaf.key in seen:
            return leaf.key
        seen.add(leaf.key)
    return ""


def _layout_differences(layouts: list[Any]) -> list[str]:
    out = []
    ref_objs, ref_tensors = layouts[0][:2]
    ref_map = {t[0]: t[1:] for t in ref_tensors}
    for r, (objs, tensors, *_) in enumerate(layouts[1:], start=1):
        if objs != ref_objs:
            out.append(f"rank {r} has state entries {objs} but rank 0 has {ref_objs}")
            continue
        mine = {t[0]: t[1:] for t in tensors}
        for k in sorted(set(mine) | set(ref_map)):
            if k not in ref_map:
                out.append(f"rank {r} has tensor {k!r} that rank 0 lacks")
            elif k not in mine:
                out.append(f"rank {r} lacks tensor {k!r} that rank 0 has")
            elif mine[k] != ref_map[k]:
                out.append(f"tensor {k!r} is {mine[k][:2]} on rank {r} but {ref_map[k][:2]} on rank 0")
    return out


def _retry_missing_dir(fn: Any, staging: str, attempts: int = 50) -> Any:
    """Retry while the staging directory is not yet visible here (NFS attribute caches)."""
    for i in range(attempts):
        try:
            return fn()
        except FileNotFoundError:
            if i == attempts - 1:
                raise CheckpointError(
                    f"the staging directory {staging} created by rank 0 is not visible on this "
                    f"rank after {attempts * 0.1:.0f}s: the ranks do not share the checkpoint "
                    f"directory. {_commit.NOT_SHARED}"
                ) from None
            time.sleep(0.1)


def manifest_head(*, step: int | None, world_size: int, metadata: Mapping[str, Any], metrics: Mapping[str, Any],
                  files: dict[str, Any], rank_trees: list[int] | None = None, meshes: list[Any] | None = None,
                  format_version: int = FORMAT_VERSION) -> dict[str, Any]:
    """A manifest's top-level fields before ``objects`` and ``tensors``, for every save path
    (format 3's ``rank_trees`` and ``meshes`` where given; a DCP save writes format 2)."""
    now = time.time()
    head = {
        "format": FORMAT,
        "format_version": format_version,
        "step": step,
        "world_size": world_size,
        "created_at": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "created_unix": now,
        "safeckpt_version": __version__,
        "torch_version": torch.__version__,
        "metadata": metadata,
        "metrics": metrics,
        "files": files,
    }
    if rank_trees is not None:
        head["rank_trees"] = rank_trees
    if meshes is not None:
        head["meshes"] = meshes
    return head
