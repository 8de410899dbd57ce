"""The step's critical path after the origin's commit: ``subscribe --until`` wakes on the delivered step and ends
its process without the interpreter's teardown, with its output and file complete (real servers, real processes)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from deltasync.cli.cluster import LocalCluster
from deltasync.cli.run import _is_the_program, run_command
from deltasync.tensorfile import read_state_file, write_state_file
from deltasync.testing.trace import ModelShape, RLTrace

from core_support import same_state

KEY = bytes(range(3, 35))
SHAPE = ModelShape(vocab=256, hidden=32, layers=1, ffn=64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("latency"), key=KEY)
    try:
        c.start_tree({"relay": ["origin"]})
        yield c
    finally:
        c.close()


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltasync.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_a_program_calling_main_is_not_ended_by_exit_now():
    """Inside pytest (a program that calls run_command) the process must go on: exit_now is for the command only."""
    assert not _is_the_program()
    parser = argparse.ArgumentParser()
    parser.set_defaults(func=lambda args: setattr(args, "exit_now", True) or 3, command="x")
    assert run_command(parser, []) == 3


def test_subscribe_until_output_and_file_are_complete_after_the_fast_exit(cluster, tmp_path):
    """The process ends with os._exit: every line it printed and logged must still be there, the file verified."""
    trace = RLTrace(SHAPE, lr=1e-4, seed=31)
    states = [trace.step(), trace.step()]
    for i, s in enumerate(states):
        write_state_file(tmp_path / f"s{i}.safetensors", s)
    common = ["--model", "lat", "--key-file", str(cluster.key_file)]
    pub = ["publish", "--origin", cluster.origin, "--token-file", str(cluster.token_file), *common]
    r = _cli(*pub, str(tmp_path / "s0.safetensors"))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out.safetensors"
    env = {**os.environ, "DELTASYNC_TIMELINE": "1"}
    sub = subprocess.Popen([sys.executable, "-m", "deltasync.cli.main", "subscribe", "--from", cluster.url("relay"),
                            *common, "--out", str(out), "--until", "1", "--timeout", "120"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        r = _cli(*pub, "--base", str(tmp_path / "s0.safetensors"), str(tmp_path / "s1.safetensors"))
        assert r.returncode == 0, r.stderr
        stdout, stderr = sub.communicate(timeout=120)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait(10)
    assert sub.returncode == 0, stderr
    assert "lat v1 -> " in stdout, stdout  # printed just before the exit: flushed
    # the last stamp (logged just before os._exit) reached stderr: the log handlers were flushed
    stamps = [line for line in stderr.splitlines() if "deltasync.timeline" in line]
    assert stamps and stamps[-1].rstrip().endswith("exit-now"), stderr[-2000:]
    assert any(" woke lat v1" in line for line in stamps), stamps
    assert same_state(read_state_file(out), states[1])


def test_the_fast_exit_skips_the_interpreters_teardown(tmp_path):
    """``python -m deltasync.cli.main``: a command that sets exit_now ends without running atexit hooks (what
    the teardown of torch and numba runs); one that does not, runs them (the control)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import argparse, atexit, sys\n"
        "from deltasync.cli import run\n"
        "run._PROGRAMS = ('probe',)\n"
        "atexit.register(lambda: print('teardown ran', flush=True))\n"
        "p = argparse.ArgumentParser()\n"
        "p.set_defaults(command='x', func=lambda a: setattr(a, 'exit_now', sys.argv[1] == 'now') or 0)\n"
        "print('before', flush=False)\n"
        "sys.exit(run.run_command(p, []))\n")
    for mode, ran in (("now", False), ("normal", True)):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "probe", mode], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("before"), r.stdout  # the unflushed print still came out
        assert ("teardown ran" in r.stdout) is ran, (mode, r.stdout, time.monotonic() - t0)
