"""Check the CLI's path arguments before a command uses them, so that a wrong kind of path (a
file where a checkpoint directory belongs, a FIFO, a root instead of one checkpoint, a URL where
only local paths work) is one line saying what the path is and what to pass instead."""

from __future__ import annotations

import errno
import os
import stat

from ..errors import CheckpointExists, CheckpointNotFound
from ..format.manifest import MANIFEST
from ..storage.base import is_remote, resolve
from .common import UsageError

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a file"
    return next((what for test, what in _KINDS if test(mode)), "a special file")


def _resolve(arg: str, what: str) -> str:
    if not arg:
        raise UsageError(f"{what} is an empty string; give a path")
    try:
        return resolve(arg)
    except ValueError as exc:  # "s3://" with no bucket
        raise UsageError(f"{what}: {exc}") from None


def _stat(path: str, what: str) -> os.stat_result | None:
    """``os.stat`` (following a symlink the user gave), None when nothing is there; a path
    through a file or a dangling symlink is reported as what it is."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise CheckpointNotFound(
                f"{what} {path} is a symlink to {os.readlink(path)}, which does not exist", path=path
            ) from None
        return None
    except NotADirectoryError:
        parent = path
        while parent != os.path.dirname(parent) and not os.path.isfile(parent):
            parent = os.path.dirname(parent)
        raise CheckpointNotFound(f"no {what} at {path}: {parent} is a file, not a directory", path=path) from None


def _readable(path: str, mode: int) -> None:
    if not os.access(path, mode):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)


def _file_hint(path: str) -> str:
    name = os.path.basename(path)
    if name == MANIFEST:
        return f"; pass the checkpoint directory that holds it: {os.path.dirname(path)}"
    if name.endswith(".safetensors"):
        return "; it looks like a plain safetensors file (open it with safetensors.safe_open)"
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return f"; to import a torch.save file: safeckpt convert {path} DST --from torch-save --allow-pickle"
    return ""


def _looks_like_root(path: str) -> bool:
    try:
        return any(name.startswith("step-") for name in os.listdir(path))
    except OSError:
        return False


def checkpoint_arg(arg: str, what: str = "checkpoint") -> str:
    """A CKPT argument: the resolved path or URL of (what should be) one checkpoint directory."""
    path = _resolve(arg, what)
    if is_remote(path):
        return path
    st = _stat(path, what)
    if st is None:
        raise CheckpointNotFound(f"no {what} at {path}: no such file or directory", path=path)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointNotFound(
            f"{path} is {_kind(st.st_mode)}, not a checkpoint: a safeckpt checkpoint is a directory "
            f"holding {MANIFEST}{_file_hint(path) if stat.S_ISREG(st.st_mode) else ''}", path=path,
        )
    _readable(path, os.R_OK | os.X_OK)
    manifest = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest):
        _readable(manifest, os.R_OK)  # (the reader would call it corrupt: it is not)
    elif _looks_like_root(path):
        raise CheckpointNotFound(
            f"{path} is a checkpoint root (it holds step-* checkpoints), not one checkpoint: "
            f"`safeckpt ls {arg}` lists them; pass one of them", path=path,
        )
    return path


def root_arg(arg: str) -> str:
    """A ROOT argument: the resolved path of an existing local directory, or a URL."""
    path = _resolve(arg, "ROOT")
    if is_remote(path):
        return path
    st = _stat(path, "checkpoint root")
    if st is None:
        raise CheckpointNotFound(f"no checkpoint root at {path}: no such directory", path=path)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointNotFound(
            f"{path} is {_kind(st.st_mode)}, not a directory: ROOT is the directory that holds "
            "the checkpoints", path=path,
        )
    return path


def local_output_file(arg: str, overwrite: bool, what: str = "OUT") -> str:
    """A local file to write: refuses a URL, a directory, a missing parent, an existing file
    without ``overwrite``."""
    if is_remote(arg):
        raise UsageError(f"{what} must be a local path, not a URL ({arg}): write it locally, then upload it")
    out = _resolve(arg, what)
    if os.path.isdir(out):
        raise UsageError(f"{out} is a directory; give the output file name (OUT.safetensors)")
    _check_parent(out)
    if os.path.lexists(out) and not overwrite:
        raise CheckpointExists(f"{out} already exists; pass --overwrite to replace it")
    return out


def local_output_dir(arg: str, what: str = "DST") -> str:
    """A local directory to write files into (created if missing)."""
    if is_remote(arg):
        raise UsageError(f"{what} must be a local directory, not a URL ({arg}): export locally, then upload it")
    out = _resolve(arg, what)
    st = _stat(out, what)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{out} is {_kind(st.st_mode)}; {what} must be a directory (it is created if missing)")
    if st is None:
        _check_parent(out)
    return out


def _check_parent(path: str) -> None:
    parent = os.path.dirname(path)
    st = _stat(parent, "directory")
    if st is None:
        raise UsageError(f"cannot write {path}: the directory {parent} does not exist")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"cannot write {path}: {parent} is {_kind(st.st_mode)}, not a directory")


def save_target(arg: str, overwrite: bool) -> str:
    """DST of an import: where :func:`safeckpt.save` writes, a local path or a URL."""
    dst = _resolve(arg, "DST")
    if not overwrite and not is_remote(dst) and os.path.lexists(dst):
        raise CheckpointExists(f"{dst} already exists; pass --overwrite to replace it (only a safeckpt "
                               "checkpoint is ever replaced)")
    return dst


def import_source(arg: str, fmt: str) -> str:
    """SRC of ``convert --from FMT``: a local DCP directory (``dcp``) or a local file (``torch-save``)."""
    if is_remote(arg):
        raise UsageError(
            f"convert --from {fmt} reads local paths only, not URLs ({arg}): copy it to a local "
            "disk first (e.g. `aws s3 cp --recursive`); the destination DST may be a URL"
        )
    path = _resolve(arg, "SRC")
    st = _stat(path, "SRC")
    takes = ("--from dcp takes a torch.distributed.checkpoint directory (the one holding .metadata)"
             if fmt == "dcp" else "--from torch-save takes a file written by torch.save")
    if st is None:
        raise CheckpointNotFound(f"no such file or directory: {path} ({takes})", path=path)
    if fmt == "dcp":
        if not stat.S_ISDIR(st.st_mode):
            hint = " (a torch.save file? use --from torch-save)" if stat.S_ISREG(st.st_mode) else ""
            raise CheckpointNotFound(f"{path} is {_kind(st.st_mode)}; {takes}{hint}", path=path)
        return path
    if stat.S_ISDIR(st.st_mode):
        hint = (" (it holds .metadata: a DCP checkpoint, use --from dcp)"
                if os.path.exists(os.path.join(path, ".metadata")) else "")
        raise CheckpointNotFound(f"{path} is a directory; {takes}{hint}", path=path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointNotFound(
            f"{path} is {_kind(st.st_mode)}, not a regular file; refusing to read it (it could block)", path=path
        )
    return path
