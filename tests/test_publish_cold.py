"""A cold ``deltasync publish``: the kernels warmed on a thread at the command's start
(``deltasync.kernels.warm_up``: numba's registries loaded with ``scipy.linalg`` and ``cffi`` hidden from it),
and with ``--base`` the compare pass started before the HTTP client is imported and the head is read.

The warm-up tests run in fresh interpreters (what is imported, and what numba concluded, is per process);
the CLI tests run real ``publish`` processes against a real origin on loopback."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

from deltasync.cli.cluster import LocalCluster
from deltasync.tensorfile import write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

HAVE_SCIPY = importlib.util.find_spec("scipy") is not None
HAVE_CFFI = importlib.util.find_spec("cffi") is not None
KEY = bytes(range(3, 35))
SHAPE = ModelShape(vocab=128, hidden=16, layers=1, ffn=32)


def _py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "DELTASYNC_KERNELS"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                       env={**e, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_warm_up_hides_scipy_linalg_and_cffi_from_numba_only_while_it_loads():
    r = _py("""
        import sys
        import numpy as np
        from deltasync import kernels
        from deltasync.fingerprint import lanes_sum
        import torch
        assert "scipy.linalg" not in sys.modules and "cffi" not in sys.modules
        assert kernels.warm_up() == "numba"
        assert kernels.warm_up() == "numba"  # idempotent
        print("hidden-after", "scipy.linalg" in sys.modules, "cffi" in sys.modules)
        assert not any(type(f).__name__ == "_HiddenModules" for f in sys.meta_path)
        import numba.np.arraymath as am
        from numba.core.typing import cffi_utils
        print("numba-saw", am._HAVE_BLAS, cffi_utils.SUPPORTED)
        # the kernels work, bit for bit the reference
        lanes = np.random.default_rng(5).integers(0, 1 << 16, 100_003, dtype=np.uint16)
        got = kernels.lanes_sum_np(lanes, 7)
        kernels.select("reference")
        assert got == int(lanes_sum(torch.from_numpy(lanes.view(np.int16)), 7))
        kernels.select("numba")
        if __import__("importlib.util").util.find_spec("scipy"):  # scipy itself still imports and works
            import scipy.linalg
            assert abs(scipy.linalg.norm([3.0, 4.0]) - 5.0) < 1e-12
            import numba  # and njit code using BLAS still compiles (numba checks for scipy again)
            f = numba.njit(lambda a: np.dot(a, a))
            assert f(np.ones(4)) == 4.0
        if __import__("importlib.util").util.find_spec("cffi"):
            import cffi
            cffi.FFI()
        print("ok")
    """, DELTASYNC_KERNELS="")
    assert "hidden-after False False" in r.stdout, r.stdout
    # what numba concluded while they were hidden (only meaningful where they are installed)
    blas, cffi_ok = re.search(r"numba-saw (\w+) (\w+)", r.stdout).groups()
    assert blas == "False" and cffi_ok == "False"
    assert r.stdout.rstrip().endswith("ok")


@pytest.mark.skipif(not HAVE_SCIPY, reason="scipy is not installed here")
def test_warm_up_leaves_an_already_imported_scipy_linalg_alone():
    r = _py("""
        import scipy.linalg
        from deltasync import kernels
        kernels.warm_up()
        import numba.np.arraymath as am
        print("blas", am._HAVE_BLAS)
    """)
    assert "blas True" in r.stdout, r.stdout


def test_warm_up_with_the_reference_selection_imports_no_numba():
    r = _py("""
        import sys
        from deltasync import kernels
        kernels.select("reference")
        assert kernels.warm_up() == "reference"
        print("numba", "numba" in sys.modules)
    """)
    assert "numba False" in r.stdout, r.stdout


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_publish_base_compared_early_keeps_its_answers(tmp_path):
    """The compare pass now starts before the head is read: a missing --base is still ignored while the
    origin is empty and an error once it has a head; the delta's stamps come in the critical path's order."""
    trace = RLTrace(SHAPE, lr=1e-4, seed=11)
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"s{i}.safetensors"))
        write_state_file(paths[-1], trace.step())
    missing = str(tmp_path / "nope.safetensors")
    with LocalCluster(tmp_path / "tree", key=KEY) as cluster:
        cluster.start_origin()
        pub = ["publish", "--origin", cluster.origin, "--model", "cold", "--token-file", str(cluster.token_file),
               "--key-file", str(cluster.key_file)]
        r = _cli(*pub, "--base", missing, paths[0])
        assert r.returncode == 0 and "published cold v0: keyframe" in r.stdout, r.stdout + r.stderr
        assert "--base is not used" in r.stdout
        r = _cli(*pub, "--base", missing, paths[1])
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stderr.startswith("deltasync publish: error: ") and "nope.safetensors" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        r = _cli(*pub, "--quiet", "--base", paths[0], paths[1], env={"DELTASYNC_TIMELINE": "1"})
        assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
        stamps = re.findall(r"mono=(\d+\.\d+) (publish-[a-z-]+)", r.stderr)
        assert [w for _, w in stamps] == ["publish-start", "publish-compare-started", "publish-head", "publish-compared",
                                          "publish-encoded", "publish-uploaded", "publish-committed"], r.stderr
        times = [float(t) for t, _ in stamps]
        assert times == sorted(times)
        # a base that is not the head: refused after the compare, nothing committed
        r = _cli(*pub, "--base", paths[0], paths[2])
        assert r.returncode == 1 and "state fingerprint" in r.stderr and "head cold v1" in r.stderr, r.stderr
        r = _cli(*pub, "--base", paths[1], paths[2])
        assert r.returncode == 0 and "published cold v2: delta" in r.stdout, r.stdout + r.stderr


def test_http_client_for_plain_urls_skips_only_aiohttps_default_ca_loading():
    r = _py("""
        import ssl, sys
        from deltasync.client import cli
        before = {n: n in ssl.SSLContext.__dict__ for n in ("load_default_certs", "set_default_verify_paths")}
        H = cli._http_client_for(["http://127.0.0.1:9"])
        import aiohttp.connector as c
        from deltasync.client.http import HttpClient
        assert H is HttpClient
        after = {n: n in ssl.SSLContext.__dict__ for n in ("load_default_certs", "set_default_verify_paths")}
        assert before == after, (before, after)  # put back as it was
        ctx = ssl.create_default_context()  # contexts made later load the store as usual
        print("aiohttp", c._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"], "later",
              ctx.cert_store_stats()["x509_ca"], "plain", ssl.create_default_context().cert_store_stats()["x509_ca"])
    """)
    aio, later, plain = map(int, re.search(r"aiohttp (\d+) later (\d+) plain (\d+)", r.stdout).groups())
    assert aio == 0 and later == plain
    r = _py("""
        from deltasync.client import cli
        import ssl
        cli._http_client_for(["http://127.0.0.1:9", "https://example.invalid"])
        import aiohttp.connector as c
        print("aiohttp", c._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"],
              "plain", ssl.create_default_context().cert_store_stats()["x509_ca"])
    """)
    aio, plain = map(int, re.search(r"aiohttp (\d+) plain (\d+)", r.stdout).groups())
    assert aio == plain  # an https URL: aiohttp's defaults trust the system store, as without this function
