"""A save's extra files (Trainer's ``trainer_state.json``) on S3: the manifest PUT is the one
commit point, with the coordinator really killed (``os._exit``) on either side of it.

- Killed after the extras are PUT and before the manifest: nothing committed is visible (the
  previous step is listed and restored), the plain-named extra is recognised as a leftover by
  its save's sidecar (not "foreign": the next save to the same path may write there), and the
  next save's sweep removes it.
- Killed right after the manifest PUT: the checkpoint is complete and verifies (before the
  extras were put before the manifest, they were missing here); ``safeckpt gc`` removes only
  the save's sidecar, never a file the manifest names.
"""

from __future__ import annotations

import json
import os

import pytest

import safeckpt
from safeckpt import cli
from safeckpt.storage import commit as _commit
from safeckpt.storage.base import storage_for
from tests.helpers import dist_harness, s3_harness
from tests.test_remote import _state

pytest.importorskip("s3fs")
pytest.importorskip("moto")

pytestmark = pytest.mark.timeout(300)

BUCKET = "extras"
KILLED = 17  # the coordinator's exit status at the injected crash


@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def endpoint(request):
    """moto's S3 server and SeaweedFS (a real S3 server enforcing conditional writes)."""
    with s3_harness.server(request.param) as ep:
        s3_harness.make_bucket(ep, BUCKET)
        yield ep


def _trainer_state(step: int) -> bytes:
    return json.dumps({"global_step": step}).encode()


def _die_at_publish(after: bool) -> None:
    """Patch this (coordinator) process: it exits at the manifest PUT, before or after it."""
    real = _commit.publish

    def dying(*args, **kwargs):
        if after:
            real(*args, **kwargs)
        os._exit(KILLED)

    _commit.publish = dying


def _save_then_die(rank: int, world: int, ep: str, root: str, after: bool) -> None:
    mgr = safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=(), timeout=15,
                                     storage_options=s3_harness.options(ep))
    mgr.save(1, _state(1.0, rank), extra_files={"trainer_state.json": _trainer_state(1)})
    if rank == 0:
        _die_at_publish(after)
    mgr.save(2, _state(2.0, rank), extra_files={"trainer_state.json": _trainer_state(2)})


def _resume_and_save_again(rank: int, world: int, ep: str, root: str) -> dict:
    with safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=(),
                                    storage_options=s3_harness.options(ep)) as mgr:
        restored = mgr.restore(_state(0.0, rank))
        mgr.save(2, _state(2.0, rank), extra_files={"trainer_state.json": _trainer_state(2)})
        return {"restored": restored, "listed": [i.step for i in mgr.list()]}


def _crash(ep: str, root: str, *, after: bool) -> None:
    outs = dist_harness.run(_save_then_die, 2, ep, root, after, timeout=120)
    assert outs[0].exitcode == KILLED, (outs[0].exitcode, outs[0].message)
    assert not outs[1].ok and outs[1].raised("CheckpointError"), outs[1].message


def _names(ep: str, prefix: str) -> list[str]:
    fs = s3_harness.s3fs_for(ep)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix, refresh=True))


def _cli(capsys, ep: str, *args: str) -> tuple[int, str]:
    opts = [f"endpoint_url={ep}", "key=testing", "secret=testing", "client_kwargs.region_name=us-east-1"]
    code = cli.main([x for o in opts for x in ("--storage-option", o)] + list(args))
    return code, capsys.readouterr().out


def test_killed_before_the_manifest_put_leaves_nothing_visible_and_a_leftover_the_next_save_sweeps(endpoint):
    root = f"s3://{BUCKET}/before"
    step2 = f"{root}/step-0000000002"
    _crash(endpoint, root, after=False)

    left = _names(endpoint, f"{BUCKET}/before/step-0000000002")
    assert "manifest.json" not in left and "trainer_state.json" in left, left  # the extras went first
    sidecars = [n for n in left if _commit.EXTRAS_FILE.match(n)]
    assert len(sidecars) == 1, left
    opts = s3_harness.options(endpoint)
    reader = safeckpt.CheckpointManager(root, preemption_signals=(), storage_options=opts)
    assert [i.step for i in reader.list()] == [1] and reader.latest().step == 1
    # Not foreign: a save to that path may begin there (it used to refuse, forever).
    store = storage_for(step2, opts)
    _commit.begin(store, step2, overwrite=False)

    outs = dist_harness.run(_resume_and_save_again, 2, endpoint, root, timeout=120)
    for o in outs:
        assert o.ok, o.message
        assert o.value == {"restored": 1, "listed": [1, 2]}, o.value
    now = _names(endpoint, f"{BUCKET}/before/step-0000000002")
    assert not [n for n in now if _commit.EXTRAS_FILE.match(n)], now  # swept, and the new one deleted
    assert len(now) == 4 and {"manifest.json", "trainer_state.json"} < set(now), now
    assert not set(now) & {n for n in left if n.startswith("rank-")}, (left, now)  # the dead save's data
    report = safeckpt.verify(step2, storage_options=opts)
    assert report.ok, report.problems
    assert s3_harness.s3fs_for(endpoint).cat_file(f"{BUCKET}/before/step-0000000002/trainer_state.json") == \
        _trainer_state(2)


def test_killed_right_after_the_manifest_put_leaves_a_complete_checkpoint(endpoint, capsys):
    root = f"s3://{BUCKET}/after"
    step2 = f"{root}/step-0000000002"
    _crash(endpoint, root, after=True)

    opts = s3_harness.options(endpoint)
    report = safeckpt.verify(step2, storage_options=opts)
    assert report.ok, report.problems  # before the fix: "trainer_state.json" missing
    reader = safeckpt.CheckpointManager(root, preemption_signals=(), storage_options=opts)
    assert [i.step for i in reader.list()] == [1, 2]
    left = _names(endpoint, f"{BUCKET}/after/step-0000000002")
    sidecars = [n for n in left if _commit.EXTRAS_FILE.match(n)]
    assert len(sidecars) == 1, left  # the coordinator died before deleting it

    # `safeckpt gc` removes the sidecar alone (the dead job's lease is stale).
    code, out = _cli(capsys, endpoint, "gc", root)
    assert code == 0 and "removed step-0000000002" in out, out
    assert _names(endpoint, f"{BUCKET}/after/step-0000000002") == sorted(set(left) - set(sidecars))
    report = safeckpt.verify(step2, storage_options=opts)
    assert report.ok, report.problems
    code, out = _cli(capsys, endpoint, "ls", root, "--json")
    assert [(r["name"], r["status"]) for r in json.loads(out)["entries"]] == [
        ("step-0000000001", "committed"), ("step-0000000002", "committed")]


def test_object_store_overwrite_and_retention_leave_no_extra_file_behind():
    """memory:// (an object store in this process): re-saving a committed step replaces its
    extras (after the manifest: no sidecar) and drops the ones only the old manifest listed;
    retention deletes a checkpoint's extras with its data (they used to stay, a manifest-less
    prefix holding a plain-named object)."""
    import fsspec

    root = "memory://extras-overwrite/run"
    fs = fsspec.filesystem("memory")

    def names(step: int) -> list[str]:
        prefix = f"/extras-overwrite/run/step-{step:010d}"
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix, detail=False)) if fs.exists(prefix) else []

    with safeckpt.CheckpointManager(root, keep_last=1, preemption_signals=()) as mgr:
        mgr.save(1, _state(1.0), extra_files={"old.json": b"{}", "trainer_state.json": _trainer_state(0)})
        mgr.save(1, _state(1.0), extra_files={"trainer_state.json": _trainer_state(1)})
        got = names(1)
        assert [n for n in got if not n.startswith("rank-")] == ["manifest.json", "trainer_state.json"], got
        assert safeckpt.verify(f"{root}/step-0000000001").ok
        mgr.save(2, _state(2.0), extra_files={"trainer_state.json": _trainer_state(2)})
    assert names(1) == [] and len(names(2)) == 3, (names(1), names(2))


def _overwrite_with_failing_extras(rank: int, world: int, ep: str, root: str) -> str | None:
    opts = s3_harness.options(ep)
    mgr = safeckpt.CheckpointManager(root, keep_last=None, preemption_signals=(), timeout=15,
                                     storage_options=opts)
    mgr.save(1, _state(1.0, rank), extra_files={"trainer_state.json": _trainer_state(1)})
    mgr.save(2, _state(2.0, rank), extra_files={"trainer_state.json": _trainer_state(2)})
    if rank == 0:  # the coordinator's extras PUT fails: on an overwrite it comes after the manifest
        def refused(*_args: object) -> None:
            raise OSError("injected: PUT refused")

        _commit._put_all = refused
    try:
        mgr.save(2, _state(3.0, rank), extra_files={"trainer_state.json": _trainer_state(3)})
    except safeckpt.CheckpointError as exc:
        return str(exc)
    return None


def test_overwrite_whose_extras_fail_after_the_manifest_says_it_published_an_incomplete_checkpoint(endpoint):
    root = f"s3://{BUCKET}/late"
    outs = dist_harness.run(_overwrite_with_failing_extras, 2, endpoint, root, timeout=120)
    for o in outs:
        assert o.ok, o.message
        msg = o.value
        assert msg is not None, "the save should fail on every rank"
        # before: the phase's failure hint, "No checkpoint was published; the previous one is intact"
        assert "was published" in msg and "incomplete" in msg and "No checkpoint was published" not in msg, msg
    opts = s3_harness.options(endpoint)
    report = safeckpt.verify(f"{root}/step-0000000002", storage_options=opts)
    assert not report.ok and any("trainer_state.json" in p for p in report.problems), report.problems
    outs = dist_harness.run(_resume_and_save_again, 2, endpoint, root, timeout=120)
    for o in outs:
        assert o.ok, o.message
        assert o.value["restored"] == 1, o.value  # the incomplete step 2 is skipped
