"""A relay keeps following its parent after the parent's event stream is mangled or cut mid-event.

Real processes on 127.0.0.1: an origin and a relay (``python -m deltasync.server.cli``), and between
them a small proxy on threads of this test that answers the relay's first event-stream requests itself
(a heartbeat, then the fault) and forwards everything else, and every later event-stream request, to
the origin faithfully. The relay's heartbeat is 1 s, so a live parent is silent at most 3 s.

``mangled-size-line`` is what the fault campaign's bit flips did (bit-flips-in-transit, RELIABILITY.md):
a chunk-size line that is not hex. aiohttp's parser then closes the connection and drops its read
timer without waking the body's reader, and before the fix the relay's follow loop waited on
``readany()`` forever: its metrics said it followed the parent, it held no connection, logged nothing,
and never announced another version.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from server_fixtures import keyframe, make_blob, origin, publish, relay, session, start_all, stop_all, wait_head

MODEL = "follow"
HEADERS = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
BEAT = b": keepalive\n\n"
FAULTS = {
    # a bit flipped in a chunk-size line: not hex any more; the parent keeps the socket open
    "mangled-size-line": (b"%x\r\n%s\r\nzz\r\n%s\r\n" % (len(BEAT), BEAT, BEAT), False),
    # an event cut off mid-way by a parent that goes away
    "cut-mid-event": (b"%x\r\n%s\r\n" % (len(BEAT) + 30, BEAT + b'event: version\ndata: {"model":"'), True),
}


class EventsFault:
    """Answers the first ``count`` GET /v1/events itself (heartbeat, fault); proxies the rest to ``target``."""

    def __init__(self, target_port: int, fault: str, count: int) -> None:
        self.target_port, self.fault, self.left = target_port, fault, count
        self.served = 0
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._socks.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(65536)
            if not data:
                conn.close()
                return
            head += data
        with self._lock:
            fake = head.startswith(b"GET /v1/events") and self.left > 0
            if fake:
                self.left -= 1
                self.served += 1
        if fake:
            body, close = FAULTS[self.fault]
            conn.sendall(HEADERS)
            time.sleep(0.3)
            conn.sendall(body)
            if close:
                conn.close()
            else:
                self._closed.wait(120)  # holds the socket open, as a parent would
            return
        try:
            up = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:  # the origin is gone (the test is tearing down): the relay sees a refused parent
            conn.close()
            return
        self._socks.add(up)
        up.sendall(head)
        threading.Thread(target=self._pump, args=(conn, up), daemon=True).start()
        self._pump(up, conn)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        for s in list(self._socks):
            s.close()


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_relay_keeps_following_after_a_broken_event_stream(tmp_path, fault):
    o = origin(tmp_path)
    start_all(o)
    proxy = EventsFault(o.port, fault, count=2)
    r = relay(tmp_path, "relay", [proxy.url])
    try:
        start_all(r)
        async with session() as s:
            # the relay is on its first (faulty) stream, or its second
            deadline = time.monotonic() + 10
            while proxy.served < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proxy.served >= 1, "the relay never asked for the event stream"
            for v in (1, 2):
                blobs = [make_blob(64 << 10, v)]
                await publish(s, o.url, keyframe(MODEL, v, blobs), blobs)
                # silence is noticed after 3 heartbeats (3 s), then the relay reconnects
                await wait_head(s, r.url, MODEL, v, timeout=20)
        assert proxy.served == 2, f"the relay asked the faulty stream {proxy.served} time(s), expected 2"
    finally:
        proxy.close()
        stop_all(r, o)
