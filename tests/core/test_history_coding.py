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


def test_the_history_keeps_the_last_two_changes_within_the_depth_in_one_flat_column():
    h = hc.StateHistory({"b": ("bfloat16", (10,)), "a": ("float32", (4,))}, since=5, depth=3)
    assert h.offsets == {"a": 0, "b": 4} and h.words == 14 and h.version == 5
    h.advance(6, [("b", np.array([2, 5, 9])), ("a", np.array([1]))])
    h.advance(7, [("b", np.array([5]))])
    c = h.chunk("b", 0, 10)  # as coding the delta into v8 sees it
    assert c.positions.tolist() == [2, 5, 9] and c.ages.tolist() == [2, 1, 2] and c.prevs.tolist() == [0, 2, 0]
    assert h.chunk("a", 0, 4).positions.tolist() == [1] and h.chunk("b", 3, 9).positions.tolist() == [2]
    h.advance(8, [])
    h.advance(9, [("b", np.array([9]))])  # 2 and a's 1 are now 4 deltas old: gone; 9's change before (v6) too
    c = h.chunk("b", 0, 10)
    assert c.positions.tolist() == [5, 9] and c.ages.tolist() == [3, 1] and c.prevs.tolist() == [0, 0]
    assert len(h.chunk("a", 0, 4)) == 0 and len(h) == 2 and h.meta == "5:3"
    with pytest.raises(ValueError, match="v9"):
        h.advance(11, [])
    with pytest.raises(ValueError, match="depth"):
        hc.StateHistory({}, since=0, depth=0)


def test_contexts_class_the_age_and_the_interval():
    h = _hist([0, 1, 2, 3, 4], [1, 2, 3, 9, 1], [0, 3, 7, 10, 2])
    # (age class - 1) * 6 + interval class + 1: interval none / 1 / 3-4 / 1 / 1
    assert h.contexts().tolist() == [1, 6 + 1 + 1, 12 + 3 + 1, 24 + 1 + 1, 0 + 1 + 1]
    assert int(h.contexts().max()) <= hc.N_HOT


def test_a_trace_round_trips_step_after_step_and_the_history_makes_it_smaller():
    words = _trace(200_000, 12)
    n, chunk = words[0].size, 1 << 15
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    hist = hc.StateHistory({"w": ("bfloat16", (n,))}, since=0, depth=8)
    sizes = []
    for t in range(12):
        old, new = words[t], words[t + 1]
        chunks = [(old[s:e], new[s:e], s, hist.chunk("w", s, e)) for s, e in spans if (old[s:e] != new[s:e]).any()]
        out, meta, expected = _code(chunks)
        for want, got in zip(expected, _decode_all(out, meta, chunks)):
            _same(want, got)
        sizes.append(out.nbytes() + sum(r.nbytes for r, _ in meta))
        hist.advance(t + 1, [("w", np.flatnonzero(old != new))])
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
    state = hc.StateHistory({"w": ("bfloat16", (words[0].size,))}, since=0, depth=4)
    state.advance(1, [("w", np.flatnonzero(words[0] != words[1]))])
    state.advance(2, [("w", np.flatnonzero(words[1] != words[2]))])
    hist = state.chunk("w", 0, words[0].size)
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


# -- the coding in delta files (docs/FORMAT.md §4.5) -----------------------------------------------

from dataclasses import replace  # noqa: E402

from deltasync.apply import apply_delta, prepare_delta  # noqa: E402
from deltasync.blob import blob_version  # noqa: E402
from deltasync.codec import ChunkPatch, diff_states  # noqa: E402
from deltasync.errors import BaseMismatchError, IntegrityError, UnsupportedError  # noqa: E402
from deltasync.squash import squash_chain  # noqa: E402

HIST = EncodeOptions(coding="history")


def _states(steps: int):
    """A two-tensor AdamW-like trace (bf16 of moving fp32 masters), plus an int8 tensor that never moves."""
    words = _trace(120_000, steps, seed=5)
    small = _trace(3_000, steps, seed=6)
    return [{"big": torch.from_numpy(w.view(np.int16)).view(torch.bfloat16).reshape(300, 400),
             "small": torch.from_numpy(s.view(np.int16)).view(torch.bfloat16),
             "ids": torch.arange(64, dtype=torch.int8)} for w, s in zip(words, small)]


def _layout(state):
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()}


def _stream(states, depth=8, since=0):
    """Publish the trace history-coded: [(Encoded, base-free Encoded)], the publisher's history advanced."""
    pub = hc.StateHistory(_layout(states[0]), since=since, depth=depth)
    out = []
    for v in range(1, len(states)):
        a, b = states[v - 1], states[v]
        enc = encode_delta(a, b, model="m", version=since + v, parent=since + v - 1, options=HIST, history=pub)
        out.append((enc, encode_delta(a, b, model="m", version=since + v, parent=since + v - 1)))
        pub.advance_diff(since + v, diff_states(a, b))
    return out


def test_a_history_coded_stream_applies_bit_for_bit_and_is_smaller():
    states = _states(8)
    stream = _stream(states)
    live = {k: v.clone() for k, v in states[0].items()}
    sub = hc.StateHistory(_layout(states[0]), since=0)
    for v, (enc, free) in enumerate(stream, 1):
        m = enc.manifest
        assert m.coding == "history" and m.meta[hc.HISTORY_META] == "0:8"
        assert {blob_version(b) for b in enc.blobs.values()} == {3}
        apply_delta(live, m, enc.blobs, history=sub)
        assert sub.version == v
        for k in live:
            assert torch.equal(live[k].view(torch.int8 if k == "ids" else torch.int16),
                               states[v][k].view(torch.int8 if k == "ids" else torch.int16)), (v, k)
    size = [sum(map(len, e.blobs.values())) for e, _ in stream]
    free = [sum(map(len, f.blobs.values())) for _, f in stream]
    assert size[0] < 1.02 * free[0] and size[-1] < 0.9 * free[-1], (size, free)


def test_decoding_needs_the_history_it_was_coded_with():
    states = _states(3)
    (e1, _), (e2, _), *_ = _stream(states)
    with pytest.raises(UnsupportedError, match="history coding.*since v0"):
        prepare_delta(e1.manifest, e1.blobs)
    sub = hc.StateHistory(_layout(states[0]), since=0)
    with pytest.raises(BaseMismatchError, match="at v1; this end holds .* at v0"):
        prepare_delta(e2.manifest, e2.blobs, history=sub)  # v1 not taken in
    for other in (hc.StateHistory(_layout(states[0]), since=0, depth=4), hc.StateHistory(_layout(states[0]), since=1)):
        with pytest.raises(BaseMismatchError, match="keyframe"):
            prepare_delta(e1.manifest, e1.blobs, history=other)
    p = prepare_delta(e1.manifest, e1.blobs, history=sub)
    assert all(c.changes is not None for cs in p.patches.values() for c in cs)
    raw = e1.manifest.blobs[0].id
    from deltasync.codec import decode_blob
    chunk = next(c for c in decode_blob(e1.blobs[raw]) if isinstance(c, ChunkPatch) and c.pending is not None)
    with pytest.raises(UnsupportedError, match="history"):
        chunk.resolve(np.zeros(chunk.stop - chunk.start, np.uint16))
    with pytest.raises(UnsupportedError, match="history"):
        chunk.as_changes()


def test_forged_or_corrupt_history_deltas_leave_the_state_as_it_was():
    states = _states(3)
    (e1, _), (e2, _), *_ = _stream(states)
    # history-coded chunks under a manifest that says base-free
    with pytest.raises(FormatError, match="history-coded"):
        prepare_delta(replace(e1.manifest, meta={}), e1.blobs)
    # a history that diverged from the publisher's (same versions, other positions): refused by the decoder or by
    # the fingerprints, and the state and the history left as they were
    live = {k: v.clone() for k, v in states[0].items()}
    sub = hc.StateHistory(_layout(states[0]), since=0)
    for seed in range(3):
        wrong = np.sort(np.random.default_rng(seed).choice(sub.words, 5000, replace=False)).astype(sub.positions.dtype)
        sub.positions, sub.last, sub.gap = wrong, np.zeros(wrong.size, np.uint8), np.zeros(wrong.size, np.uint8)
        with pytest.raises((FormatError, IntegrityError)):
            apply_delta(live, e1.manifest, e1.blobs, history=sub)
        assert sub.version == 0 and np.array_equal(sub.positions, wrong)
        for k in live:
            assert torch.equal(live[k], states[0][k])
    sub = hc.StateHistory(_layout(states[0]), since=0)
    # the right delta with the right history still applies after the refusals
    apply_delta(live, e1.manifest, e1.blobs, history=sub)
    assert sub.version == 1 and torch.equal(live["big"], states[1]["big"])


def test_squash_and_relays_refuse_history_chains_before_reading_a_blob():
    states = _states(3)
    (e1, _), (e2, _), *_ = _stream(states)
    read = []
    blobs = {**e1.blobs, **e2.blobs}
    with pytest.raises(UnsupportedError, match="history coding.*cannot be squashed"):
        squash_chain([e1.manifest, e2.manifest], lambda bid: read.append(bid) or blobs[bid])
    assert read == []
    with pytest.raises(ValueError, match="needs the stream's history"):
        encode_delta(states[0], states[1], model="m", version=1, parent=0, options=HIST)
    h = hc.StateHistory(_layout(states[0]), since=0)
    with pytest.raises(ValueError, match="not at the delta's parent"):
        encode_delta(states[1], states[2], model="m", version=2, parent=1, options=HIST, history=h)


def test_readers_refuse_what_they_cannot_take_in_before_touching_the_state():
    states = _states(2)
    (e1, _), *_ = _stream(states)
    sub = hc.StateHistory(_layout(states[0]), since=0)
    # a history-coded delta that skips versions: the history takes in one delta a version
    with pytest.raises(FormatError, match="steps one version"):
        prepare_delta(replace(e1.manifest, version=3), e1.blobs, history=sub)
    # a coding this reader does not know
    odd = replace(e1.manifest, meta={**e1.manifest.meta, "deltasync.coding": "quantum"})
    with pytest.raises(UnsupportedError, match="'quantum' coding.*upgrade"):
        prepare_delta(odd, e1.blobs, history=sub)
    # a broken table stream is named as what it is
    with pytest.raises(FormatError, match="anshm stream"):
        CondTables.parse(np.array([0x81], np.uint8), "anshm")
    assert sub.version == 0


def test_the_history_columns_wrap_their_versions_and_hold_six_bytes_a_position():
    """Versions modulo 256 in one byte: a stream far past v255 keeps the same ages, intervals and restrictions as
    one that starts at v0 (the history is the same function of the last deltas)."""
    rng = np.random.default_rng(9)
    layout = {"w": ("bfloat16", (5000,))}
    steps = [np.sort(rng.choice(5000, 300, replace=False)) for _ in range(40)]
    a, b = hc.StateHistory(layout, since=0, depth=8), hc.StateHistory(layout, since=1000, depth=8)
    for k, ch in enumerate(steps, 1):
        a.advance(k, [("w", ch)])
        b.advance(1000 + k, [("w", ch)])
        ca, cb = a.chunk("w", 0, 5000), b.chunk("w", 0, 5000)
        assert np.array_equal(ca.positions, cb.positions) and np.array_equal(ca.ages, cb.ages)
        assert np.array_equal(ca.prevs, cb.prevs) and int(ca.ages.max()) <= 8 and int(ca.prevs.max()) <= 8
    ra, rb = a.restricted(35, 4), b.restricted(1035, 4)
    assert np.array_equal(ra.chunk("w", 0, 5000).prevs, rb.chunk("w", 0, 5000).prevs)
    assert int(ra.chunk("w", 0, 5000).ages.max()) <= 4 and len(ra) < len(a)
    assert a.nbytes == 6 * len(a) and a.positions.dtype == np.uint32


def test_the_keeper_gives_each_delta_the_history_it_was_coded_with():
    """HistoryKeeper (a subscriber's histories by version): a keyframe starts an empty one; a delta coded since a
    later keyframe than this end started from gets the restriction of the longer history; one coded since an
    earlier version than this end holds is refused (only a keyframe, or the deltas since it, help)."""
    from types import SimpleNamespace as M

    states = _states(6)
    layout = _layout(states[0])
    keeper = hc.HistoryKeeper(lambda: layout)

    def manifest(v, since, depth=8):
        return M(version=v, parent=v - 1, meta={hc.HISTORY_META: f"{since}:{depth}"}, coding="history")

    keeper.keyframe(0)
    pub = hc.StateHistory(layout, since=0)
    for v in range(1, 5):
        h = keeper.at(manifest(v, 0))
        assert (h.since, h.version, len(h)) == (pub.since, pub.version, len(pub))
        d = diff_states(states[v - 1], states[v])
        keeper.took(manifest(v, 0), {n: [ChunkPatch(tensor=n, dtype="bfloat16", start=c.start, stop=c.stop,
                                                    changes=changes_from_words(c.positions, c.old, c.new, is_float=True))
                                         for c in cs] for n, cs in d.chunks.items()}, h)
        pub.advance_diff(v, d)
    # the publisher started a new history at a side keyframe at v3: the keeper restricts its own
    late = pub.restricted(3, 8)
    got = keeper.at(manifest(5, 3))
    assert (got.since, got.depth) == (3, 8) and np.array_equal(got.positions, late.positions)
    assert np.array_equal(got.gap, late.gap) and np.array_equal(got.last, late.last)
    assert keeper.at(manifest(5, 4, depth=4)).depth == 4  # shallower: restricted too
    with pytest.raises(BaseMismatchError, match="since v0 .* holds the history since v0"):
        keeper.at(manifest(5, 0, depth=16))  # deeper than this end kept
    keeper.forget(4)
    with pytest.raises(BaseMismatchError, match="holds no history"):
        keeper.at(manifest(3, 0))  # v2's history was left behind
    assert keeper.at(manifest(9, 8)).since == 8 and len(keeper.at(manifest(9, 8))) == 0  # empty since the parent
    keeper.keyframe(7)
    with pytest.raises(BaseMismatchError, match="keyframe at or after v0"):
        keeper.at(manifest(8, 0))  # a keyframe at v7 holds nothing of v1..v7


def test_wanted_chunks_only_of_a_single_blob_delta():
    """A target that holds part of a tensor (``wanted``) and a delta in one blob (no chunk spans in its manifest):
    only the wanted chunks are decoded and taken in, the others left out, and the history of the wanted ones is
    whole step after step."""
    states = _states(4)
    opts = EncodeOptions(coding="history", chunk_words=20_000)
    pub = hc.StateHistory(_layout(states[0]), since=0)
    sub = hc.StateHistory(_layout(states[0]), since=0)
    wanted = lambda name, start, stop: name != "big" or start >= 60_000  # noqa: E731 - the last rows of "big"
    for v in range(1, 4):
        enc = encode_delta(states[v - 1], states[v], model="m", version=v, parent=v - 1, options=opts, history=pub)
        pub.advance_diff(v, diff_states(states[v - 1], states[v]))
        assert len(enc.manifest.blobs) == 1
        p = prepare_delta(enc.manifest, enc.blobs, history=sub, wanted=wanted)
        got = np.concatenate([c.changes.positions for c in p.patches["big"]])
        want = np.flatnonzero(states[v - 1]["big"].view(torch.int16).reshape(-1).numpy()
                              != states[v]["big"].view(torch.int16).reshape(-1).numpy())
        assert np.array_equal(got, want[want >= 60_000])
        assert all(c.start >= 60_000 for c in p.patches["big"])
        sub.advance_patches(v, p.patches)
