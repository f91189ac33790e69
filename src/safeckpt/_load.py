"""One collective load: open -> plan -> read.

1. open  (coordinator)  read and validate the manifest; every rank gets the same copy, and
                        ranks check they were called with the same path.
2. plan  (all ranks)    match the target state against the checkpoint (keys, shapes, dtypes);
                        on a strict load any mismatch raises IncompatibleCheckpoint on every
                        rank before anything in memory is touched.
3. check (all ranks)    each rank reads what it needs: stateful objects' state into fresh
                        tensors (verified as it is read), and the chunks its in-place targets
                        need are verified against their checksums (ranks of one machine split
                        that work, see _verify_split). Any damage raises CorruptCheckpoint on
                        every rank, and nothing in the caller's state has been touched yet.
4. apply (all ranks)    stateful objects get load_state_dict; verified chunks are copied into
                        the existing tensors in place; plain values are replaced.

Only a user object's own ``load_state_dict`` raising in step 4 can leave state half-loaded
(the objects before it are loaded); everything read from disk was checked before step 4.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from . import _optim
from ._dist import Coordinator
from ._manifest import CheckpointInfo
from ._prefault import Prefault
from ._reader import TensorReader, local_box, open_manifest, read_threads
from ._save import paused_gc
from ._storage import Storage, resolve, storage_for
from ._tree import (
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
from ._verify_split import page_cache_id, split_verification
from .errors import IncompatibleCheckpoint, RankMismatch, SafeckptWarning


def load(
    path: str | os.PathLike[str],
    state: MutableMapping[str, Any],
    *,
    strict: bool = True,
    timeout: float | None = None,
    verify_checksums: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Load the checkpoint at ``path`` into ``state`` in place (collective).

    With ``strict=False`` the intersection is loaded and the returned info's ``skipped`` lists
    what was left out. ``verify_checksums=False`` skips checksum verification for speed.
    ``storage_options``: the fsspec filesystem's options for a URL ``path``.
    """
    # GC paused for the whole load, as for a save: a load allocates tens of thousands of
    # small objects (the parsed manifest, chunk bookkeeping), and in a process with torch's
    # heap each collection they trigger is expensive (json.loads of a 1 MB manifest: 55 ms
    # with collections, 11 ms without).
    with paused_gc():
        return _load(path, state, strict, timeout, verify_checksums, storage_options)


def _load(path: str | os.PathLike[str], state: MutableMapping[str, Any], strict: bool, timeout: float | None,
          verify_checksums: bool, storage_options: Mapping[str, Any] | None) -> CheckpointInfo:
    target = resolve(path)
    coord = Coordinator(timeout, what=f"load from {target}")
    store = storage_for(target, storage_options, timeout=coord.timeout)

    def _open() -> dict[str, Any]:
        return {"path": target, "manifest": open_manifest(target, store) if coord.is_coordinator else None}

    opened = coord.run("open", _open)
    bad = [f"rank {r} was called with path {o['path']!r}" for r, o in enumerate(opened) if o["path"] != target]
    if bad or any(o["path"] != opened[0]["path"] for o in opened):
        raise RankMismatch(
            f"load: ranks were called with different paths (rank 0: {opened[0]['path']!r}); "
            + "; ".join(bad)
        )
    manifest = opened[0]["manifest"]
    job = _LoadJob(target, manifest, state, strict, coord.rank, verify_checksums, coord.world_size, store)
    unchanged = "Nothing was loaded; the state is unchanged."
    try:
        plans = coord.run("plan", job.plan, hint=unchanged)
        job.share_verification(plans)
        coord.run("check", job.check, hint=unchanged)
        job.reader.trust(job.verified_by_others)  # every rank's share checked out
        coord.run("apply", job.apply)
    finally:
        job.reader.close()
    return CheckpointInfo.from_manifest(target, manifest, skipped=tuple(job.skipped))


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
                 strict: bool, rank: int, verify: bool, world_size: int = 1, store: Storage | None = None) -> None:
        self.dir = ckpt_dir
        self.man = man
        self.state = state
        self.strict = strict
        self.rank = rank
        self.world_size = world_size
        self.reader = TensorReader(ckpt_dir, man, rank=rank, verify=verify, store=store)
        self.skipped: list[str] = []
        self.targets: dict[str, dict[str, Leaf]] = {}
        self.trees: dict[str, Any] = {}
        self.kinds: dict[str, str] = {}  # kind_of each entry in trees, computed once
        self.optim_plans: dict[str, _optim.OptimPlan] = {}
        self._names: dict[int, str] | None = None
        self.boxes: dict[str, Any] = {}  # key -> local box of each target copied into in place
        self.my_share: set[int] | None = None  # chunk indices this rank verifies (None: all)
        self.verified_by_others: list[int] = []
        self.saved_world = int(man.get("world_size", 1))
        self.per_rank_keys = {k for k, rec in man["tensors"].items() if rec.get("scope") == "per_rank"}

    def _tree_for(self, name: str, value: Any) -> Any:
        """The saved tree to load into ``value``, or NO_COPY when this rank has none."""
        obj = self.man["objects"][name]
        saved_world = self.saved_world
        per_rank = bool(getattr(value, PER_RANK_ATTR, False)) or (
            bool(self.per_rank_keys) and any(k in self.per_rank_keys for k in tensor_keys(obj["tree"]))
        )
        # Rule for per-rank state across world sizes: rank r restores what rank r saved; ranks
        # the saving run did not have keep their current state; extra saved copies are unused.
        if per_rank and self.rank >= saved_world:
            warnings.warn(
                f"{name!r} is per-rank state saved by {saved_world} rank(s); rank {self.rank} has "
                "no saved copy and keeps its current state.", SafeckptWarning, stacklevel=4,
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
                f"{self.world_size}: {rule}.", SafeckptWarning, stacklevel=4,
            )
        return obj.get("rank_trees", {}).get(str(self.rank), obj["tree"])

    def plan(self) -> dict[str, Any] | None:
        problems: list[str] = []
        saved = self.man["objects"]
        for name in saved:
            if name not in self.state:
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
                    plan, optim_problems = _optim.plan_load(name, value, tree, self._names, self.reader.record)
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
                rec = self.reader.record(key)
                leaf = have[key]  # its shape and dtype code, computed once when it was made
                if leaf.shape != rec["shape"] or leaf.dtype != rec["dtype"]:
                    problems.append(
                        f"key {key!r}: checkpoint has {rec['dtype']}{rec['shape']}, "
                        f"target has {leaf.dtype}{leaf.shape}"
                    )
                else:
                    matched[key] = have[key]
            self.targets[name] = matched
        self.boxes = {key: local_box(leaf.tensor) if leaf.scope == "sharded" else [[0] * len(leaf.shape), leaf.shape]
                      for matched in self.targets.values() for key, leaf in matched.items()}
        if problems and self.strict:
            raise IncompatibleCheckpoint(
                f"checkpoint {self.dir} does not fit the state (strict load):\n  "
                + "\n  ".join(problems[:40])
                + ("\n  ..." if len(problems) > 40 else "")
                + "\nPass strict=False to load the entries that fit."
            )
        self.skipped = problems
        if self.world_size == 1:
            return None
        cache = page_cache_id(self.dir) if self.reader.store.renames else None
        return {"cache": cache, "need": self.reader.needed_ids(list(self.boxes.items()))}

    def share_verification(self, plans: list[dict[str, Any] | None]) -> None:
        """Take this rank's share of the chunk verification (see _verify_split), and size the
        reader's thread pool for the ranks that share this machine."""
        if self.world_size == 1 or any(p is None for p in plans):
            return
        mine = plans[self.rank]["cache"]
        if mine is not None:
            self.reader.threads = read_threads(sum(p["cache"] == mine for p in plans))
        sizes = [end - start for _, start, end in self.reader.chunk_ids()]
        shares = split_verification(plans, sizes)
        self.my_share = shares[self.rank]
        self.verified_by_others = sorted(set(plans[self.rank]["need"]) - self.my_share)

    def check(self) -> None:
        """Read stateful objects' state into fresh tensors and verify every chunk the in-place
        targets need; touches nothing in the caller's state (their untouched pages are
        faulted in meanwhile, contents unchanged: see _prefault)."""
        prefault = Prefault([leaf.tensor for matched in self.targets.values() for leaf in matched.values()])
        try:
            self.loaded: dict[str, Any] = {}
            for name, tree in self.trees.items():
                if self.kinds[name] != "stateful":
                    continue
                if name in self.optim_plans:
                    self.loaded[name] = _optim.build_state_dict(self.optim_plans[name], self.reader)
                else:
                    tensors = self.reader.new_many(list(tensor_keys(tree)))
                    self.loaded[name] = decode(tree, tensors.__getitem__)
            self.reader.check_many(list(self.boxes.items()), only=self.my_share)
        finally:
            prefault.stop()

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
        inner.load_state_dict(sd, strict=self.strict)
