"""Objects in an S3-compatible bucket, through ``obstore``: the network layer of the bucket store.

``Bucket`` is the only module that talks to a bucket. It owns the client (one
``obstore.store.S3Store``, or an ``HTTPStore`` for a bucket read over its plain
HTTPS URL), the timeouts of every request, and the translation of the client's
errors into deltasync's tree:

* a write the bucket refuses or cannot take (quota, a full volume behind MinIO,
  5xx, a dead endpoint, bad credentials) raises ``StorageError`` (507): the same
  error a full disk gives, and nothing partial becomes visible;
* a read that fails raises ``UnavailableError`` (503); a missing object is ``None``
  (or ``NotFoundError`` where the caller needs the object);
* a conditional create (``If-None-Match: *``) of an object that exists returns
  False; ``probe_conditional_create`` says whether the server honours it at all
  (``rclone serve s3`` does not: it overwrites).

Why obstore (measured; deploy/README.md "Buckets", benchmarks/bench_s3.py): against ``rclone serve s3`` on this
machine it put a 64 MiB object 2x faster than aiobotocore and put/got 16 KiB
objects 6-13x faster (Rust client, no per-request Python signing); it streams uploads
from an async iterator as a multipart upload, and an exception raised by that
iterator aborts the upload, so an object is visible only whole and only if we let
it complete.

Ranged reads: some servers (``rclone serve s3``) ignore ``Range`` and answer the
whole object. ``open_stream(key, offset)`` then reads from byte 0 and skips to
``offset``, so callers always get the bytes they asked for.
"""

from __future__ import annotations

import asyncio
import configparser
import logging
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import obstore
from obstore import exceptions as oe

from deltasync.errors import StorageError

from .bucketlayout import BucketLocation
from deltasync.errors import UnavailableError

log = logging.getLogger("deltasync.server.s3")

STREAM_CHUNK = 1 << 20
PART_SIZE = 8 << 20  # multipart part size (S3's minimum is 5 MiB)
UPLOAD_CONCURRENCY = 8


def aws_settings(environ: dict[str, str] | None = None, home: Path | None = None) -> dict[str, str]:
    """Credentials and region from the standard places, for what obstore does not read itself.

    obstore reads the ``AWS_*`` environment variables (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
    ``AWS_ENDPOINT_URL``, container and web-identity credentials). The shared files
    (``~/.aws/credentials`` and ``~/.aws/config``, or ``AWS_SHARED_CREDENTIALS_FILE`` /
    ``AWS_CONFIG_FILE``, profile ``AWS_PROFILE`` or ``default``) are read here and used
    only for what the environment does not set.
    """
    env = dict(os.environ if environ is None else environ)
    home = Path.home() if home is None else home
    profile = env.get("AWS_PROFILE") or "default"
    out: dict[str, str] = {}
    creds = configparser.ConfigParser()
    creds.read(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials")
    conf = configparser.ConfigParser()
    conf.read(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config")
    section = creds[profile] if creds.has_section(profile) else {}
    csection = conf[f"profile {profile}"] if conf.has_section(f"profile {profile}") else (
        conf[profile] if conf.has_section(profile) else {})
    if "AWS_ACCESS_KEY_ID" not in env and "aws_access_key_id" in section:
        out["access_key_id"] = section["aws_access_key_id"]
        out["secret_access_key"] = section.get("aws_secret_access_key", "")
        if "aws_session_token" in section:
            out["session_token"] = section["aws_session_token"]
    if not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")):
        region = section.get("region") or csection.get("region")
        out["region"] = region or "us-east-1"
    if "AWS_ENDPOINT_URL" not in env and csection.get("endpoint_url"):
        out["endpoint"] = csection["endpoint_url"]
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectInfo:
    key: str  # relative to the store's prefix
    size: int
    modified: datetime
    etag: str | None


class Bucket:
    """Async object operations on one bucket prefix. Keys are relative to the prefix."""

    def __init__(self, location: BucketLocation, *, connect_timeout: float = 5.0, read_timeout: float = 30.0,
                 request_timeout: float = 300.0, environ: dict[str, str] | None = None) -> None:
        from obstore.store import HTTPStore, S3Store

        self.location = location
        self.read_only = location.url is not None
        options = {"connect_timeout": timedelta(seconds=connect_timeout),
                   "read_timeout": timedelta(seconds=read_timeout),
                   "timeout": timedelta(seconds=request_timeout),
                   "user_agent": "deltasync/0.1"}
        retry = {"max_retries": 3, "retry_timeout": timedelta(seconds=max(read_timeout, 10.0)),
                 "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2),
                             "base": 2}}
        if location.url is not None:
            options["allow_http"] = location.url.startswith("http://")
            self._store = HTTPStore(location.url, client_options=options, retry_config=retry)
            return
        settings = aws_settings(environ)
        endpoint = location.endpoint or settings.pop("endpoint", None)
        settings.pop("endpoint", None)
        if endpoint:
            settings["endpoint"] = endpoint
            options["allow_http"] = endpoint.startswith("http://")
            # Non-AWS endpoints (MinIO, rclone, R2, GCS) address buckets by path.
            settings.setdefault("virtual_hosted_style_request", False)
        self._store = S3Store(location.bucket, prefix=location.prefix or None, config=settings,
                              client_options=options, retry_config=retry)

    @property
    def where(self) -> str:
        return self.location.display

    # -- writes ------------------------------------------------------------------------
    async def put(self, key: str, data: bytes, *, create: bool = False) -> bool:
        """Write a whole object. With ``create``, only if no object has the key (``If-None-Match: *``):
        returns False when one exists (on a server that honours it). StorageError on any failure."""
        self._check_writable(key)
        try:
            await obstore.put_async(self._store, key, data, mode="create" if create else "overwrite",
                                    use_multipart=False)
        except oe.AlreadyExistsError:
            return False
        except oe.PreconditionError:
            return False
        except Exception as e:
            raise self._write_error(key, e) from e
        return True

    async def put_if_match(self, key: str, data: bytes, etag: str | None) -> bool:
        """Replace an object only if it still has ``etag`` (``If-Match``); create it only if absent
        when ``etag`` is None. False when another writer got there first."""
        self._check_writable(key)
        mode = "create" if etag is None else {"e_tag": etag}
        try:
            await obstore.put_async(self._store, key, data, mode=mode, use_multipart=False)
        except (oe.AlreadyExistsError, oe.PreconditionError):
            return False
        except Exception as e:
            raise self._write_error(key, e) from e
        return True

    async def put_stream(self, key: str, chunks: AsyncIterator[bytes]) -> None:
        """Stream an object from ``chunks`` (multipart above ``PART_SIZE``). If ``chunks`` raises, the
        upload is aborted and nothing becomes visible; that exception propagates unchanged."""
        self._check_writable(key)
        failure: list[BaseException] = []

        async def guarded() -> AsyncIterator[bytes]:
            try:
                async for c in chunks:
                    yield c
            except BaseException as e:
                failure.append(e)
                raise

        try:
            await obstore.put_async(self._store, key, guarded(), chunk_size=PART_SIZE,
                                    max_concurrency=UPLOAD_CONCURRENCY)
        except Exception as e:
            if failure:
                raise failure[0] from None
            raise self._write_error(key, e) from e

    async def delete(self, key: str) -> None:
        self._check_writable(key)
        try:
            await obstore.delete_async(self._store, key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._write_error(key, e, verb="delete") from e

    # -- reads -------------------------------------------------------------------------
    async def get(self, key: str) -> bytes | None:
        """A whole object, or None if there is none."""
        try:
            r = await obstore.get_async(self._store, key)
            return bytes(await r.bytes_async())
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._read_error(key, e) from e

    async def get_with_etag(self, key: str, *, if_none_match: str | None = None
                            ) -> tuple[bytes | None, str | None, bool]:
        """(bytes, etag, changed): ``changed`` False (and no bytes) when the object still has
        ``if_none_match``; (None, None, True) when it does not exist."""
        opts = {"if_none_match": if_none_match} if if_none_match else None
        try:
            r = await obstore.get_async(self._store, key, options=opts)
            data = bytes(await r.bytes_async())
            return data, r.meta.get("e_tag"), True
        except oe.NotModifiedError:
            return None, if_none_match, False
        except FileNotFoundError:
            return None, None, True
        except Exception as e:
            if if_none_match and "304" in str(e):  # some clients surface 304 as a generic error
                return None, if_none_match, False
            raise self._read_error(key, e) from e

    async def head(self, key: str) -> int | None:
        """The size of an object, None if there is none."""
        try:
            meta = await obstore.head_async(self._store, key)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._read_error(key, e) from e
        return int(meta["size"])

    async def open_stream(self, key: str, offset: int = 0) -> tuple[int, AsyncIterator[bytes]] | None:
        """(object size, bytes from ``offset`` to the end), or None if there is no object.

        Asks for a range when ``offset`` > 0; a server that ignores ranges is read from byte 0
        with the first ``offset`` bytes skipped."""
        try:
            if offset:
                try:
                    r = await obstore.get_async(self._store, key, options={"range": {"offset": offset}})
                    skip = 0
                except oe.GenericError as e:
                    if "partial" not in str(e).lower():
                        raise
                    r = await obstore.get_async(self._store, key)
                    skip = offset
            else:
                r = await obstore.get_async(self._store, key)
                skip = 0
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._read_error(key, e) from e
        size = int(r.meta["size"])

        async def pieces() -> AsyncIterator[bytes]:
            left = skip
            try:
                async for chunk in r.stream(STREAM_CHUNK):
                    b = bytes(chunk)
                    if left:
                        if len(b) <= left:
                            left -= len(b)
                            continue
                        b = b[left:]
                        left = 0
                    yield b
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:
                raise self._read_error(key, e) from e
        return size, pieces()

    async def list(self, prefix: str, *, after: str | None = None) -> list[ObjectInfo]:
        """Every object under ``prefix`` (a key prefix ending in '/'), in key order, optionally only
        those after the key ``after``."""
        out: list[ObjectInfo] = []
        try:
            async for batch in obstore.list(self._store, prefix.rstrip("/") or None, offset=after,
                                            chunk_size=1000):
                for m in batch:
                    out.append(ObjectInfo(key=m["path"], size=int(m["size"]), modified=m["last_modified"],
                                          etag=m.get("e_tag")))
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._read_error(prefix, e, verb="list") from e
        out.sort(key=lambda o: o.key)
        return out

    # -- capabilities ------------------------------------------------------------------
    async def probe_conditional_create(self) -> bool:
        """Whether the server refuses a second ``If-None-Match: *`` create of one key (writes and
        deletes a probe object under ``.probe/``)."""
        key = f".probe/{secrets.token_hex(8)}"
        try:
            await self.put(key, b"1", create=True)
            second = await self.put(key, b"2", create=True)
        finally:
            try:
                await self.delete(key)
            except StorageError:
                pass
        return not second

    # -- errors ------------------------------------------------------------------------
    def _check_writable(self, key: str) -> None:
        if self.read_only:
            raise StorageError(f"{self.where} is a read-only plain-URL bucket; cannot write {key}")

    def _write_error(self, key: str, e: BaseException, *, verb: str = "write") -> StorageError:
        return StorageError(f"the bucket {self.where} did not take the {verb} of {key} ({_short(e)}); "
                            "nothing partial was kept: check the bucket's quota, credentials and endpoint")

    def _read_error(self, key: str, e: BaseException, *, verb: str = "read") -> UnavailableError:
        return UnavailableError(f"{verb} of {key} from the bucket {self.where} failed ({_short(e)}); "
                                "retry, or check the endpoint and credentials")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
