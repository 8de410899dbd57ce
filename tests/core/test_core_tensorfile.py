"""deltasync.tensorfile and deltasync.atomic: one safetensors parser for bytes and mmap'd files,
real files on disk, cross-checked against the safetensors library itself."""

from __future__ import annotations

import json
import struct
import warnings

import pytest
import safetensors
import safetensors.torch
import torch

from deltasync.atomic import remove_temp_files, temp_files, write_atomic
from deltasync.dtypes import DTYPES
from deltasync.errors import FormatError, StorageError
from deltasync.tensorfile import (ST_DTYPES, MappedTensorFile, load_shard, parse_header, read_state_file,
                                  save_shard, write_state_file)

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, info in sorted(DTYPES.items()):
        raw = torch.randint(0, 256, (3 * 2 * info.element_size,), dtype=torch.uint8, generator=g)
        if name == "bool":
            raw &= 1
        out[f"t.{name}"] = raw.view(info.torch_dtype).reshape(3, 2)
    out["empty"] = torch.empty(0, 4)
    out["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    return out


def _raw(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def _st(header: dict, body: bytes = b"") -> bytes:
    return _raw(json.dumps(header).encode(), body)


def test_every_dtype_round_trips_through_bytes_and_files(tmp_path):
    state = _every_dtype()
    data = save_shard(state, {"step": "3"})
    path = tmp_path / "s.safetensors"
    assert write_state_file(path, state, {"step": "3"}) == len(data) == path.stat().st_size
    for back in (load_shard(data), read_state_file(path)):
        assert set(back) == set(state)
        for n, t in state.items():
            assert back[n].dtype == t.dtype and back[n].shape == t.shape and _bits(back[n]) == _bits(t), n
    with MappedTensorFile(path) as f:
        assert f.metadata["step"] == "3" and f.metadata["deltasync.dtype.t.complex32"] == "complex32"


def test_native_dtypes_agree_with_the_safetensors_library(tmp_path):
    state = {n: t for n, t in _every_dtype().items() if n.removeprefix("t.") in ST_DTYPES.values()}
    path = tmp_path / "native.safetensors"
    safetensors.torch.save_file(state, str(path))  # written by the library, read by us
    ours = read_state_file(path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        for n in f.keys():
            theirs = f.get_tensor(n)
            assert ours[n].dtype == theirs.dtype and _bits(ours[n]) == _bits(theirs), n
    # and every tag we name is one the library names
    assert {str(t.dtype).removeprefix("torch.") for t in state.values() if t.dim()} <= set(ST_DTYPES.values())


def test_mapped_file_is_zero_copy_and_copy_on_write(tmp_path):
    path = tmp_path / "m.safetensors"
    write_state_file(path, {"a": torch.arange(1024, dtype=torch.float32), "b": torch.ones(8, dtype=torch.bfloat16)})
    before = path.read_bytes()
    with MappedTensorFile(path) as f:
        a = f.tensors["a"]
        base = torch.frombuffer(f._mm, dtype=torch.uint8).data_ptr()
        assert base <= a.data_ptr() < base + f.size  # a view of the mapped pages, not a copy
        a[0] = 42.0  # private to this process
        assert f.header.metadata == {} and [e.name for e in f.header.entries] == ["a", "b"]
    del a
    assert path.read_bytes() == before


def test_unaligned_data_from_a_foreign_writer_is_copied_not_refused():
    body = b"\x07" + struct.pack("<f", 1.5) + struct.pack("<f", -2.0)
    data = _st({"u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                "f": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}, body)
    back = load_shard(data)
    assert back["u"].tolist() == [7] and back["f"].tolist() == [1.5, -2.0]


@pytest.mark.parametrize("data,why", [
    (b"\x01\x00", "too short"),
    (struct.pack("<Q", 99) + b"{}", "runs past"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (struct.pack("<Q", 3) + b"{x}", "not JSON"),
    (_st({"__metadata__": {"k": 1}}), "object of strings"),
    (_raw(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
          b"\0\0"), "twice"),
    (_st({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"\0\0"), "hole or overlap"),
    (_st({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0\0"), "after the last tensor"),
    (_st({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0"), "truncated"),
    (_st({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"), "bad shape"),
    (_st({"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "not supported"),
    (_st({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}, b"\0"), "malformed"),
])
def test_header_must_rules(data, why):
    with pytest.raises(FormatError, match=why):
        parse_header(data)
    with pytest.raises(FormatError, match=why):
        load_shard(data)


def test_bad_files_name_themselves(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\xff" * 16)
    with pytest.raises(FormatError, match=str(p)):
        read_state_file(p)
    with pytest.raises(FileNotFoundError):
        read_state_file(tmp_path / "missing.safetensors")


# -- atomic files ---------------------------------------------------------------------------------

def test_write_atomic_replaces_or_keeps_the_old_file(tmp_path):
    p = tmp_path / "f.bin"
    write_atomic(p, b"one")
    write_atomic(p, memoryview(b"two"), fsync=False)
    assert p.read_bytes() == b"two"
    with pytest.raises(TypeError):
        write_atomic(p, 12345)  # type: ignore[arg-type]  # fails mid-write
    assert p.read_bytes() == b"two" and temp_files(p) == []
    with pytest.raises(StorageError, match="cannot write"):
        write_atomic(tmp_path / "no-such-dir" / "f.bin", b"x")
    other = tmp_path / "tmpdir"
    other.mkdir()
    write_atomic(p, b"three", tmp_dir=other)
    assert p.read_bytes() == b"three" and list(other.iterdir()) == []


def test_leftover_temp_files_are_found_by_name_and_only_those_removed(tmp_path):
    p = tmp_path / "live.safetensors"
    p.write_bytes(b"x")
    left = [tmp_path / ".live.safetensors.abc123.tmp", tmp_path / ".live.safetensors.zz.tmp"]
    keep = [tmp_path / ".other.safetensors.abc.tmp", tmp_path / "live.safetensors.tmp", tmp_path / ".live.safetensors.x"]
    for f in left + keep:
        f.write_bytes(b"")
    assert temp_files(p) == sorted(left)
    assert remove_temp_files(p) == 2
    assert all(f.exists() for f in keep + [p]) and not any(f.exists() for f in left)


def test_the_delta_file_module_still_exports_the_atomic_writes():
    from deltasync import atomic, deltafile

    assert deltafile.write_atomic is atomic.write_atomic and deltafile.fsync_dir is atomic.fsync_dir
