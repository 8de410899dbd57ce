"""Scoped bearer tokens: who may publish, who may read, per model (docs/PROTOCOL.md "Tokens").

A token file is either one bare token (the old form: it may publish and read every
model) or lines ``SCOPE MODEL TOKEN``: ``SCOPE`` is ``publish`` (publish and read) or
``read``; ``MODEL`` is a model name or a glob (``policy*``, ``*``); ``#`` starts a
comment. A grant for ``M`` covers its side keyframe stream ``M.kf``. When the file holds any ``read`` line, reads need a token too; otherwise
reads are open. Blob ids are content addresses shared by every model, so a blob GET
accepts any read token and a blob PUT any publish token; a manifest PUT needs a
publish token for its model. Tokens are compared in constant time and never appear in
a message, a repr or a log line. Pure: parsing and checking only.
"""

from __future__ import annotations

import fnmatch
import hmac
from dataclasses import dataclass, field

from deltasync.errors import FormatError
from deltasync.manifest import main_stream

__all__ = ["SCOPES", "TokenGrant", "TokenTable", "bearer"]

SCOPES = ("publish", "read")
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenGrant:
    scope: str  # "publish" | "read"
    model: str  # a model name or an fnmatch glob
    token: bytes = field(repr=False)

    def covers(self, scope: str, model: str | None) -> bool:
        if scope == "publish" and self.scope != "publish":
            return False
        if model is None:
            return True
        base = main_stream(model)  # a model's side keyframe stream M.kf goes with M
        return fnmatch.fnmatchcase(model, self.model) or fnmatch.fnmatchcase(base, self.model)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenTable:
    grants: tuple[TokenGrant, ...]
    require_read: bool = False  # reads need a token (the file has read lines)

    @classmethod
    def single(cls, token: str) -> TokenTable:
        """The old one-token form: publish (and read) every model; reads stay open."""
        return cls(grants=(TokenGrant(scope="publish", model="*", token=token.strip().encode()),))

    @classmethod
    def parse(cls, text: str, *, where: str = "token file") -> TokenTable:
        lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        lines = [ln for ln in lines if ln]
        if not lines:
            raise FormatError(f"{where} is empty; put one token in it, or lines 'publish|read MODEL TOKEN'")
        if len(lines) == 1 and len(lines[0].split()) == 1:
            return cls.single(lines[0])
        grants = []
        for n, ln in enumerate(lines, 1):
            parts = ln.split()
            if len(parts) != 3 or parts[0] not in SCOPES:
                # never echo the line: it holds a secret
                raise FormatError(f"{where}: entry {n} must be 'publish|read MODEL TOKEN' (3 fields), "
                                  f"found {len(parts)} field(s)")
            scope, model, token = parts
            if len(token) < MIN_TOKEN_CHARS:
                raise FormatError(f"{where}: entry {n}: a token needs at least {MIN_TOKEN_CHARS} characters")
            grants.append(TokenGrant(scope=scope, model=model, token=token.encode()))
        return cls(grants=tuple(grants), require_read=any(g.scope == "read" for g in grants))

    def allows(self, token: str | None, scope: str, model: str | None = None) -> bool:
        """Whether ``token`` may do ``scope`` on ``model`` (None: a request not tied to one model)."""
        if token is None:
            return False
        given = token.strip().encode()
        ok = False
        for g in self.grants:  # every grant is compared, whatever matched before (constant time)
            same = hmac.compare_digest(given, g.token)
            ok |= same and g.covers(scope, model)
        return ok

    def read_open(self) -> bool:
        return not self.require_read


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (None when absent or another scheme)."""
    scheme, _, token = (header or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
