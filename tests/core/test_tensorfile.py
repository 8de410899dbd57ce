"""parse_header's two JSON paths (issue 22): orjson where its re-encoding gives the header's bytes back,
the stdlib with a pairs hook otherwise; both must give the same header and the same errors."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save

from deltasync import tensorfile
from deltasync.errors import FormatError
from deltasync.tensorfile import build_header, parse_header

pytest.importorskip("orjson")


def _file(body: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(body)) + body + data


def _both(buf: bytes, monkeypatch):
    fast = parse_header(buf)
    with monkeypatch.context() as m:
        m.setattr(tensorfile, "_orjson", None)
        slow = parse_header(buf)
    assert fast == slow
    return fast


def _used_fast(buf: bytes) -> bool:
    (n,) = struct.unpack_from("<Q", buf)
    return tensorfile._fast_json(bytes(buf[8 : 8 + n])) is not None


def test_safetensors_file_takes_the_fast_path(monkeypatch):
    state = {f"model.layers.{i}.mlp.experts.{j}.w1.weight": torch.randn(3, 2).to(torch.bfloat16)
             for i in range(3) for j in range(4)}
    state["x"] = torch.zeros(0)
    buf = save(state, metadata={"format": "pt"})
    assert _used_fast(buf)
    h = _both(buf, monkeypatch)
    assert {e.name for e in h.entries} == set(state)
    assert h.metadata == {"format": "pt"}


def test_build_header_takes_the_fast_path(monkeypatch):
    header, offsets = build_header({"a": ("float32", (2, 3)), "b": ("bfloat16", (5,)), "c": ("float8_e8m0fnu", (4,))},
                                   {"k": "v"})
    size = offsets["c"] + 4  # laid out by element size: a (24 bytes), b (10), c (4)
    buf = header + bytes(size - len(header))
    assert _used_fast(buf)
    h = _both(buf, monkeypatch)
    assert [(e.name, e.dtype, e.shape) for e in h.entries] == [("a", "float32", (2, 3)), ("b", "bfloat16", (5,)),
                                                               ("c", "float8_e8m0fnu", (4,))]


def test_other_spellings_take_the_stdlib_path_with_the_same_result(monkeypatch):
    entries = {"é": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
               "z": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]}}
    for body in (json.dumps(entries).encode(),  # spaces after separators
                 json.dumps(entries, separators=(",", ":")).encode(),  # \u00e9 escapes
                 json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()):  # raw UTF-8
        buf = _file(body, b"abc")
        h = _both(buf, monkeypatch)
        assert [(e.name, e.start, e.stop) for e in h.entries] == [("é", 8 + len(body), 10 + len(body)),
                                                                  ("z", 10 + len(body), 11 + len(body))]


@pytest.mark.parametrize("body, message", [
    (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
     "appears twice"),
    (b'{"__metadata__":{"k":"v","k":"v"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "appears twice"),
    (b'{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "malformed"),
    (b'{"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "object of strings"),
    (b'[1]', "not a JSON object"),
    (b'{"a":', "not JSON"),
    (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[0],"data_offsets":[1,1]},'
     b'"b":{"dtype":"U8","shape":[0],"data_offsets":[1,1]}}', "appears twice"),  # no hole betrays this one
])
def test_duplicates_and_malformed_headers_fail_on_either_path(body, message, monkeypatch):
    buf = _file(body, b"x")
    with pytest.raises(FormatError, match=message):
        parse_header(buf)
    monkeypatch.setattr(tensorfile, "_orjson", None)
    with pytest.raises(FormatError, match=message):
        parse_header(buf)


def test_big_integers_fall_back_to_the_stdlib_error():
    body = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,' + str(1 << 70).encode() + b']}}'
    with pytest.raises(FormatError, match="do not fit"):
        parse_header(_file(body, b"x"))


def test_the_same_header_twice_is_parsed_once(monkeypatch):
    """A step's two checkpoints have the same header byte for byte: the second parse is the first's result
    (0.37 s a file at 70,000 tensors), with its own metadata dict; another size or header is parsed anew."""
    state = {f"w{i}": torch.randn(3, 2) for i in range(5)}
    buf = save(state, metadata={"step": "1"})
    first = parse_header(buf)
    calls = []
    real = tensorfile._fast_json
    monkeypatch.setattr(tensorfile, "_fast_json", lambda text: calls.append(1) or real(text))
    again = parse_header(bytearray(buf))
    assert again == first and not calls
    assert again.metadata is not first.metadata
    again.metadata["x"] = "y"
    assert parse_header(buf).metadata == {"step": "1"}
    with pytest.raises(FormatError, match="after the last tensor"):
        parse_header(buf + b"\0" * 8)  # the same header text, another size: checked anew
    other = save({**state, "w0": torch.randn(3, 3)}, metadata={"step": "1"})
    assert [e.shape for e in parse_header(other).entries][0] == (3, 3) and calls


@pytest.mark.parametrize("meta", [{"deltasync.version": "3"}, {}, {"x": "y", "deltasync.dtype.odd": "float8_e8m0fnu"}])
def test_a_built_header_is_what_parsing_it_gives(meta):
    """build_header leaves what parse_header makes of its bytes (a new ``--out`` file is mapped right after it
    is laid out: the parse was 0.6 s at 70,000 tensors); the same header, parsed from scratch, is equal."""
    layout = {f"t{i}": (("bfloat16", "float32", "float8_e8m0fnu", "int8", "complex128")[i % 5], (i % 3 + 1, 2))
              for i in range(40)}
    header, offsets = build_header(layout, meta, align=64, reserve=100)
    size = len(header) + max(offsets[n] - len(header) + tensorfile.dtype_info(d).element_size * s[0] * s[1]
                             for n, (d, s) in layout.items())
    buf = header + bytes(size - len(header))
    seeded = tensorfile._LAST_HEADER
    tensorfile._LAST_HEADER = None
    fresh = parse_header(buf)
    if any(k.startswith("deltasync.dtype.") for k in meta):  # a caller's own dtype entry: parsing judges it
        assert seeded is None or seeded[0] != header[8:]
        return
    assert seeded is not None and seeded[0] == header[8:] and seeded[1] == size
    assert seeded[2] == fresh
    assert {e.name: e.start for e in fresh.entries} == offsets


def test_the_column_checks_and_the_loop_agree(monkeypatch):
    """parse_header checks a header's entries as columns (~3x the loop at 70,000 tensors) and leaves any entry
    that breaks a rule to the loop, which names it: on a valid header both give the same entries, in header
    order; a broken one still fails with the loop's message."""
    state = {"z.scalar": torch.tensor(3.0), "a.empty": torch.zeros(0, 5), "m.w": torch.randn(4, 3).bfloat16(),
             "b.ids": torch.arange(7, dtype=torch.int8), **{f"e{i}": torch.randn(2, 1, 3) for i in range(30)}}
    buf = save(state, metadata={"k": "v"})
    tensorfile._LAST_HEADER = None
    fast = parse_header(buf)
    with monkeypatch.context() as m:
        m.setattr(tensorfile, "_entries_fast", lambda *a: None)
        tensorfile._LAST_HEADER = None
        slow = parse_header(buf)
    assert fast == slow and [e.name for e in fast.entries] == [e.name for e in slow.entries]
    (n,) = struct.unpack_from("<Q", buf)
    body = json.loads(bytes(buf[8 : 8 + n]))
    body["m.w"]["data_offsets"][1] += 2  # overlaps the next tensor
    text = json.dumps(body, separators=(",", ":")).encode()
    tensorfile._LAST_HEADER = None
    with pytest.raises(FormatError, match="m.w: data offsets"):
        parse_header(_file(text, bytes(buf[8 + n :])))


def test_a_mapped_state_knows_its_layout_from_its_header(tmp_path):
    """MappedTensorFile.host is a HostState: its records, bytes and layout come from the header (a 140k-tensor
    state was walked for each), and agree with a walk over its tensors; two files of one header have the same
    layout without a walk, and a state changed since it was made is walked."""
    from deltasync.codec import same_layout, state_layout
    from deltasync.fingerprint import state_fingerprint, state_fingerprint_of
    from deltasync.tensorfile import MappedTensorFile

    state = {f"w{i}": torch.randn(i + 1, 3).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(9)}
    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors").write_bytes(save(state))
    with MappedTensorFile(tmp_path / "a.safetensors") as fa, MappedTensorFile(tmp_path / "b.safetensors") as fb:
        a, b = fa.host, fb.host
        assert a.records() == [(n, t.dtype, t.shape) for n, t in a.items()]
        assert a.nbytes == sum(t.nbytes for t in a.values())
        assert a.header.entries is b.header.entries and same_layout(a, b)
        fps = {n: i for i, n in enumerate(a)}
        assert state_fingerprint_of(a, fps) == state_fingerprint(
            (n, state_layout(a)[n][0], state_layout(a)[n][1], fps[n]) for n in a)
        c = fa.host.__class__(b)
        c.header = b.header
        del c["w0"]
        assert not same_layout(a, c) and c.records() == [(n, t.dtype, t.shape) for n, t in c.items()]
        assert c.nbytes == a.nbytes - a["w0"].nbytes


def test_a_parsed_header_keeps_its_columns_and_makes_entries_only_when_used(tmp_path, monkeypatch):
    """A header checked as columns keeps them (tensorfile.HeaderColumns): its entries are made only if used (~0.03 s
    at 70,000 tensors), and are the loop's; a compare of two mapped files of one header, and their states, make
    none."""
    from deltasync import columnar
    from deltasync.codec import diff_states
    from deltasync.tensorfile import MappedTensorFile, entry_names, entry_starts, header_columns

    monkeypatch.setattr(columnar, "FLAT_MIN", 0)  # the mapped compare at this state's 71 tensors
    g = torch.Generator().manual_seed(0)
    state = {f"m.l{i}.w": torch.randn(40, 64, generator=g).bfloat16() for i in range(70)}
    state["m.norm"] = torch.randn(64, generator=g)
    (tmp_path / "a.safetensors").write_bytes(save(state))
    state["m.l3.w"][0, :5] += 1
    (tmp_path / "b.safetensors").write_bytes(save(state))
    tensorfile._LAST_HEADER = None
    with MappedTensorFile(tmp_path / "a.safetensors") as fa, MappedTensorFile(tmp_path / "b.safetensors") as fb:
        cols = header_columns(fa.header)
        assert cols is not None and fa.header.entries is fb.header.entries
        assert len(fa.header.entries) == len(state) and "made" not in fa.header.entries.__dict__
        d = diff_states(fa.host, fb.host, chunk_words=1 << 16)
        assert d.chunks and "made" not in fa.header.entries.__dict__
        names, starts = entry_names(fa.header), entry_starts(fa.header)
        assert "made" not in fa.header.entries.__dict__
        entries = list(fa.header.entries)  # made now
        assert [e.name for e in entries] == names and {e.name: e.start for e in entries} == starts
        assert [(e.dtype, e.shape, e.stop) for e in entries] == [
            (d_, s_, e_) for d_, s_, e_ in zip(cols.dtypes, cols.shapes, cols.stops.tolist())]
        tensorfile._LAST_HEADER = None
        with pytest.MonkeyPatch.context() as m:
            m.setattr(tensorfile, "_entries_fast", lambda *a: None)  # the loop's entries
            loop = parse_header(fa.buffer())
        assert header_columns(loop) is None and loop.entries == fa.header.entries and fa.header.entries == loop.entries


@pytest.mark.parametrize("name", ["model.layers.0.mlp.experts.7.w1.weight", "naïve.wéight", "tab\there", 'quo"te\\'])
def test_built_headers_are_the_stdlib_json_bytes(name, monkeypatch):
    """build_header serializes through orjson where every name and string is printable ASCII (a 70k-tensor
    header: ~5x faster), which gives json.dumps' bytes; anything else goes through json.dumps."""
    layout = {name: ("bfloat16", (3, 4)), "b": ("float8_e8m0fnu", (5,)), "c": ("int8", (7,)), "d": ("float32", ())}
    meta = {"deltasync.version": "3", "note": name}
    fast = build_header(layout, meta, align=64)
    with monkeypatch.context() as m:
        m.setattr(tensorfile, "_orjson", None)
        slow = build_header(layout, meta, align=64)
    assert fast == slow
    h = parse_header(fast[0] + bytes(4 + 24 + 5 + 7))  # f32 scalar, bf16 3x4, e8m0 5, int8 7
    assert {e.name for e in h.entries} == set(layout)


@pytest.mark.parametrize("layout, meta, columns", [
    ({f"m.l{i}.w": (("bfloat16", "float32", "int8", "float8_e4m3fn")[i % 4], (i % 3 + 1, 2)) for i in range(30)},
     {"deltasync.version": "3", "b": "x"}, True),
    ({"a": ("bfloat16", [2, 3]), "b": ("float32", ()), "c": ("uint8", (0,)), "d": ("float64", [4])}, {}, True),
    ({"a": ("bfloat16", (2, 3)), "b": ("float32", (1,))}, {"note": 'naïve "q"'}, True),
    ({"a": ("bfloat16", (2, 3)), "b": ("float8_e8m0fnu", (5,))}, {}, False),  # no tag of its own here
    ({"a": ("bfloat16", (2, 3)), "b": ("complex128", (5,))}, {}, False),  # stored as U8, named in the metadata
    ({'q"uote': ("bfloat16", (2, 3)), "b": ("float32", (1,))}, {}, False),
    ({"naïve": ("bfloat16", (2, 3))}, {}, False),
    ({}, {"x": "y"}, False),
])
def test_a_header_built_as_columns_is_the_loops(layout, meta, columns, monkeypatch):
    """build_header lays out a layout of tagged dtypes and plain names as columns (one text per dtype and shape,
    one formatted line per tensor: ~2.5x the loop at 70,000 tensors): the same bytes, offsets and parsed header
    as the entry-by-entry loop; any other layout is the loop's."""
    got = build_header(layout, meta, align=64, reserve=10)
    seeded = tensorfile._LAST_HEADER
    assert (tensorfile._build_columns(layout, meta, 64, None, 10) is not None) == columns
    with monkeypatch.context() as m:
        m.setattr(tensorfile, "_build_columns", lambda *a: None)
        tensorfile._LAST_HEADER = None
        want = build_header(layout, meta, align=64, reserve=10)
        assert got == want and (seeded is None) == (tensorfile._LAST_HEADER is None)
        if seeded is not None:
            assert seeded == tensorfile._LAST_HEADER
    size = len(got[0]) + sum(tensorfile.dtype_info(d).element_size * (s[0] if s else 1) * (s[1] if len(s) > 1 else 1)
                             for d, s in layout.values())
    tensorfile._LAST_HEADER = None
    parsed = parse_header(got[0] + bytes(size - len(got[0])))
    assert {e.name: e.start for e in parsed.entries} == got[1]
    if seeded is not None:
        assert seeded[2] == parsed


@pytest.mark.parametrize("edit", [
    lambda e: e.update(shape=[True, 3]), lambda e: e.update(shape=[4.0, 3]), lambda e: e.update(shape="4,3"),
    lambda e: e.update(data_offsets=[0.0, 24]), lambda e: e.update(data_offsets=[2**70, 2**70 + 24]),
    lambda e: e.update(data_offsets=[0]), lambda e: e.update(extra=1), lambda e: e.pop("dtype"),
    lambda e: e.update(dtype=5), lambda e: e.update(shape=[2**62, 2**62]), lambda e: e.update(shape=[-4, -3]),
])
def test_an_entry_the_columns_cannot_judge_is_left_to_the_loop(edit):
    state = {"m.w": torch.randn(4, 3).bfloat16(), **{f"e{i}": torch.randn(2, 3) for i in range(5)}}
    buf = save(state)
    (n,) = struct.unpack_from("<Q", buf)
    body = json.loads(bytes(buf[8 : 8 + n]))
    edit(body["m.w"])
    assert tensorfile._entries_fast(body, 8 + n, len(buf) - 8 - n) is None
    tensorfile._LAST_HEADER = None
    with pytest.raises(FormatError):
        parse_header(_file(json.dumps(body, separators=(",", ":")).encode(), bytes(buf[8 + n :])))


def test_a_states_tensors_are_made_once_whatever_threads_ask(tmp_path):
    """HostState makes its tensors on first use; threads asking at the same moment wait for that one making (a
    keyframe publish reads a state from its pool's threads): none sees a half-made state."""
    import sys
    import threading

    from deltasync.tensorfile import MappedTensorFile

    state = {f"t{i:05d}": torch.full((3,), float(i)) for i in range(20_000)}
    (tmp_path / "a.safetensors").write_bytes(save(state))
    names = sorted(state)
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can
    try:
        for _ in range(3):
            tensorfile._LAST_HEADER = None
            with MappedTensorFile(tmp_path / "a.safetensors") as f:
                host = f.host
                start = threading.Barrier(8)
                errors: list[BaseException] = []

                def read(k: int) -> None:
                    start.wait()
                    try:
                        for name in names[-1 - k :: -997]:
                            assert float(host[name].words.view("<f4")[0]) == float(int(name[1:]))
                        assert len(host) == len(state) and set(host) == set(state)
                    except BaseException as e:  # noqa: BLE001 - reported below
                        errors.append(e)

                threads = [threading.Thread(target=read, args=(k,)) for k in range(8)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert not errors, errors[0]
    finally:
        sys.setswitchinterval(was)


@pytest.mark.parametrize("columns", [True, False])
def test_a_writable_map_refuses_a_tensor_not_aligned_to_its_elements(tmp_path, monkeypatch, columns):
    """A writable map patches its tensors in place as words: a tensor that does not start at a multiple of its
    element size is refused when the file is opened, naming it, whether the header was parsed as columns (the
    check then makes no entry) or entry by entry; an aligned file opens and makes no entry."""
    if not columns:
        monkeypatch.setattr(tensorfile, "_entries_fast", lambda *a: None)
    tensorfile._LAST_HEADER = None

    def write(path, entries):
        body = json.dumps({n: {"dtype": d, "shape": s, "data_offsets": o} for n, d, s, o in entries}).encode()
        body += b" " * (-(8 + len(body)) % 8)
        path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(entries[-1][3][1]))

    bad = tmp_path / "bad.safetensors"
    write(bad, [("a.bytes", "U8", [3], [0, 3]), ("b.weight", "F32", [2], [3, 11]), ("c.weight", "BF16", [2], [11, 15])])
    with pytest.raises(FormatError, match=r"b\.weight starts at byte \d+, not aligned to its float32 elements"):
        tensorfile.MappedTensorFile(bad, writable=True)
    tensorfile.MappedTensorFile(bad).close()  # read-only: nothing is patched in place
    good = tmp_path / "good.safetensors"
    write(good, [("b.weight", "F32", [2], [0, 8]), ("c.weight", "BF16", [2], [8, 12]), ("a.bytes", "U8", [3], [12, 15])])
    tensorfile._LAST_HEADER = None
    f = tensorfile.MappedTensorFile(good, writable=True)
    if columns:
        assert tensorfile.header_columns(f.header) is not None
        assert f.header.entries.__dict__.get("made") is None  # no entry made
    f.close()


def test_a_header_of_many_entries_written_by_the_kernel_is_the_formatted_ones(monkeypatch):
    """From ``ENTRIES_KERNEL_MIN`` entries the columns' entries are written by one compiled pass
    (``kernels.cpu.header_entries``): the same bytes as formatting them, for mixed dtypes and ranks (scalars,
    empty tensors, offsets past 2**32), the same offsets and the same parsed header; below it, and without the
    compiled kernels, they are formatted."""
    import numpy as np

    from deltasync import kernels

    if kernels.cpu_kernels() is None:
        pytest.skip("the compiled kernels are not selected")
    n = tensorfile.ENTRIES_KERNEL_MIN + 37
    kinds = [("bfloat16", (64, 32)), ("float32", ()), ("float8_e4m3fn", (3, 0, 5)), ("int64", (7,)),
             ("float32", (1 << 20, 1 << 10)), ("uint8", (1, 2, 3, 4))]
    layout = {f"model.layers.{i // 384}.mlp.experts.{i % 384}.w{i % 7}": kinds[i % len(kinds)] for i in range(n)}
    meta = {"deltasync.version": "12", "k": "v"}
    calls = []
    real = tensorfile._entries_text
    monkeypatch.setattr(tensorfile, "_entries_text", lambda *a: calls.append(1) or real(*a))
    got = build_header(layout, meta, align=4096, reserve=256)
    assert calls and len(got[0]) > 1 << 18
    seeded = tensorfile._LAST_HEADER
    monkeypatch.setattr(tensorfile, "ENTRIES_KERNEL_MIN", n + 1)  # formatted, as below the threshold
    tensorfile._LAST_HEADER = None
    want = build_header(layout, meta, align=4096, reserve=256)
    assert got[0] == want[0] and dict(got[1]) == want[1] and seeded == tensorfile._LAST_HEADER
    assert max(want[1].values()) > 1 << 32
    monkeypatch.setattr(tensorfile, "ENTRIES_KERNEL_MIN", 1)
    monkeypatch.setattr(kernels, "cpu_kernels", lambda: None)  # no compiled kernels: formatted too
    tensorfile._LAST_HEADER = None
    assert build_header(layout, meta, align=4096, reserve=256)[0] == want[0]
    parsed = parse_header(got[0], size=len(got[0]) + sum(
        tensorfile.dtype_info(d).element_size * int(np.prod(s)) for d, s in layout.values()))
    assert {e.name: e.start for e in parsed.entries} == want[1]
