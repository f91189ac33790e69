"""What is under a checkpoint root: committed steps, leftovers, and things we do not own.

Read-only and lock-free: any process may scan a root at any time, on any storage (only the
:class:`~safeckpt.storage.base.Storage` interface is used). A directory (prefix) counts as a
committed checkpoint only if its name is a checkpoint name (``step-N``, or a framework's
``checkpoint-N`` / ``checkpoint_N``, see :class:`DirName`) and it holds a valid manifest. Leftovers
of interrupted saves are recognised by name: hidden staging and trash directories (POSIX), data
objects with a save token that no manifest names, the sidecars of saves' extra files and the
files they list that no manifest names (see ``commit.EXTRAS_FILE``), and unfinished uploads of
data objects (object stores). Anything else is *foreign* and is never touched by retention or gc.

A scan runs concurrently with a writer that publishes new checkpoints and retention that
deletes old ones (after the new one is committed). If something vanished while we looked, or
new names appeared, the listing is stale and may miss the checkpoint that replaced the old one,
so we list again: a reader never reports "no checkpoint" while one exists.

Overwrites on filesystems without an atomic swap (NFS, CephFS, FUSE: see ``storage.posix``) set
the committed checkpoint aside under a replaced name for the instant between two renames. A
replaced directory whose checkpoint name is taken again is a leftover; one whose name is free
is the step's committed checkpoint (the overwrite was killed between its renames): a scan that
sees one lists again for up to ``REPLACED_GRACE`` seconds (a live overwrite finishes its second
rename meanwhile), then reports it as committed at its replaced path. Only :func:`recover`
(the coordinator's sweep) renames it back; nothing ever deletes it while its name is free.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass

from ..errors import CheckpointError, CheckpointNotFound, SafeckptWarning
from ..format.manifest import MANIFEST, STAGING_MARK, TRASH_MARK, CheckpointInfo
from ..format.step_names import step_from_name
from .base import Storage, StorageError, Upload, storage_for
from .commit import EXTRAS_FILE, TOKEN_FILE, leftover_extras, manifest_names
from .posix import replaced_final

STEP_PREFIX = "step-"
_LEFTOVER_RE = re.compile(r"^\.(.+?)(" + re.escape(STAGING_MARK) + "|" + re.escape(TRASH_MARK) + r")[0-9a-f]+$")
_FIELD_RE = re.compile(r"\{step(?::0?(\d+)d)?\}")
_NAME_CHARS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
REPLACED_GRACE = 0.5  # seconds a scan waits for an overwrite's second rename (see above)


class DirName:
    """A checkpoint directory name pattern holding the step: ``"step-{step:010d}"`` (safeckpt's
    default), ``"checkpoint-{step}"`` (Hugging Face Trainer), ``"checkpoint_{step}"``
    (Accelerate). One ``{step}`` or ``{step:0Nd}`` field; the rest is literal (letters, digits,
    ``.``, ``_``, ``-``). A name matches only in its canonical form (``checkpoint-07`` is not
    step 7 of ``checkpoint-{step}``), so formatting and parsing are inverse."""

    __slots__ = ("pattern", "_prefix", "_suffix", "_width", "_re")

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise TypeError(f"dirname must be a str pattern such as 'checkpoint-{{step}}', got {pattern!r}")
        fields = list(_FIELD_RE.finditer(pattern))
        if len(fields) != 1 or pattern.count("{") != 1 or pattern.count("}") != 1:
            raise ValueError(f"dirname {pattern!r} must hold exactly one {{step}} (or {{step:0Nd}}) field, "
                             "e.g. 'checkpoint-{step}'")
        m = fields[0]
        prefix, suffix = pattern[: m.start()], pattern[m.end():]
        probe = prefix + "0" + suffix
        if not _NAME_CHARS.match(probe) or not prefix or prefix[0] == ".":
            raise ValueError(f"dirname {pattern!r}: names must start with a letter or digit and hold only "
                             "letters, digits, '.', '_' and '-' around the step field")
        self.pattern = pattern
        self._prefix, self._suffix = prefix, suffix
        self._width = int(m.group(1) or 0)
        digits = rf"\d{{{self._width},}}" if self._width else r"\d+"
        self._re = re.compile("^" + re.escape(prefix) + "(" + digits + ")" + re.escape(suffix) + "$")

    def format(self, step: int) -> str:
        return f"{self._prefix}{step:0{self._width}d}{self._suffix}" if self._width else \
            f"{self._prefix}{step}{self._suffix}"

    def parse(self, name: str) -> int | None:
        m = self._re.match(name)
        if not m:
            return None
        step = int(m.group(1))
        return step if self.format(step) == name else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DirName) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)

    def __repr__(self) -> str:
        return f"DirName({self.pattern!r})"


DEFAULT_DIRNAME = DirName("step-{step:010d}")
# Names every scan recognises as checkpoint directories (when they hold a manifest): ours, and
# the frameworks' own (the Trainer and Accelerate integrations commit under them). A directory
# with a framework name and no manifest (a stock Trainer checkpoint) is foreign, never touched.
KNOWN_DIRNAMES = (DEFAULT_DIRNAME, DirName("checkpoint-{step}"), DirName("checkpoint_{step}"))


def dirname_of(pattern: str | DirName | None) -> DirName:
    if pattern is None:
        return DEFAULT_DIRNAME
    return pattern if isinstance(pattern, DirName) else DirName(pattern)


def step_dirname(step: int, dirname: str | DirName | None = None) -> str:
    """The directory of ``step``; by default zero-padded so names sort like numbers:
    ``step-0000001200``."""
    return dirname_of(dirname).format(step)


def parse_step(name: str, dirnames: tuple[DirName, ...] = ()) -> int | None:
    """The step in a checkpoint directory name of any known pattern (or of ``dirnames``)."""
    return _match(name, dirnames)[0]


def _match(name: str, dirnames: tuple[DirName, ...] = ()) -> tuple[int | None, bool]:
    """(step, whether the name is safeckpt's default pattern) or (None, False). Besides the
    patterns, the names other frameworks give checkpoints (torchtitan's ``step-6``, DeepSpeed's
    ``global_step6``, Lightning's ``epoch=0-step=6.ckpt``: ``format.step_names``) count, like
    them only where the directory holds a manifest."""
    for d in (*KNOWN_DIRNAMES, *dirnames):
        step = d.parse(name)
        if step is not None:
            return step, d == DEFAULT_DIRNAME
    return step_from_name(name), False


@dataclass(frozen=True)
class Entry:
    """One directory (prefix) under a root and what we make of it."""

    name: str
    path: str
    status: str  # "committed" | "staging" | "trash" | "incomplete" | "corrupt"
    step: int | None
    info: CheckpointInfo | None = None
    problem: str = ""
    files: tuple[str, ...] = ()  # object-store leftovers: the stray data objects
    uploads: tuple[Upload, ...] = ()  # object-store leftovers: unfinished uploads


class _Stale(Exception):
    """The listing changed while we looked at it."""


def scan(root: str, attempts: int = 10, store: Storage | None = None, *, leftovers: bool = True,
         dirnames: tuple[DirName, ...] = ()) -> list[Entry]:
    """Every safeckpt-related directory under ``root``, by step then name; [] if root is absent
    (CheckpointNotFound if its bucket is). ``leftovers=False`` skips the search for stray
    objects and unfinished uploads (object stores). Checkpoint directories are recognised by
    the known name patterns (``KNOWN_DIRNAMES``) and ``dirnames``."""
    store = store or storage_for(root)
    for i in range(attempts):
        try:
            return _scan_once(store, root, leftovers, last=i == attempts - 1, dirnames=dirnames,
                              attempts=attempts)
        except _Stale:
            continue
    return []  # pragma: no cover - the last attempt never raises _Stale


def _scan_once(store: Storage, root: str, leftovers: bool, last: bool,
               dirnames: tuple[DirName, ...] = (), attempts: int = 10) -> list[Entry]:
    items = store.list(root)
    if items is None:
        return []
    out: list[Entry] = []
    names = {i.name for i in items}
    unsettled = False  # a save in flight (or killed) may be renaming: list again to be sure
    for item in sorted(items, key=lambda i: i.name):
        if item.kind == "gone" and not last:
            raise _Stale
        if item.kind != "dir":
            continue
        path = store.join(root, item.name)
        left = _LEFTOVER_RE.match(item.name)
        if left:
            kind = "staging" if left.group(2) == STAGING_MARK else "trash"
            out.append(Entry(item.name, path, kind, parse_step(left.group(1), dirnames)))
            unsettled = unsettled or kind == "staging"
            continue
        final = replaced_final(item.name) if store.renames else None
        if final is not None:
            step = parse_step(final, dirnames)
            if final in names:  # the overwrite put its new checkpoint in place
                out.append(Entry(item.name, path, "trash", step))
                continue
            if not last:  # between an overwrite's two renames, or killed there: wait and see
                time.sleep(REPLACED_GRACE / max(1, attempts - 1))
                raise _Stale
            # Killed between its renames: the old checkpoint, committed, is the step's.
            out += _inspect(store, item.name, path, step, leftovers, last, True)
            continue
        step, default_name = _match(item.name, dirnames)
        if step is None and (store.renames or not leftovers):
            continue  # foreign: not ours, never touched
        out += _inspect(store, item.name, path, step, leftovers, last, default_name)
    if leftovers:
        out = _with_uploads(store, root, out)
    if store.renames and unsettled and not last:
        # A directory listing taken while names change (a save publishing, an overwrite's two
        # renames on NFS) may miss both the old and the new name: compare with a second one.
        again = store.list(root) or []
        if {i.name for i in again if i.kind == "dir"} != {i.name for i in items if i.kind == "dir"}:
            raise _Stale
    if not store.renames and not last:
        # Objects cannot vanish atomically: retention deletes a manifest, then the objects.
        # If a new checkpoint appeared meanwhile, this listing may have missed it.
        again = store.list(root) or []
        if {i.name for i in again if i.kind == "dir"} != {i.name for i in items if i.kind == "dir"}:
            raise _Stale
    out.sort(key=lambda e: (e.step if e.step is not None else -1, e.name))
    return out


_INFOS: dict[tuple, CheckpointInfo] = {}  # (manifest path, dev, ino, size, m/ctime) -> its info
_INFOS_MAX = 512


def _manifest_stamp(path: str) -> tuple | None:
    try:
        st = os.stat(os.path.join(path, MANIFEST))
    except OSError:
        return None
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(stamp: tuple, info: CheckpointInfo) -> None:
    if len(_INFOS) >= _INFOS_MAX:
        _INFOS.pop(next(iter(_INFOS)))
    _INFOS[stamp] = info


def remember_published(store: Storage, path: str, manifest: dict) -> None:
    """The coordinator just published ``manifest`` at ``path``: later scans in this process
    (retention right after the save) need not read it back."""
    stamp = _manifest_stamp(path) if store.renames else None
    if stamp is not None:
        _remember(stamp, CheckpointInfo.from_manifest(path, manifest))


def _inspect(store: Storage, name: str, path: str, step: int | None, leftovers: bool, last: bool,
             default_name: bool = True) -> list[Entry]:
    """The entries for one directory (prefix): the checkpoint, and its stray objects.

    A local checkpoint whose manifest this process already read and validated is not read
    again while the file is the same one (inode, size, mtime, ctime). Retention lists the root
    after every save, and re-validating the manifest of every kept checkpoint cost ~80 ms each
    for 4,000 tensors. A committed manifest is never rewritten in place (an overwrite renames a
    new directory in), so a changed file (even one rewritten with its old size and mtime:
    ctime moves) has a new stamp and is read and judged again."""
    stamp = _manifest_stamp(path) if store.renames and step is not None else None
    if stamp in _INFOS:
        return [Entry(name, path, "committed", step, _INFOS[stamp])]
    try:
        man = store.read_manifest(path)
    except CheckpointNotFound:  # no manifest: never written, or deleted while we looked
        present = store.list(path)
        if present is None:
            if not last:
                raise _Stale from None
            return []
        names = [i.name for i in present]
        ours = tuple(sorted(n for n in names if TOKEN_FILE.match(n))) + tuple(leftover_extras(store, path, names))
        if ours:
            return [Entry(name, path, "staging", step, files=ours)]
        if step is not None and default_name:
            # Only our own name counts as a broken checkpoint: checkpoint-N without a manifest
            # is a framework's own checkpoint (foreign, never touched).
            return [Entry(name, path, "incomplete", step, problem=f"no {MANIFEST}")]
        return []
    except (CheckpointError, OSError) as exc:
        return [Entry(name, path, "corrupt", step, problem=str(exc))] if step is not None else []
    out = []
    if step is not None:
        info = CheckpointInfo.from_manifest(path, man)
        if stamp is not None and _manifest_stamp(path) == stamp:  # unchanged while we read it
            _remember(stamp, info)
        out.append(Entry(name, path, "committed", step, info))
    if leftovers and not store.renames:
        names = [i.name for i in store.list(path) or ()]
        stray = tuple(sorted(n for n in names if TOKEN_FILE.match(n) and n not in man["files"]))
        stray += tuple(leftover_extras(store, path, names))
        if stray:
            out.append(Entry(name, path, "staging", step, files=stray))
    return out


def _with_uploads(store: Storage, root: str, entries: list[Entry]) -> list[Entry]:
    """Unfinished uploads of data objects directly below the root, merged into the staging
    entry of their directory (or one of their own). Credentials that may list objects but not
    uploads only lose this part of the answer (with a warning)."""
    found: dict[str, list[Upload]] = {}
    try:
        listed = store.uploads(root)
    except StorageError as exc:
        _warn_once(f"cannot list unfinished uploads under {root} ({exc}); leftovers of killed "
                   "uploads there are not shown or removed")
        return entries
    for u in listed:
        rel = u.path[len(root) + 1 :] if u.path.startswith(root + "/") else ""
        parts = rel.split("/")
        if len(parts) == 2 and TOKEN_FILE.match(parts[1]):
            found.setdefault(parts[0], []).append(u)
    if not found:
        return entries
    out = []
    for e in entries:
        if e.status == "staging" and e.name in found:
            e = Entry(e.name, e.path, e.status, e.step, files=e.files, uploads=tuple(found.pop(e.name)))
        out.append(e)
    for name, ups in found.items():
        out.append(Entry(name, store.join(root, name), "staging", parse_step(name), uploads=tuple(ups)))
    return out


def leftovers(root: str, store: Storage | None = None, dirnames: tuple[DirName, ...] = ()) -> list[Entry]:
    """Staging/trash leftovers only. On a POSIX root, from names alone (no manifest is read,
    so the sweep before every save stays cheap however many checkpoints are kept)."""
    store = store or storage_for(root)
    if not store.renames:
        return [e for e in scan(root, store=store, dirnames=dirnames) if e.status in ("staging", "trash")]
    out = []
    items = store.list(root) or ()
    names = {i.name for i in items}
    for item in items:
        if item.kind != "dir":
            continue
        m = _LEFTOVER_RE.match(item.name)
        if m:
            kind = "staging" if m.group(2) == STAGING_MARK else "trash"
            out.append(Entry(item.name, store.join(root, item.name), kind, parse_step(m.group(1), dirnames)))
            continue
        final = replaced_final(item.name)
        # A replaced checkpoint is garbage only once its name holds the new one; while the
        # name is free it is the step's only copy (see ``recover``), never a leftover.
        if final is not None and final in names:
            out.append(Entry(item.name, store.join(root, item.name), "trash", parse_step(final, dirnames)))
    return sorted(out, key=lambda e: e.name)


def recover(root: str, store: Storage | None = None) -> list[str]:
    """Coordinator (the writer of ``root``, before it sweeps): put back under its own name every
    committed checkpoint that an overwrite killed between its two renames left set aside
    (filesystems without an atomic swap; see ``storage.posix``). Returns their paths. A reader
    never calls this: a live overwrite may be between its renames."""
    store = store or storage_for(root)
    if not store.renames:
        return []
    items = store.list(root) or ()
    names = {i.name for i in items}
    finals = sorted({f for i in items if i.kind == "dir" and (f := replaced_final(i.name)) and f not in names})
    return [store.join(root, f) for f in finals if store.put_back(store.join(root, f))]


def sweep(root: str, store: Storage | None = None, dirnames: tuple[DirName, ...] = ()) -> None:
    """Put back what interrupted overwrites set aside (:func:`recover`), then remove every
    leftover under ``root`` (the manager, before each save). Best effort: one
    the store refuses to remove now stays for the next sweep or ``safeckpt gc``, with a
    warning, and never fails the save."""
    store = store or storage_for(root)
    try:
        recover(root, store)  # first: a checkpoint put back makes its replaced copies leftovers
    except (StorageError, OSError) as exc:
        warnings.warn(f"could not put back a checkpoint that an interrupted overwrite set aside under "
                      f"{root} ({exc}); it stays where it is (restore finds it there), and the next "
                      "save's sweep retries", SafeckptWarning, stacklevel=2)
    for e in leftovers(root, store, dirnames):
        try:
            remove_entry(e, store)
        except StorageError as exc:
            warnings.warn(f"could not remove the leftover {e.path} ({exc}); the next save's sweep "
                          "or `safeckpt gc` retries", SafeckptWarning, stacklevel=3)


_WARNED: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(text, SafeckptWarning, stacklevel=4)


def committed(root: str, store: Storage | None = None, dirnames: tuple[DirName, ...] = ()) -> list[Entry]:
    return [e for e in scan(root, store=store, leftovers=False, dirnames=dirnames) if e.status == "committed"]


def remove_entry(entry: Entry, store: Storage | None = None) -> None:
    """Delete a leftover or a committed checkpoint so that it never looks committed half-way."""
    store = store or storage_for(entry.path)
    if entry.files or entry.uploads:
        # extras' sidecars last, after everything they list (see commit.leftover_extras)
        sidecars = [n for n in entry.files if EXTRAS_FILE.match(n)]
        store.delete_many([store.join(entry.path, n) for n in entry.files if not EXTRAS_FILE.match(n)])
        store.delete_many([store.join(entry.path, n) for n in sidecars])
        for upload in entry.uploads:
            store.abort(upload)
        return
    if store.renames:
        store.delete_tree(entry.path)  # renamed aside first
        return
    # The manifest first (the checkpoint stops being committed at once), then only its objects
    # (data and extra files).
    named = manifest_names(store, entry.path) or set()
    store.delete(store.join(entry.path, MANIFEST))
    store.delete_many([store.join(entry.path, item.name)
                       for item in sorted(store.list(entry.path) or (), key=lambda i: i.name)
                       if item.name in named or TOKEN_FILE.match(item.name) or EXTRAS_FILE.match(item.name)])


def entry_nbytes(entry: Entry, store: Storage | None = None) -> int:
    """Bytes an entry occupies: its listed objects and unfinished uploads, or all it holds."""
    store = store or storage_for(entry.path)
    sizes: dict[str, int] = {}
    for item in store.list(entry.path) or ():
        sizes[item.name] = item.size if item.kind == "file" else 0
    if entry.files or entry.uploads:
        return sum(sizes.get(n, 0) for n in entry.files) + sum(u.nbytes for u in entry.uploads)
    return sum(sizes.values())


def unmanaged(root: str, known: set[str], store: Storage | None = None) -> list[Entry]:
    """Checkpoints under ``root`` with names the manager does not use (for `safeckpt ls`)."""
    store = store or storage_for(root)
    found = []
    for item in sorted(store.list(root) or (), key=lambda i: i.name):
        if item.kind != "dir" or item.name in known or item.name.startswith("."):
            continue
        path = store.join(root, item.name)
        try:
            man = store.read_manifest(path)
        except CheckpointNotFound:
            continue
        except (CheckpointError, OSError) as exc:
            found.append(Entry(item.name, path, "corrupt", None, problem=str(exc)))
            continue
        info = CheckpointInfo.from_manifest(path, man)
        found.append(Entry(item.name, path, "committed", info.step, info))
    return found
