"""Shardcast's own scenario, driven by shardcast 0.3.2 itself (run by bench_shardcast.py).

Runs with the shardcast venv's python (``.venv-shardcast``), inside a private network namespace
(shardcast binds 0.0.0.0): an origin, 2 middle nodes following it, 4 clients (2 per middle node),
each node its own process. Times from ``broadcast()`` (sharding the file) until every client has
reassembled the file and checked its checksum; peak RSS of every process from ``wait4``. Prints
one JSON line.

``python shardcast_nodes.py STATE WORKDIR``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BASE_PORT = 18000
PROBE = 1 << 20  # data1.bin: the file every shardcast server must hold, downloaded by each new downloader
CHECK_INTERVAL = 1  # the middle nodes' upstream poll, seconds (their default is 30; 1 is their minimum step)

ORIGIN = r"""
import sys, time, shardcast
shardcast.initialize(data_dir=sys.argv[1], port=int(sys.argv[2]))
print("ready", flush=True)
sys.stdin.readline()
t0 = time.time()
shardcast.broadcast(sys.argv[3])
print("broadcast", t0, time.time(), flush=True)
sys.stdin.readline()
"""

CLIENT = r"""
import sys, time, logging
from shardcast.client_node import ClientNode
c = ClientNode([sys.argv[1]], output_dir=sys.argv[2])
print("ready", flush=True)
while "v1" not in (c.list_available_versions() or {}):
    time.sleep(0.1)
tries = 1
out = c.download_version("v1", sys.argv[3])
while out is None and tries < 5:  # its distribution-file read fails now and then under load: as a user would, retry
    tries += 1
    time.sleep(0.2)
    out = c.download_version("v1", sys.argv[3])
print("done", time.time(), bool(out), tries, flush=True)
"""


class Node:
    def __init__(self, name: str, cmd: list[str], log: Path, env: dict) -> None:
        self.name = name
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.rss_mb: float | None = None
        self.exit: int | None = None
        self.ended: float | None = None
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.decode(errors="replace").strip())

    def wait_line(self, word: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ln in self.lines:
                if ln.startswith(word):
                    return ln
            if self.proc.poll() is not None and not any(ln.startswith(word) for ln in self.lines):
                break
            time.sleep(0.02)
        raise RuntimeError(f"{self.name}: no {word!r} line (exit {self.proc.poll()})")

    def reap(self) -> None:
        """Wait for the process to end; record its peak RSS (wait4)."""
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.exit = self.proc.returncode
        self.ended = time.time()
        self.rss_mb = ru.ru_maxrss / 1024

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None and self.exit is None:
            self.proc.terminate()


def main(state: str, work: str) -> dict:
    work_p = Path(work)
    env = {**os.environ, "SHARDCAST_LOG_LEVEL": "WARNING"}
    py = sys.executable
    o_dir, ports = work_p / "origin", [BASE_PORT, BASE_PORT + 1, BASE_PORT + 2]
    nodes: list[Node] = []
    for d in ["origin", "middle1", "middle2"]:
        (work_p / d).mkdir(parents=True, exist_ok=True)
        (work_p / d / "data1.bin").write_bytes(os.urandom(PROBE))
    try:
        origin = Node("origin", [py, "-c", ORIGIN, str(o_dir), str(ports[0]), state], work_p / "origin.log", env)
        nodes.append(origin)
        origin.wait_line("ready", 60)
        middles = []
        for i in (1, 2):
            m = Node(f"middle{i}", [py, "-m", "shardcast.middle_node", "--upstream", f"http://127.0.0.1:{ports[0]}",
                                    "--data-dir", str(work_p / f"middle{i}"), "--port", str(ports[i]),
                                    "--check-interval", str(CHECK_INTERVAL), "--log-level", "WARNING"],
                     work_p / f"middle{i}.log", env)
            middles.append(m)
            nodes.append(m)
            _wait_port(ports[i], m)  # one at a time: every downloader probes through the same /tmp/dummy.bin
        clients = []
        for j in range(4):
            up = ports[1 + j % 2]
            c = Node(f"client{j}", [py, "-c", CLIENT, f"http://127.0.0.1:{up}", str(work_p / f"client{j}"),
                                    str(work_p / f"client{j}" / "state.bin")], work_p / f"client{j}.log", env)
            clients.append(c)
            nodes.append(c)
            c.wait_line("ready", 60)
        time.sleep(1.0)  # every node up and polling before the clock starts
        origin.send("go\n")
        line = origin.wait_line("broadcast", 300)
        _, t0, t_sharded = line.split()
        reapers = [threading.Thread(target=c.reap) for c in clients]
        for r in reapers:
            r.start()
        for r in reapers:
            r.join(600)
        done, retries = [], []
        for c in clients:
            ln = c.wait_line("done", 1)
            _, t, ok, tries = ln.split()
            retries.append(int(tries) - 1)
            if ok != "True":
                raise RuntimeError(f"{c.name}: download_version failed")
            done.append(float(t))
        origin_rss = _hwm(origin.proc.pid)
        middle_rss = [_hwm(m.proc.pid) for m in middles]
        return {"seconds": max(done) - float(t0), "shard_s": float(t_sharded) - float(t0),
                "origin_rss_mb": origin_rss, "middle_rss_mb": middle_rss,
                "client_rss_mb": [c.rss_mb for c in clients], "size": os.path.getsize(state),
                "client_retries": sum(retries)}
    finally:
        for n in nodes:
            n.stop()


def _wait_port(port: int, node: Node, timeout: float = 60.0) -> None:
    import socket
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"{node.name} exited with {node.proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{node.name} not listening on {port} after {timeout} s")


def _hwm(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
