"""TLS contexts from files: ``--tls-cert/--tls-key`` (servers) and ``--ca-file`` (clients).

Servers serve https with a certificate chain and key (PEM). Clients (subscribe,
publish, sidecar, a relay's upstream) verify the server against ``--ca-file`` (PEM
bundle) or, without it, the system's trust store; hostnames are always checked and
TLS 1.2 is the floor. A missing or malformed file is a FormatError naming it. Imports
only the standard library and the core's error tree, so both the server and the
client entry points use it.
"""

from __future__ import annotations

import os
import ssl

from deltasync.errors import FormatError

__all__ = ["client_ssl_context", "server_ssl_context"]


def server_ssl_context(cert_file: str | os.PathLike, key_file: str | os.PathLike) -> ssl.SSLContext:
    """A server context from a PEM certificate chain and its private key."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(os.fspath(cert_file), os.fspath(key_file))
    except (OSError, ssl.SSLError) as e:
        raise FormatError(f"cannot load the TLS certificate {cert_file} with key {key_file}: {e}; "
                          "give a PEM certificate chain (--tls-cert) and its PEM private key (--tls-key)") from None
    return ctx


def client_ssl_context(ca_file: str | os.PathLike | None = None) -> ssl.SSLContext | None:
    """A client context trusting ``ca_file`` (PEM) only; None without a file (the system's trust store)."""
    if ca_file is None:
        return None
    try:
        # with a cafile, only that bundle is trusted (not the system store as well)
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=os.fspath(ca_file))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    except (OSError, ssl.SSLError) as e:
        raise FormatError(f"cannot load the CA file {ca_file}: {e}; give a PEM bundle of trusted CA certificates") from None
    return ctx
