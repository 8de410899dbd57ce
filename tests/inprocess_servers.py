"""Servers started inside the test process (aiohttp runners on 127.0.0.1 ephemeral ports), for tests
that need to look at a server's objects (its store, its metrics registry) as well as talk HTTP to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from deltasync.server.app import build_app
from deltasync.server.config import ServerConfig, Timeouts
from deltasync.server.routes import SERVICES
from deltasync.server.services import Services
from server_fixtures import KEY, TOKEN

FAST = Timeouts(read=5.0, heartbeat=1.0, parent_cooldown=1.0)


def origin_config(*, store_kind: str = "disk", store_dir: Path | None = None, **kw) -> ServerConfig:
    return ServerConfig(role="origin", host="127.0.0.1", port=0, store_kind=store_kind, store_dir=store_dir, token=TOKEN,
                        verifier=KEY, fsync=False, timeouts=FAST, **kw)


def relay_config(parents: list[str], *, store_kind: str = "disk", store_dir: Path | None = None,
                 hinted_fetch: bool = False, **kw) -> ServerConfig:
    """A relay's config; ``hinted_fetch`` off unless asked for (see server_fixtures.relay)."""
    return ServerConfig(role="relay", host="127.0.0.1", port=0, store_kind=store_kind, store_dir=store_dir,
                        parents=tuple(parents), verifier=KEY, fsync=False, timeouts=FAST, hinted_fetch=hinted_fetch, **kw)


@contextlib.asynccontextmanager
async def serving(config: ServerConfig) -> AsyncIterator[tuple[str, Services]]:
    """Run one server on a loopback port; yields its base URL and its services."""
    app = build_app(config)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}", app[SERVICES]
    finally:
        await runner.cleanup()
