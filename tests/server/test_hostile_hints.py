"""Issue 27, hint flood: upload hints are unsigned and sized by the uploader's ``Content-Length``. A large upload
declared and sent at a trickle must not take a relay's cache from a signed version: hints hold at most
``HINT_SHARE`` of the cache, a hinted fetch that falls behind a publisher's pace is dropped, and a signed version's
blob cancels hinted fetches when it needs their room. In-process servers on 127.0.0.1 (real HTTP, disk stores)."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest

from deltasync.server.parents import fetcher as fetcher_mod
from deltasync.server.parents import prefetch
from deltasync.server.http.tokens import TokenTable
from deltasync.sse import SSEDecoder
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
                   "Content-Type": "application/octet-stream", "X-Deltasync-Model": "policy"}  # a token that may
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


# -- hints only for models the uploader's token may publish ---------------------------------------------------

POLICY_TOKEN = "policy-publisher-token-0001"
OTHER_TOKEN = "other-publisher-token-00002"
SCOPED = TokenTable.parse(f"publish policy {POLICY_TOKEN}\npublish other {OTHER_TOKEN}\n")


async def _hints(s: aiohttp.ClientSession, url: str, into: list[str], ready: asyncio.Event) -> None:
    """Collect the ids of ``blob`` hints on ``url``'s stream of every model."""
    decoder = SSEDecoder()
    async with s.get(f"{url}/v1/events") as resp:
        ready.set()
        async for chunk in resp.content.iter_any():
            into.extend(ev.json()["id"] for ev in decoder.feed(chunk) if ev.event == "blob")


async def _put(s: aiohttp.ClientSession, url: str, bid: str, data: bytes, token: str, model: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
    if model is not None:
        headers["X-Deltasync-Model"] = model
    async with s.put(f"{url}/v1/blobs/{bid}", data=data, headers=headers) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize("size", [2 << 20, 6 << 20], ids=["aiohttp", "direct"])
async def test_an_upload_is_hinted_only_for_a_model_its_token_may_publish(tmp_path, size):
    """Blob ids are shared content, so any publish token may upload any blob (stored, 201); but only an upload
    naming a model its token may publish is hinted to the relays: one naming no model, another token's model or a
    malformed name is stored unhinted (``uploads_unhinted``)."""
    cases = [(None, POLICY_TOKEN), ("other", POLICY_TOKEN), ("policy", OTHER_TOKEN), ("../policy", POLICY_TOKEN),
             ("policy.kf", POLICY_TOKEN)]  # the last one is hinted: a grant for M covers M.kf
    blobs = [make_blob(size, 60 + k) for k in range(len(cases))]
    seen: list[str] = []
    ready = asyncio.Event()
    async with serving(origin_config(store_dir=tmp_path / "o", tokens=SCOPED)) as (url, svc), \
            session() as s:
        reader = asyncio.create_task(_hints(s, url, seen, ready))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            for (model, token), (bid, data) in zip(cases, blobs):
                assert await _put(s, url, bid, data, token, model) == 201
                assert svc.store.has_blob(bid)
            await wait_for(lambda: _true(len(seen) >= 1), 10, what="the permitted upload's hint")
            await asyncio.sleep(0.3)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        assert seen == [blobs[-1][0]]
        assert svc.metrics.get("uploads_unhinted") == len(cases) - 1


async def test_the_publishers_clients_name_the_model_and_are_hinted(tmp_path):
    """Both of the publisher's HTTP faces (aiohttp's HttpClient, the publish command's PlainOrigin) send the model
    with a blob PUT, and ``upload_version`` names the manifest's model: each large upload is hinted."""
    from deltasync.client.http import HttpClient
    from deltasync.client.plainhttp import PlainOrigin
    from deltasync.client.upload import upload_version

    a_id, a = make_blob(2 << 20, 70)
    b_id, b = make_blob(6 << 20, 71)
    c_id, c = make_blob(3 << 20, 72)
    seen: list[str] = []
    ready = asyncio.Event()
    async with serving(origin_config(store_dir=tmp_path / "o", tokens=SCOPED)) as (url, svc), \
            session() as s:
        reader = asyncio.create_task(_hints(s, url, seen, ready))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            async with HttpClient([url], token=POLICY_TOKEN, read_token=POLICY_TOKEN) as h:
                await h.put_blob(a_id, a, model="policy")
                await upload_version(h, keyframe("policy", 0, [(c_id, c)]), {c_id: c})
            async with PlainOrigin(url, token=POLICY_TOKEN, read_token=POLICY_TOKEN) as p:
                await p.put_blob(b_id, (b[:100], memoryview(b)[100:]), model="policy")
            await wait_for(lambda: _true(len(seen) >= 3), 10, what="three hints")
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        assert sorted(seen) == sorted([a_id, b_id, c_id])
        assert svc.metrics.get("uploads_unhinted") == 0 and svc.store.head("policy") == 0
