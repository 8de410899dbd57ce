"""The in-memory store behind the BlobStore seam: its own units, and an origin and a relay that
keep everything in memory serving a real publish → relay → read back over loopback HTTP."""

from __future__ import annotations

import pytest

from deltasync.errors import IntegrityError, NotFoundError
from deltasync.server.storage.blobstore import FileBacked
from deltasync.server.storage.store import DiskStore, MemoryStore
from inprocess_servers import origin_config, relay_config, serving
from server_fixtures import (
    delta, get_bytes, keyframe, make_blob, metrics, publish, put_blob, session, wait_for, wait_head,
)

MODEL = "mem"


async def test_memory_store_keeps_blobs_manifests_and_budget():
    evicted = []
    store = MemoryStore(budget=10_000, retention=1, on_evict=lambda n, b: evicted.append((n, b)))
    await store.load()
    kf = make_blob(3000, 1)
    await store.put_blob_bytes(*kf)
    await store.put_manifest(keyframe(MODEL, 1, [kf]), announce=True)
    assert store.head(MODEL) == 1 and store.is_pinned(kf[0])
    assert await store.get_manifest(MODEL, 1) == keyframe(MODEL, 1, [kf]).to_json()
    with pytest.raises(NotFoundError):
        await store.get_manifest(MODEL, 2)

    old = make_blob(6000, 2)
    await store.put_blob_bytes(*old)
    reader = await store.open_blob(old[0])
    assert reader is not None and not isinstance(reader, FileBacked)  # streamed, never sendfile'd
    big = make_blob(5000, 3)
    await store.put_blob_bytes(*big)  # 3000 + 6000 + 5000 > 10000: the unpinned old blob goes
    assert not store.has_blob(old[0]) and store.has_blob(kf[0]) and evicted == [(1, 6000)]
    assert await reader.read(0, 10**9) == old[1]  # an open reader keeps what it reads
    assert await store.open_blob(old[0]) is None

    part = await store.open_partial(make_blob(10, 4)[0])
    part.write(b"wrong bytes")
    assert await part.read(6, 100) == b"bytes"  # readable while it grows
    with pytest.raises(IntegrityError):
        await part.commit()
    part.close()
    assert store.blob_count == 2
    assert store.needs_verify(big[0]) is False and await store.verify_cached(big[0])


async def test_disk_store_reader_is_file_backed(tmp_path):
    store = DiskStore(tmp_path, fsync=False)
    await store.load()
    bid, data = make_blob(5000, 5)
    await store.put_blob_bytes(bid, data)
    reader = await store.open_blob(bid)
    try:
        assert isinstance(reader, FileBacked) and reader.size == len(data)
        assert await reader.read(4990, 100) == data[4990:]
    finally:
        reader.close()


async def test_memory_origin_and_relay_serve_a_publish_bit_exact():
    kf_blobs = [make_blob(3 << 20, 10), make_blob(70_000, 11)]  # one over the 1 MiB streaming piece
    d_blobs = [make_blob(40_000, 12)]
    kf = keyframe(MODEL, 1, kf_blobs)
    d2 = delta(MODEL, 2, 1, d_blobs)
    async with serving(origin_config(store_kind="memory")) as (o_url, o_svc), \
            serving(relay_config([o_url], store_kind="memory")) as (r_url, r_svc):
        assert isinstance(o_svc.store, MemoryStore) and isinstance(r_svc.store, MemoryStore)
        async with session() as s:
            await publish(s, o_url, kf, kf_blobs)
            await publish(s, o_url, d2, d_blobs)
            await wait_head(s, r_url, MODEL, 2)
            for bid, data in kf_blobs + d_blobs:
                status, headers, body = await get_bytes(s, f"{r_url}/v1/blobs/{bid}")
                assert status == 200 and body == data, bid
                assert {k.lower(): v for k, v in headers.items()}["etag"] == f'"{bid}"'
            bid, data = kf_blobs[0]
            status, headers, body = await get_bytes(s, f"{r_url}/v1/blobs/{bid}",
                                                    {"Range": f"bytes={len(data) - 1_500_000}-"})
            assert status == 206 and body == data[-1_500_000:]
            for m in (kf, d2):
                status, _, body = await get_bytes(s, f"{r_url}/v1/models/{MODEL}/versions/{m.version}")
                assert status == 200 and body == m.to_json()
            status, headers, body = await get_bytes(s, f"{r_url}/v1/models/{MODEL}/head")
            assert status == 200 and body == d2.to_json() and headers["X-Deltasync-Version"] == "2"
            status, _, body = await get_bytes(s, f"{r_url}/v1/models/{MODEL}/delta?from=1&to=2")
            assert status == 200 and body == d2.to_json()
            # A blob no version names: the relay fetches it on demand and streams it to the reader
            # while it arrives (cut-through from a growing in-memory blob).
            loose_id, loose = make_blob(2 << 20, 13)
            assert await put_blob(s, o_url, loose_id, loose) == 201
            status, headers, body = await get_bytes(s, f"{r_url}/v1/blobs/{loose_id}")
            assert status == 200 and body == loose
            assert {k.lower(): v for k, v in headers.items()}["x-deltasync-cache"] == "miss"
            r_metrics = await metrics(s, r_url)
            total = sum(len(d) for _, d in kf_blobs + d_blobs) + 1_500_000 + len(loose)
            assert r_metrics["deltasync_bytes_out_total"] == total
            assert r_metrics["deltasync_upstream_fetches_total"] == 4

            async def stored():
                return r_svc.store.blob_count == 4
            await wait_for(stored, what="the relay to keep all four blobs")
        assert r_svc.store.head(MODEL) == 2
        assert o_svc.store.files.blobs[d_blobs[0][0]] == d_blobs[0][1]
