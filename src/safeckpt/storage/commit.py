"""Make a checkpoint appear atomically, or not at all: the steps of one save on any storage.

Single-process functions; ``safeckpt.engine.save`` runs each as a collective phase. Only the
:class:`~safeckpt.storage.base.Storage` interface is used, so the same steps serve a local
directory and an object store:

1. begin   (coordinator)  put back a checkpoint an interrupted overwrite of the target set
                          aside; check the target (an existing checkpoint needs ``overwrite``; anything
                          that is not a checkpoint is never replaced), draw the save's token and
                          let the storage prepare the staging place (a hidden directory on POSIX,
                          nothing on an object store, where files carry the token instead).
2. probe   (all ranks)    every rank checks that it sees that place before anything is written:
                          ranks on other machines with their own local disks fail here, at the
                          first save, with a message saying what to use instead.
3. write   (all ranks)    stream this rank's file, hashed while written.
4. commit  (coordinator)  check every rank's file arrived with the size it reported, put the
                          coordinator's extra files, then ``publish``: the manifest and the
                          atomic step that makes the save visible (rename on POSIX, the manifest
                          PUT itself on an object store). After an object-store overwrite, the
                          objects only the replaced manifest named are deleted.
5. discard (coordinator, after a failure) remove what the save wrote and abort its unfinished
                          uploads; never raises (what it cannot remove is swept later).

Extra files on an object store keep their plain names (``trainer_state.json``: the framework
reads them there), so they cannot carry the token. Where the target holds no manifest they are
put before the manifest, after a token-named sidecar (``.extras.<token>.json``) that lists
them: the manifest PUT stays the one commit point, and the plain-named objects of a save that
died before it are recognised by the sidecar as its leftovers (swept, never "foreign"). Where
the target holds a committed manifest (an overwrite), putting them first would change that
checkpoint's files before the new manifest lands, so they follow the manifest there: a
coordinator killed between the two leaves the new manifest beside the old extra files, which
verify reports (and restore skips).
"""

from __future__ import annotations

import json
import re
import shutil  # noqa: F401 - tests reach shutil.rmtree through this module
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointError, CheckpointExists, CorruptCheckpoint, SafeckptWarning
from ..format.manifest import MANIFEST, max_manifest_bytes, safe_file_path
from .base import Storage

TOKEN_FILE = re.compile(r"^rank-(\d{5})\.([0-9a-f]{12})\.safetensors$")
# The sidecar naming a save's plain-named extra files (see the module docstring). The leading
# dot keeps it apart from every name a user may give: extra and written names may not start
# with one.
EXTRAS_FILE = re.compile(r"^\.extras\.([0-9a-f]{12})\.json$")
EXTRAS_LIMIT = 1 << 20  # bytes read of a sidecar (a list of file names)
PROBE_WAIT = 5.0  # seconds a rank waits to see the staging place (NFS attribute caches)
DISCARD_WAIT = 5.0  # seconds each storage call of the cleanup after a failed save may take
NOT_SHARED = (
    "safeckpt needs one checkpoint location that every rank reads and writes: a shared "
    "filesystem (NFS, Lustre, GPFS, ...) mounted at the same path on every node, or an object "
    "store (s3://bucket/prefix, gs://...). Node-local disks are not supported."
)


def begin(store: Storage, target: str, overwrite: bool) -> dict[str, str]:
    """Coordinator: check ``target``, prepare the staging place; returns what every rank needs
    (``token``, ``path``), as JSON. An overwrite of ``target`` killed half-way is undone first
    (``Storage.put_back``): the checkpoint it set aside is ``target`` again, so it needs
    ``overwrite`` like any committed one and is never silently lost."""
    store.put_back(target)
    _check_target(store, target, overwrite)
    token = uuid.uuid4().hex[:12]
    return {"token": token, "path": store.stage(target, token)}


def _check_target(store: Storage, target: str, overwrite: bool) -> None:
    items = store.list(target)
    files = {i.name for i in items or () if i.kind == "file"}
    if store.renames:  # a directory published by rename: anything at the path is in the way
        if items is None and store.size(target) is None:
            return
        if not overwrite:
            raise _exists(target)
        if items is None or (items and MANIFEST not in files):
            raise CheckpointExists(
                f"{target} exists and is not a safeckpt checkpoint; refusing to replace "
                "it even with overwrite=True. Move it away or choose another path."
            )
        return
    # Objects: a prefix exists only through its objects; token-named ones without a manifest
    # (and the extra files their sidecars name) are leftovers of interrupted saves, not in the way.
    if MANIFEST in files:
        if not overwrite:
            raise _exists(target)
        return
    ours = pending_extras(store, target, files)
    foreign = sorted(n for n in files if not TOKEN_FILE.match(n) and n not in ours)
    if foreign:
        raise CheckpointExists(
            f"{target} holds objects that are not a safeckpt checkpoint "
            f"({', '.join(foreign[:5])}); refusing to write there even with "
            "overwrite=True. Choose another path."
        )


def _exists(target: str) -> CheckpointExists:
    return CheckpointExists(
        f"{target} already exists. Pass overwrite=True to replace it atomically, "
        "or save under a new name (CheckpointManager names steps for you)."
    )


def probe(store: Storage, staging: dict[str, str], rank: int, wait: float = PROBE_WAIT) -> None:
    """Every rank: raise unless this process sees the staging place rank 0 prepared."""
    deadline = time.monotonic() + wait
    while not store.sees(staging["path"]):
        if time.monotonic() >= deadline:
            raise CheckpointError(
                f"rank {rank} does not see {staging['path']}, which rank 0 created {wait:g}s ago: "
                f"the ranks do not share the checkpoint directory. {NOT_SHARED}"
            )
        time.sleep(0.1)


def write(store: Storage, staging: dict[str, str], rank: int, items: Any, metadata: dict[str, str],
          index: Any = None) -> tuple[str, Any]:
    """This rank's data file: (its name, the WrittenFile). ``index``: its file index (format 3)."""
    fname = store.data_name(rank, staging["token"])
    return fname, store.write(store.join(staging["path"], fname), items, metadata, index)


def check_written(store: Storage, staging: dict[str, str], written: list[dict[str, Any]]) -> dict[str, Any]:
    """Coordinator: every rank's file is there with the size it reported; the manifest's
    ``files`` table."""
    files: dict[str, Any] = {}
    where = staging["path"]
    paths = [store.join(where, w["file"]) for w in written]
    if len(paths) > 64:  # one stat (or HEAD) per file: on a parallel FS or object store ~0.1-1 ms each
        with ThreadPoolExecutor(min(32, len(paths) // 32)) as pool:
            sizes = list(pool.map(store.size, paths))
    else:
        sizes = [store.size(p) for p in paths]
    for r, w in enumerate(written):
        actual = sizes[r]
        if actual is None:
            raise CheckpointError(
                f"rank {r} wrote {w['file']} but the coordinator (rank 0) cannot see it in "
                f"{where}. {NOT_SHARED}"
            )
        if actual != w["size"]:
            raise CheckpointError(
                f"rank {r}'s file {w['file']} has {actual} bytes in {where} but rank {r} wrote "
                f"{w['size']}: the storage lost or replaced it (is it shared by all ranks?)"
            )
        files[w["file"]] = {"size": w["size"], "xxh3_128": w["xxh3_128"], "rank": r}
        if "index" in w:  # format 3: where the file's data and index start
            files[w["file"]].update(data=w["data"], index=w["index"])
    return files


def commit(store: Storage, target: str, staging: dict[str, str], manifest: bytes, *, overwrite: bool,
           files: dict[str, Any], extras: Mapping[str, bytes] | None = None) -> str | None:
    """Coordinator: put the ``extras`` (name -> bytes, names already checked) and publish the
    save (the commit point); then drop what it replaced. See the module docstring for where the
    extras go on each storage. Returns what went wrong after the commit point (an overwrite's
    extras not put: the published checkpoint is incomplete), None when nothing did; a failure
    before it raises."""
    extras = dict(extras or {})
    if store.renames:  # inside the staging directory: the rename publishes them with the rest
        _put_all(store, staging["path"], extras)
        _publish(store, staging["path"], target, manifest, overwrite)
        return None
    old = manifest_names(store, target) if overwrite else None
    sidecar = store.join(target, extras_name(staging["token"]))
    if extras and old is None:  # nothing committed here that the extras could change
        store.put(sidecar, json.dumps({"extras": sorted(extras)}).encode())
        _put_all(store, target, extras)
    _publish(store, staging["path"], target, manifest, overwrite)
    # Committed. The sidecar and the replaced checkpoint's objects are garbage now; a failure
    # to delete them leaves leftovers for the next sweep, never an error.
    late = None
    if old is not None:
        try:
            _put_all(store, target, extras)  # the window the module docstring names
        except Exception as exc:  # noqa: BLE001 - the manifest landed: report, do not discard
            late = (f"the checkpoint {target} was published, but putting its extra files "
                    f"({', '.join(sorted(extras))}) after its manifest failed ({type(exc).__name__}: "
                    f"{exc}): it is incomplete (verify reports it, restore skips it). Save it again "
                    "with overwrite=True")
    garbage = sorted((old or set()) - set(files) - set(extras))
    for path in [store.join(target, n) for n in garbage] + ([sidecar] if extras and old is None else []):
        try:
            store.delete(path)
        except Exception:  # noqa: BLE001
            pass
    return late


def _put_all(store: Storage, where: str, extras: Mapping[str, bytes]) -> None:
    for name, data in extras.items():
        store.put(store.join(where, name), data)


def _publish(store: Storage, staging: str, target: str, manifest: bytes, overwrite: bool) -> None:
    try:
        publish(store, staging, target, manifest, replace=overwrite)
    except FileExistsError:
        raise CheckpointExists(
            f"{target} appeared while saving (another job writing the same path?); "
            "nothing was replaced."
        ) from None


def publish(store: Storage, staging: str, final: str, manifest: bytes, *, replace: bool) -> None:
    """The commit point: after it the checkpoint is visible and complete."""
    store.publish(staging, final, manifest, replace=replace)


def named_files(store: Storage, ckpt: str) -> set[str]:
    """Data files the current manifest at ``ckpt`` names (empty if it has none or it is unreadable)."""
    return _names(store.read(store.join(ckpt, MANIFEST), max_manifest_bytes() + 1), ("files",)) or set()


def manifest_names(store: Storage, ckpt: str) -> set[str] | None:
    """Every file the current manifest at ``ckpt`` names (data, extra, written); None if there
    is no manifest (empty if it is unreadable)."""
    raw = store.read(store.join(ckpt, MANIFEST), max_manifest_bytes() + 1)
    return _names(raw, ("files", "extra", "written"))


def _names(raw: bytes | None, tables: tuple[str, ...]) -> set[str] | None:
    if raw is None:
        return None
    try:
        man = json.loads(raw)
        return {str(n) for t in tables for n in man.get(t, {})}
    except (ValueError, AttributeError, TypeError):
        return set()


def extras_name(token: str) -> str:
    """The sidecar of the save with ``token`` (see ``EXTRAS_FILE``)."""
    return f".extras.{token}.json"


def pending_extras(store: Storage, ckpt: str, names: Iterable[str], token: str | None = None) -> set[str]:
    """The sidecars among ``names`` (objects directly in ``ckpt``; only ``token``'s if given) and
    the extra files they list: what saves that did not commit here may have left. A listed name
    that is not a plain file name (a damaged sidecar) is ignored; so is an unreadable sidecar's
    content (the sidecar itself still counts)."""
    out: set[str] = set()
    for name in names:
        m = EXTRAS_FILE.match(name)
        if not m or (token is not None and m.group(1) != token):
            continue
        out.add(name)
        raw = store.read(store.join(ckpt, name), EXTRAS_LIMIT)
        try:
            listed = json.loads(raw or b"{}").get("extras", [])
        except (ValueError, AttributeError):
            continue
        out.update(n for n in listed if _plain(n))
    return out


def _plain(name: Any) -> bool:
    try:
        safe_file_path("", name)
    except CorruptCheckpoint:
        return False
    return name != MANIFEST and not TOKEN_FILE.match(name) and not EXTRAS_FILE.match(name)


def leftover_extras(store: Storage, ckpt: str, names: Iterable[str], token: str | None = None) -> list[str]:
    """What to delete of ``pending_extras``: the sidecars, and the files they list that exist
    and that the manifest at ``ckpt`` (if any) does not name; sidecars last, so that a removal
    cut short still leaves them to recognise the rest."""
    present = set(names)
    pending = pending_extras(store, ckpt, present, token) & present
    if not pending:
        return []
    keep = manifest_names(store, ckpt) or set()
    return sorted(pending - keep, key=lambda n: (bool(EXTRAS_FILE.match(n)), n))


def discard(store: Storage, target: str, staging: dict[str, str]) -> None:
    """Coordinator, after a failed save: remove what it wrote (unless its manifest landed) and
    abort its unfinished uploads. Never raises: this runs while an error is being reported,
    and what it cannot remove (the storage may be what failed) is swept by the next save or
    ``safeckpt gc``."""
    store = store.bounded(DISCARD_WAIT)
    try:
        if store.renames:
            store.delete_tree(staging["path"])
            return
        token = staging["token"]
        if any(token in n for n in named_files(store, target)):
            return  # committed after all (e.g. a timeout after the PUT succeeded)
        present = [i.name for i in store.list(target) or ()]
        for name in present:
            m = TOKEN_FILE.match(name)
            if m and m.group(2) == token:
                store.delete(store.join(target, name))
        for name in leftover_extras(store, target, present, token):
            store.delete(store.join(target, name))
        for upload in store.uploads(target):
            m = TOKEN_FILE.match(upload.path.rsplit("/", 1)[-1])
            if m and m.group(2) == token:
                store.abort(upload)
    except Exception as exc:  # noqa: BLE001 - reported, never raised over the save's error
        warnings.warn(
            f"could not remove what the failed save to {target} wrote ({type(exc).__name__}: "
            f"{exc}); the next save's sweep or `safeckpt gc` removes it.", SafeckptWarning, stacklevel=2,
        )
