"""``deltasync diff --coding`` (issue 24): the same choices and default as ``publish --coding``; a base-conditioned
delta file records its coding (manifest meta, blob format 3), replays bit for bit and is smaller on an AdamW
step; ``squash`` refuses it saying why. Real safetensors files, the real CLI in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync.blob import BlobReader
from deltasync.cli.main import build_parser
from deltasync.deltafile import read_delta_file
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

CLI = [sys.executable, "-m", "deltasync.cli.main"]


def run(*args: str, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=180)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def _coding_action(command: str):
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command")
    return next(a for a in sub.choices[command]._actions if "--coding" in a.option_strings)


def test_diff_offers_the_coding_choices_and_default_of_publish():
    d, p = _coding_action("diff"), _coding_action("publish")
    assert tuple(d.choices) == tuple(p.choices) == ("base-free", "base-conditioned")
    assert d.default == p.default == "base-free"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("coding")
    tr = RLTrace(ModelShape(vocab=512, hidden=64, layers=2, ffn=192), lr=2e-5, seed=5)
    tr.step()
    write_state_file(d / "s1.safetensors", tr.step())
    write_state_file(d / "s2.safetensors", tr.step())
    return d


def test_a_base_conditioned_diff_records_its_coding_and_replays_bit_for_bit(pair):
    d = pair
    free = run("diff", "s1.safetensors", "s2.safetensors", "-o", "free.dsd", cwd=d)
    cond = run("diff", "s1.safetensors", "s2.safetensors", "-o", "cond.dsd", "--coding", "base-conditioned", cwd=d)
    assert "base-free coding" in free.stdout and "base-conditioned coding" in cond.stdout
    f, c = read_delta_file(d / "free.dsd"), read_delta_file(d / "cond.dsd")
    assert f.manifest.coding == "base-free" and c.manifest.coding == "base-conditioned"
    assert {BlobReader(b).version for b in f.blobs.values()} == {4}
    assert {BlobReader(b).version for b in c.blobs.values()} == {3}
    assert c.manifest.state_fp == f.manifest.state_fp and c.manifest.changed_words == f.manifest.changed_words
    size_free, size_cond = (d / "free.dsd").stat().st_size, (d / "cond.dsd").stat().st_size
    print(f"AdamW step: base-free {size_free:,} bytes, base-conditioned {size_cond:,} bytes")
    assert size_cond < size_free
    info = json.loads(run("inspect", "cond.dsd", "--json", cwd=d).stdout)
    assert info["coding"] == "base-conditioned"
    assert "base-conditioned coding" in run("inspect", "cond.dsd", cwd=d).stdout
    run("replay", "s1.safetensors", "cond.dsd", "-o", "out.safetensors", "--verify", "full", cwd=d)
    got, want = read_state_file(d / "out.safetensors"), read_state_file(d / "s2.safetensors")
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), n
    run("verify", "out.safetensors", "cond.dsd", cwd=d)
    r = run("squash", "cond.dsd", "-o", "sq.dsd", cwd=d, ok=False)
    assert r.returncode != 0 and "base-conditioned coding" in r.stderr and not (d / "sq.dsd").exists()


def test_blob_format_2_for_a_fleet_not_yet_on_format_4(pair):
    """``--blob-format 2`` (publish, sidecar, diff: one option): base-free blobs under JSON records, what readers
    before blob format 4 read; the delta replays bit for bit and squashes; inspect counts the same chunks as the
    default format 4's; the base-conditioned coding stays format 3 whatever is asked."""
    d = pair
    for command in ("diff", "publish", "sidecar"):
        a = next(x for x in build_parser(command)._actions if x.dest == "command").choices[command]
        opt = next(x for x in a._actions if "--blob-format" in x.option_strings)
        assert tuple(opt.choices) == (4, 2) and opt.default == 4, command
    run("diff", "s1.safetensors", "s2.safetensors", "-o", "v2.dsd", "--blob-format", "2", cwd=d)
    run("diff", "s1.safetensors", "s2.safetensors", "-o", "v4.dsd", cwd=d)
    run("diff", "s1.safetensors", "s2.safetensors", "-o", "c.dsd", "--blob-format", "2", "--coding", "base-conditioned",
        cwd=d)
    v2, v4 = read_delta_file(d / "v2.dsd"), read_delta_file(d / "v4.dsd")
    assert {BlobReader(b).version for b in v2.blobs.values()} == {2}
    assert {BlobReader(b).version for b in v4.blobs.values()} == {4}
    assert {BlobReader(b).version for b in read_delta_file(d / "c.dsd").blobs.values()} == {3}
    assert [BlobReader(b).chunks for b in v2.blobs.values()] == [BlobReader(b).chunks for b in v4.blobs.values()]
    assert (d / "v4.dsd").stat().st_size <= (d / "v2.dsd").stat().st_size
    i2, i4 = (json.loads(run("inspect", f, "--json", cwd=d).stdout) for f in ("v2.dsd", "v4.dsd"))
    assert [t["encoding"] for t in i2["tensors"]] == [t["encoding"] for t in i4["tensors"]]
    run("replay", "s1.safetensors", "v2.dsd", "-o", "out2.safetensors", "--verify", "full", cwd=d)
    got, want = read_state_file(d / "out2.safetensors"), read_state_file(d / "s2.safetensors")
    assert all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
    run("squash", "v2.dsd", "-o", "sq2.dsd", cwd=d)
    assert {BlobReader(b).version for b in read_delta_file(d / "sq2.dsd").blobs.values()} == {2}  # the chain's newest
