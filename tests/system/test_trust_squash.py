"""Squashed catch-up deltas under public keys (issue 9, docs/THREAT_MODEL.md "Squashed deltas").

A relay builds squashes but holds no private key, so under Ed25519 a squash is unsigned. The rule kept
(THREAT_MODEL.md gives the measured cost of the alternative): a public-key subscriber never applies an
unsigned squash; it walks the signed chain and lands bit-exactly on the signed target. The control, an HMAC
deployment whose relay holds the key and signs its squash, shows the test can tell the two paths apart: there
the same late joiner applies the squash.

Real origin and relay processes on 127.0.0.1; the relay's squash is built (and checked unsigned / signed)
before the subscriber joins, so the subscriber's choice does not depend on how fast the first build is.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltasync.manifest import parse_manifest
from deltasync.signing import generate_ed25519_pem, load_signing_key, load_verify_key
from deltasync.testing.trace import ModelShape, RLTrace
from server_fixtures import KEY, TOKEN, fetch_squash, origin, relay, stop_all

pytestmark = pytest.mark.long

SHAPE = ModelShape(vocab=256, hidden=32, layers=2, ffn=64)
LAST = 8


def _run(tmp_path, *, public: bool, coding: str | None = "base-free") -> tuple[list[str], bool]:
    """Publish v0..v8, build the relay's squash v0→v8, then a late joiner follows the relay; returns the
    details of its applies and whether it ended bit-exact at v8. ``coding``: the stream's (None: the Publisher's
    default, which for an Ed25519 stream is the history coding: the relay then refuses to squash it)."""
    from deltasync.client.publisher import Publisher
    from deltasync.client.subscriber import ThreadedSubscriber
    from deltasync.codec import EncodeOptions

    if public:
        priv, pub = generate_ed25519_pem()
        (tmp_path / "pub.pem").write_bytes(pub)
        signer, verifier = load_signing_key(priv), load_verify_key(pub)
        o = origin(tmp_path, "origin", "--no-fsync", "--verify-key", str(tmp_path / "pub.pem"))
        extra = ["--verify-key", str(tmp_path / "pub.pem")]
        key_flag = False
    else:
        signer = verifier = KEY
        o = origin(tmp_path, "origin", "--no-fsync", key=True)
        extra, key_flag = [], True
    o.start().wait_ready(120)
    r = relay(tmp_path, "relay", [o.url], "--no-fsync", *extra, key=key_flag).start().wait_ready(120)
    subs = []
    try:
        trace = RLTrace(SHAPE, lr=1e-4, seed=11)
        options = None if coding is None else EncodeOptions(coding=coding)
        with Publisher(o.url, "sq", TOKEN, signer, keyframe_every=0, options=options) as p:
            for v in range(LAST + 1):
                state = {k: t.clone() for k, t in trace.step().items()}
                p.publish(v, state)
            p.flush(60)
        if coding is None:  # the default for an Ed25519 stream: history-coded, which no relay squashes
            assert p.options.coding == "history"
            status, body = asyncio.run(_get(f"{r.url}/v1/models/sq/delta?from=0&to={LAST}"))
            assert status == 400 and b"history coding" in body, (status, body[:300])
        else:
            body = asyncio.run(fetch_squash(r.url, "sq", 0, LAST))
            m = parse_manifest(body)
            assert (m.parent, m.version, m.kind) == (0, LAST, "delta")
            assert (m.signature is None) == public, "the relay signs its squash only with a key it holds"
        events = []
        target = {k: torch.zeros_like(t) for k, t in state.items()}
        sub = ThreadedSubscriber([r.url], "sq", target, verifier=verifier, auto=True, on_event=events.append,
                                 squash_timeout=60.0)
        subs.append(sub)
        sub.start()
        # the joiner starts from the v0 keyframe, then catches up v0 → v8 (a chain of 8 deltas: it asks for a squash)
        assert sub.wait_version(LAST, 120) == LAST
        with sub.hold():
            exact = all(torch.equal(target[n].view(-1).view(torch.uint8), state[n].view(-1).view(torch.uint8))
                        for n in state)
        return [e.detail for e in events if e.kind == "applied"], exact
    finally:
        for s in subs:
            s.close()
        stop_all(r, o)


async def _get(url: str) -> tuple[int, bytes]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(url, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.read()


def test_public_key_subscriber_walks_the_signed_chain_instead_of_an_unsigned_squash(tmp_path):
    applied, exact = _run(tmp_path, public=True)
    assert exact, "the subscriber must hold the signed v8 bit-exactly"
    assert applied and not any("squashed" in d for d in applied), applied
    assert sum(d.startswith("delta") for d in applied) == LAST, applied  # every signed delta of the chain


def test_control_a_relay_holding_the_hmac_key_signs_its_squash_and_the_joiner_applies_it(tmp_path):
    applied, exact = _run(tmp_path, public=False)
    assert exact
    assert any("squashed" in d for d in applied), applied


def test_an_ed25519_stream_is_history_coded_by_default_and_its_chain_walked(tmp_path):
    """The Publisher's default coding for a stream signed with Ed25519 is the history coding (docs/FORMAT.md §4.5):
    the relay refuses to squash it (it could not sign the squash anyway), and the late joiner walks the chain."""
    applied, exact = _run(tmp_path, public=True, coding=None)
    assert exact
    assert sum(d.startswith("delta") for d in applied) == LAST and not any("squashed" in d for d in applied), applied
