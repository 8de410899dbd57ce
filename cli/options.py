"""Command-line options that ``publish``/``sidecar`` (client/cli.py) and ``diff`` (cli/offline.py) share."""

from __future__ import annotations

import argparse


def blob_format_option(p: argparse.ArgumentParser) -> None:
    """``--blob-format``: the blob format of base-free deltas (``EncodeOptions.format``)."""
    p.add_argument("--blob-format", type=int, choices=(4, 2), default=4,
                   help="blob format of base-free deltas: 4 (default: chunk records as binary columns) or 2 (the "
                        "same chunks under JSON records: what subscribers and relays of deltasync before blob "
                        "format 4 read; write it while a fleet upgrades). docs/FORMAT.md §4.6")
