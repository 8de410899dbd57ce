"""Trust end to end, as a user runs it: real origin and relay processes on 127.0.0.1, the ``deltasync``
CLI for keygen, publish and subscribe, real safetensors files.

* A holder of only the public key (and even the origin's publish token) cannot publish a version any
  subscriber accepts: the forged zeroed-embeddings version goes through a real relay (which holds no key
  and still relays), the subscriber refuses it and keeps the old version bit-exactly.
* An origin holding the public key refuses that forgery at commit.
* TLS on every hop (a throwaway CA made with ``cryptography``): origin → relay → subscriber over https;
  a client trusting another CA is refused with a clear error.
* Scoped tokens: a publish token for one model only, read tokens on the origin and on the relay (the
  relay passes its own upstream); a subscriber without one is refused; no token appears in any log line.
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync.cli.cluster import start_server
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

# long: real CLI processes, many runs; `make test-long` (which .ci/run also runs), not `make test`
pytestmark = pytest.mark.long

SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)
PUBLISH_TOKEN = "pub-token-6f1d2c3b4a5e"
ORIGIN_READ_TOKEN = "origin-read-9a8b7c6d5e4f"
RELAY_READ_TOKEN = "relay-read-1122334455aa"
EMBED = "model.embed_tokens.weight"


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(_bits(a[n]), _bits(b[n])) for n in a)


def _keys(d: Path, name: str) -> tuple[Path, Path]:
    r = cli("keygen", str(d / name))
    assert r.returncode == 0, r.stderr
    return d / name, d / f"{name}.pub"


def _states(tmp: Path, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    trace = RLTrace(SHAPE, lr=1e-4, seed=seed)
    out = []
    for i in range(n):
        out.append({k: v.clone() for k, v in trace.step().items()})
        write_state_file(tmp / f"s{i}.safetensors", out[-1])
    return out


def _forged(tmp: Path, state: dict[str, torch.Tensor]) -> Path:
    bad = {k: v.clone() for k, v in state.items()}
    bad[EMBED].zero_()  # the forgery: zeroed embeddings
    write_state_file(tmp / "forged.safetensors", bad)
    return tmp / "forged.safetensors"


def test_verify_key_holder_cannot_publish_through_a_relay(tmp_path):
    """Origin and relay hold no key (a relay without any key still relays); the subscriber holds the
    publisher's public key, and refuses what the attacker, holding that key and the publish token, sends."""
    priv, pub = _keys(tmp_path, "publisher")
    evil_priv, _ = _keys(tmp_path, "attacker")
    token = tmp_path / "token"
    token.write_text(PUBLISH_TOKEN)
    origin = start_server("origin", "origin", tmp_path, ["--listen", "127.0.0.1:0", "--store", str(tmp_path / "o"),
                                                         "--token-file", str(token), "--no-fsync"])
    relay = start_server("relay", "relay", tmp_path, ["--listen", "127.0.0.1:0", "--parent", origin.url,
                                                      "--cache", str(tmp_path / "r"), "--no-fsync"])
    try:
        states = _states(tmp_path, 2, seed=31)
        base = ["publish", "--origin", origin.url, "--model", "policy", "--token-file", str(token)]
        for i in range(2):
            r = cli(*base, "--signing-key", str(priv), str(tmp_path / f"s{i}.safetensors"))
            assert r.returncode == 0, r.stderr
        out = tmp_path / "out.safetensors"
        sub = ["subscribe", "--from", relay.url, "--model", "policy", "--verify-key", str(pub), "--out", str(out)]
        r = cli(*sub, "--once", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        assert _same(read_state_file(out), states[1])
        v1_bytes = out.read_bytes()

        # the attacker signs with its own key (a key id the subscriber does not hold); the keyless origin
        # takes it, the relay relays it
        r = cli(*base, "--signing-key", str(evil_priv), str(_forged(tmp_path, states[1])))
        assert r.returncode == 0 and "published policy v2" in r.stdout, r.stderr
        r = cli(*sub, "--until", "2", "--timeout", "8")
        assert r.returncode == 1, r.stdout + r.stderr
        assert "still at v1" in r.stderr and "signature" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
        assert out.read_bytes() == v1_bytes  # nothing of the forgery was written
        assert _same(read_state_file(out), states[1])
        # ... and a fresh subscriber does not start from it either
        r = cli("subscribe", "--from", relay.url, "--model", "policy", "--verify-key", str(pub),
                "--out", str(tmp_path / "fresh.safetensors"), "--once", "--timeout", "8")
        assert r.returncode == 1 and not (tmp_path / "fresh.safetensors").exists(), r.stdout + r.stderr
    finally:
        relay.stop()
        origin.stop()


def _make_ca(d: Path, name: str) -> tuple[Path, object, object]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    path = d / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert, key


def _make_cert(d: Path, name: str, ca_cert, ca_key) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = d / f"{name}.crt", d / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_tokens_and_keys_on_every_hop(tmp_path):
    priv, pub = _keys(tmp_path, "publisher")
    evil_priv, _ = _keys(tmp_path, "attacker")
    ca, ca_cert, ca_key = _make_ca(tmp_path, "test-ca")
    other_ca, _, _ = _make_ca(tmp_path, "other-ca")
    o_cert, o_key = _make_cert(tmp_path, "origin", ca_cert, ca_key)
    r_cert, r_key = _make_cert(tmp_path, "relay", ca_cert, ca_key)
    origin_tokens = tmp_path / "origin-tokens"
    origin_tokens.write_text(f"# scoped tokens\npublish policy {PUBLISH_TOKEN}\nread * {ORIGIN_READ_TOKEN}\n")
    relay_tokens = tmp_path / "relay-tokens"
    relay_tokens.write_text(f"read policy {RELAY_READ_TOKEN}\n")
    (tmp_path / "publish-token").write_text(PUBLISH_TOKEN)
    (tmp_path / "upstream-token").write_text(ORIGIN_READ_TOKEN)
    (tmp_path / "sub-token").write_text(RELAY_READ_TOKEN)
    origin = start_server("origin", "origin", tmp_path, [
        "--listen", "127.0.0.1:0", "--store", str(tmp_path / "o"), "--token-file", str(origin_tokens), "--no-fsync",
        "--verify-key", str(pub), "--tls-cert", str(o_cert), "--tls-key", str(o_key), "--log-level", "DEBUG"])
    assert origin.url.startswith("https://127.0.0.1:")
    relay = start_server("relay", "relay", tmp_path, [
        "--listen", "127.0.0.1:0", "--parent", origin.url, "--cache", str(tmp_path / "r"), "--no-fsync",
        "--verify-key", str(pub), "--tls-cert", str(r_cert), "--tls-key", str(r_key), "--ca-file", str(ca),
        "--read-token-file", str(tmp_path / "upstream-token"), "--token-file", str(relay_tokens),
        "--log-level", "DEBUG"])
    outputs = []
    try:
        states = _states(tmp_path, 2, seed=41)
        base = ["publish", "--origin", origin.url, "--token-file", str(tmp_path / "publish-token"),
                "--ca-file", str(ca)]
        for i in range(2):
            r = cli(*base, "--model", "policy", "--signing-key", str(priv), str(tmp_path / f"s{i}.safetensors"))
            outputs.append(r)
            assert r.returncode == 0, r.stderr
        # the origin holds the public key: the attacker's version is refused at commit
        r = cli(*base, "--model", "policy", "--signing-key", str(evil_priv), str(_forged(tmp_path, states[1])))
        outputs.append(r)
        assert r.returncode == 1 and "signature" in r.stderr.lower(), r.stdout + r.stderr
        # the publish token is scoped to "policy"
        r = cli(*base, "--model", "other", "--signing-key", str(priv), str(tmp_path / "s0.safetensors"))
        outputs.append(r)
        # (refused at its first request: the head read; a commit would be refused with "may not publish")
        assert r.returncode == 1 and "'other'" in r.stderr and "token" in r.stderr, r.stdout + r.stderr

        out = tmp_path / "out.safetensors"
        sub = ["subscribe", "--from", relay.url, "--model", "policy", "--verify-key", str(pub), "--out", str(out),
               "--ca-file", str(ca), "--once", "--timeout", "60"]
        r = cli(*sub, "--read-token-file", str(tmp_path / "sub-token"))
        outputs.append(r)
        assert r.returncode == 0, r.stdout + r.stderr
        assert _same(read_state_file(out), states[1])

        # no read token: refused, nothing written
        r = cli(*[a if a != str(out) else str(tmp_path / "o2.safetensors") for a in sub], "--timeout", "8")
        outputs.append(r)
        assert r.returncode == 1 and "token" in r.stderr.lower(), r.stdout + r.stderr
        assert not (tmp_path / "o2.safetensors").exists()
        # a client trusting another CA: refused with a clear error
        wrong = [a if a != str(ca) else str(other_ca) for a in sub]
        wrong = [a if a != str(out) else str(tmp_path / "o3.safetensors") for a in wrong]
        r = cli(*wrong, "--read-token-file", str(tmp_path / "sub-token"), "--timeout", "8")
        outputs.append(r)
        assert r.returncode == 1 and "certificate" in r.stderr.lower(), r.stdout + r.stderr
        assert not (tmp_path / "o3.safetensors").exists()
    finally:
        relay.stop()
        origin.stop()
    # secrets never logged: not in any server log line (DEBUG level) nor in any command's output
    lines = origin.log_path.read_text(errors="replace").splitlines() + relay.log_path.read_text(errors="replace").splitlines()
    for r in outputs:
        lines += (r.stdout + r.stderr).splitlines()
    assert len(lines) > 10
    for secret in (PUBLISH_TOKEN, ORIGIN_READ_TOKEN, RELAY_READ_TOKEN):
        assert not [ln for ln in lines if secret in ln], secret
