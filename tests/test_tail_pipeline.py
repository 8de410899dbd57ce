"""A delta's blobs decoded as they land (helper Q): ``prepare_delta(decoded=...)`` with blobs the driver decoded
early (``decode_checked``) gives exactly the ``PreparedDelta`` of a plain ``prepare_delta``; a blob whose early
decode failed is decoded again in manifest order, so the error is the same. (Every subscriber test runs the
driver's early decode: tests/test_client_subscriber.py, tests/test_ends_subscribe.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltasync.apply import apply_prepared, decode_checked, prepare_delta
from deltasync.codec import EncodeOptions, encode_delta
from deltasync.errors import IntegrityError


def _pair(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = {f"t{i}": (torch.randn(20000, generator=g) * 0.02).to(torch.bfloat16) for i in range(5)}
    new = {}
    for n, t in old.items():
        w = t.view(torch.int16).clone()
        w[torch.randint(0, w.numel(), (400,), generator=g)] += 1
        new[n] = w.view(torch.bfloat16)
    return old, new


def _same_prepared(a, b) -> None:
    assert a.decoded_bytes == b.decoded_bytes and a.skipped == b.skipped and list(a.patches) == list(b.patches)
    for name in a.patches:
        for x, y in zip(a.patches[name], b.patches[name], strict=True):
            assert (x.tensor, x.start, x.stop) == (y.tensor, y.start, y.stop)
            for f in ("positions", "raw", "values"):
                assert np.array_equal(getattr(x.changes, f), getattr(y.changes, f)), f


def test_early_decoded_blobs_give_the_same_prepared_delta():
    old, new = _pair(1)
    enc = encode_delta(old, new, model="m", version=1, parent=0, options=EncodeOptions(blob_target=8 << 10, cell_blob_min=1))
    assert len(enc.manifest.blobs) >= 3
    plain = prepare_delta(enc.manifest, enc.blobs)
    some = {r.id: decode_checked(enc.blobs[r.id], r.id, r.size) for r in enc.manifest.blobs[::2]}
    _same_prepared(prepare_delta(enc.manifest, enc.blobs, decoded=some), plain)
    target = {n: t.clone() for n, t in old.items()}
    apply_prepared(target, prepare_delta(enc.manifest, enc.blobs, decoded=some))
    assert all(torch.equal(target[n].view(torch.int16), new[n].view(torch.int16)) for n in new)


def test_a_blob_that_fails_early_fails_the_same_way_in_prepare():
    old, new = _pair(2)
    enc = encode_delta(old, new, model="m", version=1, parent=0, options=EncodeOptions(blob_target=8 << 10, cell_blob_min=1))
    first, second = enc.manifest.blobs[0], enc.manifest.blobs[1]
    bad = dict(enc.blobs)
    bad[second.id] = bytes(reversed(bad[second.id]))
    with pytest.raises(IntegrityError) as early:
        decode_checked(bad[second.id], second.id, second.size)
    with pytest.raises(IntegrityError) as plain:
        prepare_delta(enc.manifest, bad)
    with pytest.raises(IntegrityError) as mixed:  # what the driver does: the failed one left out of decoded=
        prepare_delta(enc.manifest, bad, decoded={first.id: decode_checked(bad[first.id], first.id, first.size)})
    assert str(early.value) == str(plain.value) == str(mixed.value)
