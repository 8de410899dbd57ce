"""A real tree on loopback: origin → 2 relays → 4 relays, clients at the leaves."""

from __future__ import annotations

import asyncio
import json

import pytest

from server_fixtures import (
    KEY, delta, keyframe, make_blob, metrics, origin, publish, relay, session, start_all, stop_all, wait_head,
)

MODEL = "policy"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    work = tmp_path_factory.mktemp("tree")
    o = origin(work, key=True)
    mids = [relay(work, f"mid{i}", [o.url], key=True) for i in range(2)]
    leaves = [relay(work, f"leaf{i}", [mids[i // 2].url], key=True) for i in range(4)]
    start_all(o, *mids, *leaves)
    yield o, mids, leaves
    codes = stop_all(*leaves, *mids, o)
    assert codes == [0] * 7, [s.log() for s in (*leaves, *mids, o)]


def versions():
    """A keyframe and two deltas with random-bytes blobs of awkward sizes."""
    kf = [make_blob(n, seed) for seed, n in enumerate((1 << 20, 3 * (1 << 20) + 17, 65_537))]
    d2 = [make_blob(300_001, 10)]
    d3 = [make_blob(2 * (1 << 20) + 5, 11), make_blob(1, 12)]
    return [(keyframe(MODEL, 1, kf, key=KEY), kf), (delta(MODEL, 2, 1, d2, key=KEY), d2),
            (delta(MODEL, 3, 2, d3, key=KEY), d3)]


async def test_versions_reach_every_leaf_bit_exact_with_one_fetch_per_tier(tree):
    o, mids, leaves = tree
    vs = versions()
    nblobs = sum(len(b) for _, b in vs)
    async with session() as s:
        before_o = await metrics(s, o.url)
        before_mid = [await metrics(s, m.url) for m in mids]
        for m, blobs in vs:
            await publish(s, o.url, m, blobs)
        await asyncio.gather(*(wait_head(s, leaf.url, MODEL, 3) for leaf in leaves))

        async def check_leaf(leaf):
            for m, blobs in vs:
                async with s.get(f"{leaf.url}/v1/models/{MODEL}/versions/{m.version}") as r:
                    assert r.status == 200
                    assert await r.read() == m.to_json()
                for bid, data in blobs:
                    async with s.get(f"{leaf.url}/v1/blobs/{bid}") as r:
                        assert r.status == 200
                        assert r.headers["ETag"] == f'"{bid}"'
                        assert r.headers["Cache-Control"] == "public, max-age=31536000, immutable"
                        assert await r.read() == data
            async with s.get(f"{leaf.url}/v1/models/{MODEL}/head") as r:
                assert json.loads(await r.read())["version"] == 3

        await asyncio.gather(*(check_leaf(leaf) for leaf in leaves))

        after_o = await metrics(s, o.url)
        # Each mid relay asked the origin once per blob although two leaves (and four clients) wanted each.
        assert after_o["deltasync_blob_requests_total"] - before_o["deltasync_blob_requests_total"] == 2 * nblobs
        for m, before in zip(mids, before_mid):
            after = await metrics(s, m.url)
            assert after["deltasync_upstream_fetches_total"] - before["deltasync_upstream_fetches_total"] == nblobs
            assert after["deltasync_hash_failures_total"] == 0
            assert after['deltasync_head_version{model="policy"}'] == 3
            assert after['deltasync_lag_versions{model="policy"}'] == 0
        for leaf in leaves:
            mt = await metrics(s, leaf.url)
            assert mt["deltasync_upstream_fetches_total"] == nblobs
            assert mt["deltasync_versions_total"] == 3


async def test_leaf_events_and_long_poll_follow_new_versions(tree):
    o, _, leaves = tree
    leaf = leaves[3]
    blobs4 = [make_blob(500_000, 40)]
    blobs5 = [make_blob(70_000, 50)]
    async with session() as s:
        await wait_head(s, leaf.url, MODEL, 3)
        async with s.get(f"{leaf.url}/v1/models/{MODEL}/events") as ev:
            assert ev.headers["Content-Type"] == "text/event-stream"
            first = await _next_event(ev)
            assert first[0] == "head" and first[1]["version"] == 3
            m4 = delta(MODEL, 4, 3, blobs4, key=KEY)
            await publish(s, o.url, m4, blobs4)
            kind, data, eid = await _next_event(ev)
            assert (kind, data["version"], data["parent"], eid) == ("version", 4, 3, "4")
            assert data["manifest"] == json.loads(m4.to_json())  # small manifests ride along
            # announced only once servable: the blob is there for the asking
            async with s.get(f"{leaf.url}/v1/blobs/{blobs4[0][0]}") as r:
                assert await r.read() == blobs4[0][1]

        poll = asyncio.create_task(_long_poll(s, leaf.url, after=4, wait=15))
        await asyncio.sleep(0.3)
        assert not poll.done()
        await publish(s, o.url, delta(MODEL, 5, 4, blobs5, key=KEY), blobs5)
        status, version = await asyncio.wait_for(poll, 20)
        assert (status, version) == (200, 5)
        assert await _long_poll(s, leaf.url, after=5, wait=0.2) == (204, None)

        # replay from a Last-Event-ID
        async with s.get(f"{leaf.url}/v1/models/{MODEL}/events", headers={"Last-Event-ID": "3"}) as ev:
            got = [await _next_event(ev), await _next_event(ev)]
            assert [(k, d["version"]) for k, d, _ in got] == [("version", 4), ("version", 5)]


async def _long_poll(s, url, *, after, wait):
    async with s.get(f"{url}/v1/models/{MODEL}/head", params={"after": str(after), "wait": str(wait)}) as r:
        await r.read()
        return r.status, int(r.headers["X-Deltasync-Version"]) if r.status == 200 else None


async def _next_event(resp):
    kind, data, eid = None, None, None
    while True:
        line = (await asyncio.wait_for(resp.content.readline(), 10)).decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
        elif line.startswith("id: "):
            eid = line[4:]
        elif line == "" and data is not None:
            return kind, data, eid


# -- squashed catch-up deltas, built from real codec output ----------------------------------------

def _states(n: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(7)
    state = {"a.weight": torch.randn(300, 257, generator=g).to(torch.bfloat16),
             "b.bias": torch.randn(1000, generator=g).to(torch.float32)}
    out = [state]
    for _ in range(n - 1):
        new = {}
        for name, t in out[-1].items():
            t = t.clone()
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=g)
            flat[idx] = (flat[idx].float() * 1.01 + 1e-3).to(t.dtype)
            new[name] = t
        out.append(new)
    return out


async def test_squashed_catch_up_delta_from_origin_and_leaf(tree):
    import torch

    from deltasync.apply import apply_delta
    from deltasync.codec import encode_delta
    from deltasync.keyframe import encode_keyframe
    from deltasync.manifest import parse_manifest

    o, _, leaves = tree
    leaf = leaves[1]
    model = "squashy"
    states = _states(5)  # v1 keyframe, v2..v5 deltas
    encoded = [encode_keyframe(states[0], model=model, version=1)]
    for v in range(2, 6):
        encoded.append(encode_delta(states[v - 2], states[v - 1], model=model, version=v, parent=v - 1))
    async with session() as s:
        for enc in encoded:
            await publish(s, o.url, enc.manifest.sign(KEY), list(enc.blobs.items()))
        await wait_head(s, leaf.url, model, 5)
        for url in (o.url, leaf.url):
            async with s.get(f"{url}/v1/models/{model}/delta", params={"from": "2", "to": "5"}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Deltasync-Squashed"] == "2-5"
                m = parse_manifest(await r.read(), verifier=KEY)  # both hold the key: signed
            assert (m.parent, m.version, m.kind) == (2, 5, "delta")
            blobs = {}
            for ref in m.blobs:
                async with s.get(f"{leaf.url}/v1/blobs/{ref.id}") as r:
                    blobs[ref.id] = await r.read()
            live = {k: t.clone() for k, t in states[1].items()}
            apply_delta(live, m, blobs)
            for name, t in states[4].items():
                assert torch.equal(live[name].view(torch.uint8), t.view(torch.uint8)), name
        before = await metrics(s, leaf.url)
        async with s.get(f"{leaf.url}/v1/models/{model}/delta", params={"from": "2", "to": "5"}) as r:
            assert r.status == 200
        assert (await metrics(s, leaf.url))["deltasync_squash_hits_total"] == before["deltasync_squash_hits_total"] + 1
        # a single step is the version itself; bad requests have their statuses
        async with s.get(f"{leaf.url}/v1/models/{model}/delta", params={"from": "3", "to": "4"}) as r:
            assert await r.read() == encoded[3].manifest.sign(KEY).to_json()
        async with s.get(f"{leaf.url}/v1/models/{model}/delta", params={"from": "1"}) as r:
            assert r.status == 200 and r.headers["X-Deltasync-Squashed"] == "1-5"
        for params, status, code in ((("5", "2"), 400, "format"), (("0", "5"), 409, "chain"),
                                     (("1", "9"), 404, "not_found")):
            async with s.get(f"{leaf.url}/v1/models/{model}/delta", params={"from": params[0], "to": params[1]}) as r:
                assert r.status == status, await r.text()
                assert (await r.json())["error"]["code"] == code
