"""deltasync/headercache.py: a large header's checked columns kept on disk by the BLAKE3 of its text and the
file's size, read back by the next process that meets the same text (a trainer's every checkpoint), and never
trusted beyond what parsing the text gives: a damaged, truncated or foreign entry is ignored."""

from __future__ import annotations

import os

import numpy as np
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


N_TENSORS = 303  # _file(300)'s tensors


def _pair(tmp_path, n: int = 300):
    """Two files of one header (a base and a step changing some words of every tensor), mapped."""
    from safetensors.torch import load

    base = load(_file(n))
    step = {k: v.clone() for k, v in base.items()}
    for k, v in step.items():
        if v.numel():
            w = v.view(-1).view(torch.int16) if v.element_size() == 2 else v.view(-1).view(torch.int32) \
                if v.element_size() == 4 else v.view(-1).view(torch.int64)
            w[:: 3] += 1
    (tmp_path / "a.safetensors").write_bytes(save(base))
    (tmp_path / "b.safetensors").write_bytes(save(step))
    tensorfile._LAST_HEADER = None
    return tensorfile.MappedTensorFile(tmp_path / "a.safetensors"), tensorfile.MappedTensorFile(tmp_path / "b.safetensors")


def _state_fps(tmp_path):
    from deltasync.codec import diff_states

    a, b = _pair(tmp_path)
    try:
        d = diff_states(a.host, b.host, update_old=False)
        assert d.flat is not None, "the mapped columnar path was not taken"
        return d.flat.state_fps(), d.flat.memo.get("lines_key")
    finally:
        a.close()
        b.close()


def test_a_diffs_state_lines_are_kept_beside_its_header_and_read_back(cache, tmp_path, monkeypatch):
    """``publish --base``'s state fingerprints of two mapped files hash lines made once per layout: the first
    diff keeps them beside the header's entry, the next reads them back and makes none; the fingerprints are
    those made without any cache."""
    from deltasync import fingerprint

    want, key = _state_fps(tmp_path)
    assert key is not None and (cache / f"{key}.lines").exists()
    real = fingerprint.StateLines.__init__
    monkeypatch.setattr(fingerprint.StateLines, "__init__", lambda *a: pytest.fail("lines made again"))
    assert _state_fps(tmp_path)[0] == want
    monkeypatch.setattr(fingerprint.StateLines, "__init__", real)
    monkeypatch.setenv("DELTASYNC_HEADER_CACHE", "off")
    assert _state_fps(tmp_path) == (want, None)


@pytest.mark.parametrize("damage", ["flipped", "other layout", "truncated", "reordered"])
def test_kept_lines_that_do_not_describe_the_layout_are_made_again(cache, tmp_path, monkeypatch, damage):
    """Lines read back are checked (their checksum, their count, and lines spread over the layout byte for byte):
    damaged ones, or consistent lines of another layout, are not used; the right ones are made and kept."""
    want, key = _state_fps(tmp_path)
    path = cache / f"{key}.lines"
    if damage == "flipped":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 1
        path.write_bytes(bytes(raw))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    else:
        order, hex_at, template = headercache.load_lines(key, N_TENSORS)
        t = template.copy()
        if damage == "other layout":  # a name spelled otherwise, its line as long: checksum and count hold
            at = bytes(t).index(b"model.layers.")
            t[at] = ord("M")
        else:  # two tensors' fingerprints hashed on each other's line
            order = order.copy()
            order[[0, 1]] = order[[1, 0]]
        headercache.store_lines(key, order, hex_at, t)
    assert _state_fps(tmp_path)[0] == want
    kept = headercache.load_lines(key, N_TENSORS)
    assert kept is not None and bytes(kept[2]) != b"" and fingerprint_lines_ok(kept, tmp_path)


def fingerprint_lines_ok(kept, tmp_path) -> bool:
    from deltasync.fingerprint import StateLines

    a, _ = _pair(tmp_path)
    try:
        c = header_columns(a.header)
        order = sorted(range(len(c.names)), key=c.names.__getitem__)
        from deltasync.dtypes import dtype_info

        return StateLines.of_parts(*kept).describes([c.names[i] for i in order],
                                                    [dtype_info(c.dtypes[i]).name for i in order],
                                                    [c.shapes[i] for i in order])
    finally:
        a.close()


def test_lines_go_with_their_entry(cache, tmp_path, monkeypatch):
    """The newest ``KEEP`` entries are kept with their lines; lines whose entry was pruned are removed, and
    none are kept for an entry that is not there."""
    monkeypatch.setattr(headercache, "KEEP", 1)
    _, key = _state_fps(tmp_path)
    assert (cache / f"{key}.lines").exists()
    _parse(_file(meta={"another": "header"}))
    assert not (cache / key).exists() and not (cache / f"{key}.lines").exists()
    headercache.store_lines(key, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8))
    assert not (cache / f"{key}.lines").exists()
