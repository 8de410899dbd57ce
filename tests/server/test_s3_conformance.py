"""The BlobStore conformance table (tests/server/test_server_blobstore.py) run against the bucket store, on
both S3 servers: rclone serve s3 (writer lease, whole-object reads) and moto (conditional writes,
ranged reads). Same checks, same assertions; only the ``make`` fixture differs."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from deltasync.server.storage.bucketlayout import blob_key, parse_bucket_url
from deltasync.server.storage.s3objects import Bucket
from deltasync.server.storage.s3store import S3Files, S3Store
from s3_fixtures import bucket_env, moto_s3, rclone_s3  # noqa: F401  (fixtures)
from test_server_blobstore import (  # noqa: F401  (collected here with this module's ``make``)
    test_a_corrupt_stored_blob_is_dropped_not_served,
    test_blobs_round_trip,
    test_budget_evicts_unprotected_blobs_least_recently_used_first,
    test_growing_blob_is_readable_and_verified,
    test_manifests_heads_and_squashes,
)


@pytest.fixture(params=["rclone", "moto"])
async def make(request, tmp_path, monkeypatch):
    server = request.getfixturevalue("rclone_s3" if request.param == "rclone" else "moto_s3")
    bucket_env(server, monkeypatch)
    prefix = f"conf-{os.urandom(4).hex()}"
    stores: list[S3Store] = []

    async def new(**kw) -> S3Store:
        bucket = Bucket(parse_bucket_url(server.url(prefix), endpoint=server.endpoint), read_timeout=10.0)
        files = S3Files(bucket, tmp_path / f"scratch{len(stores)}", lease_ttl=3.0)
        store = S3Store(files, poll_interval=0, gc_interval=0, **kw)
        stores.append(store)
        await store.load()
        return store

    def corrupt(store: S3Store, bid: str) -> None:
        """Flip a bit of the blob's object in the bucket (from another thread: the table calls this
        synchronously while the store's loop is running)."""
        async def flip(bucket: Bucket) -> None:
            data = bytearray(await bucket.get(blob_key(bid)))
            data[0] ^= 1
            await bucket.put(blob_key(bid), bytes(data))
        errors: list[BaseException] = []

        def work() -> None:
            try:
                asyncio.run(flip(Bucket(store.files.bucket.location, read_timeout=10.0)))
            except BaseException as e:  # reported below
                errors.append(e)
        t = threading.Thread(target=work)
        t.start()
        t.join(30)
        if errors:
            raise errors[0]

    new.corrupt = corrupt
    yield new
    for s in stores:
        await s.close()
