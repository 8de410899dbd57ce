"""The offline CLI through real subprocesses on real safetensors files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

CLI = [sys.executable, "-m", "deltasync.cli.main"]


def run(*args: str, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chain")
    tr = RLTrace(ModelShape(vocab=512, hidden=64, layers=2, ffn=192), lr=2e-5, seed=3)
    for i in range(4):
        state = tr.step()
        state["extra.int_counter"] = torch.tensor([i, 7, -1], dtype=torch.int64)  # a non-float tensor too
        write_state_file(d / f"s{i}.safetensors", state)
    for i in range(1, 4):
        run("diff", f"s{i-1}.safetensors", f"s{i}.safetensors", "-o", f"d{i}.dsd", "--parent", str(i - 1), "--quiet", cwd=d)
    return d


def test_diff_prints_summary(chain: Path) -> None:
    p = run("diff", "s0.safetensors", "s1.safetensors", "-o", "again.dsd", cwd=chain)
    assert "tensors" in p.stdout and "ratio" in p.stdout and "changed" in p.stdout
    assert (chain / "again.dsd").read_bytes() == (chain / "d1.dsd").read_bytes()  # deterministic


def test_replay_chain_is_bit_exact(chain: Path) -> None:
    run("replay", "s0.safetensors", "d1.dsd", "d2.dsd", "d3.dsd", "-o", "out.safetensors", "--quiet", cwd=chain)
    assert same_bytes(read_state_file(chain / "out.safetensors"), read_state_file(chain / "s3.safetensors"))


@pytest.mark.parametrize("deltas,needle", [
    (["d1.dsd", "d3.dsd"], "gap"),              # a gap in the chain
    (["d2.dsd"], "not the delta's base"),       # wrong base
    (["d1.dsd", "d1.dsd"], "gap"),              # applying twice
])
def test_replay_refuses_and_writes_nothing(chain: Path, deltas, needle) -> None:
    out = chain / "bad.safetensors"
    p = run("replay", "s0.safetensors", *deltas, "-o", out.name, cwd=chain, ok=False)
    assert p.returncode == 1
    assert needle in p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists()


def test_replay_refuses_corrupt_delta(chain: Path) -> None:
    data = bytearray((chain / "d2.dsd").read_bytes())
    data[-10] ^= 0x40
    (chain / "corrupt.dsd").write_bytes(bytes(data))
    p = run("replay", "s0.safetensors", "d1.dsd", "corrupt.dsd", "-o", "c.safetensors", cwd=chain, ok=False)
    assert p.returncode == 1 and "corrupt" in p.stderr and "Traceback" not in p.stderr
    assert not (chain / "c.safetensors").exists()
    (chain / "trunc.dsd").write_bytes((chain / "d2.dsd").read_bytes()[:-100])
    p = run("replay", "s0.safetensors", "d1.dsd", "trunc.dsd", "-o", "c.safetensors", cwd=chain, ok=False)
    assert p.returncode == 1 and "truncated" in p.stderr
    assert not (chain / "c.safetensors").exists()


def test_squash_equals_chain(chain: Path) -> None:
    p = run("squash", "d1.dsd", "d2.dsd", "d3.dsd", "-o", "sq.dsd", cwd=chain)
    assert "v0->v3" in p.stdout
    run("replay", "s0.safetensors", "sq.dsd", "-o", "sq.safetensors", "--quiet", cwd=chain)
    assert same_bytes(read_state_file(chain / "sq.safetensors"), read_state_file(chain / "s3.safetensors"))


def test_verify_target_and_base(chain: Path) -> None:
    assert "OK" in run("verify", "s2.safetensors", "d2.dsd", cwd=chain).stdout
    assert "OK" in run("verify", "s1.safetensors", "d2.dsd", "--base", cwd=chain).stdout
    p = run("verify", "s1.safetensors", "d2.dsd", cwd=chain, ok=False)
    assert p.returncode == 1 and "MISMATCH" in p.stdout


def test_inspect_delta_and_state(chain: Path) -> None:
    p = run("inspect", "d1.dsd", cwd=chain)
    assert "model.embed_tokens.weight" in p.stdout and "total:" in p.stdout
    info = json.loads(run("inspect", "d1.dsd", "--json", cwd=chain).stdout)
    assert info["kind"] == "delta" and info["version"] == 1 and info["parent"] == 0
    assert 0 < info["bytes"] < os.path.getsize(chain / "d1.dsd")
    assert sum(t["changed"] for t in info["tensors"]) == info["changed_words"] > 0
    st = json.loads(run("inspect", "s0.safetensors", "--json", cwd=chain).stdout)
    # format 3: a delta lists the tensors it changes, the state all of them
    assert st["type"] == "safetensors" and {t["name"] for t in info["tensors"]} <= {t["name"] for t in st["tensors"]}


def test_signed_deltas(chain: Path) -> None:
    (chain / "k.hex").write_text("00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n")
    (chain / "other.hex").write_text("ff" * 32)
    run("diff", "s0.safetensors", "s1.safetensors", "-o", "signed.dsd", "--key-file", "k.hex", "--quiet", cwd=chain)
    run("replay", "s0.safetensors", "signed.dsd", "-o", "o.safetensors", "--key-file", "k.hex", "--quiet", cwd=chain)
    p = run("replay", "s0.safetensors", "signed.dsd", "-o", "o2.safetensors", "--key-file", "other.hex", cwd=chain, ok=False)
    assert p.returncode == 1 and "signature" in p.stderr and not (chain / "o2.safetensors").exists()
    p = run("replay", "s0.safetensors", "d1.dsd", "-o", "o3.safetensors", "--key-file", "k.hex", cwd=chain, ok=False)
    assert p.returncode == 1 and "unsigned" in p.stderr


def test_garbage_input_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3 + b"not a file")
    p = run("inspect", "junk.safetensors", cwd=tmp_path, ok=False)
    assert p.returncode == 1 and "safetensors" in p.stderr and "Traceback" not in p.stderr
    p = run("replay", "missing.safetensors", "x.dsd", "-o", "y", cwd=tmp_path, ok=False)
    assert p.returncode == 1 and "No such file" in p.stderr


def test_replay_onto_a_full_disk_keeps_the_old_file(chain: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        out = mnt / "out.safetensors"
        out.write_bytes(b"previous contents")
        p = run("replay", str(chain / "s0.safetensors"), str(chain / "d1.dsd"), "-o", str(out), cwd=chain, ok=False)
        assert p.returncode == 1 and "writing" in p.stderr and "Traceback" not in p.stderr
        assert out.read_bytes() == b"previous contents"  # untouched
        assert [f.name for f in mnt.iterdir()] == ["out.safetensors"]  # no temp file left behind
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("json_out", [False, True], ids=["table", "json"])
def test_inspect_piped_into_head_exits_quietly(tmp_path: Path, json_out: bool) -> None:
    # far more output than a pipe holds, so the write after `head -1` exits really hits a closed pipe
    state = {f"layers.{i:05d}.weight": torch.full((2,), float(i)) for i in range(4000)}
    path = tmp_path / "many.safetensors"
    write_state_file(path, state)
    cmd = " ".join(f"'{a}'" for a in [*CLI, "inspect", str(path), *(["--json"] if json_out else [])])
    p = subprocess.run(["bash", "-c", f'{cmd} | head -1; echo "deltasync exit ${{PIPESTATUS[0]}}" >&2'],
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.count("\n") == 1 and p.stdout.strip()
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert p.stderr.strip() == "deltasync exit 141"


def test_a_broken_pipe_that_is_not_stdout_stays_an_error() -> None:
    import argparse

    from deltasync.cli.run import run_command

    def fails(args):
        raise BrokenPipeError(32, "Broken pipe")  # as from a socket; our stdout is fine

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=fails, command="x")
    with pytest.raises(BrokenPipeError):
        run_command(parser, [])
