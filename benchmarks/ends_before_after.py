"""Run by hand, not by `make bench` (it needs a second install to compare with). The two ends side by side: ``deltasync publish`` / ``subscribe --out`` before (another install, e.g. main's)
and after (this tree), on one synthetic bf16 state, in one run, against one local origin.

    python benchmarks/ends_before_after.py --mib 512 --before-site /tmp/before-site [--dir /dev/shm/x]

``--before-site``: a ``pip install --target`` of the code to compare with (PYTHONPATH for the "before"
commands; every command runs outside the source tree so that path wins). Each command is timed by
``/usr/bin/time`` (wall, user, system seconds, peak RSS). Phases, in order, for each side: the first
version (publish a keyframe; a fresh ``subscribe --once``), then a step changing ``--changed`` of the
words by one ULP (publish: before without ``--base``, after with ``--base PREV``; ``subscribe --once``
on the file of the first phase).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deltasync.cli.cluster import LocalCluster
from deltasync.tensorfile import write_state_file

KEY = bytes(range(1, 33))


def make_state(mib: int, seed: int, tensors: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 2 // tensors
    return {f"layer{i:02d}.weight": (torch.randn(n, generator=g) * 0.02).bfloat16().reshape(-1, 1024)
            for i in range(tensors)}


def make_step(state: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        w = t.clone().view(-1).view(torch.int16)
        k = int(w.numel() * frac)
        pos = torch.randint(0, w.numel(), (k,), generator=g)
        w[pos] += torch.where(torch.rand(k, generator=g) < 0.5, -1, 1).to(torch.int16)
        out[name] = w.view(torch.bfloat16).reshape(t.shape)
    return out


def _status_kb(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0])
    except (OSError, ValueError):
        pass
    return out


def timed(cmd: list[str], *, env: dict[str, str], cwd: str) -> dict[str, float]:
    """Wall/user/sys/peak RSS by /usr/bin/time; peak anonymous and file-backed RSS sampled every 20 ms from
    /proc (the kernel keeps no peak of each)."""
    p = subprocess.Popen(["/usr/bin/time", "-f", "TIME %e %U %S %M", *cmd], env=env, cwd=cwd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    anon = file = 0
    child = None
    while p.poll() is None:
        if child is None:
            try:
                child = int(Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()[0])
            except (OSError, IndexError, ValueError):
                pass
        if child is not None:
            st = _status_kb(child)
            anon = max(anon, st.get("RssAnon", 0))
            file = max(file, st.get("RssFile", 0) + st.get("RssShmem", 0))
        time.sleep(0.02)
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{out}\n{err}")
    line = [x for x in err.splitlines() if x.startswith("TIME ")][-1].split()
    return {"wall": float(line[1]), "user": float(line[2]), "sys": float(line[3]), "rss_mb": int(line[4]) / 1024,
            "anon_mb": anon / 1024, "file_mb": file / 1024}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--before-site", required=True)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ends-", dir=a.dir))
    s0 = make_state(a.mib, 1)
    write_state_file(root / "s0.safetensors", s0)
    write_state_file(root / "s1.safetensors", make_step(s0, a.changed, 2))
    del s0
    py = sys.executable
    base_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    envs = {"before": {**base_env, "PYTHONPATH": a.before_site}, "after": dict(base_env)}
    base_env.pop("PYTHONPATH", None)
    rows = []
    with LocalCluster(root / "tree", key=KEY) as c:
        c.start_origin()
        pub = lambda m: [py, "-m", "deltasync.client.cli", "publish", "--origin", c.origin, "--model", m,  # noqa: E731
                         "--token-file", str(c.token_file), "--key-file", str(c.key_file), "--quiet"]
        sub = lambda m: [py, "-m", "deltasync.client.cli", "subscribe", "--from", c.origin, "--model", m,  # noqa: E731
                         "--key-file", str(c.key_file), "--out", str(root / f"out-{m}.safetensors"), "--once",
                         "--timeout", "900", "--quiet"]
        phases = [
            ("publish first", lambda side: [*pub(side), str(root / "s0.safetensors")]),
            ("subscribe first", lambda side: sub(side)),
            (f"publish {100 * a.changed:g}% step", lambda side: [*pub(side), *(
                ["--base", str(root / "s0.safetensors")] if side == "after" else []), str(root / "s1.safetensors")]),
            (f"subscribe {100 * a.changed:g}% step", lambda side: sub(side)),
        ]
        for phase, cmd in phases:
            for side in ("before", "after"):
                m = timed(cmd(side), env=envs[side], cwd=str(root))
                rows.append((phase, side, m))
                print(f"{phase:24s} {side:6s} wall {m['wall']:6.2f} s  user {m['user']:6.2f} s  sys {m['sys']:6.2f} s  "
                      f"peak RSS {m['rss_mb']:6.0f} MB (anon {m['anon_mb']:5.0f}, file {m['file_mb']:5.0f})", flush=True)
    ok = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(
        *(dict(sorted(__import__("deltasync.tensorfile", fromlist=["x"]).read_state_file(p).items())).values()
          for p in (root / "out-after.safetensors", root / "s1.safetensors"))))
    print(f"state {a.mib} MiB bf16, {root}; after's file equals the published step bit for bit: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
