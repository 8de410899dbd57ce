"""Public-key versions in the core: Ed25519 pairs, key ids, key sets (rotation), manifests that need
digests, key files and ``deltasync keygen``, scoped tokens. Real keys, real manifests, no mocks."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import subprocess
import sys

import pytest
import torch

from deltasync.codec import encode_delta
from deltasync.digest import blob_digest, check_digest
from deltasync.errors import FormatError, IntegrityError, SignatureError
from deltasync.manifest import BlobRef, parse_manifest
from deltasync.signing import (Ed25519Signer, Ed25519Verifier, HmacSigner, KeySet, generate_ed25519_pem,
                               is_public_key, load_signing_key, load_verify_key)
from deltasync.keyfiles import signer_from_options, verifier_from_options
from deltasync.server.http.tokens import TokenTable

OLD = {"w": torch.arange(64, dtype=torch.float32)}
NEW = {"w": OLD["w"].clone()}
NEW["w"][[3, 40]] += 1
ENC = encode_delta(OLD, NEW, model="policy", version=2, parent=1)
M = ENC.manifest.with_digests(ENC.blobs)


def test_key_id_is_the_first_8_bytes_of_sha256_of_the_raw_public_key():
    s = Ed25519Signer.generate()
    raw = s.verifier()._key.public_bytes_raw()
    assert s.key_id == "ed25519:" + hashlib.sha256(raw).hexdigest()[:16] == s.verifier().key_id
    assert Ed25519Verifier(raw).key_id == s.key_id
    assert is_public_key(s.verifier()) and not is_public_key(HmacSigner(b"k" * 32).verifier())


def test_signed_manifest_round_trips_and_names_its_key():
    s = Ed25519Signer.generate()
    signed = M.sign(s)
    assert signed.format == 2 and signed.key_id == s.key_id and signed.signature.startswith("ed25519:")
    assert len(signed.signature) == len("ed25519:") + 128
    back = parse_manifest(signed.to_json(), verifier=s.verifier())
    assert back == signed and back.blobs[0].digest == blob_digest(ENC.blobs[back.blobs[0].id])


def test_a_verify_key_holder_cannot_sign_a_version_anyone_accepts():
    """The verifier has no signing method; its own fresh key, a reused signature, or HMAC are all refused."""
    publisher = Ed25519Signer.generate()
    v = publisher.verifier()
    assert not hasattr(v, "sign")
    good = M.sign(publisher)
    zeroed = dataclasses.replace(good, meta={"step": "evil"})  # a changed field under the old signature
    with pytest.raises(SignatureError, match="does not verify"):
        parse_manifest(zeroed.to_json(), verifier=v)
    own = M.sign(Ed25519Signer.generate())  # the attacker's own pair
    with pytest.raises(SignatureError, match="not among the accepted keys|does not verify"):
        parse_manifest(own.to_json(), verifier=v)
    # the attacker's key, but the manifest claims the publisher's key id
    spoofed = dataclasses.replace(own, key_id=publisher.key_id)
    with pytest.raises(SignatureError):
        parse_manifest(spoofed.to_json(), verifier=v)
    with pytest.raises(SignatureError, match="ed25519"):
        parse_manifest(M.sign(HmacSigner(b"x" * 32)).to_json(), verifier=v)
    with pytest.raises(SignatureError, match="unsigned"):
        parse_manifest(M.to_json(), verifier=v)


def test_digests_are_signed_and_required_with_public_keys():
    s = Ed25519Signer.generate()
    with pytest.raises(FormatError, match="digest of every blob"):
        ENC.manifest.sign(s)  # no digests yet
    signed = M.sign(s)
    bid = signed.blobs[0].id
    other = dataclasses.replace(signed, blobs=(BlobRef(id=bid, size=signed.blobs[0].size,
                                                       digest="blake3:" + "0" * 64),) + signed.blobs[1:])
    with pytest.raises(SignatureError):
        parse_manifest(other.to_json(), verifier=s.verifier())
    # a digest-less manifest signed by some other route is refused by a public-key verifier
    bare = dataclasses.replace(signed, blobs=tuple(dataclasses.replace(b, digest=None) for b in signed.blobs))
    with pytest.raises(SignatureError, match="lacks a digest"):
        bare.verify_signature(s.verifier())
    old_format = dataclasses.replace(signed, format=1)
    with pytest.raises(SignatureError, match="format 1"):
        old_format.verify_signature(s.verifier())
    # HMAC (closed deployments) and unsigned format-1 manifests still read
    hm = dataclasses.replace(ENC.manifest, format=1).sign(b"k" * 32)
    assert hm.key_id is None and b"key_id" not in hm.to_json() and b"digest" not in hm.to_json()
    assert parse_manifest(hm.to_json(), verifier=b"k" * 32) == hm


def test_with_digests_drops_a_stale_signature_and_keeps_existing_digests():
    s = Ed25519Signer.generate()
    signed = M.sign(s)
    assert signed.with_digests(ENC.blobs) == signed  # nothing to add: the signature stays
    unsigned_again = ENC.manifest.sign(b"k" * 32).with_digests(ENC.blobs)
    assert unsigned_again.signature is None and unsigned_again.has_digests
    with pytest.raises(FormatError, match="not in hand"):
        ENC.manifest.with_digests({})


def test_check_digest_catches_bytes_that_keep_the_id_but_not_the_digest():
    data = ENC.blobs[M.blobs[0].id]
    check_digest("b", data, blob_digest(data))
    check_digest("b", data, blob_digest(data, "sha256"))
    with pytest.raises(IntegrityError, match="signed manifest says"):
        check_digest("b", data[:-1] + bytes([data[-1] ^ 1]), blob_digest(data))
    with pytest.raises(FormatError):
        check_digest("b", data, "md5:00")


def test_key_set_accepts_old_and_new_and_refuses_a_removed_key():
    old, new, removed = Ed25519Signer.generate(), Ed25519Signer.generate(), Ed25519Signer.generate()
    ks = KeySet([old.verifier(), new.verifier()])
    assert ks.key_ids == {old.key_id, new.key_id}
    for s in (old, new):
        parse_manifest(M.sign(s).to_json(), verifier=ks)
    with pytest.raises(SignatureError, match=f"signed with key {removed.key_id}.*not among the accepted keys"):
        parse_manifest(M.sign(removed).to_json(), verifier=ks)
    # the key set after rotation: the old key is removed, its versions are refused
    after = KeySet([new.verifier()])
    with pytest.raises(SignatureError, match=old.key_id):
        parse_manifest(M.sign(old).to_json(), verifier=after)


def test_key_files_and_keygen(tmp_path):
    r = subprocess.run([sys.executable, "-m", "deltasync.cli.main", "keygen", str(tmp_path / "pub-key")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    priv, pub = tmp_path / "pub-key", tmp_path / "pub-key.pub"
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600
    assert b"PRIVATE KEY" in priv.read_bytes() and b"PUBLIC KEY" in pub.read_bytes()
    signer = signer_from_options(priv)
    verifier = verifier_from_options([pub])
    assert signer.key_id == verifier.key_id and signer.key_id in r.stdout
    parse_manifest(M.sign(signer).to_json(), verifier=verifier)
    r = subprocess.run([sys.executable, "-m", "deltasync.cli.main", "keygen", str(priv)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "exists" in r.stderr
    with pytest.raises(FormatError, match="PRIVATE key"):
        verifier_from_options([priv])  # a verifier must never be handed the private half
    with pytest.raises(FormatError, match="not an unencrypted PEM private key"):
        signer_from_options(pub)
    with pytest.raises(FormatError, match="not both"):
        verifier_from_options([pub], key_file=pub)
    _, pub2 = generate_ed25519_pem()
    (tmp_path / "new.pub").write_bytes(pub2)
    ks = verifier_from_options([pub, tmp_path / "new.pub"])
    assert isinstance(ks, KeySet) and verifier.key_id in ks.key_ids
    assert load_verify_key(pub2).key_id in ks.key_ids
    with pytest.raises(FormatError):
        load_signing_key(b"-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")


def test_token_table_scopes_per_model_and_never_shows_a_token():
    pub_t, read_t, all_t = "p" * 20, "r" * 20, "a" * 20
    t = TokenTable.parse(f"# comment\npublish policy {pub_t}\nread policy* {read_t}\nread * {all_t}\n")
    assert t.require_read
    assert t.allows(pub_t, "publish", "policy") and t.allows(pub_t, "read", "policy")
    assert not t.allows(pub_t, "publish", "other") and not t.allows(read_t, "publish", "policy")
    assert t.allows(read_t, "read", "policy.kf") and not t.allows(read_t, "read", "other")
    assert t.allows(all_t, "read", "other") and t.allows(read_t, "read", None)
    assert not t.allows(None, "read", "policy") and not t.allows("x" * 20, "read", "policy")
    assert pub_t not in repr(t) and read_t not in repr(t)
    single = TokenTable.parse(pub_t + "\n")
    assert not single.require_read and single.allows(pub_t, "publish", "anything")
    with pytest.raises(FormatError) as e:
        TokenTable.parse(f"write policy {pub_t}\n")
    assert pub_t not in str(e.value)
    with pytest.raises(FormatError, match="at least 16"):
        TokenTable.parse("read policy short\npublish policy " + pub_t)
