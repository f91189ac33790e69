"""Turn any exception that reaches the CLI into one line on stderr and a documented exit code.

safeckpt's own errors carry their exit code; the operating system's (permission denied, not a
directory, disk full) and a storage service's (missing credentials) get a line saying which
path and what to do; only an exception nobody expected is called a bug. ``--debug`` adds the
traceback; the line and the exit code stay the same.
"""

from __future__ import annotations

import errno
import re

from ..errors import CheckpointError, CheckpointExists
from .common import (
    EXIT_DIFFERENT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_USAGE,
    UsageError,
)

MAX_LINE = 1000
_CONTROL = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")  # ANSI colours, control chars
# Packages whose exceptions mean "the storage service said no", not "safeckpt has a bug".
STORAGE_PACKAGES = frozenset({
    "fsspec", "s3fs", "botocore", "aiobotocore", "boto3", "gcsfs", "google", "adlfs", "azure",
    "aiohttp", "requests", "urllib3", "ossfs", "huggingface_hub",
})
_CREDENTIAL_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (or ~/.aws/credentials), "
          "and AWS_ENDPOINT_URL for a non-AWS store",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
    "gcs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
}


def one_line(text: str) -> str:
    """``text`` on one line: lines joined with '; ', control characters dropped, bounded length."""
    text = _CONTROL.sub("", text)
    line = "; ".join(part.strip() for part in text.splitlines() if part.strip())
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


def _message(exc: BaseException) -> str:
    return one_line(str(exc)) or type(exc).__name__


def _os_error(exc: OSError) -> tuple[int, str]:
    name = exc.filename if exc.filename is not None else None
    where = f" {name}" if name is not None else ""
    code = exc.errno
    if isinstance(exc, FileExistsError) and not isinstance(exc, CheckpointExists):
        return CheckpointExists.exit_code, f"error: {where.strip() or 'the output'} already exists"
    if code == errno.ENOENT:
        return EXIT_USAGE, f"error: no such file or directory:{where}" if where else f"error: {_message(exc)}"
    if code == errno.ENOTDIR:
        return EXIT_USAGE, f"error: not a directory:{where} (a part of this path is a file)"
    if code == errno.EISDIR:
        return EXIT_USAGE, f"error:{where} is a directory, where a file was expected"
    if code in (errno.EACCES, errno.EPERM):
        return EXIT_IO, (f"error: permission denied:{where}; check its permissions (and its parent "
                         "directories'), or run as a user who may access it")
    if code == errno.EROFS:
        return EXIT_IO, f"error: read-only file system:{where}; write the output somewhere writable"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return EXIT_IO, (f"error: no space left on the device (or quota exceeded) writing{where or ' the output'}; "
                         "free some space")
    if code == errno.ELOOP:
        return EXIT_IO, f"error: symlink refused or symlink loop at{where}"
    if code in (errno.ENXIO, errno.EAGAIN) and name is not None:
        return EXIT_IO, f"error:{where} cannot be opened now ({exc.strerror}); is it a FIFO or a device?"
    if code == errno.EIO:
        return EXIT_IO, f"error: input/output error reading or writing{where}: the disk or network file system failed"
    text = exc.strerror or _message(exc)
    return EXIT_IO, f"error: {text}{':' + where if where else ''}"


def _storage_error(exc: BaseException, url: str | None) -> tuple[int, str]:
    kind = type(exc).__name__
    scheme = url.split("://", 1)[0] if url and "://" in url else None
    hint = "check the URL, the network and the credentials for it"
    if "credential" in kind.lower() or "credential" in str(exc).lower() or "accessdenied" in kind.lower():
        hint = _CREDENTIAL_HINTS.get(scheme or "", "configure credentials for this storage service")
    what = f" {url}" if url else " the object store"
    return EXIT_IO, f"error: cannot access{what}: {kind}: {_message(exc)}; {hint}"


def _package(exc: BaseException) -> str:
    return (type(exc).__module__ or "").split(".", 1)[0]


def describe(exc: BaseException, remote_url: str | None = None) -> tuple[int, str]:
    """(exit code, one line without the ``safeckpt CMD:`` prefix) for an exception the command
    raised. ``remote_url``: the first object-store URL among the command's paths, if any."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, UsageError):
        return EXIT_USAGE, f"error: {_message(exc)}"
    if isinstance(exc, CheckpointError):
        return int(exc.exit_code), f"error: {_message(exc)}"
    package = _package(exc)
    if package in STORAGE_PACKAGES or (remote_url is not None and package not in ("builtins", "safeckpt")):
        return _storage_error(exc, remote_url)
    if isinstance(exc, OSError):
        return _os_error(exc)
    if isinstance(exc, MemoryError):
        return EXIT_DIFFERENT, "error: out of memory; free memory or run it on a machine with more"
    return EXIT_INTERNAL, (f"internal error: {type(exc).__name__}: {_message(exc)}; this is a bug in "
                           "safeckpt, rerun with --debug and report it with the traceback")
