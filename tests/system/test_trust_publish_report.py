"""``deltasync publish`` cut between the ``M`` and ``M.kf`` commits (issue 9): the version is live, so the CLI
says so and exits 0 (it reported a failed publish before, and a retry then failed with "not after the head");
the side keyframe's uploaded blob is an orphan that the restarted origin deletes once its grace has passed
(server/storage/store.py ``orphan_grace``; here ``DELTASYNC_ORPHAN_GRACE_S=3``: long enough for the publish's own
commits, which come milliseconds after its uploads).

A real origin process behind a small HTTP proxy (aiohttp, its own thread) that SIGKILLs the origin as soon as
the origin has answered the commit of ``M vN`` and answers 502 to everything after it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from server_fixtures import KEY_HEX, TOKEN, origin, stop_all

SHAPE = ModelShape(vocab=128, hidden=32, layers=1, ffn=64)


class KillAfterCommit:
    """Forwards to ``target``; once ``PUT /v1/models/{model}/versions/{version}`` was answered 2xx, SIGKILLs
    ``pid`` and answers 502 from then on."""

    def __init__(self, target: str, model: str, version: int, pid: int) -> None:
        self.target, self.path, self.pid = target, f"/v1/models/{model}/versions/{version}", pid
        self.killed = False
        self.seen: list[str] = []
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(30)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        ready.set()
        self._loop.run_forever()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(f"{request.method} {request.path}")
        if self.killed:
            return web.json_response({"error": {"code": "upstream", "message": "origin gone"}}, status=502)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession(auto_decompress=False) as s, \
                s.request(request.method, self.target + request.path_qs, data=body, headers=headers) as r:
            data = await r.read()
            out = web.Response(status=r.status, body=data,
                               headers={k: v for k, v in r.headers.items()
                                        if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                                             "content-encoding")})
        if request.method == "PUT" and request.path == self.path and r.status < 300:
            os.kill(self.pid, signal.SIGKILL)
            self.killed = True
        return out

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _blob_ids(store: Path) -> set[str]:
    return {f.name for f in (store / "blobs").rglob("*") if f.is_file()}


def _referenced(store: Path) -> set[str]:
    return {b["id"] for f in (store / "models").rglob("*.json") for b in json.loads(f.read_bytes())["blobs"]}


@pytest.mark.long
def test_publish_cut_between_the_version_and_its_side_keyframe_reports_the_version_live(tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=3)
    for i in range(2):
        write_state_file(tmp_path / f"s{i}.safetensors", trace.step())
    os.environ["DELTASYNC_ORPHAN_GRACE_S"] = "3"  # inherited by the origin processes started below
    try:
        o = origin(tmp_path, "origin", "--no-fsync", key=True).start().wait_ready(120)
        key = tmp_path / "key"
        key.write_text(KEY_HEX + "\n")
        common = ["--model", "m", "--token-file", str(tmp_path / "token"), "--key-file", str(key), "--timeout", "60"]
        r = cli("publish", "--origin", o.url, *common, str(tmp_path / "s0.safetensors"))
        assert r.returncode == 0, r.stderr
        proxy = KillAfterCommit(o.url, "m", 1, o.pid)
        try:
            r = cli("publish", "--origin", proxy.url, *common, "--keyframe", str(tmp_path / "s1.safetensors"))
        finally:
            proxy.close()
        assert proxy.killed, proxy.seen
        assert r.returncode == 0, f"the version is live: the publish must not report a failure\n{r.stdout}{r.stderr}"
        assert "published m v1: delta" in r.stdout, r.stdout
        assert "v1 is live, but its side keyframe m.kf v1 was not committed" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        store = tmp_path / "origin"
        orphans = _blob_ids(store) - _referenced(store)
        assert orphans, ("the side keyframe's blob was uploaded before the cut (the case under test)", [x for x in proxy.seen if x.startswith("PUT")], sorted(_blob_ids(store)), sorted(_referenced(store)))
        time.sleep(3.5)  # the grace passes
        o.start().wait_ready(120)  # same port, same store
        async def head() -> dict:
            async with aiohttp.ClientSession() as s, s.get(f"{o.url}/v1/models/m/head") as resp:
                assert resp.status == 200
                return json.loads(await resp.read())
        assert asyncio.run(head())["version"] == 1
        assert not (_blob_ids(store) - _referenced(store)), "the restarted origin deletes the orphan blobs"
        # the stream goes on: the next publish (a delta on v1) works and a subscriber gets it bit-exactly
        write_state_file(tmp_path / "s2.safetensors", trace.step())
        r = cli("publish", "--origin", o.url, *common, str(tmp_path / "s2.safetensors"))
        assert r.returncode == 0 and "published m v2" in r.stdout, r.stdout + r.stderr
        r = cli("subscribe", "--from", o.url, "--model", "m", "--key-file", str(key), "--out",
                str(tmp_path / "out.safetensors"), "--once", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        got, want = read_state_file(tmp_path / "out.safetensors"), read_state_file(tmp_path / "s2.safetensors")
        assert set(got) == set(want) and all(torch.equal(got[n].view(-1).view(torch.uint8),
                                                         want[n].view(-1).view(torch.uint8)) for n in got)
    finally:
        os.environ.pop("DELTASYNC_ORPHAN_GRACE_S", None)
        stop_all(o)
