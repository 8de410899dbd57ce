"""The README's offline Quickstart, run literally (issue 24): its ``sh`` block is read out of README.md and run
by bash, line after line, in a folder holding the files it names: ``step1``/``step2`` checkpoints of an AdamW
trace, and ``d1``..``d3``, three ``deltasync diff`` files of consecutive states made as a new user makes them
(plain ``deltasync diff A B -o dK.dsd``, no version flags), from checkpoint names with numbers and without.
Before the fix every such diff was v0 -> v1 and ``squash d1.dsd d2.dsd d3.dsd`` failed ("chain breaks").
Also: how ``diff`` numbers versions (metadata, names, flags) and the errors that name the flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync.deltafile import read_delta_file
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

README = Path(__file__).resolve().parents[2] / "README.md"
BIN = str(Path(sys.executable).parent)  # the venv's bin: the `deltasync` command of this install
CLI = [sys.executable, "-m", "deltasync.cli.main"]


def quickstart_lines() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "README's Quickstart has no sh block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def run(*args: str, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=180)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


@pytest.fixture(scope="module")
def states() -> list[dict[str, torch.Tensor]]:
    tr = RLTrace(ModelShape(vocab=256, hidden=32, layers=2, ffn=96), lr=2e-5, seed=24)
    return [tr.step() for _ in range(4)]


@pytest.mark.parametrize("numbered", [True, False], ids=["numbered-names", "names-without-numbers"])
def test_the_readme_quickstart_runs_as_written(states, tmp_path, numbered):
    words = ["alpha", "bravo", "charlie", "delta"]
    files = [f"ckpt-{i}.safetensors" if numbered else f"ckpt-{words[i]}.safetensors" for i in range(4)]
    for name, s in zip(files, states):
        write_state_file(tmp_path / name, s)
    write_state_file(tmp_path / "step1.safetensors", states[1])
    write_state_file(tmp_path / "step2.safetensors", states[2])
    for k in (1, 2, 3):  # what a user ran to get the files the Quickstart squashes: no flags
        run("diff", files[k - 1], files[k], "-o", f"d{k}.dsd", "--quiet", cwd=tmp_path)
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    lines = quickstart_lines()
    assert any(line.startswith("deltasync squash d1.dsd d2.dsd d3.dsd") for line in lines)
    outputs = []
    for line in lines:
        p = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"README line failed: {line}\n{p.stderr[-2000:]}"
        outputs.append(p.stdout)
    m = read_delta_file(tmp_path / "step2.dsd").manifest
    assert (m.parent, m.version) == (1, 2)  # "is this exactly v2?"
    verify_out = outputs[next(i for i, line in enumerate(lines) if line.startswith("deltasync verify"))]
    assert "OK" in verify_out and "v2" in verify_out
    assert same(read_state_file(tmp_path / "out.safetensors"), states[2])
    sq = read_delta_file(tmp_path / "d1-3.dsd").manifest
    assert (sq.parent, sq.version) == (0, 3)
    squash_out = outputs[next(i for i, line in enumerate(lines) if line.startswith("deltasync squash"))]
    assert ("renumbered" in squash_out) != numbered  # files numbered on their own are renumbered, and say so
    run("replay", files[0], "d1-3.dsd", "-o", "sq.safetensors", "--quiet", cwd=tmp_path)
    assert same(read_state_file(tmp_path / "sq.safetensors"), states[3])
    run("replay", files[0], "d1.dsd", "d2.dsd", "d3.dsd", "-o", "chain.safetensors", "--quiet", cwd=tmp_path)
    assert same(read_state_file(tmp_path / "chain.safetensors"), states[3])


def test_diff_numbers_from_file_metadata_then_flags(states, tmp_path):
    meta = {"deltasync.model": "policy", "deltasync.version": "17"}
    write_state_file(tmp_path / "live.safetensors", states[0], meta)  # what `subscribe --out` keeps
    write_state_file(tmp_path / "next.safetensors", states[1])
    run("diff", "live.safetensors", "next.safetensors", "-o", "m.dsd", "--quiet", cwd=tmp_path)
    m = read_delta_file(tmp_path / "m.dsd").manifest
    assert (m.model, m.parent, m.version) == ("policy", 17, 18)
    run("diff", "live.safetensors", "next.safetensors", "-o", "f.dsd", "--version", "20", "--model", "x",
        "--quiet", cwd=tmp_path)
    m = read_delta_file(tmp_path / "f.dsd").manifest
    assert (m.model, m.parent, m.version) == ("x", 17, 20)
    write_state_file(tmp_path / "step9.safetensors", states[0])
    write_state_file(tmp_path / "step3.safetensors", states[1])
    run("diff", "step9.safetensors", "step3.safetensors", "-o", "b.dsd", "--quiet", cwd=tmp_path)  # names go back
    m = read_delta_file(tmp_path / "b.dsd").manifest
    assert (m.parent, m.version) == (0, 1)
    p = run("diff", "step9.safetensors", "step3.safetensors", "-o", "e.dsd", "--parent", "4", "--version", "4",
            cwd=tmp_path, ok=False)
    assert p.returncode == 1 and "--parent P" in p.stderr and "--version V" in p.stderr
    assert not (tmp_path / "e.dsd").exists()


def test_a_chain_that_does_not_connect_is_refused_naming_files_and_flags(states, tmp_path):
    for i, s in enumerate(states):
        write_state_file(tmp_path / f"s{i}.safetensors", s)
    for k in (1, 2, 3):
        run("diff", f"s{k - 1}.safetensors", f"s{k}.safetensors", "-o", f"d{k}.dsd", "--quiet", cwd=tmp_path)
    p = run("squash", "d1.dsd", "d3.dsd", "-o", "x.dsd", cwd=tmp_path, ok=False)
    assert p.returncode == 1 and "chain breaks: d3.dsd" in p.stderr and "d1.dsd" in p.stderr
    assert "--parent P --version V" in p.stderr and "Traceback" not in p.stderr and not (tmp_path / "x.dsd").exists()
    p = run("squash", "d2.dsd", "d1.dsd", "-o", "x.dsd", cwd=tmp_path, ok=False)
    assert p.returncode == 1 and "wrong order" in p.stderr
