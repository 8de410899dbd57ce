"""``deltasync compile-kernels``: every kernel signature the commands use, compiled into numba's cache up front.

In an empty cache (``NUMBA_CACHE_DIR``) the command compiles; afterwards the CLI's real flows (a keyframe
published from a file, ``publish --base`` in both codings, ``subscribe --out`` following them, a late subscriber
whose relay squashes the chain, ``diff``) over tensors of several dtypes must find every kernel they call in the
cache: the cache's files are exactly as the command left them (numba writes a signature's machine code, and
rewrites the function's index, whenever a process compiles one). Before the command existed, a fresh clone's
first ``make demo`` compiled them in its trainer and subscribers (the trainer's first publish blocked 6.2 s,
subscribers 16 versions behind)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.tensorfile import read_state_file, write_state_file
from core_support import same_state

KEY = bytes(range(3, 35))
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32)


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    first = {}
    for dt in DTYPES:
        x = torch.randn(50_000, generator=g) * 0.02
        first[f"w_{str(dt)[6:]}"] = x.to(dt) if dt.is_floating_point else (x * 3000).to(dt)
    out = [first]
    for _ in range(n - 1):
        nxt = {}
        for name, t in out[-1].items():
            t = t.clone()
            words = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            idx = torch.randint(0, t.numel(), (t.numel() // 60,), generator=g)
            words[idx] += torch.randint(1, 3, (idx.numel(),), generator=g).to(words.dtype)
            nxt[name] = t
        out.append(nxt)
    return out


def _snapshot(cache: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(cache)): (p.stat().st_size, p.stat().st_mtime_ns) for p in cache.rglob("*") if p.is_file()}


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "deltasync.cli.main", *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"deltasync {args[0]}: {r.stdout}{r.stderr}"
    return r


# long: a cold compile of every kernel (~1 min on 2 cores); `make test-long` (which .ci/run also runs)
@pytest.mark.long
def test_after_compile_kernels_the_cli_flows_compile_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))  # every process below (servers and their squash workers too)
    monkeypatch.delenv("DELTASYNC_KERNELS", raising=False)
    r = _cli("compile-kernels")
    assert "[1/" in r.stdout and "compiled kernels ready for" in r.stdout and str(cache) in r.stdout, r.stdout
    compiled = _snapshot(cache)
    assert sum(name.endswith(".nbc") for name in compiled) > 30, sorted(compiled)

    states = _states(4)
    files = []
    for i, s in enumerate(states):
        files.append(tmp_path / f"s{i}.safetensors")
        write_state_file(files[-1], s)
    with LocalCluster(tmp_path / "servers", key=KEY) as c:
        c.start_tree({"relay": ["origin"]})
        key = str(c.key_file)
        pub = ["publish", "--origin", c.origin, "--model", "pc", "--token-file", str(c.token_file), "--key-file", key,
               "--quiet"]
        out, late = tmp_path / "out.safetensors", tmp_path / "late.safetensors"
        follow = subprocess.Popen([sys.executable, "-m", "deltasync.cli.main", "subscribe", "--from", c.url("relay"),
                                   "--model", "pc", "--key-file", key, "--out", str(out), "--until", "3", "--quiet"])
        try:
            _cli(*pub, str(files[0]))  # a keyframe, from the file
            deadline = time.monotonic() + 120
            while not out.exists():  # the follower holds v0 before the deltas come
                assert follow.poll() is None, "subscribe --out ended early"
                assert time.monotonic() < deadline, "subscribe --out never wrote v0"
                time.sleep(0.1)
            _cli(*pub, "--base", str(files[0]), str(files[1]))
            _cli(*pub, "--base", str(files[1]), str(files[2]))
            _cli(*pub, "--coding", "base-conditioned", "--base", str(files[2]), str(files[3]))
            assert follow.wait(120) == 0
        finally:
            if follow.poll() is None:
                follow.kill()
        # a late subscriber: the relay squashes v1..v2 (base-free) for it
        _cli("subscribe", "--from", c.url("relay"), "--model", "pc", "--key-file", key, "--out", str(late),
             "--until", "3", "--quiet")
    _cli("diff", str(files[0]), str(files[1]), "-o", str(tmp_path / "d.delta"), "--quiet")
    assert same_state(read_state_file(out), states[3]) and same_state(read_state_file(late), states[3])
    after = _snapshot(cache)
    changed = sorted(k for k in after if compiled.get(k) != after[k])
    assert not changed, f"compiled after compile-kernels (a signature it does not run): {changed}"


def test_the_cache_dirs_are_where_numba_writes(tmp_path, monkeypatch):
    from deltasync import kernels
    from deltasync.precompile import cache_dirs

    if kernels.cpu_kernels() is None:
        pytest.skip("the reference kernels are selected")
    dirs = cache_dirs()
    assert len(dirs) == 2 and all(Path(d).is_dir() for d in dirs), dirs  # kernels/ and the codec's modules


def test_compile_kernels_without_a_writeable_cache_says_what_to_set(monkeypatch, capsys):
    """numba compiles in memory where it cannot write a cache: the command would then keep nothing, so it
    refuses, naming NUMBA_CACHE_DIR, before compiling anything."""
    import argparse

    import deltasync.precompile as precompile
    from deltasync import kernels
    from deltasync.cli.offline import cmd_compile_kernels

    if kernels.cpu_kernels() is None:
        pytest.skip("the reference kernels are selected")
    monkeypatch.setattr(precompile, "cache_dirs", lambda: [])
    monkeypatch.setattr(precompile, "compile_kernels", lambda report=None: pytest.fail("compiled anyway"))
    assert cmd_compile_kernels(argparse.Namespace(quiet=False)) == 1
    err = capsys.readouterr().err
    assert "no writeable cache directory" in err and "NUMBA_CACHE_DIR" in err
