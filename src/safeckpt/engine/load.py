"""One collective load: check -> apply, in at most three collective rounds.

1. check (all ranks)    every rank reads and validates the manifest itself (format 3: O(tensors
                        + files), see safeckpt.format.v3), matches the target state against it (keys,
                        shapes, dtypes; on a strict load a mismatch is IncompatibleCheckpoint),
                        reads the indexes of just the files it needs, reads stateful objects'
                        state into fresh tensors (verified as read), and verifies the chunks its
                        in-place targets need (ranks of one machine split the replicated ones,
                        see safeckpt.coord.verify_split). Nothing in the caller's state is touched.
         (coordinator)  one gather: the same path and manifest on every rank, every check
                        passed; the decision is broadcast, so any failure raises the same error
                        on every rank before anything is applied.
2. apply (all ranks)    stateful objects get load_state_dict; verified chunks are copied into
                        the existing tensors in place; plain values are replaced. One all-reduce
                        says whether any rank failed; only then do ranks exchange the errors.

Only a user object's own ``load_state_dict`` raising in step 2 can leave state half-loaded
(the objects before it are loaded); everything read from disk was checked before step 2.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

import torch

from ..coord.dist import Coordinator, PhaseFailures, describe_exception
from ..coord.verify_split import (
    local_position,
    page_cache_id,
    shared_digest,
    shares_complete,
    split_shared,
)
from ..errors import CorruptCheckpoint, IncompatibleCheckpoint, RankMismatch, SafeckptWarning
from ..format.manifest import CHECKSUM_FIELD, CheckpointInfo, dtype_size
from ..format.sharding import local_box
from ..format.tree import (
    KEEP,
    PER_RANK_ATTR,
    SEP,
    Leaf,
    decode,
    encode_object,
    escape_key,
    kind_of,
    merge_into,
    param_names,
    tensor_keys,
    unescape_key,
    unwrap_module,
)
from ..format.v3 import FORMAT_V3, Layout
from ..storage.base import Storage, resolve, storage_for
from . import frozen as _frozen
from . import optim as _optim
from .gc_pause import paused_gc
from .prefault import Prefault
from .reader import TensorReader, open_manifest, read_threads


def load(
    path: str | os.PathLike[str],
    state: MutableMapping[str, Any],
    *,
    strict: bool | Literal["entries"] = True,
    timeout: float | None = None,
    verify_checksums: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Load the checkpoint at ``path`` into ``state`` in place (collective).

    With ``strict=False`` the intersection is loaded and the returned info's ``skipped`` lists
    what was left out. ``strict="entries"``: only ``state``'s entries are loaded (the
    checkpoint's other entries are left out, e.g. a model alone from a training checkpoint),
    strictly: an entry missing from the checkpoint, or a key, shape or dtype that differs inside
    one, raises ``IncompatibleCheckpoint`` before anything is changed.
    ``verify_checksums=False`` skips checksum verification for speed.
    ``storage_options``: the fsspec filesystem's options for a URL ``path``.
    """
    # GC paused for the whole load, as for a save: a load allocates tens of thousands of
    # small objects (the parsed manifest, chunk bookkeeping), and in a process with torch's
    # heap each collection they trigger is expensive (json.loads of a 1 MB manifest: 55 ms
    # with collections, 11 ms without).
    if strict not in (True, False, "entries"):
        raise ValueError(f"strict must be True, False or 'entries', got {strict!r}")
    with paused_gc():
        return _load(path, state, strict, timeout, verify_checksums, storage_options)


def files_needed(path: str, man: dict[str, Any], state: MutableMapping[str, Any], *, strict: bool | str,
                 rank: int, world_size: int) -> set[str] | None:
    """The data files a load of ``man`` (a validated manifest, as stored) into ``state`` reads on
    ``rank``, planned as the load plans them but without opening any file; None when that is not
    known (a format older than 3, or a state the plan refuses: then every file)."""
    if man.get("format_version") != FORMAT_V3:
        return None
    try:
        target = state
        if _frozen.has_frozen(state) and _frozen.ENTRY in man.get("objects", {}):
            target = _frozen.for_load(state, True)
        with paused_gc(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the load itself warns
            job = _LoadJob(path, man, target, strict, rank, True, world_size, storage_for(path))
            job.plan(open_reader=False)
            assert job.layout is not None
            return job.layout.files_for(job.reader_targets(), rank)
    except Exception:  # noqa: BLE001 - the load itself reports what does not fit
        return None


def _load(path: str | os.PathLike[str], state: MutableMapping[str, Any], strict: bool | str, timeout: float | None,
          verify_checksums: bool, storage_options: Mapping[str, Any] | None) -> CheckpointInfo:
    target = resolve(path)
    coord = Coordinator(timeout, what=f"load from {target}")
    store = storage_for(target, storage_options, timeout=coord.timeout)
    unchanged = "Nothing was loaded; the state is unchanged."
    jobs: list[_LoadJob] = []
    live_frozen = _frozen.has_frozen(state)
    views: list[dict[str, Any]] = []  # the state seen through frozen-parameter fingerprints

    def check() -> dict[str, Any]:
        """Every rank reads the manifest itself (ranks agree on its checksum below), plans,
        reads the indexes of the files it needs and verifies what it will copy."""
        try:
            man = open_manifest(target, store, full=False)
            if live_frozen and _frozen.ENTRY in man.get("objects", {}):  # saved as fingerprints: verify them
                views.append(_frozen.for_load(state, True))
            job = _LoadJob(target, man, views[0] if views else state, strict, coord.rank, verify_checksums,
                           coord.world_size, store)
            jobs.append(job)
            job.plan()
            job.check()
            return {"path": target, "manifest": man.get(CHECKSUM_FIELD), "share": job.share}
        except Exception as exc:  # noqa: BLE001 - reported with the path: a path mismatch comes first
            return {"path": target, "error": describe_exception(exc)}

    try:
        decision = coord.decide("check", check, _resolve_check, hint=unchanged)
        job = jobs[0]
        if decision["verify_rest"]:  # a machine's ranks could not share the hashing after all
            coord.decide("check-rest", job.check_rest, lambda _: None, hint=unchanged)
        else:
            job.trust_shared()  # every rank's share checked out
        failed: Exception | None = None
        try:
            job.apply()
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            failed = exc
        if coord.any_true(failed is not None, "apply"):  # one tiny all-reduce when all went well
            coord.run("apply", lambda: _reraise(failed))
        if views:
            _frozen.copy_back(state, views[0])
    finally:
        for job in jobs:
            job.close()
    return CheckpointInfo.from_manifest(target, job.man, skipped=tuple(job.skipped))


def _resolve_check(values: list[dict[str, Any]]) -> dict[str, Any]:
    """Coordinator: same path and manifest everywhere, every rank's check passed, and whether
    the ranks of each machine covered every chunk they share."""
    ref = values[0]
    bad = [f"rank {r} was called with path {v['path']!r}" for r, v in enumerate(values) if v["path"] != ref["path"]]
    if bad:
        raise RankMismatch(f"load: ranks were called with different paths (rank 0: {ref['path']!r}); "
                           + "; ".join(bad[:20]))
    failures = {r: v["error"] for r, v in enumerate(values) if "error" in v}
    if failures:
        raise PhaseFailures(failures)
    if any(v["manifest"] != ref["manifest"] for v in values):
        raise RankMismatch(f"load: ranks read different manifests at {ref['path']!r} (it was replaced "
                           "while they read it); nothing was loaded, retry the load")
    return {"verify_rest": not shares_complete([v["share"] for v in values])}


def _reraise(exc: Exception | None) -> None:
    if exc is not None:
        raise exc


NO_COPY = object()  # this rank has no saved copy of a per-rank entry (it keeps its state)


def _roll_back(state: MutableMapping[str, Any], backups: dict[str, Any], names: list[str]) -> bool:
    """Give each named object its backed-up state again; False if any refused."""
    ok = True
    for name in names:
        try:
            state[name].load_state_dict(backups[name])
        except Exception:  # noqa: BLE001 - best effort; reported by the caller
            ok = False
    return ok


class _LoadJob:
    def __init__(self, ckpt_dir: str, man: dict[str, Any], state: MutableMapping[str, Any],
                 strict: bool | str, rank: int, verify: bool, world_size: int = 1, store: Storage | None = None) -> None:
        self.dir = ckpt_dir
        self.man = man  # as stored: format 3 holds no chunks (see safeckpt.format.v3)
        self.state = state
        self.strict = strict
        self.rank = rank
        self.world_size = world_size
        self.verify = verify
        self.store = store or storage_for(ckpt_dir)
        self.layout = Layout(man, ckpt_dir, self.store, dtype_size) if man.get("format_version") == FORMAT_V3 else None
        self.objects = man["objects"]
        if self.layout is not None and rank in set(man.get("rank_trees", ())):
            self.objects = self.layout.view({self.layout.file_of[rank]})["objects"]  # this rank's own trees
        self.reader: TensorReader | None = None  # made by plan(), for the files this rank needs
        self.skipped: list[str] = []
        self.targets: dict[str, dict[str, Leaf]] = {}
        self.trees: dict[str, Any] = {}
        self.kinds: dict[str, str] = {}  # kind_of each entry in trees, computed once
        self.optim_plans: dict[str, _optim.OptimPlan] = {}
        self._names: dict[int, str] | None = None
        self.boxes: dict[str, Any] = {}  # key -> local box of each target copied into in place
        self.mismatched: list[str] = []  # keys whose saved dtype/shape differ from the target's
        self.share: dict[str, Any] | None = None  # how this rank shares verification (see check)
        self.shared_skipped: list[tuple[str, int, int]] = []  # chunks another rank of this machine verifies
        self.saved_world = int(man.get("world_size", 1))
        self.per_rank_keys = {k for k, rec in man["tensors"].items() if rec.get("scope") == "per_rank"}

    def record(self, key: str) -> dict[str, Any]:
        """The manifest record of ``key`` (for an alias, the record of the tensor it shares)."""
        try:
            rec = self.man["tensors"][key]
            return self.man["tensors"][rec["alias_of"]] if "alias_of" in rec else rec
        except KeyError:
            raise CorruptCheckpoint(f"manifest tree refers to tensor {key!r} that it does not describe",
                                    path=self.dir) from None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def _tree_for(self, name: str, value: Any) -> Any:
        """The saved tree to load into ``value``, or NO_COPY when this rank has none. (Its
        warnings point at the caller of ``load``: _tree_for < plan < check < decide < _load <
        load < caller, stacklevel 7.)"""
        obj = self.objects[name]
        saved_world = self.saved_world
        per_rank = bool(getattr(value, PER_RANK_ATTR, False)) or (
            bool(self.per_rank_keys) and any(k in self.per_rank_keys for k in tensor_keys(obj["tree"]))
        )
        # Rule for per-rank state across world sizes: rank r restores what rank r saved; ranks
        # the saving run did not have keep their current state; extra saved copies are unused.
        if per_rank and self.rank >= saved_world:
            warnings.warn(
                f"{name!r} is per-rank state saved by {saved_world} rank(s); rank {self.rank} has "
                "no saved copy and keeps its current state.", SafeckptWarning, stacklevel=7,
            )
            return NO_COPY
        if per_rank and saved_world != self.world_size and self.rank == 0:
            rule = f"rank r restores the state saved by rank r (r < {min(saved_world, self.world_size)})"
            if self.world_size > saved_world:
                rule += f"; ranks {saved_world}-{self.world_size - 1} keep their current state"
            else:
                rule += f"; the copies saved by ranks {self.world_size}-{saved_world - 1} are not used"
            warnings.warn(
                f"{name!r} is per-rank state saved by {saved_world} rank(s) and loaded by "
                f"{self.world_size}: {rule}.", SafeckptWarning, stacklevel=7,
            )
        return obj.get("rank_trees", {}).get(str(self.rank), obj["tree"])

    def plan(self, open_reader: bool = True) -> dict[str, Any] | None:
        problems: list[str] = []
        saved = self.objects
        for name in saved:
            if name not in self.state and self.strict != "entries":
                problems.append(f"unexpected entry {name!r} (in the checkpoint, not in state)")
        for name, value in self.state.items():
            if name not in saved:
                problems.append(f"missing entry {name!r} (in state, not in the checkpoint)")
                continue
            tree = self._tree_for(name, value)
            if tree is NO_COPY:
                continue
            self.trees[name] = tree
            kind = self.kinds[name] = kind_of(value)
            if kind == "stateful":
                if _optim.needs_mapping(value, tree):
                    if self._names is None:
                        self._names = param_names(self.state)
                    plan, optim_problems = _optim.plan_load(name, value, tree, self._names, self.record)
                    problems += optim_problems
                    if plan is None:
                        del self.trees[name]  # not loadable: skipped on a non-strict load
                    else:
                        self.optim_plans[name] = plan
                elif isinstance(value, torch.optim.Optimizer) and _optim.is_optimizer_tree(tree):
                    orphans = _optim.orphan_state_keys(tree)
                    if orphans:
                        problems.append(
                            f"{name}: saved optimizer state for {len(orphans)} key(s) in no param "
                            f"group (e.g. {orphans[0]!r}); it would attach to no parameter"
                        )
                        del self.trees[name]
                continue
            leaves: list[Leaf] = []
            encode_object(name, value, leaves)
            have = {leaf.key: leaf for leaf in leaves}
            keys = list(tensor_keys(tree))
            if len(keys) != 1 or len(have) != 1 or keys[0] not in have:  # not just one tensor, as saved
                stored = set(keys)
                for key in sorted(stored - set(have)):
                    problems.append(f"unexpected key {key!r}")
                for key in sorted(set(have) - stored):
                    problems.append(f"missing key {key!r}")
                keys = sorted(stored & have.keys())
            matched = {}
            for key in keys:
                rec = self.record(key)
                leaf = have[key]  # its shape and dtype code, computed once when it was made
                if leaf.shape != rec["shape"] or leaf.dtype != rec["dtype"]:
                    self.mismatched.append(key)
                    problems.append(
                        f"key {key!r}: checkpoint has {rec['dtype']}{rec['shape']}, "
                        f"target has {leaf.dtype}{leaf.shape}"
                    )
                else:
                    matched[key] = have[key]
            self.targets[name] = matched
        self.boxes = {key: local_box(leaf.tensor) if leaf.scope == "sharded" else [[0] * len(leaf.shape), leaf.shape]
                      for matched in self.targets.values() for key, leaf in matched.items()}
        if self.mismatched and self.layout is not None:
            # A signed manifest whose dtype or shape the files' indexes contradict is damage,
            # not a state that does not fit (restore falls back past damage): check them first.
            self.layout.view(self.layout.files_for([(k, None) for k in self.mismatched], self.rank))
        if problems and self.strict:
            raise IncompatibleCheckpoint(
                f"checkpoint {self.dir} does not fit the state (strict load):\n  "
                + "\n  ".join(problems[:40])
                + ("\n  ..." if len(problems) > 40 else "")
                + ("\nPass strict=False to load the entries that fit." if self.strict is True
                   else "\nA non-strict load takes what fits.")
            )
        self.skipped = problems
        if open_reader:
            self._open_reader()

    def reader_targets(self) -> list[tuple[str, Any]]:
        """(key, local box) of every tensor this rank reads: in place (``boxes``) and into fresh
        tensors (stateful objects: box None, the whole tensor), once :meth:`plan` ran."""
        self.fresh_targets: list[tuple[str, Any]] = []  # what stateful objects read into new tensors
        for name, tree in self.trees.items():
            if self.kinds[name] != "stateful":
                continue
            if name in self.optim_plans:
                self.fresh_targets += _optim.plan_targets(self.optim_plans[name], self.record)
            else:
                self.fresh_targets += [(k, None) for k in tensor_keys(tree)]
        return [*self.boxes.items(), *self.fresh_targets]

    def _open_reader(self) -> None:
        """The reader over the chunks this rank needs: for format 3, only the indexes of the
        files that hold them are read (an FSDP2 rank at the same world size: its own file)."""
        view = self.man
        targets = self.reader_targets()
        if self.layout is not None:
            view = self.layout.view(self.layout.files_for(targets, self.rank))
        self.reader = TensorReader(self.dir, view, rank=self.rank, verify=self.verify, store=self.store)

    def check(self) -> None:
        """Read stateful objects' state into fresh tensors and verify every chunk the in-place
        targets need; touches nothing in the caller's state (their untouched pages are
        faulted in meanwhile, contents unchanged: see safeckpt.engine.prefault).

        Ranks of one machine reading the same page cache split the hashing of the replicated
        chunks they all need (see safeckpt.coord.verify_split): each verifies its share, and trusts the
        others' once the check phase succeeded on every rank."""
        reader = self.reader
        assert reader is not None
        targets = list(self.boxes.items())
        shared = (self._shared_chunks([*targets, *self.fresh_targets])
                  if self.world_size > 1 and self.verify else [])
        cache = page_cache_id(self.dir) if shared and reader.store.renames else None
        local = local_position()
        mine, self.shared_skipped = (split_shared(shared, *local) if cache is not None and local
                                     else ([c for c, _ in shared], []))
        if local:  # this machine's ranks share its cores (with or without checksums)
            reader.threads = read_threads(local[1])
        self.share = {"cache": cache, "local": local, "shared": shared_digest(shared)} if cache else None
        reader.defer(self.shared_skipped)
        prefault = Prefault([leaf.tensor for matched in self.targets.values() for leaf in matched.values()])
        try:
            self.loaded: dict[str, Any] = {}
            for name, tree in self.trees.items():
                if self.kinds[name] != "stateful":
                    continue
                if name in self.optim_plans:
                    self.loaded[name] = _optim.build_state_dict(self.optim_plans[name], reader)
                else:
                    tensors = reader.new_many(list(tensor_keys(tree)))
                    self.loaded[name] = decode(tree, tensors.__getitem__)
            reader.check_many(targets)
        finally:
            prefault.stop()

    def _shared_chunks(self, targets: list[tuple[str, Any]]) -> list[tuple[tuple[str, int, int], int]]:
        """(chunk, bytes) of the replicated tensors this rank copies or reads whole (``box``
        None: into a fresh tensor): what every rank of a data-parallel job needs alike, so
        ranks of one machine can split their hashing."""
        assert self.reader is not None
        whole = []
        for k, box in targets:
            rec = self.record(k)
            if rec.get("scope") == "replicated" and (box is None or box[1] == rec["shape"]):
                whole.append((k, box if box is not None else [[0] * len(rec["shape"]), rec["shape"]]))
        return sorted((ident, ident[2] - ident[1]) for ident in self.reader.needed(whole))

    def check_rest(self) -> None:
        """Verify the shared chunks this rank left to the others (their split did not hold)."""
        assert self.reader is not None
        self.reader.check_idents(self.shared_skipped)
        self.shared_skipped = []

    def trust_shared(self) -> None:
        assert self.reader is not None
        self.reader.trust_idents(self.shared_skipped)

    def apply(self) -> None:
        """Hand stateful objects their state, then copy verified chunks into place.

        A stateful object's ``load_state_dict`` is the one step that can still fail (it may
        reject state that is well-formed but not what it expects). If it does, the objects
        already loaded get their previous ``state_dict()`` back, so the state is unchanged."""
        backups = {name: self.state[name].state_dict() for name in self.loaded}
        done: list[str] = []
        for name, sd in self.loaded.items():
            try:
                self.state[name].load_state_dict(sd)
                done.append(name)
            except Exception as exc:
                restored = _roll_back(self.state, backups, [*done, name])
                raise IncompatibleCheckpoint(
                    f"{name!r}.load_state_dict rejected the checkpoint's state: "
                    f"{type(exc).__name__}: {exc}. "
                    + ("The state is unchanged." if restored else
                       "Restoring the objects loaded before it failed: the state is partly loaded.")
                ) from exc
        # One fill_many for the in-place targets of every entry (a flat state of 4,000 tensors
        # is 4,000 entries), so small chunks are read in runs, not one by one.
        assert self.reader is not None
        self.reader.fill_many([(key, leaf.tensor) for name in self.trees if self.kinds[name] != "stateful"
                               for key, leaf in self.targets[name].items()], boxes=self.boxes)
        for name, tree in self.trees.items():
            value = self.state[name]
            kind = self.kinds[name]
            if kind == "stateful":
                continue
            matched = self.targets[name]
            if kind == "module":
                self._finish_module(name, value, matched)
            elif kind == "tree":
                # Matched tensors were filled in place; skipped ones stay as they are.
                loaded = decode(tree, lambda k: KEEP)
                self.state[name] = merge_into(value, loaded)

    def _finish_module(self, name: str, module: Any, matched: dict[str, Leaf]) -> None:
        """Tensors were filled in place; call load_state_dict only if they do not alias the module."""
        inner = unwrap_module(module)
        live = {
            (t.to_local() if hasattr(t, "to_local") else t).data_ptr()
            for t in [*inner.parameters(), *inner.buffers()]
        }
        if all(
            (leaf.tensor.to_local() if hasattr(leaf.tensor, "to_local") else leaf.tensor).data_ptr() in live
            or leaf.tensor.numel() == 0
            for leaf in matched.values()
        ):
            return
        prefix = escape_key(name) + SEP
        sd = {unescape_key(k[len(prefix):]): leaf.tensor for k, leaf in matched.items()}
        inner.load_state_dict(sd, strict=bool(self.strict))
