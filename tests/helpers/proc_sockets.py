"""Count this process's open sockets (Linux ``/proc``): what a process group or store client
added. Used by tests/test_format3.py and bench/bench_scale.py."""

from __future__ import annotations

import os


def open_sockets() -> int:
    """How many of this process's file descriptors are sockets."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n
