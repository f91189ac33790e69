"""Shared pieces of the CLI: terminal output (rich when available, plain text otherwise),
progress bars, and small readers of a manifest that several commands use."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CheckpointExists, CheckpointLocked, CorruptCheckpoint, RankFailure
from ..format.manifest import torch_dtype
from ..format.tree import decode, tensor_keys

Advance = Callable[[int], None]

EXIT_DIFFERENT = 1  # diff found differences; also a safeckpt error with no more specific code
EXIT_USAGE = 2  # bad arguments, or no checkpoint / file / directory of the kind asked for at a path
EXIT_INTERNAL = 70  # an unexpected exception: a bug in safeckpt (sysexits EX_SOFTWARE)
EXIT_IO = 74  # the operating system or a storage service refused (permission, disk full, credentials)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_PIPE = 141  # whoever read our output went away (128 + SIGPIPE), as `cmd | head` reports it
EXIT_CODES: tuple[tuple[int, str], ...] = (  # docs/cli.md's table lists exactly these
    (0, "success (sound, identical, done)"),
    (EXIT_DIFFERENT, "`diff` found differences; or a safeckpt error with no more specific code "
                     "(`--only` matches nothing, a pickle refused)"),
    (EXIT_USAGE, "usage error, or no checkpoint (file, directory) of the kind needed at a path"),
    (RankFailure.exit_code, "the save of an import failed (`RankFailure`; the line says why)"),
    (CorruptCheckpoint.exit_code, "the checkpoint is corrupt (or an import source is damaged)"),
    (CheckpointLocked.exit_code, "a live writer holds the root (`gc` refuses)"),
    (CheckpointExists.exit_code, "the output exists (pass `--overwrite`)"),
    (EXIT_INTERNAL, "internal error: a bug in safeckpt (rerun with `--debug` and report it)"),
    (EXIT_IO, "the system or the object store refused: permission denied, disk full, I/O error, "
              "missing credentials"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
    (EXIT_PIPE, "whoever read the output went away (`safeckpt ls ROOT | head`); nothing printed"),
)
ABSENT = "<absent>"
INSTALL_HINT = "install rich for tables and progress bars: pip install 'safeckpt[cli]'"
GC_LEASE = 30.0  # a crashed gc blocks writers on other hosts for at most this long


class UsageError(Exception):
    """Bad arguments found after parsing (exit 2)."""


# --------------------------------------------------------------------------- output


def _rich() -> Any:
    try:
        import rich  # noqa: F401
    except ImportError:
        return None
    return rich


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class UI:
    """Where output goes: plain text when piped, rich tables and progress bars on a terminal."""

    def __init__(self) -> None:
        self._hinted = False

    @property
    def out(self) -> Any:
        return sys.stdout

    @property
    def err(self) -> Any:
        return sys.stderr

    def _hint(self) -> None:
        if not self._hinted:
            self._hinted = True
            print(f"safeckpt: note: {INSTALL_HINT}", file=self.err)

    def echo(self, text: str = "") -> None:
        print(text, file=self.out)

    def warn(self, text: str) -> None:
        print(f"safeckpt: {text}", file=self.err)

    def json(self, obj: Any) -> None:
        print(json.dumps(_json_safe(obj), indent=2), file=self.out)

    def table(self, headers: list[str], rows: list[list[str]], *, right: frozenset[int] | set[int] = frozenset()) -> None:
        if _isatty(self.out):
            rich = _rich()
            if rich is None:
                self._hint()
            else:
                from rich.console import Console
                from rich.table import Table

                t = Table(show_edge=False, pad_edge=False)
                for i, h in enumerate(headers):
                    t.add_column(h, justify="right" if i in right else "left", no_wrap=i == 0, overflow="fold")
                for r in rows:
                    t.add_row(*r)
                Console(file=self.out).print(t)
                return
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

        def line(cells: list[str]) -> str:
            parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return "  ".join(parts).rstrip()

        self.echo(line(headers))
        for r in rows:
            self.echo(line(r))

    @contextlib.contextmanager
    def progress(self, total: int, what: str) -> Iterator[Advance | None]:
        """A byte-counting progress bar on stderr, or None when stderr is not a terminal."""
        forced = os.environ.get("SAFECKPT_PROGRESS", "")
        enabled = forced == "1" or (forced != "0" and _isatty(self.err))
        if not enabled or total <= 0:
            yield None
            return
        if _rich() is None:
            self._hint()
            yield None
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TimeRemainingColumn(),
            console=Console(file=self.err), transient=True,
        ) as bar:
            task = bar.add_task(what, total=total)
            yield lambda n: bar.advance(task, n)


def _json_safe(obj: Any) -> Any:
    """JSON has no NaN/Infinity: write them as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _step(step: int | None) -> str:
    return "-" if step is None else str(step)


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(_json_safe(value)) if not isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# --------------------------------------------------------------------------- shared pieces


class _TensorRef:
    """Stands for a tensor while walking a manifest's object trees without reading data."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _values(man: dict[str, Any]) -> dict[str, Any]:
    """The non-tensor leaves of every object, flattened to ``object/sub/key`` (as tensor keys are).

    A list or tuple holding no dict and no tensor counts as one value (``param_groups/0/params``)."""
    out: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, _TensorRef):
            return
        if isinstance(value, dict):
            if not value:
                out[prefix] = {}
            for k, v in value.items():
                walk(v, f"{prefix}/{k}")
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple, _TensorRef)) for v in value):
            for i, v in enumerate(value):
                walk(v, f"{prefix}/{i}")
        else:
            out[prefix] = list(value) if isinstance(value, tuple) else value

    for name, obj in man["objects"].items():
        walk(decode(obj["tree"], _TensorRef), name)
    return out


def _tensor_order(man: dict[str, Any]) -> list[str]:
    """Tensor keys in the order their objects list them (state-dict order), then any others."""
    seen: dict[str, None] = {}
    for obj in man["objects"].values():
        for key in tensor_keys(obj["tree"]):
            seen.setdefault(key, None)
    for key in man["tensors"]:
        seen.setdefault(key, None)
    return list(seen)


def _tensor_nbytes(rec: dict[str, Any]) -> int:
    return math.prod(rec["shape"]) * torch_dtype(rec["dtype"]).itemsize


def _checkpoint_files_size(man: dict[str, Any]) -> int:
    return sum(int(f["size"]) for f in man["files"].values())


