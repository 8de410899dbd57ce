"""The bucket-backed deployment variants (deploy/compose.bucket.yaml, deploy/k8s-bucket/) parse with
the real CLI and agree with each other: stateless origins (two, no persistent volume) on one
bucket, relays whose parents are origins or that bucket."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to check deploy/ (pip install pyyaml)")

from deltasync.server.storage.bucketlayout import is_bucket_url, parse_bucket_url  # noqa: E402
from test_deploy import DEPLOY, listen_port, parse_cli  # noqa: E402


def test_compose_bucket_variant():
    doc = yaml.safe_load((DEPLOY / "compose.bucket.yaml").read_text())
    services = doc["services"]
    parsed = {n: parse_cli(s["command"]) for n, s in services.items() if n not in ("minio", "make-bucket")}
    origins = [n for n, a in parsed.items() if a.command == "origin"]
    assert len(origins) == 2, "two stateless origins share the bucket"
    stores = {parsed[n].store for n in origins}
    assert len(stores) == 1 and is_bucket_url(stores.pop()), "both origins on the same bucket"
    listening = {}
    for n in origins:
        assert "volumes" not in services[n], f"{n} must not need a volume"
        env = services[n]["environment"]
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env)
        assert urlparse(parsed[n].s3_endpoint).hostname == "minio"
        listening[n] = listen_port(parsed[n])
        assert env["DELTASYNC_PORT"] == str(listening[n])
    relays = [n for n, a in parsed.items() if a.command == "relay"]
    assert relays
    for n in relays:
        buckets = [p for p in parsed[n].parent if is_bucket_url(p)]
        assert buckets == [parsed[origins[0]].store], f"{n}: the bucket is its fallback parent"
        assert parsed[n].parent[-1] == buckets[0], f"{n}: the bucket comes after the origins"
        for url in parsed[n].parent[:-1]:
            u = urlparse(url)
            assert u.hostname in listening and u.port == listening[u.hostname], url
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(services[n]["environment"])
    for n, s in services.items():
        for secret in s.get("secrets", []):
            assert secret in doc["secrets"]
        for vol in s.get("volumes", []):
            assert vol.split(":")[0] in doc["volumes"]


def _docs(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d and d.get("kind") != "Kustomization"]
    return out


def test_kubernetes_bucket_variant():
    folder = DEPLOY / "k8s-bucket"
    docs = _docs(folder)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not any(k == "PersistentVolumeClaim" for k, _ in kinds), "no volume for the origins"
    (origin,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "deltasync-origin"]
    assert origin["spec"]["replicas"] == 2
    pod = origin["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = parse_cli(c["args"])
    assert args.command == "origin" and is_bucket_url(args.store)
    parse_bucket_url(args.store)
    assert all("persistentVolumeClaim" not in v for v in pod["volumes"])
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert any(str(args.s3_scratch).startswith(m) for m in mounts), "scratch dir on the emptyDir"
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    for w in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
        (cc,) = w["spec"]["template"]["spec"]["containers"]
        for ref in cc.get("envFrom", []):
            assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secrets[ref["secretRef"]["name"]]["stringData"])
        a = parse_cli(cc["args"])
        port = listen_port(a)
        assert [p["containerPort"] for p in cc["ports"]] == [port]
        if a.command == "relay":
            assert a.parent[-1] == args.store, "relays fall back to the origins' bucket"
            assert cc["envFrom"], "a relay reading the bucket needs its credentials"
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert "deltasync-origin" in services
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert all((folder / r).exists() for r in kust["resources"])
