"""Issue 9: signed manifests are sanity-checked before anything allocates or loops, and squash work is bounded.

Each crafted input from the issue gives the library's own error (FormatError, IntegrityError, TooLargeError),
never another exception; a relay asked to squash a crafted chain answers an error at once."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from deltasync import manifest as mf
from deltasync.codec import encode_delta
from deltasync.errors import DeltaSyncError, FormatError, IntegrityError, TooLargeError
from deltasync.keyframe import encode_keyframe
from deltasync.manifest import Manifest, TensorRecord, parse_manifest
from deltasync.squash import SquashBudget, squash_chain

FP = "0123456789abcdef"


def _manifest(shape, *, dtype="float32", version=2) -> dict:
    rec = TensorRecord(name="w", dtype=dtype, shape=tuple(shape), fp_before=FP, fp_after=FP, changed=0)
    m = Manifest(model="m", version=version, parent=1, kind="delta", tensors=(rec,), blobs=(), state_fp=FP,
                 state_fp_before=FP)
    return m.to_obj()


def _bad(data, match: str) -> FormatError:
    with pytest.raises(FormatError, match=match) as e:
        parse_manifest(data)
    assert len(str(e.value)) < 1000  # never a 5000-digit echo
    return e.value


def test_shapes_of_the_issue_are_rejected_before_allocating():
    _bad(json.dumps(_manifest([1 << 40])), "dimension")
    _bad(json.dumps(_manifest([1 << 20, 1 << 20])), "over the .*-element limit per tensor")
    _bad(json.dumps(_manifest([16, 1 << 48])), "dimension")
    _bad(json.dumps(_manifest([1 << 20, 1 << 20])), "element limit per tensor")
    assert parse_manifest(json.dumps(_manifest([1 << 17, 1 << 17]))).tensors[0].shape == (1 << 17, 1 << 17)
    assert parse_manifest(json.dumps(_manifest([mf.MAX_TENSOR_ELEMENTS]))).tensors[0].words == mf.MAX_TENSOR_ELEMENTS


def test_state_totals_are_limited():
    obj = _manifest([mf.MAX_TENSOR_ELEMENTS])
    one = obj["tensors"][0]
    n = mf.MAX_STATE_ELEMENTS // mf.MAX_TENSOR_ELEMENTS + 1
    obj["tensors"] = [dict(one, name=f"t{i:04d}") for i in range(n)]
    _bad(json.dumps(obj), "limit per state")
    obj["tensors"] = obj["tensors"][: n - 1]
    assert len(parse_manifest(json.dumps(obj)).tensors) == n - 1
    obj = _manifest([mf.MAX_TENSOR_ELEMENTS], dtype="float64")
    obj["tensors"] = [dict(obj["tensors"][0], name=f"t{i:04d}") for i in range(mf.MAX_STATE_BYTES // (8 << 34) + 1)]
    _bad(json.dumps(obj), "bytes .the limit per state")


@pytest.mark.parametrize("where", ["version", "shape", "blob size", "changed", "parent"])
def test_a_5000_digit_integer_is_a_format_error(where):
    obj = _manifest([4])
    obj["blobs"] = [{"id": "0" * 32, "size": 7}]
    big = "9" * 5000
    text = json.dumps(obj)
    token = {"version": '"version": 2', "shape": '"shape": [4]', "blob size": '"size": 7',
             "changed": '"changed": 0', "parent": '"parent": 1'}[where]
    assert token in text
    text = text.replace(token, token.split(":")[0] + ": " + (f"[{big}]" if where == "shape" else big))
    _bad(text, "not valid JSON")
    _bad(text.encode(), "not valid JSON")


def test_huge_python_ints_in_an_object_are_a_format_error():
    obj = _manifest([4])
    obj["version"] = 10 ** 5000
    e = _bad(obj, "integer of about")
    obj = _manifest([4])
    obj["tensors"][0]["shape"] = [2 ** 20000]
    _bad(obj, "integer of about")


def test_counts_and_sizes_are_limited():
    obj = _manifest([4])
    obj["blobs"] = [{"id": "0" * 32, "size": mf.MAX_BLOB_BYTES + 1}]
    _bad(obj, "blob size")
    obj["blobs"] = [{"id": f"{i:032x}", "size": mf.MAX_BLOB_BYTES} for i in range(mf.MAX_TOTAL_BLOB_BYTES // mf.MAX_BLOB_BYTES + 1)]
    _bad(obj, "blobs total")
    obj = _manifest([4])
    obj["blobs"] = [{"id": "0" * 32, "size": 1}]
    obj["tensors"][0].update(changed=1, fp_after="fedcba9876543210", chunks=[{"blob": "0" * 32, "index": 1 << 32}])
    _bad(obj, "chunk index")
    obj["tensors"][0]["chunks"] = [{"blob": "0" * 32, "index": 0}]
    assert parse_manifest(obj).tensors[0].chunks[0].index == 0


def test_random_garbage_never_escapes_the_tree():
    import random
    rng = random.Random(9)
    base = json.dumps(_manifest([3, 5])).encode()
    for _ in range(400):
        b = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.choice(b'0123456789e-.[]{}",:9')
        try:
            parse_manifest(bytes(b))
        except DeltaSyncError:
            pass


# -- squash -------------------------------------------------------------------------------

def _states(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = [{"a": torch.randn(64, 33, generator=g), "b": torch.randn(500, generator=g).to(torch.bfloat16)}]
    for _ in range(n - 1):
        new = {}
        for name, t in out[-1].items():
            t = t.clone()
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 20,), generator=g)
            flat[idx] = (flat[idx].float() * 1.5 + 0.25).to(t.dtype)
            new[name] = t
        out.append(new)
    return out


def _chain(n: int = 4):
    states = _states(n)
    encs = [encode_delta(states[i - 1], states[i], model="sq", version=i + 1, parent=i) for i in range(1, n)]
    blobs = {k: v for e in encs for k, v in e.blobs.items()}
    return states, [e.manifest for e in encs], blobs


def _grow(m: Manifest, name: str, shape: tuple[int, ...]) -> Manifest:
    return replace(m, tensors=tuple(replace(t, shape=shape) if t.name == name else t for t in m.tensors))


def test_squash_of_a_huge_claimed_shape_with_few_changes_is_fast():
    """The relay's builder used to loop over every chunk of the claimed shape (16×2^48 words: forever)."""
    _, chain, blobs = _chain()
    big = tuple([1 << 17, 1 << 17])  # 2^34 elements: within the limits, 16 Gi words
    crafted = [_grow(m, "a", big) for m in chain]
    for m in crafted:
        parse_manifest(m.to_json())  # passes the sanity limits
    t0 = time.monotonic()
    enc = squash_chain(crafted, blobs.__getitem__)
    assert time.monotonic() - t0 < 5
    assert enc.manifest.tensor("a").shape == big


def test_squash_of_blobs_that_disagree_with_their_manifests_is_an_integrity_error():
    _, chain, blobs = _chain()
    renamed = [replace(m, tensors=tuple(replace(t, name="z" + t.name) for t in m.tensors)) for m in chain]
    with pytest.raises(IntegrityError, match="does not list"):
        squash_chain(renamed, blobs.__getitem__)
    shrunk = [_grow(m, "a", (2,)) for m in chain]
    with pytest.raises(IntegrityError):
        squash_chain(shrunk, blobs.__getitem__)
    short = dict(blobs)
    bid = chain[0].blobs[0].id
    short[bid] = short[bid][:-1]
    with pytest.raises(IntegrityError, match="bytes, its manifest says"):
        squash_chain(chain, short.__getitem__)


@pytest.mark.parametrize("budget, cap", [(SquashBudget(words=10), "changed words"),
                                         (SquashBudget(chain_bytes=10), "chain bytes"),
                                         (SquashBudget(output_bytes=10), "output bytes"),
                                         (SquashBudget(seconds=0.0), "time")])
def test_squash_over_its_budget_is_too_large(budget, cap):
    _, chain, blobs = _chain()
    with pytest.raises(TooLargeError, match=cap) as e:
        squash_chain(chain, blobs.__getitem__, budget=budget)
    assert e.value.http_status == 413 and "fetch the chain" in str(e.value)
    squash_chain(chain, blobs.__getitem__)  # the default budget holds it
