"""Every deployment file parses, and its commands and ports agree with the CLI and with each other."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to check deploy/ (pip install pyyaml)")

from deltasync.cli.main import build_parser  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROOT = DEPLOY.parent


def parse_cli(argv: list[str]):
    """The real CLI parses the command (argparse exits on any unknown flag or bad value)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:  # pragma: no cover - the failure message is the point
        raise AssertionError(f"deltasync {' '.join(argv)!r} does not parse (exit {e.code})") from None


def listen_port(args) -> int:
    return args.listen[1]


# -- compose ---------------------------------------------------------------------------------------------

def test_compose_commands_ports_and_links():
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert {"origin", "relay-eu", "relay-us", "subscriber"} <= set(services)
    listening: dict[str, int] = {}
    parsed = {}
    for name, svc in services.items():
        args = parse_cli(svc["command"])
        parsed[name] = args
        if args.command in ("origin", "relay"):
            port = listen_port(args)
            listening[name] = port
            assert any(str(p).endswith(f":{port}") for p in svc.get("ports", [])), f"{name} does not publish {port}"
            assert svc["environment"]["DELTASYNC_PORT"] == str(port), f"{name}: health check port"
        for path in [a for a in vars(args).values() if isinstance(a, Path)]:
            if str(path).startswith("/run/secrets/"):
                assert path.name in svc["secrets"], f"{name} reads {path} but does not mount the secret"
        for secret in svc.get("secrets", []):
            assert secret in doc["secrets"]
        for vol in svc.get("volumes", []):
            assert vol.split(":")[0] in doc["volumes"]
    assert parsed["origin"].command == "origin" and parsed["subscriber"].command == "subscribe"
    assert parsed["relay-eu"].command == parsed["relay-us"].command == "relay"
    urls = [u for n in ("relay-eu", "relay-us") for u in parsed[n].parent] + parsed["subscriber"].sources
    for url in urls:
        u = urlparse(url)
        assert u.hostname in listening and u.port == listening[u.hostname], f"{url} names no listening service"
    assert (DEPLOY / "Dockerfile").exists() and services["origin"]["build"]["dockerfile"] == "deploy/Dockerfile"


# -- kubernetes --------------------------------------------------------------------------------------------

def _k8s_docs() -> list[dict]:
    docs = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d and d.get("kind") != "Kustomization":
                d["__file__"] = f.name
                docs.append(d)
    return docs


def test_kubernetes_manifests_agree_with_the_cli_and_each_other():
    docs = _k8s_docs()
    kinds = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert ("Deployment", "deltasync-origin") in kinds and ("PersistentVolumeClaim", "deltasync-origin-store") in kinds
    assert ("StatefulSet", "deltasync-relay-eu") in kinds and ("StatefulSet", "deltasync-relay-us") in kinds
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    pvcs = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    parents: list[str] = []
    for w in workloads:
        name = w["metadata"]["name"]
        assert w["metadata"]["namespace"] == "deltasync"
        pod = w["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in w["spec"]["selector"]["matchLabels"].items())
        (c,) = pod["spec"]["containers"]
        args = parse_cli(c["args"])
        port = listen_port(args)
        assert [p["containerPort"] for p in c["ports"]] == [port], name
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": port}, f"{name} {probe}"
        ann = pod["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(port)
        assert ann["prometheus.io/path"] == "/metrics"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for vname in mounts:
            assert vname in volumes or vname in claims, f"{name} mounts undeclared volume {vname}"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs
            if "secret" in v:
                sec = secrets[v["secret"]["secretName"]]
                for item in v["secret"].get("items", []):
                    assert item["key"] in sec["stringData"]
        data_dirs = [getattr(args, a) for a in ("store", "cache") if getattr(args, a, None) is not None]
        assert all(any(str(d).startswith(mp) for mp in mounts.values()) for d in data_dirs), f"{name}: data dir not on a volume"
        for f in ("token_file", "key_file"):
            if getattr(args, f, None) is not None:
                assert any(str(getattr(args, f)).startswith(mp) for mp in mounts.values())
        if w["kind"] == "StatefulSet":
            assert w["spec"]["serviceName"] in services and services[w["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
            assert "cache" in claims
            assert args.command == "relay"
            parents += args.parent
        else:
            assert args.command == "origin" and w["spec"]["replicas"] == 1
            assert w["spec"]["strategy"]["type"] == "Recreate"
        # every Service selecting these pods targets the listening port
        for svc in services.values():
            sel = svc["spec"]["selector"]
            if all(labels.get(k) == v for k, v in sel.items()):
                assert all(p["targetPort"] == port for p in svc["spec"]["ports"]), svc["metadata"]["name"]
    for url in parents:
        u = urlparse(url)
        host = u.hostname.split(".")[0]
        assert host in services and any(p["port"] == u.port for p in services[host]["spec"]["ports"]), url
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (DEPLOY / "k8s" / res).exists()


# -- systemd ------------------------------------------------------------------------------------------------

def _unit(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        k, _, v = line.partition("=")
        out.setdefault(k, []).append(v)
    return out


def _expand(cmd: str, unit: dict[str, list[str]], instance: str) -> list[str]:
    env = {}
    for e in unit.get("Environment", []):
        k, _, v = e.partition("=")
        env[k] = v
    cmd = cmd.replace("%i", instance)
    words = []
    for w in shlex.split(cmd):
        m = re.fullmatch(r"\$(\w+)", w)  # $VAR: split on whitespace (systemd semantics)
        if m:
            words += env[m.group(1)].replace("%i", instance).split()
        else:
            words.append(re.sub(r"\$\{(\w+)\}", lambda mm: env[mm.group(1)], w))
    return words


@pytest.mark.parametrize("unit_file", sorted(p.name for p in (DEPLOY / "systemd").glob("*.service")))
def test_systemd_units_run_commands_the_cli_accepts(unit_file):
    unit = _unit(DEPLOY / "systemd" / unit_file)
    (exec_start,) = unit["ExecStart"]
    argv = _expand(exec_start, unit, "eu")
    assert argv[0].endswith("/bin/deltasync")
    args = parse_cli(argv[1:])
    expected = {"deltasync-origin.service": "origin", "deltasync-relay@.service": "relay",
                "deltasync-sidecar.service": "sidecar", "deltasync-subscribe@.service": "subscribe"}[unit_file]
    assert args.command == expected
    if expected in ("origin", "relay"):
        assert listen_port(args) == {"origin": 8700, "relay": 8701}[expected]
    assert unit["User"] == ["deltasync"] and unit["Restart"]


# -- the image ------------------------------------------------------------------------------------------------

def test_dockerfile_copies_what_exists_and_runs_the_cli():
    text = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.M):
        for part in src.split():
            assert (ROOT / part).exists() or part == "README.md", f"Dockerfile copies missing {part}"
    assert re.search(r'^ENTRYPOINT \["deltasync"\]$', text, flags=re.M)
    assert set(re.findall(r"^EXPOSE (.+)$", text, flags=re.M)[0].split()) == {"8700", "8701"}
    assert 'deltasync = "deltasync.cli.main:main"' in (ROOT / "pyproject.toml").read_text()
    assert (DEPLOY / "README.md").exists()
