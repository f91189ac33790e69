"""The ``safeckpt`` entry point: the argument parser, one-line errors and exit codes (:func:`main`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

from .._version import __version__
from ..errors import SafeckptWarning
from ..storage.base import default_options, is_remote, parse_options
from .commands import (
    cmd_consolidate,
    cmd_convert,
    cmd_gc,
    cmd_inspect,
    cmd_ls,
    cmd_verify,
)
from .common import EXIT_CODES, EXIT_PIPE, EXIT_USAGE, UI, UsageError
from .diff import cmd_diff
from .exit_codes import describe, one_line


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line too (argparse prints the whole usage block otherwise)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (`{self.prog} --help` shows the usage)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="safeckpt",
        description="Inspect, verify, clean up, compare and export safeckpt checkpoints.",
        epilog="Exit codes: " + "; ".join(f"{code} {what}" for code, what in EXIT_CODES).replace("`", "")
               + ". Errors are one line on stderr; --debug adds the traceback.",
    )
    p.add_argument("--version", action="version", version=f"safeckpt {__version__}")
    p.add_argument("--debug", action="store_true", help="on an error, also print the traceback")
    store_help = ("an fsspec option for URL paths (endpoint, credentials), repeatable; VALUE is "
                  "JSON or a string, a dotted KEY nests: endpoint_url=http://127.0.0.1:9000, "
                  "key=..., secret=..., client_kwargs.region_name=eu-west-1")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", help=store_help)
    common = argparse.ArgumentParser(add_help=False)  # so `safeckpt CMD ... --debug` works too
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, also print the traceback")
    common.add_argument("--storage-option", action="append", default=argparse.SUPPRESS,
                        metavar="KEY=VALUE", help=store_help)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True,
                           parser_class=lambda **kw: _Parser(parents=[common], **kw))

    s = sub.add_parser("ls", help="list checkpoints, leftovers and the writer lease under ROOT",
                       description="List what is under a checkpoint root: committed checkpoints (step, "
                                   "time, size, world size, metrics), leftovers of interrupted saves, "
                                   "corrupt or incomplete directories, and who holds the writer lease. "
                                   "File sizes are always checked; --verify also checks every checksum.")
    s.add_argument("root", metavar="ROOT")
    s.add_argument("--verify", action="store_true", help="deep-check every committed checkpoint (reads all bytes)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("inspect", help="show a checkpoint's metadata and tensors",
                       description="Show a checkpoint's metadata (step, world size, time, versions, user "
                                   "metadata, metrics), its objects, and every tensor with dtype, shape, "
                                   "size and scope. Reads only the manifest.")
    s.add_argument("ckpt", metavar="CKPT")
    s.add_argument("--values", action="store_true", help="also list non-tensor values (hyperparameters, counters)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="check a checkpoint; exit 0 only when it is sound",
                       description="Check a checkpoint: manifest, every file present with its size, every "
                                   "tensor fully covered, and (--deep, the default) every file's checksum. "
                                   "Exit 0 when sound, 5 when corrupt, 2 when there is no checkpoint.")
    s.add_argument("ckpt", metavar="CKPT")
    s.add_argument("--deep", action=argparse.BooleanOptionalAction, default=True,
                   help="verify checksums of all bytes (default); --no-deep checks sizes only")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("gc", help="remove leftovers of crashed saves; optionally apply retention",
                       description="Remove staging and trash leftovers of interrupted saves under ROOT. "
                                   "With --keep-* rules, also delete committed step-* checkpoints that no "
                                   "rule keeps (never the newest). Refuses while a live job holds the "
                                   "writer lease, and never touches anything it does not recognise.")
    s.add_argument("root", metavar="ROOT")
    s.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N committed checkpoints")
    s.add_argument("--keep-best", type=int, metavar="N", help="keep the N best by --best-metric")
    s.add_argument("--best-metric", metavar="NAME", help="metric saved with each checkpoint (e.g. loss)")
    s.add_argument("--best-mode", choices=("min", "max"), default="min", help="min (default) or max is best")
    s.add_argument("--keep-every", type=int, metavar="N", help="keep every checkpoint whose step is a multiple of N")
    s.add_argument("--dry-run", action="store_true", help="show what would be removed; remove nothing")
    s.add_argument("--break-lock", action="store_true",
                   help="remove the writer lease first, even if it looks live (only if that job is gone)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser("diff", help="compare two checkpoints tensor by tensor (exit 1 if they differ)",
                       description="Compare two checkpoints: per-tensor max absolute difference, tensors "
                                   "only in A or only in B, dtype/shape differences, differing non-tensor "
                                   "values, metadata and metrics. Reads one tensor at a time. "
                                   "Exit 0 when identical, 1 when different.")
    s.add_argument("a", metavar="A")
    s.add_argument("b", metavar="B")
    s.add_argument("--atol", type=float, default=0.0, help="tensors within this max abs difference count as equal")
    s.add_argument("--all", action="store_true", help="list every compared tensor, not only differing ones")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser("consolidate", help="write one full state dict as a single safetensors file",
                       description="Assemble every tensor (replicated, sharded or per-rank: rank 0's) into "
                                   "one plain safetensors file, one tensor at a time (peak memory: the "
                                   "largest tensor). With --only NAME, only that object, with names "
                                   "relative to it ('model/layer.weight' -> 'layer.weight'), ready for "
                                   "module.load_state_dict(safetensors.torch.load_file(OUT)) and "
                                   "Hugging Face tools.")
    s.add_argument("ckpt", metavar="CKPT")
    s.add_argument("-o", "--output", required=True, metavar="OUT.safetensors")
    s.add_argument("--only", metavar="NAME", help="one top-level object of the state, e.g. model")
    s.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    s.set_defaults(func=cmd_consolidate)

    s = sub.add_parser("convert", help="import DCP / torch.save into safeckpt, or export to Hugging Face",
                       description="Import a torch.distributed.checkpoint directory (--from dcp) or a "
                                   "torch.save file (--from torch-save; a pickle, so only with "
                                   "--allow-pickle) into a safeckpt checkpoint at DST, or export a "
                                   "safeckpt checkpoint's model to Hugging Face style safetensors in the "
                                   "directory DST (--to hf: model.safetensors, or shards plus "
                                   "model.safetensors.index.json above --max-shard-size). Runs in one "
                                   "process, no torchrun.")
    s.add_argument("src", metavar="SRC")
    s.add_argument("dst", metavar="DST")
    way = s.add_mutually_exclusive_group(required=True)
    way.add_argument("--from", dest="from_", choices=("dcp", "torch-save"), help="import SRC of this format")
    way.add_argument("--to", choices=("hf",), help="export SRC (a safeckpt checkpoint) to this format")
    s.add_argument("--entry", metavar="NAME", help="import: store the whole loaded state under this one entry")
    s.add_argument("--allow-pickle", action="store_true",
                   help="import: allow unpickling (required for torch.save files; for DCP, allows "
                        "custom pickled values). Only for files you trust")
    s.add_argument("--no-weights-only", action="store_true",
                   help="torch-save import: torch.load(weights_only=False), arbitrary objects (runs "
                        "arbitrary unpickling; trusted files only)")
    s.add_argument("--only", metavar="NAME", help="export: the entry to export (default model)")
    s.add_argument("--max-shard-size", metavar="SIZE",
                   help="export: largest file before sharding, bytes or e.g. 5GB, 500MiB (default 5GB)")
    s.add_argument("--overwrite", action="store_true", help="replace what is at DST")
    s.set_defaults(func=cmd_convert)
    return p


def _stdout_gone() -> bool:
    """Whether our stdout is a pipe whose reader has gone (`safeckpt ls ROOT | head`)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLERR)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no real file descriptor (captured output)
        return False


def _remote_arg(args: argparse.Namespace) -> str | None:
    for name in ("root", "ckpt", "a", "b", "src", "dst"):
        value = getattr(args, name, None)
        if isinstance(value, str) and is_remote(value):
            return value
    return None


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return parse_options(getattr(args, "storage_option", None) or [])
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _print_err(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr itself closed: nothing more to do
        print(text, file=sys.stderr, flush=True)


def _one_line_warnings(prog: str) -> Callable[..., None]:
    """``warnings.showwarning``: safeckpt's own warnings as one line; others' (deprecations of
    the libraries we call) only with --debug."""

    def show(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
        if issubclass(category, SafeckptWarning):
            _print_err(f"{prog}: warning: {one_line(str(message))}")

    return show


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``safeckpt`` console script; returns the exit code.

    Every failure is one line on stderr (``safeckpt CMD: error: ...``) and an exit code from
    the table in docs/cli.md (``EXIT_CODES``); ``--debug`` also prints the traceback."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    ui = UI()
    prog = f"safeckpt {args.command}"
    debug = bool(getattr(args, "debug", False))
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.showwarning = _one_line_warnings(prog)
            with default_options(_storage_options(args)):
                code = int(args.func(args, ui))
            sys.stdout.flush()  # a closed pipe shows here, not in Python's exit-time flush
            return code
    except SystemExit:
        raise
    except BaseException as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            # `safeckpt ls ROOT | head`: stop quietly, and keep Python's exit-time flush of
            # stdout from printing a second BrokenPipeError.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_PIPE
        code, line = describe(exc, _remote_arg(args))
        if debug:
            with contextlib.suppress(OSError, ValueError):
                traceback.print_exception(exc, file=sys.stderr)
        _print_err(f"{prog}: {line}")
        return code

