"""Golden vectors for signed manifests (manifest format 2, docs/FORMAT.md §5).

IF THIS FAILS, THE SIGNED WIRE FORMAT CHANGED: every deployed verifier reads these bytes. Bump
``deltasync.manifest.FORMAT_VERSION``, describe the change in docs/FORMAT.md, keep a reader for the
old format where deployed data must stay readable, and only then update the vectors.

The blob is opaque to a manifest, so these vectors do not depend on the blob coding (deltasync.blob).
The Ed25519 key is RFC 8032's test 1 key, whose signature of the empty message is pinned too.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from deltasync.blob import blob_id
from deltasync.digest import blob_digest
from deltasync.errors import SignatureError
from deltasync.manifest import BlobRef, ChunkRef, Manifest, TensorRecord, parse_manifest
from deltasync.signing import Ed25519Signer, Ed25519Verifier

RFC8032_SECRET = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"
RFC8032_PUBLIC = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
RFC8032_EMPTY_SIG = ("e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b4"
                     "6bd25bf5f0595bbe24655141438e7a100b")
KEY_ID = "ed25519:21fe31dfa154a261"  # first 8 bytes of SHA-256 of the raw public key, hex
BLOB = b"deltasync golden blob: opaque bytes to a manifest\n"
BLOB_ID = "20d3b35ccba83ca4d3bad40e5c0a09bd"
BLAKE3 = "blake3:963d5a32478411c4d9453b025a968ffa6e797cef7e71000ccca7fa6204016f24"
SHA256 = "sha256:cf5087c6a9791122a6528d844441dc96a45f0be4cd7557232a3f5af7e2faf30a"
SIGNED = (
    '{"blobs":[{"digest":"blake3:963d5a32478411c4d9453b025a968ffa6e797cef7e71000ccca7fa6204016f24",'
    '"id":"20d3b35ccba83ca4d3bad40e5c0a09bd","size":50}],"format":2,"key_id":"ed25519:21fe31dfa154a261",'
    '"kind":"delta","meta":{"step":"3"},"model":"policy","parent":2,"signature":"ed25519:81c1438e8c384235235a9'
    '50d5e28c61ae5d75d44e56e82a4889d1697538428cf62c92cfd2cd631e03d3ca66e8fc8a875a7886fa9ff1d1c136ffa0acbe99c7201'
    '","state_fp":"1111111111111111","state_fp_before":"2222222222222222","tensors":[{"changed":1,"chunks":[{"b'
    'lob":"20d3b35ccba83ca4d3bad40e5c0a09bd","index":0}],"dtype":"float32","fp_after":"fedcba9876543210","fp_be'
    'fore":"0123456789abcdef","name":"w","shape":[4]}],"version":3}'
)


def _signer() -> Ed25519Signer:
    return Ed25519Signer(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(RFC8032_SECRET)))


def _manifest() -> Manifest:
    return Manifest(model="policy", version=3, parent=2, kind="delta",
                    tensors=(TensorRecord(name="w", dtype="float32", shape=(4,), fp_before="0123456789abcdef",
                                          fp_after="fedcba9876543210", changed=1,
                                          chunks=(ChunkRef(blob=BLOB_ID, index=0),)),),
                    blobs=(BlobRef(id=BLOB_ID, size=len(BLOB)),), state_fp="1111111111111111",
                    state_fp_before="2222222222222222", meta={"step": "3"})


def test_primitives():
    s = _signer()
    assert s.verifier()._key.public_bytes_raw().hex() == RFC8032_PUBLIC
    assert s.sign(b"") == "ed25519:" + RFC8032_EMPTY_SIG  # RFC 8032 §7.1, test 1
    assert s.key_id == KEY_ID == "ed25519:" + hashlib.sha256(bytes.fromhex(RFC8032_PUBLIC)).hexdigest()[:16]
    assert blob_id(BLOB) == BLOB_ID
    assert blob_digest(BLOB) == BLAKE3 and blob_digest(BLOB, "sha256") == SHA256
    assert blob_digest(b"") == "blake3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def test_signed_manifest_bytes():
    signed = _manifest().with_digests({BLOB_ID: BLOB}).sign(_signer())
    assert signed.to_json().decode() == SIGNED
    back = parse_manifest(SIGNED, verifier=Ed25519Verifier(bytes.fromhex(RFC8032_PUBLIC)))
    assert back == signed and back.to_json().decode() == SIGNED
    # the signature covers everything but itself and the key id
    assert b'"signature"' not in signed.canonical_bytes() and b'"key_id"' not in signed.canonical_bytes()
    assert b'"digest":"' + BLAKE3.encode() in signed.canonical_bytes()


@pytest.mark.parametrize("field", ["digest", "size", "state_fp", "meta"])
def test_golden_tampered_is_refused(field):
    m = parse_manifest(SIGNED)
    if field == "digest":
        m = dataclasses.replace(m, blobs=(dataclasses.replace(m.blobs[0], digest=SHA256),))
    elif field == "size":
        m = dataclasses.replace(m, blobs=(dataclasses.replace(m.blobs[0], size=51),))
    elif field == "state_fp":
        m = dataclasses.replace(m, state_fp="0" * 16)
    else:
        m = dataclasses.replace(m, meta={"step": "4"})
    with pytest.raises(SignatureError):
        parse_manifest(m.to_json(), verifier=Ed25519Verifier(bytes.fromhex(RFC8032_PUBLIC)))
