"""A keyframe shard received straight into ``subscribe --out``'s new file (issue 10), and every way its
transfer can go wrong.

``HttpClient.receive_blob`` into ``KeyframeWriter.shard_sink``: through the kernel's ``recv_into`` for
plain-HTTP sources (``direct``) and through aiohttp for the others; the same checks either way. A real
in-process origin serves the happy path; a small socket server on a thread of this test plays the
sources that misbehave (cut the body, ignore Range, flip a bit, lie about the length, go silent), each
answer built from the real shard bytes, Range honoured unless the fault says otherwise.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch

from deltasync.client.filetarget import FileTarget, KeyframeWriter
from deltasync.client.http import HttpClient, Timeouts
from deltasync.errors import IntegrityError, UpstreamError
from deltasync.fingerprint import tensor_fingerprint
from deltasync.keyframe import encode_keyframe

from inprocess_servers import origin_config, serving
from server_fixtures import TOKEN

PATHS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "aiohttp"])
FAST = Timeouts(connect=2.0, read=1.0, request=20.0, ttfb=2.0, cooldown=0.2, hedge_after=None)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "a.weight": torch.randn(700, 300, generator=g).bfloat16(),  # 420 kB: many receive pieces
        "b.bias": torch.randn(1001, generator=g),
        "c.ids": torch.randint(-100, 100, (333,), generator=g, dtype=torch.int8),  # odd bytes, 1-byte lanes
        "d.empty": torch.empty(0, 4, dtype=torch.float16),
        "e.f64": torch.randn(17, generator=g, dtype=torch.float64),
        "f.fp8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),  # a tagged U8 tensor in the shard
    }


def _encoded(shard_bytes: int = 64 << 10):
    return encode_keyframe(_state(), model="m", version=4, shard_bytes=shard_bytes)


def _writer(tmp_path, enc) -> tuple[FileTarget, KeyframeWriter]:
    layout = {t.name: (t.dtype, tuple(t.shape)) for t in enc.manifest.tensors}
    target = FileTarget(tmp_path / "f.safetensors", "m", layout=layout, open_existing=False)
    return target, KeyframeWriter(target, enc.manifest)


def _same_file(target: FileTarget, state: dict[str, torch.Tensor]) -> None:
    got = target.tensors()
    for n, t in state.items():
        if t.numel():
            assert torch.equal(got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
    assert target.scan() == {n: tensor_fingerprint(t) for n, t in state.items()}


async def _receive_all(client: HttpClient, w: KeyframeWriter, enc, *, with_digest: bool = True) -> None:
    for ref in enc.manifest.blobs:
        sink = w.shard_sink(ref.size)
        await client.receive_blob(ref.id, ref.size, sink, digest=ref.digest if with_digest else None)
        w.add_received(sink)


# -- a real origin ----------------------------------------------------------------------------------

@PATHS
async def test_shards_land_in_the_new_file_from_a_real_origin(tmp_path, direct):
    enc = _encoded()
    m = enc.manifest.with_digests(enc.blobs)
    assert len(m.blobs) > 1 and all(r.digest for r in m.blobs)
    enc_d = type(enc)(manifest=m, blobs=enc.blobs, fps=enc.fps)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (url, _):
        async with HttpClient(url, token=TOKEN, timeouts=FAST, direct_receive=direct) as c:
            for bid, data in enc.blobs.items():
                await c.put_blob(bid, data)
            target, w = _writer(tmp_path, enc_d)
            await _receive_all(c, w, enc_d)
            w.commit()
            assert c.stats.bytes_in == sum(len(b) for b in enc.blobs.values())
    assert target.version == 4
    _same_file(target, _state())
    target.close()


# -- sources that misbehave -------------------------------------------------------------------------

class Source:
    """A blob server on a thread: ``faults`` is the list of what each successive GET does (then "ok")."""

    def __init__(self, blobs: dict[str, bytes], faults: list[str]) -> None:
        self.blobs, self.faults = blobs, list(faults)
        self.requests: list[str] = []
        self._stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            lines = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
            path = lines[0].split()[1]
            rng = next((ln.split("=", 1)[1] for ln in lines[1:] if ln.lower().startswith("range:")), None)
            fault = self.faults.pop(0) if self.faults else "ok"
            self.requests.append(f"{fault} {rng or ''}".strip())
            data = self.blobs.get(path.rsplit("/", 1)[-1])
            if data is None:
                body = b'{"error": {"code": "not_found", "message": "no such blob"}}'
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"\r\n%s" % (len(body), body))
                return
            start = int(rng.rstrip("-")) if rng and fault != "norange" else 0
            body = data[start:]
            if fault == "flip":
                body = bytearray(body)
                body[len(body) // 2] ^= 0x10
            status = b"206 Partial Content" if start else b"200 OK"
            extra = b"Content-Range: bytes %d-%d/%d\r\n" % (start, len(data) - 1, len(data)) if start else b""
            length = len(body) + (7 if fault == "long" else 0)
            conn.sendall(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s\r\n" % (status, length, extra))
            if fault == "cut":
                conn.sendall(body[: len(body) // 2])
                return
            if fault == "stall":
                conn.sendall(body[:1000])
                self._stop.wait(10)
                return
            conn.sendall(body)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


@pytest.fixture
def enc():
    return _encoded(shard_bytes=1 << 20)  # one shard: every fault hits the one blob


@PATHS
@pytest.mark.parametrize("faults", [["cut"], ["cut", "cut"], ["cut", "norange"]], ids=["cut", "cut-twice", "no-range"])
async def test_a_cut_body_is_resumed_with_range(tmp_path, enc, direct, faults):
    src = Source(enc.blobs, faults)
    try:
        async with HttpClient(src.url, timeouts=FAST, direct_receive=direct) as c:
            target, w = _writer(tmp_path, enc)
            await _receive_all(c, w, enc)
            w.commit()
            assert c.stats.resumes == faults.count("cut")
            assert (c._session is None) == direct, "the direct path opened aiohttp (or the other did not)"
        assert src.requests[0] == faults[0]
        assert all(r.endswith("-") for r in src.requests[1:]), src.requests  # every later GET asked a Range
        _same_file(target, _state())
        target.close()
    finally:
        src.close()


@PATHS
async def test_a_corrupt_copy_fails_over_and_a_lone_corrupt_source_leaves_no_file(tmp_path, enc, direct):
    bad = Source(enc.blobs, ["flip"] * 10)
    good = Source(enc.blobs, [])
    try:
        async with HttpClient([bad.url, good.url], timeouts=FAST, direct_receive=direct) as c:
            target, w = _writer(tmp_path, enc)
            await _receive_all(c, w, enc, with_digest=False)  # the xxh3 id alone catches it
            w.commit()
            assert c.stats.corrupt_blobs == 1
        _same_file(target, _state())
        target.close()
        (tmp_path / "f.safetensors").unlink()
        async with HttpClient(bad.url, timeouts=FAST, direct_receive=direct) as c:
            target, w = _writer(tmp_path, enc)
            with pytest.raises(UpstreamError, match="hashes to"):  # every source failed: that one
                await _receive_all(c, w, enc)
            w.abort()
        assert sorted(p.name for p in tmp_path.iterdir()) == [], "a half-written keyframe was left behind"
    finally:
        bad.close()
        good.close()


@PATHS
async def test_a_length_other_than_the_manifests_is_refused_before_a_byte_lands(tmp_path, enc, direct):
    src = Source(enc.blobs, ["long"] * 10)
    try:
        async with HttpClient(src.url, timeouts=FAST, direct_receive=direct) as c:
            target, w = _writer(tmp_path, enc)
            ref = enc.manifest.blobs[0]
            sink = w.shard_sink(ref.size)
            landed = []
            real = sink.received
            sink.received = lambda off, n: (landed.append(n), real(off, n))
            with pytest.raises(UpstreamError, match=f"manifest says {ref.size}"):
                await c.receive_blob(ref.id, ref.size, sink)
            assert landed == []
            w.abort()
    finally:
        src.close()


@PATHS
async def test_a_source_gone_silent_mid_body_times_out(tmp_path, enc, direct):
    src = Source(enc.blobs, ["stall"] * 10)
    try:
        async with HttpClient(src.url, timeouts=FAST, direct_receive=direct) as c:
            target, w = _writer(tmp_path, enc)
            ref = enc.manifest.blobs[0]
            t0 = time.monotonic()
            with pytest.raises(UpstreamError):  # UpstreamTimeout, or the same after the resumes
                await c.receive_blob(ref.id, ref.size, w.shard_sink(ref.size))
            assert time.monotonic() - t0 < 3 * 2 * FAST.read + 3  # three attempts, each ~read of silence
            w.abort()
    finally:
        src.close()


def test_a_shard_whose_header_names_other_tensors_is_a_format_error(tmp_path, enc):
    from deltasync.errors import FormatError

    other = encode_keyframe({"zz": torch.ones(3)}, model="m", version=4)
    target, w = _writer(tmp_path, enc)
    ref = other.manifest.blobs[0]
    sink = w.shard_sink(ref.size)
    data = memoryview(other.blobs[ref.id])
    with pytest.raises(FormatError, match="zz"):
        at = 0
        while at < len(data):
            room = sink.buffer(at)
            k = min(len(room), len(data) - at, 100)
            room[:k] = data[at:at + k]
            sink.received(at, k)
            at += k
    w.abort()


async def test_chunked_mangled_bodies_fail_over_instead_of_hanging(tmp_path):
    """aiohttp 3.14.5: a chunk-size line that is not hex leaves a waiting reader waiting (its read timer
    dropped) and a later read raises RuntimeError; the client's own bound makes it the source's fault."""
    body = b'{"model": "m", "version": 3}'

    def serve(lst: socket.socket, mangled: bool) -> None:
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            if mangled:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                conn.sendall(b"%x\r\n%s\r\nzz\r\n%s\r\n" % (len(body), body, body))
                time.sleep(15)
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
            conn.close()

    lsts = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    for lst, mangled in zip(lsts, (True, False)):
        threading.Thread(target=serve, args=(lst, mangled), daemon=True).start()
    bad, good = (f"http://127.0.0.1:{lst.getsockname()[1]}" for lst in lsts)
    try:
        t = Timeouts(connect=2.0, read=1.0, request=60.0, ttfb=2.0, cooldown=0.2, hedge_after=None)
        async with HttpClient([bad, good], timeouts=t) as c:
            t0 = time.monotonic()
            assert await c.get_manifest("m", 3) == body
            assert time.monotonic() - t0 < 5 and c.stats.failovers == 1
        async with HttpClient(bad, timeouts=t) as c:
            t0 = time.monotonic()
            with pytest.raises(UpstreamError):
                await c.get_manifest("m", 3)
            assert time.monotonic() - t0 < 5
    finally:
        for lst in lsts:
            lst.close()
        await asyncio.sleep(0)


def test_shards_received_side_by_side_in_odd_pieces_share_one_buffer(tmp_path):
    """Every shard sink of a keyframe receives through the writer's one buffer: pieces of the shards taken in
    turn, each an odd number of bytes (lanes cut between receives, their bytes carried while the other shards
    use the buffer), land exactly and fingerprint right."""
    enc = _encoded(shard_bytes=16 << 10)
    assert len(enc.manifest.blobs) >= 2  # a.weight alone (420 kB), the small tensors together
    target, w = _writer(tmp_path, enc)
    sinks = [(w.shard_sink(ref.size), enc.blobs[ref.id]) for ref in enc.manifest.blobs]
    at = [0] * len(sinks)
    sizes = [1, 3, 4097, 7, 65535, 2, 333]
    turn = 0
    while any(a < len(data) for a, (_, data) in zip(at, sinks)):
        for i, (sink, data) in enumerate(sinks):
            if at[i] >= len(data):
                continue
            room = sink.buffer(at[i])
            n = min(len(room), sizes[turn % len(sizes)], len(data) - at[i])
            turn += 1
            room[:n] = data[at[i] : at[i] + n]
            sink.received(at[i], n)
            at[i] += n
    for sink, _ in sinks:
        w.add_received(sink)
    w.commit()
    _same_file(target, _state())
    target.close()


def test_a_shard_of_many_small_tensors_lands_in_few_receives(tmp_path):
    """Tensors that lie back to back in the shard and in the file are received as one run (a 70k-tensor keyframe
    was 70k receives, writes and hash updates): 2,000 small tensors of mixed lane widths and odd byte lengths
    take a handful of receives, land exactly and fingerprint right; a flipped byte is caught."""
    g = torch.Generator().manual_seed(5)
    kinds = [torch.bfloat16, torch.int8, torch.float32]  # one dtype a width: shard and file order them alike
    state = {f"layers.{i:04d}.w": torch.randn(1 + i % 37, generator=g).to(kinds[i % len(kinds)])
             for i in range(2000)}
    enc = encode_keyframe(state, model="m", version=4, shard_bytes=1 << 30)
    assert len(enc.manifest.blobs) == 1
    for flip in (None, -1000):  # a byte of the data (the header alone is ~150 kB)
        (tmp_path / str(flip)).mkdir()
        target, w = _writer(tmp_path / str(flip), enc)
        data = bytearray(enc.blobs[enc.manifest.blobs[0].id])
        if flip is not None:
            data[flip] ^= 1
        sink = w.shard_sink(len(data))
        at = receives = 0
        while at < len(data):
            room = sink.buffer(at)
            n = min(len(room), len(data) - at)
            room[:n] = data[at : at + n]
            sink.received(at, n)
            at += n
            receives += 1
        assert receives < 20, receives
        if flip is None:
            w.add_received(sink)
            w.commit()
            _same_file(target, state)
        else:
            with pytest.raises(IntegrityError, match="fingerprint"):
                w.add_received(sink)
            w.abort()
        target.close()


@pytest.mark.parametrize("kind,room", [("auto", 0), ("auto", 2), ("reference", 0)])
def test_run_lane_sums_is_the_tensor_fingerprint(kind, room):
    """fingerprint.run_lane_sums (one compiled call a receive; the reference loop without the kernels) over runs of
    tensors of both lane widths at odd starts, fed in odd receives with cut lanes carried: each tensor's sum
    is its fingerprint's."""
    import numpy as np

    from deltasync import kernels
    from deltasync.fingerprint import run_lane_sums
    from deltasync.kernels.fpkeys import C0, MASK64

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-128, 127, (n,), generator=g, dtype=torch.int8) if n % 3 == 0 else
               torch.randn(n, generator=g).bfloat16() for n in (3, 5, 1, 6, 7, 9, 2, 12, 11, 4)]
    raw = b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors)
    lbs = np.array([1 if t.dtype == torch.int8 else 2 for t in tensors] + [1], np.int64)
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = np.cumsum([0] + sizes)[:-1].astype(np.int64)
    starts = np.append(starts, len(raw))
    stops = np.append(starts[:-1] + np.array(sizes), len(raw) + 1).astype(np.int64)
    kernels.select(kind)
    try:
        for step in (1, 3, 7, 64):
            done, sums = np.zeros(len(lbs), np.int64), np.zeros(len(lbs), np.uint64)
            buf = np.zeros(len(raw) + 8, np.uint8)
            scratch = np.empty(room or len(raw), np.uint16)  # 2: an odd tensor copied 2 lanes at a time
            at = j = carry = 0
            carried = b""
            while at < len(raw):
                n = min(step, len(raw) - at)
                buf[:carry] = np.frombuffer(carried, np.uint8)
                buf[carry : carry + n] = np.frombuffer(raw[at : at + n], np.uint8)
                base, end = at - carry, at + n
                j = run_lane_sums(buf, base, end, starts, stops, lbs, done, sums, j, scratch)
                carry = end - int(starts[j] + done[j] * lbs[j])
                carried = buf[end - carry - base : end - base].tobytes()
                at = end
            for t, s, d, lb in zip(tensors, sums, done, lbs):
                assert int(d) == t.numel() * t.element_size() // lb
                assert (int(s) + int(d) * C0) & MASK64 == tensor_fingerprint(t), (step, t.dtype, t.numel())
    finally:
        kernels.select("auto")


def test_a_file_scan_is_every_tensor_fingerprint(tmp_path):
    """filetarget.scan_file (one compiled pass over the file's data) gives each tensor's fingerprint, on a file
    laid out by build_header and on a foreign one with a bf16 tensor at an odd byte (fingerprinted one by one)."""
    import json
    import struct

    import numpy as np
    from safetensors.torch import save

    from deltasync.client.filetarget import scan_file
    from deltasync.tensorfile import MappedTensorFile

    g = torch.Generator().manual_seed(9)
    state = {f"t{i:03d}": torch.randn(1 + i % 11, generator=g).to((torch.bfloat16, torch.float32, torch.int8)[i % 3])
             for i in range(300)}
    state["empty"] = torch.zeros(0, dtype=torch.bfloat16)
    (tmp_path / "a.safetensors").write_bytes(save(state))
    odd = torch.randint(-5, 5, (3,), dtype=torch.int8)
    bf = torch.randn(5, generator=g).bfloat16()
    body = json.dumps({"i": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
                       "b": {"dtype": "BF16", "shape": [5], "data_offsets": [3, 13]}}).encode()
    raw = struct.pack("<Q", len(body)) + body + odd.numpy().tobytes() + bf.view(torch.int16).numpy().tobytes()
    (tmp_path / "odd.safetensors").write_bytes(raw)
    for name, want in (("a", state), ("odd", {"i": odd, "b": bf})):
        with MappedTensorFile(tmp_path / f"{name}.safetensors") as f:
            got = scan_file(f)
            assert got == {n: tensor_fingerprint(t) for n, t in want.items()}, name
            assert got == {n: tensor_fingerprint(t) for n, t in f.tensors.items()}
