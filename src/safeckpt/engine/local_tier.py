"""The node-local tier: every save's files on the nodes' own storage, replicas on other nodes,
and the restore of a step from the nearest verified copy of each file.

Layout of one node's ``local_dir`` (it may be a different path on every node)::

    local_dir/run-<hash of root>/            one run: the root it belongs to, in tier.json
        tier.json                            {"format": "safeckpt-local-tier", "root": root, "run_id": id}
        quarantine.json                      {"<step>": "reason"} (mgr.quarantine)
        step-0000000042/                     a step as this node holds it, published by rename
            manifest.json                    the step's manifest, the same bytes on every node
            rank-00003.safetensors           this node's ranks' files and the replicas it holds
            tier.json                        {"root", "step", "run_id", "node", "own", "replicas"}
        .partial-step-0000000043-<token>/    a save in progress (removed by the next save)
    local_dir/run-<hash>.other-<id>/         another run's data of the same root path, moved aside

A file of a step is the very file ``safeckpt.save`` would write for that rank (the same plan,
the same bytes, its xxh3-128 in the manifest), so a node's step directory is a partial
checkpoint and the union over the nodes is a whole one; the drain to ``root`` writes the same
staged bytes again there with an ordinary commit. A restore assembles, on every node, every
file of the step (own copy verified, else a peer's over the checkpoint group, else root's,
each verified against the manifest) and loads it through a ``safeckpt-tier://`` URL that is the
same string on every rank and names each node's own directory (:class:`NodeTierStorage`).

Nodes: ``GROUP_RANK`` (torchrun's node rank) where set, else the host name.

Run identity: a root path names a run only while that root lives; a new run at the same path
(the output directory deleted and made again) must never restore the old run's local steps.
``root/.safeckpt-run.json`` (``{"format": "safeckpt-run", "id": <uuid4 hex>}``) is created once
(an exclusive create through root's storage) by the manager's coordinator at its first tier
collective, and the id is agreed on every rank in that exchange (``CheckpointManager._tier_run``);
the run directory's and each step's ``tier.json`` record it. A node's data is this run's iff its
recorded id is root's: another run's data is never used nor silently deleted: the node's first
rank renames the run directory aside (``run-<hash>.other-<id>``, :meth:`NodeDir.move_aside`),
with a warning naming it, and the run starts a fresh directory. Root unreachable (its run file
cannot be read): the id most nodes recorded is trusted, with a warning, and the run file is
written at the first drain that reaches root. Data of versions without ids (``legacy``) is this
run's only when root holds committed steps and no run file yet (a run upgrading), or root is
unreachable and no node records an id; otherwise it is another run's.

A node's copies are read with root's checks (:func:`read_record`, :meth:`NodeDir.read_manifest`):
every file the tier reads (manifests, ``tier.json``, ``quarantine.json``, data files) is opened
only as a regular file, never through a symlink (the step directory itself included), never
blocking on a FIFO, with a bounded size; a manifest is parsed, checksum-verified and validated
as root's (depth, shape, safe file names) before anything in it is used. A node copy that fails
any check is a damaged copy: the inventory leaves it out and names it (node and path) in one
warning; its files are re-sourced from a peer or root as any missing file, and the restore's
repair (:meth:`NodeDir.repair_step`) writes only inside the node's own step directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from ..errors import CheckpointError, CorruptCheckpoint, SafeckptWarning
from ..format.fileindex import MAX_INDEX, parse_index
from ..format.manifest import (
    MANIFEST,
    open_regular,
    parse_manifest,
    pread_all,
    read_manifest_fd,
    retry_io,
    safe_file_path,
    written_file_path,
)
from ..format.tree import escape_key
from ..storage.base import register_backend
from ..storage.posix import (
    PosixStorage,
    lstat_beneath,
    rmtree_quiet,
    write_bytes_atomic,
)
from . import held_files, prehashed

SCHEME = "safeckpt-tier"
TIER_FILE = "tier.json"
QUARANTINE_FILE = "quarantine.json"
ROOT_QUARANTINE = ".safeckpt-quarantine.json"  # under root: {"<step>": "reason"} (mgr.quarantine)
TIER_FORMAT = "safeckpt-local-tier"
RUN_FILE = ".safeckpt-run.json"  # under root: {"format": RUN_FORMAT, "id": run id} (run identity)
RUN_FORMAT = "safeckpt-run"
OTHER = ".other-"  # run-<hash>.other-<id>: another run's data of the root, moved aside
RECORD_MAX = 1 << 20  # bytes of a tier.json or quarantine.json read at most (they are tiny)
_BASES: dict[str, str] = {}  # key (NodeDir.key) -> this process's node directory of that run


def node_id() -> str:
    """This rank's node: torchrun's ``GROUP_RANK`` where set, else the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"node-{group}" if group not in (None, "") else socket.gethostname()


def tier_tag(root: str) -> str:
    """The name of a root's run directory inside ``local_dir`` (its identity is in tier.json)."""
    return "run-" + hashlib.sha256(root.encode()).hexdigest()[:16]


def new_run_id() -> str:
    return uuid.uuid4().hex


def run_record(run: str) -> bytes:
    """The bytes of root's run file naming ``run``."""
    return json.dumps({"format": RUN_FORMAT, "id": run}).encode()


def parse_run(raw: bytes | None) -> str | None:
    """The run id in the bytes of root's run file (None when absent). A damaged file still
    names one run, the same on every read: ``damaged-<hash of its bytes>`` (never a real id)."""
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        rec = None
    if isinstance(rec, dict) and rec.get("format") == RUN_FORMAT and isinstance(rec.get("id"), str) and rec["id"]:
        return str(rec["id"])
    return "damaged-" + file_xxh3(raw)


def read_run(read: Any, path: str) -> str | None:
    """Root's run id, read with ``read(path, limit)`` (a storage's); a file another manager is
    creating this instant (empty or torn) is read again briefly before it counts as damaged."""
    raw = read(path, RECORD_MAX)
    for _ in range(20):
        if raw is None or not str(parse_run(raw)).startswith("damaged-"):
            break
        time.sleep(0.05)
        raw = read(path, RECORD_MAX)
    return parse_run(raw)


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def tier_url(tag: str, step: int) -> str:
    """The same string on every rank; each process's storage reads its own node's directory."""
    return f"{SCHEME}://{tag}/{step_name(step)}"


def step_files(man: Mapping[str, Any]) -> dict[str, Any]:
    """Every file of a step the tier keeps, by name -> its record (size, xxh3_128): the data
    and named files (``files``) and the coordinator's extra files (``extra``)."""
    files = man.get("files") or {}
    extra = man.get("extra") or {}
    return {**(files if isinstance(files, dict) else {}), **(extra if isinstance(extra, dict) else {})}


def save_signature(man: Mapping[str, Any]) -> str:
    """What identifies one save of a step across the tiers: the xxh3-128 of the sorted
    checksums of its files (a node's copy and root's drain of the same save have the same
    file bytes, but other file names and manifest times)."""
    sums = sorted(str(rec.get("xxh3_128")) if isinstance(rec, dict) else "" for rec in step_files(man).values())
    return file_xxh3("\n".join(sums).encode())


def file_xxh3(data: Any) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _open_dir(path: str) -> int:
    """A handle on the directory ``path`` itself, never through a symlink as its last component
    (CorruptCheckpoint if it is one, or not a directory)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return retry_io(lambda: os.open(path, flags), f"cannot open {path}")
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} is missing", path=path) from None
    except OSError as exc:
        if os.path.islink(path):
            raise CorruptCheckpoint(f"{path} is a symlink; refusing to follow it", path=path) from None
        raise CorruptCheckpoint(f"cannot open {path} as a directory: {exc.strerror}", path=path) from None


def read_bounded(path: str, limit: int, *, dir_fd: int | None = None, name: str | None = None) -> bytes:
    """The bytes of a file the tier keeps, read as root's readers read (``open_regular``: a
    regular file only, no symlink, never blocking on a FIFO or device), refused past ``limit``
    bytes before reading. CorruptCheckpoint (or another CheckpointError) otherwise."""
    fd = open_regular(path, os.path.dirname(path), dir_fd=dir_fd, name=name)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpoint(f"{path} has {size} bytes, more than the {limit} it may have", path=path)
        raw = retry_io(lambda: pread_all(fd, size + 1), f"cannot read {path}")
    finally:
        os.close(fd)
    if len(raw) > limit:  # grew while read
        raise CorruptCheckpoint(f"{path} has more than the {limit} bytes it may have", path=path)
    return raw


def read_record(path: str, limit: int = RECORD_MAX) -> Any:
    """A tier record (``tier.json``, ``quarantine.json``) parsed as JSON, or None when it is
    absent, unreadable, too large, not a regular file, not JSON or nested too deeply."""
    try:
        return json.loads(read_bounded(path, limit))
    except (CheckpointError, OSError, ValueError, RecursionError):
        return None


def quarantine_marks(rec: Any) -> dict[str, str]:
    """``{"<step>": "reason"}`` of a quarantine record, for display (entries of any other shape
    are dropped; see :func:`quarantine_entries` for which save a mark hides)."""
    return {k: v["reason"] for k, v in quarantine_entries(rec).items()}


def quarantine_entries(rec: Any) -> dict[str, dict[str, Any]]:
    """``{"<step>": {"reason": str, "sigs": [save_signature, ...] | None}}`` of a quarantine
    record. A mark names the saves of the step it quarantined (``sigs``), so that a later save
    of the same step number (a job rolled back and saved it again) is not hidden; a mark of
    an older version (a plain reason string) or one without ``sigs`` hides any save of it."""
    if not isinstance(rec, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for k, v in rec.items():
        if not (isinstance(k, str) and k.isdigit()):
            continue
        if isinstance(v, dict) and isinstance(v.get("reason"), str):
            sigs = v.get("sigs")
            ok = isinstance(sigs, list) and all(isinstance(x, str) for x in sigs) and sigs
            out[k] = {"reason": v["reason"], "sigs": list(sigs) if ok else None}
        else:
            out[k] = {"reason": v if isinstance(v, str) else json.dumps(v)[:500], "sigs": None}
    return out


def quarantine_mark(reason: str, sigs: Sequence[str]) -> dict[str, Any]:
    """The record of one mark (see :func:`quarantine_entries`): no ``sigs`` when no save of the
    step was found (then it hides any save of that step number)."""
    return {"reason": reason, "sigs": sorted(set(sigs))} if sigs else {"reason": reason}


def hidden_by(entries: Mapping[str, Any], step: int, sig: str | None) -> str | None:
    """The reason ``step``'s save with signature ``sig`` (:func:`save_signature`; None when
    unknown) is quarantined, or None when it is not: a mark hides the saves it names, and any
    save when it names none (an older version's mark) or the save is unknown."""
    mark = entries.get(str(step))
    if mark is None:
        return None
    if isinstance(mark, str):
        return mark
    sigs = mark.get("sigs")
    if not sigs or sig is None or sig in sigs:
        return str(mark.get("reason"))
    return None


class NodeTierStorage(PosixStorage):
    """``safeckpt-tier://<tag>/...``: this node's directory of the run ``tag`` (see module)."""

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any], timeout: float | None) -> NodeTierStorage:
        return cls(timeout)

    @staticmethod
    def local(path: str) -> str:
        if not path.startswith(f"{SCHEME}://"):
            return path
        tag, _, rest = path[len(SCHEME) + 3:].partition("/")
        base = _BASES.get(tag)
        if base is None:
            raise CheckpointError(f"{path}: no node-local directory is registered for {tag} in this process")
        return os.path.join(base, rest) if rest else base

    def join(self, parent: str, name: str) -> str:
        return f"{parent.rstrip('/')}/{name}"

    def list(self, path: str) -> Any:
        return super().list(self.local(path))

    def size(self, path: str) -> int | None:
        return super().size(self.local(path))

    def read(self, path: str, limit: int) -> bytes | None:
        return super().read(self.local(path), limit)

    def read_manifest(self, ckpt: str) -> dict[str, Any]:
        local = self.local(ckpt)
        raw = held_files.held(os.path.join(local, MANIFEST))  # a restore that could not write it
        return super().read_manifest(local) if raw is None else parse_manifest(bytes(raw), local)

    def open(self, path: str, size: int, ckpt: str, likely: Sequence[tuple[int, int]] = ()) -> Any:
        local = self.local(path)
        data = held_files.held(local)  # a verified copy a restore could not keep on disk
        return prehashed.open_file(local, size) if data is None else held_files.open_held(local, data, size)

    def hash(self, path: str, progress: Any = None, spans: Sequence[tuple[int, int]] = ()) -> Any:
        return super().hash(self.local(path), progress, spans)

    def write(self, path: str, items: Sequence[tuple[str, Any]], metadata: dict[str, str], index: Any = None) -> Any:
        return super().write(self.local(path), items, metadata, index)

    def put(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        super().put(self.local(path), data, exclusive=exclusive)

    def delete(self, path: str) -> None:
        super().delete(self.local(path))

    def delete_tree(self, path: str) -> None:
        super().delete_tree(self.local(path))

    def stage(self, final: str, token: str) -> str:
        return super().stage(self.local(final), token)

    def sees(self, staging: str) -> bool:
        return super().sees(self.local(staging))

    def publish(self, staging: str, final: str, manifest: bytes, *, replace: bool) -> None:
        super().publish(self.local(staging), self.local(final), manifest, replace=replace)

    def put_back(self, final: str) -> bool:
        return super().put_back(self.local(final))

    def create(self, path: str, data: bytes) -> None:
        super().create(self.local(path), data)

    def touch(self, path: str, data: bytes) -> None:
        super().touch(self.local(path), data)

    def age(self, path: str, record: dict[str, Any]) -> float:
        return super().age(self.local(path), record)

    def take_over(self, path: str) -> None:
        super().take_over(self.local(path))


register_backend(SCHEME, "safeckpt.engine.local_tier:NodeTierStorage")


class NodeDir:
    """This node's directory of one run (``local_dir/run-<hash>``)."""

    def __init__(self, local_dir: str, root: str) -> None:
        self.local_dir = os.path.abspath(os.fspath(local_dir))
        self.root = root
        self.tag = tier_tag(root)
        self.base = os.path.join(self.local_dir, self.tag)
        self.node = node_id()
        self.run: str | None = None  # the run id agreed (CheckpointManager._tier_run); None: unchecked
        # the id was agreed while root was unreachable and root's run file does not name it yet:
        # a restart that finds root without a run file adopts it (the run never reached root),
        # where a confirmed id there means root was deleted (another run)
        self.unconfirmed = False
        self._parsed: dict[str, dict[str, Any]] = {}  # manifest xxh3 -> parsed (the newest 8)
        # The tier URL's key of this directory in this process: the run's tag, unless another
        # manager of this process registered the tag for another local_dir (then tag~1, ...):
        # two managers of one root with different local_dirs never read each other's steps.
        # Provisional: the run agreement (CheckpointManager._tier_run) makes it the same string
        # on every rank (:meth:`keys_taken`, :meth:`rekey`), whatever order ranks made managers in.
        self.key = self.tag
        n = 0
        while _BASES.get(self.key, self.base) != self.base:
            n += 1
            self.key = f"{self.tag}~{n}"
        _BASES[self.key] = self.base

    def step_dir(self, step: int) -> str:
        return os.path.join(self.base, step_name(step))

    def partial(self, step: int, token: str) -> str:
        return os.path.join(self.base, f".partial-{step_name(step)}-{token}")

    def ensure(self) -> None:
        os.makedirs(self.base, exist_ok=True)
        marker = os.path.join(self.base, TIER_FILE)
        if not os.path.lexists(marker):
            write_bytes_atomic(marker, json.dumps(self._dir_record()).encode())

    def _dir_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"format": TIER_FORMAT, "root": self.root}
        if self.run is not None:
            rec["run_id"] = self.run
        if self.unconfirmed:  # agreed while root was unreachable: root has no record of it yet
            rec["unconfirmed"] = True
        return rec

    def ours(self) -> bool:
        """The run directory exists and belongs to this root and run (a hash collision, a copied
        directory of another root, or an earlier run's data at this root path is never used)."""
        rec = self._base_record()
        return (isinstance(rec, dict) and rec.get("format") == TIER_FORMAT and rec.get("root") == self.root
                and (self.run is None or rec.get("run_id") == self.run))

    def _base_record(self) -> Any:
        """The run directory's record; None when it is missing, damaged, or the run directory
        is a symbolic link (it is made here, never a link: one leads anywhere, so its data is
        treated as damaged and moved aside by :meth:`adopt`, the link itself, never followed).
        ``local_dir`` itself may be a link (a RAM disk mounted elsewhere)."""
        if os.path.islink(self.base):
            return None
        return read_record(os.path.join(self.base, TIER_FILE), 1 << 16)

    # ------------------------------------------------------------------ run identity
    def recorded(self) -> dict[str, Any]:
        """For the run agreement (``CheckpointManager._tier_run``): this node's recorded run id
        (None when none), whether its directory is this root's at all (``mine``: a tier.json of
        this root), holds data (``data``: anything besides tier.json), and exists."""
        present = os.path.lexists(self.base)
        rec = self._base_record()
        mine = isinstance(rec, dict) and rec.get("format") == TIER_FORMAT and rec.get("root") == self.root
        run = rec.get("run_id") if mine and isinstance(rec.get("run_id"), str) else None
        try:
            data = present and (os.path.islink(self.base) or any(n != TIER_FILE for n in os.listdir(self.base)))
        except OSError:
            data = present
        other_root = isinstance(rec, dict) and rec.get("format") == TIER_FORMAT and rec.get("root") != self.root
        return {"node": self.node, "run": run, "mine": mine, "data": data, "present": present,
                "other_root": other_root, "taken": self.keys_taken(),
                "unconfirmed": bool(mine and run is not None and rec.get("unconfirmed") is True)}

    def keys_taken(self) -> list[str]:
        """The tier URL keys of this run's tag that this process registered for another
        local_dir (another manager of the same root): not usable as this directory's key."""
        return sorted(k for k, base in _BASES.items()
                      if (k == self.tag or k.startswith(f"{self.tag}~")) and base != self.base)

    def rekey(self, key: str) -> None:
        """Take ``key`` (agreed on every rank: free on each) as this directory's URL key."""
        if key == self.key:
            return
        if _BASES.get(self.key) == self.base:
            del _BASES[self.key]
        _BASES[key] = self.base
        self.key = key

    def adopt(self, run: str, legacy: bool) -> str | None:
        """The node's first rank, once the run id is agreed (before any rank of the node reads
        or writes the directory): data recorded for ``run`` is kept; data without an id is
        stamped with ``run`` when ``legacy`` (it is this run's); another run's data (or old data
        not adopted, or a directory whose record is damaged) is moved aside, never deleted
        (:meth:`move_aside`). Returns the path it was moved to, or None."""
        self.run = run
        rec = self._base_record()
        if not os.path.lexists(self.base):
            return None
        if isinstance(rec, dict) and rec.get("format") == TIER_FORMAT and rec.get("root") != self.root:
            return None  # another root's (a hash collision): never used (ours()), left alone
        mine = isinstance(rec, dict) and rec.get("format") == TIER_FORMAT
        have = rec.get("run_id") if mine else None
        if mine and have == run:
            if bool(rec.get("unconfirmed")) != self.unconfirmed:  # root has it now (or still not)
                write_bytes_atomic(os.path.join(self.base, TIER_FILE), json.dumps(self._dir_record()).encode())
            return None
        try:
            data = os.path.islink(self.base) or any(n != TIER_FILE for n in os.listdir(self.base))
        except OSError:
            data = True
        if not data:  # nothing but a record: made this run's
            _clear_dir_entry(os.path.join(self.base, TIER_FILE))
            write_bytes_atomic(os.path.join(self.base, TIER_FILE), json.dumps(self._dir_record()).encode())
            return None
        if mine and have is None and legacy:
            for name in self._step_names():  # an upgrading run's steps: this run's from now on
                if os.path.islink(os.path.join(self.base, name)):
                    continue  # never followed (a restore treats it as damaged)
                path = os.path.join(self.base, name, TIER_FILE)
                srec = read_record(path)
                if isinstance(srec, dict) and "run_id" not in srec:
                    with contextlib.suppress(OSError):
                        write_bytes_atomic(path, json.dumps({**srec, "run_id": run}).encode())
            write_bytes_atomic(os.path.join(self.base, TIER_FILE), json.dumps(self._dir_record()).encode())
            return None
        label = (have if isinstance(have, str) and have else "legacy") if mine else "damaged"
        return self.move_aside(label)

    def move_aside(self, label: str) -> str | None:
        """Rename the run directory to ``run-<hash>.other-<label>`` (a free name) beside it."""
        safe = "".join(c for c in label if c.isalnum() or c in "-_")[:64] or "unknown"
        for n in range(1000):
            aside = os.path.join(self.local_dir, f"{self.tag}{OTHER}{safe}" + (f"-{n}" if n else ""))
            if os.path.lexists(aside):
                continue
            try:
                os.rename(self.base, aside)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if os.path.lexists(aside):
                    continue
                raise CheckpointError(f"cannot move another run's local data {self.base} aside to {aside}: "
                                      f"{exc}; delete it") from exc
            return aside
        raise CheckpointError(f"cannot move another run's local data {self.base} aside; delete it")

    def _step_names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.base) if n.startswith("step-") and n[5:].isdigit()]
        except OSError:
            return []

    # ------------------------------------------------------------------ inventory
    def steps(self) -> list[int]:
        if not self.ours():
            return []
        out = []
        for name in os.listdir(self.base):
            if name.startswith("step-") and name[5:].isdigit():
                out.append(int(name[5:]))
        return sorted(out)

    def read_manifest(self, step: int) -> tuple[bytes, dict[str, Any]]:
        """This node's manifest of ``step``: its bytes and the manifest, read and validated as
        root's (``format.manifest``: the step directory and the manifest never through a
        symlink, a regular file only, at most ``SAFECKPT_MAX_MANIFEST_BYTES``, parsed with its
        checksum, depth, shape and file names checked). CorruptCheckpoint (or another
        CheckpointError) when the copy is damaged."""
        d = self.step_dir(step)
        path = os.path.join(d, MANIFEST)
        dfd = _open_dir(d)
        try:
            fd = open_regular(path, d, dir_fd=dfd, name=MANIFEST)
        finally:
            os.close(dfd)
        raw = read_manifest_fd(fd, path, d)
        key = file_xxh3(raw)
        man = self._parsed.get(key)
        if man is None:
            man = parse_manifest(raw, d)
            if len(self._parsed) >= 8:
                self._parsed.pop(next(iter(self._parsed)))
            self._parsed[key] = man
        return raw, man

    def file_path(self, step: int, name: str) -> str:
        """The path of a file a (validated) manifest names, inside the step directory (a data
        file's plain name, or an extra file's relative path; CorruptCheckpoint for any other)."""
        d = self.step_dir(step)
        return safe_file_path(d, name) if isinstance(name, str) and "/" not in name else written_file_path(d, name)

    def examine(self, step: int) -> tuple[dict[str, Any] | None, str | None]:
        """What this node holds of ``step`` (the manifest's hash, world size and files present:
        regular files of the listed size, reached without a symlink; checksums are checked when
        read) and what of its copy is damaged or not this run's, naming the path (None when
        nothing is): (None, why) when the whole copy is unusable."""
        d = self.step_dir(step)
        try:
            st = os.lstat(d)
        except OSError:
            return None, None
        whole = "the node's copy is damaged and is not used ({}); its files come from another copy"
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            return None, whole.format(f"{d} is {kind}")
        rec = read_record(os.path.join(d, TIER_FILE))
        if not isinstance(rec, dict) or rec.get("root") != self.root or rec.get("step") != step:
            return None, whole.format(f"{os.path.join(d, TIER_FILE)} is missing, damaged or names another "
                                      "root or step")
        if self.run is not None and rec.get("run_id") != self.run:
            return None, whole.format(f"{os.path.join(d, TIER_FILE)} names another run of this root")
        try:
            raw, man = self.read_manifest(step)
        except (CheckpointError, OSError) as exc:
            return None, whole.format(f"{type(exc).__name__}: {str(exc)[:300]}")
        files = {}
        bad = []
        listed = step_files(man)
        for name, frec in listed.items():
            try:
                path = self.file_path(step, name)
                fst = lstat_beneath(path)
            except (CheckpointError, OSError):
                continue
            if fst is not None and stat.S_ISREG(fst.st_mode) and fst.st_size == frec.get("size"):
                files[name] = fst.st_size
            elif fst is not None:
                what = (f"has {fst.st_size} bytes, not {frec.get('size')}" if stat.S_ISREG(fst.st_mode)
                        else "is not a regular file")
                bad.append(f"{path} {what}")
            elif os.path.lexists(path):
                bad.append(f"{path} is a symlink or lies beyond one")
        why = None
        if bad:
            why = (f"the node's copies of {len(bad)} file(s) are damaged and are not used ({'; '.join(bad[:3])}"
                   f"{'; ...' if len(bad) > 3 else ''}); they come from another copy")
        created = man.get("created_at")
        return {"manifest": file_xxh3(raw), "world": man.get("world_size"), "files": sorted(files),
                "all": sorted(listed), "sig": save_signature(man),
                "created": created if isinstance(created, str) else ""}, why

    def step_record(self, step: int) -> dict[str, Any] | None:
        """What this node holds of ``step`` (see :meth:`examine`), or None."""
        return self.examine(step)[0]

    def survey(self) -> tuple[dict[str, Any], dict[str, str]]:
        """(step -> :meth:`examine`'s record of every step this node holds, step -> what of
        this node's copy of the step is damaged and why)."""
        inv: dict[str, Any] = {}
        damaged: dict[str, str] = {}
        for s in self.steps():
            rec, why = self.examine(s)
            if rec is not None:
                inv[str(s)] = rec
            if why is not None:
                damaged[str(s)] = why
        return inv, damaged

    def inventory(self) -> dict[str, Any]:
        return self.survey()[0]

    def quarantined(self) -> dict[str, str]:
        return quarantine_marks(read_record(os.path.join(self.base, QUARANTINE_FILE)))

    def quarantine_entries(self) -> dict[str, dict[str, Any]]:
        """This node's marks with the saves they name (see :func:`hidden_by`)."""
        return quarantine_entries(read_record(os.path.join(self.base, QUARANTINE_FILE)))

    def quarantine(self, marks: Mapping[str, Any]) -> None:
        """Add ``marks`` (step -> :func:`quarantine_mark`, or a reason) to this node's record."""
        self.ensure()
        rec = {**self.quarantine_entries(), **marks}
        write_bytes_atomic(os.path.join(self.base, QUARANTINE_FILE), json.dumps(rec, sort_keys=True).encode())

    def verified(self, step: int, name: str, rec: Mapping[str, Any]) -> bool:
        """This node's copy of ``name`` (a name of the validated manifest, ``rec`` its record)
        is a regular file, reached without a symlink, whose xxh3-128 is ``rec["xxh3_128"]``.
        The chunks its index lists are hashed in the same pass and, when it verifies, kept for
        this process's load of it (``engine.prehashed``: the load does not hash them again).
        The caller releases them (``prehashed.release``)."""
        try:
            path = self.file_path(step, name)
            got, hashed = prehashed.hash_file(path, lambda fd: _index_spans(fd, path, rec))
        except (CheckpointError, OSError):
            return False
        if got.xxh3_128 != rec.get("xxh3_128"):
            return False
        prehashed.remember(path, hashed)
        return True

    def repair_step(self, step: int, manifest: bytes) -> None:
        """Make this node's directory of ``step`` fit to receive fetched files (a restore):
        whatever is there that is not a real directory (a symlink, a file) is removed, never
        followed; the manifest and tier record are (re)written unless intact."""
        d = self.step_dir(step)
        self.ensure()
        _clear_non_dir(d)
        os.makedirs(d, exist_ok=True)
        try:
            current = read_bounded(os.path.join(d, MANIFEST), len(manifest))
        except (CheckpointError, OSError):
            current = None
        if current != manifest:
            _clear_dir_entry(os.path.join(d, MANIFEST))
            write_bytes_atomic(os.path.join(d, MANIFEST), manifest)
        rec = read_record(os.path.join(d, TIER_FILE))
        if (not isinstance(rec, dict) or rec.get("root") != self.root or rec.get("step") != step
                or rec.get("run_id") != self.run):
            _clear_dir_entry(os.path.join(d, TIER_FILE))
            keep = {"root": self.root, "step": step, "run_id": self.run, "node": self.node, "own": [],
                    "replicas": []}
            write_bytes_atomic(os.path.join(d, TIER_FILE), json.dumps(keep).encode())

    def room_for(self, step: int, name: str) -> str:
        """The path to write the fetched file ``name`` (a name of the validated manifest) of
        ``step`` to: a directory in its way is removed, and for a nested name every parent is
        made a real directory (a symlink there is removed, never followed)."""
        parts = name.split("/")
        cur = self.step_dir(step)
        for part in parts[:-1]:
            cur = os.path.join(cur, part)
            _clear_non_dir(cur)
            os.makedirs(cur, exist_ok=True)
        path = os.path.join(cur, parts[-1])
        _clear_dir_entry(path)
        return path

    # ------------------------------------------------------------------ publish and retain
    def publish(self, step: int, token: str, manifest: bytes, own: list[str], replicas: list[str],
                extras: Mapping[str, bytes] | None = None) -> None:
        """The node's first rank, after every rank of the node wrote (and every replica it
        holds arrived): the step's extra files, manifest and tier record into the partial
        directory, then one rename."""
        part = self.partial(step, token)
        os.makedirs(part, exist_ok=True)
        for name, data in (extras or {}).items():
            write_bytes_atomic(os.path.join(part, name), data)
        write_bytes_atomic(os.path.join(part, MANIFEST), manifest)
        rec = {"root": self.root, "step": step, "run_id": self.run, "node": self.node, "own": own,
               "replicas": replicas}
        write_bytes_atomic(os.path.join(part, TIER_FILE), json.dumps(rec).encode())
        final = self.step_dir(step)
        if os.path.exists(final):  # a step saved again (a run restarted from an older step)
            aside = f"{part}.old"
            os.rename(final, aside)
            os.rename(part, final)
            rmtree_quiet(aside)
        else:
            os.rename(part, final)

    def sweep_partials(self, keep_token: str | None = None) -> None:
        try:
            names = os.listdir(self.base)
        except OSError:
            return
        for name in names:
            # a save's partial directory, or the (empty) staging place its agreement made
            if name.startswith((".partial-", ".step-")) and (keep_token is None or keep_token not in name):
                rmtree_quiet(os.path.join(self.base, name))

    def retain(self, keep: int | None, max_bytes: int | None, protect: set[int]) -> list[int]:
        """Drop the oldest steps beyond ``keep`` and while the run's bytes exceed ``max_bytes``
        (never the newest step, nor a protected one)."""
        steps = self.steps()
        gone: list[int] = []
        if not steps:
            return gone
        newest = steps[-1]
        doomed = steps[:-keep] if keep is not None and keep > 0 and len(steps) > keep else []
        for s in doomed:
            if s != newest and s not in protect:
                rmtree_quiet(self.step_dir(s))
                gone.append(s)
        if max_bytes is not None:
            left = [s for s in steps if s not in gone]
            while len(left) > 1 and self.nbytes() > max_bytes:
                s = left.pop(0)
                if s in protect:
                    continue
                rmtree_quiet(self.step_dir(s))
                gone.append(s)
        return gone

    def step_sizes(self) -> list[list[int]]:
        """[[step, bytes], ...] of the steps this node holds, oldest first."""
        out = []
        for s in self.steps():
            out.append([s, dir_bytes(self.step_dir(s))])
        return out

    def nbytes(self) -> int:
        return dir_bytes(self.base)


def _index_spans(fd: int, path: str, rec: Mapping[str, Any]) -> list[tuple[int, int]]:
    """The byte ranges of the chunks the index of the data file ``path`` (open as ``fd``)
    lists (``rec``: its manifest record, format 3: where its data and index are); [] for a
    file without one, or whose index is damaged (the file then fails its checksum, or the load
    finds it)."""
    index, data, size = rec.get("index"), rec.get("data"), rec.get("size")
    if not (isinstance(index, list) and len(index) == 3 and type(data) is int and type(size) is int):
        return []
    start, end, digest = index
    if not (type(start) is int and type(end) is int and isinstance(digest, str)
            and 0 <= start <= end <= size and end - start <= MAX_INDEX):
        return []
    try:
        chunks = parse_index(pread_all(fd, end - start, start), path, os.path.dirname(path), digest)["chunks"]
    except CheckpointError:
        return []
    return sorted({(data + c[3], data + c[4]) for c in chunks if c[4] > c[3] and data + c[4] <= size})


def _clear_non_dir(path: str) -> None:
    """Remove ``path`` unless it is a real directory (a symlink is unlinked, never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _clear_dir_entry(path: str) -> None:
    """Remove a directory in the way of the file ``path`` (a rename would not replace it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        rmtree_quiet(path)


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


def describe(path: str) -> list[dict[str, Any]] | None:
    """For ``safeckpt ls``: the runs of a ``local_dir`` (or one run directory) with, per step,
    the files this node holds (own and replicas) and the quarantine marks; None when ``path``
    holds no local tier."""
    def run_of(d: str) -> dict[str, Any] | None:
        rec = read_record(os.path.join(d, TIER_FILE), 1 << 16)
        if not isinstance(rec, dict) or rec.get("format") != TIER_FORMAT:
            return None
        nd = NodeDir.__new__(NodeDir)  # a reader of one run directory: no tier URL key to register
        nd.base, nd.root, nd._parsed = d, str(rec.get("root")), {}
        nd.run = rec.get("run_id") if isinstance(rec.get("run_id"), str) else None
        marks = nd.quarantined()
        steps = []
        for s in nd.steps():
            got = nd.step_record(s)
            held = read_record(os.path.join(nd.step_dir(s), TIER_FILE)) if got else None
            held = held if isinstance(held, dict) else {}
            steps.append({"step": s, "files": len(got["files"]) if got else 0,
                          "of": len(got["all"]) if got else None, "own": held.get("own", []),
                          "replicas": held.get("replicas", []), "node": held.get("node"),
                          "quarantined": marks.get(str(s))})
        # run-<hash>.other-<id>: another run's data of this root path, moved aside by a new run
        # (NodeDir.move_aside): it belongs to no run; nothing restores from it.
        moved = OTHER in os.path.basename(d)
        return {"run": d, "root": rec.get("root"), "run_id": rec.get("run_id"), "moved_aside": moved,
                "steps": steps, "quarantine": marks}

    one = run_of(path)
    if one is not None:
        return [one]
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    runs = [r for n in names if n.startswith("run-") and (r := run_of(os.path.join(path, n))) is not None]
    return runs or None


# ---------------------------------------------------------------------- placement


def replica_targets(nodes: list[str], replicas: int) -> dict[int, list[int]]:
    """Rank -> the ranks that receive a replica of its file: on the ``replicas`` next nodes (in
    the order the nodes first appear), never its own; the rank with the same position on that
    node where it has one, so every node receives about as much as it sends."""
    order = list(dict.fromkeys(nodes))
    members: dict[str, list[int]] = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    k = min(replicas, len(order) - 1)
    out: dict[int, list[int]] = {}
    for r, n in enumerate(nodes):
        i, pos = order.index(n), members[n].index(r)
        dests = []
        for j in range(1, k + 1):
            other = members[order[(i + j) % len(order)]]
            dests.append(other[pos % len(other)])
        out[r] = dests
    return out


def replica_shortfall(nodes: list[str], replicas: int) -> str | None:
    """Why fewer than ``replicas`` copies of each file can be placed (:func:`replica_targets`
    puts them on other nodes only, at most nodes - 1), or None when they all can: said once,
    since a user who asked for replicas expects a lost node not to lose a step."""
    order = list(dict.fromkeys(nodes))
    if replicas <= len(order) - 1:
        return None
    names = ", ".join(order[:5]) + (" ..." if len(order) > 5 else "")
    return (f"replicas={replicas}, but the job runs on {len(order)} node(s) ({names}): only {len(order) - 1} "
            "copy(ies) of each file can be placed on other nodes, so a lost node loses the local steps "
            "it holds alone until they reach root (durable_every, preemption, close)")


def non_finite(items: Sequence[tuple[str, torch.Tensor]], entries: Any = True) -> list[str]:
    """Names of the floating tensors among ``items`` that hold NaN or Inf: all of them, or with
    ``entries`` a collection of state entry names, those under these entries (a named file's
    ``@file:name`` items always)."""
    bad = []
    only = None if entries is True else {escape_key(str(e)) for e in entries}
    for name, t in items:
        if only is not None and not name.startswith("@") and name.split("/", 1)[0] not in only:
            continue
        if (t.is_floating_point() or t.is_complex()) and t.numel() and not bool(torch.isfinite(t).all()):
            bad.append(name)
    return bad


def read_file(path: str, size: int) -> torch.Tensor:
    """The file's bytes in a uint8 tensor of ``size`` (read straight into it, no copy; a short
    file leaves the rest zero: its checksum fails where it is checked). Opened as root's
    readers open (a regular file only, no symlink as its name, never blocking on a FIFO)."""
    t = torch.empty(size, dtype=torch.uint8)
    if size:
        view = memoryview(t.numpy())
        with os.fdopen(open_regular(path, os.path.dirname(path)), "rb") as f:
            got = f.readinto(view)
        if got < size:
            view[got:] = b"\0" * (size - got)
    return t


def as_tensor(data: Any) -> torch.Tensor:
    """What is sent of a file (the hook a test uses to damage a replica on the way)."""
    return data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)


def warn(text: str) -> None:
    warnings.warn(text, SafeckptWarning, stacklevel=3)


def spread(items: Sequence[Any], k: int) -> int:
    """A stable index in range(k) for a string."""
    return int(hashlib.sha256(str(items).encode()).hexdigest()[:8], 16) % max(k, 1)


