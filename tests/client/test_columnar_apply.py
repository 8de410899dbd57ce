"""A subscriber's decode -> stage -> journal -> commit as columns (issue 22) on a state of thousands of small tensors.

``prepare_delta`` keeps a delta's ans chunks as columns (``apply.ColumnarPatches``: no object per chunk), the
patch builds the kernel's job rows with numpy, the ``--out`` file's undo journal is ``jrnl03`` (per word size one
group of chunk rows, offsets and old words). Here, on 3,000 tensors of five dtypes (some unchanged, one rewritten
densely, so one tensor takes the chunk-by-chunk path beside the columns), everything must equal the chunk-by-chunk
path (the same delta prepared as a plain dict of ChunkPatch lists) bit for bit: the tensors, the fingerprints, the
file's bytes; and every failure must leave the tensors or the file exactly as they were: a wrong fingerprint after,
a wrong base, a change outside its chunk, a crash after the journal (``recover``), a rollback.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from deltasync import kernels
from deltasync.apply import ColumnarPatches, apply_prepared, prepare_delta
from deltasync.codec import EncodeOptions, encode_delta
from deltasync.errors import ApplyError, BaseMismatchError, FormatError, IntegrityError
from deltasync.fingerprint import tensor_fingerprint
from deltasync.manifest import parse_manifest, table_columns
from deltasync.client import filetarget
from deltasync.client.filetarget import FileTarget, journal_path, recover

pytest.importorskip("numba")

from core_support import restore_kernels  # noqa: E402,F401  (autouse)

N_TENSORS = 3000
DTYPES = (torch.bfloat16, torch.float32, torch.int8, torch.float16, torch.int64)
DENSE = "t.dense"  # rewritten in full: a dense chunk


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    old, new = {}, {}
    for i in range(N_TENSORS):
        dt = DTYPES[i % len(DTYPES)]
        n = 16 + (i * 37) % 300
        t = (torch.randn(n, generator=g) * 50).to(dt) if dt.is_floating_point else \
            torch.randint(-100, 100, (n,), generator=g).to(dt)
        name = f"layers.{i // 16}.experts.{i % 16}.w{i % 3}"
        old[name] = t
        if i % 7 == 3:  # unchanged
            new[name] = t.clone()
            continue
        w = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).clone()
        idx = torch.randint(0, n, (max(1, n // 40),), generator=g)
        w[idx] += 1
        w[idx[::5]] = 3  # some raw words
        new[name] = w.view(dt)
    old[DENSE] = torch.randn(4096, generator=g).to(torch.bfloat16)
    new[DENSE] = (old[DENSE].view(torch.int16) ^ -0x3F01).view(torch.bfloat16)  # every word, sign flipped: raw
    return old, new


@pytest.fixture(scope="module", params=["one-blob", "many-blobs", "many-blobs-parsed"])
def delta(request):
    """The step as one blob, and cut into blobs of ~4 KiB and chunks of at most 64 words (several chunks a tensor,
    the columns of many blobs concatenated); and that manifest as a subscriber has it: format 3, parsed, its
    table's columns read without a record made (``manifest.table_columns``)."""
    old, new = _states()
    options = EncodeOptions() if request.param == "one-blob" else EncodeOptions(chunk_words=64, blob_target=4096)
    enc = encode_delta(old, new, model="m", version=2, parent=1, options=options)
    assert (len(enc.manifest.blobs) == 1) == (request.param == "one-blob")
    if request.param.endswith("parsed"):
        parsed = parse_manifest(enc.manifest.compact().to_json())
        assert table_columns(parsed) is not None
        enc = dataclasses.replace(enc, manifest=parsed)
    return old, new, enc


def _fps(state):
    return {n: tensor_fingerprint(t) for n, t in state.items()}


def _words(state):
    return {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in state.items()}


def _clone(state):
    return {n: t.clone() for n, t in state.items()}


def _by_chunks(prepared):
    """The same prepared delta as a plain dict of ChunkPatch lists: the chunk-by-chunk path."""
    return dataclasses.replace(prepared, patches={n: list(prepared.patches[n]) for n in prepared.patches})


def _columns(prepared) -> ColumnarPatches:
    cols = prepared.patches
    assert type(cols) is ColumnarPatches
    pure, _, rest = cols.pure()
    assert [cols.names[t] for t in rest] == [DENSE] and len(pure.names) > 2000  # both paths taken
    return cols


def test_the_columns_are_the_chunks(delta):
    old, new, enc = delta
    cols = _columns(prepare_delta(enc.manifest, enc.blobs))
    kernels.select("reference")  # every chunk a ChunkPatch, decoded by numpy
    try:
        ref = prepare_delta(enc.manifest, enc.blobs)
    finally:
        kernels.select("numba")
    assert type(ref.patches) is not ColumnarPatches and list(ref.patches) == list(cols)
    for name, chunks in ref.patches.items():
        got = cols[name]
        assert len(got) == len(chunks)
        for a, b in zip(got, chunks):
            assert (a.tensor, a.dtype, a.start, a.stop) == (b.tensor, b.dtype, b.start, b.stop)
            if b.dense is not None:
                assert np.array_equal(a.dense, b.dense)
                continue
            for f in ("positions", "raw", "values"):
                x, y = getattr(a.changes, f), getattr(b.changes, f)
                assert x.dtype == y.dtype and np.array_equal(x, y)


def test_a_parsed_manifest_is_checked_planned_and_applied_from_its_columns(delta):
    """A subscriber's manifest (format 3, parsed): its table's columns are what the base check and the patch plan
    read; no record is made for the step."""
    import deltasync.manifest

    old, new, enc = delta
    deltasync.manifest._PARSED.clear()  # a fresh parse, not the fixture's manifest
    m = parse_manifest(enc.manifest.compact().to_json())
    prepared = prepare_delta(m, enc.blobs)
    _columns(prepared)
    a = _clone(old)
    assert apply_prepared(a, prepared, _fps(old)) == _fps(new) and _words(a) == _words(new)
    assert "made" not in vars(m.tensors)
    assert list(m.tensors) == list(enc.manifest.compact().tensors)  # made when asked for: the table's records


def test_the_layout_check_as_columns_is_the_record_check(delta):
    """apply.LayoutColumns (a file's layout as arrays, made once) accepts a parsed table exactly where the
    record-by-record comparison does: a tensor missing, of another dtype, of another shape or rank, is refused."""
    from deltasync.apply import LayoutColumns
    from deltasync.codec import state_layout

    old, _, enc = delta
    cols = table_columns(parse_manifest(enc.manifest.compact().to_json()))
    layout = {n: (d, tuple(s)) for n, (d, s) in state_layout(old).items()}
    name = cols.names[len(cols.names) // 2]
    d, s = layout[name]
    other = "float32" if d != "float32" else "bfloat16"
    for edit, ok in [(None, True), ((d, (*s, 1)), False), ((d, (s[0] + 1,)), False), ((other, s), False),
                     ("drop", False)]:
        lay = dict(layout)
        if edit == "drop":
            del lay[name]
        elif edit is not None:
            lay[name] = edit
        want = list(map(lay.get, cols.names)) == list(zip(cols.dtypes(), cols.shapes()))
        assert want == ok and LayoutColumns(lay).matches(cols) == ok, edit


@pytest.mark.parametrize("threads", [False, True], ids=["serial", "pool"])
def test_in_process_apply_equals_the_chunk_by_chunk_path(delta, threads):
    from concurrent.futures import ThreadPoolExecutor

    old, new, enc = delta
    prepared = prepare_delta(enc.manifest, enc.blobs)
    _columns(prepared)
    pool = ThreadPoolExecutor(2) if threads else None
    try:
        a, b = _clone(old), _clone(old)
        fa = apply_prepared(a, prepared, _fps(old), executor=pool)
        fb = apply_prepared(b, _by_chunks(prepared), _fps(old), executor=pool)
    finally:
        if pool is not None:
            pool.shutdown()
    assert _words(a) == _words(b) == _words(new)
    assert fa == fb == _fps(new)


def test_a_wrong_fingerprint_after_rolls_every_tensor_back(delta):
    old, new, enc = delta
    names = [r.name for r in enc.manifest.tensors]
    bad = names[len(names) // 2]
    tensors = tuple(dataclasses.replace(r, fp_after=f"{int(r.fp_after, 16) ^ 1:016x}") if r.name == bad else r
                    for r in enc.manifest.tensors)
    m = dataclasses.replace(enc.manifest, tensors=tensors)
    target = _clone(old)
    with pytest.raises(IntegrityError, match=bad.replace(".", r"\.")):
        apply_prepared(target, prepare_delta(m, enc.blobs), _fps(old))
    assert _words(target) == _words(old)


def _file(tmp_path, state, name="f.safetensors") -> FileTarget:
    t = FileTarget(tmp_path / name, "m", layout={n: (str(v.dtype).removeprefix("torch."), tuple(v.shape))
                                               for n, v in state.items()}, open_existing=False)
    t.stage_keyframe(state, _fps(state), version=1).commit()
    return t


def _spy_journal(monkeypatch):
    seen = []
    real = filetarget._write_journal

    def spy(path, info, regions, payload):
        seen.append((info, regions))
        real(path, info, regions, payload)
    monkeypatch.setattr(filetarget, "_write_journal", spy)
    return seen


def test_a_file_delta_equals_the_chunk_by_chunk_path_and_journals_columns(delta, tmp_path, monkeypatch):
    old, new, enc = delta
    seen = _spy_journal(monkeypatch)
    a, b = _file(tmp_path, old, "a.safetensors"), _file(tmp_path, old, "b.safetensors")
    prepared = prepare_delta(enc.manifest, enc.blobs)
    _columns(prepared)
    sa = a.stage_delta(prepared, _fps(old), verify="incremental")
    sb = b.stage_delta(_by_chunks(prepared), _fps(old), verify="incremental")
    sa.commit()
    sb.commit()
    (ia, ra), (ib, rb) = seen
    assert {g["word"] for g in ia["sparse"]} == {1, 2, 4, 8} and "sparse" not in ib  # jrnl03 / jrnl02
    dense = sum(c.dense is not None for c in prepared.patches[DENSE])
    assert dense and [r["kind"] for r in ra] == ["bytes"] * (dense + 1)  # the dense tensor's chunks, the header
    assert journal_path(a.path).exists() is False
    assert sa.fps == sb.fps == _fps(new)
    a.close()
    b.close()
    assert a.path.read_bytes()[4096:] == b.path.read_bytes()[4096:]  # the data (headers differ by nothing but...)
    assert a.path.read_bytes() == b.path.read_bytes()


def test_a_crash_after_the_journal_rolls_the_file_back_byte_for_byte(delta, tmp_path):
    old, new, enc = delta
    t = _file(tmp_path, old)
    before = t.path.read_bytes()
    staged = t.stage_delta(prepare_delta(enc.manifest, enc.blobs), _fps(old), verify="incremental")
    assert journal_path(t.path).read_bytes().startswith(filetarget.MAGIC_COLUMNS)
    t.file.flush()
    t.close()  # killed before the commit: the file holds the patched words and the "patching" header
    assert t.path.read_bytes() != before
    info = recover(t.path)
    assert info is not None and info["from"] == 1 and info["to"] == 2
    assert t.path.read_bytes() == before and not journal_path(t.path).exists()
    del staged


def test_a_rollback_restores_the_file(delta, tmp_path):
    old, new, enc = delta
    t = _file(tmp_path, old)
    before = t.path.read_bytes()
    staged = t.stage_delta(prepare_delta(enc.manifest, enc.blobs), _fps(old), verify="incremental")
    staged.rollback()
    t.close()
    assert t.path.read_bytes() == before and not journal_path(t.path).exists()


def test_failures_leave_the_file_as_it_was(delta, tmp_path):
    old, new, enc = delta
    t = _file(tmp_path, old)
    before = t.path.read_bytes()
    names = [r.name for r in enc.manifest.tensors]
    # a wrong fingerprint after, on a tensor in the middle: every word written is restored
    bad = names[len(names) // 3]
    m = dataclasses.replace(enc.manifest, tensors=tuple(
        dataclasses.replace(r, fp_after=f"{int(r.fp_after, 16) ^ 1:016x}") if r.name == bad else r
        for r in enc.manifest.tensors))
    with pytest.raises(IntegrityError):
        t.stage_delta(prepare_delta(m, enc.blobs), _fps(old), verify="incremental")
    # a wrong base: refused before anything is written
    fps = _fps(old)
    fps[names[5]] ^= 1
    with pytest.raises(BaseMismatchError):
        t.stage_delta(prepare_delta(enc.manifest, enc.blobs), fps, verify="incremental")
    # a change outside its chunk (the columns' views changed behind the prepared delta's back): refused by the
    # journal, before the file changes
    prepared = prepare_delta(enc.manifest, enc.blobs)
    c = prepared.patches[names[len(names) // 2]][0]
    c.changes.positions[-1] = c.stop
    with pytest.raises(FormatError, match="leaves its chunk"):
        t.stage_delta(prepared, _fps(old), verify="incremental")
    assert not journal_path(t.path).exists()
    # and the honest delta still lands afterwards
    t.stage_delta(prepare_delta(enc.manifest, enc.blobs), _fps(old), verify="incremental").commit()
    assert t.scan() == _fps(new)
    t.close()
    assert t.path.read_bytes() != before


def test_a_position_outside_its_tensor_in_process_is_rolled_back(delta):
    old, new, enc = delta
    prepared = prepare_delta(enc.manifest, enc.blobs)
    names = list(prepared.patches)
    victim = names[-3]
    c = prepared.patches[victim][-1]
    c.changes.positions[-1] = 10**9  # past its tensor: the patch kernel refuses the job
    target = _clone(old)
    with pytest.raises(ApplyError, match="outside a tensor"):
        apply_prepared(target, prepared, _fps(old))
    assert _words(target) == _words(old)


_RECORD_CASES = [("start", -1), ("start", 1.0), ("start", True), ("start", "0"), ("stop", 0), ("count", 0),
                 ("count", 10**6), ("na", 1), ("nr", 1), ("dtype", "float128"), ("dtype", 7), ("dtype", "int64"),
                 ("tensor", None), ("mode", "dense"), ("mode", ["ans"]), ("extra", 1), ("nr", "drop"),
                 ("count", 2**60)]


@pytest.mark.parametrize("field,value", _RECORD_CASES, ids=[f"{f}={v!r}" for f, v in _RECORD_CASES])
def test_a_malformed_ans_record_fails_as_the_record_loop_says(delta, monkeypatch, field, value):
    """decode_blob checks a blob of ans chunks as columns (codec._ans_blob_rows): a record it does not take goes
    to the record-by-record loop, which raises the same FormatError as before (or decodes the same chunks)."""
    from deltasync import codec

    old, new, enc = delta
    fmt2 = dataclasses.replace(_options(enc), format=2)  # JSON records: any value of any type can be forged
    data = next(iter(encode_delta(old, new, model="m", version=2, parent=1, options=fmt2).blobs.values()))
    real = codec.BlobReader

    def mutated(raw, **kw):
        reader = real(raw, **kw)
        assert reader.version == 2
        rec = dict(reader.chunks[1])
        if value == "drop":
            del rec[field]
        elif field in ("na", "nr") and type(value) is int and value == 1:
            rec[field] = rec[field] + 1  # one item more than its streams hold
        else:
            rec[field] = value
        reader.chunks = [reader.chunks[0], rec, *reader.chunks[2:]]
        return reader

    _fails_as_the_record_loop_says(monkeypatch, data, mutated)


def _fails_as_the_record_loop_says(monkeypatch, data: bytes, mutated) -> None:
    """``decode_blob(data)`` with blobs read by ``mutated`` fails with a FormatError, the same one (or the same
    chunks) through the columns' checks (``codec._ans_blob_rows``) and through the record-by-record loop."""
    from deltasync import codec

    monkeypatch.setattr(codec, "BlobReader", mutated)

    def outcome():
        try:
            return [(p.tensor, p.start, p.stop, p.count) for p in codec.decode_blob(data)]
        except Exception as e:  # noqa: BLE001 - compared below
            return type(e), str(e)

    fast = outcome()
    monkeypatch.setattr(codec, "_ans_blob_rows", lambda reader: None)
    assert fast == outcome()
    assert isinstance(fast, tuple) and issubclass(fast[0], FormatError), fast


def _options(enc) -> EncodeOptions:
    """The options the ``delta`` fixture encoded with (one blob, or many small ones)."""
    return EncodeOptions() if len(enc.manifest.blobs) == 1 else EncodeOptions(chunk_words=64, blob_target=4096)


_COLUMN_CASES = [("start", -1), ("stop", 0), ("count", 0), ("count", 10**6), ("na", "+1"), ("nr", "+1"),
                 ("count", 2**60), ("start", 2**48 + 1), ("dtype", "int64"), ("dtype", "float128"), ("mode", 1)]


@pytest.mark.parametrize("field,value", _COLUMN_CASES, ids=[f"{f}={v!r}" for f, v in _COLUMN_CASES])
def test_a_malformed_column_fails_as_the_record_loop_says(delta, monkeypatch, field, value):
    """Blob version 4: a chunk's column forged (as u64, so -1 is 2**64 - 1) is refused by the columns' checks
    (codec._ans_blob_rows) and by the record-by-record loop with the same FormatError."""
    from deltasync import codec
    from deltasync.blob import COLUMN_INTS

    old, new, enc = delta
    data = next(iter(enc.blobs.values()))
    real = codec.BlobReader

    def mutated(raw, **kw):
        reader = real(raw, **kw)
        cols = reader.columns
        assert reader.version == 4 and cols is not None
        ints, dtype, mode, dnames = cols.ints.copy(), cols.dtype.copy(), cols.mode.copy(), list(cols.dtype_names)
        if field in COLUMN_INTS:
            row = COLUMN_INTS.index(field)
            ints[row, 1] = ints[row, 1] + 1 if value == "+1" else np.uint64(value % 2**64)
        elif field == "dtype":
            dnames.append(value)
            dtype[1] = len(dnames) - 1
        else:
            mode[1] = value
        reader.columns = dataclasses.replace(cols, ints=ints, dtype=dtype, mode=mode, dtype_names=dnames)
        return reader

    _fails_as_the_record_loop_says(monkeypatch, data, mutated)
