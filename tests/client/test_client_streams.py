"""client/streams.stream_layout on real servers: a format-3 delta head names only what it changes; the whole
layout comes from the side keyframe at that version, else from the keyframe the chain starts at."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltasync.client.http import HttpClient
from deltasync.client.publisher import Publisher
from deltasync.client.streams import stream_layout
from deltasync.dtypes import dtype_info
from deltasync.manifest import parse_manifest
from cluster_support import origin_only

KEY = bytes(range(32))


def _states(n: int = 3):
    g = torch.Generator().manual_seed(3)
    base = {f"t{i:02d}": torch.randn(50 + i, generator=g).to(torch.bfloat16) for i in range(12)}
    out = [base]
    for k in range(1, n):
        s = {name: t.clone() for name, t in out[-1].items()}
        s[f"t{k:02d}"].view(torch.int16)[0] += 1  # each step changes one tensor
        out.append(s)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with origin_only(tmp_path_factory.mktemp("streams"), KEY) as c:
        yield c


@pytest.mark.parametrize("side_every", [0, 2])
def test_the_layout_of_a_delta_head_is_the_whole_state(cluster, side_every):
    model = f"sl{side_every}"
    states = _states(3)
    with Publisher(cluster.origin, model, cluster.token, KEY, keyframe_every=side_every) as pub:
        for i, s in enumerate(states):
            pub.publish(i, s)
        pub.flush(60)
    want = {n: (dtype_info(t.dtype).name, tuple(t.shape)) for n, t in states[-1].items()}

    async def go():
        client = HttpClient([cluster.origin])
        try:
            head = await client.get_head(model)
            m = parse_manifest(head.body, verifier=KEY)
            assert m.kind == "delta" and m.format == 3 and len(m.tensors) == 1  # names only what it changed
            return await stream_layout(client, model, m, KEY)
        finally:
            await client.close()

    assert asyncio.run(go()) == want
