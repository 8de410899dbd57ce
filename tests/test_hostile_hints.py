"""Issue 27, hint flood: upload hints are unsigned and sized by the uploader's ``Content-Length``. A large upload
declared and sent at a trickle must not take a relay's cache from a signed version: hints hold at most
``HINT_SHARE`` of the cache, a hinted fetch that falls behind a publisher's pace is dropped, and a signed version's
blob cancels hinted fetches when it needs their room. In-process servers on 127.0.0.1 (real HTTP, disk stores)."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp

from deltasync.server import fetcher as fetcher_mod
from deltasync.server import prefetch
from inprocess_servers import FAST, origin_config, relay_config, serving
from server_fixtures import TOKEN, keyframe, make_blob, put_blob, put_manifest, session, wait_for, wait_head

CACHE = 16 << 20


async def _true(v: bool) -> bool:
    return v


class TrickleUpload:
    """A PUT declaring ``declared`` bytes and sending ``rate`` bytes/s of them, until cancelled."""

    def __init__(self, s: aiohttp.ClientSession, url: str, bid: str, declared: int, rate: int) -> None:
        async def body():
            while True:
                yield b"\0" * (rate // 10)
                await asyncio.sleep(0.1)

        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(declared),
                   "Content-Type": "application/octet-stream"}
        self.task = asyncio.create_task(self._put(s, f"{url}/v1/blobs/{bid}", body(), headers))

    @staticmethod
    async def _put(s, url, body, headers):
        try:
            async with s.put(url, data=body, headers=headers) as resp:
                return resp.status
        except aiohttp.ClientError:
            return None

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _flood_then_keyframe(tmp_path, declared: int, *, slow_ok: float = 0.0):
    flood_id, _ = make_blob(64, 99)  # the id of bytes never sent: the upload can never complete
    kf_id, kf = make_blob(6 << 20, 27)
    o_cfg = origin_config(store_dir=tmp_path / "o")
    timeouts = dataclasses.replace(FAST, rate_grace=1.0)
    async with serving(o_cfg) as (o_url, o_svc), \
            serving(dataclasses.replace(relay_config([o_url], store_dir=tmp_path / "r", hinted_fetch=True,
                                                     cache_size=CACHE), timeouts=timeouts)) as (r_url, r_svc), \
            session() as s:
        await wait_for(lambda: _true(o_svc.hub.subscribers >= 1), 10, what="the relay to follow the origin")
        flood = TrickleUpload(s, o_url, flood_id, declared, 80 << 10)
        try:
            await asyncio.sleep(1.5)
            held = sum(r_svc.prefetcher._hinted.values())
            assert held <= prefetch.HINT_SHARE * CACHE, held
            assert await put_blob(s, o_url, kf_id, kf) in (200, 201)
            status, _ = await put_manifest(s, o_url, keyframe("policy.kf", 0, [(kf_id, kf)]))
            assert status == 201
            await wait_head(s, r_url, "policy.kf", 0)
            async with s.get(f"{r_url}/v1/blobs/{kf_id}") as resp:
                assert resp.status == 200 and await resp.read() == kf
            assert not r_svc.store.over_budget
            async with s.get(f"{r_url}/healthz") as resp:
                assert (await resp.json())["status"] == "ok"
        finally:
            await flood.stop()
        return r_svc


async def test_a_hint_flood_over_the_share_is_not_fetched_and_the_signed_keyframe_lands(tmp_path):
    """The issue's flood, scaled to a 16 MiB cache: a 12 MiB upload declared, sent at 80 KB/s."""
    r_svc = await _flood_then_keyframe(tmp_path, 12 << 20)
    assert r_svc.metrics.get("hinted_fetches") == 0 and r_svc.metrics.get("hints_refused") >= 1


async def test_a_hinted_fetch_within_the_share_that_trickles_is_dropped(tmp_path):
    """A 3 MiB hint fits the share, but the upload behind it trickles: the relay drops the hinted fetch (its room
    released) once it falls behind a publisher's pace; the signed keyframe lands meanwhile."""
    r_svc = await _flood_then_keyframe(tmp_path, 3 << 20)
    assert r_svc.metrics.get("hinted_fetches") == 1
    await wait_for(lambda: _true(not r_svc.fetcher._hinted), 15, what="the trickling hinted fetch to be dropped")


def test_hinted_fetches_have_a_publishers_pace():
    assert fetcher_mod.HINTED_MIN_RATE >= 1 << 20
