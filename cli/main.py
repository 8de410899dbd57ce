"""``deltasync``: the command line. Wires the core, the servers and the client together."""

from __future__ import annotations

import argparse
import importlib
import sys

from deltasync import __version__
from . import keys, offline
from .run import run_command

# Subcommand groups owned by the server and client packages; each module has register(subparsers).
_PLUGINS = ("deltasync.server.cli", "deltasync.client.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltasync", description="Sparse, verified, per-step weight deltas for RL inference fleets.")
    parser.add_argument("--version", action="version", version=f"deltasync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    offline.register(sub)
    keys.register(sub)
    for name in _PLUGINS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        register = getattr(mod, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
