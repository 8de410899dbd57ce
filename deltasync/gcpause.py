"""The cyclic garbage collector paused while many long-lived objects are made.

Building the records of a state of 70,000 tensors (header entries, host views, manifest records) makes a few
hundred thousand objects; each batch of allocations triggers a collection, and the oldest generation's passes
walk everything alive, again and again: more than half of the time it took to open two 70k-tensor files. Nothing
made there is cyclic garbage, so the collector has nothing to find in it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off meanwhile (back on after, if it was on; nested uses are no-ops)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
