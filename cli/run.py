"""Running a parsed command: one place that turns errors into exit statuses.

Used by ``deltasync`` (cli/main.py) and by the standalone entry points
``python -m deltasync.server.cli`` and ``python -m deltasync.client.cli``, which
exist so a server starts without importing the client (and torch). Imports only the
core's error tree.
"""

from __future__ import annotations

import argparse
import sys

from deltasync.errors import DeltaSyncError


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the chosen subcommand; a DeltaSyncError or a missing/unreadable file
    is one line on stderr and exit status 1, an interrupt 130."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (DeltaSyncError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"deltasync {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
