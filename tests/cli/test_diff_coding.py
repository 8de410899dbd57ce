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
