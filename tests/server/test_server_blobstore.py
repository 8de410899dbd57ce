"""One behaviour for every ``BlobStore``: the same table of checks runs against the disk store and the
in-memory store (a later store, S3, adds itself to ``STORES``)."""

from __future__ import annotations

import pytest

from deltasync.errors import IntegrityError, NotFoundError
from deltasync.server.storage.store import DiskStore, IndexedStore, MemoryStore
from server_fixtures import delta, keyframe, make_blob

MODEL = "conf"


def _disk(tmp_path, **kw) -> DiskStore:
    return DiskStore(tmp_path / "store", fsync=False, **kw)


def _memory(tmp_path, **kw) -> MemoryStore:
    return MemoryStore(**kw)


def _corrupt_disk(store: DiskStore, bid: str) -> None:
    path = store.files.blob_path(bid)
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))


def _corrupt_memory(store: MemoryStore, bid: str) -> None:
    data = bytearray(store.files.blobs[bid])
    data[0] ^= 1
    store.files.blobs[bid] = bytes(data)


STORES = {"disk": (_disk, _corrupt_disk), "memory": (_memory, _corrupt_memory)}


@pytest.fixture(params=sorted(STORES))
def make(request, tmp_path):
    build, corrupt = STORES[request.param]

    async def new(**kw) -> IndexedStore:
        store = build(tmp_path, **kw)
        await store.load()
        return store
    new.corrupt = corrupt
    return new


async def test_blobs_round_trip(make):
    store = await make()
    bid, data = make_blob(100_000, 1)
    assert not store.has_blob(bid) and store.blob_size(bid) is None and await store.open_blob(bid) is None
    await store.put_blob_bytes(bid, data)
    await store.put_blob_bytes(bid, data)  # again: a no-op
    assert store.has_blob(bid) and store.blob_size(bid) == len(data) and store.blob_count == 1
    assert store.blob_bytes == len(data)
    assert await store.get_blob(bid) == data
    reader = await store.open_blob(bid)
    try:
        assert reader.size == len(data)
        assert await reader.read(99_990, 100) == data[99_990:]
        assert await reader.read(5, 10) == data[5:15]
    finally:
        reader.close()
    with pytest.raises(NotFoundError):
        await store.get_blob(make_blob(10, 2)[0])


async def test_growing_blob_is_readable_and_verified(make):
    store = await make()
    bid, data = make_blob(50_000, 3)
    part = await store.open_partial(bid)
    part.write(data[:20_000])
    assert part.written == 20_000 and await part.read(19_990, 100) == data[19_990:20_000]
    assert not store.has_blob(bid)  # not a stored blob until it commits
    part.reset()
    part.write(b"x" * 10)
    with pytest.raises(IntegrityError):
        part.verify()
    part.reset()
    part.write(data)
    await part.commit()
    part.close()
    assert store.has_blob(bid) and await store.get_blob(bid) == data and not store.needs_verify(bid)

    bad = await store.open_partial(make_blob(10, 4)[0])
    bad.write(b"0123456789")
    with pytest.raises(IntegrityError):
        await bad.commit()
    bad.close()
    assert store.blob_count == 1


async def test_manifests_heads_and_squashes(make):
    store = await make()
    blobs = [make_blob(1000, 5)]
    for bid, data in blobs:
        await store.put_blob_bytes(bid, data)
    kf, d2 = keyframe(MODEL, 1, blobs), delta(MODEL, 2, 1, blobs)
    assert store.head(MODEL) is None and store.info(MODEL, 1) is None
    await store.put_manifest(kf, announce=True)
    await store.put_manifest(d2, announce=False)  # stored, not announced (a relay pulling through)
    assert store.head(MODEL) == 1 and store.info(MODEL, 2).parent == 1
    assert await store.get_manifest(MODEL, 2) == d2.to_json()
    assert [i.version for i in store.index(MODEL).after(0, limit=10)] == [1]
    assert store.announce(MODEL, 2) and not store.announce(MODEL, 1)  # heads only move forward
    assert store.head(MODEL) == 2 and store.blob_refs(MODEL, 2) == d2.blobs
    with pytest.raises(NotFoundError):
        await store.get_manifest(MODEL, 3)
    assert await store.get_squash(MODEL, 0, 2) is None
    await store.put_squash(MODEL, 0, 2, b'{"squashed": true}')
    assert await store.get_squash(MODEL, 0, 2) == b'{"squashed": true}'


async def test_budget_evicts_unprotected_blobs_least_recently_used_first(make):
    evictions = []
    store = await make(budget=10_000, retention=1, on_evict=lambda n, b: evictions.append((n, b)))
    kf = make_blob(3000, 10)
    await store.put_blob_bytes(*kf)
    await store.put_manifest(keyframe(MODEL, 1, [kf]), announce=True)
    old = [make_blob(2000, 11 + i) for i in range(3)]
    for b in old:
        await store.put_blob_bytes(*b)
    (await store.open_blob(old[0][0])).close()  # served: recently used
    store.lease([old[1][0]])
    await store.put_blob_bytes(*make_blob(2500, 20))  # 11500 > 10000: the oldest unprotected goes
    assert [store.has_blob(b) for b, _ in old] == [True, True, False]
    assert evictions == [(1, 2000)] and store.pinned_bytes == 3000 and not store.over_budget
    store.make_room(20_000)  # everything unprotected goes, and it is still not enough
    assert store.over_budget and store.blob_bytes == 5000 and store.has_blob(kf[0]) and store.has_blob(old[1][0])
    store.make_room(0)
    assert not store.over_budget
    store.unlease([old[1][0]])
    store.make_room(6000)  # the released lease is fair game again; the pinned keyframe never is
    assert not store.has_blob(old[1][0]) and store.blob_bytes == 3000 and not store.over_budget


async def test_a_corrupt_stored_blob_is_dropped_not_served(make):
    store = await make()
    bid, data = make_blob(4000, 30)
    await store.put_blob_bytes(bid, data)
    assert await store.verify_cached(bid)
    make.corrupt(store, bid)
    assert not await store.verify_cached(bid)
    assert not store.has_blob(bid) and await store.open_blob(bid) is None
