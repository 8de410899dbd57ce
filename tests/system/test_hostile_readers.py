"""Issue 27, torn ``--out`` files: every reader of a state file that deltasync documents refuses one whose header
says a delta is being written into it (``deltasync.state_fp`` is ``"patching"``: a subscriber caught, or killed,
mid-apply), naming the fix, before it reads a tensor: ``deltasync verify``, ``inspect``, ``replay``, ``diff``
(either file), ``publish STATE`` and ``publish --base`` (against a real origin with a head). The commands run
in-process through ``deltasync.cli.main.main`` (their own parsers and error mapping); the files are real
safetensors files; the origin is a real server on 127.0.0.1.

The engines: vLLM's ``deltasync_load_checkpoint`` is tested in tests/test_vllm_checkpoint*; the SGLang and HF
appliers take tensors from the engine or a live ``nn.Module``, never a file (docs/ENGINES.md), so there is no
file reader there to guard."""

from __future__ import annotations

import pytest

from deltasync.cli.main import main
from deltasync.client.filetarget import META_MODEL, META_STATE_FP, META_VERSION
from deltasync.tensorfile import write_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from cluster_support import origin_only

KEY = bytes(range(31, 63))
SHAPE = ModelShape(vocab=64, hidden=16, layers=1, ffn=32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("readers")
    trace = RLTrace(SHAPE, lr=1e-3, seed=27)
    s0, s1 = trace.step(), trace.step()
    good0, good1, torn = d / "v0.safetensors", d / "v1.safetensors", d / "torn.safetensors"
    write_state_file(good0, s0, {META_MODEL: "rd", META_VERSION: "0"})
    write_state_file(good1, s1, {META_MODEL: "rd", META_VERSION: "1"})
    # what a subscriber killed between its journal and its new header leaves: v0's header, tensors part way to v1
    half = {n: (s1[n] if i % 2 else s0[n]) for i, n in enumerate(sorted(s0))}
    write_state_file(torn, half, {META_MODEL: "rd", META_VERSION: "0", META_STATE_FP: "patching"})
    delta = d / "v0-v1.delta"
    key = d / "key"
    key.write_text(KEY.hex() + "\n")
    assert main(["diff", str(good0), str(good1), "-o", str(delta), "--key-file", str(key), "--quiet"]) == 0
    return {"good0": good0, "good1": good1, "torn": torn, "delta": delta, "key": key, "dir": d}


def _refused(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0, f"{argv[0]} accepted a torn file"
    assert "patching" in err and "subscribe --out" in err, err  # the reason and the fix, in one line
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("reader", ["verify", "verify-base", "inspect", "replay", "diff-old", "diff-new"])
def test_offline_readers_refuse_a_patching_file(files, capsys, reader):
    f = {k: str(v) for k, v in files.items()}
    out = str(files["dir"] / f"{reader}.out")
    argv = {
        "verify": ["verify", f["torn"], f["delta"], "--key-file", f["key"]],
        "verify-base": ["verify", f["torn"], f["delta"], "--base", "--key-file", f["key"]],
        "inspect": ["inspect", f["torn"]],
        "replay": ["replay", f["torn"], f["delta"], "-o", out, "--key-file", f["key"]],
        "diff-old": ["diff", f["torn"], f["good1"], "-o", out, "--quiet"],
        "diff-new": ["diff", f["good0"], f["torn"], "-o", out, "--quiet"],
    }[reader]
    _refused(capsys, argv)
    assert not (files["dir"] / f"{reader}.out").exists()


def test_the_controls_accept_published_files(files, capsys):
    """The same commands on the published files succeed: the refusals above are about the header alone."""
    f = {k: str(v) for k, v in files.items()}
    assert main(["verify", f["good1"], f["delta"], "--key-file", f["key"]]) == 0
    assert main(["verify", f["good0"], f["delta"], "--base", "--key-file", f["key"]]) == 0
    assert main(["inspect", f["good0"]]) == 0
    assert main(["diff", f["good1"], f["good0"], "-o", str(files["dir"] / "back.delta"), "--quiet",
                 "--version", "2", "--parent", "1"]) == 0
    capsys.readouterr()


def test_publish_refuses_a_patching_state_or_base(files, capsys, tmp_path):
    with origin_only(tmp_path / "c", KEY) as c:
        common = ["publish", "--origin", c.origin, "--model", "rd", "--token-file", str(c.token_file),
                  "--key-file", str(files["key"]), "--timeout", "60"]
        _refused(capsys, [*common, str(files["torn"]), "--step", "0"])
        assert main([*common, str(files["good0"]), "--step", "0"]) == 0  # the origin now has a head to diff against
        capsys.readouterr()
        _refused(capsys, [*common, "--base", str(files["torn"]), str(files["good1"]), "--step", "1"])
        assert main([*common, "--base", str(files["good0"]), str(files["good1"]), "--step", "1"]) == 0
