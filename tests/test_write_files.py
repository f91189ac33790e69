"""Files every rank writes itself into a save (``CheckpointManager.save(write_files=...)``).

Two ranks on gloo: each rank's files are published with the one atomic commit and listed in the
manifest with their size and checksum; a rank killed in the middle of writing its files leaves
nothing visible; a damaged file is found by verify and by the collective check a caller runs
before reading the files (CorruptCheckpoint on every rank).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import safeckpt
from safeckpt import CheckpointManager
from tests.helpers import dist_harness

pytestmark = pytest.mark.timeout(180)


def _payload(rank: int, step: int) -> bytes:
    return bytes((rank * 31 + step + i) % 251 for i in range(5000 + 1000 * rank))


def _hook(rank: int, step: int, die: bool = False):  # noqa: ANN202
    def write(staging: str) -> list[str]:
        os.makedirs(os.path.join(staging, "engine", f"r{rank}"), exist_ok=True)
        name = f"engine/r{rank}/part.bin"
        data = _payload(rank, step)
        with open(os.path.join(staging, name), "wb") as f:
            if die and rank == 1:
                f.write(data[: len(data) // 2])
                f.flush()
                os._exit(9)  # killed in the middle of writing its file
            f.write(data)
        names = [name]
        if rank == 0:
            with open(os.path.join(staging, "latest"), "w") as f:
                f.write(f"global_step{step}")
            names.append("latest")
        return names
    return write


def _state(step: int) -> dict:
    return {"w": torch.full((4, 3), float(step)), "meta": {"step": step}}


def _save_two(rank: int, world: int, root: str) -> dict:
    with CheckpointManager(root, keep_last=None) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step), extra_files={"note.json": b"{}"}, write_files=_hook(rank, step))
        return {"steps": [i.step for i in mgr.list()]}


def _kill_in_write(rank: int, world: int, root: str) -> dict:
    with CheckpointManager(root, keep_last=None) as mgr:
        mgr.save(1, _state(1), write_files=_hook(rank, 1))
        return dist_harness.attempt(lambda: mgr.save(2, _state(2), write_files=_hook(rank, 2, die=True)))


def _restore_and_check(rank: int, world: int, root: str, names: list[str]) -> dict:
    from safeckpt.engine.extra import verify_files

    with CheckpointManager(root, keep_last=None) as mgr:
        state = _state(0)
        step = mgr.restore(state)
        ckpt = mgr.latest().path
        return {"step": step, "w": float(state["w"][0, 0]),
                "check": dist_harness.attempt(lambda: verify_files(ckpt, names))}


def test_every_rank_writes_its_files_into_the_commit(tmp_path) -> None:
    root = str(tmp_path / "run")
    out = dist_harness.run(_save_two, 2, root, timeout=120)
    assert all(o.ok for o in out), [o.message for o in out]
    assert out[0].value["steps"] == [1, 2]
    ckpt = os.path.join(root, "step-0000000002")
    with open(os.path.join(ckpt, "manifest.json")) as f:
        man = json.load(f)
    # one record per file, each from the rank that wrote it; the coordinator's own file in extra
    assert sorted(man["written"]) == ["engine/r0/part.bin", "engine/r1/part.bin", "latest"]
    assert sorted(man["extra"]) == ["note.json"]
    written = man["written"]
    for rank in (0, 1):
        with open(os.path.join(ckpt, "engine", f"r{rank}", "part.bin"), "rb") as f:
            assert f.read() == _payload(rank, 2)
        assert written[f"engine/r{rank}/part.bin"]["size"] == len(_payload(rank, 2))
    assert safeckpt.verify(ckpt, deep=True).ok
    assert not dist_harness.leftovers(root)

    # damage one rank's file (same size): verify names it; the collective check raises
    # CorruptCheckpoint on every rank, so a caller falls back together
    path = os.path.join(ckpt, "engine", "r1", "part.bin")
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    report = safeckpt.verify(ckpt, deep=True)
    assert not report.ok and any("engine/r1/part.bin" in p for p in report.problems), report.problems
    assert safeckpt.verify(ckpt, deep=False).ok  # same size: only the checksum tells
    out = dist_harness.run(_restore_and_check, 2, root, sorted(written), timeout=120)
    assert all(o.ok for o in out), [o.message for o in out]
    for o in out:
        assert o.value["step"] == 2 and o.value["w"] == 2.0
        assert not o.value["check"]["ok"]
        assert "CorruptCheckpoint" in o.value["check"]["mro"], o.value["check"]
        assert "engine/r1/part.bin" in o.value["check"]["msg"]


def test_a_rank_killed_while_writing_its_files_leaves_nothing_visible(tmp_path) -> None:
    root = str(tmp_path / "run")
    out = dist_harness.run(_kill_in_write, 2, root, timeout=120)
    assert out[1].exitcode == 9
    assert out[0].ok and not out[0].value["ok"], out[0].value
    assert "RankFailure" in out[0].value["mro"]
    assert not os.path.exists(os.path.join(root, "step-0000000002"))
    assert not dist_harness.leftovers(root)  # the coordinator removed the staging directory
    with CheckpointManager(root) as mgr:
        assert [i.step for i in mgr.list()] == [1]


def test_write_files_is_refused_where_it_cannot_be_atomic(tmp_path) -> None:
    with CheckpointManager(str(tmp_path / "a"), async_save=True) as mgr, \
            pytest.raises(safeckpt.CheckpointError, match="write_files"):
        mgr.save(1, _state(1), write_files=_hook(0, 1))
    bad = lambda staging: ["../escape"]  # noqa: E731
    with CheckpointManager(str(tmp_path / "b")) as mgr:
        with pytest.raises(safeckpt.CheckpointError, match="escape"):
            mgr.save(1, _state(1), write_files=bad)
        assert mgr.list() == []

    def unreported(staging: str) -> list[str]:
        for name in ("a.bin", "b.bin"):
            with open(os.path.join(staging, name), "wb") as f:
                f.write(b"x")
        return ["a.bin"]  # b.bin would be published unchecked
    with CheckpointManager(str(tmp_path / "c")) as mgr:
        with pytest.raises(safeckpt.CheckpointError, match="no rank reported.*b.bin"):
            mgr.save(1, _state(1), write_files=unreported)
        assert mgr.list() == []
