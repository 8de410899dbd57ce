"""``deltasync publish`` from files without torch (issue 10): the CLI's parser and the file publish (the
first keyframe, a ``--base`` delta, a side keyframe) never import torch, and what they commit is what
the in-process (torch) Publisher commits for the same pair: the same tensor records, fingerprints,
state fingerprints and changed words, and blobs that decode to the same state.

Real files, a real origin on 127.0.0.1, real CLI processes; torch is looked for in ``-X importtime``'s
list of every module the process imported."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import torch

from deltasync.apply import apply_delta
from deltasync.cli.cluster import LocalCluster
from deltasync.keyframe import load_keyframe
from deltasync.manifest import parse_manifest
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.client.http import HttpClient
from deltasync.client.publisher import Publisher

KEY = bytes(range(3, 35))


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16, fp32, int32, int64, uint8, a 0-d and an empty tensor; ~1-5% of each changed."""
    g = torch.Generator().manual_seed(7)
    s0 = {
        "w.bf16": (torch.randn(64, 300, generator=g) * 0.02).to(torch.bfloat16),
        "w.fp32": torch.randn(257, 33, generator=g),
        "i.int32": torch.randint(-1000, 1000, (999,), generator=g, dtype=torch.int32),
        "i.int64": torch.randint(-2**40, 2**40, (130,), generator=g, dtype=torch.int64),
        "b.uint8": torch.randint(0, 255, (77,), generator=g, dtype=torch.uint8),
        "scalar": torch.tensor(1.5, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    s1 = {n: t.clone() for n, t in s0.items()}
    for n, t in s1.items():
        flat = t.view(-1)
        if flat.numel() == 0:
            continue
        k = max(1, flat.numel() // 30)
        idx = torch.randint(0, flat.numel(), (k,), generator=g)
        if t.dtype.is_floating_point:
            flat[idx] = flat[idx] * 1.01 + 0.001
        else:
            flat[idx] = flat[idx] + 1
    s1["scalar"] = torch.tensor(2.5, dtype=torch.float32)
    return s0, s1


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        and bytes(a[n].contiguous().view(-1).view(torch.uint8).numpy()) == bytes(b[n].contiguous().view(-1).view(torch.uint8).numpy())
        for n in a)


# runs the real CLI entry point (as ``python -m deltasync.cli.main``), then reports at exit which modules are loaded
# (also when the command ends with os._exit, skipping the interpreter's teardown: cli/run.py ``exit_now``)
_RUN = ("import os, runpy, sys\n"
        "sys.argv = ['deltasync', *sys.argv[1:]]\n"
        "def _report():\n"
        "    print('LOADED ' + ' '.join(sorted(sys.modules)), file=sys.stderr, flush=True)\n"
        "_real_exit = os._exit\n"
        "def _exit(rc):\n"
        "    _report()\n"
        "    _real_exit(rc)\n"
        "os._exit = _exit\n"
        "try:\n"
        "    runpy.run_module('deltasync.cli.main', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    _report()\n")


def _loaded(stderr: str) -> set[str]:
    lines = [line for line in stderr.splitlines() if line.startswith("LOADED ")]
    assert len(lines) == 1, stderr[-2000:]
    return set(lines[0].split()[1:])


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=timeout)


def _no_torch(r: subprocess.CompletedProcess, *, ran: str = "deltasync.client.cli") -> set[str]:
    mods = _loaded(r.stderr)
    assert ran in mods  # the command's own module ran: the check is not vacuous
    bad = sorted(m for m in mods if m == "torch" or m.startswith("torch.") or m == "safetensors.torch")
    assert not bad, f"imported {bad[:5]}"
    return mods


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("lean"), key=KEY) as c:
        c.start_origin()
        yield c


def _fetch(cluster, model: str, version: int):
    async def go():
        async with HttpClient([cluster.origin]) as h:
            m = parse_manifest(await h.get_manifest(model, version), verifier=KEY)
            blobs = {b.id: await h.get_blob(b.id, b.size) for b in m.blobs}
            return m, blobs
    return asyncio.run(go())


def _records(m):
    return [(t.name, t.dtype, tuple(t.shape), t.fp_before, t.fp_after, t.changed) for t in m.tensors]


def test_help_of_every_command_needs_no_torch():
    for cmd in ("publish", "subscribe", "sidecar"):
        r = _cli(cmd, "--help")
        assert r.returncode == 0 and "usage: deltasync " + cmd in r.stdout, r.stderr[-2000:]
        assert "deltasync.server.cli" not in _no_torch(r)  # only the command's own group is loaded


def test_file_publish_is_torch_free_and_matches_the_in_process_publisher(cluster, tmp_path):
    s0, s1 = _states()
    p0, p1 = tmp_path / "s0.safetensors", tmp_path / "s1.safetensors"
    write_state_file(p0, s0)
    write_state_file(p1, s1)
    pub = ["publish", "--origin", cluster.origin, "--token-file", str(cluster.token_file), "--key-file",
           str(cluster.key_file)]

    # the torch-free CLI: the first keyframe, then a --base delta with a side keyframe
    r = _cli(*pub, "--model", "lean", str(p0))
    assert r.returncode == 0 and "published lean v0: keyframe" in r.stdout, r.stdout + r.stderr[-3000:]
    _no_torch(r, ran="deltasync.client.filepublish")
    r = _cli(*pub, "--model", "lean", "--base", str(p0), str(p1), "--keyframe")
    assert r.returncode == 0 and "published lean v1: delta" in r.stdout and "side keyframe" in r.stdout, \
        r.stdout + r.stderr[-3000:]
    _no_torch(r, ran="deltasync.client.filepublish")
    # a wrong base is refused (checked in the compare pass) and nothing is committed
    r = _cli(*pub, "--model", "lean", "--base", str(p0), str(p1))
    assert r.returncode == 1 and "state fingerprint" in r.stderr and "head lean v1" in r.stderr, r.stderr[-3000:]
    _no_torch(r)

    # the in-process Publisher (torch) on the same pair
    token = cluster.token_file.read_text().strip()
    p = Publisher(cluster.origin, "torch", token, KEY, keyframe_every=0)
    try:
        p.publish(0, s0).result(60)
        p.publish(1, s1, keyframe=True).result(60)
        p.flush(60)
    finally:
        p.close()

    async def head(model):
        async with HttpClient([cluster.origin]) as h:
            return (await h.get_head(model)).version
    assert asyncio.run(head("lean")) == 1  # the refused publish committed nothing
    lk, lkb = _fetch(cluster, "lean", 0)
    tk, _ = _fetch(cluster, "torch", 0)
    assert lk.kind == tk.kind == "keyframe"
    assert _records(lk) == _records(tk) and lk.state_fp == tk.state_fp and lk.changed_words == tk.changed_words
    ld, ldb = _fetch(cluster, "lean", 1)
    td, _ = _fetch(cluster, "torch", 1)
    assert ld.kind == td.kind == "delta"
    assert _records(ld) == _records(td)
    assert (ld.state_fp, ld.state_fp_before, ld.changed_words) == (td.state_fp, td.state_fp_before, td.changed_words)
    assert ld.changed_words > 0

    # the lean blobs decode to the states: keyframe v0 is s0, v0 + delta v1 is s1, side keyframe v1 is s1
    state, fps = load_keyframe(lk, lkb)
    assert _same(state, s0)
    target = {n: t.clone() for n, t in state.items()}
    apply_delta(target, ld, ldb, fps)
    assert _same(target, s1)
    sk, skb = _fetch(cluster, "lean.kf", 1)
    assert sk.state_fp == ld.state_fp
    assert _same(load_keyframe(sk, skb)[0], s1)
    assert _same(read_state_file(p1), s1)


def test_host_tensors_fingerprint_and_shard_as_torch_does(tmp_path):
    """The numpy paths: MappedTensorFile.host fingerprints equal the torch tensors'; a keyframe shard sent as
    pieces of the mapped file is byte for byte what shard_bytes builds, with the same id and digest."""
    from deltasync.blob import blob_id
    from deltasync.digest import blob_digest
    from deltasync.fingerprint import tensor_fingerprint
    from deltasync.tensorfile import MappedTensorFile, shard_bytes
    from deltasync.client.filepublish import shard_fingerprints, shard_pieces

    s0, _ = _states()
    s0["c.complex64"] = torch.randn(5, 3, dtype=torch.complex64)
    s0["f.fp16"] = torch.randn(33, dtype=torch.float16)
    s0["bool"] = torch.rand(17) > 0.5
    if hasattr(torch, "float8_e8m0fnu"):  # a dtype safetensors cannot name: a tagged U8 tensor in the header
        s0["f8.e8m0"] = torch.randint(0, 255, (6, 5), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    path = tmp_path / "s.safetensors"
    write_state_file(path, s0)
    with MappedTensorFile(path) as f:
        host = f.host
        assert all(isinstance(h.words, np.ndarray) for h in host.values())
        for n, t in s0.items():
            assert tensor_fingerprint(host[n]) == tensor_fingerprint(t), n
        fps: dict[str, int] = {}
        built = bytes(shard_bytes(s0, fps=fps))
        sp = shard_pieces(host, digest=True, slice_bytes=64)  # many slices per tensor
        joined = b"".join(bytes(p) for p in sp.pieces)
        assert joined == built and sp.size == len(built)
        assert sp.id == blob_id(built) and sp.digest == blob_digest(built)
        assert shard_fingerprints(host, slice_bytes=64) == fps == shard_fingerprints(host)  # summed apart
        whole = shard_pieces(host, digest=True)  # the default slices
        assert (whole.id, whole.digest, whole.size) == (sp.id, sp.digest, sp.size)


def test_lazy_parser_lists_the_same_commands_and_options():
    """``main`` registers only the group of the command it runs: that command's parser (its --help) is the
    one the full parser has, and the group table names every command the full parser has."""
    import argparse

    from deltasync.cli import main as cli_main

    def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices

    full = subparsers(cli_main.build_parser())
    assert sorted(full) == sorted(c for cmds in cli_main._GROUPS.values() for c in cmds)
    for cmd, parser in full.items():
        lazy = subparsers(cli_main.build_parser(cmd))
        assert cmd in lazy and set(lazy) <= set(full)
        assert lazy[cmd].format_help() == parser.format_help(), cmd
    assert cli_main._command_of(["--version"]) is None and cli_main._command_of(["publish", "--help"]) == "publish"
