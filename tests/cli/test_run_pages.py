"""cli/run.py's ``small_pages``: numpy's huge-page advice off in a command that is the program (``subscribe``,
``publish --base``) unless the environment says otherwise, set for the processes it starts too, at once when
numpy is already imported; a program that only embeds deltasync keeps its own setting."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from deltasync.cli import run

try:
    from numpy._core import multiarray
except ImportError:  # numpy 1.x
    from numpy.core import multiarray  # type: ignore[no-redef]


@pytest.fixture
def restore_pages():
    was = multiarray._get_madvise_hugepage()
    yield
    multiarray._set_madvise_hugepage(was)


def test_small_pages_turns_numpys_advice_off_at_once(monkeypatch, restore_pages):
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    monkeypatch.setattr(run, "_is_the_program", lambda: True)
    multiarray._set_madvise_hugepage(True)
    run.small_pages()
    assert os.environ["NUMPY_MADVISE_HUGEPAGE"] == "0" and multiarray._get_madvise_hugepage() is False


def test_the_environment_keeps_its_say(monkeypatch, restore_pages):
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    monkeypatch.setattr(run, "_is_the_program", lambda: True)
    multiarray._set_madvise_hugepage(True)
    run.small_pages()
    assert multiarray._get_madvise_hugepage() is True


def test_a_program_that_embeds_deltasync_keeps_its_setting(monkeypatch, restore_pages):
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    monkeypatch.setattr(run, "_is_the_program", lambda: False)
    multiarray._set_madvise_hugepage(True)
    run.small_pages()
    assert multiarray._get_madvise_hugepage() is True and "NUMPY_MADVISE_HUGEPAGE" not in os.environ


def test_subscribe_and_publish_base_ask_for_small_pages(monkeypatch):
    """The commands that diff or patch call it first thing (publish before its warm-up thread, which imports
    numpy, starts); a keyframe's publish (no --base) does not."""
    import argparse

    from deltasync.client import cli

    class Stop(Exception):
        pass

    calls = []
    monkeypatch.setattr(cli, "small_pages", lambda: calls.append("pages"))
    monkeypatch.setattr(cli, "_warm_up_kernels", lambda: calls.append("warm-up") or threading.Thread())
    monkeypatch.setattr(cli, "_read_token", lambda *a: (_ for _ in ()).throw(Stop()))  # the next step: stop there
    monkeypatch.setattr(cli, "_setup_logging", lambda args: None)
    for base, want in ((None, ["warm-up"]), ("prev.safetensors", ["pages", "warm-up"])):
        calls.clear()
        try:
            cli.cmd_publish(argparse.Namespace(base=base, token_file=None, serve_format=None))
        except Stop:
            pass
        assert calls == want
    calls.clear()
    monkeypatch.setattr(cli, "_bounded_subscribe", lambda *a: None)
    args = argparse.Namespace(once=True, until=1, signing_key=None)  # refused as bad usage, after the call
    assert cli.cmd_subscribe(args) == 2 and calls == ["pages"]


def test_small_pages_leaves_a_numpy_another_thread_is_importing(monkeypatch, restore_pages):
    """Regression (a `publish --base` died at its start, one run in many): numpy half imported by the warm-up
    thread, small_pages imported its parts from the main thread and got "partially initialized module". While
    numpy's import is in progress it only sets the variable and imports nothing."""
    import importlib.machinery
    import types

    fake = types.ModuleType("numpy")
    fake.__spec__ = importlib.machinery.ModuleSpec("numpy", None)
    fake.__spec__._initializing = True  # what importlib marks a module being imported with
    monkeypatch.setitem(sys.modules, "numpy", fake)
    for part in ("numpy._core", "numpy.core"):  # importing them now fails, as on the half-made module
        monkeypatch.setitem(sys.modules, part, None)
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    monkeypatch.setattr(run, "_is_the_program", lambda: True)
    run.small_pages()  # imports nothing of it (an import of its parts raises ImportError here)
    assert os.environ["NUMPY_MADVISE_HUGEPAGE"] == "0"
