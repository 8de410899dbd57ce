"""Uploads served while they arrive, and relays that fetch a blob the origin hints it is receiving.

In-process servers on 127.0.0.1 (real aiohttp, real HTTP, disk stores under tmp_path); an upload is held
half-way by a request body that waits on an event, so each test can look at the origin and the relay
while the upload is in progress."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from deltasync.server.config import ServerConfig
from deltasync.signing import Ed25519Signer
from deltasync.sse import SSEDecoder
from inprocess_servers import FAST, origin_config, relay_config, serving
from server_fixtures import TOKEN, keyframe, make_blob, put_manifest, session, wait_for, wait_head

PUBLISHER = Ed25519Signer.generate()


class HeldUpload:
    """A PUT of ``data`` for ``model`` (``X-Deltasync-Model``: the origin hints only uploads naming a model their
    token may publish) whose body stops after ``first`` bytes until ``release()`` (or ``cut()``)."""

    def __init__(self, s: aiohttp.ClientSession, url: str, bid: str, data: bytes, first: int, *,
                 model: str = "hinted") -> None:
        self.go = asyncio.Event()
        self.abort = False
        self.sent = asyncio.Event()

        async def body():
            yield data[:first]
            self.sent.set()
            await self.go.wait()
            if self.abort:
                raise ConnectionResetError("the test cut the upload")
            for i in range(first, len(data), 1 << 20):
                yield data[i:i + (1 << 20)]

        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(len(data)),
                   "Content-Type": "application/octet-stream", "X-Deltasync-Model": model}
        self.task = asyncio.create_task(self._put(s, f"{url}/v1/blobs/{bid}", body(), headers))

    @staticmethod
    async def _put(s, url, body, headers) -> int:
        async with s.put(url, data=body, headers=headers) as resp:
            return resp.status

    def release(self) -> None:
        self.go.set()

    def cut(self) -> None:
        self.abort = True
        self.go.set()


async def _first_hint(s: aiohttp.ClientSession, url: str, timeout: float = 10.0) -> dict:
    """The data of the first ``blob`` event on ``url``'s stream of every model."""
    decoder = SSEDecoder()
    async with s.get(f"{url}/v1/events") as resp:
        async with asyncio.timeout(timeout):
            async for chunk in resp.content.iter_any():
                for ev in decoder.feed(chunk):
                    if ev.event == "blob":
                        return ev.json()
    raise AssertionError("no blob event")


@pytest.mark.parametrize("size,store", [(6 << 20, "disk"), (2 << 20, "disk"), (6 << 20, "memory")],
                         ids=["direct", "aiohttp", "memory-store"])
async def test_an_upload_is_hinted_and_served_while_it_arrives(tmp_path, size, store):
    """A large upload is announced on /v1/events as a ``blob`` hint and can be read from the origin while it
    arrives: the bytes written so far come at once, the last only when the whole blob hashed to its id."""
    bid, data = make_blob(size, 31)
    cfg = origin_config(store_dir=tmp_path / "o") if store == "disk" else origin_config(store_kind="memory")
    async with serving(cfg) as (url, svc), session() as s:
        hint = asyncio.create_task(_first_hint(s, url))
        await asyncio.sleep(0.2)  # the stream is open before the upload starts
        up = HeldUpload(s, url, bid, data, first=size // 2)
        assert await hint == {"id": bid, "size": size}
        await up.sent.wait()
        async with s.get(f"{url}/v1/blobs/{bid}") as resp:
            assert resp.status == 200 and resp.headers["X-Deltasync-Cache"] == "upload"
            assert resp.content_length == size
            got = await resp.content.readexactly(size // 4)  # before the rest of the upload exists
            assert got == data[:size // 4]
            assert not svc.store.has_blob(bid)
            up.release()
            got += await resp.read()
        assert got == data
        assert await up.task == 201
        assert svc.store.has_blob(bid) and svc.intake.inflight(bid) is None
        assert svc.metrics.get("upload_reads") == 1


async def test_a_cut_upload_cuts_its_readers_and_leaves_nothing(tmp_path):
    """A reader following an upload that is cut short never gets a complete blob: its response is cut, and
    the origin then has no such blob."""
    bid, data = make_blob(6 << 20, 32)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (url, svc), session() as s:
        up = HeldUpload(s, url, bid, data, first=3 << 20)
        await up.sent.wait()
        await wait_for(lambda: _true(svc.intake.inflight(bid) is not None), 5, what="the upload to start")
        async with s.get(f"{url}/v1/blobs/{bid}") as resp:
            assert resp.status == 200
            up.cut()
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        with pytest.raises(aiohttp.ClientError):
            await up.task
        await wait_for(lambda: _true(svc.intake.inflight(bid) is None), 5, what="the upload to be dropped")
        assert not svc.store.has_blob(bid)
        async with s.get(f"{url}/v1/blobs/{bid}") as resp:
            assert resp.status == 404


async def test_bytes_that_miss_the_id_never_reach_a_reader_whole(tmp_path):
    """An upload whose bytes do not hash to its id is refused, and its reader never gets the last byte."""
    bid, data = make_blob(6 << 20, 33)
    bad = data[:-1] + bytes([data[-1] ^ 1])
    async with serving(origin_config(store_dir=tmp_path / "o")) as (url, svc), session() as s:
        up = HeldUpload(s, url, bid, bad, first=1 << 20)
        await up.sent.wait()
        await wait_for(lambda: _true(svc.intake.inflight(bid) is not None), 5, what="the upload to start")
        async with s.get(f"{url}/v1/blobs/{bid}") as resp:
            up.release()
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        assert await up.task == 422
        assert not svc.store.has_blob(bid)


async def test_a_relay_fetches_a_hinted_upload_before_its_version_is_committed(tmp_path):
    """The relay starts fetching a blob when the origin hints it, follows the upload as it arrives, and the
    version naming it is announced without a second fetch; a relay told not to waits for the version."""
    bid, data = make_blob(6 << 20, 34)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (o_url, o_svc), \
            serving(relay_config([o_url], store_dir=tmp_path / "r", hinted_fetch=True)) as (r_url, r_svc), \
            serving(relay_config([o_url], store_dir=tmp_path / "q")) as (q_url, q_svc), session() as s:
        await wait_for(lambda: _true(o_svc.hub.subscribers >= 2), 10, what="both relays to follow the origin")
        up = HeldUpload(s, o_url, bid, data, first=3 << 20)
        await wait_for(lambda: _true(r_svc.fetcher.inflight(bid) is not None), 10, what="the hinted fetch")
        assert r_svc.fetcher.inflight(bid).part.written <= 3 << 20  # following the upload, not after it
        assert q_svc.fetcher.inflight(bid) is None  # --no-hinted-fetch
        up.release()
        assert await up.task == 201
        await wait_for(lambda: _true(r_svc.store.has_blob(bid)), 10, what="the relay's copy")
        assert not q_svc.store.has_blob(bid)
        status, _ = await put_manifest(s, o_url, keyframe("hinted", 0, [(bid, data)]))
        assert status == 201
        await wait_head(s, r_url, "hinted", 0)
        await wait_head(s, q_url, "hinted", 0)
        async with s.get(f"{r_url}/v1/blobs/{bid}") as resp:
            assert resp.headers["X-Deltasync-Cache"] == "hit" and await resp.read() == data
        assert r_svc.metrics.get("upstream_fetches") == 1 and r_svc.metrics.get("hinted_fetches") == 1
        assert q_svc.metrics.get("hinted_fetches") == 0


async def test_a_hinted_blob_that_is_never_uploaded_costs_nothing_later(tmp_path):
    """A hinted upload that is cut leaves no negative entry on the relay: the blob's next upload and its
    version go through at once."""
    bid, data = make_blob(6 << 20, 35)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (o_url, o_svc), \
            serving(relay_config([o_url], store_dir=tmp_path / "r", hinted_fetch=True)) as (r_url, r_svc), \
            session() as s:
        await wait_for(lambda: _true(o_svc.hub.subscribers >= 1), 10, what="the relay to follow the origin")
        up = HeldUpload(s, o_url, bid, data, first=2 << 20)
        await wait_for(lambda: _true(r_svc.fetcher.inflight(bid) is not None), 10, what="the hinted fetch")
        up.cut()
        with pytest.raises(aiohttp.ClientError):
            await up.task
        await wait_for(lambda: _true(r_svc.fetcher.inflight(bid) is None), 20, what="the hinted fetch to end")
        assert not r_svc.store.has_blob(bid) and not r_svc.fetcher.known_missing(bid)
        assert r_svc.fetcher.storage_error is None
        up = HeldUpload(s, o_url, bid, data, first=len(data))
        up.release()
        assert await up.task == 201
        assert (await put_manifest(s, o_url, keyframe("again", 0, [(bid, data)])))[0] == 201
        await wait_head(s, r_url, "again", 0, timeout=10)
        async with s.get(f"{r_url}/v1/blobs/{bid}") as resp:
            assert await resp.read() == data


def _verified_relay(tmp_path, parent: str) -> ServerConfig:
    return ServerConfig(role="relay", host="127.0.0.1", port=0, store_kind="disk", store_dir=tmp_path / "r",
                        parents=(parent,), verifier=PUBLISHER.verifier(), fsync=False, timeouts=FAST)


@pytest.mark.parametrize("honest", [True, False], ids=["signed-digest", "other-digest"])
async def test_a_blob_fetched_before_its_manifest_is_checked_against_the_signed_digest(tmp_path, honest):
    """A relay holding the publisher's key that fetched a blob by id alone (a child asked before any
    manifest named it) compares that copy's digest with the signed manifest's when the version comes: a copy
    that is not the signed one is dropped, and no child gets it whole afterwards."""
    bid, data = make_blob(2 << 20, 36)
    signed = data if honest else b"the bytes the publisher signed"
    m = keyframe("signed", 0, [(bid, data)], key=None).with_digests({bid: signed}).sign(PUBLISHER)
    # an origin without the key stores what it is given (a compromised origin, as far as the relay knows)
    o_cfg = ServerConfig(role="origin", host="127.0.0.1", port=0, store_kind="disk", store_dir=tmp_path / "o",
                         token=TOKEN, fsync=False, timeouts=FAST)
    async with serving(o_cfg) as (o_url, _), serving(_verified_relay(tmp_path, o_url)) as (r_url, r_svc), \
            session() as s:
        async with s.put(f"{o_url}/v1/blobs/{bid}", data=data, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 201
        async with s.get(f"{r_url}/v1/blobs/{bid}") as resp:  # by id alone: no manifest names it yet
            assert await resp.read() == data
        await wait_for(lambda: _true(r_svc.store.has_blob(bid)), 10, what="the relay's copy")
        async with s.put(f"{o_url}/v1/models/signed/versions/0", data=m.to_json(),
                         headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}) as r:
            assert r.status == 201
        if honest:
            await wait_head(s, r_url, "signed", 0, timeout=10)
            assert r_svc.metrics.get("hash_failures") == 0
            return
        await wait_for(lambda: _true(r_svc.metrics.get("hash_failures") >= 1), 10,
                       what="the relay to find the copy is not the signed one")
        assert not r_svc.store.has_blob(bid)
        # the copy it had is gone, and no copy that is not the signed one reaches a child whole
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.get(f"{r_url}/v1/blobs/{bid}") as resp:
                await resp.read()
        assert not r_svc.store.has_blob(bid)


async def _true(value: bool) -> bool:
    return value


def test_hint_payload_is_compact_json():
    from deltasync.server.events import EventHub
    hub = EventHub()
    every, one = hub.subscribe(None), hub.subscribe("m")
    hub.hint("ab" * 16, 5)
    assert json.loads(every.queue.get_nowait().payload) == {"id": "ab" * 16, "size": 5}
    assert one.queue.empty()  # a model's stream (subscribers) never sees hints


async def test_a_hint_travels_down_a_chain_of_relays(tmp_path):
    """A relay that starts a hinted fetch hints its own children: the second tier follows the first tier's
    copy of an upload that is still arriving."""
    bid, data = make_blob(6 << 20, 37)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (o_url, o_svc), \
            serving(relay_config([o_url], store_dir=tmp_path / "r1", hinted_fetch=True)) as (r1_url, r1_svc), \
            serving(relay_config([r1_url], store_dir=tmp_path / "r2", hinted_fetch=True)) as (r2_url, r2_svc), \
            session() as s:
        await wait_for(lambda: _true(o_svc.hub.subscribers >= 1 and r1_svc.hub.subscribers >= 1), 10,
                       what="the chain to follow its parents")
        up = HeldUpload(s, o_url, bid, data, first=2 << 20)
        await wait_for(lambda: _true(r2_svc.fetcher.inflight(bid) is not None), 10, what="the second tier's fetch")
        assert not o_svc.store.has_blob(bid)  # the upload is still held
        up.release()
        assert await up.task == 201
        await wait_for(lambda: _true(r2_svc.store.has_blob(bid)), 10, what="the second tier's copy")
        assert r2_svc.metrics.get("upstream_fetches") == 1 and r1_svc.metrics.get("upstream_fetches") == 1


async def test_a_hinted_blob_that_does_not_fit_the_cache_is_not_fetched(tmp_path):
    """A relay fetches a hinted blob only when it fits its --cache-size beside what is pinned, and within the
    hints' share of it (prefetch.HINT_SHARE, a quarter): a larger one waits for a version that names it (a smaller
    one hinted after it is fetched, so the first hint was seen)."""
    big_id, big = make_blob(6 << 20, 38)
    small_id, small = make_blob(2 << 20, 39)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (o_url, o_svc), \
            serving(relay_config([o_url], store_dir=tmp_path / "r", hinted_fetch=True, cache_size=8 << 20)
                    ) as (r_url, r_svc), session() as s:
        await wait_for(lambda: _true(o_svc.hub.subscribers >= 1), 10, what="the relay to follow the origin")
        up_big = HeldUpload(s, o_url, big_id, big, first=1 << 20)
        await up_big.sent.wait()
        up_small = HeldUpload(s, o_url, small_id, small, first=1 << 20)
        await wait_for(lambda: _true(r_svc.fetcher.inflight(small_id) is not None or r_svc.store.has_blob(small_id)),
                       10, what="the small hinted blob's fetch")
        assert r_svc.fetcher.inflight(big_id) is None and not r_svc.store.has_blob(big_id)
        up_big.release()
        up_small.release()
        assert await up_big.task == 201 and await up_small.task == 201
        await wait_for(lambda: _true(r_svc.store.has_blob(small_id)), 10, what="the small blob's copy")
        assert r_svc.metrics.get("upstream_fetches") == 1


async def test_a_manifest_that_comes_while_the_copy_is_being_stored_is_still_checked(tmp_path):
    """The same check when the signed manifest arrives between the copy's hash check and its move into the cache
    (the fetch compares once the copy is stored)."""
    bid, data = make_blob(2 << 20, 40)
    m = keyframe("late", 0, [(bid, data)], key=None).with_digests({bid: b"the signed bytes"}).sign(PUBLISHER)
    o_cfg = ServerConfig(role="origin", host="127.0.0.1", port=0, store_kind="disk", store_dir=tmp_path / "o",
                         token=TOKEN, fsync=False, timeouts=FAST)
    async with serving(o_cfg) as (o_url, _), serving(_verified_relay(tmp_path, o_url)) as (r_url, r_svc), \
            session() as s:
        files = r_svc.store.files
        adopt, gate, adopting = files.adopt, asyncio.Event(), asyncio.Event()

        async def held_adopt(part):
            adopting.set()
            await gate.wait()
            await adopt(part)
        files.adopt = held_adopt
        async with s.put(f"{o_url}/v1/blobs/{bid}", data=data, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 201
        async with s.get(f"{r_url}/v1/blobs/{bid}") as resp:  # by id alone; served once it hashed to its id
            assert await resp.read() == data
        await asyncio.wait_for(adopting.wait(), 10)
        async with s.put(f"{o_url}/v1/models/late/versions/0", data=m.to_json(),
                         headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}) as r:
            assert r.status == 201
        await wait_for(lambda: _true("late" in r_svc.store.models), 10, what="the relay to take the manifest")
        gate.set()
        await wait_for(lambda: _true(r_svc.metrics.get("hash_failures") >= 1), 10,
                       what="the relay to find the stored copy is not the signed one")
        assert not r_svc.store.has_blob(bid) or r_svc.fetcher.inflight(bid) is not None
