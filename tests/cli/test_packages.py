"""The public packages: each imports cleanly in a fresh interpreter, everything in ``__all__`` exists,
and the server side never loads torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PACKAGES = ["deltasync", "deltasync.client", "deltasync.server", "deltasync.cli"]


def _fresh(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_cleanly_and_all_names_exist(package):
    got = _fresh(f"""
import importlib, json, warnings
warnings.simplefilter("error")  # an import that warns is not clean
pkg = importlib.import_module({package!r})
names = list(pkg.__all__)
missing = [n for n in names if not hasattr(pkg, n)]
star = {{}}
exec("from {package} import *", star)
print(json.dumps({{"names": names, "missing": missing, "star": sorted(k for k in star if k != "__builtins__")}}))
""")
    assert got["names"], f"{package} has an empty __all__"
    assert len(set(got["names"])) == len(got["names"]), "duplicate names in __all__"
    assert got["missing"] == []
    assert got["star"] == sorted(got["names"])


def test_server_and_manifest_code_never_load_torch():
    got = _fresh("""
import json, sys
import deltasync, deltasync.server, deltasync.server.app, deltasync.server.cli
from deltasync import HmacVerifier, Manifest, parse_manifest, write_atomic
from deltasync.server import *
import deltasync.deltafile, deltasync.signing, deltasync.atomic, deltasync.cli.run, deltasync.cli.keys, deltasync.keyfiles
print(json.dumps({"torch": "torch" in sys.modules, "client": any(m.startswith("deltasync.client") for m in sys.modules)}))
""")
    assert got == {"torch": False, "client": False}


def test_an_unknown_name_is_an_attribute_error():
    import deltasync

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        deltasync.nope  # noqa: B018
    assert "encode_delta" in dir(deltasync)


def test_every_package_folder_is_listed_for_the_wheel():
    """pyproject.toml lists packages by hand (server/, client/ and cli/ map under deltasync): a subpackage
    left off that list is missing from a built wheel, though an editable install still finds it."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "pyproject.toml").read_text()
    mapping = dict(re.findall(r'"([\w.]+)" = "(\w+)"', re.search(r"^package-dir = \{(.*)\}$", text, re.M).group(1)))
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1)))
    found = set()
    for name, folder in mapping.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            found.add(".".join((name, *rel.parts)))
    assert found - listed == set(), "package folders missing from pyproject.toml's packages"
    assert listed - found == set(), "pyproject.toml lists packages that have no folder"
