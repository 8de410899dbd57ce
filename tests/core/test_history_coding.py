"""History-conditioned coding (deltasync/history.py): every chunk round-trips bit for bit against the history
it was coded with, the history advances as both ends would keep it, and bad input is a FormatError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltasync import history as hc
from deltasync.codec import EncodeOptions, encode_delta
from deltasync.conditioned import CondTables
from deltasync.errors import FormatError
from deltasync.values import changes_from_words


class _Streams:
    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {}

    def append(self, name: str, data: np.ndarray) -> None:
        self.parts.setdefault(name, []).append(np.asarray(data, np.uint8))

    def nbytes(self) -> int:
        return sum(p.size for ps in self.parts.values() for p in ps)


def _code(chunks):
    """chunks: [(old words, new words, start, history)] -> (streams, [(raw, count)], changes) of one blob."""
    coder = hc.HistoryBlobCoder()
    meta, expected = [], []
    for old, new, start, hist in chunks:
        rel = np.flatnonzero(old != new)
        ch = changes_from_words(rel + start, old[rel], new[rel], is_float=True)
        rec: dict = {}
        raw = coder.add(rec, hc.ranks(ch, start, old.size, hist), ch)
        assert rec["mode"] == "ansh"
        meta.append((raw, len(ch)))
        expected.append(ch)
    out = _Streams()
    coder.finish(out)
    return out, meta, expected


def _decode_all(out, meta, chunks):
    tables = CondTables.parse(out.parts["anshm"][0])
    got = []
    for (raw, count), msg, (old, _, start, hist) in zip(meta, out.parts["ansh"], chunks):
        got.append(hc.decode_chunk(tables, msg.view("<u2"), raw, count, start, old.size, 2, hist))
    return got


def _same(a, b) -> None:
    np.testing.assert_array_equal(a.positions, b.positions)
    np.testing.assert_array_equal(a.raw, b.raw)
    np.testing.assert_array_equal(a.values, b.values)


def _trace(n: int, steps: int, seed: int = 0):
    """bf16 words of fp32 masters of magnitudes 1e-4..1e-1, each moving at its own steady pace of about 1e-6
    (Adam's steps are ~lr whatever the weight): small words change every few steps, large ones rarely."""
    g = torch.Generator().manual_seed(seed)
    w = torch.sign(torch.randn(n, generator=g)) * 10 ** (torch.rand(n, generator=g) * 3 - 4)
    pace = torch.sign(torch.randn(n, generator=g)) * (0.5 + torch.rand(n, generator=g) * 0.5) * 1e-6
    out = []
    for _ in range(steps + 1):
        out.append(w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy())
        w = w + pace
    return out


def _hist(pos, ages, prevs=None) -> hc.ChunkHistory:
    pos = np.asarray(pos, np.int64)
    return hc.ChunkHistory(pos, np.asarray(ages, np.uint8),
                           np.zeros(pos.size, np.uint8) if prevs is None else np.asarray(prevs, np.uint8))


def test_advance_ages_the_history_and_drops_what_is_older_than_the_depth():
    h = _hist([2, 5, 9], [1, 3, 2], [0, 0, 3])
    h2 = hc.advance(h, np.array([0, 5, 7]), depth=3)
    assert h2.positions.tolist() == [0, 2, 5, 7, 9] and h2.ages.tolist() == [1, 2, 1, 1, 3]
    assert h2.prevs.tolist() == [0, 0, 0, 0, 0]  # 5's change before was 4 deltas ago: past the depth; 9's too
    h3 = hc.advance(h2, np.array([2]), depth=3)
    assert h3.positions.tolist() == [0, 2, 5, 7] and h3.ages.tolist() == [2, 1, 2, 2]
    assert h3.prevs.tolist() == [0, 3, 0, 0]  # 2 changed now and 3 deltas ago
    h4 = hc.advance(h3, np.array([], np.int64), depth=4)
    assert h4.ages.tolist() == [3, 2, 3, 3] and h4.prevs.tolist() == [0, 4, 0, 0]
    with pytest.raises(ValueError, match="depth"):
        hc.advance(h, np.array([1]), depth=0)


def test_contexts_class_the_age_and_the_interval():
    h = _hist([0, 1, 2, 3, 4], [1, 2, 3, 9, 1], [0, 3, 7, 10, 2])
    # (age class - 1) * 6 + interval class + 1: interval none / 1 / 3-4 / 1 / 1
    assert h.contexts().tolist() == [1, 6 + 1 + 1, 12 + 3 + 1, 24 + 1 + 1, 0 + 1 + 1]
    assert int(h.contexts().max()) <= hc.N_HOT


def test_a_trace_round_trips_step_after_step_and_the_history_makes_it_smaller():
    words = _trace(200_000, 12)
    n, chunk = words[0].size, 1 << 15
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    hists = {s: hc.ChunkHistory.empty() for s, _ in spans}
    sizes = []
    for t in range(12):
        old, new = words[t], words[t + 1]
        chunks = [(old[s:e], new[s:e], s, hists[s]) for s, e in spans if (old[s:e] != new[s:e]).any()]
        out, meta, expected = _code(chunks)
        for want, got in zip(expected, _decode_all(out, meta, chunks)):
            _same(want, got)
        sizes.append(out.nbytes() + sum(r.nbytes for r, _ in meta))
        for s, e in spans:
            hists[s] = hc.advance(hists[s], np.flatnonzero(old[s:e] != new[s:e]), depth=8)
    # the first step has no history: the same models as ansx with one context; later steps know the hot words
    t0 = {"w": torch.from_numpy(words[10].view(np.int16)).view(torch.bfloat16)}
    t1 = {"w": torch.from_numpy(words[11].view(np.int16)).view(torch.bfloat16)}
    free = sum(len(b) for b in encode_delta(t0, t1, model="m", version=1, parent=0,
                                            options=EncodeOptions()).blobs.values())
    assert abs(sizes[0] - free) < 0.02 * free, (sizes, free)
    assert sizes[10] < 0.9 * free, (sizes, free)


@pytest.mark.parametrize("case", ["cold only", "all hot", "edges", "whole chunk in the history"])
def test_edge_histories_round_trip(case):
    rng = np.random.default_rng(3)
    n = 4096
    old = rng.integers(0, 1 << 15, n, dtype=np.uint16)
    new = old.copy()
    if case == "cold only":
        hist = hc.ChunkHistory.empty()
        idx = rng.choice(n, 40, replace=False)
    elif case == "all hot":
        hp = np.sort(rng.choice(n, 300, replace=False))
        hist = _hist(hp, rng.integers(1, 5, hp.size), rng.integers(5, 9, hp.size) * rng.integers(0, 2, hp.size))
        idx = rng.choice(hp, 50, replace=False)
    elif case == "edges":
        hist = _hist([0, 17, n - 1], [2, 1, 1])
        idx = np.array([0, 1, 16, 17, 18, n - 2, n - 1])
    else:
        hist = _hist(np.arange(n), rng.integers(1, 9, n))
        idx = rng.choice(n, 700, replace=False)
    new[idx] += rng.integers(1, 40, idx.size).astype(np.uint16)
    new[idx[:3]] ^= 0x8000  # sign flips: raw words
    chunks = [(old, new, 1000, hist)]
    out, meta, expected = _code(chunks)
    _same(expected[0], _decode_all(out, meta, chunks)[0])


def test_bad_messages_and_wrong_histories_are_format_errors():
    words = _trace(50_000, 3)
    hist = hc.advance(hc.ChunkHistory.empty(), np.flatnonzero(words[0] != words[1]), depth=4)
    hist = hc.advance(hist, np.flatnonzero(words[1] != words[2]), depth=4)
    chunks = [(words[2], words[3], 0, hist)]
    out, meta, expected = _code(chunks)
    tables = CondTables.parse(out.parts["anshm"][0])
    msg = out.parts["ansh"][0].view("<u2")
    raw, count = meta[0]
    n = words[2].size
    with pytest.raises(FormatError, match="ansh chunk"):
        hc.decode_chunk(tables, msg[: msg.size - 3], raw, count, 0, n, 2, hist)  # truncated
    with pytest.raises(FormatError, match="ansh chunk"):  # a history out of order
        hc.decode_chunk(tables, msg, raw, count, 0, n, 2, hc.ChunkHistory(hist.positions[::-1].copy(), hist.ages, hist.prevs))
    with pytest.raises(FormatError, match="ansh chunk"):  # a history position past the chunk
        hc.decode_chunk(tables, msg, raw, count, 0, 10, 2, hist)
    # another history: refused, or other positions (the fingerprints after an apply catch those)
    other = hc.ChunkHistory(hist.positions[1:].copy(), hist.ages[1:].copy(), hist.prevs[1:].copy())
    try:
        got = hc.decode_chunk(tables, msg, raw, count, 0, n, 2, other)
    except FormatError:
        return
    assert not np.array_equal(got.positions, expected[0].positions)
