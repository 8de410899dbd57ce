"""Baseline for the fan-out benchmark: a plain aiohttp app serving blob files with web.FileResponse."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True, help="a deltasync store's blobs/ directory")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--uvloop", action="store_true", help="run on uvloop (aiohttp then copies through a thread)")
    args = p.parse_args()

    async def blob(request: web.Request) -> web.StreamResponse:
        bid = request.match_info["id"]
        return web.FileResponse(args.root / bid[:2] / bid)

    app = web.Application()
    app.router.add_get("/v1/blobs/{id}", blob)
    loop = None
    if args.uvloop:
        import uvloop
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    web.run_app(app, host="127.0.0.1", port=args.port, loop=loop, access_log=None,
                print=lambda *_: print("ready", flush=True))


if __name__ == "__main__":
    main()
