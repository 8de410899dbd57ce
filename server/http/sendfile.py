"""Zero-copy sending of file ranges to an aiohttp response, on uvloop as on asyncio.

aiohttp's ``FileResponse`` calls ``loop.sendfile``, which uvloop does not implement,
so on uvloop it falls back to reading chunks in a thread pool and copying them
through the transport. ``send_file_range`` instead calls ``os.sendfile`` on a
duplicate of the connection's socket descriptor (page cache to socket, no copy
into Python), waiting for writability with the loop's own poller. The duplicate
keeps the socket alive even if the transport closes it meanwhile, so a descriptor
number can never be reused under us. TLS transports (and anything without a plain
socket) take the copying fallback.

``send_blob_range`` is what routes call with any ``StoredBlob`` (blobstore.py): a
``FileBacked`` one goes out with ``os.sendfile`` from its descriptor, any other
(the memory store, a remote store) is streamed with ``read`` in 1 MiB pieces.

The caller must have sent the headers (``await resp.prepare(request)``) and must not
write anything else to the response while a range is being sent.
"""

from __future__ import annotations

import asyncio
import os
import time

from aiohttp import web

from ..storage.blobstore import StoredBlob
from ..compat import timeout as timeout_after

FALLBACK_CHUNK = 1 << 20


class SlowClientError(ConnectionError):
    """The peer accepted no bytes for the whole write timeout."""


async def send_blob_range(request: web.BaseRequest, resp: web.StreamResponse, reader: StoredBlob, offset: int,
                          count: int, *, timeout: float) -> int:
    """Send ``count`` bytes of ``reader`` from ``offset``; returns the bytes sent (always ``count``) or raises."""
    fileno = getattr(reader, "fileno", None)  # the FileBacked capability (getattr: this runs per piece)
    if fileno is not None:
        return await send_file_range(request, resp, fileno(), offset, count, timeout=timeout)
    sent = 0
    while sent < count:
        chunk = await reader.read(offset + sent, min(FALLBACK_CHUNK, count - sent))
        if not chunk:
            raise EOFError(f"blob ended at {offset + sent}, {count - sent} bytes short")
        await _write(resp, chunk, timeout)
        sent += len(chunk)
    return sent


async def send_file_range(request: web.BaseRequest, resp: web.StreamResponse, fd: int, offset: int, count: int,
                          *, timeout: float) -> int:
    """Send ``count`` bytes of ``fd`` from ``offset``; returns the bytes sent (always ``count``) or raises."""
    if count <= 0:
        return 0
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("client connection closed")
    sock = transport.get_extra_info("socket")
    if sock is None or transport.get_extra_info("sslcontext") is not None:
        return await _copy_range(resp, fd, offset, count, timeout=timeout)
    loop = asyncio.get_running_loop()
    await _flush(transport, timeout)
    out = os.dup(sock.fileno())
    sent = 0
    try:
        while sent < count:
            try:
                n = os.sendfile(out, fd, offset + sent, count - sent)
            except BlockingIOError:
                await _writable(loop, out, timeout)
                continue
            except (BrokenPipeError, ConnectionResetError) as e:
                raise ConnectionResetError(f"client went away: {e}") from None
            if n == 0:
                raise EOFError(f"file ended at {offset + sent}, {count - sent} bytes short")
            sent += n
    finally:
        os.close(out)
    return sent


async def _flush(transport: asyncio.Transport, timeout: float) -> None:
    """Wait until the transport has written out whatever it buffered (the headers)."""
    deadline = time.monotonic() + timeout
    while transport.get_write_buffer_size():
        if transport.is_closing():
            raise ConnectionResetError("client connection closed")
        if time.monotonic() > deadline:
            raise SlowClientError(f"client accepted no bytes for {timeout:.0f} s")
        await asyncio.sleep(0.001)


async def _writable(loop: asyncio.AbstractEventLoop, fd: int, timeout: float) -> None:
    fut = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, ready)
    try:
        async with timeout_after(timeout):
            await fut
    except asyncio.TimeoutError:
        raise SlowClientError(f"client accepted no bytes for {timeout:.0f} s") from None
    finally:
        loop.remove_writer(fd)


async def _copy_range(resp: web.StreamResponse, fd: int, offset: int, count: int, *, timeout: float) -> int:
    sent = 0
    while sent < count:
        chunk = os.pread(fd, min(FALLBACK_CHUNK, count - sent), offset + sent)
        if not chunk:
            raise EOFError(f"file ended at {offset + sent}, {count - sent} bytes short")
        await _write(resp, chunk, timeout)
        sent += len(chunk)
    return sent


async def _write(resp: web.StreamResponse, chunk: bytes, timeout: float) -> None:
    try:
        async with timeout_after(timeout):
            await resp.write(chunk)
    except asyncio.TimeoutError:
        raise SlowClientError(f"client accepted no bytes for {timeout:.0f} s") from None
