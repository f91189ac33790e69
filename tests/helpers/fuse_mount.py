"""A real FUSE filesystem for tests: ``bindfs SRC MNT`` mirrors a directory through FUSE.

FUSE (like NFS and CephFS) answers EINVAL to ``renameat2``'s ``RENAME_NOREPLACE`` and
``RENAME_EXCHANGE``, so on such a mount safeckpt takes its fallback paths (two renames for an
overwrite). :func:`bindfs_mount` mounts one and always unmounts it; :func:`unavailable` says why
no mount can be made here (no ``bindfs`` binary, no ``/dev/fuse``, no ``fusermount``, or the
mount itself refused, e.g. in a container without the FUSE capability), so tests skip with that
reason. Debian/Ubuntu: ``apt-get install bindfs`` (CI's ``.ci/run`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

MOUNT_TIMEOUT = 30.0  # seconds for bindfs to mount or fusermount to unmount


def unavailable() -> str | None:
    """Why no bindfs mount can be made on this machine, or None if the tools are there."""
    if shutil.which("bindfs") is None:
        return "bindfs is not installed (apt-get install bindfs)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if shutil.which("fusermount") is None and shutil.which("fusermount3") is None:
        return "fusermount is not installed (package fuse or fuse3)"
    return None


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f if len(line.split()) > 1)


def _unmount(mnt: str) -> None:
    tool = shutil.which("fusermount") or shutil.which("fusermount3") or "fusermount"
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while is_mounted(mnt):
        # busy right after a killed process's files close: retry, then detach lazily
        lazy = ["-z"] if time.monotonic() > deadline - 5 else []
        subprocess.run([tool, "-u", *lazy, mnt], capture_output=True, timeout=MOUNT_TIMEOUT)
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not unmount the bindfs mount {mnt}")
        if is_mounted(mnt):
            time.sleep(0.2)


@contextlib.contextmanager
def bindfs_mount(src: str, mnt: str) -> Iterator[str]:
    """Mount ``src`` at ``mnt`` through bindfs; yields ``mnt``; unmounts on exit. RuntimeError
    (with bindfs's own message) if the mount is refused."""
    os.makedirs(src, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    try:
        proc = subprocess.run(["bindfs", "--no-allow-other", src, mnt], capture_output=True,
                              text=True, timeout=MOUNT_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"bindfs did not mount {mnt} within {MOUNT_TIMEOUT:g}s") from exc
    if proc.returncode != 0 or not is_mounted(mnt):
        raise RuntimeError(f"bindfs {src} {mnt} failed (rc {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[:500]}")
    try:
        yield mnt
    finally:
        _unmount(mnt)
