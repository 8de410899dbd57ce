"""The servers' pure parts and the disk store, without any process or socket."""

from __future__ import annotations

import argparse
import os

import pytest

from deltasync.errors import ChainError, FormatError, IntegrityError, NotFoundError, SignatureError
from deltasync.server.cli import parse_listen, parse_size
from deltasync.server.errors import MissingBlobsError, RangeError, UpstreamTimeout, error_code
from deltasync.sse import SSEDecoder, format_event
from deltasync.server.metrics import Metrics, parse_metrics
from deltasync.server.http.ranges import etag_matches, if_range_allows, parse_range
from deltasync.server.storage.store import DiskStore
from server_fixtures import delta, keyframe, make_blob


@pytest.mark.parametrize("header, size, expected", [
    (None, 100, None),
    ("bytes=0-9", 100, (0, 10)),
    ("bytes=10-", 100, (10, 100)),
    ("bytes=-10", 100, (90, 100)),
    ("bytes=-1000", 100, (0, 100)),
    ("bytes=90-1000", 100, (90, 100)),
    ("bytes=99-99", 100, (99, 100)),
    ("bytes=5-4", 100, None),  # invalid: ignored
    ("bytes=0-1,5-6", 100, None),  # multi-range: ignored (whole blob)
    ("items=0-1", 100, None),
    ("bytes=-", 100, None),
    ("bytes=abc", 100, None),
])
def test_parse_range(header, size, expected):
    assert parse_range(header, size) == expected


@pytest.mark.parametrize("header, size", [("bytes=100-", 100), ("bytes=100-200", 100), ("bytes=-0", 100),
                                          ("bytes=0-", 0), ("bytes=-5", 0)])
def test_unsatisfiable_ranges(header, size):
    with pytest.raises(RangeError) as e:
        parse_range(header, size)
    assert e.value.size == size and e.value.http_status == 416


def test_conditional_headers():
    tag = '"ab"'
    assert etag_matches('"ab"', tag) and etag_matches('W/"ab"', tag) and etag_matches('"x", "ab"', tag)
    assert etag_matches("*", tag) and not etag_matches('"x"', tag) and not etag_matches(None, tag)
    assert if_range_allows(None, tag) and if_range_allows('"ab"', tag)
    assert not if_range_allows('"x"', tag) and not if_range_allows("Wed, 21 Oct 2015 07:28:00 GMT", tag)


def test_sse_decoder_handles_any_chunking():
    stream = (format_event("head", {"model": "m", "version": 1}) + b": keepalive\n\n"
              + format_event("version", {"model": "m", "version": 2}, id="2") + b"retry: 10\n\n"
              + b"event: x\r\ndata: a\r\ndata: b\r\n\r\n")
    for step in (1, 2, 7, len(stream)):
        dec = SSEDecoder()
        events = []
        for i in range(0, len(stream), step):
            events += dec.feed(stream[i:i + step])
        assert [(e.event, e.data, e.id) for e in events] == [
            ("head", '{"model":"m","version":1}', None),
            ("version", '{"model":"m","version":2}', "2"),
            ("x", "a\nb", "2"),
        ]


def test_metrics_render_and_parse():
    m = Metrics(role="relay")
    m.inc("bytes_out", 5)
    m.add_gauge("head_version", "h", lambda: [({"model": 'a"b'}, 3), ({"model": "c"}, 1.5)])
    text = m.render()
    assert "# TYPE deltasync_bytes_out_total counter" in text
    parsed = parse_metrics(text)
    assert parsed["deltasync_bytes_out_total"] == 5
    assert parsed['deltasync_head_version{model="a\\"b"}'] == 3
    assert parsed['deltasync_head_version{model="c"}'] == 1.5
    assert parsed['deltasync_info{role="relay"}'] == 1


@pytest.mark.parametrize("err, code", [
    (FormatError("x"), "format"), (IntegrityError("x"), "integrity"), (SignatureError("x"), "signature"),
    (ChainError("x"), "chain"), (NotFoundError("x"), "not_found"), (UpstreamTimeout("x"), "upstream_timeout"),
    (MissingBlobsError("x", missing=[]), "missing_blobs"),
])
def test_error_codes(err, code):
    assert error_code(err) == code


def test_cli_parsers():
    assert parse_size("123") == 123 and parse_size("64M") == 64 << 20 and parse_size("10GiB") == 10 << 30
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0) and parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("12X", "-1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_listen("localhost")


# -- the disk store ------------------------------------------------------------------------------

async def _put(store: DiskStore, bid: str, data: bytes) -> None:
    await store.put_blob_bytes(bid, data)


async def test_store_survives_reopen_and_drops_partials(tmp_path):
    store = DiskStore(tmp_path)
    store.open()
    bid, data = make_blob(1000, 1)
    await _put(store, bid, data)
    await store.put_manifest(keyframe("m", 1, [(bid, data)]), announce=True)
    part = store.new_partial(make_blob(10, 2)[0])
    part.write(b"partial")  # never committed: a crash mid-write
    with pytest.raises(IntegrityError):
        await store.new_partial(make_blob(10, 3)[0]).commit()  # wrong bytes never enter the store

    again = DiskStore(tmp_path)
    again.open()
    assert again.has_blob(bid) and again.blob_size(bid) == len(data)
    assert again.read_blob(bid) == data
    assert again.head("m") == 1 and again.read_manifest("m", 1) == keyframe("m", 1, [(bid, data)]).to_json()
    assert list((tmp_path / "tmp").iterdir()) == []
    assert again.blob_count == 1


async def test_store_evicts_least_recently_used_unpinned_blobs(tmp_path):
    store = DiskStore(tmp_path, budget=10_000, retention=1)
    store.open()
    kf_blob = make_blob(3000, 10)
    await _put(store, *kf_blob)
    await store.put_manifest(keyframe("m", 1, [kf_blob]), announce=True)  # newest keyframe: pinned
    old = [make_blob(2000, 11 + i) for i in range(3)]
    for b in old:
        await _put(store, *b)
    store.touch(old[0][0])  # recently used: evicted last
    d2 = make_blob(2500, 20)
    await _put(store, *d2)  # 3000 + 6000 + 2500 > 10000: evict the least recently used unpinned
    await store.put_manifest(delta("m", 2, 1, [d2]), announce=True)
    assert store.blob_bytes <= 10_000
    assert store.has_blob(kf_blob[0]) and store.has_blob(d2[0])
    assert not store.has_blob(old[1][0]) and store.has_blob(old[0][0])
    assert not (tmp_path / "blobs" / old[1][0][:2] / old[1][0]).exists()
    assert store.is_pinned(kf_blob[0]) and store.is_pinned(d2[0]) and not store.is_pinned(old[0][0])

    # Everything pinned or leased: the store goes over budget rather than drop what it must serve.
    store.lease([old[0][0], old[2][0]])
    big = make_blob(6000, 30)
    await _put(store, *big)
    await store.put_manifest(delta("m", 3, 2, [big]), announce=True)
    assert store.has_blob(big[0]) and store.has_blob(old[0][0])
    store.make_room(9000)  # room for another 9000 bytes: only leased and pinned blobs are left
    assert store.over_budget
    store.unlease([old[0][0], old[2][0]])
    store.make_room(0)
    assert not store.has_blob(old[0][0])  # released leases are fair game again
    assert not store.is_pinned(d2[0])  # retention 1: only v3 and the keyframe v1 are pinned


async def test_store_ignores_stray_files(tmp_path):
    store = DiskStore(tmp_path)
    store.open()
    (tmp_path / "blobs" / "zz").mkdir()
    (tmp_path / "blobs" / "zz" / "not-a-blob").write_bytes(b"x")
    (tmp_path / "models" / "m").mkdir()
    (tmp_path / "models" / "m" / f"{5:020d}.json").write_bytes(b"{garbage")
    again = DiskStore(tmp_path)
    again.open()
    assert again.blob_count == 0 and again.head("m") is None
    assert os.path.exists(tmp_path / "blobs" / "zz" / "not-a-blob")
