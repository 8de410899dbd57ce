"""``deltasync``: the command line. Wires the core, the servers and the client together.

Start-up is lazy: ``main(argv)`` imports only the module that registers the command it runs
(``deltasync publish ...`` never imports the servers, the offline tools or the budget code), and
that module imports what the command needs when it runs. ``build_parser()`` without a command (and
``deltasync --help``, or an unknown command) registers every group, so the help lists them all.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from deltasync import __version__
from .run import run_command

# Subcommand groups: module -> the commands its register(subparsers) adds (tests/test_cli_lazy* pins the table).
# The server and client groups are optional packages; a group whose module is absent is left out.
_GROUPS: dict[str, tuple[str, ...]] = {
    "deltasync.cli.offline": ("diff", "replay", "squash", "inspect", "verify", "compile-kernels"),
    "deltasync.cli.keys": ("keygen",),
    "deltasync.server.cli": ("origin", "relay"),
    "deltasync.client.cli": ("publish", "subscribe", "sidecar"),
}
_OPTIONAL = frozenset({"deltasync.server.cli", "deltasync.client.cli"})


def _group_of(command: str | None) -> str | None:
    return next((m for m, cmds in _GROUPS.items() if command in cmds), None)


def _command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word not an option (the top level has only options without values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command``, only that command's group is registered (imported)."""
    parser = argparse.ArgumentParser(prog="deltasync", description="Sparse, verified, per-step weight deltas for RL inference fleets.")
    parser.add_argument("--version", action="version", version=f"deltasync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    only = _group_of(command)
    for name in _GROUPS:
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name or name not in _OPTIONAL:
                raise
            continue
        register = getattr(mod, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_command(build_parser(_command_of(argv)), argv)


if __name__ == "__main__":
    sys.exit(main())
