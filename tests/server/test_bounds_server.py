"""Issue 9 on real servers (loopback): crafted manifests are 400s, not 500s; a relay asked to squash a
crafted chain answers an error at once and keeps serving."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from server_fixtures import KEY, origin, publish, put_manifest, relay, session, start_all, stop_all, wait_head

from deltasync.codec import encode_delta
from deltasync.keyframe import encode_keyframe
from deltasync.manifest import Manifest


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    work = tmp_path_factory.mktemp("bounds")
    o = origin(work, key=True)
    r = relay(work, "relay", [o.url], key=True)
    start_all(o, r)
    yield o, r
    codes = stop_all(r, o)
    assert codes == [0, 0], [s.log() for s in (r, o)]


def _states(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = [{"a": torch.randn(64, 33, generator=g), "b": torch.randn(500, generator=g).to(torch.bfloat16)}]
    for _ in range(n - 1):
        new = {}
        for name, t in out[-1].items():
            t = t.clone()
            idx = torch.randint(0, t.numel(), (t.numel() // 20,), generator=g)
            t.view(-1)[idx] = (t.view(-1)[idx].float() * 1.5 + 0.25).to(t.dtype)
            new[name] = t
        out.append(new)
    return out


def _encoded(model: str, n: int = 4):
    states = _states(n)
    return [encode_keyframe(states[0], model=model, version=1)] + [
        encode_delta(states[v - 2], states[v - 1], model=model, version=v, parent=v - 1) for v in range(2, n + 1)]


def _tweak(m: Manifest, fn) -> Manifest:
    return replace(m, tensors=tuple(fn(t) for t in m.tensors), signature=None).sign(KEY)


async def test_crafted_manifests_are_format_errors_not_500s(pair):
    o, _ = pair
    enc = _encoded("crafted")
    async with session() as s:
        await publish(s, o.url, enc[0].manifest.sign(KEY), list(enc[0].blobs.items()))
        m2 = enc[1].manifest.sign(KEY)
        for bid, data in enc[1].blobs.items():
            async with s.put(f"{o.url}/v1/blobs/{bid}", data=data, headers={"Authorization": "Bearer " + _token(o)}) as r:
                assert r.status in (200, 201)
        huge = _tweak(m2, lambda t: replace(t, shape=(16, 1 << 48)) if t.name == "a" else t)
        status, body = await put_manifest(s, o.url, huge)
        assert (status, body["error"]["code"]) == (400, "format"), body
        assert "dimension" in body["error"]["message"]
        text = m2.to_json().decode().replace('"version":2', '"version":' + "9" * 5000)
        status, body = await put_manifest(s, o.url, m2, body=text.encode())
        assert (status, body["error"]["code"]) == (400, "format"), body
        status, body = await put_manifest(s, o.url, m2)  # the honest one still goes in
        assert status in (200, 201), body


def _token(o) -> str:
    return (o.workdir / "token").read_text().strip()


async def test_relay_squash_of_crafted_chains_answers_at_once(pair):
    o, r = pair
    async with session() as s:
        # blobs that patch tensors the manifests do not list: 422, quickly, from origin and relay
        enc = _encoded("renamed")
        for i, e in enumerate(enc):
            m = e.manifest if i == 0 else _tweak(e.manifest, lambda t: replace(t, name="z" + t.name))
            await publish(s, o.url, m.sign(KEY) if m.signature is None else m, list(e.blobs.items()))
        await wait_head(s, r.url, "renamed", 4)
        for url in (r.url, o.url):
            t0 = time.monotonic()
            async with s.get(f"{url}/v1/models/renamed/delta", params={"from": "2", "to": "4"}) as resp:
                body = await resp.json(content_type=None)
                assert (resp.status, body["error"]["code"]) == (422, "integrity"), body
            assert time.monotonic() - t0 < 10
        # a huge claimed shape (2^34 elements, within the limits) with few changes: built at once
        enc = _encoded("bigshape")
        for i, e in enumerate(enc):
            m = e.manifest if i == 0 else _tweak(e.manifest, lambda t: replace(t, shape=(1 << 17, 1 << 17)) if t.name == "a" else t)
            await publish(s, o.url, m.sign(KEY) if m.signature is None else m, list(e.blobs.items()))
        await wait_head(s, r.url, "bigshape", 4)
        t0 = time.monotonic()
        async with s.get(f"{r.url}/v1/models/bigshape/delta", params={"from": "2", "to": "4"}) as resp:
            assert resp.status == 200, await resp.text()
            assert json.loads(await resp.read())["tensors"][0]["shape"] == [1 << 17, 1 << 17]
        assert time.monotonic() - t0 < 10
        async with s.get(f"{r.url}/healthz") as resp:  # still serving
            assert resp.status == 200
