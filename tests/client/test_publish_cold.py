"""A cold ``deltasync publish``: the kernels warmed on a thread at the command's start
(``deltasync.kernels.warm_up``: numba's runtime initialised; our kernels load their cached code without numba's
registries),
and with ``--base`` the compare pass started before the HTTP client is imported and the head is read.

The warm-up tests run in fresh interpreters (what is imported, and what numba concluded, is per process);
the CLI tests run real ``publish`` processes against a real origin on loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.tensorfile import MappedTensorFile, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

KEY = bytes(range(3, 35))
SHAPE = ModelShape(vocab=128, hidden=16, layers=1, ffn=32)


def _py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "DELTASYNC_KERNELS"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                       env={**e, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return r


#: what numba's ``target_context.refresh()`` imports (its registries) and a cached kernel's load does not need
_REGISTRIES = ("numba.np.arraymath", "numba.np.linalg", "numba.typed.typeddict", "numba.np.random.generator_core",
               "numba.np.polynomial", "numba.experimental.function_type", "scipy.linalg", "cffi")


def test_warm_up_and_cached_kernel_loads_leave_numbas_registries_unloaded():
    r = _py(f"""
        import sys
        import numpy as np
        from deltasync import kernels
        from deltasync.fingerprint import lanes_sum
        assert kernels.warm_up() == "numba"
        assert kernels.warm_up() == "numba"  # idempotent
        lanes = np.random.default_rng(5).integers(0, 1 << 16, 100_003, dtype=np.uint16)
        got = kernels.lanes_sum_np(lanes, 7)  # loaded from numba's cache
        print("registries", [m for m in {_REGISTRIES!r} if m in sys.modules])
        import torch
        kernels.select("reference")
        assert got == int(lanes_sum(torch.from_numpy(lanes.view(np.int16)), 7))  # bit for bit the reference
        kernels.select("numba")
        # numba still compiles other code as usual: its compiler fills every registry first
        import numba
        f = numba.njit(lambda a: np.cumsum(a)[-1] + len({{1: 2}}))
        assert f(np.ones(4)) == 5.0
        if __import__("importlib.util").util.find_spec("scipy"):  # and njit code using BLAS finds scipy
            g = numba.njit(lambda a: np.dot(a, a))
            assert g(np.ones(4)) == 4.0
        print("ok")
    """, DELTASYNC_KERNELS="")
    assert "registries []" in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("ok")


def test_a_kernel_missing_from_numbas_cache_is_compiled_as_before(tmp_path):
    """A cache lookup that misses (a fresh install, another CPU) falls through to numba's compiler."""
    r = _py("""
        import sys
        import numpy as np
        from deltasync import kernels
        kernels.warm_up()
        lanes = np.arange(1000, dtype=np.uint16)
        a = kernels.lanes_sum_np(lanes, 3)
        k = kernels.cpu_kernels()
        print("misses", sum(k.lanes_sum.stats.cache_misses.values()), "hits", sum(k.lanes_sum.stats.cache_hits.values()))
        kernels.select("reference")
        import torch
        from deltasync.fingerprint import lanes_sum
        assert a == int(lanes_sum(torch.from_numpy(lanes.view(np.int16)), 3))
        print("ok")
    """, NUMBA_CACHE_DIR=str(tmp_path / "empty-cache"), DELTASYNC_KERNELS="")
    assert "misses 1 hits 0" in r.stdout and r.stdout.rstrip().endswith("ok"), r.stdout


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
        side = ("publish-prefaulted",)  # the prefault thread's, at any point
        assert [w for _, w in stamps if w in side] == list(side), r.stderr
        stamps = [(t, w) for t, w in stamps if w not in side]
        assert [w for _, w in stamps] == ["publish-start", "publish-compare-started", "publish-head", "publish-compared",
                                          "publish-checked", "publish-encoded", "publish-digests", "publish-uploaded",
                                          "publish-committed"], r.stderr
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


def test_prefault_maps_the_pages_and_changes_nothing(tmp_path):
    import numpy as np

    from deltasync.tensorfile import MappedTensorFile

    path = tmp_path / "s.safetensors"
    write_state_file(path, RLTrace(SHAPE, lr=1e-4, seed=3).step())
    before = path.read_bytes()
    f = MappedTensorFile(path)
    words = {n: t.words.copy() for n, t in f.host.items()}
    assert f.prefault() is True  # Linux >= 5.14 (MADV_POPULATE_READ)
    assert all(np.array_equal(words[n], t.words) for n, t in f.host.items())
    f.close()
    assert f.prefault() is False  # a closed map: nothing to do
    assert path.read_bytes() == before


def test_a_keyframe_publish_loads_no_codec(tmp_path):
    """A keyframe needs the fingerprints' kernel, not the delta codec (its import, numba's with it, used to
    hold the first upload back ~0.2 s): ``publish`` of a keyframe imports neither ``deltasync.codec`` nor its
    entropy coders, and the state still arrives whole (the fingerprints, summed apart from the hashes, verify)."""
    trace = RLTrace(SHAPE, lr=1e-4, seed=12)
    path = tmp_path / "s0.safetensors"
    state = trace.step()
    write_state_file(path, state)
    with LocalCluster(tmp_path / "tree", key=KEY) as cluster:
        cluster.start_origin()
        r = _cli("publish", "--origin", cluster.origin, "--model", "kf", "--token-file", str(cluster.token_file),
                 "--key-file", str(cluster.key_file), str(path), env={"PYTHONPROFILEIMPORTTIME": "1"})
        assert r.returncode == 0 and "published kf v0: keyframe" in r.stdout, r.stdout + r.stderr[-2000:]
        imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
        assert "numba" in imported  # the fingerprints' kernel
        assert not {"deltasync.codec", "deltasync.entropy", "deltasync.conditioned"} & imported, sorted(
            m for m in imported if m.startswith("deltasync."))
        out = tmp_path / "sub.safetensors"
        r = _cli("subscribe", "--from", cluster.origin, "--model", "kf", "--key-file", str(cluster.key_file),
                 "--out", str(out), "--until", "0", "--quiet")
        assert r.returncode == 0, r.stdout + r.stderr
    with MappedTensorFile(out) as f:
        assert all(torch.equal(f.tensors[n].view(torch.uint8), t.view(torch.uint8)) for n, t in state.items())
