"""Every error class of the one tree round-trips over HTTP: the server's route layer answers it, the client
turns the answer back into the same class (real aiohttp server on a loopback port, real HttpClient)."""

from __future__ import annotations

import inspect
import json

import pytest
from aiohttp import web

import deltasync.errors as errors_module
from deltasync.client.http import HttpClient
from deltasync.errors import (
    AuthError,
    DeltaSyncError,
    FormatError,
    MissingBlobsError,
    NotFoundError,
    RangeError,
    UpstreamError,
    UpstreamTimeout,
    error_class,
    error_classes,
    from_wire,
    to_wire,
)
from deltasync.server.routes import error_middleware

MISSING = ["ab" * 16, "cd" * 16]


def _tree() -> list[type[DeltaSyncError]]:
    """Every exception class defined in deltasync/errors.py."""
    return [c for _, c in inspect.getmembers(errors_module, inspect.isclass)
            if issubclass(c, DeltaSyncError) and c.__module__ == errors_module.__name__]


def _make(cls: type[DeltaSyncError]) -> DeltaSyncError:
    message = f"a {cls.__name__} on purpose"
    if cls is MissingBlobsError:
        return cls(message, missing=MISSING)
    if cls is RangeError:
        return cls(message, size=1234)
    return cls(message)


def test_every_class_has_its_own_code_and_a_status():
    tree = _tree()
    assert len(tree) >= 20
    assert set(error_classes()) == set(tree)  # no class without a code, no code outside the tree
    codes = [c.code for c in tree]
    assert len(codes) == len(set(codes))
    for cls in tree:
        assert "code" in cls.__dict__ or cls is DeltaSyncError, cls
        assert error_class(cls.code) is cls and 400 <= cls.http_status <= 599


def test_one_class_each_for_auth_502_and_504():
    from deltasync.client import errors as client_errors
    from deltasync.server import errors as server_errors
    assert client_errors.AuthError is server_errors.UnauthorizedError is AuthError
    assert client_errors.TransportError is server_errors.UpstreamError is UpstreamError
    assert client_errors.SyncTimeout is server_errors.UpstreamTimeout is UpstreamTimeout
    for module in (client_errors, server_errors):  # thin re-exports: nothing defined there
        assert not [n for n, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]


def test_a_subclass_defined_elsewhere_travels_as_its_parent():
    class Elsewhere(UpstreamError):
        pass

    wire = to_wire(Elsewhere("x"))
    assert (wire.status, wire.code) == (502, "upstream")
    assert type(from_wire(wire.status, wire.body(), wire.headers)) is UpstreamError


def test_a_code_cannot_be_defined_twice():
    with pytest.raises(TypeError, match="already"):
        type("Again", (DeltaSyncError,), {"code": "not_found"})


@pytest.mark.parametrize("status, body, headers, cls", [
    (503, "overloaded", {}, UpstreamError),
    (502, "", {}, UpstreamError),
    (429, "slow down", {}, UpstreamError),
    (504, "<html>gateway timeout</html>", {}, UpstreamTimeout),
    (401, "", {}, AuthError),
    (403, "forbidden by the proxy", {}, AuthError),
    (404, "nothing here", {}, NotFoundError),
    (400, "bad", {}, FormatError),
    (418, json.dumps({"error": {"code": "no_such_code", "message": "m"}}), {}, FormatError),
])
def test_answers_without_a_known_code_are_judged_by_status(status, body, headers, cls):
    err = from_wire(status, body, headers, where="http://x/y")
    assert type(err) is cls and str(err).startswith("http://x/y: ") and err.status == status


@pytest.fixture
async def raising_server():
    """An aiohttp app with the servers' own error middleware; PUT /v1/models/{code}/versions/1 raises that class."""
    async def handler(request: web.Request) -> web.Response:
        raise _make(error_class(request.match_info["model"]))

    app = web.Application(middlewares=[error_middleware])
    app.router.add_put("/v1/models/{model}/versions/{version}", handler)
    app.router.add_get("/v1/models/{model}/versions/{version}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.mark.parametrize("cls", _tree(), ids=lambda c: c.__name__)
async def test_every_class_round_trips_through_server_and_client(raising_server, cls):
    sent = _make(cls)
    async with HttpClient(raising_server, write_retries=1) as client:
        with pytest.raises(DeltaSyncError) as got:
            await client.put_manifest(cls.code, 1, b"{}")
        err = got.value
        assert type(err) is cls, f"{cls.__name__} came back as {type(err).__name__}: {err}"
        assert str(sent) in str(err) and err.status == cls.http_status
        if cls is MissingBlobsError:
            assert err.missing == MISSING
        if cls is RangeError:
            assert err.size == 1234
        if cls.http_status < 500 and not issubclass(cls, AuthError):  # reads: an answer, raised as it is
            with pytest.raises(cls):
                await client.get_manifest(cls.code, 1)


@pytest.mark.parametrize("cls", _tree(), ids=lambda c: c.__name__)
async def test_the_answer_carries_the_class_status_code_and_headers(raising_server, cls):
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{raising_server}/v1/models/{cls.code}/versions/1") as r:
            body = json.loads(await r.read())
            assert r.status == cls.http_status == body["error"]["status"]
            assert body["error"]["code"] == cls.code
            for name, value in _make(cls).wire_headers().items():
                assert r.headers[name] == value
    if cls is RangeError:
        assert r.headers["Content-Range"] == "bytes */1234"
    if cls is MissingBlobsError:
        assert body["error"]["missing"] == MISSING
