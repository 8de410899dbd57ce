"""Issue 27, torn reads of ``subscribe --out F``: SIGKILLs of real subscribers during delta applies and keyframe
streams; before any recovery, every reader deltasync documents either reads a bit-exact published version or
refuses F with a clear error: the core loader (``read_state_file``: ``deltasync verify``, ``diff``, ``replay``,
``publish --base``) and docs/CLIENT.md's loading recipe (safetensors, then the header rule). After recovery F is
one published version (tests/system/test_ends_subscribe.py)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors
import torch
import xxhash

from deltasync.cli.cluster import LocalCluster
from deltasync.client.filetarget import recover
from deltasync.client.publisher import Publisher
from deltasync.errors import IntegrityError
from deltasync.tensorfile import read_state_file
from deltasync.testing.trace import ModelShape, RLTrace

pytestmark = pytest.mark.long

KEY = bytes(range(7, 39))
SHAPE = ModelShape(vocab=1024, hidden=128, layers=2, ffn=512)
LAUNCHER = str(Path(__file__).resolve().parents[1] / "kill_at_phase.py")


def _digest(state) -> str:
    h = xxhash.xxh3_128()
    for n in sorted(state):
        h.update(n.encode())
        h.update(state[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_as_documented(path: Path) -> dict[str, torch.Tensor]:
    """docs/CLIENT.md's recipe, as written there: safetensors, refusing a file whose header says "patching"."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        if f.metadata().get("deltasync.state_fp") == "patching":
            raise RuntimeError(f"{path} is being patched (or was cut mid-apply): not a published version")
        return {k: f.get_tensor(k) for k in f.keys()}


def _readers_agree(out: Path, digests: dict[int, str]) -> str:
    """Each documented reader: bit-exact some published version, or a clear refusal. Returns what they saw."""
    seen = []
    for name, read, refusal in (("core", read_state_file, IntegrityError), ("recipe", load_as_documented, RuntimeError)):
        try:
            d = _digest(read(out))
        except refusal as e:
            assert "patch" in str(e), e
            seen.append(f"{name}:refused")
            continue
        assert d in digests.values(), f"{name} read a torn {out}: it matches no published version"
        seen.append(f"{name}:ok")
    return ",".join(seen)


def test_no_documented_reader_accepts_a_torn_out_file(tmp_path):
    rng = random.Random(27)
    trace = RLTrace(SHAPE, lr=3e-4, seed=27)
    digests: dict[int, str] = {}
    outcomes: list[str] = []
    with LocalCluster(tmp_path / "c", key=KEY) as c:
        c.start_origin()

        def sub(out: Path, *extra: str) -> list[str]:
            return ["subscribe", "--from", c.origin, "--model", "torn", "--key-file", str(c.key_file),
                    "--out", str(out), *extra]

        def cli(*args: str) -> None:
            r = subprocess.run([sys.executable, "-m", "deltasync.client.cli", *args], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr

        out = tmp_path / "live.safetensors"
        kills = 0
        with Publisher(c.origin, "torn", c.token, KEY, keyframe_every=4) as pub:
            def publish(v: int) -> None:
                st = trace.step()
                digests[v] = _digest(st)
                pub.publish(v, st)
                pub.flush(60)

            publish(0)
            cli(*sub(out, "--once", "--timeout", "60"))
            # 10 kills at the apply's phases (deterministic): F at v(k), the delta to v(k+1) cut there
            for k, phase in enumerate(["mid-patch", "patched", "header-torn", "header", "journal-torn"] * 2):
                publish(k + 1)
                p = subprocess.run([sys.executable, LAUNCHER, phase, *sub(out, "--once", "--timeout", "60")],
                                   capture_output=True, text=True, timeout=120)
                assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
                kills += 1
                outcomes.append(f"{phase}:{_readers_agree(out, digests)}")
                recover(out)
                assert _readers_agree(out, digests) == "core:ok,recipe:ok"
                cli(*sub(out, "--once", "--timeout", "60"))
            last = max(digests)
            # 10 kills at random instants: of a first keyframe's stream, or of a catch-up through the deltas
            for k in range(10):
                if k % 2 == 0:
                    out.unlink(missing_ok=True)
                else:
                    recover(out)
                p = subprocess.Popen([sys.executable, "-m", "deltasync.client.cli",
                                      *sub(out, "--until", str(last), "--timeout", "60")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(rng.uniform(0.3, 3.0))
                p.send_signal(signal.SIGKILL)
                p.wait(30)
                kills += 1
                if out.exists():
                    outcomes.append(f"random:{_readers_agree(out, digests)}")
                else:
                    outcomes.append("random:no-file")
    assert kills == 20
    assert any("refused" in o for o in outcomes), outcomes  # torn files were made, and refused
    print("torn-read kills:", outcomes)
