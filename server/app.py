"""The aiohttp application of a deltasync server (origin or relay) and how it starts and stops.

Run it with ``connections.GuardedRunner`` (server/cli.py does): the connection limits,
idle timeout and JSON bad-request errors live there; the app's own middlewares mark
busy connections and turn errors into the protocol's JSON."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web

from .config import ServerConfig
from .connections import busy_middleware
from .routes import SERVICES, add_routes, error_middleware
from .services import close_services, open_services

log = logging.getLogger("deltasync.server")

CONFIG = web.AppKey("config", ServerConfig)


def build_app(config: ServerConfig) -> web.Application:
    """The app; its services (store, parents, prefetch) open on startup and close on cleanup."""
    app = web.Application(middlewares=[busy_middleware, error_middleware], client_max_size=config.max_manifest_size)
    app[CONFIG] = config
    app.cleanup_ctx.append(_services_ctx)
    app.on_shutdown.append(_end_streams)
    add_routes(app)
    return app


async def _services_ctx(app: web.Application) -> AsyncIterator[None]:
    svc = await open_services(app[CONFIG])
    app[SERVICES] = svc
    yield
    await close_services(svc)


async def _end_streams(app: web.Application) -> None:
    """On shutdown, end event streams and long-polls at once so they do not hold it up."""
    if SERVICES in app:
        app[SERVICES].hub.close()
