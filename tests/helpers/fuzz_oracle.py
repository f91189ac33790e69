"""Run one mutant against every public reader and classify the outcome (worker side).

A worker process (driven by :class:`tests.helpers.fuzz_pool.Pool`) applies each mutant to a fresh copy
of its base root and calls, in order: ``verify(deep=True)``, ``verify(deep=False)``,
``read_state_dict``, strict ``load`` into a fresh state, ``CheckpointManager.restore`` on the
root (which also holds the older, valid checkpoint), ``CheckpointManager.list`` and the CLI
(``safeckpt verify``, ``inspect``, ``ls``: exit 70 or a traceback is a NON_CHECKPOINT_ERROR).
The pool bounds each call (HANG). An audit hook records every file opened during a call whose
real path is outside the checkpoint (OUTSIDE_READ); peak RSS growth over 200 MB is MEMORY.
Every call also has its own limits (issue 27: a 6,000-box manifest took 67 s to verify, a
32 MiB index cost 771 MiB): a call that returns but took over CALL_SECS is SLOW, and one whose
own peak RSS (the kernel's high-water mark, reset before each call) grew by over CALL_MEMORY_MB
is MEMORY.

Outcomes (a mutant may have several bad ones):

- CAUGHT: every reader refused it with a CheckpointError (verify: ``ok=False``). A forged
  inconsistency confined to a file a 1-process read does not open (rank 1's index, per-rank
  copy or recorded size) may load the original values (bit-exact) while verify refuses it;
  that counts as BENIGN.
- BENIGN: something loaded, and what loaded equals the original (and the manifest's parsed
  JSON is unchanged, e.g. whitespace, key order).
- FORGED_LOADED: a forged (checksum recomputed) consistent edit loaded its new values.
- SILENT: a call succeeded although the manifest's parsed JSON was edited (plain edits; forged
  ones only when they break a format invariant), or loaded values differ from the original, or
  ``verify(deep=True)`` passed a mutant that changed bytes it checks (``Mutant.verify_bad``: a
  data file's index or chunk, an extra file).
- NON_CHECKPOINT_ERROR: an exception that is not a CheckpointError (or a RankFailure wrapping
  one on a single process, where nothing but the checkpoint can have failed).
- STATE_MODIFIED_ON_FAILURE: a failed load/restore changed the caller's state.
- VERIFY_OK_BUT_LOAD_FAILS: ``verify(deep=True).ok`` but read_state_dict or load raised (other
  than IncompatibleCheckpoint, which depends on the target state).
- RESTORE_NO_FALLBACK: restore started fresh (None), or raised something other than
  CorruptCheckpoint (forged consistent edits may raise what load raised).
- OUTSIDE_READ, HANG, SLOW, MEMORY, CRASH (the worker died).
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

from tests.helpers.fuzz_bases import STEP_A, STEP_B, first_difference, fresh_state, snapshot
from tests.helpers.fuzz_files import apply
from tests.helpers.fuzz_mutants import Mutant

BAD = ("SILENT", "NON_CHECKPOINT_ERROR", "STATE_MODIFIED_ON_FAILURE", "VERIFY_OK_BUT_LOAD_FAILS",
       "RESTORE_NO_FALLBACK", "OUTSIDE_READ", "HANG", "SLOW", "MEMORY", "CRASH")
GOOD = ("CAUGHT", "BENIGN", "FORGED_LOADED")
CALLS = ("verify_deep", "verify_shallow", "read", "load", "restore", "list", "cli")
CLI_INTERNAL = 70  # the CLI's exit code for an unexpected exception (a bug)
MEMORY_MB = 200
CALL_SECS = 20.0  # a legit call on the largest sample manifest: ~10 s on a busy VM; HANG comes later
CALL_MEMORY_MB = 150  # a call's own peak RSS growth

# ------------------------------------------------------------------ worker side
_WATCH: tuple[str, str] | None = None
_OUTSIDE: list[str] = []
_RUNTIME = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, "/proc/", "/sys/", "/usr/", "/etc/ld.so",
                  "/dev/shm/", "/dev/null"})


def _under(path: str, d: str) -> bool:
    return path == d or path.startswith(d.rstrip(os.sep) + os.sep)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or _WATCH is None:
        return
    try:
        path = args[0]
        if not isinstance(path, (str, bytes, os.PathLike)):
            return
        p = os.path.abspath(os.fsdecode(path))
        lex, real = _WATCH
        if not (_under(p, lex) or _under(p, real)):
            # Imports, and linecache probing pseudo-files ("<unknown>") while formatting tracebacks.
            pseudo = os.path.basename(p).startswith("<")
            if not (pseudo or p.startswith(_RUNTIME) or p.endswith((".py", ".pyc", ".so"))):
                _OUTSIDE.append(p)
            return
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        if flags & os.O_NOFOLLOW:  # a final symlink fails with ELOOP: only the parent is followed
            r = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
        else:
            r = os.path.realpath(p)
        if not _under(r, real):
            _OUTSIDE.append(f"{p} -> {r}")
    except BaseException:  # noqa: BLE001 - an audit hook must never raise into the caller
        pass


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mb(field: str) -> float | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in MB, or None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> float:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux: clear_refs 5), so that the
    next :func:`_call_peak_mb` sees this call's own peak, not an earlier call's; returns the
    RSS to measure growth from (ru_maxrss, which cannot be reset, without /proc)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return _maxrss_mb()
    rss = _status_mb("VmRSS")
    return rss if rss is not None else _maxrss_mb()


def _call_peak_mb(start: float) -> float:
    hwm = _status_mb("VmHWM")
    return (hwm if hwm is not None else _maxrss_mb()) - start


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    ours = [f for f in frames if "/safeckpt/" in f.filename]
    last = frames[-1]
    pick = ours[-1] if ours else last
    text = f"{_short(pick.filename)}:{pick.lineno} ({pick.name})"
    if pick is not last:
        text += f" -> {_short(last.filename)}:{last.lineno} ({last.name})"
    return text


def _short(filename: str) -> str:
    for mark in ("/src/safeckpt/", "/site-packages/", "/lib/python3"):
        if mark in filename:
            return filename[filename.index(mark) + 1:]
    return filename


def _describe(exc: BaseException) -> dict[str, Any]:
    import safeckpt

    inner = exc
    wrapped = (isinstance(exc, safeckpt.RankFailure) and exc.__cause__ is not None
               and not isinstance(exc.__cause__, safeckpt.CheckpointError))
    if wrapped:
        inner = exc.__cause__  # type: ignore[assignment]
    name = type(exc).__name__ + (f"({type(inner).__name__})" if wrapped else "")
    return {
        "type": type(exc).__name__,
        "name": name,
        "proper": isinstance(exc, safeckpt.CheckpointError) and not wrapped,
        "msg": " ".join(str(inner).split())[:240],
        "where": _where(inner),
    }


class Refs:
    """What each base loads as when undamaged (computed by the worker at start)."""

    def __init__(self, root: str, base: str = "single") -> None:
        import safeckpt

        self.base = base
        ckpt_b, ckpt_a = os.path.join(root, STEP_B), os.path.join(root, STEP_A)
        self.flat_b = safeckpt.read_state_dict(ckpt_b)
        self.state_b = self._loaded(ckpt_b, base)
        self.state_a = self._loaded(ckpt_a, base)
        if first_difference(self.state_a, self.state_b) is None:
            raise RuntimeError(f"{root}: the two checkpoints hold equal values; fallback is invisible")

    @staticmethod
    def _loaded(path: str, base: str) -> dict[str, Any]:
        import safeckpt

        state = fresh_state(base)
        safeckpt.load(path, state)
        return snapshot(state)


def _call(name: str, ckpt: str, root: str, refs: Refs, progress: Any) -> dict[str, Any]:
    """One reader on the damaged checkpoint; the result with what it loaded compared."""
    global _WATCH
    import safeckpt

    out: dict[str, Any] = {"ok": False}
    state = fresh_state(refs.base) if name in ("load", "restore") else None
    before = snapshot(state) if state is not None else None
    watched = ckpt if name not in ("restore", "list", "cli") else root
    _WATCH = (os.path.abspath(watched), os.path.realpath(watched))
    rss0 = _maxrss_mb()
    peak0 = _reset_peak()
    t0 = time.monotonic()
    try:
        if name.startswith("verify"):
            report = safeckpt.verify(ckpt, deep=name == "verify_deep")
            out.update(ok=True, verified=bool(report.ok), problems=[str(p)[:200] for p in report.problems[:3]])
        elif name == "read":
            flat = safeckpt.read_state_dict(ckpt)
            out.update(ok=True, diff=first_difference(refs.flat_b, flat))
        elif name == "load":
            safeckpt.load(ckpt, state)  # type: ignore[arg-type]
            out.update(ok=True, diff=first_difference(refs.state_b, snapshot(state)))  # type: ignore[arg-type]
        elif name == "restore":
            mgr = safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=())
            try:
                step = mgr.restore(state)  # type: ignore[arg-type]
            finally:
                mgr.close()
            ref = {1: refs.state_a, 2: refs.state_b}.get(step)  # type: ignore[arg-type]
            diff = first_difference(ref, snapshot(state)) if ref is not None else None  # type: ignore[arg-type]
            out.update(ok=True, step=step, diff=diff)
        elif name == "list":
            steps = [i.step for i in safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=()).list()]
            out.update(ok=True, steps=steps)
        elif name == "cli":
            out.update(ok=True, cli=_cli(ckpt, root, progress))
    except Exception as exc:  # noqa: BLE001 - classified below
        out["exc"] = _describe(exc)
        if before is not None:
            out["modified"] = first_difference(before, snapshot(state))  # type: ignore[arg-type]
    finally:
        if name in ("restore", "list"):
            # A manager's lease finalizer reads ROOT/.safeckpt.lock when it is collected: let it
            # run now, inside this call's root, not during a later mutant's call.
            gc.collect()
        _WATCH = None
        out["secs"] = round(time.monotonic() - t0, 3)
        out["rss_mb"] = round(_maxrss_mb() - rss0)  # growth of the process's peak during this call
        out["peak_mb"] = round(_call_peak_mb(peak0))  # this call's own peak over its start
    return out


def _cli(ckpt: str, root: str, progress: Any) -> dict[str, Any]:
    """Exit code and output of ``safeckpt verify|inspect CKPT`` and ``ls ROOT``, in process."""
    import contextlib
    import io

    from safeckpt import cli

    global _WATCH
    out = {}
    for argv in (["verify", ckpt], ["inspect", ckpt], ["ls", root]):
        progress(f"cli {argv[0]}")
        _WATCH = (os.path.abspath(argv[1]), os.path.realpath(argv[1]))  # what the user named
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = cli.main(argv)
        text = buf.getvalue()
        out[argv[0]] = {"code": code, "traceback": "Traceback (most recent call last)" in text,
                        "last": (text.strip().splitlines() or [""])[-1][:200]}
    return out


def run_mutant(m: Mutant, root: str, refs: Refs, scratch: str, progress: Any,
               calls_to_run: tuple[str, ...] = CALLS) -> dict[str, Any]:
    ws = tempfile.mkdtemp(prefix=f"m{m.id}-", dir=scratch)
    try:
        shutil.copytree(root, os.path.join(ws, "root"), symlinks=True)
        os.makedirs(os.path.join(ws, "outside"))
        ckpt_root = os.path.join(ws, "root")
        ckpt = os.path.join(ckpt_root, STEP_B)
        progress("apply")
        apply(m.ops, ws, ckpt)
        rss0 = _maxrss_mb()
        calls: dict[str, dict[str, Any]] = {}
        outside: dict[str, list[str]] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in calls_to_run:
                progress(name)
                del _OUTSIDE[:]
                calls[name] = _call(name, ckpt, ckpt_root, refs, progress)
                if _OUTSIDE:
                    outside[name] = sorted(set(_OUTSIDE))[:3]
        rss = _maxrss_mb() - rss0
    finally:
        progress("cleanup")
        cleanup(ws)
    return classify(m, calls, outside, rss)


def cleanup(ws: str) -> None:
    for d, dirs, files in os.walk(ws):
        for n in dirs + files:
            try:
                os.chmod(os.path.join(d, n), 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
    shutil.rmtree(ws, ignore_errors=True)


def classify(m: Mutant, calls: dict[str, dict[str, Any]], outside: dict[str, list[str]], rss: float
             ) -> dict[str, Any]:
    """Outcome labels of one mutant (see the module docstring)."""
    bad: dict[str, str] = {}

    def add(label: str, detail: str) -> None:
        bad.setdefault(label, detail)

    edited = (m.changed and not m.forged) or (m.forged and m.invalid is True)
    new_values_ok = m.forged and m.invalid is not True
    # Readers open only the files (format 3: the indexes) they need, so a forged inconsistency
    # confined to a file a 1-process read does not use (rank 1's index or per-rank copy, its
    # size) may load the original values bit-exact (diff checked below), as long as verify
    # (which checks every file and index) refuses it. verify(deep=False) reads no tensor bytes,
    # so for damaged chunk bytes (forged.data: rank 1's per-rank copy) only the deep one must.
    partial = (m.forged and not calls["verify_deep"].get("verified")
               and (m.cls == "forged.data" or not calls["verify_shallow"].get("verified")))
    for name, c in calls.items():
        exc = c.get("exc")
        if exc and not exc["proper"]:
            add("NON_CHECKPOINT_ERROR", f"{name}: {exc['name']}: {exc['msg'][:160]} at {exc['where']}")
        if c.get("modified"):
            add("STATE_MODIFIED_ON_FAILURE", f"{name} raised {exc['name'] if exc else '?'} "
                f"({exc['msg'][:100] if exc else ''}) after changing {c['modified']}")
    for cmd, res in calls.get("cli", {}).get("cli", {}).items():
        if res["code"] == CLI_INTERNAL or res["traceback"]:
            add("NON_CHECKPOINT_ERROR", f"cli: safeckpt {cmd}: exit {res['code']}: {res['last']} at cli")
    for name in ("verify_deep", "verify_shallow"):
        # verify(deep=False) reads no tensor bytes: damage that only reading them shows (a
        # chunk's bytes against its own checksum, under a consistently re-signed file checksum)
        # is verify(deep=True)'s to find (checked just below), and every load's
        if name == "verify_shallow" and m.cls == "forged.data":
            continue
        if calls[name].get("verified") and edited:
            add("SILENT", f"{name}: ok=True for an edited manifest")
    if m.verify_bad and calls["verify_deep"].get("verified"):
        add("SILENT", "verify_deep: ok=True although a file it checks was changed")
    for name in ("read", "load"):
        c = calls[name]
        if c["ok"] and c["diff"] and not new_values_ok:
            add("SILENT", f"{name} loaded different values without error: {c['diff']}")
        elif c["ok"] and edited and not partial:
            add("SILENT", f"{name} succeeded on an edited manifest")
    if calls["verify_deep"].get("verified"):
        for name in ("read", "load"):
            exc = calls[name].get("exc")
            # IncompatibleCheckpoint is about the target state, which verify never sees.
            if exc and exc["name"] != "IncompatibleCheckpoint":
                add("VERIFY_OK_BUT_LOAD_FAILS", f"verify(deep=True) ok, {name} raised {exc['name']}: "
                    f"{exc['msg'][:120]} at {exc['where']}")
    r = calls["restore"]
    if r.get("exc"):
        exc = r["exc"]
        same_as_load = (calls["load"].get("exc") or {}).get("type") == exc["type"]
        if not exc["proper"] or (exc["type"] != "CorruptCheckpoint" and not (new_values_ok and same_as_load)):
            add("RESTORE_NO_FALLBACK", f"restore raised {exc['name']}: {exc['msg'][:120]} at {exc['where']}")
    elif r["step"] is None:
        add("RESTORE_NO_FALLBACK", "restore returned None (a fresh start) with a valid older checkpoint")
    elif r["step"] not in (1, 2):
        add("SILENT", f"restore returned step {r['step']!r}")
    elif r["step"] == 1 and r["diff"]:
        add("SILENT", f"restore fell back to step 1 but loaded different values: {r['diff']}")
    elif r["step"] == 2 and r["diff"] and not new_values_ok:
        add("SILENT", f"restore loaded step 2 with different values: {r['diff']}")
    elif r["step"] == 2 and edited and not partial:
        add("SILENT", "restore loaded the edited step 2")
    if outside:
        add("OUTSIDE_READ", "; ".join(f"{k}: {', '.join(v)}" for k, v in outside.items()))
    slow = {n: c["secs"] for n, c in calls.items() if c.get("secs", 0) > CALL_SECS}
    if slow:
        add("SLOW", ", ".join(f"{n} took {secs:.1f}s (limit {CALL_SECS:.0f}s)" for n, secs in slow.items()))
    heavy = {n: c["peak_mb"] for n, c in calls.items() if c.get("peak_mb", 0) > CALL_MEMORY_MB}
    if heavy and rss <= MEMORY_MB:
        add("MEMORY", ", ".join(f"{n}: peak RSS +{mb} MB (limit {CALL_MEMORY_MB} MB)" for n, mb in heavy.items()))
    if rss > MEMORY_MB:
        where = ", ".join(f"{n} +{c['rss_mb']} MB in {c['secs']:.1f}s" for n, c in calls.items() if c.get("rss_mb", 0) > 20)
        add("MEMORY", f"peak RSS grew by {rss:.0f} MB ({where})")
    loaded = calls["read"]["ok"] or calls["load"]["ok"]
    if bad:
        outcome = "BAD"
    elif not loaded:
        outcome = "CAUGHT"
    elif any(calls[n]["ok"] and calls[n]["diff"] for n in ("read", "load")):
        outcome = "FORGED_LOADED"
    else:
        outcome = "BENIGN"
    return {"mutant": mutant_dict(m), "bad": bad, "outcome": outcome,
            "calls": {n: _call_text(c) for n, c in calls.items()}, "rss_mb": round(rss, 1)}


def mutant_dict(m: Mutant) -> dict[str, Any]:
    """The mutant as JSON-able data, file contents abbreviated."""
    return {"id": m.id, "base": m.base, "cls": m.cls, "desc": m.desc, "changed": m.changed,
            "forged": m.forged, "invalid": m.invalid, "verify_bad": m.verify_bad, "ops": _ops_text(m)}


def _ops_text(m: Mutant) -> list[str]:
    out = []
    for op in m.ops:
        args = [a if not isinstance(a, bytes) else (f"<{len(a)} bytes>" if len(a) > 80 else a) for a in op[1:]]
        out.append(f"{op[0]} {args!r}"[:200])
    return out


def _call_text(c: dict[str, Any]) -> str:
    if c.get("exc"):
        e = c["exc"]
        return f"raised {e['name']}: {e['msg'][:160]} at {e['where']}"
    if "verified" in c:
        return f"ok={c['verified']}" + (f" {c['problems'][:1]}" if c["problems"] else "")
    if "step" in c:
        return f"step={c['step']}" + (f" diff {c['diff']}" if c.get("diff") else "")
    if "steps" in c:
        return f"steps={c['steps']}"
    if "cli" in c:
        return "; ".join(f"{k}: exit {v['code']} {v['last'][:70]!r}" for k, v in c["cli"].items())
    return "loaded" + (f", diff {c['diff']}" if c.get("diff") else " (equal)")


def worker_main(conn: Any, bases: dict[str, str], scratch: str, calls: tuple[str, ...] = CALLS) -> None:
    """Worker loop: refs first, then one mutant per message until None."""
    try:
        sys.addaudithook(_audit)
        import torch

        torch.set_num_threads(1)
        refs = {name: Refs(root, name) for name, root in bases.items()}
        conn.send(("ready", os.getpid()))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        conn.send(("error", "".join(traceback.format_exception(exc))))
        return
    while True:
        m = conn.recv()
        if m is None:
            return
        try:
            result = run_mutant(m, bases[m.base], refs[m.base], scratch, lambda s: conn.send(("call", s)), calls)
        except Exception as exc:  # noqa: BLE001 - the harness itself failed on this mutant
            result = {"mutant": mutant_dict(m), "outcome": "BAD", "calls": {},
                      "bad": {"CRASH": "fuzzer error: " + "".join(traceback.format_exception(exc))[-600:]},
                      "rss_mb": 0.0}
        conn.send(("done", result))
