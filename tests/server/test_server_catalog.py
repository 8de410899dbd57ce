"""server/parents/catalog.py: a manifest is parsed once per server process (issue 22: at 70,000 tensors a parse is
~0.5 s of CPU). The origin serves a version it committed, and a relay serves and walks back through versions it
fetched, without parsing them again; a stored copy that no longer hashes to its etag is still refused. Real
servers in this process (aiohttp on loopback), real manifests; parse_manifest is wrapped to count calls."""

from __future__ import annotations

import pytest

from deltasync.server import routes
from deltasync.server.parents import catalog as catalog_mod
from inprocess_servers import origin_config, relay_config, serving
from server_fixtures import KEY, delta, get_bytes, keyframe, make_blob, publish, session, wait_head


def _counting(monkeypatch, module) -> list[str]:
    calls: list[str] = []
    real = module.parse_manifest

    def counted(data, **kw):
        m = real(data, **kw)
        calls.append(f"{m.model} v{m.version}")
        return m

    monkeypatch.setattr(module, "parse_manifest", counted)
    return calls


async def test_committed_and_fetched_manifests_are_not_parsed_again(tmp_path, monkeypatch):
    served = _counting(monkeypatch, routes)
    walked = _counting(monkeypatch, catalog_mod)
    b0, b1 = make_blob(4096, 1), make_blob(4096, 2)
    v0 = keyframe("m", 0, [b0])
    v1 = delta("m", 1, 0, [b1], base_fp=v0.state_fp)
    async with serving(origin_config(store_dir=tmp_path / "o")) as (o_url, o_svc), session() as s:
        await publish(s, o_url, v0, [b0])
        await publish(s, o_url, v1, [b1])
        for v in (0, 1, 1):
            status, _, body = await get_bytes(s, f"{o_url}/v1/models/m/versions/{v}")
            assert status == 200 and body == (v0 if v == 0 else v1).to_json()
        assert served == []  # verified at commit: served by rehashing the bytes only
        async with serving(relay_config([o_url], store_dir=tmp_path / "r")) as (r_url, r_svc):
            await wait_head(s, r_url, "m", 1)
            for v in (1, 0):
                status, _, body = await get_bytes(s, f"{r_url}/v1/models/m/versions/{v}")
                assert status == 200 and body == (v0 if v == 0 else v1).to_json()
            assert served == [] and walked == []  # verified when fetched from the origin, kept parsed
            assert (await r_svc.catalog.manifest("m", 1)) == v1
            assert walked == []
            # a stored copy damaged behind the server's back: its bytes no longer hash to the etag
            path = next(p for p in (tmp_path / "r").rglob("*") if p.is_file() and p.read_bytes() == v0.to_json())
            path.write_bytes(v0.to_json().replace(b'"keyframe"', b'"keyfram3"'))
            status, _, body = await get_bytes(s, f"{r_url}/v1/models/m/versions/0")
            assert status == 200 and body == v0.to_json()  # refetched from the origin
            assert r_svc.metrics.get("corrupt_dropped") == 1
