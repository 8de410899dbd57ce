"""Test launcher: the client CLI's ``subscribe``, SIGKILLed right after it applies a version.

``python tests/kill_after_apply.py V subscribe ARGS...`` runs ``deltasync subscribe ARGS...``
through its ``on_applied`` hook and kills itself once a version >= V is applied in memory,
before the file is replaced: the crash the end-to-end tests recover from. Fault injection
lives here, not in the library (no environment variable is read for it).
"""

from __future__ import annotations

import os
import signal
import sys

from deltasync.client import cli


def main(argv: list[str]) -> int:
    kill_at = int(argv[0])

    def die_after(version: int) -> None:
        if version >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    args = cli.build_parser().parse_args(argv[1:])
    if args.command != "subscribe":
        raise SystemExit(f"kill_after_apply: only 'subscribe' has the hook, not {args.command!r}")
    return cli.cmd_subscribe(args, on_applied=die_after)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
