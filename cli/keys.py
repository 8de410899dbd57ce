"""``deltasync keygen``: writes an Ed25519 key pair (:func:`deltasync.keyfiles.write_keypair`). Turning key files
into a Signer or a Verifier is :mod:`deltasync.keyfiles` (the core: servers, clients and engine extensions use it
without this command package)."""

from __future__ import annotations

import argparse
import sys

from deltasync.errors import FormatError
from deltasync.keyfiles import write_keypair

__all__ = ["register"]


def _keygen(args) -> int:
    try:
        priv, pub, kid = write_keypair(args.name, force=args.force)
    except (OSError, FormatError) as e:
        print(f"deltasync keygen: {e}", file=sys.stderr)
        return 2
    print(f"wrote {priv} (private: --signing-key, publisher only) and {pub} (public: --verify-key); key id {kid}")
    return 0


def register(subparsers) -> None:
    """Add ``keygen`` to an argparse subparsers object."""
    k = subparsers.add_parser("keygen", help="write an Ed25519 key pair (PEM) for signing versions",
                              description="Write NAME (Ed25519 private key, PEM, mode 0600: for --signing-key) and "
                                          "NAME.pub (public key: for --verify-key).")
    k.add_argument("name", metavar="NAME", help="path of the private key file; the public key goes to NAME.pub")
    k.add_argument("--force", action="store_true", help="overwrite existing files")
    k.set_defaults(func=_keygen)


def main(argv: list[str] | None = None) -> int:
    from .run import run_command
    parser = argparse.ArgumentParser(prog="deltasync")
    register(parser.add_subparsers(dest="command", required=True))
    return run_command(parser, argv)
