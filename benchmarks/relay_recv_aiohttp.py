"""A bare aiohttp receive loop, the baseline for a relay's cold path (bench_relay): GET one blob with
aiohttp's client on uvloop, hash every piece (xxh3-128) and ``os.write`` it to a new file, as the relay
did before server/http/blobget.py. Prints the loop's own user and system CPU seconds (getrusage around
the transfer, start-up excluded).

``python relay_recv_aiohttp.py URL OUT``
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys

import aiohttp
import xxhash


async def main(url: str, out: str) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    h = xxhash.xxh3_128()
    async with aiohttp.ClientSession(read_bufsize=4 << 20, auto_decompress=False) as s:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        async with s.get(url) as resp:
            assert resp.status == 200, resp.status
            while True:
                chunk, _ = await resp.content.readchunk()
                if not chunk:
                    break
                h.update(chunk)
                os.write(fd, chunk)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    os.close(fd)
    os.unlink(out)
    print(r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, h.hexdigest())


if __name__ == "__main__":
    import uvloop
    uvloop.run(main(sys.argv[1], sys.argv[2]))
