"""deltasync: sparse, verified, per-step weight deltas for RL inference fleets (pure core, no network).

Every public name below is importable from ``deltasync`` itself; each is loaded from its
module on first use, so ``import deltasync`` (the servers do) does not load torch.
"""

from .exports import lazy_exports

__version__ = "0.1.0"

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    # errors
    "DeltaSyncError": ".errors", "FormatError": ".errors", "UnsupportedError": ".errors",
    "IntegrityError": ".errors", "BaseMismatchError": ".errors", "SignatureError": ".errors",
    "ChainError": ".errors", "NotFoundError": ".errors", "ApplyError": ".errors", "StorageError": ".errors",
    # manifests and signing
    "Manifest": ".manifest", "TensorRecord": ".manifest", "BlobRef": ".manifest", "ChunkRef": ".manifest",
    "parse_manifest": ".manifest",
    "Signer": ".signing", "Verifier": ".signing", "HmacSigner": ".signing", "HmacVerifier": ".signing",
    "load_key": ".signing",
    # encode, apply, keyframes, squash, plan
    "EncodeOptions": ".codec", "Encoded": ".codec", "encode_delta": ".codec", "decode_blob": ".codec",
    "prepare_delta": ".apply", "apply_prepared": ".apply", "apply_delta": ".apply",
    "encode_keyframe": ".keyframe", "load_keyframe": ".keyframe", "apply_keyframe": ".keyframe",
    "squash_chain": ".squash", "plan_catchup": ".planner",
    # fingerprints
    "tensor_fingerprint": ".fingerprint", "fingerprint_state": ".fingerprint", "state_fingerprint_of": ".fingerprint",
    # files
    "read_state_file": ".tensorfile", "write_state_file": ".tensorfile", "MappedTensorFile": ".tensorfile",
    "read_delta_file": ".deltafile", "write_delta_file": ".deltafile", "write_atomic": ".atomic",
})
__all__.append("__version__")
