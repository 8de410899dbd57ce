"""``deltasync diff`` from files without torch (issue 10, helper D): both files are read as HostTensor words
over their maps, compared with the same ``diff_span`` kernel and pool as ``publish --base``, and the delta
file written is byte for byte the one ``encode_delta`` makes of the same files' torch tensors, whatever the
thread count. Real safetensors files, the real CLI in subprocesses; torch is looked for in the list of
modules the command's process had imported when it ended."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync.codec import EncodeOptions, encode_delta
from deltasync.deltafile import pack_delta_file, read_delta_file
from deltasync.tensorfile import read_state_file, write_state_file

# runs the CLI entry point as ``python -m deltasync.cli.main`` would, then prints every module it loaded
_RUN = ("import runpy, sys\n"
        "sys.argv = ['deltasync', *sys.argv[1:]]\n"
        "try:\n"
        "    runpy.run_module('deltasync.cli.main', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    print('LOADED ' + ' '.join(sorted(sys.modules)), file=sys.stderr, flush=True)\n")


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    r = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=180)
    lines = [line for line in r.stderr.splitlines() if line.startswith("LOADED ")]
    assert r.returncode == 0 and len(lines) == 1, r.stderr[-3000:]
    return r, set(lines[0].split()[1:])


def _pair(d: Path) -> tuple[Path, Path]:
    """Many tensors of several word widths, one big enough to span several chunks, a 0-d and an empty one,
    an odd-sized uint8 and a complex tensor (two words per element)."""
    g = torch.Generator().manual_seed(11)
    s0 = {f"layers.{i}.w": (torch.randn(48, 40, generator=g) * 0.02).to(torch.bfloat16) for i in range(24)}
    s0.update({
        "big.bf16": torch.randn(300, 256, generator=g).to(torch.bfloat16),
        "w.fp32": torch.randn(129, 7, generator=g),
        "b.uint8": torch.randint(0, 255, (77,), generator=g, dtype=torch.uint8),
        "c.int64": torch.tensor([5, -7, 1 << 40], dtype=torch.int64),
        "scalar": torch.tensor(1.5, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "z.c64": torch.randn(10, generator=g, dtype=torch.complex64),
    })
    s1 = {n: t.clone() for n, t in s0.items()}
    for n, t in s1.items():
        flat = t.view(-1)
        if flat.numel() == 0 or n == "layers.3.w":  # one tensor unchanged
            continue
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        if t.dtype.is_floating_point or t.dtype.is_complex:
            flat[idx] = flat[idx] * 1.01 + 0.001
        else:
            flat[idx] = flat[idx] + 1
    s1["scalar"] = torch.tensor(2.5, dtype=torch.float32)
    write_state_file(d / "a.safetensors", s0)
    write_state_file(d / "b.safetensors", s1)
    return d / "a.safetensors", d / "b.safetensors"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return _pair(tmp_path_factory.mktemp("diffcli"))


def _expected(a: Path, b: Path, chunk_words: int) -> bytes:
    enc = encode_delta(read_state_file(a), read_state_file(b), model="model", version=1, parent=0,
                       options=EncodeOptions(chunk_words=chunk_words))
    return pack_delta_file(enc.manifest.compact(), enc.blobs)  # what `diff` writes: format 3


@pytest.mark.parametrize("threads", ["1", "2"])
def test_diff_needs_no_torch_and_writes_the_torch_encoders_bytes(pair, tmp_path, threads):
    a, b = pair
    out = tmp_path / "d.dsd"
    r, mods = _cli("diff", str(a), str(b), "-o", str(out), "--threads", threads, "--chunk-words", "4096")
    assert "deltasync.cli.offline" in mods  # the command ran in this process: the check below is not vacuous
    bad = sorted(m for m in mods if m == "torch" or m.startswith("torch.") or m == "safetensors.torch")
    assert not bad, f"deltasync diff imported {bad[:5]}"
    assert out.read_bytes() == _expected(a, b, 4096)
    df = read_delta_file(out)
    assert df.manifest.changed_words > 0 and 0 < len(df.manifest.tensors) <= 31  # format 3: the changed ones
    assert f"{df.manifest.changed_words:,} of" in r.stdout and "ratio" in r.stdout  # the summary line, unchanged


def test_diff_default_options_match_too(pair, tmp_path):
    a, b = pair
    out = tmp_path / "d.dsd"
    _cli("diff", str(a), str(b), "-o", str(out), "--quiet")
    assert out.read_bytes() == _expected(a, b, EncodeOptions().chunk_words)


def test_diff_of_different_layouts_says_keyframe(tmp_path):
    write_state_file(tmp_path / "a.safetensors", {"w": torch.zeros(4, 4)})
    write_state_file(tmp_path / "b.safetensors", {"w": torch.zeros(4, 5)})
    r = subprocess.run([sys.executable, "-m", "deltasync.cli.main", "diff", str(tmp_path / "a.safetensors"),
                        str(tmp_path / "b.safetensors"), "-o", str(tmp_path / "d.dsd")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "keyframe" in r.stderr and not (tmp_path / "d.dsd").exists()
