"""The aiohttp application of a deltasync server (origin or relay) and how it starts and stops.

Run it with ``connections.GuardedRunner`` (server/cli.py does): the connection limits,
idle timeout and JSON bad-request errors live there; the app's own middlewares mark
busy connections and turn errors into the protocol's JSON."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web

from deltasync.errors import AuthError

from .config import ServerConfig
from .http.connections import busy_middleware
from .routes import SERVICES, add_routes, error_middleware
from .services import close_services, open_services
from .http.tokens import bearer

log = logging.getLogger("deltasync.server")

CONFIG = web.AppKey("config", ServerConfig)


def build_app(config: ServerConfig) -> web.Application:
    """The app; its services (store, parents, prefetch) open on startup and close on cleanup."""
    middlewares = [busy_middleware, error_middleware]
    table = config.token_table
    if table is not None and table.require_read:
        middlewares.append(_read_auth_middleware(table))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_manifest_size)
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


#: paths anyone may read even when reads need a token (liveness, metrics scrapers)
OPEN_PATHS = frozenset(("/healthz", "/metrics"))


def _read_auth_middleware(table):
    """Reads (GET/HEAD) need a read (or publish) token for their model; writes are checked by their routes.
    The token is never logged: the error names only the model."""

    @web.middleware
    async def read_auth(request: web.Request, handler):
        if request.method in ("GET", "HEAD") and request.path not in OPEN_PATHS:
            model = request.match_info.get("model")
            if not table.allows(bearer(request.headers.get("Authorization")), "read", model):
                raise AuthError("reads need 'Authorization: Bearer <read token>'" +
                                (f" valid for model {model!r}" if model else "") + " (--read-token-file)")
        return await handler(request)

    return read_auth
