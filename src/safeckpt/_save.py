"""One collective save: agree -> stage -> write -> commit.

Call sequence (every step is a Coordinator phase, so a failure anywhere is reported on every
rank and no rank waits forever):

1. agree   (all ranks)    encode the state; exchange path, step, layout hash, shard boxes and,
                          optionally, replica digests; mismatch -> RankMismatch, nothing written.
2. stage   (coordinator)  check the target, prepare the staging place (``_commit.begin``).
   probe   (all ranks)    with a staging directory: every rank sees it (shared storage), before
                          anything is written.
3. write   (all ranks)    write this rank's file (its share of replicated bytes, its shards, its
                          per-rank state) with checksums, durably; report sizes and hashes.
4. commit  (coordinator)  check every file's size, write the manifest, publish atomically.

The storage steps are ``safeckpt._commit``'s, on the path's :class:`~safeckpt._storage.Storage`
(a local directory or an object store): one job class serves both. On any failure the
coordinator removes what the save wrote after all ranks have reported (never raising over the
save's error); the previous checkpoint at the path is never touched.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
import zlib
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import torch
import xxhash
from torch import nn

from . import __version__, _commit
from ._catalog import remember_published
from ._dist import Coordinator
from ._manifest import FORMAT, FORMAT_VERSION, CheckpointInfo
from ._manifest_text import ManifestPieces
from ._manifest_text import encode as encode_manifest_text
from ._plan import plan_replicated
from ._reader import local_box as _local_box
from ._reader import placement_of
from ._shardfile import tensor_bytes
from ._staging import PendingCopies, copy_aside
from ._storage import Storage, resolve, storage_for
from ._tree import EncodedObject, Leaf, encode_state, escape_key, param_names
from .errors import CheckpointError, RankMismatch

CHECK_REPLICAS = ("auto", "error", "warn", "off")


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
) -> CheckpointInfo:
    """Save ``state`` to the directory ``path`` (collective: every rank calls it identically).

    The checkpoint appears atomically and complete, or not at all. ``check_replicas`` controls
    the check that replicated tensors are identical on every rank: ``"auto"`` (error when a
    DDP-wrapped module is in ``state``, else off), ``"error"``, ``"warn"`` or ``"off"``.
    ``storage_options``: the fsspec filesystem's options for a URL ``path`` (endpoint,
    credentials; see the README's "Remote roots"); ignored for local paths.
    """
    if check_replicas not in CHECK_REPLICAS:
        raise ValueError(f"check_replicas must be one of {CHECK_REPLICAS}, got {check_replicas!r}")
    target = resolve(path)
    coord = Coordinator(timeout, what=f"save to {target}")
    store = storage_for(target, storage_options, timeout=coord.timeout)
    job = new_job(coord, target, state, metadata, overwrite, step, metrics, check_replicas, store=store)
    return job.run()


def new_job(coord: Coordinator, target: str, *args: Any, store: Storage | None = None) -> _SaveJob:
    """The save job for ``target`` (a local directory or an fsspec URL) on ``store`` (default:
    the storage of ``target`` without options)."""
    job = _SaveJob(coord, target, *args)
    job.store = store or storage_for(target, timeout=getattr(coord, "timeout", None))
    return job


class _SaveJob:
    store: Storage  # where the files go (set by new_job)

    def __init__(self, coord: Coordinator, target: str, state: Mapping[str, Any], metadata: Any,
                 overwrite: bool, step: int | None, metrics: Any, check_replicas: str) -> None:
        self.coord = coord
        self.target = target
        self.state = state
        self.metadata = dict(metadata or {})
        self.metrics = dict(metrics or {})
        self.overwrite = overwrite
        self.step = step
        self.check_replicas = check_replicas
        self.objects: list[EncodedObject] = []
        self.leaves: dict[str, Leaf] = {}
        self.tensor_table: dict[str, dict[str, Any]] = {}
        self.items: list[tuple[str, torch.Tensor]] = []
        self.records: list[dict[str, Any]] = []
        self.aliases: dict[str, str] = {}  # key -> the key whose bytes it shares (stored once)
        self.from_rank0: set[str] = set()  # replicated keys written by rank 0 alone, unchecked
        self.copies = PendingCopies()  # snapshot copies still running on a GPU
        self.pieces = ManifestPieces()  # the plan's cached manifest JSON (set with the plan)

    # ------------------------------------------------------------------ phases
    def run(self) -> CheckpointInfo:
        """A synchronous save: the caller waits for all of it, so GC stays paused throughout
        (the commit of 4,000 tensors allocates ~40k objects; collections ran inside it)."""
        with paused_gc():
            self.agree()
            return self.finish()

    def agree(self) -> None:
        """Phase 1 (all ranks): encode, check agreement, and fix this rank's write items."""
        with paused_gc():
            self._agree_and_plan()

    def _agree_and_plan(self) -> None:
        agreed = self.coord.run("agree", self._agree, hint="Nothing was written.")
        self._check_agreement(agreed)
        self.items, self.records, self.tensor_table, self.pieces = self._planned_items()

    def _tensor_table(self) -> dict[str, dict[str, Any]]:
        """The manifest's tensor records without chunks (read-only once built: it is cached)."""
        table = {}
        for k, leaf in sorted(self.leaves.items()):
            rec = {"dtype": leaf.dtype, "shape": leaf.shape, "scope": leaf.scope}
            if leaf.scope == "sharded":
                rec["placement"] = placement_of(leaf.tensor)
            if k in self.aliases:
                rec["alias_of"] = self.aliases[k]
            table[k] = rec
        return table

    def snapshot(self, pool: SnapshotPool) -> None:
        """Copy this rank's write items aside (into reusable buffers from ``pool``), so the
        caller may change the live state while the rest of the save runs in the background."""
        srcs = [t for _, t in self.items]  # plain tensors: shards are local already
        with paused_gc():
            staged, bufs = pool.staged(self.plan_key, self.items)
            self.copies = copy_aside(bufs, srcs)  # GPU copies may still run: finish() waits
        self.items = staged
        self.leaves = {}  # drop references to live tensors; the manifest needs only the layout
        self.state = {}

    def finish(self) -> CheckpointInfo:
        """Phases 2-4: stage (coordinator), write (all ranks), commit (coordinator)."""
        self.copies.wait()  # an async save's device-to-host copies
        staging = self.coord.run("stage", self._stage, hint="Nothing was written.")[0]
        try:
            if self.store.renames and self.coord.world_size > 1:
                self.coord.run("probe", lambda: _commit.probe(self.store, staging, self.coord.rank),
                               hint="Nothing was written.")
            written = self.coord.run(
                "write", lambda: self._write(staging),
                hint="No checkpoint was published; the previous one (if any) is intact.",
            )
            info = self.coord.run(
                "commit", lambda: self._commit(staging, written),
                hint="No checkpoint was published; the previous one (if any) is intact.",
                done_hint=f"Rank 0 published the checkpoint {self.target} before the failure: "
                "it is complete and loadable.",
            )[0]
        except BaseException:
            if self.coord.is_coordinator and staging:
                _commit.discard(self.store, self.target, staging)
            raise
        return CheckpointInfo(**{**info, "metrics": self.metrics, "metadata": self.metadata})

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
        self.from_rank0 = {k for name, v in self.state.items() if isinstance(v, nn.Module)
                           for k in ddp_broadcast_buffers(name, v)
                           if k in self.leaves and self.leaves[k].scope == "replicated" and k not in self.aliases}
        layout = self._layout()
        boxes = {
            k: _local_box(leaf.tensor) for k, leaf in self.leaves.items() if leaf.scope == "sharded"
        }
        self.layout = layout
        # A digest for the other ranks to compare with theirs; one rank agrees with itself, and
        # for 4,000 tensors the digest costs 3 ms of the time an async save blocks.
        self.layout_hash = hashlib.sha256(json.dumps(layout).encode()).hexdigest() if self.coord.world_size > 1 else ""
        return {
            "path": self.target,
            "step": self.step,
            "overwrite": self.overwrite,
            "layout_hash": self.layout_hash,
            "boxes": boxes,
            "digests": self._replica_digests() if self._replica_mode() != "off" else None,
        }

    def _layout(self) -> list[Any]:
        objs = [[o.name, o.kind] for o in self.objects]
        tensors = [
            [k, leaf.dtype, leaf.shape, leaf.scope, self.aliases.get(k)]
            for k, leaf in sorted(self.leaves.items())
        ]
        return [objs, tensors, sorted(self.from_rank0)]

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

    def _check_agreement(self, agreed: list[dict[str, Any]]) -> None:
        ref = agreed[0]
        problems = []
        for field in ("path", "step", "overwrite"):
            for r, a in enumerate(agreed):
                if a[field] != ref[field]:
                    problems.append(f"rank {r} was called with {field}={a[field]!r} but rank 0 with {ref[field]!r}")
        if not problems and any(a["layout_hash"] != ref["layout_hash"] for a in agreed):
            layouts = self.coord.run("describe-layout", self._layout)
            problems += _layout_differences(layouts)
        if problems:
            raise RankMismatch(
                f"save to {self.target}: ranks disagree, nothing was written:\n  "
                + "\n  ".join(problems[:20])
                + "\nEvery rank must call save() with the same path/step and the same state "
                "structure (compute paths on one rank, or from the step, not from a clock)."
            )
        mode = self._replica_mode()
        if mode != "off" and ref["digests"] is not None:
            bad = sorted({
                f"rank {r}: {k}"
                for r, a in enumerate(agreed)
                for k, d in (a["digests"] or {}).items()
                if ref["digests"].get(k) != d
            })
            if bad:
                msg = (
                    f"save to {self.target}: replicated tensors differ from rank 0's on "
                    + "; ".join(bad[:10])
                    + ". A tensor that is not sharded is saved once for all ranks, so the "
                    "other ranks' values would be lost. If it is meant to differ per rank, wrap "
                    "its entry in safeckpt.PerRank(...) (kept per rank); if not, the ranks have "
                    "diverged (different init seeds, a rank-local update). Nothing was written."
                )
                if mode == "error":
                    raise RankMismatch(msg)
                import warnings

                from .errors import SafeckptWarning

                warnings.warn(msg, SafeckptWarning, stacklevel=3)
        self.boxes = [a["boxes"] for a in agreed]

    def _stage(self) -> dict[str, str] | None:
        if not self.coord.is_coordinator:
            return None
        return _commit.begin(self.store, self.target, self.overwrite)

    def _planned_items(self) -> tuple[list[tuple[str, torch.Tensor]], list[dict[str, Any]], dict[str, Any],
                                      ManifestPieces]:
        """:meth:`_my_items`, the tensor table and the manifest's JSON pieces, from a cache
        keyed by the agreed layout: a training loop saves the same layout every time, and for
        thousands of tensors planning is a large part of the time an async save blocks."""
        sharded = any(leaf.scope == "sharded" for leaf in self.leaves.values())
        placements = json.dumps([self.boxes, [placement_of(leaf.tensor) for _, leaf in sorted(self.leaves.items())
                                              if leaf.scope == "sharded"]]) if sharded else ""
        layout, self.layout = self.layout, None  # freed now if an equal plan is cached (8,000 lists)
        self.plan_key, cached = _cached_plan((layout, placements, self.coord.rank, self.coord.world_size))
        if cached is None:
            items, records = self._my_items()
            specs = [(name, rec["key"], _how(self.leaves[rec["key"]], rec))
                     for (name, _), rec in zip(items, records, strict=True)]
            cached = (specs, records, self._tensor_table(), ManifestPieces())
            _PLANS.append((self.plan_key, cached))
            del _PLANS[:-8]
        specs, records, table, pieces = cached
        items = []
        leaves = self.leaves
        for name, key, how in specs:
            t = leaves[key].tensor
            if how is not None:
                t = t.to_local() if how == "local" else t.narrow(0, *how)
            items.append((name, t))
        return items, records, table, pieces

    def _my_items(self) -> tuple[list[tuple[str, torch.Tensor]], list[dict[str, Any]]]:
        """What this rank writes: (name in file, tensor) plus a manifest record for each."""
        rank, world = self.coord.rank, self.coord.world_size
        items: list[tuple[str, torch.Tensor]] = []
        records: list[dict[str, Any]] = []
        specs = [
            (k, leaf.shape, leaf.itemsize)
            for k, leaf in sorted(self.leaves.items())
            if leaf.scope == "replicated" and k not in self.aliases and k not in self.from_rank0
        ]
        if rank == 0:  # buffers DDP takes from rank 0: rank 0's values are the model's
            for k in sorted(self.from_rank0):
                leaf = self.leaves[k]
                items.append((k, leaf.tensor))
                records.append({"key": k, "name": k, "offsets": [0] * len(leaf.shape), "sizes": leaf.shape})
        for piece in plan_replicated(specs, world):
            if piece.rank != rank:
                continue
            leaf = self.leaves[piece.key]
            t, shape = leaf.tensor, leaf.shape
            if shape and (piece.row_start, piece.rows) != (0, shape[0]):
                t = t.narrow(0, piece.row_start, piece.rows)
                name = f"{piece.key}@{piece.row_start}"
                sizes = [piece.rows, *shape[1:]]
            else:
                name, sizes = piece.key, shape
            offsets = [piece.row_start] + [0] * (len(shape) - 1) if shape else []
            items.append((name, t))
            records.append({"key": piece.key, "name": name, "offsets": offsets, "sizes": sizes})

        for k, leaf in sorted(self.leaves.items()):
            if leaf.scope == "replicated":
                continue
            if k in self.aliases:
                continue  # its bytes are the aliased tensor's, written once under that key
            if leaf.scope == "per_rank":
                items.append((k, leaf.tensor))
                records.append({"key": k, "name": k, "offsets": [0] * leaf.tensor.dim(),
                                "sizes": leaf.shape, "rank": rank})
            elif leaf.scope == "sharded":
                box = self.boxes[rank][k]
                # replicas of a shard (HSDP) are written once, by one of their holders chosen
                # per key (crc32 is the same on every rank) so writes spread over the replicas
                holders = [r for r in range(world) if self.boxes[r][k] == box]
                owner = holders[zlib.crc32(k.encode()) % len(holders)]
                if owner != rank or 0 in box[1]:
                    continue  # another rank writes this replica of the shard, or it is empty
                name = f"{k}@" + ",".join(map(str, box[0]))
                items.append((name, leaf.tensor.to_local()))
                records.append({"key": k, "name": name, "offsets": box[0], "sizes": box[1]})

        return items, records

    def _write(self, staging: dict[str, str]) -> dict[str, Any]:
        fname, written = _retry_missing_dir(
            lambda: _commit.write(self.store, staging, self.coord.rank, self.items, {"format": FORMAT}),
            staging["path"],
        )
        return self._report(fname, written)

    def _report(self, fname: str, written: Any) -> dict[str, Any]:
        """What this rank tells the coordinator about the file it wrote: its chunks as
        ManifestPieces.chunk_report renders them (the coordinator joins them without parsing)."""
        return {
            "file": fname,
            "size": written.size,
            "xxh3_128": written.xxh3_128,
            "chunks": self.pieces.chunk_report(self.records, fname, written),
            "objects": {o.name: {"kind": o.kind, "tree": o.tree} for o in self.objects},
        }

    def _commit(self, staging: dict[str, str], written: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.coord.is_coordinator:
            return None
        files = _commit.check_written(self.store, staging, written)
        head, objects = self._manifest_head(files, written)
        raw = encode_manifest_text(head, objects,
                                   self.pieces.tensors_json(self.tensor_table, [w["chunks"] for w in written]))
        _commit.commit(self.store, self.target, staging, raw, overwrite=self.overwrite, files=files)
        remember_published(self.store, self.target, head)
        return self._committed_info(head, files)

    def _committed_info(self, manifest: dict[str, Any], files: dict[str, Any]) -> dict[str, Any]:
        """What every rank learns about the checkpoint just published."""
        return {
            "path": self.target,
            "step": self.step,
            "world_size": self.coord.world_size,
            "created_at": manifest["created_at"],
            "nbytes": sum(f["size"] for f in files.values()),
        }

    def _manifest_head(self, files: dict[str, Any], written: list[dict[str, Any]]) -> tuple[dict[str, Any], dict]:
        """The manifest's top-level fields before ``objects`` and ``tensors`` (in file order),
        and its ``objects``; the tensor records come from the plan's pieces."""
        objects: dict[str, Any] = written[0]["objects"]
        if len(written) > 1:  # where other ranks' trees differ from rank 0's, they are kept too
            objects = self._merged_objects(written)
        now = time.time()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.coord.world_size,
            "created_at": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "created_unix": now,
            "safeckpt_version": __version__,
            "torch_version": torch.__version__,
            "metadata": self.metadata,
            "metrics": self.metrics,
            "files": files,
        }
        return manifest, objects

    @staticmethod
    def _merged_objects(written: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0's objects, each with ``rank_trees`` holding the trees of the ranks whose trees differ."""
        objects: dict[str, Any] = {}
        for name, obj in written[0]["objects"].items():
            others = {
                str(r): w["objects"][name]["tree"]
                for r, w in enumerate(written[1:], start=1)
                if w["objects"][name]["tree"] != obj["tree"]
            }
            objects[name] = {**obj, "rank_trees": others} if others else obj
        return objects


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while the training loop waits on us. A save of thousands
    of tensors allocates tens of thousands of small objects, which triggers collections whose
    cost grows with the whole heap of the training process (the profile of an async save of
    4,000 tensors showed most of its time in collections landing in our allocations). The
    objects are freed by reference counting anyway; GC resumes right after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _how(leaf: Leaf, rec: dict[str, Any]) -> Any:
    """How a planned write item comes from its leaf: whole (None), this rank's shard
    ("local"), or a row range ((start, rows))."""
    if leaf.scope == "sharded":
        return "local"
    if "rank" not in rec and rec["sizes"] != leaf.shape:
        return (rec["offsets"][0], rec["sizes"][0])
    return None


_PLANS: list[tuple[tuple, tuple]] = []  # (plan key, (item specs, records, table, JSON pieces)), newest last


def _cached_plan(key: tuple) -> tuple[tuple, tuple | None]:
    """The cached (key, plan) whose key equals ``key``, else (``key``, None). Keys hold the
    layout itself and are compared, not hashed: comparing costs well under the 3 ms a digest
    of 4,000 tensors' layout takes, and the cached key object that is returned makes later
    comparisons (the snapshot pool's) identity checks."""
    for cached_key, plan in reversed(_PLANS):
        if cached_key == key:
            return cached_key, plan
    return key, None


class SnapshotPool:
    """Reusable staging buffers for async saves (pinned when CUDA is present): allocated for
    the first save of a layout, reused as they are by every later save of the same layout."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.items: list[tuple[str, torch.Tensor]] = []
        self.bufs: list[torch.Tensor] = []
        self.by_name: dict[str, torch.Tensor] = {}

    def staged(self, key: tuple, items: list[tuple[str, torch.Tensor]]
               ) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
        """The write items with a buffer in place of each tensor, and the buffers. The same
        lists for every save of the same plan (building them cost ~0.5 ms for 4,000 tensors)."""
        if key == self.key and len(self.bufs) == len(items):
            return self.items, self.bufs
        bufs = []
        for name, src in items:
            buf = self.by_name.get(name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=torch.cuda.is_available())
            bufs.append(buf)
        self.key, self.bufs = key, bufs
        self.items = [(name, buf) for (name, _), buf in zip(items, bufs, strict=True)]
        self.by_name = dict(self.items)
        return self.items, bufs


def ddp_broadcast_buffers(name: str, value: Any) -> list[str]:
    """Tensor keys of the buffers of a DDP module that broadcasts them (the default): DDP
    copies rank 0's buffers to every rank at the start of each forward, so between a step and
    the next forward the ranks legitimately differ (BatchNorm running stats) and rank 0's
    values are the model's. They are written from rank 0 and left out of the replica check."""
    seen = value
    while isinstance(seen, nn.Module) and not isinstance(seen, nn.parallel.DistributedDataParallel):
        seen = getattr(seen, "_orig_mod", None)
    if not isinstance(seen, nn.parallel.DistributedDataParallel) or not getattr(seen, "broadcast_buffers", False):
        return []
    prefix = escape_key(name)
    return [f"{prefix}/{escape_key(fqn)}" for fqn, _ in seen.module.named_buffers()]


def find_aliases(leaves: Mapping[str, Leaf]) -> dict[str, str]:
    """Tensors that are the same memory (tied weights: one Parameter under two names, or two
    identical views of one storage): each maps to the first such key in sorted order, whose
    bytes alone are written. Views that differ (another offset, shape or stride) are stored as
    separate tensors. Computed from the tensors alone, so every rank finds the same aliases."""
    plain = [leaf.tensor.data_ptr() for leaf in leaves.values() if leaf.scope != "sharded"]
    if len(set(plain)) == len(plain) and len(plain) == len(leaves):
        return {}  # no two tensors start at one address (the common case, checked in C)
    first_at: dict[int, str] = {}  # address -> a key there
    shared: dict[int, list[str]] = {}  # address -> every key there, where there are several
    for k, leaf in leaves.items():
        if 0 in leaf.shape:
            continue
        t = leaf.tensor
        if leaf.scope == "sharded":
            t = t.to_local()
            if not t.numel():
                continue
        ptr = t.data_ptr()
        other = first_at.setdefault(ptr, k)
        if other != k:
            shared.setdefault(ptr, [other]).append(k)
    aliases: dict[str, str] = {}
    for keys in shared.values():  # rare (tied weights): only these keys are sorted and compared
        first: dict[tuple, str] = {}
        for k in sorted(keys):
            leaf = leaves[k]
            t = leaf.tensor.to_local() if leaf.scope == "sharded" else leaf.tensor
            ident = (leaf.scope, t.device, leaf.dtype, tuple(t.shape), t.stride(), tuple(leaf.shape))
            if ident in first:
                aliases[k] = first[ident]
            else:
                first[ident] = k
    return aliases


def _first_duplicate(leaves: list[Leaf]) -> str:
    """The first key that two of ``leaves`` share."""
    seen: set[str] = set()
    for leaf in leaves:
        if leaf.key in seen:
            return leaf.key
        seen.add(leaf.key)
    return ""


def replica_digest(t: torch.Tensor) -> str:
    """A digest of a tensor's bytes for the replica check: xxh3-64 on the CPU; for an
    accelerator tensor a position-weighted sum computed on the device (no device-to-host copy of
    the tensor, only of the 8-byte result)."""
    if t.device.type == "cpu":
        return xxhash.xxh3_64_hexdigest(tensor_bytes(t))
    return f"dev-{device_fingerprint(t)}"


def device_fingerprint(t: torch.Tensor, block: int = 1 << 24) -> int:
    """Sum over int32 words w_i of w_i * (2*i + 1) (mod 2**63): any single changed word changes
    it (odd weights), computed in blocks to bound temporary memory. Works on any device."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-data.numel()) % 4
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), block):
        w = words[lo : lo + block].to(torch.int64)
        weights = torch.arange(lo, lo + w.numel(), device=t.device, dtype=torch.int64) * 2 + 1
        total += (w * weights).sum()
    return int(total.item()) ^ (t.numel() << 1)


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
                    f"rank after {attempts * 0.1:.0f}s: the checkpoint directory must be on storage "
                    "shared by all ranks."
                ) from None
            time.sleep(0.1)

