"""The kernels of the decode and apply path (decode of whole ans chunks, the one-pass patch, the journal's gather and scatter)
against the reference, bit for bit, and the threaded decode and apply against the serial ones.

* ``entropy.decode_ans_chunks`` (numba: one call per word size) must give exactly the Changes that
  ``entropy.decode_ans_chunk`` gives chunk by chunk, and fail on the same chunk with the same message
  for cut, extended, flipped or miscounted streams.
* ``kernels.patch_chunk`` must leave the words, old words and fingerprint change of ``patch_words``
  (itself tested against the numpy reference in test_core_kernels.py), and write nothing when a position
  leaves the tensor.
* ``stage_prepared``'s batched patch (``kernels.patch_jobs``, every tensor in one call per word size) against
  the tensor-by-tensor path: the same words, fingerprints, rollback and first failure.
* ``prepare_delta`` / ``stage_prepared`` with a 2-thread pool: the same patches, the same fingerprints, and
  on a failure every word restored (the task groups report their first failure).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deltasync import kernels
from deltasync.apply import apply_prepared, prepare_delta, stage_prepared
from deltasync.blob import BlobReader
from deltasync.codec import EncodeOptions, decode_blob, encode_delta
from deltasync.entropy import AnsChunk, AnsTables, decode_ans_chunks
from deltasync.errors import FormatError, IntegrityError
from deltasync.fingerprint import fingerprint_state
from deltasync.values import Changes

pytest.importorskip("numba")

from core_support import WORD, restore_kernels  # noqa: E402,F401  (restore_kernels: autouse)
TORCH = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same_changes(a: Changes, b: Changes) -> None:
    for f in ("positions", "raw", "values"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f


def _pair(seed: int, w: int, n: int, density: float, big: bool):
    """Old and new tensors of one word size: ULP steps, big steps, rewrites (raw words), sign flips."""
    rng = np.random.default_rng(seed)
    dt = WORD[w]
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    new = old.copy()
    sel = np.flatnonzero(rng.random(n) < density)
    choices = [1, -1, 2, -2, 7, -8, 9] + ([300, -70000, 1 << 20] if big else [])
    steps = rng.choice(np.array(choices, dtype=np.int64), sel.size)
    with np.errstate(over="ignore"):
        new[sel] = (old[sel].astype(np.uint64) + steps.astype(np.uint64)).astype(dt)
    rewrite = sel[rng.random(sel.size) < 0.05]
    new[rewrite] = rng.integers(0, np.iinfo(dt).max, rewrite.size, dtype=dt, endpoint=True)
    return torch.from_numpy(old).view(TORCH[w]), torch.from_numpy(new).view(TORCH[w])


def _delta(seed: int, density: float, big: bool = True, chunk_words: int = 1 << 12):
    """A format-2 delta over tensors of every word size, several ans chunks per blob."""
    a, b = {}, {}
    for i, (w, n) in enumerate(((2, 20_000), (4, 9_000), (1, 5_000), (8, 3_000), (2, 300))):
        a[f"t{i}"], b[f"t{i}"] = _pair(seed + i, w, n, density, big)
    enc = encode_delta(a, b, model="m", version=2, parent=1, options=EncodeOptions(chunk_words=chunk_words))
    return a, b, enc


def _ans_parts(data: bytes):
    """(tables, ans stream, raw streams, [AnsChunk]) of a blob, read with the public BlobReader."""
    r = BlobReader(data)
    tables = AnsTables.parse(r.stream("ansm"))
    chunks, at, r0 = [], 0, {}
    from deltasync.dtypes import dtype_info
    for rec in r.chunks:
        if rec["mode"] != "ans":
            continue
        w = dtype_info(rec["dtype"]).word_size
        chunks.append(AnsChunk(count=rec["count"], length=rec["stop"] - rec["start"], start=rec["start"], at=at,
                               na=rec["na"], r0=r0.get(w, 0), nr=rec["nr"], word_size=w))
        at += 2 * rec["na"]
        r0[w] = r0.get(w, 0) + rec["nr"]
    raws = {w: r.stream(f"raw{w}", np.dtype(WORD[w])) for w in (1, 2, 4, 8)}
    return tables, np.array(r.stream("ans")), raws, chunks


def _decode_both(tables, ans, raws, chunks, executor=None):
    out = []
    for sel in ("reference", "numba"):
        kernels.select(sel)
        try:
            out.append(("ok", decode_ans_chunks(tables, ans, raws, chunks, executor=executor)))
        except FormatError as e:
            out.append(("error", str(e)))
    return out


@SETTINGS
@given(st.integers(0, 2**31), st.sampled_from((0.002, 0.05, 0.4, 1.0)), st.booleans())
def test_ans_decode_matches_reference(seed, density, big):
    _, _, enc = _delta(seed, density, big)
    for data in enc.blobs.values():
        parts = _ans_parts(data)
        if not parts[3]:
            continue
        (k1, ref), (k2, got) = _decode_both(*parts)
        assert k1 == k2 == "ok"
        for x, y in zip(ref, got, strict=True):
            _same_changes(x, y)
        with ThreadPoolExecutor(2) as pool:  # split in parts on the pool: the same arrays
            kernels.select("numba")
            for x, y in zip(ref, decode_ans_chunks(*parts, executor=pool), strict=True):
                _same_changes(x, y)


@SETTINGS
@given(st.integers(0, 2**31), st.sampled_from(("cut", "extend", "flip", "nr+", "nr-", "count+", "count-", "len")),
       st.integers(0, 10**6))
def test_malformed_ans_chunks_fail_alike(seed, how, where):
    """Streams damaged in every way decode_blob's header checks let through: the same chunk fails with
    the same message under both selections (or both decode to the same changes)."""
    _, _, enc = _delta(seed, 0.05, True)
    data = max(enc.blobs.values(), key=len)
    tables, ans, raws, chunks = _ans_parts(data)
    i = where % len(chunks)
    c = chunks[i]
    fields = dict(count=c.count, length=c.length, start=c.start, at=c.at, na=c.na, r0=c.r0, nr=c.nr,
                  word_size=c.word_size)
    if how == "cut":
        fields["na"] = max(0, c.na - 1 - where % 3)
    elif how == "extend":
        fields["na"] = c.na + 1 if c.at + 2 * (c.na + 1) <= ans.size else c.na
    elif how == "flip":
        ans = ans.copy()
        ans[c.at + where % max(1, 2 * c.na)] ^= np.uint8(1 << (where % 8))
    elif how == "nr+":
        fields["nr"] = c.nr + 1
    elif how == "nr-":
        fields["nr"] = max(0, c.nr - 1)
    elif how == "count+":
        fields["count"] = c.count + 1
    elif how == "count-":
        fields["count"] = max(1, c.count - 1)
    else:
        fields["length"] = max(1, c.length // 2)
    chunks = chunks[:i] + [AnsChunk(**fields)] + chunks[i + 1:]
    ref, got = _decode_both(tables, ans, raws, chunks)
    assert ref[0] == got[0]
    if ref[0] == "error":
        assert ref[1] == got[1]
    else:
        for x, y in zip(ref[1], got[1], strict=True):
            _same_changes(x, y)


def test_big_steps_past_half_a_word_fail_alike():
    """A BIG step's magnitude beyond half the word (only a forged stream has one) fails alike."""
    from deltasync.kernels import rans

    gfreq = rans.normalize(np.bincount([1, 2], minlength=rans.N_GAP))
    vfreq = rans.normalize(np.bincount([rans.BIG, 0], minlength=rans.N_VAL))
    tables = AnsTables.from_freqs(gfreq, vfreq)
    (gf, gc, _), (vf, vc, _) = tables.g, tables.v
    for bits, mag in ((8, 200), (16, 1 << 15), (16, 100)):
        msg = rans.encode_chunk(np.array([1], np.int64), np.array([rans.BIG], np.uint8), np.array([False]),
                                np.array([mag], np.uint64), gf, gc, vf, vc)
        ans = msg.astype("<u2").view(np.uint8)
        chunk = AnsChunk(count=1, length=10, start=0, at=0, na=msg.size, r0=0, nr=0, word_size=bits // 8)
        raws = {bits // 8: np.zeros(0, WORD[bits // 8])}
        ref, got = _decode_both(tables, ans, raws, [chunk])
        assert ref == got if ref[0] == "error" else ref[0] == got[0] == "ok"
        if mag > 200:
            assert ref[0] == "error" and "larger than half" in ref[1]


@SETTINGS
@given(st.sampled_from((1, 2, 4, 8)), st.integers(0, 2**31), st.sampled_from((0.0, 0.01, 0.3, 1.0)),
       st.sampled_from((0, 5, 65535, 3 * 65536 - 7)))
def test_patch_chunk_matches_patch_words(w, seed, density, start):
    rng = np.random.default_rng(seed)
    n = 70_000 + start
    dt = WORD[w]
    words = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    rel = np.flatnonzero(rng.random(n - start) < density) + start
    raw = rng.random(rel.size) < 0.2
    values = rng.integers(0, np.iinfo(dt).max, rel.size, dtype=dt, endpoint=True)
    ch = Changes(positions=rel.astype(np.int64), raw=raw, values=values)
    kernels.select("numba")
    a, b = words.copy(), words.copy()
    old_a, fp_a = kernels.patch_words(a, ch, w)
    old_b, fp_b = kernels.patch_chunk(b, ch, w)
    assert np.array_equal(a, b) and np.array_equal(old_a, old_b) and fp_a == fp_b
    assert fp_b == kernels.fingerprint_delta_np(ch.positions, words[rel], b[rel], w)
    c = words.copy()
    kernels.select("reference")
    kernels.apply_changes_np(c, ch)
    assert np.array_equal(b, c)
    kernels.select("numba")
    kernels.scatter_words(b, ch.positions, old_b)  # the undo record written back
    assert np.array_equal(b, words)
    got = np.empty(rel.size, dt)
    kernels.gather_words(words, ch.positions, got)
    assert np.array_equal(got, words[rel])


def test_patch_chunk_out_of_range_writes_nothing():
    kernels.select("numba")
    words = np.arange(100, dtype=np.uint16)
    for bad in (100, -1):
        ch = Changes(positions=np.array([3, 50, bad], np.int64), raw=np.zeros(3, bool), values=np.ones(3, np.uint16))
        with pytest.raises(IndexError, match=f"position {bad} is outside a tensor of 100 words"):
            kernels.patch_chunk(words, ch, 2)
        assert np.array_equal(words, np.arange(100, dtype=np.uint16))


@pytest.mark.parametrize("w", (2, 4))
@pytest.mark.parametrize("bad_job", (None, 0, 57, 299))
def test_patch_jobs_of_many_small_tensors_matches_patch_chunk(w, bad_job):
    """``kernels.patch_jobs`` over 300 small tensors (0 to 40 changes each, empty jobs among them: its prefetch
    runs ahead across jobs) leaves each tensor's words, old words and fingerprint change of ``patch_chunk`` run
    tensor by tensor; a position out of range in job ``bad_job`` (one past its end, or a wild one that the
    prefetch reaches before the job runs) fails there: the jobs before it patched, it and the later ones untouched. Undone by
    ``unpatch_jobs``, every word is back."""
    rng = np.random.default_rng(7 + w)
    dt = WORD[w]
    kernels.select("numba")
    words, changes = [], []
    for j in range(300):
        n = int(rng.integers(1, 4096))
        t = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
        k = 0 if j % 7 == 3 else min(n, int(rng.integers(0, 41)))
        pos = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        if j == bad_job:  # one past the end; or a wild first one, which the prefetch meets while job 56 runs
            pos = np.r_[1 << 40, pos] if j == 57 else np.r_[pos, n]
        words.append(t)
        changes.append(Changes(positions=pos, raw=rng.random(pos.size) < 0.2,
                               values=rng.integers(0, np.iinfo(dt).max, pos.size, dtype=dt, endpoint=True)))
    base = [t.copy() for t in words]
    raws = [c.raw.astype(np.uint8) for c in changes]
    jobs = np.array([(t.ctypes.data, t.size, c.positions.ctypes.data, r.ctypes.data, c.values.ctypes.data,
                      c.positions.size, 0) for t, c, r in zip(words, changes, raws)], np.int64)
    total = sum(c.positions.size for c in changes)
    old = np.zeros(total, dt)
    fpds = np.zeros(len(words), np.uint64)
    j, k = kernels.patch_jobs(jobs, words[0][:0], old, fpds, w)
    stop = len(words) if bad_job is None else bad_job
    assert (j, k) == ((-1, 0) if bad_job is None else (bad_job, 0 if bad_job == 57 else changes[bad_job].positions.size - 1))
    o = 0
    for i in range(len(words)):
        ref = base[i].copy()
        if i < stop:
            ref_old, ref_fp = kernels.patch_chunk(ref, changes[i], w)
            m = changes[i].positions.size
            assert np.array_equal(old[o : o + m], ref_old) and int(fpds[i]) == ref_fp, i
            o += m
        assert np.array_equal(words[i], ref), i
    offsets = np.zeros(len(words) + 1, np.int64)
    np.cumsum([c.positions.size for c in changes], out=offsets[1:])
    kernels.unpatch_jobs(jobs[:stop], old, offsets[: stop + 1], w)
    for i in range(len(words)):
        assert np.array_equal(words[i], base[i]), i


@pytest.mark.parametrize("density", (0.003, 0.2))
def test_threaded_prepare_and_apply_equal_serial(density):
    a, b, enc = _delta(11, density, True, chunk_words=1 << 10)
    fps = fingerprint_state(a)
    kernels.select("numba")
    serial = prepare_delta(enc.manifest, enc.blobs)
    with ThreadPoolExecutor(2) as pool:
        threaded = prepare_delta(enc.manifest, enc.blobs, executor=pool)
        for name, chunks in serial.patches.items():
            for x, y in zip(chunks, threaded.patches[name], strict=True):
                assert (x.tensor, x.start, x.stop) == (y.tensor, y.start, y.stop)
                _same_changes(x.as_changes(), y.as_changes())
        one = {k: v.clone() for k, v in a.items()}
        two = {k: v.clone() for k, v in a.items()}
        f1 = apply_prepared(one, serial, fps)
        f2 = apply_prepared(two, threaded, fps, executor=pool)
    assert f1 == f2 == enc.fps
    for k in b:
        assert torch.equal(one[k].view(torch.uint8), b[k].view(torch.uint8))
        assert torch.equal(two[k].view(torch.uint8), b[k].view(torch.uint8))


@pytest.mark.parametrize("threads", (0, 2))
@pytest.mark.parametrize("selection", ("numba", "reference"))
def test_failed_apply_restores_every_word(threads, selection):
    """One tensor's recorded fingerprint is wrong: the apply raises and every word of every tensor,
    patched or not, is back as it was (the undo log of the compiled path, and of the task groups)."""
    import dataclasses

    a, _, enc = _delta(12, 0.05, True, chunk_words=1 << 10)
    fps = fingerprint_state(a)
    bad = sorted(r.name for r in enc.manifest.tensors if r.changed)[2]
    tensors = tuple(dataclasses.replace(r, fp_after="0" * 16) if r.name == bad else r for r in enc.manifest.tensors)
    manifest = dataclasses.replace(enc.manifest, tensors=tensors)
    kernels.select(selection)
    live = {k: v.clone() for k, v in a.items()}
    with ThreadPoolExecutor(2) as pool:
        prep = prepare_delta(manifest, enc.blobs)
        with pytest.raises(IntegrityError, match=f"{bad}: fingerprint after patching"):
            stage_prepared(live, prep, fps, executor=pool if threads else None)
    for k in a:
        assert torch.equal(live[k].view(torch.uint8), a[k].view(torch.uint8)), k


@pytest.mark.parametrize("threads", (0, 2))
def test_batched_patch_equals_tensor_by_tensor(monkeypatch, threads):
    """``apply._patch_batched`` (every chunk of every word size through ``kernels.patch_jobs``) leaves the words,
    fingerprints and undo log of the tensor-by-tensor compiled path, and a staged patch rolls back to the base."""
    from deltasync import apply as apply_mod

    a, b, enc = _delta(13, 0.05, True, chunk_words=1 << 10)
    fps = fingerprint_state(a)
    kernels.select("numba")
    monkeypatch.setattr(apply_mod, "BATCH_PART_MIN", 0)  # with threads: every word size in parts
    calls = []
    real = kernels.patch_jobs
    monkeypatch.setattr(kernels, "patch_jobs", lambda *x: calls.append(1) or real(*x))
    with ThreadPoolExecutor(2) as pool:
        ex = pool if threads else None
        prep = prepare_delta(enc.manifest, enc.blobs)
        one = {k: v.clone() for k, v in a.items()}
        staged = stage_prepared(one, prep, fps, executor=ex)
        assert calls, "the batched path did not run"
        monkeypatch.setattr(apply_mod, "_patch_batched", lambda *x: None)  # the tensor-by-tensor path
        two = {k: v.clone() for k, v in a.items()}
        f2 = apply_prepared(two, prep, fps, executor=ex)
    assert staged.fps == f2 == enc.fps
    for k in b:
        assert torch.equal(one[k].view(torch.uint8), b[k].view(torch.uint8))
        assert torch.equal(two[k].view(torch.uint8), b[k].view(torch.uint8))
    staged.rollback()
    for k in a:
        assert torch.equal(one[k].view(torch.uint8), a[k].view(torch.uint8)), k


@pytest.mark.parametrize("threads", (0, 2))
def test_batched_patch_out_of_range_fails_first_in_tensor_order(monkeypatch, threads):
    """A position outside its tensor in one chunk, a wrong recorded fingerprint in a later tensor: the batched
    path raises the earlier failure (ApplyError for the position, as the tensor-by-tensor path) and every word
    of every tensor is restored."""
    import dataclasses

    from deltasync.errors import ApplyError

    from deltasync import apply as apply_mod

    monkeypatch.setattr(apply_mod, "BATCH_PART_MIN", 0)
    a, _, enc = _delta(14, 0.05, True, chunk_words=1 << 10)
    fps = fingerprint_state(a)
    kernels.select("numba")
    names = sorted(r.name for r in enc.manifest.tensors if r.changed)
    late = names[-1]
    tensors = tuple(dataclasses.replace(r, fp_after="0" * 16) if r.name == late else r for r in enc.manifest.tensors)
    prep = prepare_delta(dataclasses.replace(enc.manifest, tensors=tensors), enc.blobs)
    patches = dict(prep.patches)
    p = patches[names[1]][-1]
    pos = p.changes.positions.copy()
    pos[-1] = 10**9
    patches[names[1]] = patches[names[1]][:-1] + [dataclasses.replace(p, changes=Changes(
        positions=pos, raw=p.changes.raw, values=p.changes.values))]
    prep = dataclasses.replace(prep, patches=patches)
    live = {k: v.clone() for k, v in a.items()}
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ApplyError, match="change position 1000000000 is outside"):
            stage_prepared(live, prep, fps, executor=pool if threads else None)
    for k in a:
        assert torch.equal(live[k].view(torch.uint8), a[k].view(torch.uint8)), k


def test_decode_blob_uses_the_batch_for_every_ans_chunk():
    """decode_blob through the batch decoder: the same ChunkPatches under both selections, in order."""
    _, _, enc = _delta(13, 0.02, True, chunk_words=1 << 11)
    for data in enc.blobs.values():
        kernels.select("reference")
        ref = decode_blob(data)
        kernels.select("numba")
        got = decode_blob(data)
        assert [(p.tensor, p.start, p.stop) for p in ref] == [(p.tensor, p.start, p.stop) for p in got]
        for x, y in zip(ref, got):
            _same_changes(x.as_changes(), y.as_changes())
