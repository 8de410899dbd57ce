"""Every byte a server keeps counts against its budget, and a relay's history is pruned (issue 9: ``make soak``
found relay blob caches 24% over ``--cache-size`` and 1,000 manifest files on every server, outside any budget).

Unit level: the store (server/storage/store.py) over a real directory counts manifests and squashed manifests with its
blobs, evicts again whenever a blob lands or a lease ends, prunes manifests below the floor
(retention.py ``manifest_floor``) when made with ``prune_history`` and answers a pruned version with 404, never a
500. Process level: origin → relay → relay with a tiny ``--cache-size``, many versions from the real
``Publisher``; each relay's directory ends within budget + one version's bytes, manifests are pruned, and
subscribers that join late converge bit-exactly.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from deltasync.errors import NotFoundError
from deltasync.server.storage.retention import manifest_floor
from deltasync.server.storage.store import STALE_MAX, DiskStore
from server_fixtures import KEY, TOKEN, delta, keyframe, make_blob, origin, relay, stop_all


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "lock")


@pytest.mark.parametrize("order, head, kf, retention, floor", [
    ([], None, None, 4, None),
    ([0, 1, 2, 3], 3, None, 2, None),              # no keyframe yet: the whole chain is needed
    ([0, 1, 2, 3, 4, 5], 5, 0, 2, 0),               # the newest keyframe is the floor
    ([0, 1, 2, 3, 4, 5, 6, 7], 7, 5, 2, 5),         # keyframe older than the newest two: it is the floor
    ([0, 1, 2, 3, 4, 5, 6, 7], 7, 7, 3, 5),         # keyframe inside the window: the window's oldest
    ([0, 1, 2, 3, 4, 5, 6, 7], 5, 3, 2, 3),         # above the head does not move the floor
])
def test_manifest_floor(order, head, kf, retention, floor):
    assert manifest_floor(order, head=head, newest_keyframe=kf, retention=retention) == floor


async def _put_version(store: DiskStore, m, blobs) -> None:
    for bid, data in blobs:
        await store.put_blob_bytes(bid, data)
    await store.put_manifest(m, announce=True)


def _versions(n: int, *, every: int, size: int = 3000):
    """(manifest, blobs) of versions 0..n-1: a keyframe every ``every``, else a delta of one fresh blob."""
    out = []
    for v in range(n):
        blobs = [make_blob(size, seed=v)]
        m = keyframe("m", v, blobs) if v % every == 0 else delta("m", v, v - 1, blobs)
        out.append((m, blobs))
    return out


def test_store_counts_manifests_and_squashes_and_stays_within_budget(tmp_path):
    async def main():
        budget = 40_000
        store = DiskStore(tmp_path / "s", budget=budget, retention=3, fsync=False, prune_history=True)
        await store.load()
        vs = _versions(60, every=10)
        for m, blobs in vs:
            await _put_version(store, m, blobs)
            await store.put_squash("m", max(0, m.version - 4), m.version, b"{}" * 300)
            store.make_room(0)
            on_disk = du(tmp_path / "s")
            assert on_disk == store.stored_bytes, "the ledger must count every byte on disk"
            assert on_disk <= budget + 3000 + 2000, f"v{m.version}: {on_disk} bytes kept, budget {budget}"
        idx = store.index("m")
        # the newest keyframe is v50, the newest three 57..59: manifests kept from v50 to the head
        assert idx.order == list(range(50, 60))
        assert len(list((tmp_path / "s" / "models" / "m").iterdir())) == 10
        assert all(int(f.name.split("-")[0]) >= 50 for f in (tmp_path / "s" / "squash" / "m").iterdir())
        assert store.manifest_bytes > 0 and store.stored_bytes == store.blob_bytes + store.manifest_bytes
        with pytest.raises(NotFoundError, match="not stored here"):
            await store.get_manifest("m", 49)
        # every blob of v50..v59 is still held (pinned or newest), so the chain from the keyframe is servable
        for m, _ in vs[50:]:
            assert all(store.has_blob(b.id) for b in m.blobs) or m.version not in store.index("m").window(3)
        # a restart indexes the same bytes
        store2 = DiskStore(tmp_path / "s", budget=budget, retention=3, fsync=False, prune_history=True)
        store2.files._lock_fd = None
        await store2.load()
        assert store2.index("m").order == idx.order and store2.manifest_bytes == store.manifest_bytes
        assert du(tmp_path / "s") == store2.stored_bytes <= budget

    asyncio.run(main())


def test_origin_store_keeps_its_history(tmp_path):
    async def main():
        store = DiskStore(tmp_path / "o", retention=3, fsync=False)  # an origin: no pruning, no budget
        await store.load()
        for m, blobs in _versions(30, every=10):
            await _put_version(store, m, blobs)
        assert store.index("m").order == list(range(30))
        assert len(await store.get_manifest("m", 0)) > 0

    asyncio.run(main())


def test_unleased_blobs_are_evicted_at_once(tmp_path):
    async def main():
        store = DiskStore(tmp_path / "s", budget=10_000, retention=1, fsync=False, prune_history=True)
        await store.load()
        ids = []
        for seed in range(6):
            bid, data = make_blob(3000, seed=100 + seed)
            store.lease([bid])
            await store.put_blob_bytes(bid, data)
            ids.append(bid)
        assert store.blob_bytes == 18_000 and store.over_budget  # all leased: over budget rather than refuse
        store.unlease(ids)
        assert store.blob_bytes <= 10_000 and not store.over_budget
        assert du(tmp_path / "s") == store.stored_bytes

    asyncio.run(main())


# -- process level ---------------------------------------------------------------------------------------------

async def _get(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.read()


@pytest.mark.long
def test_tree_with_a_tiny_budget_stays_within_it_and_late_joiners_converge(tmp_path):
    from deltasync.client.publisher import Publisher
    from deltasync.client.subscriber import ThreadedSubscriber
    from deltasync.testing.trace import ModelShape, RLTrace

    budget = 200_000
    o = origin(tmp_path, "origin", "--no-fsync", "--retention", "4", key=True).start().wait_ready(120)
    a = relay(tmp_path, "tier1", [o.url], "--cache-size", str(budget), "--retention", "4", "--no-fsync",
              key=True).start().wait_ready(120)
    b = relay(tmp_path, "tier2", [a.url, o.url], "--cache-size", str(budget), "--retention", "4", "--no-fsync",
              key=True).start().wait_ready(120)
    trace = RLTrace(ModelShape(vocab=256, hidden=32, layers=2, ffn=64), lr=3e-4, seed=5)
    subs: list[tuple[ThreadedSubscriber, dict]] = []
    states = {}
    biggest = 0
    versions = 60
    try:
        with Publisher(o.url, "bud", TOKEN, KEY, keyframe_every=10) as pub:
            for v in range(versions):
                states[v] = trace.step()
                pub.publish(v, states[v])
                if v in (25, 47):  # late joiners, one per relay
                    pub.flush(60)
                    t = {n: torch.zeros_like(x) for n, x in states[v].items()}
                    s = ThreadedSubscriber([(a if v == 25 else b).url, o.url], "bud", t, verifier=KEY, auto=True)
                    s.start()
                    subs.append((s, t))
            pub.flush(60)
            biggest = max(r.blob_bytes + 4096 for r in pub.results)
        for s, t in subs:
            assert s.wait_version(versions - 1, 90) == versions - 1
            with s.hold():
                assert all(torch.equal(t[n].view(-1).view(torch.uint8), states[versions - 1][n].view(-1).view(torch.uint8))
                           for n in t)
        # The last blobs land a moment after the head moves, and a squash build a joiner asked for leases its
        # chain (over budget rather than refuse) until it ends: its first build starts the codec (tens of s).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(du(tmp_path / r) <= budget + biggest for r in ("tier1", "tier2")):
                break
            time.sleep(0.2)
        for r in ("tier1", "tier2"):
            kept = du(tmp_path / r)
            parts = {p.name: du(p) for p in (tmp_path / r).iterdir() if p.is_dir()}
            assert kept <= budget + biggest, f"{r} keeps {kept} bytes {parts}, budget {budget} + one version {biggest}"
            manifests = list((tmp_path / r / "models" / "bud").iterdir())
            # from the newest side keyframe (v50) to the head, plus at most STALE_MAX pulled back through
            assert len(manifests) <= 10 + STALE_MAX, f"{r}: {len(manifests)} manifests kept, expected pruning"
        # the origin keeps every version (documented): a pruned version is still served through the relays
        assert len(list((tmp_path / "origin" / "models" / "bud").iterdir())) == versions
        status, _ = asyncio.run(_get(f"{b.url}/v1/models/bud/versions/3"))
        assert status == 200
    finally:
        for s, _ in subs:
            s.close()
        stop_all(b, a, o)


@pytest.mark.long
def test_relay_answers_a_pruned_version_404_when_no_parent_has_it(tmp_path):
    """The relay's only parent is gone: a pruned version is a JSON 404 (catch up from a keyframe), not a 500."""
    import json

    from server_fixtures import publish, session

    o = origin(tmp_path, "origin", "--no-fsync", key=True).start().wait_ready(120)
    a = relay(tmp_path, "tier1", [o.url], "--cache-size", "100000", "--retention", "2", "--no-fsync",
              key=True).start().wait_ready(120)

    async def main():
        async with session() as s:
            for m, blobs in _versions(12, every=5):
                await publish(s, o.url, m, blobs)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                st, body = await _get(f"{a.url}/v1/models/m/head")
                if st == 200 and json.loads(body)["version"] == 11:
                    break
                await asyncio.sleep(0.1)

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(list((tmp_path / "tier1" / "models" / "m").iterdir())) > 2:
            time.sleep(0.1)
        assert sorted(f.name for f in (tmp_path / "tier1" / "models" / "m").iterdir())[0].startswith("0" * 18 + "10")
        stop_all(o)
        status, body = asyncio.run(_get(f"{a.url}/v1/models/m/versions/2"))
        assert status in (404, 502, 504), (status, body)
        assert json.loads(body)["error"]["code"]
        status, _ = asyncio.run(_get(f"{a.url}/v1/models/m/versions/10"))
        assert status == 200
    finally:
        stop_all(a, o)


def test_origin_store_deletes_orphan_blobs_after_the_grace(tmp_path):
    """Blobs no manifest names (a publish cut between its blob uploads and its commit, or between a version's
    commit and its side keyframe's) leave an origin once older than the grace: at start and at a commit."""
    async def main():
        store = DiskStore(tmp_path / "o", fsync=False, orphan_grace=3600)
        await store.load()
        (m0, b0), (m1, b1) = _versions(2, every=10)
        await _put_version(store, m0, b0)
        orphan, data = make_blob(500, seed=999)
        await store.put_blob_bytes(orphan, data)  # uploaded, never committed
        await store.put_manifest(m1, announce=False)  # a commit within the grace keeps it
        for bid, d in b1:
            await store.put_blob_bytes(bid, d)
        assert store.has_blob(orphan)
        store.orphan_grace = 0.0
        await _put_version(store, *_versions(3, every=10)[2])  # the next commit sweeps
        assert not store.has_blob(orphan) and all(store.has_blob(b.id) for b in m0.blobs + m1.blobs)
        await store.put_blob_bytes(orphan, data)
        # a restart finds it again; one shared with a committed version is never an orphan
        again = DiskStore(tmp_path / "o", fsync=False, orphan_grace=0.0)
        await again.load()
        assert not again.has_blob(orphan) and all(again.has_blob(b.id) for b in m0.blobs + m1.blobs)
        assert not (tmp_path / "o" / "blobs" / orphan[:2] / orphan).exists()

    asyncio.run(main())
