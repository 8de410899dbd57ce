"""The bucket object layer (server/storage/s3objects.py) and layout (server/storage/bucketlayout.py) against real S3
servers: rclone serve s3 (no Range, no conditional writes) and moto in server mode (both)."""

from __future__ import annotations

import os

import pytest

from deltasync.errors import FormatError, StorageError
from deltasync.server.storage.bucketlayout import (
    HeadEntry,
    blob_key,
    decode_heads,
    encode_heads,
    manifest_key,
    merge_heads,
    parse_blob_key,
    parse_manifest_key,
)
from deltasync.server.errors import UnavailableError
from deltasync.server.storage.bucketlayout import parse_bucket_url
from deltasync.server.storage.s3objects import Bucket, aws_settings

from s3_fixtures import moto_s3, rclone_s3, bucket_env  # noqa: F401  (fixtures)


# -- names (pure) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text,bucket,prefix", [
    ("s3://weights", "weights", ""),
    ("s3://weights/", "weights", ""),
    ("s3://weights/fleet/a", "weights", "fleet/a"),
    ("s3://weights/fleet/a/", "weights", "fleet/a"),
])
def test_parse_bucket_url(text, bucket, prefix):
    loc = parse_bucket_url(text)
    assert (loc.bucket, loc.prefix, loc.url) == (bucket, prefix, None)


@pytest.mark.parametrize("text", ["http://x/y", "s3://", "s3://A_B", "s3://b/../x", "bucket+ftp://h/p", "s3://ab/x//y"])
def test_parse_bucket_url_refuses(text):
    with pytest.raises(ValueError):
        parse_bucket_url(text)


def test_plain_url_bucket_is_read_only():
    loc = parse_bucket_url("bucket+https://pub.example.com/fleet")
    assert loc.url == "https://pub.example.com/fleet" and loc.bucket is None


def test_keys_round_trip():
    bid = "ab" + "0" * 30
    assert blob_key(bid) == f"blobs/ab/{bid}" and parse_blob_key(blob_key(bid)) == bid
    assert parse_blob_key(f"blobs/cd/{bid}") is None and parse_blob_key("blobs/ab") is None
    assert manifest_key("m.kf", 7) == "models/m.kf/00000000000000000007.json"
    assert parse_manifest_key(manifest_key("m.kf", 7)) == ("m.kf", 7)
    assert parse_manifest_key("models/m/7.json") is None and parse_manifest_key("models/m/x/1.json") is None
    with pytest.raises(FormatError):
        manifest_key("../x", 1)


def test_heads_object():
    a = HeadEntry(version=3, kind="delta", state_fp="f" * 16)
    heads = {"m": a}
    assert decode_heads(encode_heads(heads)) == heads
    assert merge_heads(heads, "m", HeadEntry(version=2, kind="delta", state_fp="0" * 16)) is None
    assert merge_heads(heads, "m", HeadEntry(version=4, kind="delta", state_fp="0" * 16))["m"].version == 4
    for bad in (b"", b"[]", b'{"format":"x"}', b'{"format":"deltasync-heads","version":1,"models":{"m":{}}}'):
        with pytest.raises(FormatError):
            decode_heads(bad)


def test_aws_settings_read_shared_files(tmp_path):
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n"
                                                   "[other]\naws_access_key_id = O\naws_secret_access_key = OS\n")
    (tmp_path / ".aws" / "config").write_text("[profile other]\nregion = eu-west-1\n")
    s = aws_settings({}, tmp_path)
    assert s == {"access_key_id": "AK", "secret_access_key": "SK", "region": "us-east-1"}
    s = aws_settings({"AWS_PROFILE": "other"}, tmp_path)
    assert s["access_key_id"] == "O" and s["region"] == "eu-west-1"
    assert aws_settings({"AWS_ACCESS_KEY_ID": "E", "AWS_REGION": "x"}, tmp_path) == {}


# -- against real servers -------------------------------------------------------------------------------

@pytest.fixture(params=["rclone", "moto"])
def server(request, monkeypatch):
    s = request.getfixturevalue("rclone_s3" if request.param == "rclone" else "moto_s3")
    bucket_env(s, monkeypatch)
    return s


def _bucket(server, prefix: str) -> Bucket:
    return Bucket(parse_bucket_url(server.url(prefix), endpoint=server.endpoint), read_timeout=10.0)


async def _read_all(stream) -> bytes:
    size, pieces = stream
    out = bytearray()
    async for p in pieces:
        out += p
    return bytes(out)


async def test_put_get_stream_list_delete(server):
    b = _bucket(server, f"objects-{os.urandom(3).hex()}")
    data = os.urandom(3 << 20)
    assert await b.put("blobs/x", data)
    assert await b.get("blobs/x") == data
    assert await b.head("blobs/x") == len(data)
    assert await b.get("blobs/none") is None and await b.head("blobs/none") is None
    assert await b.open_stream("blobs/none") is None
    # from an offset: a ranged GET where the server honours it, the whole object skipped otherwise
    for offset in (0, 1, (1 << 20) + 5, len(data) - 1):
        assert await _read_all(await b.open_stream("blobs/x", offset)) == data[offset:]
    await b.put("blobs/y", b"y")
    listed = await b.list("blobs/")
    assert [o.key for o in listed] == ["blobs/x", "blobs/y"] and listed[0].size == len(data)
    assert [o.key for o in await b.list("blobs/", after="blobs/x")] == ["blobs/y"]
    await b.delete("blobs/x")
    await b.delete("blobs/x")  # deleting what is gone is fine
    assert await b.get("blobs/x") is None


async def test_streamed_multipart_upload_and_abort(server):
    b = _bucket(server, f"mp-{os.urandom(3).hex()}")
    data = os.urandom(20 << 20)  # several 8 MiB parts

    async def pieces(fail: bool):
        for i in range(0, len(data), 1 << 20):
            yield data[i:i + (1 << 20)]
        if fail:
            raise ValueError("hash mismatch at the end")

    await b.put_stream("big", pieces(False))
    assert await b.get("big") == data
    with pytest.raises(ValueError, match="hash mismatch"):
        await b.put_stream("aborted", pieces(True))
    assert await b.head("aborted") is None  # an aborted upload leaves nothing visible


async def test_conditional_create_probe(server):
    b = _bucket(server, f"cond-{os.urandom(3).hex()}")
    assert await b.probe_conditional_create() is server.conditional_writes
    assert await b.put("m", b"1", create=True)
    second = await b.put("m", b"2", create=True)
    assert second is (not server.conditional_writes)
    assert await b.get("m") == (b"1" if server.conditional_writes else b"2")
    assert await b.list(".probe/") == []  # the probe cleaned up after itself


async def test_failing_bucket_gives_storage_error(server, monkeypatch):
    missing = Bucket(parse_bucket_url(server.url("x", bucket="no-such-bucket"), endpoint=server.endpoint),
                     read_timeout=5.0)
    with pytest.raises(StorageError, match="did not take the write"):
        await missing.put("k", b"v")
    async def gen():
        yield b"x"
    with pytest.raises(StorageError):
        await missing.put_stream("k", gen())


async def test_dead_endpoint_gives_clear_errors(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = Bucket(parse_bucket_url("s3://weights/p", endpoint=f"http://127.0.0.1:{port}"), connect_timeout=1.0,
               read_timeout=1.0, environ={"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "AWS_REGION": "x"})
    with pytest.raises(StorageError, match="nothing partial was kept"):
        await b.put("k", b"v")
    with pytest.raises(UnavailableError):
        await b.get("k")
