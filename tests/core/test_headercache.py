"""deltasync/headercache.py: a large header's checked columns kept on disk by the SHA-256 of its text and the
file's size, read back by the next process that meets the same text (a trainer's every checkpoint), and never
trusted beyond what parsing the text gives: a damaged, truncated or foreign entry is ignored."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save

from deltasync import headercache, tensorfile
from deltasync.tensorfile import header_columns, parse_header


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASYNC_HEADER_CACHE", str(tmp_path / "hc"))
    monkeypatch.setattr(headercache, "MIN_ENTRIES", 64)
    return tmp_path / "hc"


def _file(n: int = 300, *, meta=None) -> bytes:
    g = torch.Generator().manual_seed(n)
    state = {f"model.layers.{i // 10}.mlp.experts.{i % 10}.w": torch.randn(3, 4, generator=g).bfloat16()
             for i in range(n)}
    state["model.norm"] = torch.randn(7, generator=g)
    state["model.ids"] = torch.zeros(5, dtype=torch.int64)
    state["model.empty"] = torch.zeros(0, 2)
    return save(state, metadata=meta)


def _parse(buf: bytes):
    tensorfile._LAST_HEADER = None  # no in-process shortcut
    return parse_header(buf)


def _loop(buf: bytes, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(headercache, "load", lambda *a: (None, None))
        return _parse(buf)


def test_a_header_parsed_once_is_read_back_as_parsing_gives_it(cache, monkeypatch):
    buf = _file(meta={"format": "pt"})
    first = _parse(buf)
    assert len(list(cache.iterdir())) == 1
    calls = []
    monkeypatch.setattr(tensorfile, "_fast_json", lambda *a: calls.append(1))  # a second parse would call it
    again = _parse(buf)
    assert not calls and header_columns(again) is not None
    monkeypatch.undo()
    monkeypatch.setenv("DELTASYNC_HEADER_CACHE", str(cache))
    ref = _loop(buf, monkeypatch)
    assert again == first == ref and again.metadata == ref.metadata == {"format": "pt"}
    assert (again.data_start, again.size) == (ref.data_start, ref.size)
    c, r = header_columns(again), header_columns(first)
    assert c.names == r.names and c.dtypes == r.dtypes and c.shapes == r.shapes
    assert (c.starts == r.starts).all() and (c.stops == r.stops).all()


def test_small_headers_and_an_off_cache_keep_nothing(cache, monkeypatch):
    _parse(_file(20))
    assert not cache.exists() or not list(cache.iterdir())
    monkeypatch.setenv("DELTASYNC_HEADER_CACHE", "off")
    _parse(_file())
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_a_damaged_entry_is_ignored_and_the_text_parsed(cache, monkeypatch, damage):
    buf = _file()
    want = _parse(buf)
    (entry,) = cache.iterdir()
    raw = bytearray(entry.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw = bytearray(os.urandom(len(raw)))
    entry.write_bytes(bytes(raw))
    calls = []
    real = tensorfile._fast_json
    monkeypatch.setattr(tensorfile, "_fast_json", lambda t: calls.append(1) or real(t))
    assert _parse(buf) == want and calls == [1]


def test_an_entry_is_for_its_text_and_size_only(cache, monkeypatch):
    buf = _file()
    _parse(buf)
    other = bytearray(buf)
    other += b"\x00" * 8  # the same header text in a file of another size: its own key (and a parse that refuses it)
    with pytest.raises(Exception):
        _parse(bytes(other))
    changed = _file(meta={"step": "2"})  # another text
    assert _parse(changed) == _loop(changed, monkeypatch)
    assert len(list(cache.iterdir())) == 2


def test_an_unwritable_cache_is_no_error(tmp_path, monkeypatch):
    monkeypatch.setattr(headercache, "MIN_ENTRIES", 64)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DELTASYNC_HEADER_CACHE", str(blocker / "hc"))
    buf = _file()
    assert _parse(buf) == _loop(buf, monkeypatch)


def test_only_the_newest_entries_are_kept(cache, monkeypatch):
    monkeypatch.setattr(headercache, "KEEP", 3)
    for step in range(5):
        _parse(_file(meta={"step": str(step)}))
    assert len(list(cache.iterdir())) == 3
