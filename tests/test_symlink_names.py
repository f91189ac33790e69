"""No component of a name a manifest lists is followed if it is a symlink (issue 27, item 6).

A ``written`` name ``d/hostname`` whose directory ``d`` was replaced by a symlink to a directory
outside the checkpoint (``d -> /etc``) used to be checked through the link: O_NOFOLLOW guards
only the last component and ``Storage.size`` stat'ed through links, so verify reported the size
of a file outside the checkpoint and, when the size matched, hashed it and reported the
checkpoint as intact. Here the outside file has the very bytes the manifest recorded, so only
following no link at all tells the two apart.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import safeckpt
from safeckpt import CheckpointManager
from safeckpt.engine.extra import verify_files
from safeckpt.storage.posix import PosixStorage

pytestmark = pytest.mark.timeout(120)

PAYLOAD = b"node-17.cluster.example\n" * 40
DEEP = b"deep file " * 100


def _write(staging: str) -> list[str]:
    os.makedirs(os.path.join(staging, "d", "e"))
    with open(os.path.join(staging, "d", "hostname"), "wb") as f:
        f.write(PAYLOAD)
    with open(os.path.join(staging, "d", "e", "f"), "wb") as f:
        f.write(DEEP)
    return ["d/hostname", "d/e/f"]


@pytest.fixture
def ckpt(tmp_path) -> str:
    with CheckpointManager(str(tmp_path / "root"), keep_last=None, preemption_signals=()) as mgr:
        info = mgr.save(1, {"w": torch.arange(6.0)}, extra_files={"note.json": b"{}"}, write_files=_write)
    assert safeckpt.verify(info.path).ok
    with open(os.path.join(info.path, "manifest.json")) as f:
        assert sorted(json.load(f)["written"]) == ["d/e/f", "d/hostname"]
    return info.path


def _outside(tmp_path, name: str, files: dict[str, bytes]) -> str:
    """A directory outside the checkpoint holding ``files`` (relative name -> bytes)."""
    where = tmp_path / name
    for rel, data in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_bytes(data)
    return str(where)


def _link_dir(ckpt: str, rel: str, target: str) -> None:
    shutil.rmtree(os.path.join(ckpt, rel))
    os.symlink(target, os.path.join(ckpt, rel))


def test_verify_follows_no_symlinked_directory_of_a_written_name(ckpt, tmp_path) -> None:
    # d -> a directory outside holding the very same bytes under the same names
    _link_dir(ckpt, "d", _outside(tmp_path, "etc", {"hostname": PAYLOAD, "e/f": DEEP}))
    for deep in (True, False):
        report = safeckpt.verify(ckpt, deep=deep)
        assert not report.ok, f"deep={deep}: verify read through the symlink d"
        assert any("d/hostname" in p for p in report.problems), report.problems
        assert any("d/e/f" in p for p in report.problems), report.problems
    store = PosixStorage()
    assert store.size(os.path.join(ckpt, "d", "hostname")) is None
    with pytest.raises(safeckpt.CorruptCheckpoint, match="symlink"):
        store.hash(os.path.join(ckpt, "d", "hostname"))
    # the collective check a caller runs before reading the files with another reader
    with pytest.raises(safeckpt.CorruptCheckpoint):
        verify_files(ckpt)


def test_a_symlink_deeper_in_the_name_is_not_followed_either(ckpt, tmp_path) -> None:
    _link_dir(ckpt, "d/e", _outside(tmp_path, "elsewhere", {"f": DEEP}))
    report = safeckpt.verify(ckpt, deep=True)
    assert not report.ok
    assert [p for p in report.problems if "d/e/f" in p], report.problems
    assert not [p for p in report.problems if "d/hostname" in p], report.problems  # intact
    with pytest.raises(safeckpt.CorruptCheckpoint, match="symlink"):
        PosixStorage().hash(os.path.join(ckpt, "d", "e", "f"))
    # the last component as a link (guarded before): still refused
    os.unlink(os.path.join(ckpt, "d", "hostname"))
    os.symlink(os.path.join(_outside(tmp_path, "x", {"h": PAYLOAD}), "h"), os.path.join(ckpt, "d", "hostname"))
    assert PosixStorage().size(os.path.join(ckpt, "d", "hostname")) is None
    assert any("d/hostname" in p for p in safeckpt.verify(ckpt).problems)


def test_links_above_the_checkpoint_are_the_users_and_still_work(ckpt, tmp_path) -> None:
    """A root reached through a symlink (``/ckpt -> /mnt/nfs/run``) is not a name in a
    manifest: checkpoints under it verify, load and report sizes as before."""
    link = tmp_path / "via-link"
    os.symlink(os.path.dirname(ckpt), link)
    through = os.path.join(str(link), os.path.basename(ckpt))
    assert safeckpt.verify(through, deep=True).ok
    assert PosixStorage().size(os.path.join(through, "d", "hostname")) == len(PAYLOAD)
    verify_files(through)
    state = {"w": torch.zeros(6)}
    safeckpt.load(through, state)
    assert torch.equal(state["w"], torch.arange(6.0))
