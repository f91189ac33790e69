"""safeckpt against a real S3 HTTP server (moto's, on 127.0.0.1) through s3fs, with 2 ranks.

Scenarios are packed into few multi-process runs (each costs a few seconds to start):

- run A: save/load bit-exact, manager save/restore/retention/async while this process polls
  ``latest()`` (never None once a checkpoint exists), a missing bucket, the endpoint dropped
  in the middle of an upload and restored, wrong credentials, a hung endpoint.
- runs B and C: ranks SIGKILLed mid-upload leave unfinished multipart uploads; the next job's
  sweep aborts them, and ``safeckpt gc`` aborts those of a second kill. The CLI with
  ``--storage-option`` (ls, verify, gc, convert, errors) runs on what they leave.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import safeckpt
from safeckpt import cli
from tests.helpers import dist_harness, s3_harness
from tests.test_remote import _state

pytest.importorskip("s3fs")
pytest.importorskip("moto")

SMALL_PART = 5 << 20  # S3's minimum part size: a rank's 12 MiB share is a 3-part multipart upload


@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def endpoint(request):
    """moto's S3 server and SeaweedFS (a real S3 server enforcing conditional writes)."""
    with s3_harness.server(request.param) as ep:
        yield ep


def _same(a: dict, b: dict) -> bool:
    return a["version"] == b["version"] and all(
        torch.equal(x, y) for x, y in zip(a["model"].state_dict().values(), b["model"].state_dict().values())
    ) and ("big" not in a or torch.equal(a["big"], b["big"]))


def _wait_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _wait_scans(sync_dir: Path, more: int, timeout: float = 120.0) -> None:
    """Block until the test's reader thread has scanned ``more`` more times, so every save in a
    window is watched however slowly ``latest()`` runs on a loaded machine."""
    def count() -> int:
        try:
            return int((sync_dir / "scans").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0
    goal = count() + more
    deadline = time.monotonic() + timeout
    while count() < goal:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the reader scanned fewer than {goal} times")
        time.sleep(0.02)


def _small_parts() -> None:
    from safeckpt.storage import s3 as _storage_s3

    _storage_s3.PART = SMALL_PART


def _kill_after_first_part() -> None:
    """Patch this worker: its next multipart upload SIGKILLs it once part 1 is stored."""
    from safeckpt.storage.s3 import MultipartWriter

    real = MultipartWriter.upload_part

    def dying(self, number, body):
        fut = real(self, number, body)
        fut.result()
        os.kill(os.getpid(), signal.SIGKILL)

    MultipartWriter.upload_part = dying


# --------------------------------------------------------------------------- run A


def _scenarios(rank: int, world: int, ep: str, proxy_ep: str, hung_ep: str, auth_ep: str, sync: str) -> dict:
    _small_parts()
    sync_dir = Path(sync)
    opts = s3_harness.options(ep)
    out: dict = {}

    # Plain save/load, bit-exact (the 8 MiB tensor is split over both ranks' files).
    st = _state(1.0, rank, mib=8)
    torch.manual_seed(100 + rank)
    safeckpt.save("s3://run-a/plain", st, storage_options=opts)
    expect_rand = torch.rand(3).tolist()
    st2 = _state(0.0, rank, mib=8)
    torch.manual_seed(999)
    safeckpt.load("s3://run-a/plain", st2, storage_options=opts)
    out["plain"] = _same(st, st2) and torch.rand(3).tolist() == expect_rand

    # Manager: retention keeps 1 while the test polls latest(); then async.
    root = "s3://run-a/run"
    with safeckpt.CheckpointManager(root, keep_last=1, preemption_signals=(), storage_options=opts) as mgr:
        out["fresh"] = mgr.restore(_state(0.0, rank))
        for s in range(1, 7):
            mgr.save(s, _state(float(s), rank), metrics={"loss": 1.0 / s})
            if rank == 0:  # the reader watches each retention deletion, however slow its scans
                _wait_scans(sync_dir, 5)
        out["listed"] = [i.step for i in mgr.list()]
    with safeckpt.CheckpointManager(root, keep_last=2, async_save=True, preemption_signals=(),
                                    storage_options=opts) as mgr:
        st3 = _state(0.0, rank)
        out["restored"] = mgr.restore(st3)
        out["restored_ok"] = _same(st3, _state(6.0, rank))
        mgr.save(7, _state(7.0, rank))  # background; close() waits for it
    out["after_async"] = [i.step for i in safeckpt.CheckpointManager(
        root, preemption_signals=(), storage_options=opts).list()]
    torch.distributed.barrier()  # both ranks are done saving before the reader stops
    if rank == 0:
        (sync_dir / "saves-done").touch()

    # A bucket that does not exist: a clear error on every rank, not a fresh start.
    out["missing_bucket"] = dist_harness.attempt(lambda: safeckpt.CheckpointManager(
        "s3://no-such-bucket/run", preemption_signals=(), storage_options=opts).restore(_state(0.0, rank)))

    # The endpoint goes away after rank 0 stored the first part of step 2, and comes back.
    popts = s3_harness.options(proxy_ep)
    with safeckpt.CheckpointManager("s3://run-a/outage", keep_last=None, preemption_signals=(),
                                    storage_options=popts, timeout=20) as mgr:
        mgr.save(1, _state(1.0, rank, mib=24))
        from safeckpt.storage.s3 import MultipartWriter

        real = MultipartWriter.upload_part

        def dropping(self, number, body):
            fut = real(self, number, body)
            if number == 1:
                fut.result()
                (sync_dir / "drop").touch()
                _wait_file(sync_dir / "dropped")
            return fut

        if rank == 0:
            MultipartWriter.upload_part = dropping
        t0 = time.monotonic()
        out["outage"] = dist_harness.attempt(lambda: mgr.save(2, _state(2.0, rank, mib=24)))
        out["outage_elapsed"] = time.monotonic() - t0
        MultipartWriter.upload_part = real
        if rank == 0:
            (sync_dir / "restore").touch()
        _wait_file(sync_dir / "restored")
        mgr.save(3, _state(3.0, rank, mib=24))
        out["after_outage"] = [i.step for i in mgr.list()]
        st4 = _state(0.0, rank, mib=24)
        safeckpt.load("s3://run-a/outage/step-0000000003", st4, storage_options=popts)
        out["after_outage_ok"] = _same(st4, _state(3.0, rank, mib=24))

    # Wrong credentials: one clear error.
    bad = s3_harness.options(auth_ep, key="wrong", secret="wrong")
    out["wrong_credentials"] = dist_harness.attempt(lambda: safeckpt.CheckpointManager(
        "s3://run-a/run", preemption_signals=(), storage_options=bad, timeout=30).restore(_state(0.0, rank)))

    # A hung endpoint: RankFailure on every rank within the timeout (6 s).
    out["hung"] = dist_harness.attempt(lambda: safeckpt.CheckpointManager(
        "s3://run-a/run", preemption_signals=(), storage_options=s3_harness.options(hung_ep),
        timeout=6).save(1, _state(1.0, rank)))
    return out


def _poll_latest(root: str, opts: dict, sync: Path, seen: list) -> None:
    ro = safeckpt.CheckpointManager(root, preemption_signals=(), storage_options=opts)
    deadline = time.monotonic() + 240
    while not (sync / "saves-done").exists() and time.monotonic() < deadline:
        try:
            info = ro.latest()
            seen.append(None if info is None else info.step)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen.append(f"{type(exc).__name__}: {exc}")
        (sync / "scans.tmp").write_text(str(len(seen)))
        os.replace(sync / "scans.tmp", sync / "scans")
        time.sleep(0.02)


def test_s3_two_ranks_roundtrip_retention_async_outage_credentials_hung(endpoint, tmp_path):
    s3_harness.make_bucket(endpoint, "run-a")
    sync = tmp_path / "sync"
    sync.mkdir()
    proxy = s3_harness.Proxy(endpoint)
    hung = s3_harness.HungServer(lifetime=240)
    seen: list = []
    reader = threading.Thread(target=_poll_latest, args=(
        "s3://run-a/run", s3_harness.options(endpoint), sync, seen), daemon=True)
    reader.start()

    def outage() -> None:  # drop the endpoint when rank 0 asks, restore it when asked
        _wait_file(sync / "drop", 200)
        proxy.drop()
        (sync / "dropped").touch()
        _wait_file(sync / "restore", 200)
        proxy.restore()
        (sync / "restored").touch()

    threading.Thread(target=outage, daemon=True).start()
    try:
        with s3_harness.auth_server() as auth:
            outs = dist_harness.run(_scenarios, 2, endpoint, proxy.endpoint, hung.endpoint, auth, str(sync),
                                    timeout=240)
    finally:
        proxy.close()
        hung.close()
        reader.join(10)
    # A concurrent reader never saw "no checkpoint" once one existed.
    first = next(i for i, s in enumerate(seen) if s is not None)
    assert all(isinstance(s, int) for s in seen[first:]), seen
    assert len(seen) - first > 20 and set(seen[first:]) >= {6, 7}, seen
    for o in outs:
        assert o.ok, o.message
        v = o.value
        assert v["plain"] and v["fresh"] is None
        assert v["listed"] == [6] and (v["restored"], v["restored_ok"]) == (6, True)
        assert v["after_async"] == [6, 7]

        mb = v["missing_bucket"]
        assert mb["type"] == "CheckpointNotFound" and "no-such-bucket" in mb["msg"] and "does not exist" in mb["msg"]

        out = v["outage"]  # the same type on both ranks, naming the storage failure
        assert out["type"] == "RankFailure", out
        assert "endpoint" in out["msg"] or "no answer" in out["msg"], out["msg"]
        # Within the timeout (20 s); rank 0 then spends a bounded while on the cleanup.
        assert v["outage_elapsed"] < (20 if o.rank else 20 + 2 * 5), v["outage_elapsed"]
        assert v["after_outage"] == [1, 3] and v["after_outage_ok"]  # step 2 never committed

        wc = v["wrong_credentials"]
        assert wc["type"] == "RankFailure" and "access denied" in wc["msg"] and "credentials" in wc["msg"], wc
        assert "Traceback" not in wc["msg"] and len(wc["msg"].splitlines()) <= 4

        hg = v["hung"]
        assert hg["type"] == "RankFailure" and "no answer" in hg["msg"], hg
        assert hg["elapsed"] < 6 + 3, hg["elapsed"]  # the timeout, plus setting up its gloo group
    # The failed step 2's data objects and unfinished upload were removed by the next save's sweep.
    fs = s3_harness.s3fs_for(endpoint)
    assert s3_harness.uploads(endpoint, "run-a", "outage/") == []
    names = [p.rsplit("/", 1)[-1] for p in fs.ls("run-a/outage")]
    assert names == ["step-0000000001", "step-0000000003"]


# --------------------------------------------------------------------------- runs B, C + CLI


def _kill_mid_upload(rank: int, world: int, ep: str, root: str) -> None:
    _small_parts()
    mgr = safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=(),
                                     storage_options=s3_harness.options(ep))
    mgr.save(1, _state(1.0, rank, mib=24))
    _kill_after_first_part()
    mgr.save(2, _state(2.0, rank, mib=24))


def _resume_sweep_then_die(rank: int, world: int, ep: str, root: str, report: str) -> None:
    _small_parts()
    mgr = safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=(),
                                     storage_options=s3_harness.options(ep))
    st = _state(0.0, rank, mib=24)
    res = {"restored": mgr.restore(st), "ok": _same(st, _state(1.0, rank, mib=24))}
    mgr.save(2, _state(2.0, rank, mib=24))  # its sweep aborts the killed job's uploads first
    res["uploads_after_save"] = len(s3_harness.uploads(ep, "run-b"))
    Path(f"{report}.{rank}").write_text(json.dumps(res))
    torch.distributed.barrier()
    _kill_after_first_part()
    mgr.save(3, _state(3.0, rank, mib=24))


def _cli(capsys, ep: str, *args: str) -> tuple[int, str, str]:
    opts = [f"endpoint_url={ep}", "key=testing", "secret=testing", "client_kwargs.region_name=us-east-1"]
    code = cli.main([x for o in opts for x in ("--storage-option", o)] + list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_s3_killed_uploads_are_aborted_by_sweep_and_gc_and_cli(endpoint, tmp_path, capsys, monkeypatch):
    s3_harness.make_bucket(endpoint, "run-b")
    root = "s3://run-b/run"
    outs = dist_harness.run(_kill_mid_upload, 2, endpoint, root, timeout=120)
    assert [o.exitcode for o in outs] == [-signal.SIGKILL] * 2, [(o.exitcode, o.message) for o in outs]
    orphans = s3_harness.uploads(endpoint, "run-b")
    assert sorted(u["Key"].split("/")[1] for u in orphans) == ["step-0000000002"] * 2
    assert [u["Key"].rsplit("/", 1)[1][:10] for u in sorted(orphans, key=lambda u: u["Key"])] == [
        "rank-00000", "rank-00001"]
    code, out, _ = _cli(capsys, endpoint, "ls", root, "--json")
    rows = {r["name"]: r for r in json.loads(out)["entries"] if r["status"].startswith("staging")}
    assert code == 0 and rows["step-0000000002"]["nbytes"] >= 2 * SMALL_PART  # the parts are counted

    report = str(tmp_path / "report")
    outs = dist_harness.run(_resume_sweep_then_die, 2, endpoint, root, report, timeout=120)
    assert [o.exitcode for o in outs] == [-signal.SIGKILL] * 2, [(o.exitcode, o.message) for o in outs]
    for r in (0, 1):
        res = json.loads(Path(f"{report}.{r}").read_text())
        assert res == {"restored": 1, "ok": True, "uploads_after_save": 0}, res
    orphans = s3_harness.uploads(endpoint, "run-b")
    assert sorted(u["Key"].split("/")[1] for u in orphans) == ["step-0000000003"] * 2

    # `safeckpt gc` aborts them (the dead job's lease is stale); nothing committed is touched.
    code, out, err = _cli(capsys, endpoint, "gc", root)
    assert code == 0 and "removed step-0000000003" in out, (out, err)
    assert s3_harness.uploads(endpoint, "run-b") == []
    code, out, _ = _cli(capsys, endpoint, "ls", root, "--json")
    assert [(r["name"], r["status"]) for r in json.loads(out)["entries"]] == [
        ("step-0000000001", "committed"), ("step-0000000002", "committed")]
    code, out, _ = _cli(capsys, endpoint, "verify", f"{root}/step-0000000002")
    assert code == 0 and "OK" in out
    assert safeckpt.read_state_dict(f"{root}/step-0000000002", storage_options=s3_harness.options(endpoint))[
        "version"] == 2.0

    # convert: a remote source exports; an import source must be local, said plainly.
    code, out, err = _cli(capsys, endpoint, "convert", f"{root}/step-0000000002", str(tmp_path / "hf"), "--to", "hf")
    assert code == 0 and (tmp_path / "hf" / "model.safetensors").exists(), err
    code, out, err = _cli(capsys, endpoint, "convert", f"{root}/step-0000000002", str(tmp_path / "x"),
                          "--from", "dcp")
    assert code == 2 and "local paths only" in err and err.count("\n") == 1, err

    # Errors are one line with the storage's meaning.
    code, out, err = _cli(capsys, endpoint, "ls", "s3://no-such-bucket/run")
    assert code == 2 and "no-such-bucket" in err and "does not exist" in err and err.count("\n") == 1, err
    code, out, err = _cli(capsys, endpoint, "--storage-option", "nonsense", "ls", root)
    assert code == 2 and "KEY=VALUE" in err and err.count("\n") == 1, err
    torch.save({"w": torch.arange(4.0)}, tmp_path / "plain.pt")  # an import into the bucket
    code, out, err = _cli(capsys, endpoint, "convert", str(tmp_path / "plain.pt"), f"{root}-imported",
                          "--from", "torch-save", "--allow-pickle")
    assert code == 0, err
    assert torch.equal(safeckpt.read_state_dict(f"{root}-imported", storage_options=s3_harness.options(endpoint))[
        "model/w"], torch.arange(4.0))

    # No credentials anywhere: a StorageError (a CheckpointError) saying where to put them,
    # from the library and as one line from the CLI; never botocore's own exception.
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bare = {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    mgr = safeckpt.CheckpointManager(root, preemption_signals=(), storage_options=bare)
    with pytest.raises(safeckpt.CheckpointError, match="no credentials") as exc_info:
        mgr.list()
    assert "storage_options" in str(exc_info.value) and "AWS_ACCESS_KEY_ID" in str(exc_info.value)
    with pytest.raises(safeckpt.CheckpointError, match="no credentials"):
        safeckpt.read_state_dict(f"{root}/step-0000000002", storage_options=bare)
    report = safeckpt.verify(f"{root}/step-0000000002", storage_options=bare)
    assert not report.ok and "no credentials" in report.problems[0]
    code = cli.main(["--storage-option", f"endpoint_url={endpoint}", "ls", root])
    out, err = capsys.readouterr()
    assert code == 74 and "no credentials" in err and err.count("\n") == 1, err
