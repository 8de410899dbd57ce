"""A subscriber whose source stays behind another listed source moves on (no error ever comes from it).

Two real origins (``deltasync.cli.cluster.LocalCluster`` processes on 127.0.0.1): ``stale`` holds only v0,
``origin`` goes on to v1. The subscriber lists the stale one first: its long-polls there answer
"nothing newer" for ever, which is not a failure. After ``behind_after`` seconds of that (two long-polls
by default) the driver asks the other source's head, finds it ahead and puts the stale one down, so v1
arrives within seconds. Before this, the subscriber stayed at v0 (the campaign's bit-flips-in-transit
follower behind a wedged relay, RELIABILITY.md).
"""

from __future__ import annotations

import time

import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.client.http import Timeouts
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import ThreadedSubscriber
from deltasync.testing.trace import ModelShape, RLTrace

KEY = bytes(range(1, 33))
SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=64)


def test_a_source_that_stays_behind_is_left_for_one_that_is_ahead(tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=21)
    s0, s1 = trace.step(), trace.step()
    with LocalCluster(tmp_path, key=KEY) as c:
        c.start_origin()
        stale = c.start_origin("stale").url
        with Publisher(stale, "lag", c.token, KEY) as pub:
            pub.publish(0, s0)
            pub.flush(60)
        with Publisher(c.origin, "lag", c.token, KEY) as pub:
            pub.publish(0, s0)
            pub.flush(60)
            target = {n: torch.zeros_like(t) for n, t in s0.items()}
            with ThreadedSubscriber([stale, c.origin], "lag", target, verifier=KEY,
                                    timeouts=Timeouts(connect=1.0, read=5.0, poll=1.0)) as sub:
                assert sub.wait_version(0, 30) == 0
                assert sub.status.server == stale
                pub.publish(1, s1)
                pub.flush(60)
                t0 = time.monotonic()
                assert sub.wait_version(1, 20) == 1, "stayed on the source that is behind"
                took = time.monotonic() - t0
                assert sub.status.server == c.origin
    assert all(torch.equal(target[n].view(torch.int16), s1[n].view(torch.int16)) for n in s1)
    assert took < 10, f"v1 took {took:.1f} s (bound: two 1 s long-polls, then one head probe)"
