"""Files of a checkpoint beside its tensors: the manifest's ``extra`` and ``written``.

Two kinds go in through a save: the coordinator's small files (``extra_files`` -> ``extra``,
plain names: a framework's own JSON such as Trainer's ``trainer_state.json``) and files every
rank writes itself into the staging directory during the save (``write_files`` -> ``written``:
a DeepSpeed engine's checkpoint, whose optimizer partitions are written by the ranks that hold
them). Each rank hashes the files it reports (its own share, never all of them), so the
coordinator receives one record per file and nothing more; the records go into the manifest,
the one rename publishes them with the rest, and verify (and callers about to read them with
another reader) check each file's size and xxh3-128.

``written`` names are relative paths of plain components (``global_step8/mp_rank_00_model_states.pt``),
never absolute, never ``..``, never a name of safeckpt's own (``manifest.json``, ``rank-*`` at
the top, hidden staging names).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import CheckpointError, CorruptCheckpoint
from ..format.manifest import MANIFEST, is_staging_name, is_written_name, written_file_path
from ..format.shardfile import hash_file
from ..storage.base import Storage

WriteFiles = Callable[[str], Iterable[str]]
"""``write_files(staging_dir) -> relative paths``: runs on every rank inside a save's write
phase; writes files under ``staging_dir`` and returns the ones this rank reports."""


def records(root: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """This rank's report: ``{name: {size, xxh3_128}}`` of its files under ``root`` (streamed)."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if not is_written_name(name):
            raise CheckpointError(f"write_files returned {name!r}: not a relative path of plain names "
                                  "(letters, digits, . _ -; no '..', not manifest.json, rank-* or hidden)")
        if name in out:
            raise CheckpointError(f"write_files returned {name!r} twice")
        try:
            size, digest = hash_file(written_file_path(root, name))
        except CorruptCheckpoint as exc:  # missing, a symlink, not a regular file
            raise CheckpointError(f"write_files reported {name!r}, which is not a regular file it "
                                  f"wrote: {exc}") from None
        out[name] = {"size": size, "xxh3_128": digest}
    return out


def merge(reports: list[Mapping[str, Any]], taken: Iterable[str], store: Storage, staging: str
          ) -> dict[str, dict[str, Any]]:
    """Coordinator: every rank's records as the manifest's ``written``; a name reported twice, or
    one the save writes itself (``taken``), or a file whose size differs from what its rank
    reported is an error (nothing is published)."""
    owner: dict[str, int] = {}
    out: dict[str, dict[str, Any]] = {}
    reserved = set(taken)
    for r, rep in enumerate(reports):
        for name, rec in (rep or {}).items():
            if name in reserved:
                raise CheckpointError(f"rank {r} wrote {name!r}, a file the save itself writes")
            if name in owner:
                raise CheckpointError(f"ranks {owner[name]} and {r} both reported {name!r}")
            owner[name] = r
            size = store.size(store.join(staging, name))
            if size != rec["size"]:
                raise CheckpointError(f"rank {r}'s file {name!r} has {size} bytes in {staging}, rank {r} "
                                      f"wrote {rec['size']}: the ranks do not share the directory?")
            out[name] = {"size": int(rec["size"]), "xxh3_128": str(rec["xxh3_128"])}
    if store.renames:  # a file under the staging directory that no rank reported: refuse it
        unlisted = [n for n in tree_share(staging, 0, 1) if n not in out and n not in reserved]
        if unlisted:
            raise CheckpointError(
                f"files were written into {staging} that no rank reported, so nothing would check "
                f"them: {', '.join(unlisted[:5])}" + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
                + " (did the ranks list the directory before every rank finished writing?)")
    return out


def tree_share(root: str, rank: int, world: int, *, under: Iterable[str] = ()) -> list[str]:
    """The files under ``root`` (only those inside the top-level names ``under`` if given),
    sorted, that ``rank`` reports: every ``world``-th one. For hooks whose writes end in a
    barrier (a DeepSpeed save): every rank lists the same complete tree and reports its share,
    so the coordinator still receives each record once. Symlinks and special files are refused."""
    names: list[str] = []
    tops = sorted(under) if under else sorted(n for n in os.listdir(root) if is_written_name(n))
    for top in tops:
        path = os.path.join(root, top)
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode):
            names.append(top)
            continue
        if not stat.S_ISDIR(mode):
            raise CheckpointError(f"{path} is neither a regular file nor a directory; it cannot be "
                                  "part of a checkpoint")
        for d, dirs, files in os.walk(path):
            dirs.sort()
            rel = os.path.relpath(d, root)
            for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
                p = os.path.join(d, f)
                if not stat.S_ISREG(os.lstat(p).st_mode):
                    raise CheckpointError(f"{p} is not a regular file; it cannot be part of a checkpoint")
                names.append(f"{rel}/{f}".replace(os.sep, "/"))
    names.sort()
    return names[rank::world]


def listed(man: Mapping[str, Any]) -> dict[str, Any]:
    """Every file a manifest lists beside its data files: ``extra`` and ``written``, by name."""
    return {**man.get("extra", {}), **man.get("written", {})}


def problems(store: Storage, ckpt: str, man: Mapping[str, Any], *, deep: bool,
             names: Iterable[str] | None = None) -> list[str]:
    """What is wrong with the files ``names`` (default: all) that the manifest ``man`` of the
    checkpoint ``ckpt`` lists beside its data files: missing, another size, and with ``deep``
    another checksum (streamed, never held whole)."""
    files = listed(man)
    out: list[str] = []
    for name in sorted(files) if names is None else names:
        rec = files[name]
        try:
            path = written_file_path(ckpt, name)
        except CorruptCheckpoint as exc:
            out.append(str(exc))
            continue
        size = store.size(path)
        if size is None:
            out.append(f"missing file {name}")
        elif size != rec["size"]:
            out.append(f"{name}: {size} bytes, the manifest says {rec['size']}")
        elif deep:
            try:
                digest = store.hash(path)[1]  # (size, xxh3-128, ...)
            except (CheckpointError, OSError) as exc:
                out.append(f"{name}: {exc}")
                continue
            if digest != rec["xxh3_128"]:
                out.append(f"{name}: checksum mismatch (corrupt data)")
    return out


def verify_files(path: str, names: Iterable[str] | None = None, *, timeout: float | None = None) -> None:
    """Collective: check the files ``names`` (default: all ``extra`` and ``written`` ones) of the committed checkpoint
    at ``path`` before reading them with another reader (a DeepSpeed engine's own load). Every
    rank checks its share (size and xxh3-128, streamed), so the files are read once in all;
    damage anywhere raises CorruptCheckpoint on every rank (a resume then falls back together)."""
    from ..coord.dist import Coordinator
    from ..storage.base import resolve, storage_for
    from .reader import open_manifest

    ckpt = resolve(path)
    coord = Coordinator(timeout, what=f"check of the files of {ckpt}")
    store = storage_for(ckpt, timeout=coord.timeout)

    def mine() -> None:
        man = open_manifest(ckpt, store, full=False)
        files = listed(man)
        wanted = sorted(files) if names is None else sorted(names)
        absent = [n for n in wanted if n not in files]
        if absent:
            raise CorruptCheckpoint(f"{ckpt}: the manifest lists no file {absent[0]!r}", path=ckpt)
        found = problems(store, ckpt, man, deep=True, names=wanted[coord.rank::coord.world_size])
        if found:
            raise CorruptCheckpoint(f"{ckpt}: " + "; ".join(found[:5]), path=ckpt)

    coord.decide("check-files", mine, lambda _: None, hint="Nothing was read.")


def safe_extra_name(name: str) -> str:
    """An extra file's name, refused unless it is a plain file name that is not one of ours."""
    if (not isinstance(name, str) or not _EXTRA_NAME.match(name) or name == MANIFEST
            or name.startswith("rank-") or is_staging_name(name)):
        raise CheckpointError(f"extra file name {name!r} is not allowed (a plain name, not manifest.json or rank-*)")
    return name


_EXTRA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
