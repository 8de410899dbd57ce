"""Cryptographic blob digests checked by the parties that hold a public key: the origin on commit, the
subscriber's blob reads. In-process servers on 127.0.0.1 (real aiohttp, real HTTP), real manifests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltasync.client.http import HttpClient
from deltasync.codec import encode_delta
from deltasync.digest import blob_digest
from deltasync.errors import IntegrityError, SignatureError, UpstreamError
from deltasync.manifest import BlobRef
from deltasync.server.config import ServerConfig
from deltasync.signing import Ed25519Signer
from inprocess_servers import FAST, serving
from server_fixtures import TOKEN

PUBLISHER = Ed25519Signer.generate()


def _origin(**kw) -> ServerConfig:
    return ServerConfig(role="origin", host="127.0.0.1", port=0, store_kind="memory", store_dir=None, token=TOKEN,
                        verifier=PUBLISHER.verifier(), fsync=False, timeouts=FAST, **kw)


def _keyframe_and_delta():
    from deltasync.keyframe import encode_keyframe
    old = {"w": torch.arange(256, dtype=torch.float32)}
    new = {"w": old["w"].clone()}
    new["w"][[3, 40, 200]] += 1
    kf = encode_keyframe(old, model="policy", version=0)
    delta = encode_delta(old, new, model="policy", version=1, parent=0)
    return kf, delta


async def test_origin_with_a_public_key_checks_every_digest_on_commit():
    kf, delta = _keyframe_and_delta()
    async with serving(_origin()) as (url, svc):
        async with HttpClient([url], token=TOKEN) as c:
            for enc in (kf, delta):
                for bid, data in enc.blobs.items():
                    await c.put_blob(bid, data)
            await c.put_manifest("policy", 0, kf.manifest.with_digests(kf.blobs).sign(PUBLISHER).to_json())
            # the publisher's own key, but a digest that is not the stored bytes' (a crafted blob, or a bug)
            m = delta.manifest.with_digests(delta.blobs)
            b0 = m.blobs[0]
            lying = dataclasses.replace(m, blobs=(dataclasses.replace(b0, digest=blob_digest(b"other bytes")),)
                                        + m.blobs[1:]).sign(PUBLISHER)
            with pytest.raises(IntegrityError, match="stored bytes hash to"):
                await c.put_manifest("policy", 1, lying.to_json())
            assert svc.store.head("policy") == 0
            # unsigned, or signed without digests: refused by the public key
            with pytest.raises(SignatureError):
                await c.put_manifest("policy", 1, delta.manifest.to_json())
            await c.put_manifest("policy", 1, m.sign(PUBLISHER).to_json())
            assert svc.store.head("policy") == 1
            # a blob uploaded before a restart (no digest kept from its upload) is reread at commit
            svc.intake._digests.clear()
            kf2 = dataclasses.replace(kf.manifest, model="policy2")
            await c.put_manifest("policy2", 0, kf2.with_digests(kf.blobs).sign(PUBLISHER).to_json())


async def test_subscriber_reads_check_the_signed_digest():
    kf, _ = _keyframe_and_delta()
    async with serving(_origin()) as (url, _svc):
        async with HttpClient([url], token=TOKEN) as c:
            bid, data = next(iter(kf.blobs.items()))
            await c.put_blob(bid, data)
            assert await c.get_blob(bid, len(data), digest=blob_digest(data)) == data
            with pytest.raises(UpstreamError, match="signed manifest says"):  # every source failed it
                await c.get_blob(bid, len(data), digest="blake3:" + "0" * 64)
