"""/metrics as Prometheus sees it: scraped from real servers over loopback and parsed with
``prometheus_client``'s own parser; counters move with the traffic, and two servers in one process
each count their own."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from inprocess_servers import origin_config, relay_config, serving
from server_fixtures import keyframe, make_blob, publish, session, wait_for, wait_head

MODEL = "metered"


async def _scrape(s, url: str) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """(type per family, value per (sample name, sorted labels)) of one scrape."""
    async with s.get(f"{url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    types: dict[str, str] = {}
    values: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for sample in fam.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return types, values


async def test_scraped_counters_move_and_servers_do_not_share_them(tmp_path):
    blobs = [make_blob(300_000, 1), make_blob(5_000, 2)]
    size = sum(len(d) for _, d in blobs)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (o_url, _), session() as s:
        types, before = await _scrape(s, o_url)
        assert types["deltasync_bytes_out"] == "counter" and types["deltasync_store_bytes"] == "gauge"
        assert before[("deltasync_info", (("role", "origin"),))] == 1
        assert before[("deltasync_uploads_total", ())] == 0
        assert not any(name.endswith("_created") for name, _ in before)

        await publish(s, o_url, keyframe(MODEL, 7, blobs), blobs)
        for bid, data in blobs:
            async with s.get(f"{o_url}/v1/blobs/{bid}") as r:
                assert await r.read() == data
        _, after = await _scrape(s, o_url)
        moved = {name: after[(name, ())] - before[(name, ())] for name in (
            "deltasync_uploads_total", "deltasync_bytes_in_total", "deltasync_blob_requests_total",
            "deltasync_cache_hits_total", "deltasync_bytes_out_total", "deltasync_versions_total")}
        assert moved == {"deltasync_uploads_total": 2, "deltasync_bytes_in_total": size,
                         "deltasync_blob_requests_total": 2, "deltasync_cache_hits_total": 2,
                         "deltasync_bytes_out_total": size, "deltasync_versions_total": 1}
        assert after[("deltasync_head_version", (("model", MODEL),))] == 7
        assert after[("deltasync_store_bytes", ())] == size

        # A second server in the same process: its own registry, its own counts.
        async with serving(relay_config([o_url], store_dir=tmp_path / "r")) as (r_url, r_svc):
            await wait_head(s, r_url, MODEL, 7)  # announced once every fetch is under way

            async def fetched():
                return r_svc.store.blob_count == 2
            await wait_for(fetched, what="the relay to store both blobs")
            _, relay = await _scrape(s, r_url)
            assert relay[("deltasync_info", (("role", "relay"),))] == 1
            assert relay[("deltasync_uploads_total", ())] == 0  # the origin's uploads are the origin's
            assert relay[("deltasync_upstream_fetches_total", ())] == 2
            assert relay[("deltasync_bytes_in_total", ())] == size
            assert relay[("deltasync_bytes_out_total", ())] == 0  # nobody read from the relay yet
            assert relay[("deltasync_lag_versions", (("model", MODEL),))] == 0
            assert relay[("deltasync_active_streams", (("kind", "blob"),))] == 0
            _, origin_again = await _scrape(s, o_url)
            assert origin_again[("deltasync_bytes_out_total", ())] == after[("deltasync_bytes_out_total", ())] + size
            assert origin_again[("deltasync_uploads_total", ())] == 2
