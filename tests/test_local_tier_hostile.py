"""The node-local tier's restore over hostile or damaged node copies (tests/stress/tier_defects.py,
the fuzz_tier findings of 0b5eb70): a node copy that fails any of root's checks (wrong-shaped
or deeply nested JSON, a FIFO, a device, a huge sparse manifest, unsafe file names, a symlinked
manifest or step directory) is a damaged copy: ignored with one warning naming the node and the
path, its files re-sourced from a peer or root, an older step only when no valid copy exists;
never a crash, a hang or a read outside local_dir. And a fresh local_dir with root's only
checkpoint damaged raises CorruptCheckpoint, as the restore without the tier does.

Collective cases run in one real 2-process job (2 simulated nodes x 1 rank, replicas=1, gloo on
127.0.0.1) under a hard timeout; each case has its own root and local dirs.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings

import pytest
import torch

from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(120)


def _state(v: float) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) * v, "v": v}


def _forged(man: dict, name: str) -> bytes:
    """``man`` with its first data file renamed to ``name``, re-sealed (checksum consistent)."""
    from safeckpt.format.manifest import CHECKSUM_FIELD, encode_manifest

    body = {k: v for k, v in man.items() if k != CHECKSUM_FIELD}
    files = dict(body["files"])
    first = sorted(files)[0]
    files[name] = files.pop(first)
    body["files"] = files
    return encode_manifest(body)


def _damage(case: str, step_dir: str, outside: str) -> None:
    """Damage one node's copy of a step (``step_dir``) as ``case`` says; ``outside`` is a
    directory outside local_dir that the restore must never read."""
    man_path = os.path.join(step_dir, "manifest.json")
    with open(man_path, "rb") as f:
        good = f.read()
    man = json.loads(good)
    data = sorted(man["files"])[0]

    def write(raw: bytes) -> None:
        os.remove(man_path)
        with open(man_path, "wb") as f:
            f.write(raw)

    if case == "list":
        write(b"[]")
    elif case == "string":
        write(b'"x"')
    elif case == "number":
        write(b"7")
    elif case == "record-number":
        write(json.dumps({**man, "files": {**man["files"], data: 5}}).encode())
    elif case == "record-no-xxh3":
        rec = {k: v for k, v in man["files"][data].items() if k != "xxh3_128"}
        write(json.dumps({**man, "files": {**man["files"], data: rec}}).encode())
    elif case == "nested":
        write(b"[" * 100_000 + b"]" * 100_000)
    elif case == "fifo":
        os.remove(man_path)
        os.mkfifo(man_path)
    elif case == "dev-zero":
        os.remove(man_path)
        os.symlink("/dev/zero", man_path)
    elif case == "huge":
        with open(man_path, "r+b") as f:
            f.truncate(1 << 30)  # sparse: 1 GiB of NULs
    elif case == "traversal":  # a consistent manifest naming a file outside the node directory
        target = os.path.join(outside, "secret")
        with open(target, "wb") as f:
            f.write(b"s" * man["files"][data]["size"])
        write(_forged(man, os.path.relpath(target, step_dir)))
    elif case == "symlinked-manifest":  # a valid manifest outside local_dir, linked in
        shutil.copy(man_path, os.path.join(outside, "manifest.json"))
        os.remove(man_path)
        os.symlink(os.path.join(outside, "manifest.json"), man_path)
    elif case == "symlinked-step":  # the whole step, valid, outside local_dir, linked in
        away = os.path.join(outside, "step")
        shutil.copytree(step_dir, away)
        shutil.rmtree(step_dir)
        os.symlink(away, step_dir)
    elif case == "fifo-data":
        os.remove(os.path.join(step_dir, data))
        os.mkfifo(os.path.join(step_dir, data))
    elif case == "fifo-tier-record":
        os.remove(os.path.join(step_dir, "tier.json"))
        os.mkfifo(os.path.join(step_dir, "tier.json"))
    else:
        raise AssertionError(case)


# node 0's copy of step 1001 damaged; node 1 holds every file of it (replicas=1): 1001 restored
ONE_NODE = ("list", "string", "number", "record-number", "record-no-xxh3", "nested", "fifo", "dev-zero",
            "huge", "traversal", "symlinked-manifest", "symlinked-step", "fifo-data", "fifo-tier-record")
# both nodes' copies damaged: no valid copy of 1001 anywhere -> 1000 from root
BOTH_NODES = ("list", "nested", "fifo", "symlinked-step")


def _job(rank: int, world: int, base: str) -> dict:
    import sys

    import torch.distributed as dist

    import safeckpt

    os.environ["GROUP_RANK"] = str(rank)
    opened: list[str] = []
    watch: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event == "open" and watch and args and isinstance(args[0], (str, bytes)):
            p = os.fsdecode(args[0])
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            if not os.path.isabs(p):  # relative to a directory descriptor: inside its directory
                return
            if flags & os.O_NOFOLLOW:  # a final symlink fails (ELOOP): only the parent is followed
                real = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
            else:
                real = os.path.realpath(p)
            if real.startswith(watch[0]):
                opened.append(p)

    sys.addaudithook(audit)
    out: dict = {}

    def restore(root: str, local: str | None) -> tuple:
        st = _state(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                # the job restarts as it ran (replicas=1): the restore heals the node's copy
                kw = {"local_dir": local, "replicas": 1} if local else {}
                with safeckpt.CheckpointManager(root, preemption_signals=(), timeout=30, **kw) as m:
                    got = m.restore(st)
                res: tuple = ("ok", got, st["v"], torch.equal(st["w"], _state(st["v"])["w"]))
            except Exception as exc:  # noqa: BLE001 - reported
                res = (type(exc).__name__, str(exc)[:300])
        return res, [str(w.message) for w in caught]

    cases = [(c, "one") for c in ONE_NODE] + [(c, "both") for c in BOTH_NODES]
    for case, where in cases:
        d = os.path.join(base, f"{case}-{where}")
        root, local, outside = (os.path.join(d, n) for n in ("root", f"node{rank}", f"outside{rank}"))
        os.makedirs(outside, exist_ok=True)
        m = safeckpt.CheckpointManager(root, local_dir=local, durable_every=1000, replicas=1,
                                       preemption_signals=(), timeout=30)
        m.save(1000, _state(1))  # durable
        m.save(1001, _state(2))  # local only (and its replica on the other node)
        m.wait()
        m.close(drain=False)  # the job dies: 1001 is on the nodes only
        dist.barrier()
        step_dir = glob.glob(os.path.join(local, "run-*", "step-0000001001"))[0]
        if rank == 0 or where == "both":
            _damage(case, step_dir, outside)
        dist.barrier()
        watch[:] = [os.path.realpath(outside) + os.sep]
        res, notes = restore(root, local)
        watch[:] = []
        from safeckpt.engine.local_tier import NodeDir

        healed = NodeDir(local, root).step_record(1001)
        out[f"{case}-{where}"] = {"res": res, "notes": notes, "outside": sorted(set(opened)),
                                  "healed": healed is not None and len(healed["files"]) == len(healed["all"])}
        opened.clear()
        dist.barrier()

    # 2. a fresh local_dir (a new node) and root's only checkpoint damaged: never a fresh start
    d = os.path.join(base, "fresh")
    root = os.path.join(d, "root")
    m = safeckpt.CheckpointManager(root, local_dir=os.path.join(d, f"old{rank}"), durable_every=1000,
                                   replicas=1, preemption_signals=(), timeout=30)
    m.save(1000, _state(1))
    m.close()
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, "step-0000001000", "manifest.json"), "wb") as f:
            f.write(b"{}")
    dist.barrier()
    out["fresh-plain"] = restore(root, None)[0]
    out["fresh-tier"] = restore(root, os.path.join(d, f"new{rank}"))[0]
    return out


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    base = str(tmp_path_factory.mktemp("hostile"))
    outs = dist_harness.run(_job, 2, base, timeout=100)
    assert all(o.ok for o in outs), [(o.error_type, o.message) for o in outs]
    return [o.value for o in outs]


@pytest.mark.parametrize("case", ONE_NODE)
def test_one_node_damaged_copy_is_resourced_from_the_peer(hostile: list[dict], case: str) -> None:
    for rank, out in enumerate(hostile):
        got = out[f"{case}-one"]
        assert got["res"] == ("ok", 1001, 2, True), (rank, got)  # bit-exact, the newest step
        assert not got["outside"], (rank, got["outside"])  # nothing read outside local_dir
        assert got["healed"], (rank, got)  # node 0's copy repaired by the restore
        ignored = [n for n in got["notes"] if "step 1001 on node-0:" in n and "damaged" in n]
        assert len(ignored) == 1, (rank, got["notes"])  # warned once, naming node and path
        assert "step-0000001001" in ignored[0]


@pytest.mark.parametrize("case", BOTH_NODES)
def test_every_copy_damaged_moves_to_the_older_step(hostile: list[dict], case: str) -> None:
    for rank, out in enumerate(hostile):
        got = out[f"{case}-both"]
        assert got["res"] == ("ok", 1000, 1, True), (rank, got)
        assert not got["outside"], (rank, got["outside"])
        for node in ("node-0", "node-1"):
            assert sum(f"step 1001 on {node}:" in n and "damaged" in n for n in got["notes"]) == 1, got["notes"]


def test_fresh_local_dir_and_damaged_root_history_raises(hostile: list[dict]) -> None:
    for out in hostile:
        assert out["fresh-plain"][0] == "CorruptCheckpoint", out["fresh-plain"]
        assert out["fresh-tier"][0] == "CorruptCheckpoint", out["fresh-tier"]
        assert "refusing to start fresh when history exists" in out["fresh-tier"][1]


# ------------------------------------------------------------------------- one process


def _local_job(tmp_path, *, drain: bool = False) -> tuple[str, str]:
    import safeckpt

    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    m = safeckpt.CheckpointManager(root, local_dir=local, durable_every=1000, preemption_signals=())
    m.save(1000, _state(1))
    m.save(1001, _state(2))
    m.wait()
    m.close(drain=drain)
    return root, local


def test_close_without_drain_leaves_the_step_on_the_tier(tmp_path) -> None:
    import safeckpt

    root, local = _local_job(tmp_path / "a")
    assert [c.step for c in safeckpt.CheckpointManager(root, preemption_signals=()).list()] == [1000]
    with safeckpt.CheckpointManager(root, local_dir=local, preemption_signals=()) as m:
        st = _state(0)
        assert m.restore(st) == 1001 and st["v"] == 2
    root, _ = _local_job(tmp_path / "b", drain=True)  # the default: drained to root
    assert [c.step for c in safeckpt.CheckpointManager(root, preemption_signals=()).list()] == [1000, 1001]


@pytest.mark.timeout(60)
def test_hostile_records_are_ignored_without_blocking(tmp_path) -> None:
    """FIFOs as the run's tier.json and quarantine.json, and as root's quarantine record: the
    restore, `safeckpt ls` of the local_dir and the quarantine read neither block nor raise."""
    import safeckpt
    from safeckpt.engine.local_tier import describe

    root, local = _local_job(tmp_path)
    run = glob.glob(os.path.join(local, "run-*"))[0]
    os.mkfifo(os.path.join(run, "quarantine.json"))
    os.mkfifo(os.path.join(root, ".safeckpt-quarantine.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with safeckpt.CheckpointManager(root, local_dir=local, preemption_signals=()) as m:
            st = _state(0)
            assert m.restore(st) == 1001 and st["v"] == 2
        assert describe(local)[0]["steps"][-1]["step"] == 1001
        os.remove(os.path.join(run, "tier.json"))
        os.mkfifo(os.path.join(run, "tier.json"))  # the run is not recognisably this root's: unused
        assert describe(local) is None
        with safeckpt.CheckpointManager(root, local_dir=local, preemption_signals=()) as m:
            st = _state(0)
            assert m.restore(st) == 1000 and st["v"] == 1


def test_symlinked_run_and_step_directories_are_never_followed_when_adopting(tmp_path) -> None:
    """The run identity's adoption (an upgrading run stamps its legacy steps' records; another
    run's data is moved aside) never writes or reads through a symbolic link inside local_dir
    (found by the tier fuzz: a legacy step directory replaced by a link to elsewhere had a
    record written there): a linked step is skipped, a linked run directory is moved aside as
    damaged, as a link, and what it points at is left as it was."""
    from safeckpt.engine.local_tier import TIER_FILE, TIER_FORMAT, NodeDir

    root, local, outside = tmp_path / "root", tmp_path / "local", tmp_path / "outside"
    for d in (root, outside / "ck"):
        d.mkdir(parents=True)
    legacy = {"root": str(root), "step": 2, "own": [], "replicas": []}  # no run_id: written before ids
    (outside / "ck" / TIER_FILE).write_text(json.dumps(legacy))
    nd = NodeDir(str(local), str(root))
    nd.ensure()  # the run directory, recorded without an id
    os.symlink(outside / "ck", os.path.join(nd.base, "step-0000000002"))
    before = sorted(os.listdir(outside / "ck"))
    assert nd.adopt("run-a", legacy=True) is None
    assert sorted(os.listdir(outside / "ck")) == before  # no record written through the link
    assert json.loads((outside / "ck" / TIER_FILE).read_text()) == legacy
    assert json.loads(open(os.path.join(nd.base, TIER_FILE)).read())["run_id"] == "run-a"

    # the run directory itself a link (to a copy that even names this root): damaged, moved aside
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / TIER_FILE).write_text(json.dumps({"format": TIER_FORMAT, "root": str(root), "run_id": "run-a"}))
    shutil.rmtree(nd.base)
    os.symlink(other, nd.base)
    rec = nd.recorded()
    assert not rec["mine"] and rec["run"] is None and rec["data"], rec
    aside = nd.adopt("run-a", legacy=False)
    assert aside is not None and os.path.islink(aside) and not os.path.lexists(nd.base)
    assert sorted(os.listdir(other)) == [TIER_FILE]  # the target untouched
