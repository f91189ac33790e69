"""Every exception safeckpt raises, rooted in one class.

    CheckpointError (Exception)
    ├── RankFailure              one or more ranks failed or died; raised on every surviving rank
    ├── RankMismatch (ValueError) ranks were called with different path, step or state layout
    ├── CorruptCheckpoint        files missing, truncated, or failing their checksums
    ├── IncompatibleCheckpoint   keys/shapes/dtypes do not fit the target on a strict load
    ├── CheckpointNotFound (FileNotFoundError)
    ├── CheckpointExists (FileExistsError)  target exists and overwrite=False
    ├── CheckpointLocked         another live job holds the checkpoint root
    └── StorageError             the storage refused or failed a request (not the checkpoint's fault)
        └── StorageUnavailable   a read kept failing for a reason that can pass (EMFILE, EIO, ESTALE)

Errors carry structured fields (``rank``, ``path``, ``failures``) so callers need not parse
messages. Messages say what happened, on which rank, and what to do next.
"""

from __future__ import annotations

from collections.abc import Mapping


class CheckpointError(Exception):
    """Base class of all safeckpt errors."""

    exit_code: int = 1


class RankFailure(CheckpointError):
    """One or more ranks failed (raised an exception, died, or never arrived), or were out of
    step with rank 0 (in another collective phase: a rank skipped or repeated a call; every
    rank then raises at once, naming the phases).

    ``failures`` maps each failing rank to a one-line description of its error.
    """

    exit_code = 3

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)


class RankMismatch(CheckpointError, ValueError):
    """Ranks were called with different arguments or different state layouts."""

    exit_code = 4


class CorruptCheckpoint(CheckpointError):
    """A checkpoint's files are missing, truncated, or fail their checksums."""

    exit_code = 5

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class IncompatibleCheckpoint(CheckpointError):
    """A checkpoint does not fit the state it is loaded into (strict load)."""

    exit_code = 6


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the given path."""

    exit_code = 2

    def __init__(self, message: str, path: str | None = None) -> None:
        CheckpointError.__init__(self, message)
        self.path = path

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointExists(CheckpointError, FileExistsError):
    """The target path already holds something and ``overwrite`` was not given."""

    exit_code = 8

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointLocked(CheckpointError):
    """Another live job is writing to the same checkpoint root."""

    exit_code = 7


class StorageError(CheckpointError):
    """The storage service failed or refused a request (unreachable or hung endpoint, missing
    or wrong credentials, access denied). Nothing about the checkpoint itself is known.
    (Defined here so that the format layer can raise it; ``safeckpt.storage.base`` exports it.)"""

    exit_code = 74  # the CLI's "the system or the object store refused"


class StorageUnavailable(StorageError):
    """Reading a checkpoint's file kept failing, after a few tries, for a reason that says
    nothing about the checkpoint (too many open files, an I/O error, a stale NFS handle): the
    checkpoint may be fine, so a restore must not fall back to an older one. Raised on every
    rank of a collective load (portable). ``errno`` is the last OS error number."""

    errno: int | None = None

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class SafeckptWarning(UserWarning):
    """Warnings about recoverable surprises (fallbacks, resharding of per-rank state)."""


# Error types that mean the same thing on every rank, so one rank's error of this kind is
# re-raised as that type everywhere (instead of the generic RankFailure).
PORTABLE_ERRORS: tuple[type[CheckpointError], ...] = (
    RankMismatch,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    CheckpointNotFound,
    CheckpointExists,
    CheckpointLocked,
    StorageUnavailable,  # a transient read failure: the same on every rank, never a fallback
)
