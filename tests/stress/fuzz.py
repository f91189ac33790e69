"""Mutation fuzzing of real checkpoints: the full run and its tables.

Reproduce the README's table (>= 5,000 mutants; ~15-40 min on 2 busy cores)::

    .venv/bin/python -m tests.stress.fuzz --mutants 5000 --seed 1 --out fuzz-table.md

It writes two checkpoints per base (an older valid one and a newer one it damages; bases
``single``, saved by one process, ``ddp``, saved by 2 gloo ranks with a DDP model, ``fsdp``, by
2 gloo ranks with DTensors and extra files, each also rewritten in format 2 as ``NAME.f2``), then
runs each mutant (see :mod:`tests.helpers.fuzz_mutants`) against verify, read_state_dict, load,
restore and list (see :mod:`tests.helpers.fuzz_oracle` for the outcomes). The markdown table counts
outcomes per mutant class; ``--findings FILE`` also writes, per bad outcome, its count and a
few concrete reproductions (mutation, call, exception, location). ``--only 17,42`` reruns
single mutants of the same seed; ``--json FILE`` keeps every result. Exit status 1 if any
mutant had a bad outcome.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from tests.helpers.fuzz_bases import BASES_VERSION, F2, STEP_A, STEP_B, WRITERS
from tests.helpers.fuzz_mutants import BaseView, generate
from tests.helpers.fuzz_oracle import BAD, CALLS, GOOD
from tests.helpers.fuzz_pool import CANARY, Pool
from tests.helpers.manifest_checks import as_format2


def make_bases(workdir: str, *, ddp: bool = True, names: Iterable[str] | None = None) -> dict[str, str]:
    """Base roots under ``workdir`` (reused when already there): name -> root. Each format-3
    base also gives ``NAME.f2``, the same checkpoints rewritten in format 2."""
    wanted = list(names) if names is not None else (["single", "ddp", "fsdp"] if ddp else ["single"])
    bases = {}
    for name in wanted:
        root = os.path.join(workdir, f"{name}-v{BASES_VERSION}")
        if not _still_valid(root):
            shutil.rmtree(root, ignore_errors=True)  # absent, or written by an older format
            os.makedirs(root)
            WRITERS[name](root)
        bases[name] = root
        root2 = root + F2
        if not _still_valid(root2):
            shutil.rmtree(root2, ignore_errors=True)
            shutil.copytree(root, root2)
            for step in (STEP_A, STEP_B):
                as_format2(os.path.join(root2, step))
        bases[name + F2] = root2
    return bases


def _still_valid(root: str) -> bool:
    import safeckpt

    steps = [os.path.join(root, s) for s in (STEP_A, STEP_B)]
    return all(os.path.isdir(s) and safeckpt.verify(s, deep=False).ok for s in steps)


def run_fuzz(bases: dict[str, str], *, seed: int, count: int, huge: int = 300 << 20,
             only: Iterable[int] | None = None, classes: list[str] | None = None,
             call_timeout: float = 30.0, progress: Any = None, on_batch: Any = None,
             batch: int = 250, calls: tuple[str, ...] = CALLS) -> list[dict[str, Any]]:
    """Generate and run mutants; one result dict per mutant (see fuzz_oracle.classify)."""
    views = {name: BaseView.load(name, root) for name, root in bases.items()}
    if progress and not all(v.forge_ok for v in views.values()):
        progress("WARNING: safeckpt refuses a re-signed unedited manifest: forged.* classes skipped")
    wanted = set(only) if only else None
    last = (max(wanted) + 1) if wanted else count
    results = []
    t0 = time.monotonic()
    with Pool(bases, call_timeout=call_timeout, calls=calls) as pool:
        for m in generate(views, seed, last, huge=huge, classes=classes):
            if wanted is not None and m.id not in wanted:
                continue
            results.append(pool.run(m))
            if on_batch and len(results) % batch == 0:
                on_batch(results)
            if progress and len(results) % 100 == 0:
                bad = sum(1 for r in results if r["bad"])
                progress(f"{len(results)} mutants, {bad} bad, {time.monotonic() - t0:.0f}s, "
                         f"{pool.restarts} worker restarts")
        canary = pool.run(CANARY, timeout=3)
        if "blocked" not in canary["bad"].get("HANG", ""):
            raise RuntimeError(f"the fuzzer's hang detection is broken: {canary}")
    return results


def counts(results: list[dict[str, Any]]) -> dict[str, collections.Counter[str]]:
    by_cls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in results:
        c = by_cls[r["mutant"]["cls"]]
        c["mutants"] += 1
        if r["outcome"] != "BAD":
            c[r["outcome"]] += 1
        for label in r["bad"]:
            c[label] += 1
    return by_cls


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per mutant class, outcome counts (bad ones may overlap per mutant)."""
    by_cls = counts(results)
    cols = ["mutants", *GOOD, *BAD]
    lines = ["| class | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    total: collections.Counter[str] = collections.Counter()
    for cls in sorted(by_cls):
        total.update(by_cls[cls])
        lines.append(f"| {cls} | " + " | ".join(str(by_cls[cls][c]) for c in cols) + " |")
    lines.append("| **total** | " + " | ".join(f"**{total[c]}**" for c in cols) + " |")
    return "\n".join(lines)


def signature(label: str, r: dict[str, Any]) -> str:
    """What makes two bad outcomes the same finding: the call, error type and location (or,
    for hangs and memory, the call and the kind of mutant)."""
    detail = r["bad"][label]
    if " at " in detail:
        head = detail.split(":", 1)[0]
        kind = detail.split(":", 2)[1].strip().split(" ")[0][:40] if detail.count(":") >= 2 else ""
        return f"{head} | {kind} | {detail.rsplit(' at ', 1)[1]}"
    what = re.sub(r"\d+", "N", r["mutant"]["desc"])[:70]
    if label == "HANG":
        return f"{detail.split(' did not')[0]} | {detail.split('(')[-1].split(':')[0]} | {what}"
    if label in ("MEMORY", "SLOW"):
        return f"{r['mutant']['cls']} | {what}"
    return re.sub(r"/tmp/\S+", "...", re.sub(r"\d+", "N", detail))[:100]


def findings(results: list[dict[str, Any]], *, header: str = "", per_label: int = 5) -> str:
    """Per bad outcome: count, the distinct signatures, and minimal reproductions."""
    out = [header] if header else []
    bad = [r for r in results if r["bad"]]
    out.append(f"{len(results)} mutants, {len(bad)} with a bad outcome.\n")
    for label in BAD:
        hits = [r for r in bad if label in r["bad"]]
        out.append(f"## {label}: {len(hits)}\n")
        if not hits:
            continue
        sigs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for r in hits:
            sigs[signature(label, r)].append(r)
        out.append("| count | signature (call / error / location) | classes |")
        out.append("|---|---|---|")
        for sig, rs in sorted(sigs.items(), key=lambda kv: -len(kv[1]))[:25]:
            classes = ", ".join(sorted({r["mutant"]["cls"] for r in rs}))
            out.append(f"| {len(rs)} | {sig.replace('|', '/')} | {classes} |")
        out.append("")
        examples = [min(rs, key=lambda r: len(r["mutant"]["desc"]))
                    for _, rs in sorted(sigs.items(), key=lambda kv: -len(kv[1]))][:per_label]
        for r in examples:
            out.append(example(r, label))
    return "\n".join(out)


def example(r: dict[str, Any], label: str) -> str:
    m = r["mutant"]
    lines = [f"- **#{m['id']}** `{m['cls']}` on `{m['base']}`: {m['desc']}"
             + (" (forged checksum" + (", breaks an invariant)" if m["invalid"] else ")") if m["forged"] else ""),
             f"  - {label}: {r['bad'][label]}"]
    for call, text in r.get("calls", {}).items():
        lines.append(f"  - `{call}`: {text[:220]}")
    return "\n".join(lines)


def _write(path: str, text: str) -> None:
    """Replace ``path`` atomically (the lead reads the findings file while runs go on)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.stress.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--mutants", type=int, default=5000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="markdown table of outcomes by mutant class")
    p.add_argument("--findings", help="markdown list of bad outcomes with reproductions")
    p.add_argument("--json", help="every result as JSON")
    p.add_argument("--preamble", help="markdown file put at the top of the findings (notes)")
    p.add_argument("--only", help="comma-separated mutant ids to rerun (same seed)")
    p.add_argument("--classes", help="comma-separated class prefixes (e.g. manifest.,data.fifo)")
    p.add_argument("--no-ddp", action="store_true", help="skip the 2-rank base (no processes spawned)")
    p.add_argument("--bases", help="directory to keep/reuse the base checkpoints in")
    p.add_argument("--huge-mb", type=int, default=300, help="size of the huge-manifest mutants")
    p.add_argument("--call-timeout", type=float, default=30.0, help="seconds before a call is a HANG")
    args = p.parse_args(argv)

    workdir = args.bases or tempfile.mkdtemp(prefix="safeckpt-fuzz-bases-")
    t0 = time.monotonic()
    bases = make_bases(workdir, ddp=not args.no_ddp)
    only = [int(x) for x in args.only.split(",")] if args.only else None
    classes = args.classes.split(",") if args.classes else None
    cmd = "python -m tests.stress.fuzz " + " ".join(argv if argv is not None else sys.argv[1:])
    notes = ""
    if args.preamble:
        with open(args.preamble) as f:
            notes = f.read().rstrip() + "\n\n"

    def header(results: list[dict[str, Any]], note: str = "") -> str:
        return (f"Fuzz: {len(results)} mutants{note}, seed {args.seed}, bases {', '.join(bases)}, "
                f"{time.monotonic() - t0:.0f}s. Command: `{cmd}`. Rerun one: add `--only ID`.\n")

    def partial(results: list[dict[str, Any]]) -> None:
        if args.findings:
            _write(args.findings, findings(results, header="# Fuzz findings\n\n" + notes + header(
                results, f" (run in progress, of {args.mutants})")))

    results = run_fuzz(bases, seed=args.seed, count=args.mutants, huge=args.huge_mb << 20, only=only,
                       classes=classes, call_timeout=args.call_timeout, on_batch=partial,
                       progress=lambda s: print(s, file=sys.stderr, flush=True))
    head = header(results)
    text = head + "\n" + table(results) + "\n"
    print(text)
    if args.out:
        _write(args.out, text)
    if args.findings:
        _write(args.findings, findings(results, header=f"# Fuzz findings\n\n{notes}{head}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 1 if any(r["bad"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
