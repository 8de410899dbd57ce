"""Rebuild a stream's history from its servers (docs/FORMAT.md §4.5): the deltas since its ``since`` fetched in
order, each decoded with the history so far (a history-coded delta) or as it is, and taken in.

Both ends need it after a restart: a subscriber whose process restarted at a version after the last keyframe
(:class:`~deltasync.client.driver.SyncDriver`), and the sidecar resuming a history-coded stream. O(the chain's
changes); callers bound the chain (``REBUILD_MAX``) and fall back to a keyframe (subscriber) or to an empty
history at the head (publisher)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from deltasync.apply import prepare_delta
from deltasync.conditioned import CODING_HISTORY
from deltasync.history import StateHistory
from deltasync.manifest import Manifest

Fetched = tuple[Manifest, dict[str, bytes], set[str] | None]  # a delta's manifest, its blobs, the ids fetched (None: all)


async def take_in_chain(history: StateHistory, upto: int, fetch: Callable[[int], Awaitable[Fetched | None]], *,
                        pool=None, wanted=None) -> str | None:
    """Advance ``history`` through the deltas into ``history.version + 1`` .. ``upto``; ``fetch(v)`` gives delta v
    (verified as the caller requires) or None. Returns None when done, else why it stopped (the history is then
    left at the last version taken in). ``pool``: where to decode (an executor; None: the loop's default)."""
    loop = asyncio.get_running_loop()
    for v in range(history.version + 1, upto + 1):
        got = await fetch(v)
        if got is None:
            return f"v{v} is not on the servers"
        d, blobs, only = got
        if d.kind != "delta" or d.parent != v - 1:
            return f"v{v} is a {d.kind} from v{d.parent}"
        coded = d.coding == CODING_HISTORY
        prepared = await loop.run_in_executor(pool, lambda: prepare_delta(
            d, blobs, only=only, history=history if coded else None, wanted=wanted))
        history.advance_patches(v, prepared.patches)
    return None
