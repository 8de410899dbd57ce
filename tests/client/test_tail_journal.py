"""The ``--out`` step's tail (helper Q): the journal's one-pass gather, the compact undo records, the kernel warm-up.

* ``kernels.journal_gather`` (numba) must write exactly the uint32 offsets and old words of the numpy
  reference, and report the same first out-of-chunk position.
* A ``FileTarget`` delta journals each sparse chunk as ``rel32`` (uint32 offsets + old words, 8-byte
  aligned at its recorded ``at``): ``recover`` of that journal after the patch gives back the old file
  byte for byte, header included; a journal in the earlier layout (int64 positions, no ``at``) still
  rolls back (jrnl01: read as before); a position outside its chunk raises before anything is written.
* ``warm_kernels`` loads the decode and patch kernels (numba dispatchers hold a compiled signature
  afterwards) and touches nothing else.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings, strategies as st

from deltasync import kernels
from deltasync.apply import prepare_delta, warm_kernels
from deltasync.codec import encode_delta
from deltasync.errors import FormatError
from deltasync.fingerprint import tensor_fingerprint
from deltasync.client import filetarget
from deltasync.client.filetarget import FileTarget, journal_path, recover

pytest.importorskip("numba")

from core_support import WORD, restore_kernels  # noqa: E402,F401  (restore_kernels: autouse)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _reference(words, positions, start, stop):
    kernels.select("reference")
    try:
        rel = np.full(positions.size, 0xDEADBEEF, np.uint32)
        old = np.zeros(positions.size, words.dtype)
        return kernels.journal_gather(words, positions, start, stop, rel, old), rel, old
    finally:
        kernels.select("numba")


@SETTINGS
@given(w=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 5000), start=st.integers(0, 300),
       density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31), bad=st.sampled_from([None, "low", "high"]))
def test_journal_gather_matches_the_reference_bit_for_bit(w, n, start, density, seed, bad):
    rng = np.random.default_rng(seed)
    words = rng.integers(0, np.iinfo(WORD[w]).max, n + start + 50, dtype=WORD[w], endpoint=True)
    stop = start + n
    positions = np.flatnonzero(rng.random(n) < density).astype(np.int64) + start
    if bad is not None and positions.size:
        at = int(rng.integers(0, positions.size))
        positions[at] = start - 1 if bad == "low" else stop  # in the tensor, outside the chunk
    kernels.select("numba")
    rel = np.full(positions.size, 0xDEADBEEF, np.uint32)
    old = np.zeros(positions.size, words.dtype)
    got = kernels.journal_gather(words, positions, start, stop, rel, old)
    want, rel_ref, old_ref = _reference(words, positions, start, stop)
    assert got == want
    if want < 0:
        assert np.array_equal(rel, rel_ref) and np.array_equal(old, old_ref)
        assert np.array_equal(rel.astype(np.int64) + start, positions) and np.array_equal(old, words[positions])
    else:
        assert positions[want] < start or positions[want] >= stop


@pytest.mark.parametrize("bad_row", (None, 0, 101, 399))
def test_journal_columns_of_many_small_rows_matches_the_reference(bad_row):
    """``kernels.journal_columns`` over 400 small chunk rows of one mapped buffer (0 to 40 changes each: its prefetch
    runs ahead across rows) gives the reference's offsets and old words, and the same first change outside its
    chunk (``bad_row``: its first change, which the prefetch reaches while earlier rows run)."""
    rng = np.random.default_rng(11)
    sizes = rng.integers(1, 3000, 400)
    first = np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64)  # each tensor's first word in the buffer
    words = rng.integers(0, 2**16 - 1, int(sizes.sum()), dtype=np.uint16, endpoint=True)
    flat, at, counts, starts, stops = [], [], [], [], []
    for j, n in enumerate(sizes.tolist()):
        s0 = int(rng.integers(0, n))
        e0 = int(rng.integers(s0 + 1, n + 1))
        k = 0 if j % 9 == 4 else min(e0 - s0, int(rng.integers(0, 41)))
        pos = np.sort(rng.choice(np.arange(s0, e0), k, replace=False)).astype(np.int64)
        if j == bad_row:
            pos = np.r_[e0 + (1 << 30), pos]
        at.append(sum(map(len, flat)))
        flat.append(pos)
        counts.append(pos.size)
        starts.append(s0)
        stops.append(e0)
    cols = [np.array(c, np.int64) for c in (at, counts, starts, stops)]
    kernels.select("numba")
    rel = np.full(sum(counts), 0xDEADBEEF, np.uint32)
    old = np.zeros(sum(counts), np.uint16)
    assert kernels.journal_columns(words, np.concatenate(flat), *cols, first, rel, old) == \
        ((-1, 0) if bad_row is None else (bad_row, 0))
    rows = len(counts) if bad_row is None else bad_row  # the rows the kernel wrote (the reference checks first)
    done = sum(counts[:rows])
    kernels.select("reference")
    rel_ref = np.full(done, 0xDEADBEEF, np.uint32)
    old_ref = np.zeros(done, np.uint16)
    assert kernels.journal_columns(words, np.concatenate(flat), *(c[:rows] for c in cols), first[:rows], rel_ref,
                                   old_ref) == (-1, 0)
    kernels.select("numba")
    assert np.array_equal(rel[:done], rel_ref) and np.array_equal(old[:done], old_ref)
    each = [words[f + p] for f, p in zip(first[:rows].tolist(), flat[:rows])]
    assert np.array_equal(old_ref, np.concatenate([np.zeros(0, np.uint16), *each]))


def test_journal_gather_refuses_a_chunk_beyond_its_words():
    with pytest.raises(ValueError, match="chunk"):
        kernels.journal_gather(np.zeros(8, np.uint16), np.arange(2), 0, 9, np.empty(2, np.uint32),
                               np.empty(2, np.uint16))


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": (torch.randn(3000, 7, generator=g) * 0.02).to(torch.bfloat16),
            "b.bias": torch.randn(777, generator=g),
            "c.ids": torch.randint(-2**40, 2**40, (501,), generator=g, dtype=torch.int64),
            "d.small": torch.randint(-100, 100, (3,), generator=g, dtype=torch.int8)}


def _step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        w = t.view(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).clone()
        idx = torch.randint(0, w.numel(), (max(1, w.numel() // 50),), generator=g)
        w[idx] += 1
        w[idx[::7]] = 5  # some raw words
        out[name] = w.view(t.dtype).view(t.shape)
    out["d.small"] = torch.tensor([1, 2, 3], dtype=torch.int8)  # a rewritten chunk: shipped dense
    return out


def _file(tmp_path, state) -> FileTarget:
    out = tmp_path / "f.safetensors"
    t = FileTarget(out, "m", layout={n: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for n, v in state.items()},
                   open_existing=False)
    t.stage_keyframe(state, {n: tensor_fingerprint(v) for n, v in state.items()}, version=3).commit()
    return t


def test_the_journal_of_a_delta_rolls_the_patched_file_back_byte_for_byte(tmp_path):
    s0 = _state(1)
    s1 = _step(s0, 2)
    t = _file(tmp_path, s0)
    before = t.path.read_bytes()
    enc = encode_delta(s0, s1, model="m", version=4, parent=3)
    # chunk by chunk (a plain dict of chunks; a delta prepared as columns journals them as jrnl03 groups)
    prepared = dataclasses.replace(prepare_delta(enc.manifest, enc.blobs), patches=dict(
        prepare_delta(enc.manifest, enc.blobs).patches))
    kinds = []
    real = filetarget._write_journal

    def spy(path, info, regions, payload):
        kinds.extend(r["kind"] for r in regions)
        assert all(r["at"] % 8 == 0 for r in regions)
        real(path, info, regions, payload)
    filetarget._write_journal = spy
    try:
        staged = t.stage_delta(prepared, {n: tensor_fingerprint(v) for n, v in s0.items()}, verify="incremental")
    finally:
        filetarget._write_journal = real
    assert "rel32" in kinds and "bytes" in kinds  # sparse chunks, the dense one, the header
    assert all(torch.equal(t.tensors()[n].view(-1).view(torch.uint8), s1[n].view(-1).view(torch.uint8)) for n in s1)
    t.file.write_header(bytes(t.file.buffer()[: t.file.header.data_start]))  # as a commit would start
    t.close()
    assert t.path.read_bytes() != before
    info = recover(t.path)  # as if killed here: the journal is complete
    assert info is not None and info["from"] == 3 and info["to"] == 4
    assert t.path.read_bytes() == before and not journal_path(t.path).exists()
    del staged


@pytest.mark.parametrize("in_place", (True, False))
def test_the_journal_keeps_only_the_header_bytes_a_delta_rewrites(tmp_path, monkeypatch, in_place):
    """A header laid out with its metadata first (``subscribe --out``'s) is rewritten in place, metadata only: the
    journal keeps those bytes, not the tensors' entries (~8 MB at 70k tensors); otherwise the whole header. Either
    way a kill after the patch and the "patching" header rolls the file back byte for byte."""
    s0 = _state(5)
    s1 = _step(s0, 6)
    t = _file(tmp_path, s0)
    if not in_place:
        monkeypatch.setattr(type(t.file), "metadata_end", lambda self: None)
    before = t.path.read_bytes()
    enc = encode_delta(s0, s1, model="m", version=4, parent=3)
    heads = []
    real = filetarget._write_journal
    monkeypatch.setattr(filetarget, "_write_journal", lambda path, info, regions, payload: (
        heads.extend(r["length"] for r in regions if r["kind"] == "bytes" and r["offset"] == 0),
        real(path, info, regions, payload)))
    staged = t.stage_delta(prepare_delta(enc.manifest, enc.blobs), {n: tensor_fingerprint(v) for n, v in s0.items()},
                           verify="incremental")
    data_start = t.file.header.data_start
    assert heads == [data_start] if not in_place else heads[0] < data_start // 2
    t.close()
    after = t.path.read_bytes()
    assert after != before and after[heads[0]:data_start] == before[heads[0]:data_start]  # only the metadata moved
    assert recover(t.path) is not None
    assert t.path.read_bytes() == before and not journal_path(t.path).exists()
    del staged


def test_a_journal_in_the_earlier_layout_still_rolls_back(tmp_path):
    """jrnl01, as earlier versions wrote it: int64 positions, old words right after, regions back to back."""
    s0 = _state(3)
    t = _file(tmp_path, s0)
    before = t.path.read_bytes()
    e = next(e for e in t.file.header.entries if e.name == "a.weight")
    words = np.frombuffer(before, dtype="<u2", count=(e.stop - e.start) // 2, offset=e.start)
    pos = np.array([0, 5, 900, words.size - 1], dtype="<i8")
    regions = [{"kind": "words", "offset": e.start, "words": int(words.size), "word": 2, "count": 4},
               {"kind": "bytes", "offset": 0, "length": t.file.header.data_start}]
    payload = pos.tobytes() + words[pos].tobytes() + before[: t.file.header.data_start]
    head = json.dumps({"from": 3, "to": 4, "size": len(before), "regions": regions}).encode()
    body = b"deltasync-jrnl01" + len(head).to_bytes(8, "little") + head + payload
    journal_path(t.path).write_bytes(body + xxhash.xxh3_128_digest(body))
    host = t.tensors()["a.weight"].view(-1).view(torch.int16).numpy()
    host[pos] += 3
    t.close()
    assert recover(t.path) is not None
    assert t.path.read_bytes() == before


def test_a_change_outside_its_chunk_is_refused_before_the_file_changes(tmp_path):
    s0 = _state(4)
    s1 = _step(s0, 5)
    t = _file(tmp_path, s0)
    before = t.path.read_bytes()
    enc = encode_delta(s0, s1, model="m", version=4, parent=3)
    prepared = prepare_delta(enc.manifest, enc.blobs)
    c = prepared.patches["a.weight"][0]
    c.changes.positions[-1] = c.stop  # one past its chunk (still inside the tensor when it has more chunks)
    with pytest.raises(FormatError, match="leaves its chunk"):
        t.stage_delta(prepared, {n: tensor_fingerprint(v) for n, v in s0.items()}, verify="incremental")
    t.close()
    assert t.path.read_bytes() == before and not journal_path(t.path).exists()


def test_warm_kernels_loads_the_decode_and_patch_kernels_and_touches_nothing_else():
    from deltasync.kernels import cpu

    warm_kernels(["bfloat16", "float32", "int8", "bool"])
    # the kernels a delta applied with incremental verification calls (FileTarget's path): the batched patch,
    # one word dtype per word size (patch_chunk is the per-tensor path of a full verify; another test in the same
    # process may have loaded it, so its signatures say nothing here)
    for k in (cpu.ans_decode_chunks, cpu.patch_jobs):
        assert k.signatures, f"{k.__name__} was not loaded"
    assert {s[1].dtype.name for s in cpu.patch_jobs.signatures} >= {"uint16", "uint32", "uint8"}


def test_a_file_delta_skips_the_alias_search_and_journals_from_the_map(tmp_path, monkeypatch):
    """A mapped file's tensors are disjoint (its header's entries may not overlap): the apply does not look for
    tied weights (reading every tensor's address, shape and strides: ~0.3 s a step at 70,000 tensors), and the
    journal reads the old words through the map's numpy views (no torch view per tensor); the result and the
    rollback are as before."""
    from deltasync import apply as apply_mod

    def no_search(*a, **k):
        raise AssertionError("find_aliases called for a mapped file")

    monkeypatch.setattr(apply_mod, "find_aliases", no_search)
    monkeypatch.setattr(filetarget, "word_view", no_search, raising=False)
    s0 = _state(3)
    s1 = _step(s0, 4)
    t = _file(tmp_path, s0)
    before = t.path.read_bytes()
    enc = encode_delta(s0, s1, model="m", version=4, parent=3)
    staged = t.stage_delta(prepare_delta(enc.manifest, enc.blobs), {n: tensor_fingerprint(v) for n, v in s0.items()},
                           verify="incremental")
    assert all(torch.equal(t.tensors()[n].view(-1).view(torch.uint8), s1[n].view(-1).view(torch.uint8)) for n in s1)
    staged.rollback()
    t.close()
    assert t.path.read_bytes() == before


def test_a_file_target_keeps_its_fingerprints_as_one_table_step_after_step(tmp_path):
    """subscribe --out's state at 100k+ tensors: the fingerprints stay one uint64 array in the rows of the file's
    layout (FingerprintTable), each step a new table (the columns' and the chunk-by-chunk tensors' fingerprints
    put in); a step that fails its state check is rolled back and leaves the table it had."""
    from deltasync.client.livestate import LiveState
    from deltasync.client.ready import ReadyStep
    from deltasync.fingerprint import FingerprintTable

    s0 = _state(7)
    s1 = _step(s0, 8)
    s2 = _step(s1, 9)
    t = _file(tmp_path, s0)
    live = LiveState(t, version=3)
    live.fps = t.scan()
    assert type(live.fps) is FingerprintTable and live.fps.names is t.name_index()

    def ready(a, b, version, state_fp=None):
        enc = encode_delta(a, b, model="m", version=version, parent=version - 1)
        return ReadyStep(kind="delta", version=version, base=version - 1, state_fp=state_fp or enc.manifest.state_fp,
                         manifest=enc.manifest, generation=0, prepared=prepare_delta(enc.manifest, enc.blobs))

    out = live.apply(ready(s0, s1, 4))
    assert out.applied and live.version == 4
    assert type(live.fps) is FingerprintTable and live.fps.names is t.name_index()
    assert dict(live.fps) == {n: tensor_fingerprint(v) for n, v in s1.items()}
    held = live.fps
    out = live.apply(ready(s1, s2, 5, state_fp="0" * 16))  # the signed state says otherwise: rolled back
    assert not out.applied and out.failure == "integrity" and live.version == 4 and live.fps is held
    assert all(torch.equal(t.tensors()[n].view(-1).view(torch.uint8), s1[n].view(-1).view(torch.uint8)) for n in s1)
    assert live.apply(ready(s1, s2, 5)).applied and dict(live.fps) == {n: tensor_fingerprint(v) for n, v in s2.items()}
