"""The in-process publisher against a real origin: versions, side keyframes, errors, sharded trainers."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.client.errors import PublishError
from deltasync.client.publisher import Part, Publisher, merge_parts
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.errors import ChainError
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state as _same

KEY = bytes(range(32))
SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("pub"), key=KEY)
    try:
        c.start_origin()
        yield c
    finally:
        c.close()


def _sync(url: str, model: str, like, version: int):
    target = {n: torch.zeros_like(t) for n, t in like.items()}
    with ThreadedSubscriber(url, model, target, verifier=KEY) as sub:
        assert sub.wait_version(version, 60) == version
    return target


def test_versions_side_keyframes_and_layout_changes(cluster):
    trace = RLTrace(SHAPE, lr=1e-4, seed=0)
    with Publisher(cluster.origin, "p1", cluster.token, KEY, keyframe_every=3) as pub:
        for step in (0, 2, 3, 5, 9):  # steps need not be consecutive
            state = trace.step()
            pub.publish(step, state)
        with pytest.raises(ChainError, match="greater than"):
            pub.publish(9, state)
        pub.publish(10, state, keyframe=True)  # on demand
        grown = {**state, "extra.bias": torch.ones(7, dtype=torch.bfloat16)}
        pub.publish(11, grown)  # the tensor set changed: the stream continues with a keyframe
        pub.flush(60)
        got = [(r.version, r.kind, r.side_keyframe, r.manifest.parent) for r in pub.results]
    assert got == [(0, "keyframe", False, None), (2, "delta", False, 0), (3, "delta", True, 2), (5, "delta", False, 3),
                   (9, "delta", True, 5), (10, "delta", True, 9), (11, "keyframe", False, None)]
    assert all(r.manifest.signature for r in pub.results)
    assert _same(_sync(cluster.origin, "p1", grown, 11), grown)


def test_a_failed_upload_is_raised_on_the_next_call_and_the_stream_recovers(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = LocalCluster(tmp_path, key=KEY)
    try:
        c.start_origin(port=port)
        trace = RLTrace(SHAPE, lr=1e-4, seed=1)
        pub = Publisher(c.origin, "p2", c.token, KEY, keyframe_every=0)
        pub.publish(0, trace.step())
        pub.flush(60)
        c.servers["origin"].stop()
        lost = pub.publish(1, trace.step())
        with pytest.raises(PublishError):
            lost.result(60)
        with pytest.raises(PublishError, match="v1"):
            pub.publish(2, trace.step())  # the failure surfaces here, once; this state is not published
        c.start_origin(port=port)
        state = trace.step()
        p3 = pub.publish(3, state)
        assert p3.kind == "keyframe"  # v1 never committed, so no delta can build on it
        pub.close(60)
        assert _same(_sync(c.origin, "p2", state, 3), state)
    finally:
        c.close()


def test_merge_parts_refuses_inconsistent_ranks():
    trace = RLTrace(SHAPE, lr=1e-4, seed=2)
    from deltasync.keyframe import encode_keyframe
    st = trace.step()
    names = sorted(st)
    a = encode_keyframe({n: st[n] for n in names[:3]}, model="m", version=1).manifest
    b = encode_keyframe({n: st[n] for n in names[3:]}, model="m", version=1).manifest
    whole = encode_keyframe(st, model="m", version=1).manifest
    merged = merge_parts([a, b])
    assert merged.state_fp == whole.state_fp and [t.name for t in merged.tensors] == names
    with pytest.raises(PublishError, match="two ranks"):
        merge_parts([a, a])
    c = encode_keyframe({n: st[n] for n in names[3:]}, model="m", version=2).manifest
    with pytest.raises(PublishError, match="disagree"):
        merge_parts([a, c])
    assert Part.from_bytes(Part(main=a).to_bytes()).main == a


def _rank_main(rank: int, world: int, port: int, origin: str, token: str, steps: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trace = RLTrace(SHAPE, lr=1e-4, seed=3)  # every rank computes the same trace, publishes its own slice
        names = sorted(trace.state())
        mine = names[rank::world]
        pub = Publisher(origin, "sharded", token, KEY, keyframe_every=2, commit=False)  # rank 0 commits the merge
        for step in range(steps):
            full = trace.step()
            pending = pub.publish(step, {n: full[n] for n in mine})
            part = pending.part(60).to_bytes()
            parts = [None] * world if rank == 0 else None
            dist.gather_object(part, parts, dst=0)
            if rank == 0:
                pub.commit([Part.from_bytes(p) for p in parts], 60)
            dist.barrier()
        pub.close(60)
        queue.put((rank, "ok"))
    except BaseException as e:
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def test_sharded_trainer_each_rank_publishes_its_tensors_one_commit_makes_the_version(cluster):
    world, steps = 3, 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cluster.origin, cluster.token, steps, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted(q.get(timeout=180) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert results == [(r, "ok") for r in range(world)]
    trace = RLTrace(SHAPE, lr=1e-4, seed=3)
    for _ in range(steps):
        expected = trace.step()
    assert _same(_sync(cluster.origin, "sharded", expected, steps - 1), expected)
    # side keyframes were merged too: a subscriber can start from the side stream's v2
    from deltasync.client.http import HttpClient
    import asyncio

    async def side_head():
        async with HttpClient(cluster.origin) as h:
            return await h.get_head("sharded.kf")
    head = asyncio.run(side_head())
    assert head is not None and head.version == 2 and head.kind == "keyframe"
