"""The coding a publisher uses when not told one (deltasync.history.default_coding): the history coding for a
lossless stream signed with Ed25519 by a publisher that keeps its history (the in-process Publisher committing
its own versions, the sidecar), base-free otherwise (HMAC or no key: relays squash for late joiners; a budget;
part mode, where every rank must code alike; the one-shot `publish` command, which keeps no history)."""

from __future__ import annotations

import pytest

from deltasync.client.cli import build_parser
from deltasync.client.publisher import Publisher
from deltasync.client.sidecar import Sidecar
from deltasync.codec import EncodeOptions
from deltasync.history import default_coding
from deltasync.signing import Ed25519Signer

ED = Ed25519Signer.generate()
HMAC = bytes(range(32))


@pytest.mark.parametrize("key, kw, want", [
    (ED, {}, "history"), (HMAC, {}, "base-free"), (None, {}, "base-free"),
    (ED, {"budget": 1 << 20}, "base-free"), (ED, {"commit": False}, "base-free"),
    (ED, {"options": EncodeOptions()}, "base-free"),
])
def test_the_publishers_default_coding(key, kw, want):
    with Publisher("http://127.0.0.1:9", "m", "t", key, check_origin=False, **kw) as pub:
        assert pub.options.coding == want


@pytest.mark.parametrize("key, kw, want", [
    (ED, {}, "history"), (HMAC, {}, "base-free"), (ED, {"budget": 1 << 20}, "base-free"),
    (ED, {"coding": "base-free"}, "base-free"), (HMAC, {"coding": "history"}, "history"),
])
def test_the_sidecars_default_coding(tmp_path, key, kw, want):
    car = Sidecar(tmp_path, "http://127.0.0.1:9", "m", "t", key, **kw)
    assert car.options.coding == want


def test_the_command_lines_offer_it_where_a_history_is_kept():
    p = build_parser()
    sidecar = p.parse_args(["sidecar", "--watch", ".", "--origin", "http://x", "--model", "m", "--token-file", "t"])
    assert sidecar.coding == "auto"
    publish = p.parse_args(["publish", "--origin", "http://x", "--model", "m", "--token-file", "t", "s.safetensors"])
    assert publish.coding == "base-free"
    with pytest.raises(SystemExit):
        p.parse_args(["publish", "--origin", "http://x", "--model", "m", "--token-file", "t", "--coding", "history",
                      "s.safetensors"])
    assert default_coding(ED, keeps_history=False) == "base-free"


def test_a_state_of_many_tensors_stays_base_free_unless_asked(monkeypatch, tmp_path):
    """The history coder works chunk by chunk: by default a state of more than AUTO_MAX_TENSORS tensors (seed
    scale: 70k per-expert tensors) is published base-free, through the columnar path; asking for it still works."""
    import torch

    import deltasync.history

    monkeypatch.setattr(deltasync.history, "AUTO_MAX_TENSORS", 2)
    state = {f"t{i}": torch.zeros(4, dtype=torch.bfloat16) for i in range(3)}
    with Publisher("http://127.0.0.1:9", "m", "t", ED, check_origin=False) as pub:
        assert pub.options.coding == "history"
        pub._start_history(0, state)  # what the first publish does with the first state
        assert pub.options.coding == "base-free" and pub._history is None
    with Publisher("http://127.0.0.1:9", "m", "t", ED, check_origin=False,
                   options=EncodeOptions(coding="history")) as pub:
        pub._start_history(0, state)
        assert pub.options.coding == "history" and pub._history is not None
    assert deltasync.history.default_coding(ED, tensors=3) == "base-free"
    assert deltasync.history.default_coding(ED, tensors=2) == "history"
