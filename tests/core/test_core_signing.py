"""Signer / Verifier: the HMAC pair, raw-key compatibility, and a second algorithm plugged in behind
the same protocols (the seam the Ed25519 issue uses)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

import pytest
import torch

from deltasync.codec import encode_delta
from deltasync.deltafile import pack_delta_file, unpack_delta_file
from deltasync.errors import FormatError, SignatureError
from deltasync.manifest import parse_manifest
from deltasync.signing import (HMAC_ALG, HmacSigner, HmacVerifier, Signer, Verifier, as_signer, as_verifier,
                               signature_alg)

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
OLD = {"w": torch.arange(64, dtype=torch.float32)}
NEW = {"w": OLD["w"].clone()}
NEW["w"][[3, 40]] += 1
ENC = encode_delta(OLD, NEW, model="policy", version=2, parent=1)
M = ENC.manifest


class ToySigner:
    """A non-HMAC scheme (keyed SHA-256) standing in for an asymmetric one: only the protocols are used."""

    key_id = "toy:0001"

    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    def sign(self, data: bytes) -> str:
        return "toy-sha256:" + hashlib.sha256(self.secret + data).hexdigest()


class ToyVerifier:
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    def verify(self, data: bytes, signature: str) -> None:
        if signature != ToySigner(self.secret).sign(data):
            raise SignatureError("toy signature does not verify")


def test_hmac_pair_signs_and_verifies_and_refuses_changes():
    s, v = HmacSigner(KEY), HmacVerifier(KEY)
    sig = s.sign(b"payload")
    assert sig == f"{HMAC_ALG}:" + hmac.new(KEY, b"payload", hashlib.sha256).hexdigest()
    assert signature_alg(sig) == HMAC_ALG
    v.verify(b"payload", sig)
    with pytest.raises(SignatureError, match="does not verify"):
        v.verify(b"payloaD", sig)
    with pytest.raises(SignatureError, match="does not verify"):
        HmacVerifier(OTHER).verify(b"payload", sig)
    with pytest.raises(SignatureError, match="toy-sha256"):
        v.verify(b"payload", ToySigner(KEY).sign(b"payload"))


def test_key_ids_name_keys_without_revealing_them():
    s = HmacSigner(KEY)
    assert s.key_id == HmacVerifier(KEY).key_id != HmacSigner(OTHER).key_id
    assert KEY.hex() not in s.key_id and KEY.hex()[:16] not in s.key_id
    assert KEY.hex() not in repr(s) and s.key_id in repr(s)
    with pytest.raises(FormatError, match="empty"):
        HmacSigner(b"")
    with pytest.raises(TypeError):
        HmacVerifier("not bytes")  # type: ignore[arg-type]


def test_protocols_and_raw_key_wrapping():
    assert isinstance(HmacSigner(KEY), Signer) and isinstance(HmacVerifier(KEY), Verifier)
    assert isinstance(ToySigner(KEY), Signer) and isinstance(ToyVerifier(KEY), Verifier)
    assert as_signer(None) is None and as_verifier(None) is None
    assert isinstance(as_signer(KEY), HmacSigner) and isinstance(as_verifier(KEY), HmacVerifier)
    toy = ToySigner(KEY)
    assert as_signer(toy) is toy
    as_verifier(HmacSigner(KEY)).verify(b"x", HmacSigner(KEY).sign(b"x"))  # the symmetric case


def test_manifest_sign_with_a_signer_equals_the_raw_key_and_verifies_every_way():
    signed = M.sign(HmacSigner(KEY))
    assert signed == M.sign(KEY)  # callers still passing bytes get the same bytes on the wire
    data = signed.to_json()
    assert parse_manifest(data, verifier=HmacVerifier(KEY)) == signed
    assert parse_manifest(data, verifier=KEY) == signed
    assert parse_manifest(data, verifier=KEY) == signed
    signed.verify_signature(HmacVerifier(KEY))
    with pytest.raises(SignatureError, match="policy v2"):
        parse_manifest(data, verifier=HmacVerifier(OTHER))
    with pytest.raises(SignatureError, match="unsigned"):
        parse_manifest(M.to_json(), verifier=HmacVerifier(KEY))


def test_another_algorithm_plugs_in_behind_the_protocols():
    signed = M.sign(ToySigner(b"s3cret"))
    assert signed.signature.startswith("toy-sha256:")
    assert parse_manifest(signed.to_json(), verifier=ToyVerifier(b"s3cret")) == signed
    with pytest.raises(SignatureError):
        parse_manifest(signed.to_json(), verifier=ToyVerifier(b"other"))
    with pytest.raises(SignatureError, match="toy-sha256"):
        parse_manifest(signed.to_json(), verifier=HmacVerifier(KEY))
    forged = dataclasses.replace(signed, meta={"step": "evil"})
    with pytest.raises(SignatureError):
        parse_manifest(forged.to_json(), verifier=ToyVerifier(b"s3cret"))


def test_delta_files_verify_with_a_verifier():
    data = pack_delta_file(M.sign(HmacSigner(KEY)), ENC.blobs)
    assert unpack_delta_file(data, verifier=HmacVerifier(KEY)).manifest.signature is not None
    assert unpack_delta_file(data, verifier=KEY).blobs == ENC.blobs
    with pytest.raises(SignatureError):
        unpack_delta_file(data, verifier=HmacVerifier(OTHER))
