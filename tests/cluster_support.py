"""A module-scoped local tree with a published RL trace: what the real-server tests of several files share."""

from __future__ import annotations

from contextlib import contextmanager

from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.testing.trace import RLTrace


@contextmanager
def origin_only(root, key: bytes):
    """A LocalCluster with just its origin, closed (servers stopped by pid) on exit."""
    c = LocalCluster(root, key=key)
    try:
        c.start_tree({})
        yield c
    finally:
        c.close()


def publish_trace(cluster, model: str, shape, key: bytes, *, seed: int, steps: int) -> list:
    """``steps`` states of an RL trace (lr 1e-4) published as v0 (keyframe), v1, ... of ``model``; returns them."""
    trace = RLTrace(shape, lr=1e-4, seed=seed)
    states = [trace.step() for _ in range(steps)]
    with Publisher(cluster.origin, model, cluster.token, key, keyframe_every=0) as pub:
        for i, s in enumerate(states):
            pub.publish(i, s)
        pub.flush(60)
    return states
