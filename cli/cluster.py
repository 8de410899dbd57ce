"""A relay tree on one machine: an origin and relays as subprocesses on loopback ports.

The demo, the end-to-end tests and the benchmark run the real servers this way:
``python -m deltasync.server.cli origin|relay --listen 127.0.0.1:0 ...``, each its own
process (this module starts them; it never imports the server package). The port
each server picked is read from its log line ``listening on http://HOST:PORT``.
Processes are stopped by pid: SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_LISTENING = re.compile(r"listening on (https?://[^\s,()]+)")
RETENTION = 16  # versions each server keeps


@dataclass(slots=True, kw_only=True)
class ServerProcess:
    """One running server."""

    name: str
    role: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    data_dir: Path

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def start_server(role: str, name: str, root: Path, args: Sequence[str], *, timeout: float = 30.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``deltasync.server.cli ROLE ARGS`` (``env``: extra environment, e.g. S3 credentials) and wait for
    its listening line."""
    return _wait_listening(*_spawn(role, name, root, args, env=env), timeout=timeout)


def _spawn(role: str, name: str, root: Path, args: Sequence[str], *, env: dict[str, str] | None = None):
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / f"{name}.log"
    argv = [sys.executable, "-m", "deltasync.server.cli", role, *args]
    logf = open(log_path, "wb")
    try:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    finally:
        logf.close()
    return role, name, root, proc, log_path


def _wait_listening(role: str, name: str, root: Path, proc: subprocess.Popen, log_path: Path, *,
                    timeout: float = 30.0) -> ServerProcess:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        m = _LISTENING.search(text)
        if m:
            return ServerProcess(name=name, role=role, url=m.group(1).rstrip("/"), proc=proc, log_path=log_path,
                                 data_dir=root / name)
        if proc.poll() is not None:
            raise RuntimeError(f"{role} {name} exited with {proc.returncode} before listening:\n{text[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"{role} {name} did not report a listening address within {timeout}s:\n"
                       f"{log_path.read_text(errors='replace')[-3000:]}")


class LocalCluster:
    """An origin plus relays, all on 127.0.0.1. ``close()`` stops every process it started.

    ``tree`` maps relay names to their parents' names (``"origin"`` or another relay),
    most preferred first, in start order: ``{"eu": ["origin"], "eu-1": ["eu"], ...}``.
    """

    def __init__(self, root: str | os.PathLike, *, key: bytes | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.key = key
        self.token_file = self.root / "token"
        self.token_file.write_text(self.token + "\n")
        self.key_file: Path | None = None
        if key is not None:
            self.key_file = self.root / "key"
            self.key_file.write_text(key.hex() + "\n")
        self.servers: dict[str, ServerProcess] = {}

    def _common(self, listen: str = "127.0.0.1:0") -> list[str]:
        # throwaway stores: no fsync (durability is not what a local tree is for)
        args = ["--listen", listen, "--retention", str(RETENTION), "--log-level", "INFO", "--no-fsync"]
        if self.key_file is not None:
            args += ["--key-file", str(self.key_file)]
        return args

    def start_origin(self, name: str = "origin", *, port: int = 0) -> ServerProcess:
        """Start (or restart, on the same store) the origin; ``port`` 0 picks a free one."""
        store = self.root / name
        s = start_server("origin", name, self.root,
                         [*self._common(f"127.0.0.1:{port}"), "--store", str(store), "--token-file", str(self.token_file)])
        self.servers[name] = s
        return s

    def start_tree(self, tree: dict[str, Sequence[str]]) -> None:
        """Start the origin (if not yet) and the relays; relays whose parents are all up start together."""
        if "origin" not in self.servers:
            self.start_origin()
        todo = dict(tree)
        while todo:
            wave = [n for n, ps in todo.items() if all(p in self.servers or "://" in p for p in ps)]
            if not wave:
                raise ValueError(f"relays {sorted(todo)} name parents that are never started")
            pending = []
            for name in wave:
                urls = [self.servers[p].url if p in self.servers else p for p in todo[name]]
                args = [*self._common(), "--cache", str(self.root / name)]
                for u in urls:
                    args += ["--parent", u]
                pending.append((name, _spawn("relay", name, self.root, args)))
            try:
                for name, started in pending:
                    self.servers[name] = _wait_listening(*started)
                    del todo[name]
            except BaseException:
                for name, started in pending:
                    if name not in self.servers and started[3].poll() is None:
                        started[3].kill()
                        started[3].wait(5)
                raise

    def url(self, name: str) -> str:
        return self.servers[name].url

    @property
    def origin(self) -> str:
        return self.servers["origin"].url

    def close(self) -> None:
        for s in reversed(list(self.servers.values())):
            try:
                s.stop(5)
            except Exception:  # keep stopping the others
                s.kill()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
