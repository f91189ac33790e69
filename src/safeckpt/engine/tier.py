"""The collective phases of the node-local tier (see :mod:`safeckpt.engine.local_tier` for the
layout): a local save after the snapshot, its drain to ``root``, and a restore from the
nearest verified copy of each file. Every phase is one ``Coordinator.decide``: a failure on
any rank raises the same error on every rank, and every choice (the step, who sends which
file to whom) is the coordinator's, broadcast.

Save of step N (background thread, after ``SaveJob.agree`` + ``snapshot`` on the caller's; a
preemption signal on any rank is agreed in the first exchange, making the step durable):

1. local-write  each rank writes its file (the bytes ``safeckpt.save`` would write for it,
                from the staged buffers) into its node's partial directory; with
                ``check_finite`` it first refuses NaN/Inf (naming the tensors). The
                coordinator builds the manifest and the replica placement.
2. replicate    each rank reads its file back, checks it against its reported checksum and
                sends it to its replica ranks (``coord.dist.send_recv``); receivers verify
                before keeping it. A replica that fails is dropped with a warning on every
                rank (the step stays complete locally, with fewer copies).
3. publish      the first rank of each node writes the manifest and renames the partial
                directory into place, then applies the local retention.
4. drain        (every ``durable_every``-th step, on preemption, at close) the same staged
                bytes are committed under ``root`` by the ordinary save path.

Restore: inventory (every node's steps, files, manifest hashes; root's steps; quarantine) ->
for each candidate step, newest first: verify (each node's ranks hash their node's copies) ->
fetch rounds (each missing or bad file from the next holder, over the group, else from root,
verified on arrival) -> ``engine.load.load`` through the tier URL. A step some file of which
has no valid copy is skipped by every rank together. Of a step root holds, only the nodes'
copies of root's save are used; of one it lacks, the newest save (``holders_of``). The first
save after a restore removes the nodes' steps newer than the restored one (``abandon_after``).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from ..coord.dist import Coordinator, send_recv
from ..errors import CheckpointError, CorruptCheckpoint, StorageError
from ..format.manifest import MANIFEST
from ..storage import commit as _commit
from ..storage.base import Storage
from ..storage.posix import rmtree_quiet, write_bytes_atomic
from . import held_files, prehashed
from .load import files_needed, load
from .local_tier import (
    NodeDir,
    as_tensor,
    dir_bytes,
    file_xxh3,
    hidden_by,
    non_finite,
    read_file,
    replica_targets,
    step_files,
    tier_url,
    warn,
)
from .request import CommitHooks

ROOT = -1  # a fetch source: read the file from root


# ---------------------------------------------------------------------- save


def save_local(coord: Coordinator, job: Any, nd: NodeDir, step: int, *, replicas: int, check_finite: Any,
               keep_local: int | None, max_bytes: int | None, protect: set[int],
               signalled: bool = False, abandon_after: int | None = None) -> dict[str, Any]:
    """Phases 1-3 of the module docstring for the snapshotted ``job`` (its agreement first, if
    it was speculative): each rank's
    files (its data file and the named files it writes) on its node and their replicas; the
    coordinator's extra files on every node (sent with the manifest, checked against it).
    ``abandon_after``: the first save after a restore of that (older) step: the node's local
    steps newer than it belong to the abandoned history and are removed first (not the ones
    quarantined: their bytes are kept for inspection)."""
    job.confirm(coord)  # a speculative agreement's exchange, before anything is written
    token = job.staging_token
    part = nd.partial(step, token)

    def write() -> dict[str, Any]:
        job.drop_staging()  # the job's own (empty) staging place: the tier writes into ``part``
        if check_finite:
            bad = non_finite(job.write_items(), check_finite)
            if bad:
                raise CheckpointError(
                    f"check_finite: step {step} holds NaN/Inf in {', '.join(bad[:10])}"
                    + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
                    + "; the step was not committed on any tier (the previous steps are intact)")
        if abandon_after is not None:
            marked = nd.quarantined()
            for s in nd.steps():
                if s > abandon_after and str(s) not in marked:
                    rmtree_quiet(nd.step_dir(s))
        for attempt in (0, 1):
            try:
                nd.ensure()
                nd.sweep_partials(keep_token=token)
                os.makedirs(part, exist_ok=True)
                report = write_local(job, {"token": token, "path": part})
                break
            except (OSError, StorageError) as exc:  # ENOSPC, a RAM disk full: the tier degrades
                # room from the node's older steps (never its newest, nor a protected one), once
                older = [s for s in nd.steps()[:-1] if s not in protect]
                if attempt or not no_space(exc) or not older:
                    return {"node": nd.node, "signalled": signalled, "failed": f"{type(exc).__name__}: {exc}"}
                for s in older:
                    rmtree_quiet(nd.step_dir(s))
                for name in os.listdir(part) if os.path.isdir(part) else ():  # this rank's leftovers
                    if any(name == f or name.startswith(f"{f}.") for f in job.file_names()):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(part, name))
        report["node"] = nd.node
        report["signalled"] = signalled  # a preemption signal here: this step is drained to root
        if max_bytes is not None:  # what the node holds now, for the budget
            report["held"] = nd.step_sizes()
            report["base"] = nd.nbytes() - sum(b for _, b in report["held"]) - dir_bytes(part)
        return report

    def manifest(written: list[dict[str, Any]]) -> dict[str, Any]:
        failed = [f"rank {r} on {w['node']}: {w['failed']}" for r, w in enumerate(written) if "failed" in w]
        if failed:
            return {"skip": failed, "preempted": any(w.get("signalled") for w in written)}
        raw = job.manifest_bytes(job.files_of(written), written)
        nodes = [w["node"] for w in written]
        files = [job.report_files(w) for w in written]
        targets = replica_targets(nodes, replicas)
        drops: dict[str, list[int]] = {}
        notes: list[str] = []
        if max_bytes is not None:
            held, base = {}, {}
            for w in written:
                held.setdefault(w["node"], w["held"])
                base.setdefault(w["node"], w["base"])
            drops, notes = fit_budget(nodes, files, targets, held, base, max_bytes, protect)
        return {"manifest": raw.decode(), "files": files, "nodes": nodes, "targets": targets, "drops": drops,
                "notes": notes, "preempted": any(w.get("signalled") for w in written),
                "extra": {n: base64.b64encode(data).decode() for n, data in sorted(job.extra_files.items())}}

    hint = f"Step {step} was not committed on the local tier; the previous local steps are intact."
    d = coord.decide("local-write", write, manifest, hint=hint)
    if "skip" in d:
        rmtree_quiet(part)
        return {"step": step, "skipped": True, "preempted": d["preempted"], "warnings": [
            f"step {step} is not on the local tier: a node-local write failed ({'; '.join(d['skip'][:5])}); "
            "training goes on, the previous local steps are intact"]}
    files: list[list[list[Any]]] = d["files"]  # rank -> [[name, size, xxh3-128], ...]
    nodes = d["nodes"]
    targets = {int(k): v for k, v in d["targets"].items()}
    first_tag = [sum(len(f) for f in files[:r]) for r in range(len(files))]  # one tag per file
    me = coord.rank

    first = nodes.index(nd.node) == me  # the node's first rank

    def replicate() -> dict[str, Any]:
        sends, recvs, bad = [], [], []
        if first:  # room for the replicas this node receives (the budget): the oldest steps go
            for s in d["drops"].get(nd.node, []):
                rmtree_quiet(nd.step_dir(s))
        if targets.get(me):
            for j, (name, size, xxh) in enumerate(files[me]):
                path = os.path.join(part, name)
                data = read_file(path, size)
                if os.path.getsize(path) != size or file_xxh3(data.numpy()) != xxh:
                    # what is on disk is not what was written: the receivers will drop it
                    bad.append(f"rank {me}'s own copy of {name} on {nd.node} no longer matches its checksum")
                tensor = as_tensor(data)
                sends += [(dst, first_tag[me] + j, tensor) for dst in targets[me]]
        for src, dsts in targets.items():
            if me in dsts:
                recvs += [(src, first_tag[src] + j, torch.empty(f[1], dtype=torch.uint8))
                          for j, f in enumerate(files[src])]
        send_recv(coord, sends, recvs)
        got = []
        for src, tag, buf in recvs:
            name, size, xxh = files[src][tag - first_tag[src]]
            view = buf.numpy()
            if file_xxh3(view) != xxh:
                bad.append(f"the replica of {name} (rank {src}) received by rank {me} on {nd.node} does not "
                           "match its checksum: not kept")
                continue
            try:
                write_bytes_atomic(os.path.join(part, name), view)
            except OSError as exc:  # ENOSPC: one replica fewer, training goes on
                for left in [name, *(n for n in os.listdir(part) if n.startswith(f"{name}.tmp-"))]:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(part, left))  # what the failed write left
                bad.append(f"the replica of {name} (rank {src}) could not be kept on {nd.node} "
                           f"({type(exc).__name__}: {exc})")
                continue
            got.append(name)
        return {"got": got, "bad": bad}

    def held(reports: list[dict[str, Any]]) -> dict[str, Any]:
        by_node: dict[str, list[str]] = {}
        for r, rep in enumerate(reports):
            by_node.setdefault(nodes[r], []).extend(rep["got"])
        return {"held": by_node, "warnings": [b for rep in reports for b in rep["bad"]]}

    d2 = coord.decide("replicate", replicate, held, hint=hint)
    raw = d["manifest"].encode()
    extras = extra_files_of(raw, d["extra"])

    def publish() -> list[str]:
        if not first:
            return []
        own = [f[0] for r, n in enumerate(nodes) if n == nd.node for f in files[r]]
        try:
            nd.publish(step, token, raw, own, sorted(d2["held"].get(nd.node, [])), extras)
        except OSError as exc:  # ENOSPC on the manifest: this node lacks the step, as if it were lost
            rmtree_quiet(part)
            return [f"not published on {nd.node} ({type(exc).__name__}: {exc}); the other nodes' copies "
                    "and replicas hold it"]
        nd.retain(keep_local, max_bytes, protect | {step})
        return []

    d3 = coord.decide("local-publish", publish, lambda notes: [n for ns in notes for n in ns], hint=hint)
    notes = [*d["notes"], *d2["warnings"], *d3]
    return {"step": step, "manifest": raw, "preempted": d["preempted"],
            "warnings": [f"step {step}: {note}" for note in notes]}


def no_space(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT anywhere in the exception's chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def fit_budget(nodes: list[str], files: list[list[Any]], targets: dict[int, list[int]],
               held: dict[str, list[list[int]]], base: dict[str, int], max_bytes: int, protect: set[int]
               ) -> tuple[dict[str, list[int]], list[str]]:
    """Coordinator, for ``local_max_bytes``: each node must hold its ranks' files of the step in
    flight, the replicas it receives, the steps it keeps and the run's own records (``base``)
    within the budget. The oldest
    steps go first (never a protected one, nor the node's newest until this step is
    published); what still does not fit is the replicas: the node receives none (``targets``
    edited in place), with a note. Returns (node -> steps to drop, notes)."""
    size = {r: sum(f[1] for f in fs) for r, fs in enumerate(files)}
    drops: dict[str, list[int]] = {}
    notes: list[str] = []
    for node in dict.fromkeys(nodes):
        own = sum(size[r] for r, n in enumerate(nodes) if n == node)
        senders = [src for src, dsts in targets.items() if any(nodes[d] == node for d in dsts)]
        incoming = sum(size[src] for src in senders)
        steps = sorted(held.get(node, []))  # [[step, bytes], ...], oldest first
        total = own + incoming + sum(b for _, b in steps) + base.get(node, 0)
        gone = []
        for s, b in steps[:-1]:
            if total <= max_bytes:
                break
            if s not in protect:
                gone.append(s)
                total -= b
        if gone:
            drops[node] = gone
        if total > max_bytes and incoming:
            for src in senders:
                targets[src] = [d for d in targets[src] if nodes[d] != node]
            names = sorted(f[0] for src in senders for f in files[src])
            notes.append(f"local_max_bytes ({max_bytes} bytes) leaves no room on {node} for the replicas of "
                         f"{', '.join(names[:5])}{' and more' if len(names) > 5 else ''} ({incoming} bytes; "
                         f"{total - incoming} held): not replicated there")
    return drops, notes


def extra_files_of(manifest: bytes, sent: dict[str, str]) -> dict[str, bytes]:
    """The coordinator's extra files as broadcast with the manifest, each checked against the
    manifest's record (size, xxh3-128) before any node keeps it."""
    listed = json.loads(manifest).get("extra") or {}
    out = {}
    for name, text in sent.items():
        data = base64.b64decode(text)
        rec = listed.get(name)
        if rec is None or rec["size"] != len(data) or file_xxh3(data) != rec["xxh3_128"]:
            raise CorruptCheckpoint(f"extra file {name} arrived damaged (it does not match the manifest)")
        out[name] = data
    if set(out) != set(listed):
        raise CorruptCheckpoint(f"extra files {sorted(set(listed) - set(out))} were not sent with the manifest")
    return out


def refuse_non_finite(coord: Coordinator, job: Any, step: int | None, entries: Any = True) -> None:
    """``check_finite`` for a save without the local tier: after the agreement (and the
    snapshot), one exchange of the names of this rank's floating write items that hold NaN/Inf;
    any -> the same CheckpointError on every rank naming them, and the coordinator removes the
    staging place (nothing was written)."""
    bad = non_finite(job.write_items(), entries)

    def resolve(reports: list[list[str]]) -> None:
        named = sorted({n for rep in reports for n in rep})
        if named:
            raise CheckpointError(
                f"check_finite: step {step} holds NaN/Inf in {', '.join(named[:10])}"
                + (f" and {len(named) - 10} more" if len(named) > 10 else "")
                + "; the step was not committed (the previous checkpoints are intact)")

    try:
        coord.decide("check-finite", lambda: bad, resolve, hint="Nothing was written.")
    except BaseException:
        job.drop_staging()
        raise


def write_local(job: Any, staging: dict[str, str]) -> dict[str, Any]:
    """This rank's files of ``job`` (the bytes a save would write for it) into ``staging``
    (a module-level hook, so that a test can make the write fail)."""
    return job.write_to(staging)


def drain(coord: Coordinator, job: Any, store: Storage, target: str, before: Callable[[], None],
          after_commit: Callable[[int | None], Any], step: int) -> Any:
    """Commit the staged bytes of ``job`` under ``target`` (root) with the ordinary save path."""
    def begin(_: Any) -> dict[str, str]:
        before()
        return _commit.begin(store, target, True)

    staging = coord.decide("durable-begin", lambda: None, begin, hint="Nothing was written under root.")
    job.retarget(target, store, staging, CommitHooks(
        after_commit=after_commit, after_commit_hint=f"The checkpoint {target} is committed; only retention failed."))
    return job.finish(coord)


# ---------------------------------------------------------------------- restore


def inventory(coord: Coordinator, nd: NodeDir, root_side: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One exchange: every node's steps and the root's (``root_side(steps the nodes hold)`` on
    the coordinator: ``{"steps": [...], "sigs": {step: save_signature of root's manifest, for
    the steps the nodes hold too}, "quarantine": {...}, "warnings": [...]}``)."""
    def mine() -> dict[str, Any]:
        inv, damaged = nd.survey()
        return {"node": nd.node, "inv": inv, "damaged": damaged, "q": nd.quarantine_entries()}

    def resolve(values: list[dict[str, Any]]) -> dict[str, Any]:
        nodes = [v["node"] for v in values]
        inv: dict[str, Any] = {}
        quarantine: dict[str, Any] = {}
        notes: list[str] = []
        for v in values:
            if v["node"] not in inv:  # one warning per node and step: the node's first rank's view
                notes += [f"restore: step {s} on {v['node']}: {why}" for s, why in sorted(v["damaged"].items())]
                merge_marks(quarantine, v["q"])
            inv.setdefault(v["node"], v["inv"])
        # root's save of a step the nodes hold or a node's mark names: which save it is
        root = root_side({int(s) for i in inv.values() for s in i} | {int(s) for s in quarantine})
        merge_marks(quarantine, root.get("quarantine", {}))
        steps = {int(s) for i in inv.values() for s in i} | set(root["steps"])
        root_sigs = root.get("sigs") or {}
        # root's steps whose committed save a mark names (any mark, when root's save is unknown)
        root_hidden = {s for s in root["steps"] if hidden_by(quarantine, s, root_sigs.get(str(s)))}

        def visible(s: int) -> bool:  # some save of step s that no mark names
            return (s in root["steps"] and s not in root_hidden) or any(
                hidden_by(quarantine, s, i[str(s)].get("sig")) is None for i in inv.values() if str(s) in i)

        cands = sorted((s for s in steps if visible(s)), reverse=True)
        return {"nodes": nodes, "inv": inv, "root": root["steps"], "root_paths": root.get("paths", {}), "cands": cands,
                "root_sigs": root_sigs, "root_hidden": sorted(root_hidden),
                "quarantine": quarantine, "root_damaged": root.get("damaged", []),
                "warnings": root.get("warnings", []) + notes}

    return coord.decide("tier-inventory", mine, resolve, hint="Nothing was loaded; the state is unchanged.")


def merge_marks(into: dict[str, Any], more: Mapping[str, Any]) -> None:
    """Merge quarantine marks (``local_tier.quarantine_entries``) of several tiers: the saves
    they name together; a mark that names none (hides every save of the step) stays so."""
    for s, mark in more.items():
        cur = into.get(s)
        if cur is None:
            into[s] = mark
            continue
        a, b = cur.get("sigs"), mark.get("sigs")
        into[s] = {"reason": cur.get("reason"), "sigs": sorted({*a, *b}) if a and b else None}


def holders_of(plan: dict[str, Any], step: int) -> tuple[str | None, list[str], dict[str, list[str]]]:
    """(the manifest hash to use, its files, file -> nodes holding a copy) for ``step``. When
    root holds the step, root's save is the committed truth: only the nodes' copies of that
    save count (the same files, :func:`save_signature`), and with none the step comes from root
    alone (None). When only nodes hold it and they hold different saves of that step number
    (a job that rolled back and saved it again elsewhere, or whose save failed on some node),
    the newest save wins (the manifest's time; then the most copies), never a mix of files
    of different saves."""
    by_hash: dict[str, dict[str, list[str]]] = {}
    names: dict[str, list[str]] = {}
    created: dict[str, str] = {}
    marks = plan.get("quarantine") or {}
    in_root = step in plan.get("root", ()) and step not in plan.get("root_hidden", ())  # a quarantined save is no truth
    root_sig = (plan.get("root_sigs") or {}).get(str(step)) if in_root else None
    for node, inv in plan["inv"].items():
        rec = inv.get(str(step))
        if rec is None or hidden_by(marks, step, rec.get("sig")) is not None:
            continue
        if in_root and rec.get("sig") != root_sig:
            continue  # another save than root's (or root's manifest unreadable): not this step
        names[rec["manifest"]] = rec["all"]
        created[rec["manifest"]] = str(rec.get("created") or "")
        held = by_hash.setdefault(rec["manifest"], {})
        for f in rec["files"]:
            held.setdefault(f, []).append(node)
    if not by_hash:
        return None, [], {}
    best = max(sorted(by_hash), key=lambda h: (created[h], len(by_hash[h]), sum(map(len, by_hash[h].values()))))
    return best, names[best], by_hash[best]


def restore_local(coord: Coordinator, nd: NodeDir, plan: dict[str, Any], step: int, state: MutableMapping[str, Any],
                  **kwargs: Any) -> bool | str:
    """:func:`_restore_local`; the chunk digests its verify kept for the load
    (``engine.prehashed``) are released on every way out."""
    try:
        return _restore_local(coord, nd, plan, step, state, **kwargs)
    finally:
        prehashed.release(nd.step_dir(step))


def _restore_local(coord: Coordinator, nd: NodeDir, plan: dict[str, Any], step: int, state: MutableMapping[str, Any],
                   *, strict: Any, timeout: float, root_file: Callable[[str], bytes | None] | None,
                   reasons: list[str], keep_local: int | None = None, max_bytes: int | None = None,
                   replicas: int = 1,
                   defer: Callable[[Callable[[], list[str]]], None] | None = None) -> bool | str:
    """Assemble ``step`` on every node and load it. False (on every rank) when some file has
    no valid copy or the load found damage (the reason is appended); True when loaded.
    Healing is best effort: a node that cannot write a fetched file (ENOSPC, ...) warns, and
    the step is then loaded from root (``"root"`` returned: the caller does) when root holds
    it, else False (an older step). After the load each node applies ``keep_local`` and
    ``max_bytes`` (a healed node may be over its budget).

    Every copy is hashed whole before the load, though the load checks the chunks it reads
    again: a load may read a file in part (another rank's per-rank entries, a partial or
    resharding load), and damage in the rest, never checked, would be redundancy silently lost
    (a later restore would find no good copy). Tried and reverted: leaving the copies a rank's
    load reads to its chunk check (found by review: a partial read left the rest unchecked).

    ``defer(heal)``: where the files a node of one rank loaded from memory are written to its
    disk after the restore returns (the manager's background worker: the next save, wait,
    restore or close joins it); without it, before returning."""
    mhash, names, holders = holders_of(plan, step)
    nodes: list[str] = plan["nodes"]
    me = coord.rank
    members = [r for r, n in enumerate(nodes) if n == nd.node]
    pos = members.index(me)
    my_rec = plan["inv"].get(nd.node, {}).get(str(step))
    in_root = step in plan["root"] and step not in plan["root_hidden"]
    man_source = next((nodes.index(n) for n in dict.fromkeys(nodes) if nd_holds(plan, n, step, mhash)), None)

    url = tier_url(nd.key, step)
    needed: list[Any] = []  # this rank's files_needed (None: unknown), once planned

    def verify() -> dict[str, Any]:
        out: dict[str, Any] = {"bad": []}
        if my_rec is not None and my_rec["manifest"] != mhash:
            if pos == 0:  # another save of this step number: useless here, and in the way
                rmtree_quiet(nd.step_dir(step))
            return out
        if my_rec is None:
            return out
        try:
            raw, man = nd.read_manifest(step)  # validated as root's (see NodeDir.read_manifest)
        except (CheckpointError, OSError):
            raw, man = b"", {}
        if file_xxh3(raw) != mhash:
            out["bad"] = list(my_rec["files"])
            return out
        hasher = verifier_of(my_rec["files"], man, members)
        mine = [f for f in sorted(my_rec["files"]) if hasher[f] == me]
        listed = step_files(man)
        out["bad"] = [f for f in mine if not nd.verified(step, f, listed[f])]
        if me == man_source:
            out["manifest"] = raw.decode()
        return out

    def manifest_of(reports: list[dict[str, Any]]) -> dict[str, Any]:
        text = next((rep["manifest"] for rep in reports if "manifest" in rep), None)
        if text is None or file_xxh3(text.encode()) != mhash:
            return {"skip": f"step {step}: no node holds its manifest intact"}
        return {"manifest": text, "bad": sorted({(nodes[r], f) for r, rep in enumerate(reports) for f in rep["bad"]})}

    unchanged = "Nothing was loaded; the state is unchanged."
    d = coord.decide("tier-verify", verify, manifest_of, hint=unchanged)
    if "skip" in d:
        reasons.append(d["skip"])
        return False
    raw = d["manifest"].encode()
    man = json.loads(raw)
    bad_at = {(n, f) for n, f in d["bad"]}
    data_files = set(man.get("files") or {})

    def needs() -> Any:
        """The data files this rank's load reads ("all" when every one, or unknown): a node
        fetches only what its ranks read (an FSDP rank at the same world size: its own file),
        so a restore's bytes per node do not grow with the world size."""
        got = files_needed(url, man, state, strict=strict, rank=me, world_size=coord.world_size)
        needed.append(got)
        return "all" if got is None or data_files <= got else sorted(got)

    def fetch_plan(reports: list[Any]) -> dict[str, Any]:
        good = {f: [n for n in holders.get(f, []) if (n, f) not in bad_at] for f in names}
        lacking = [f for f in names if not good[f] and not (in_root and root_file is not None)]
        if lacking:
            return {"skip": f"step {step}: no valid copy of {', '.join(sorted(set(lacking))[:5])} on any node"
                    + (" nor under root" if root_file is not None else "")}
        entries = []
        ranks_of: dict[str, list[int]] = {}
        for r, m in enumerate(nodes):
            ranks_of.setdefault(m, []).append(r)
        placed = placement(man, nodes, replicas)
        for n, ranks in ranks_of.items():
            wanted = set(placed.get(n, ()))
            for r in ranks:
                wanted |= data_files if reports[r] == "all" else set(reports[r])
            for i, f in enumerate(names):
                if n in good[f] or (f in data_files and f not in wanted):
                    continue
                srcs = []
                for j, h in enumerate(good[f]):
                    hr = ranks_of[h]
                    srcs.append(hr[(i + j) % len(hr)])
                if in_root and root_file is not None:
                    srcs.append(ROOT)
                entries.append([ranks[i % len(ranks)], f, srcs])
        notes = [f"restore of step {step}: the copy of {f} on {n} failed verification; taking it from "
                 "another copy" for n, f in sorted(bad_at)]
        return {"entries": entries, "warnings": notes}

    d = coord.decide("tier-plan", needs, fetch_plan, hint=unchanged)
    if "skip" in d:
        reasons.append(d["skip"])
        return False
    for note in d["warnings"]:
        warn(note)
    expected = {f: (rec["size"], rec["xxh3_128"]) for f, rec in step_files(man).items()}
    entries = d["entries"]
    repaired: list[int] = []  # this rank's directory of the step, once fit to receive (see _keep)
    done = [False] * len(entries)
    rounds = max((len(e[2]) for e in entries), default=0)
    unhealed: list[str] = []  # the same on every rank: the files fetched that a node could not keep
    from_memory = True  # and every such file is held in memory for the load (see held_files)
    # A node of one rank receives the fetched files its load reads into buffers the load reads
    # from, and writes them to its disk after the load (the heal, ``defer``: off the restore's
    # critical path); the rest (a replica it keeps for the others, an extra file) is written as
    # it arrives, so what it holds is at most what it loads. Load unknown (None): none held.
    loads_here = set(needed[0] or ()) if len(members) == 1 else set()
    to_heal: list[tuple[str, Any]] = []  # (name, held_files.Received), verified, not on disk yet
    loaded = False
    try:  # whatever is held in memory is released on every way out (see held_files)
        for k in range(rounds):
            todo = [i for i, e in enumerate(entries) if not done[i] and k < len(e[2])]
            if not any(not done[i] for i in range(len(entries))):
                break

            def fetch(todo: list[int] = todo, k: int = k) -> dict[str, Any]:
                sends, recvs, got, failed, unhealed = [], [], [], [], []
                received: dict[int, Any] = {}  # entry -> its held_files.Received
                in_memory = True  # every file this rank could not keep is held in memory for the load
                for i in todo:
                    dest, f, srcs = entries[i]
                    src = srcs[k]
                    if src == me:
                        try:
                            data = read_file(nd.file_path(step, f), expected[f][0])
                        except (OSError, CheckpointError):  # gone meanwhile: zeros, which the receiver rejects
                            data = torch.zeros(expected[f][0], dtype=torch.uint8)
                        sends.append((dest, i, as_tensor(data)))
                    if dest == me and src != ROOT:
                        held = held_files.receive_buffer(expected[f][0]) if f in loads_here else None
                        if held is not None:
                            received[i] = held
                        recvs.append((src, i, held.tensor if held is not None
                                      else torch.empty(expected[f][0], dtype=torch.uint8)))
                send_recv(coord, sends, recvs)
                arrived: list[tuple[int, Any]] = [(tag, buf.numpy()) for _, tag, buf in recvs]
                for i in todo:
                    dest, f, srcs = entries[i]
                    if dest == me and srcs[k] == ROOT:
                        assert root_file is not None
                        try:
                            arrived.append((i, root_file(expected[f][1])))
                        except Exception as exc:  # noqa: BLE001 - the root copy is just one more source
                            failed.append([i, f"root: {type(exc).__name__}: {exc}"])
                del recvs
                for i, data in arrived:
                    f = entries[i][1]
                    if data is None or len(data) != expected[f][0] or file_xxh3(data) != expected[f][1]:
                        failed.append([i, f"{f} from {'root' if entries[i][2][k] == ROOT else f'rank {entries[i][2][k]}'} "
                                          "failed verification"])
                        continue
                    if i in received:  # loaded from memory, kept on disk after the load
                        held_files.hold(os.path.join(nd.step_dir(step), MANIFEST), raw)
                        held = received.pop(i)
                        held_files.hold(nd.file_path(step, f), held)
                        to_heal.append((f, held))
                        got.append(i)
                        continue
                    try:
                        _keep(nd, step, f, data, raw, repaired)
                    except OSError as exc:  # healing is best effort: the file is here, not on disk
                        unhealed.append(f"{f} on {nd.node}: {type(exc).__name__}: {exc}")
                        with contextlib.suppress(OSError, CheckpointError):  # a damaged copy left there:
                            os.unlink(nd.file_path(step, f))  # gone, so no reader can take it (fails closed)
                        # Held for this process's load only: usable when it is the node's one rank
                        # (another rank of the node would find the file missing on disk).
                        in_memory = in_memory and len(members) == 1 and \
                            held_files.hold(nd.file_path(step, f), data) and \
                            held_files.hold(os.path.join(nd.step_dir(step), MANIFEST), raw)
                    got.append(i)
                del arrived
                for held in received.values():  # failed verification: not used
                    held.close()
                return {"got": got, "failed": failed, "unhealed": unhealed, "in_memory": in_memory}

            res = coord.decide("tier-fetch", fetch, lambda reps: reps, hint=unchanged)
            from_memory = from_memory and all(rep["in_memory"] for rep in res)
            for rep in res:
                for i in rep["got"]:
                    done[i] = True
                for _i, why in rep["failed"]:
                    warn(f"restore of step {step}: {why}; trying the next copy")
                unhealed += rep["unhealed"]
        if not all(done):
            missing = sorted({entries[i][1] for i in range(len(entries)) if not done[i]})
            reasons.append(f"step {step}: no copy of {', '.join(missing[:5])} could be fetched and verified")
            return False
        if unhealed:
            warn(f"restore of step {step}: a node could not keep the copies it fetched ({'; '.join(unhealed[:3])}"
                 f"{'; ...' if len(unhealed) > 3 else ''}): " + (
                     "loading them from memory; its node-local tier is not healed" if from_memory else
                     "loading the step from root" if in_root else "its node-local tier is not healed"))
            if not from_memory:
                held_files.release(nd.step_dir(step))
                if in_root and root_file is not None:
                    return "root"
                reasons.append(f"step {step}: a node could not keep the copies it fetched ({unhealed[0]})")
                return False
        # Every chunk is verified again as the load reads it: a file's whole-file checksum matching
        # the manifest does not prove its index's chunk checksums agree (a forged file would pass).
        load(url, state, strict=strict, timeout=timeout)
        loaded = True
    except (CorruptCheckpoint, FileNotFoundError) as exc:
        reasons.append(f"step {step} (local tier): {exc}")
        return False
    finally:
        held_files.release(nd.step_dir(step))
        if not loaded:  # fetched again by whatever comes next
            for _, held in to_heal:
                held.close()

    def heal() -> list[str]:
        """The node keeps what it loaded from memory, then applies its budget: warnings."""
        notes = []
        try:
            for f, held in to_heal:
                try:
                    _keep(nd, step, f, held.view(), raw, repaired)
                except OSError as exc:  # healing is best effort: the step was loaded
                    notes.append(f"restore of step {step}: {nd.node} could not keep the copy of {f} it fetched "
                                 f"({type(exc).__name__}: {exc}); its node-local tier is not healed")
                    with contextlib.suppress(OSError, CheckpointError):
                        os.unlink(nd.file_path(step, f))
                    break
        finally:
            for _, held in to_heal:
                held.close()
        if pos == 0 and (keep_local is not None or max_bytes is not None):
            with contextlib.suppress(OSError):  # the healed node within its budget (never this step)
                nd.retain(keep_local, max_bytes, {step})
                if max_bytes is not None and nd.nbytes() > max_bytes:
                    _trim(nd, step, man, nodes, members, replicas)
        return notes

    if to_heal and defer is not None:
        defer(heal)
    else:
        for note in heal():
            warn(note)
    return True


def verifier_of(names: Any, man: Mapping[str, Any], members: list[int]) -> dict[str, int]:
    """Which rank of a node hashes each of the node's files of a step in a restore's verify: a
    data file's own rank where that rank is on this node (a sharded rank's load reads its own
    file: the chunk digests its verify keeps serve that load, see ``engine.prehashed``), the
    other files in turn. The same on every rank of the node (same files, same manifest)."""
    files = man.get("files") if isinstance(man.get("files"), dict) else {}
    out: dict[str, int] = {}
    rest = []
    for f in sorted(names):
        rec = files.get(f)
        rank = rec.get("rank") if isinstance(rec, dict) else None
        if type(rank) is int and rank in members:
            out[f] = rank
        else:
            rest.append(f)
    for i, f in enumerate(rest):
        out[f] = members[i % len(members)]
    return out


def placement(man: dict[str, Any], nodes: list[str], replicas: int) -> dict[str, set[str]]:
    """Node -> the data files a save of this world would place there (its ranks' own files and
    the replicas it receives): what a restore heals a node to besides what its ranks load, so
    the step keeps its redundancy (a node lost next still has its files elsewhere). Empty when
    the step was saved on another world size. O(files of the node) each."""
    if man.get("world_size") != len(nodes):
        return {}
    of_rank: dict[Any, list[str]] = {}
    for name, rec in (man.get("files") or {}).items():
        if isinstance(rec, dict):
            of_rank.setdefault(rec.get("rank"), []).append(name)
    out: dict[str, set[str]] = {}
    for r, dests in replica_targets(nodes, replicas).items():
        for holder in (r, *dests):
            out.setdefault(nodes[holder], set()).update(of_rank.get(r, ()))
    return out


def _trim(nd: NodeDir, step: int, man: dict[str, Any], nodes: list[str], members: list[int], replicas: int) -> None:
    """After a restore healed every file of ``step`` onto this node and the node is still over
    ``local_max_bytes``: keep only what a save would have placed here (the data files of its
    ranks and the replicas it would receive, the extra files and the records); every other
    file stays on the node of its rank. Nothing when the step was saved on another world."""
    files = man.get("files") or {}
    if man.get("world_size") != len(nodes):
        return
    targets = replica_targets(nodes, replicas)
    mine = set(members)
    for name, rec in files.items():
        r = rec.get("rank") if isinstance(rec, dict) else None
        if not isinstance(r, int) or r in mine or mine & set(targets.get(r, [])):
            continue
        with contextlib.suppress(OSError, CheckpointError):
            os.unlink(nd.file_path(step, name))


def nd_holds(plan: dict[str, Any], node: str, step: int, mhash: str | None) -> bool:
    rec = plan["inv"].get(node, {}).get(str(step))
    return rec is not None and rec["manifest"] == mhash


def _keep(nd: NodeDir, step: int, name: str, data: Any, manifest: bytes, repaired: list[int]) -> None:
    """A fetched, verified file into this node's directory of ``step`` (created if the node
    lost it, repaired once per restore if its copy was damaged: ``NodeDir.repair_step``),
    replacing a bad copy; written only inside that directory (``name`` is a name of the
    validated manifest)."""
    if step not in repaired:
        nd.repair_step(step, manifest)
        repaired.append(step)
    write_bytes_atomic(nd.room_for(step, name), data)


def drain_from_tier(coord: Coordinator, nd: NodeDir, store: Storage, target: str, step: int,
                    before: Callable[[], None], after_commit: Callable[[int | None], Any]) -> dict[str, Any]:
    """Commit the nodes' copies of ``step`` under ``target`` (root): for a step whose staged
    bytes a later save's copy-aside reused (``close()`` after that later save failed, e.g. its
    ``check_finite`` refusal). Every rank reports what its node holds of the step; the
    coordinator assigns each data file to a rank on a node holding it and begins the commit;
    each rank copies its files, verified against the manifest, into root's staging place; the
    coordinator commits the node's manifest with the extra files. Returns the manifest's
    ``files`` (the commit raises on any failure, on every rank, nothing published)."""
    def mine() -> dict[str, Any]:
        rec, _why = nd.examine(step)
        return {"node": nd.node, "files": sorted(rec["files"]) if rec else [], "manifest": rec["manifest"] if rec else None}

    def assign(reports: list[dict[str, Any]]) -> dict[str, Any]:
        raw, man = nd.read_manifest(step)  # the coordinator's node: published, so it holds the manifest
        mhash = file_xxh3(raw)
        data = sorted(man.get("files") or {})
        who: dict[str, int] = {}
        for i, f in enumerate(data):
            ranks = [r for r, rep in enumerate(reports) if rep["manifest"] == mhash and f in rep["files"]]
            if not ranks:
                raise CheckpointError(f"drain of step {step} from the node-local tier: no node holds {f}")
            who[f] = ranks[i % len(ranks)]
        before()
        staging = _commit.begin(store, target, True)
        return {"staging": staging, "who": who, "manifest": raw.decode()}

    hint = f"Nothing was committed under root; step {step} stays on the node-local tier."
    plan = coord.decide("tier-drain-begin", mine, assign, hint=hint)
    staging, raw = plan["staging"], plan["manifest"].encode()
    listed = step_files(json.loads(raw))

    def copy() -> list[str]:
        done = []
        for f, r in plan["who"].items():
            if r != coord.rank:
                continue
            size, xxh = int(listed[f]["size"]), listed[f]["xxh3_128"]
            data = read_file(nd.file_path(step, f), size).numpy()
            if file_xxh3(data) != xxh:
                raise CorruptCheckpoint(f"the node-local copy of {f} of step {step} on {nd.node} failed "
                                        "verification")
            store.put(store.join(staging["path"], f), data.tobytes())
            done.append(f)
        return done

    def commit(_: Any) -> dict[str, Any]:
        try:
            man = json.loads(raw)
            extras = {}
            for name, rec in (man.get("extra") or {}).items():
                data = read_file(nd.file_path(step, name), int(rec["size"])).numpy()
                if file_xxh3(data) != rec["xxh3_128"]:
                    raise CorruptCheckpoint(f"the node-local copy of the extra file {name} of step {step} "
                                            "failed verification")
                extras[name] = data.tobytes()
            late = _commit.commit(store, target, staging, raw, overwrite=True, files=man.get("files") or {},
                                  extras=extras)
        except BaseException:
            _commit.discard(store, target, staging)
            raise
        if late is not None:
            raise CheckpointError(late)
        after_commit(step)
        return {"path": target}

    coord.decide("tier-drain-write", copy, commit, hint=hint)
    return {"path": target}
