"""Checkpoints on object stores (fsspec URLs): commit by manifest, no renames, ranged reads.

Multi-process runs need storage every rank can reach, so this file registers ``objtest://``, a
test-only fsspec filesystem that keeps its objects in a local temporary directory but behaves
like an object store: rename/move raise, prefixes need no directories (and vanish when their
last object is deleted), and ``pipe_file(mode="create")`` is a conditional write. Every spawned
worker imports this module, so every rank has it. ``memory://`` covers the single-process case.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import stringify_path
from torch import nn

import safeckpt
from safeckpt import cli
from safeckpt.engine.reader import TensorReader, open_manifest
from safeckpt.format.manifest import MANIFEST
from safeckpt.format.shardfile import write_file
from safeckpt.storage import commit as _commit
from safeckpt.storage.base import storage_for
from safeckpt.storage.catalog import scan
from safeckpt.storage.fsspec_store import FsspecStorage
from safeckpt.storage.ranged import RemoteFile
from tests.helpers import dist_harness

PROTO = "objtest"


class ObjectStoreFS(LocalFileSystem):
    """A local directory that behaves like an object store (see module docstring)."""

    protocol = (PROTO,)
    root_marker = "/"

    def __init__(self, *args, **kwargs):
        super().__init__(auto_mkdir=True)

    @classmethod
    def _strip_protocol(cls, path):
        path = stringify_path(path)
        if path.startswith(f"{PROTO}://"):
            path = path[len(PROTO) + 3 :]
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name):
        return f"{PROTO}://{self._strip_protocol(name)}"

    def mv(self, *args, **kwargs):
        raise NotImplementedError("object store: no rename")

    rename = move = mv

    def rm_file(self, path):
        super().rm_file(path)
        parent = os.path.dirname(self._strip_protocol(path))
        try:
            os.rmdir(parent)  # a prefix exists only through its objects
        except OSError:
            pass

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        with self.open(path, "xb" if mode == "create" else "wb") as f:
            f.write(value)


fsspec.register_implementation(PROTO, ObjectStoreFS, clobber=True)


def _url(p: Path) -> str:
    return f"{PROTO}://{p}"


def _state(version: float, rank: int = 0, mib: int = 0) -> dict:
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(version)
    state = {"model": model, "version": version, "rng": safeckpt.RNGState()}
    if mib:  # a replicated tensor large enough to be cut into row ranges written by both ranks
        state["big"] = torch.arange(mib << 18, dtype=torch.float32).reshape(-1, 1024) + version
    return state


def _model_value(path: str) -> float:
    flat = safeckpt.read_state_dict(path)
    w = flat["model/0.weight"]
    assert torch.all(w == w.flatten()[0])
    assert flat["version"] == float(w.flatten()[0])
    return flat["version"]


def _files_under(local: Path) -> list[str]:
    return sorted(p.name for p in local.iterdir()) if local.exists() else []


# --------------------------------------------------------------------------- 2 ranks


def _roundtrip(rank: int, world: int, base: str) -> dict:
    out: dict = {}
    plain = f"{base}/plain"
    st = _state(1.0, rank, mib=8)
    torch.manual_seed(100 + rank)  # per-rank RNG state differs
    expect_rand = None
    info = safeckpt.save(plain, st, metadata={"run": "a"})
    out["plain_path"] = info.path
    expect_rand = torch.rand(3).tolist()  # what the restored RNG must produce
    st2 = _state(0.0, rank, mib=8)
    torch.manual_seed(999)
    safeckpt.load(plain, st2)
    out["plain_ok"] = (
        st2["version"] == 1.0
        and all(torch.equal(a, b) for a, b in zip(st["model"].state_dict().values(), st2["model"].state_dict().values()))
        and torch.equal(st2["big"], st["big"])
        and torch.rand(3).tolist() == expect_rand
    )
    run = f"{base}/run"
    with safeckpt.CheckpointManager(run, keep_last=2, preemption_signals=()) as mgr:
        out["fresh"] = mgr.restore(_state(0.0, rank))
        for s in (1, 2, 3, 4):
            mgr.save(s, _state(float(s), rank), metrics={"loss": 1.0 / s})
        out["listed"] = [i.step for i in mgr.list()]
        out["latest"] = mgr.latest().path
    with safeckpt.CheckpointManager(run, keep_last=2, async_save=True, preemption_signals=()) as mgr:
        st3 = _state(0.0, rank)
        out["restored"] = mgr.restore(st3)
        out["restored_version"] = st3["version"]
        out["restored_weight"] = float(st3["model"][0].weight[0, 0])
        mgr.save(5, _state(5.0, rank))  # background; close() waits for it
    out["after_async"] = [i.step for i in safeckpt.CheckpointManager(run, preemption_signals=()).list()]
    return out


def test_two_ranks_save_load_manager_retention_async(tmp_path):
    base = _url(tmp_path / "bucket")
    outs = dist_harness.run(_roundtrip, 2, base, timeout=120)
    for o in outs:
        assert o.ok, o.message
        v = o.value
        assert v["plain_ok"], v
        assert v["fresh"] is None
        assert v["listed"] == [3, 4]
        assert v["latest"] == f"{base}/run/step-0000000004"
        assert (v["restored"], v["restored_version"], v["restored_weight"]) == (4, 4.0, 4.0)
        assert v["after_async"] == [4, 5]
    # Data files carry the save's token; both ranks wrote one; the manifest names exactly them.
    man = open_manifest(f"{base}/plain")
    names = sorted(man["files"])
    assert [n.split(".")[0] for n in names] == ["rank-00000", "rank-00001"]
    assert len({n.split(".")[1] for n in names}) == 1
    assert _files_under(tmp_path / "bucket" / "plain") == sorted([MANIFEST, *names])
    big = man["tensors"]["big"]["chunks"]
    assert len({c["file"] for c in big}) == 2  # the 8 MiB tensor was split over both ranks
    # Retention removed steps 1-3 completely (manifest and data); nothing else is left over.
    assert sorted(n for n in _files_under(tmp_path / "bucket" / "run") if not n.startswith(".")) == [
        "step-0000000004", "step-0000000005"]
    assert [e.status for e in scan(f"{base}/run")] == ["committed", "committed"]
    assert safeckpt.verify(f"{base}/run/step-0000000005").ok
    assert _model_value(f"{base}/run/step-0000000005") == 5.0


def _die_mid_upload() -> None:
    """Patch this worker so that its next data upload stops half-way with a SIGKILL."""

    def dying(self, path, items, metadata, index=None):
        f = self.fs.open(self._path(path), "wb")
        f.write(b"\0" * 4096)
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    FsspecStorage.write = dying


def _overwrite_then_die(rank: int, world: int, run: str) -> None:
    mgr = safeckpt.CheckpointManager(run, keep_last=None, preemption_signals=())
    mgr.save(1, _state(1.0, rank))
    mgr.save(2, _state(2.0, rank))
    _die_mid_upload()
    mgr.save(2, _state(3.0, rank))  # overwrite of step 2, killed mid-upload


def _resume_then_die(rank: int, world: int, run: str, report: str) -> None:
    mgr = safeckpt.CheckpointManager(run, keep_last=None, preemption_signals=())
    st = _state(0.0, rank)
    step = mgr.restore(st)
    with open(f"{report}.{rank}", "w") as f:
        json.dump({"step": step, "version": st["version"], "w": float(st["model"][0].weight[0, 0])}, f)
    _die_mid_upload()
    mgr.save(3, _state(3.0, rank))  # a new step, killed mid-upload


def test_kill_mid_write_leaves_nothing_visible_and_old_checkpoints_load(tmp_path, capsys):
    local = tmp_path / "bucket" / "run"
    run = _url(local)
    outs = dist_harness.run(_overwrite_then_die, 2, run, timeout=90)
    assert [o.exitcode for o in outs] == [-signal.SIGKILL] * 2, [(o.exitcode, o.message) for o in outs]
    # The interrupted overwrite left step 2 as it was: committed, verified, old values.
    mgr = safeckpt.CheckpointManager(run, preemption_signals=())
    assert [i.step for i in mgr.list()] == [1, 2]
    assert safeckpt.verify(f"{run}/step-0000000002").ok
    assert _model_value(f"{run}/step-0000000002") == 2.0
    referenced = set(open_manifest(f"{run}/step-0000000002")["files"])
    strays = [n for n in _files_under(local / "step-0000000002") if n != MANIFEST and n not in referenced]
    assert strays and all(_commit.TOKEN_FILE.match(n) for n in strays)
    assert [(e.status, e.files) for e in scan(run) if e.step == 2] == [
        ("committed", ()), ("staging", tuple(sorted(strays)))]

    report = str(tmp_path / "report")
    outs = dist_harness.run(_resume_then_die, 2, run, report, timeout=90)
    assert [o.exitcode for o in outs] == [-signal.SIGKILL] * 2, [(o.exitcode, o.message) for o in outs]
    for r in (0, 1):
        with open(f"{report}.{r}") as f:
            assert json.load(f) == {"step": 2, "version": 2.0, "w": 2.0}
    # The sweep at that save (dead holder's lease taken over) removed step 2's strays ...
    assert _files_under(local / "step-0000000002") == sorted([MANIFEST, *referenced])
    # ... and the killed save of step 3 is invisible: no manifest, only token-named leftovers.
    assert [i.step for i in mgr.list()] == [1, 2]
    assert MANIFEST not in _files_under(local / "step-0000000003")
    assert [e.status for e in scan(run) if e.step == 3] == ["staging"]
    with pytest.raises(safeckpt.CheckpointNotFound):
        safeckpt.read_state_dict(f"{run}/step-0000000003")

    # `safeckpt ls` shows the leftover, `safeckpt gc` removes it (the dead job's lease is stale).
    assert cli.main(["ls", run]) == 0
    out = capsys.readouterr().out
    assert "staging (leftover)" in out and "step-0000000002" in out
    assert cli.main(["gc", run]) == 0
    assert "removed step-0000000003" in capsys.readouterr().out
    assert _files_under(local / "step-0000000003") == []
    assert [e.status for e in scan(run)] == ["committed", "committed"]


# --------------------------------------------------------------------------- one process


def test_memory_roundtrip_read_state_dict_and_cli(capsys):
    url = "memory://safeckpt-test/one"
    st = _state(7.0)
    info = safeckpt.save(url, st, metadata={"k": "v"}, step=3)
    assert info.path == url and info.step == 3
    st2 = _state(0.0)
    got = safeckpt.load(url + "/", st2)  # a trailing slash names the same checkpoint
    assert got.path == url and st2["version"] == 7.0
    assert torch.equal(st2["model"][2].bias, st["model"][2].bias)
    flat = safeckpt.read_state_dict(url)
    assert flat["version"] == 7.0 and torch.equal(flat["model/0.weight"], st["model"][0].weight)
    report = safeckpt.verify(url)
    assert report.ok and report.step == 3 and report.nbytes == info.nbytes
    with pytest.raises(safeckpt.CheckpointExists):
        safeckpt.save(url, st)
    assert cli.main(["verify", url]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli.main(["inspect", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    assert cli.main(["ls", "memory://safeckpt-test", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert [(r["name"], r["status"]) for r in rows] == [("one", "committed")]
    fsspec.filesystem("memory").rm("/safeckpt-test", recursive=True)


def test_stream_writer_bytes_match_local_writer(tmp_path):
    items = [("a", torch.arange(10, dtype=torch.int16)), ("b", torch.randn(3, 5)),
             ("c", torch.tensor(True)), ("d", torch.randn(7, dtype=torch.float64))]
    local = write_file(str(tmp_path / "x.safetensors"), items, {"format": "safeckpt"})
    url = "memory://safeckpt-test/w/x.safetensors"
    store = storage_for(url)
    remote = store.write(url, items, {"format": "safeckpt"})
    assert remote == local
    assert store.read(url, 1 << 20) == (tmp_path / "x.safetensors").read_bytes()
    store.delete(url)


def test_partial_reads_fetch_only_the_rows_needed(tmp_path, monkeypatch):
    url = _url(tmp_path / "ck")
    big = torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024)
    safeckpt.save(url, {"big": big})
    man = open_manifest(url)  # format 3: reads the file's index (a few bytes), counted apart
    fetched: list[int] = []
    real = RemoteFile._fetch

    def spy(self, ranges):
        fetched.extend(hi - lo for lo, hi in ranges)
        return real(self, ranges)

    monkeypatch.setattr(RemoteFile, "_fetch", spy)
    (name,) = man["files"]
    size = man["files"][name]["size"]
    unverified = TensorReader(url, man, rank=1, verify=False)  # rank 1: nothing of it is "likely"
    part = torch.empty(1024, 1024)
    unverified.fill_box("big", part, [[100, 0], [1024, 1024]])
    assert torch.equal(part, big[100:1124])
    header = size - big.numel() * 4
    assert sum(fetched) == 1024 * 1024 * 4 + min(size, 4 << 20)  # the header window, then those rows only
    fetched.clear()
    # Verified (the default): the chunk is fetched whole once (with the rest of the file after
    # the header's window) to check its checksum before anything is copied; the copies are
    # served from it.
    reader = TensorReader(url, man)
    part = torch.empty(1024, 1024)
    reader.fill_box("big", part, [[100, 0], [1024, 1024]])
    assert torch.equal(part, big[100:1124])
    whole = reader.new("big")
    index = man["files"][name]["index"][1] - man["files"][name]["index"][0]  # read with the manifest
    assert torch.equal(whole, big) and sum(fetched) == size - index and header > 0
    reader.close()


def test_overwrite_keeps_old_checkpoint_readable_until_manifest_lands(tmp_path, monkeypatch):
    local = tmp_path / "ck"
    url = _url(local)
    safeckpt.save(url, _state(1.0))
    old_files = set(open_manifest(url)["files"])
    seen = {}
    real_publish = _commit.publish

    def checking_publish(store, staging, final, manifest, *, replace):
        # the commit point: new data is written, old manifest in place
        seen["before"] = _model_value(url)
        seen["present"] = _files_under(local)
        real_publish(store, staging, final, manifest, replace=replace)
        seen["after"] = _model_value(url)

    monkeypatch.setattr(_commit, "publish", checking_publish)
    safeckpt.save(url, _state(2.0), overwrite=True)
    assert seen["before"] == 1.0 and seen["after"] == 2.0
    assert old_files < set(seen["present"])  # both generations existed side by side
    new_files = set(open_manifest(url)["files"])
    assert not (new_files & old_files)
    assert _files_under(local) == sorted([MANIFEST, *new_files])  # old data deleted afterwards


def test_failed_save_removes_its_objects_and_keeps_the_old(tmp_path, monkeypatch):
    local = tmp_path / "ck"
    url = _url(local)
    safeckpt.save(url, _state(1.0))
    before = _files_under(local)
    real = FsspecStorage.write

    def failing(self, path, items, metadata, index=None):
        real(self, path, items, metadata, index)
        raise OSError("upload failed: simulated")

    monkeypatch.setattr(FsspecStorage, "write", failing)
    with pytest.raises(safeckpt.RankFailure, match="simulated"):
        safeckpt.save(url, _state(2.0), overwrite=True)
    assert _files_under(local) == before
    assert _model_value(url) == 1.0


def test_corrupt_data_is_detected_and_restore_falls_back(tmp_path):
    local = tmp_path / "run"
    run = _url(local)
    with safeckpt.CheckpointManager(run, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))
    step2 = local / "step-0000000002"
    data = next(p for p in step2.iterdir() if p.name != MANIFEST)
    raw = bytearray(data.read_bytes())
    last = max(c["end"] for rec in open_manifest(f"{run}/step-0000000002")["tensors"].values()
               for c in rec["chunks"])  # the files' indexes (format 3) follow the tensors
    raw[last - 5] ^= 0x40  # flip a bit in the last tensor's bytes, size unchanged
    data.write_bytes(bytes(raw))
    assert safeckpt.verify(f"{run}/step-0000000002", deep=False).ok
    report = safeckpt.verify(f"{run}/step-0000000002")
    assert not report.ok and "checksum mismatch" in report.problems[0]
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.load(f"{run}/step-0000000002", _state(0.0))
    with pytest.raises(safeckpt.CorruptCheckpoint):
        safeckpt.read_state_dict(f"{run}/step-0000000002")
    assert cli.main(["verify", f"{run}/step-0000000002"]) == safeckpt.CorruptCheckpoint.exit_code
    st = _state(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with safeckpt.CheckpointManager(run, preemption_signals=()) as mgr:
            assert mgr.restore(st) == 1
    assert st["version"] == 1.0
    assert any("step 2" in str(w.message) for w in caught)
    data.write_bytes(bytes(raw[:-100]))  # truncated: even the shallow check fails
    report = safeckpt.verify(f"{run}/step-0000000002", deep=False)
    assert not report.ok and "manifest says" in report.problems[0]
    data.unlink()
    report = safeckpt.verify(f"{run}/step-0000000002", deep=False)
    assert not report.ok and "missing file" in report.problems[0]


def test_lease_refuses_a_second_writer(tmp_path):
    run = _url(tmp_path / "run")
    a = safeckpt.CheckpointManager(run, preemption_signals=())
    b = safeckpt.CheckpointManager(run, preemption_signals=())
    a.save(1, _state(1.0))
    with pytest.raises(safeckpt.CheckpointLocked, match="another job"):
        b.save(2, _state(2.0))
    assert cli.main(["gc", run]) == safeckpt.CheckpointLocked.exit_code  # a live writer: gc refuses
    a.close()
    assert not (tmp_path / "run" / ".safeckpt.lock").exists()
    b.save(2, _state(2.0))
    b.close()
    assert [i.step for i in safeckpt.CheckpointManager(run, preemption_signals=()).list()] == [1, 2]


def test_missing_fsspec_or_scheme_is_a_clear_error(monkeypatch):
    with pytest.raises(safeckpt.CheckpointError, match="nosuchscheme"):
        safeckpt.CheckpointManager("nosuchscheme://bucket/run", preemption_signals=())
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if it were not installed
    with pytest.raises(safeckpt.CheckpointError, match=r"safeckpt\[remote\]"):
        safeckpt.CheckpointManager("s3://bucket/run", preemption_signals=())
    with pytest.raises(safeckpt.CheckpointError, match=r"safeckpt\[remote\]"):
        safeckpt.read_state_dict("s3://bucket/run/step-0000000001")


def test_file_urls_stay_local(tmp_path):
    safeckpt.save(f"file://{tmp_path}/ck", _state(1.0))
    assert sorted(os.listdir(tmp_path / "ck")) == [MANIFEST, "rank-00000.safetensors"]
    assert _model_value(str(tmp_path / "ck")) == 1.0


def _import_graph() -> dict[str, set[str]]:
    """Module (dotted, under safeckpt) -> the safeckpt modules it imports (at module level or
    inside functions; a package's ``__init__`` counts as the package)."""
    import ast

    pkg = Path(safeckpt.__file__).parent
    names = {}
    for f in pkg.rglob("*.py"):
        parts = ["safeckpt", *f.relative_to(pkg).with_suffix("").parts]
        names[f] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    known = set(names.values())
    graph: dict[str, set[str]] = {}
    for f, mod in names.items():
        here = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                target = f"{base}.{node.module}" if node.module else base
                deps |= {t for t in (target, *(f"{target}.{a.name}" for a in node.names)) if t in known}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]:
                    deps |= {a.name} & known
        graph[mod] = deps - {mod, "safeckpt"}
    return graph


def test_storage_layer_imports_nothing_above_it_and_the_package_has_no_import_cycle():
    graph = _import_graph()
    storage = [m for m in graph if m.startswith("safeckpt.storage")]
    assert len(storage) >= 8, storage
    for mod in storage:
        above = {d for d in graph[mod] if not d.startswith(("safeckpt.storage", "safeckpt.format", "safeckpt.errors",
                                                            "safeckpt._settings", "safeckpt._humanize"))}
        assert not above, (mod, above)
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, f"import cycle: {' -> '.join(path + [d])}"
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_sweep_and_listing_are_best_effort_when_the_store_refuses(tmp_path, monkeypatch):
    """A leftover the store refuses to delete, or uploads the credentials may not list, never
    fail a save or a listing: a warning says what is left behind."""
    from safeckpt.storage.base import StorageError

    run = _url(tmp_path / "run")
    with safeckpt.CheckpointManager(run, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(1, _state(1.0))
    stray = tmp_path / "run" / "step-0000000002" / "rank-00000.0123456789ab.safetensors"
    stray.parent.mkdir()
    stray.write_bytes(b"x" * 10)
    real_delete = FsspecStorage.delete

    def refusing(self, path):
        if path.endswith(stray.name):
            raise StorageError("deleting: access denied (simulated)")
        real_delete(self, path)

    def no_uploads(self, prefix):
        raise StorageError("listing unfinished uploads: access denied (simulated)")

    monkeypatch.setattr(FsspecStorage, "delete", refusing)
    monkeypatch.setattr(FsspecStorage, "uploads", no_uploads)
    with pytest.warns(safeckpt.SafeckptWarning) as caught, \
            safeckpt.CheckpointManager(run, keep_last=None, preemption_signals=()) as mgr:
        mgr.save(3, _state(3.0))
        assert [i.step for i in mgr.list()] == [1, 3]
    text = " ".join(str(w.message) for w in caught)
    assert "could not remove the leftover" in text and "cannot list unfinished uploads" in text
    assert stray.exists()


def test_a_server_that_ignores_range_requests_still_serves_a_checkpoint(tmp_path):
    """Python's http.server answers a ranged GET with the whole object: the reader takes the
    part it asked for (the object has the size the manifest says) instead of a 'short read'."""
    import functools
    import http.server
    import threading

    pytest.importorskip("aiohttp")
    safeckpt.save(tmp_path / "ck", {"w": torch.arange(1000.0), "m": {"a": 1}})

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/ck"
        flat = safeckpt.read_state_dict(url)
        assert torch.equal(flat["w"], torch.arange(1000.0)) and flat["m/a"] == 1
        assert safeckpt.verify(url).ok
    finally:
        srv.shutdown()
