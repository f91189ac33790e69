"""moto's S3 server, with ranged GETs served in O(range) as S3 serves them.

moto 5.2.5 answers ``GET`` with ``Range: bytes=a-b`` by reading the *whole* object from its
buffer and slicing it, so each ranged request costs the full object (a 1 KiB range of a 256 MiB
object took 0.25-0.55 s on the dev VM). That penalises any client that reads by ranges, which is
what S3 clients do to read in parallel. This launcher changes only that: for a single
``bytes=a-b`` range the response body reads just those bytes from the object's buffer (under the
object's lock). Everything else is moto unchanged. ``bench/bench_s3.py`` reports results against
both servers.

Usage: ``python bench/moto_ranged.py -H 127.0.0.1 -p PORT`` (moto.server's arguments).
"""

from __future__ import annotations

import re
import sys
from typing import Any

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")


class _RangedBody:
    """What ``_handle_range_header`` needs of a body: its length and one slice."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, s: slice) -> bytes:
        start, stop, _ = s.indices(len(self))
        with self.key.lock:
            buf = self.key._value_buffer
            buf.seek(start)
            return buf.read(max(0, stop - start))


def patch() -> None:
    """While a GET with one ``bytes=a-b`` range is answered (on this server thread), the
    object's ``value`` is a lazy body from which moto's range handling takes its slice."""
    import threading

    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    local = threading.local()
    whole = FakeKey.value

    def value(self: Any) -> Any:
        return _RangedBody(self) if getattr(local, "ranged", False) else whole.fget(self)

    FakeKey.value = property(value, whole.fset)  # type: ignore[method-assign, assignment]
    real = S3Response.get_object

    def get_object(self: Any) -> Any:
        local.ranged = bool(_RANGE.match(self.headers.get("range") or ""))
        try:
            return real(self)
        finally:
            local.ranged = False

    S3Response.get_object = get_object  # type: ignore[method-assign]


if __name__ == "__main__":
    patch()
    from moto.server import main

    main(sys.argv[1:])
