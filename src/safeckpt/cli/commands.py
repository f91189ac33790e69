"""The ``safeckpt`` commands (``cmd_*``): each takes the parsed arguments and a UI and returns an exit code.

The parser and the entry point are in :mod:`safeckpt.cli.app`; the package docstring lists the commands.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import uuid
from collections.abc import Callable
from typing import Any

from .. import _humanize as human
from ..coord.lease import break_lease, holder_is_live, read_lock, writer_lease
from ..engine.local_tier import ROOT_QUARANTINE, hidden_by, quarantine_entries, save_signature
from ..engine.local_tier import describe as describe_local_tier
from ..engine.offline import VerifyReport, verify
from ..engine.reader import open_manifest
from ..errors import (
    CheckpointError,
    CheckpointLocked,
    CorruptCheckpoint,
)
from ..format.manifest import MANIFEST, dtype_size
from ..format.tree import tensor_keys
from ..format.v3 import FORMAT_V3, Layout
from ..retention import RetentionPolicy
from ..storage.base import is_remote, join, storage_for
from ..storage.catalog import Entry, entry_nbytes, recover, remove_entry, scan, unmanaged
from .common import (
    GC_LEASE,
    UI,
    Advance,
    UsageError,
    _checkpoint_files_size,
    _short,
    _step,
    _tensor_nbytes,
    _tensor_order,
    _values,
)
from .paths import (
    checkpoint_arg,
    import_source,
    local_output_dir,
    local_output_file,
    root_arg,
    save_target,
)


def _check(path: str, deep: bool, advance: Advance | None) -> VerifyReport:
    """:func:`safeckpt.verify`, feeding a progress bar while it hashes when one is shown."""
    return verify(path, deep=deep, progress=advance, storage_errors="raise")  # exit 74, not "corrupt"


def _entry_size(e: Entry) -> int:
    return entry_nbytes(e)


def _has_manifest(path: str) -> bool:
    return storage_for(path).size(join(path, MANIFEST)) is not None


def _root(path: str) -> str:
    root = root_arg(path)
    storage_for(root)  # for a URL: fsspec and the scheme's package are installed, or a clear error
    return root  # (an object-store prefix exists only through what is under it)


def _lease(root: str) -> dict[str, Any] | None:
    """The writer lease on ``root`` (holder, age, live) or None when nobody holds one."""
    holder = read_lock(root)
    if holder is None:
        return None
    return {
        "run_id": holder.get("run_id"), "host": holder.get("host"), "pid": holder.get("pid"),
        "heartbeat_age": round(float(holder.get("age", 0.0)), 1), "lease": holder.get("lease"),
        "live": holder_is_live(holder),
    }


def _lease_line(lease: dict[str, Any]) -> str:
    state = "LIVE (a job is writing here)" if lease["live"] else "stale (holder gone; the next writer takes it over)"
    return (f"writer lease: run {lease['run_id']} on {lease['host']} pid {lease['pid']}, "
            f"heartbeat {human.age(lease['heartbeat_age'])} ago: {state}")


# --------------------------------------------------------------------------- ls


def _unmanaged(root: str, known: set[str]) -> list[Entry]:
    """Checkpoints under ``root`` saved with safeckpt.save under names the manager does not use."""
    return unmanaged(root, known)


def _quarantine_marks(root: str) -> dict[str, dict[str, Any]]:
    """``mgr.quarantine``'s marks under ``root`` (step -> {"reason", "sigs"}: the saves marked)."""
    try:
        raw = storage_for(root).read(join(root, ROOT_QUARANTINE), 1 << 20)
        rec = json.loads(raw) if raw else {}
    except (CheckpointError, OSError, ValueError, RecursionError):
        return {}
    return quarantine_entries(rec)


def _marked(marks: dict[str, dict[str, Any]], e: Entry) -> str | None:
    """The reason ``e`` is quarantined, or None (unmarked, or a later save of a marked step)."""
    if e.step is None or str(e.step) not in marks:
        return None
    sig = None
    with contextlib.suppress(Exception):  # unreadable: shown as marked, as a restore treats it
        sig = save_signature(storage_for(e.path).read_manifest(e.path))
    return hidden_by(marks, e.step, sig)


def _ls_local_tier(runs: list[dict[str, Any]], args: argparse.Namespace, ui: UI) -> int:
    """``safeckpt ls LOCAL_DIR``: what this node holds of each run (see engine.local_tier)."""
    if args.json:
        ui.json({"local_tier": runs})
        return 0
    for i, run in enumerate(runs):
        if i:
            ui.echo("")
        if run.get("moved_aside"):  # engine.local_tier: another run's data of this root path
            ui.echo(f"local tier {run['run']} (root {run['root']}; another run's data, moved aside by a "
                    "newer run of that root: not used by any run; delete it to free the space)")
        else:
            ui.echo(f"local tier {run['run']} (root {run['root']})")
        if not run["steps"]:
            ui.echo("  no steps")
            continue
        ui.table(
            ["STEP", "NODE", "FILES", "OWN", "REPLICAS", "STATUS"],
            [[str(s["step"]), str(s["node"] or "-"), f"{s['files']}/{s['of'] if s['of'] is not None else '?'}",
              str(len(s["own"])), str(len(s["replicas"])),
              f"quarantined ({s['quarantined']})" if s["quarantined"] else
              ("all files here" if s["of"] is not None and s["files"] == s["of"] else "partial (rest on peers/root)")]
             for s in run["steps"]],
            right={0, 2, 3, 4},
        )
    return 0


def cmd_ls(args: argparse.Namespace, ui: UI) -> int:
    root = _root(args.root)
    entries = scan(root)
    # A node's local_dir: its tier table. A directory that is both (local_dir == root) shows both.
    local_runs = None if is_remote(root) else describe_local_tier(root)
    if local_runs is not None and not entries:
        return _ls_local_tier(local_runs, args, ui)
    marks = _quarantine_marks(root)
    managed = {e.name for e in entries}
    extra = _unmanaged(root, managed)
    lease = _lease(root)
    live = bool(lease and lease["live"])
    to_check = [e for e in entries + extra if e.status == "committed" and e.info is not None]
    total = sum(e.info.nbytes for e in to_check if e.info) if args.verify else 0
    reports: dict[str, VerifyReport] = {}
    with ui.progress(total, "verifying") as advance:
        for e in to_check:
            reports[e.path] = _check(e.path, args.verify, advance)

    rows = []
    for e in entries + extra:
        row: dict[str, Any] = {
            "name": e.name, "path": e.path, "step": e.step, "status": e.status,
            "managed": e.name in managed, "problems": [e.problem] if e.problem else [],
            "created_at": None, "nbytes": None, "world_size": None, "metrics": {},
        }
        if e.info is not None:
            row.update(created_at=e.info.created_at, nbytes=e.info.nbytes,
                       world_size=e.info.world_size, metrics=e.info.metrics)
            rep = reports[e.path]
            if not rep.ok and not (_has_manifest(e.path) if is_remote(e.path) else os.path.isdir(e.path)):
                continue  # deleted (by retention) while we looked: not corrupt, just gone
            row["verified"] = "deep" if args.verify else "sizes"
            if not rep.ok:
                row["status"] = "corrupt"
                row["problems"] = rep.problems
        else:
            if not is_remote(e.path):
                with contextlib.suppress(OSError):
                    row["created_at"] = human.iso(os.path.getmtime(e.path))
            row["nbytes"] = _entry_size(e)
        if e.status in ("staging", "trash"):
            row["status"] = f"{e.status} ({'live writer' if live else 'leftover'})"
        why = _marked(marks, e)
        if why is not None:
            row["status"] = f"{row['status']}, quarantined ({why})"
            row["quarantined"] = why
        rows.append(row)

    if args.json:
        doc = {"root": root, "lease": lease, "entries": rows, "quarantine": {k: v["reason"] for k, v in marks.items()}}
        if local_runs is not None:
            doc["local_tier"] = local_runs
        ui.json(doc)
        return 0
    if local_runs is not None:
        _ls_local_tier(local_runs, args, ui)
        ui.echo("")
    if not rows:
        hint = " (it is a checkpoint itself: try `safeckpt inspect`)" if _has_manifest(root) else ""
        ui.echo(f"no checkpoints under {root}{hint}")
    else:
        ui.table(
            ["NAME", "STEP", "TIME (UTC)", "SIZE", "WORLD", "METRICS", "STATUS"],
            [[r["name"], _step(r["step"]), human.timestamp(r["created_at"]),
              "-" if r["nbytes"] is None else human.size(r["nbytes"]),
              "-" if r["world_size"] is None else str(r["world_size"]),
              human.metrics(r["metrics"]), r["status"]] for r in rows],
            right={1, 3, 4},
        )
        problems = [(r["name"], p) for r in rows for p in r["problems"]]
        if problems:
            ui.echo("")
            for name, p in problems:
                ui.echo(f"{name}: {p}")
        leftovers = [r for r in rows if r["status"].endswith("(leftover)")]
        if leftovers:
            ui.echo("")
            ui.echo(f"{len(leftovers)} leftover(s) of interrupted saves ({human.size(sum(r['nbytes'] for r in leftovers))}); "
                    f"`safeckpt gc {args.root}` removes them")
    if lease:
        ui.echo(_lease_line(lease))
    return 0


# --------------------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace, ui: UI) -> int:
    ckpt = checkpoint_arg(args.ckpt)
    man = open_manifest(ckpt, full=False)  # the manifest alone: format 3's indexes are not read
    layout = Layout(man, ckpt, None, dtype_size) if man.get("format_version") == FORMAT_V3 else None
    order = _tensor_order(man)
    tensors = []
    for key in order:
        rec = man["tensors"][key]
        if layout is None:
            chunks = len(rec["chunks"])
        elif "alias_of" in rec:
            chunks = 0
        elif rec.get("scope") == "per_rank":
            chunks = int(man["world_size"])
        else:
            chunks = len(list(layout.holders(key, None, 0)))
        tensors.append({
            "key": key, "dtype": rec["dtype"], "shape": list(rec["shape"]), "nbytes": _tensor_nbytes(rec),
            "scope": rec.get("scope", "replicated"), "chunks": chunks,
        })
    objects = {}
    for name, obj in man["objects"].items():
        keys = list(dict.fromkeys(tensor_keys(obj["tree"])))
        objects[name] = {"kind": obj.get("kind"), "tensors": len(keys),
                         "nbytes": sum(_tensor_nbytes(man["tensors"][k]) for k in keys if k in man["tensors"])}
    values = _values(man)
    summary = {
        "path": ckpt, "step": man.get("step"), "world_size": man.get("world_size"),
        "created_at": man.get("created_at"), "format_version": man.get("format_version"),
        "safeckpt_version": man.get("safeckpt_version"), "torch_version": man.get("torch_version"),
        "nbytes": _checkpoint_files_size(man), "metadata": man.get("metadata") or {},
        "metrics": man.get("metrics") or {},
        "files": {name: rec["size"] for name, rec in sorted(man["files"].items())},
    }
    if args.json:
        ui.json({**summary, "objects": objects, "tensors": tensors, "values": values})
        return 0
    ui.echo(f"checkpoint  {ckpt}")
    ui.echo(f"step        {_step(summary['step'])}")
    ui.echo(f"created     {human.timestamp(summary['created_at'])}")
    ui.echo(f"world size  {summary['world_size']}")
    ui.echo(f"size        {human.size(summary['nbytes'])} in {len(summary['files'])} file(s), "
            f"{len(tensors)} tensor(s)")
    ui.echo(f"versions    format {summary['format_version']}, safeckpt {summary['safeckpt_version']}, "
            f"torch {summary['torch_version']}")
    ui.echo(f"metrics     {human.metrics(summary['metrics'])}")
    for k, v in summary["metadata"].items():
        ui.echo(f"metadata    {k} = {_short(v)}")
    ui.echo("")
    ui.table(["OBJECT", "KIND", "TENSORS", "SIZE"],
             [[n, str(o["kind"]), str(o["tensors"]), human.size(o["nbytes"])] for n, o in objects.items()],
             right={2, 3})
    ui.echo("")
    ui.table(["TENSOR", "DTYPE", "SHAPE", "SIZE", "SCOPE"],
             [[t["key"], t["dtype"], human.shape(t["shape"]), human.size(t["nbytes"]), t["scope"]] for t in tensors],
             right={3})
    if values and args.values:
        ui.echo("")
        ui.table(["KEY", "VALUE"], [[k, _short(v)] for k, v in values.items()])
    elif values:
        ui.echo("")
        ui.echo(f"{len(values)} non-tensor value(s) (--values shows them)")
    return 0


# --------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace, ui: UI) -> int:
    ckpt = checkpoint_arg(args.ckpt)
    try:
        man = open_manifest(ckpt, full=False)
        total = _checkpoint_files_size(man) if args.deep else 0
    except CorruptCheckpoint:
        total = 0  # an unreadable manifest: verify reports it
    with ui.progress(total, "verifying") as advance:
        report = _check(ckpt, args.deep, advance)
    code = 0 if report.ok else CorruptCheckpoint.exit_code
    if args.json:
        ui.json({"path": report.path, "ok": report.ok, "deep": report.deep, "step": report.step,
                 "nbytes": report.nbytes, "problems": report.problems, "exit_code": code})
        return code
    how = "checksums of every file" if report.deep else "sizes only, no checksums (--deep checks every byte)"
    if report.ok:
        ui.echo(f"OK  {report.path}  (step {_step(report.step)}, {human.size(report.nbytes)}; {how})")
    else:
        ui.echo(f"CORRUPT  {report.path}  ({len(report.problems)} problem(s); {how})")
        for p in report.problems:
            ui.echo(f"  - {p}")
    return code


# --------------------------------------------------------------------------- gc


def _policy(args: argparse.Namespace) -> RetentionPolicy | None:
    rules = (args.keep_last, args.keep_best, args.keep_every)
    if all(r is None for r in rules):
        if args.best_metric:
            raise UsageError("--best-metric needs --keep-best N")
        return None
    try:
        # Only --keep-best/--keep-every given: keep what they keep plus the newest (keep_last=1).
        return RetentionPolicy(keep_last=1 if args.keep_last is None else args.keep_last, keep_best=args.keep_best,
                               best_metric=args.best_metric, best_mode=args.best_mode,
                               keep_every=args.keep_every)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _gc_plan(root: str, policy: RetentionPolicy | None) -> tuple[list[Entry], list[Entry], list[Entry]]:
    """(leftovers to remove, committed checkpoints retention deletes, entries left alone)."""
    entries = scan(root)
    leftovers = [e for e in entries if e.status in ("staging", "trash")]
    done = [e for e in entries if e.status == "committed" and e.info is not None]
    doomed: list[Entry] = []
    if policy is not None and done:
        steps = set(policy.delete([(e.step, e.info.metrics if e.info else {}) for e in done]))
        doomed = [e for e in done if e.step in steps]
    alone = [e for e in entries if e.status in ("incomplete", "corrupt")]
    return leftovers, doomed, alone


def _break_lease(root: str, ui: UI) -> None:
    lease = _lease(root)
    if lease is None:
        return
    break_lease(root)
    ui.warn(f"warning: broke the writer lease of run {lease['run_id']} on {lease['host']} pid {lease['pid']}"
            + (" (it looked LIVE: if that job is still saving, its checkpoint may be lost)" if lease["live"] else ""))


def cmd_gc(args: argparse.Namespace, ui: UI) -> int:
    root = _root(args.root)
    policy = _policy(args)
    if _has_manifest(root):
        raise UsageError(f"{root} is a checkpoint, not a checkpoint root: gc cleans the directory that "
                         "holds checkpoints (its parent) and never writes inside a checkpoint")
    lease = _lease(root)
    live = bool(lease and lease["live"])
    refused = live and not args.break_lock
    lock: Any = None
    if not args.dry_run:
        if lease is not None and refused:
            raise CheckpointLocked(
                f"{root} has a live writer ({_lease_line(lease)}); gc does not touch a root a job is "
                "writing (its manager sweeps leftovers itself at the next save). Stop the job first, "
                "or pass --break-lock if you are sure it is gone."
            )
        if args.break_lock:
            _break_lease(root, ui)
        # Hold the lease while deleting, so no writer starts saving into what we clean.
        lock = writer_lease(root, run_id=f"safeckpt-gc-{os.getpid()}-{uuid.uuid4().hex[:8]}", lease=GC_LEASE)
        lock.acquire()
    removed: list[dict[str, Any]] = []
    try:
        if not args.dry_run:  # an overwrite killed between its two renames: the old copy goes back first
            for path in recover(root):
                ui.warn(f"put back {path} (set aside by an overwrite that was killed between its renames)")
        leftovers, doomed, alone = _gc_plan(root, policy)
        for e, why in [(e, f"{e.status} leftover") for e in leftovers] + [(e, "retention") for e in doomed]:
            size = _entry_size(e)
            if not args.dry_run:
                remove_entry(e)
            removed.append({"name": e.name, "step": e.step, "reason": why, "nbytes": size})
    finally:
        if lock is not None:
            lock.release()
    gone = {r["name"] for r in removed if r["reason"] == "retention"}  # (a remote leftover shares its checkpoint's name)
    kept = [e.name for e in scan(root) if e.status == "committed" and e.name not in gone]
    if args.json:
        ui.json({"root": root, "dry_run": args.dry_run, "removed": removed, "kept": kept,
                 "left_alone": [{"name": e.name, "status": e.status, "problem": e.problem} for e in alone],
                 "lease": lease, "would_refuse": refused})
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for r in removed:
        ui.echo(f"{verb} {r['name']}  ({r['reason']}, {human.size(r['nbytes'])})")
    if not removed:
        ui.echo("nothing to remove")
    else:
        ui.echo(f"{verb} {len(removed)} director{'y' if len(removed) == 1 else 'ies'}, "
                f"{human.size(sum(r['nbytes'] for r in removed))}; {len(kept)} committed checkpoint(s) kept")
    for e in alone:
        ui.echo(f"left alone: {e.name} ({e.status}: {e.problem}); not something gc removes, delete it by hand if unwanted")
    if lease is not None and args.dry_run and refused:
        ui.echo(_lease_line(lease))
        ui.echo("gc would refuse to run now (use --break-lock only if that job is gone)")
    return 0


# --------------------------------------------------------------------------- consolidate, convert


def _bytes_progress(advance: Advance | None) -> Callable[[int, int, str], None] | None:
    """Adapt a byte-counting bar to _convert's ``progress(done, total, name)`` callback."""
    if advance is None:
        return None
    last = 0

    def report(done: int, total: int, name: str) -> None:
        nonlocal last
        advance(done - last)
        last = done

    return report


def _selected_nbytes(ckpt: str, only: str | None) -> int:
    """Tensor bytes that consolidate/export will write (raises early when ``only`` matches nothing)."""
    from ..convert.consolidate import _select

    man = open_manifest(ckpt, full=False)
    tensors, _ = _select(man, only)
    return sum(_tensor_nbytes(man["tensors"][key]) for _, key in tensors)


def cmd_consolidate(args: argparse.Namespace, ui: UI) -> int:
    from ..convert import consolidate

    ckpt = checkpoint_arg(args.ckpt)
    out = local_output_file(args.output, args.overwrite)
    total = _selected_nbytes(ckpt, args.only)
    with ui.progress(total, "consolidating") as advance:
        written = consolidate(ckpt, out, only=args.only, progress=_bytes_progress(advance))
    ui.echo(f"wrote {written.path}: {len(written.names)} tensor(s), {human.size(written.nbytes)}"
            + (f" (only {args.only!r}, names without the '{args.only.strip('/')}/' prefix)" if args.only else ""))
    return 0


def cmd_convert(args: argparse.Namespace, ui: UI) -> int:
    from .. import convert as _convert

    if args.to == "hf":
        if args.entry or args.allow_pickle or args.no_weights_only:
            raise UsageError("--entry, --allow-pickle and --no-weights-only are for --from (imports)")
        src, dst = checkpoint_arg(args.src), local_output_dir(args.dst)
        only = "model" if args.only is None else args.only
        try:
            limit = _convert.parse_size(args.max_shard_size or "5GB")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if limit <= 0:
            raise UsageError(f"--max-shard-size must be positive, got {args.max_shard_size!r}")
        total = _selected_nbytes(src, only)
        with ui.progress(total, "exporting") as advance:
            paths = _convert.export_hf(src, dst, only=only, max_shard_size=limit,
                                       overwrite=args.overwrite, progress=_bytes_progress(advance))
        for path in paths:
            ui.echo(f"wrote {path}")
        return 0
    if args.only is not None or args.max_shard_size is not None:
        raise UsageError("--only and --max-shard-size are for --to hf (exports)")
    src, dst = import_source(args.src, args.from_), save_target(args.dst, args.overwrite)
    if args.from_ == "dcp":
        if args.no_weights_only:
            raise UsageError("--no-weights-only is for --from torch-save")
        info = _convert.import_dcp(src, dst, entry=args.entry, allow_pickle=args.allow_pickle,
                                   overwrite=args.overwrite)
    else:
        info = _convert.import_torch_save(src, dst, allow_pickle=args.allow_pickle, entry=args.entry,
                                          weights_only=not args.no_weights_only, overwrite=args.overwrite)
    ui.echo(f"wrote {info.path}: safeckpt checkpoint, {human.size(info.nbytes)} "
            f"(check it with `safeckpt inspect {args.dst}`)")
    return 0


