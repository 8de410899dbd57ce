"""The columnar fast path of diff_states / encode_diff (deltasync.columnar, issue 22) against the per-chunk path:
the same manifest (format 2 and compact), the same blobs, the same fingerprints, on states of many small tensors
of mixed dtypes and shapes; the diff's lazy ``chunks`` the same ChunkDiffs; the paths it leaves to the per-chunk
code (format 1, base-conditioned, packing by cells) fed from it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from deltasync import columnar
from deltasync.codec import EncodeOptions, diff_states, encode_delta, encode_diff
from deltasync.deltafile import pack_delta_file
from deltasync.dtypes import HostTensor, dtype_info, host_words
from deltasync.manifest import parse_manifest
from deltasync.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the columnar path needs the compiled kernels")


@pytest.fixture(autouse=True, params=[0, 10**9], ids=["flat", "small-state"])
def flat_min(request, monkeypatch):
    """Every test with the columnar path taken whatever the state's size, and with it declined as for a small
    state (the diff's addressing and the per-chunk encoder)."""
    monkeypatch.setattr(columnar, "FLAT_MIN", request.param)
    return request.param

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "uint8": torch.uint8,
          "float64": torch.float64}


def _states(n: int = 3000, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two versions of a state of ``n`` small tensors (bf16 mostly, a few float32, an int32, a uint8 and a
    float64; 1-d and 2-d), one big 2-d tensor cut into row cells, one rewritten tensor, unchanged tensors,
    single-change tensors, one changed in a step that flips signs (raw words) for most words but not all."""
    rng = np.random.default_rng(seed)
    old: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}

    def put(name, dtype, shape, kind):
        if dtype in ("uint8", "int32"):
            t = torch.from_numpy(rng.integers(0, 100, shape).astype(np.int64)).to(DTYPES[dtype])
        else:
            t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(DTYPES[dtype])
        u = t.clone()
        w = host_words(u)  # u's words, shared
        wdt = w.dtype
        if kind == "rewrite":  # every word differs, its sign flipped: raw words, a dense chunk
            w[:] = ~w
        elif kind.startswith("raw"):  # every word changes, ``raw<k>`` of them by a sign flip (raw words), the others by +1
            w[:] = w + wdt.type(1)
            k = int(kind[3:])
            w[:k] = w[:k] ^ wdt.type(1 << (8 * wdt.itemsize - 1))
        elif kind == "single":
            p = int(rng.integers(0, w.size))
            w[p] = w[p] + wdt.type(1)
        elif kind == "sparse":
            k = max(1, w.size // 100)
            p = rng.choice(w.size, size=k, replace=False)
            w[p] = w[p] + rng.integers(1, 40, k).astype(wdt)
            big = p[: k // 5]
            w[big] = w[big] ^ wdt.type(1 << (8 * wdt.itemsize - 1))  # sign flips: raw words
        old[name], new[name] = t, u

    shapes = [(64,), (3, 40), (128, 64), (7,), (1, 300), (1024,)]
    kinds = ["sparse"] * 6 + ["single", "same"]
    for i in range(n):
        dtype = "bfloat16" if i % 50 else ("float32" if i % 100 else "float64")
        put(f"model.layers.{i // 64}.mlp.experts.{i % 64}.w{i % 3}.weight", dtype, shapes[i % len(shapes)],
            kinds[i % len(kinds)])
    put("model.embed.int_table", "int32", (50, 20), "sparse")
    put("model.embed.bytes", "uint8", (4000,), "sparse")
    put("model.lm_head.weight", "bfloat16", (1024, 640), "sparse")  # 655k words: cut into 8 row cells
    put("model.layers.0.rewritten", "bfloat16", (32, 32), "rewrite")
    put("model.layers.1.all_steps", "int32", (40,), "raw0")  # all words changed, no raw word: ans
    put("model.layers.1.half_raw", "int32", (40,), "raw20")  # half of them raw: still ans
    put("model.layers.1.most_raw", "int32", (40,), "raw21")  # more than half: dense
    put("model.norm.weight", "bfloat16", (0,), "same")  # empty
    for i in range(6):  # not contiguous: their words are copies (of one size: a freed copy's memory is reused)
        a = torch.from_numpy(rng.standard_normal((30, 50)).astype(np.float32)).to(torch.bfloat16)
        b = a.clone()
        b[3, 7 + i] += 1
        b[20, 40] -= 1
        old[f"model.z.transposed{i}"], new[f"model.z.transposed{i}"] = a.t(), b.t()
    return old, new


def _host(state: dict[str, torch.Tensor]) -> dict[str, HostTensor]:
    return {n: HostTensor(dtype=dtype_info(t.dtype).name, shape=tuple(t.shape), words=host_words(t))
            for n, t in state.items()}


def _encode(old, new, options, *, fast: bool, executor=None, base_fps=None):
    columnar.ENABLED = fast
    try:
        diff = diff_states(old, new, base_fps=base_fps, chunk_words=options.chunk_words, executor=executor)
        assert (diff.flat is not None) == fast
        return diff, encode_diff(diff, model="m", version=2, parent=1, options=options, meta={"k": "v"},
                                 base=old, executor=executor)
    finally:
        columnar.ENABLED = True


def _same(a, b) -> None:
    ma, mb = a.manifest, b.manifest
    assert ma == mb
    assert ma.meta == mb.meta and list(ma.meta) == list(mb.meta)
    assert [(c.start, c.stop) for t in ma.tensors for c in t.chunks] == \
        [(c.start, c.stop) for t in mb.tensors for c in t.chunks]
    assert list(a.blobs) == list(b.blobs) and a.blobs == b.blobs
    assert a.fps == b.fps
    assert ma.to_json() == mb.to_json()
    assert pack_delta_file(ma.compact(), a.blobs) == pack_delta_file(mb.compact(), b.blobs)
    # the format-3 form: the columnar encoder's table (packed from columns) is the record-by-record one's
    ca, cb = ma.compact(), mb.compact()
    assert ca.to_json() == cb.to_json() and ca.canonical_bytes() == cb.canonical_bytes()
    assert ca == cb and cb == ca and list(ca.tensors) == list(cb.tensors) and len(ca.tensors) == len(cb.tensors)
    assert [(c.start, c.stop) for t in ca.tensors for c in t.chunks] == \
        [(c.start, c.stop) for t in cb.tensors for c in t.chunks]
    assert ca.meta == cb.meta and ca.format == cb.format == 3


OPTIONS = [
    EncodeOptions(),  # one blob for this state
    EncodeOptions(blob_target=20_000, cell_blob_min=4_000),  # many blobs, cut inside tensors: spans in meta
    EncodeOptions(blob_target=1 << 20, cell_blob_min=0, chunk_words=500),  # many chunks a tensor, a blob a tensor
]


@pytest.mark.parametrize("opt", range(len(OPTIONS)))
@pytest.mark.parametrize("threads", [0, 2])
def test_fast_path_bytes_match_reference(opt, threads, flat_min):
    old, new = _states()
    options = OPTIONS[opt]
    pool = ThreadPoolExecutor(threads) if threads else None
    try:
        for a, b in ((old, new), (_host(old), _host(new))):
            d_ref, ref = _encode(a, b, options, fast=False, executor=pool)
            d_fast, fast = _encode(a, b, options, fast=True, executor=pool)
            assert columnar.takes_flat(d_fast, options) == (flat_min == 0)
            assert len(fast.manifest.tensors) == len(a) and fast.manifest.changed_words > 0
            if opt:
                assert len(fast.blobs) > 1
            _same(ref, fast)
            assert d_fast.fps_before == d_ref.fps_before and d_fast.fps_after == d_ref.fps_after
            assert d_fast.layout == d_ref.layout
    finally:
        if pool is not None:
            pool.shutdown()


def test_prepared_columns_are_freed_without_the_cyclic_collector(flat_min):
    """A follower's step is freed as soon as it is dropped: no reference cycle through its columns (``subscribe
    --out`` freezes what lives at start; a cycle dying later was never freed: ~10 bytes a changed word a step)."""
    import sys

    from deltasync.apply import ColumnarPatches, prepare_delta

    rng = np.random.default_rng(3)
    old = {f"layers.{i}.w": torch.from_numpy(rng.standard_normal((16, 32)).astype(np.float32)).to(torch.bfloat16)
           for i in range(300)}
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        host_words(t)[::37] += 1  # every tensor changed, a few words each: every chunk in the columns
    _, enc = _encode(_host(old), _host(new), EncodeOptions(), fast=True)
    prepared = prepare_delta(parse_manifest(enc.manifest.compact().to_json()), enc.blobs)
    cols = prepared.patches
    assert isinstance(cols, ColumnarPatches) and not cols.others
    assert cols.pure()[0] is cols and cols.pure()[0] is cols  # (made, then remembered)
    del prepared
    assert sys.getrefcount(cols) == 2  # this name and the call's argument: nothing of its own points back at it


def test_released_columns_are_made_again_from_the_table(flat_min):
    """A subscriber lets go of an applied manifest's columns (release_columns); asked for again, they are the same,
    made from its table; any other manifest is left as it is."""
    from deltasync.apply import prepare_delta
    from deltasync.manifest import release_columns, table_columns

    old, new = _states(200)
    _, enc = _encode(_host(old), _host(new), EncodeOptions(), fast=True)
    m = parse_manifest(enc.manifest.compact().to_json())
    before = table_columns(m)
    names, fps = list(before.names), before.fps.copy()
    release_columns(m)
    assert "columns" not in m.tensors.__dict__
    again = table_columns(m)
    assert again is not before and again.names == names and again.fps.tolist() == fps.tolist()
    assert table_columns(m) is again  # made once
    assert prepare_delta(m, enc.blobs).decoded_bytes > 0
    release_columns(enc.manifest)  # a manifest made in memory (records): nothing to let go of
    assert table_columns(enc.manifest) is None


def test_a_publish_makes_no_format_2_record(flat_min):
    """The columnar encoder's format-2 records and span entries are made only if used: what a publish does with
    the manifest (digests, compact, sign, send, count the changed words) makes neither (~0.1 s at 70,000
    tensors); used after, they are the record-by-record encoder's."""
    from deltasync.manifest import LazyMeta, LazyRecords
    from deltasync.signing import as_signer

    if flat_min:
        pytest.skip("the columnar encoder only")
    old, new = _states()
    options = OPTIONS[1]  # many blobs: span entries in the format-2 meta
    _, ref = _encode(_host(old), _host(new), options, fast=False)
    _, fast = _encode(_host(old), _host(new), options, fast=True)
    m = fast.manifest
    assert isinstance(m.tensors, LazyRecords) and isinstance(m.meta, LazyMeta)
    sent = m.with_digests(fast.blobs).compact().sign(as_signer(b"k" * 32))
    parse_manifest(sent.to_json(), verifier=b"k" * 32)
    assert m.changed_words == ref.manifest.changed_words and m.total_bytes == ref.manifest.total_bytes
    assert m.coding == ref.manifest.coding
    assert "made" not in m.tensors.__dict__ and m.meta._pending is not None  # neither made
    assert sent.to_json() == ref.manifest.with_digests(ref.blobs).compact().sign(as_signer(b"k" * 32)).to_json()
    assert dict(m.meta) == dict(ref.manifest.meta) and m.meta._pending is None
    assert m.tensors == ref.manifest.tensors and "made" in m.tensors.__dict__


def test_dense_chunk_and_modes_present():
    """The state exercises what it should: a dense chunk and ans chunks."""
    from deltasync.blob import BlobReader

    old, new = _states(400)
    enc = encode_delta(_host(old), _host(new), model="m", version=2, parent=1)
    modes = {c["mode"] for data in enc.blobs.values() for c in BlobReader(data).chunks}
    assert modes == {"ans", "dense"}


def test_lazy_chunks_and_base_fps_and_update_old():
    """diff_states' columnar result: its ``chunks`` the per-chunk path's ChunkDiffs; with given base
    fingerprints; with update_old (the publisher's reference patched in place: the same words after)."""
    old, new = _states(600, seed=3)
    old = {n: t.contiguous() for n, t in old.items()}  # update_old needs contiguous tensors
    chunk_words = 700
    ref_copy = {n: t.clone() for n, t in old.items()}
    fast_copy = {n: t.clone() for n, t in old.items()}
    columnar.ENABLED = False
    try:
        ref = diff_states(ref_copy, new, chunk_words=chunk_words, update_old=True)
        fps = dict(ref.fps_before)
    finally:
        columnar.ENABLED = True
    fast = diff_states(fast_copy, new, chunk_words=chunk_words, update_old=True, base_fps=fps)
    assert fast.flat is not None
    assert fast.fps_before == ref.fps_before and fast.fps_after == ref.fps_after
    assert all(np.array_equal(host_words(fast_copy[n]), host_words(new[n])) for n in new)
    assert sorted(fast.chunks) == sorted(ref.chunks)
    for name, cs in ref.chunks.items():
        got = fast.chunks[name]
        assert [(c.start, c.stop) for c in got] == [(c.start, c.stop) for c in cs]
        for x, y in zip(got, cs):
            np.testing.assert_array_equal(x.positions, y.positions)
            np.testing.assert_array_equal(x.old, y.old)
            np.testing.assert_array_equal(x.new, y.new)
    assert fast.changed == ref.changed and fast.host_bytes == ref.host_bytes


@pytest.mark.parametrize("options", [EncodeOptions(format=1), EncodeOptions(coding="base-conditioned"),
                                     EncodeOptions(pack="cells", blob_target=30_000, cell_blob_min=5_000)])
def test_other_encodings_from_a_columnar_diff(options):
    """What encode_flat does not take (format 1, base-conditioned, packing by cells) is coded from the
    columnar diff's ChunkDiffs: the same bytes as from the per-chunk diff."""
    old, new = _states(300, seed=5)
    old, new = _host(old), _host(new)
    _, ref = _encode(old, new, options, fast=False)
    _, fast = _encode(old, new, options, fast=True)
    _same(ref, fast)


def test_names_that_need_json_escapes_and_an_unchanged_state():
    old, new = _states(60, seed=7)
    rename = {n: (n + ' "q"\\é\x7f' if i % 2 else n) for i, n in enumerate(sorted(old))}
    old = {rename[n]: t for n, t in old.items()}
    new = {rename[n]: t for n, t in new.items()}
    _, ref = _encode(old, new, EncodeOptions(blob_target=4000), fast=False)
    _, fast = _encode(old, new, EncodeOptions(blob_target=4000), fast=True)
    _same(ref, fast)
    _, ref = _encode(old, old, EncodeOptions(), fast=False)
    _, fast = _encode(old, old, EncodeOptions(), fast=True)
    _same(ref, fast)
    assert not fast.blobs


@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_every_tensor_changed_names_cut_from_one_text(opt, flat_min, monkeypatch):
    """Every tensor changed (an AdamW step): the table's names and each version-4 blob's chunk names are pieces of
    the state's names joined once; the bytes are the per-chunk path's all the same."""
    old, new = _states(600)
    for name in [n for n in old if torch.equal(old[n], new[n]) and old[n].numel()]:
        new[name] = old[name].clone()
        host_words(new[name])[0] += 1
    for name in ("model.norm.weight", "model.lm_head.weight"):  # (an empty tensor cannot change; one cut in cells)
        del old[name], new[name]
    cut = []
    real = columnar.pack_chunk_columns
    monkeypatch.setattr(columnar, "pack_chunk_columns", lambda names, *a: (cut.append(type(names)), real(names, *a))[1])
    options = OPTIONS[opt]
    d_ref, ref = _encode(old, new, options, fast=False)
    d_fast, fast = _encode(old, new, options, fast=True)
    _same(ref, fast)
    assert all(t.changed for t in fast.manifest.tensors)
    if flat_min == 0 and opt != 2:  # (option 2 cuts tensors into many chunks: names listed, one a chunk)
        assert memoryview in cut


def test_a_state_of_empty_tensors():
    old = {"a": torch.zeros(0, dtype=torch.bfloat16), "b": torch.zeros((3, 0), dtype=torch.float32)}
    new = {n: t.clone() for n, t in old.items()}
    _, ref = _encode(old, new, EncodeOptions(), fast=False)
    _, fast = _encode(old, new, EncodeOptions(), fast=True)
    _same(ref, fast)


@pytest.mark.parametrize("one_size", [True, False])
def test_many_compare_segments(monkeypatch, one_size):
    """Compare tasks of a few thousand words: the changes come in many segments (one word size: each blob's
    chunks in runs of a segment; mixed: chunks ordered across segments)."""
    monkeypatch.setattr(columnar, "PIECE_WORDS", 3000)
    old, new = _states(800, seed=11)
    if one_size:
        old = {n: t for n, t in old.items() if t.dtype == torch.bfloat16}
        new = {n: new[n] for n in old}
    pool = ThreadPoolExecutor(2)
    try:
        for options in (EncodeOptions(), EncodeOptions(blob_target=9_000, cell_blob_min=2_000)):
            d_ref, ref = _encode(old, new, options, fast=False, executor=pool)
            d_fast, fast = _encode(old, new, options, fast=True, executor=pool)
            assert len(d_fast.flat.segs) > 50
            assert bool((np.diff(d_fast.flat.seg) >= 0).all()) == one_size
            _same(ref, fast)
    finally:
        pool.shutdown()



def test_strided_host_words_are_left_to_the_per_chunk_path():
    """A HostTensor over strided words (not one run of memory): the compare kernel's job rows cannot address
    it, so diff_flat declines (the per-chunk path's kernels do not take such words either: a typing error
    there, a limitation of that path)."""
    base = np.arange(2000, dtype=np.uint16)
    old = {"a": HostTensor(dtype="bfloat16", shape=(1000,), words=base[::2])}
    new = {"a": HostTensor(dtype="bfloat16", shape=(1000,), words=(base + 1)[::2])}
    assert columnar.diff_flat(old, new, base_fps=None, chunk_words=1 << 20, update_old=False, progress=None,
                              executor=None) is None


@pytest.mark.parametrize("opt", [0, 1, 2])
def test_two_mapped_files_of_one_header_compare_from_its_columns(tmp_path, opt, flat_min, monkeypatch):
    """Two safetensors files of one layout, mapped (``publish --base``): the compare's jobs come from the header's
    columns (no tensor looked at); the diff and its encoding are the tensor-by-tensor path's."""
    from safetensors.torch import save_file

    from deltasync.tensorfile import MappedTensorFile

    old, new = _states(600, seed=4)
    old = {n: t.contiguous() for n, t in old.items()}
    new = {n: t.contiguous() for n, t in new.items()}
    save_file(old, str(tmp_path / "a.safetensors"))
    save_file(new, str(tmp_path / "b.safetensors"))
    options = OPTIONS[opt]
    seen = []
    real = columnar._mapped_jobs
    monkeypatch.setattr(columnar, "_mapped_jobs", lambda *a: seen.append(real(*a)) or seen[-1])
    with MappedTensorFile(tmp_path / "a.safetensors") as fa, MappedTensorFile(tmp_path / "b.safetensors") as fb:
        a, b = fa.host, fb.host
        assert a.header.entries is b.header.entries
        d_ref, ref = _encode(dict(a), dict(b), options, fast=True)  # plain dicts: tensor by tensor
        assert seen[-1] is None
        d_map, got = _encode(a, b, options, fast=True)
        assert (seen[-1] is not None) == (flat_min == 0)
        _same(ref, got)
        assert d_map.fps_before == d_ref.fps_before and d_map.fps_after == d_ref.fps_after
        assert d_map.layout == d_ref.layout
        # a mapping changed since it was made is compared as it is now
        b2 = type(b)(b)
        b2.header, b2.whole = b.header, b.whole
        del b2["model.embed.bytes"]
        with pytest.raises(Exception):
            diff_states(a, b2)
