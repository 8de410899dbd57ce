"""cli/run.py's process settings for a command that is the program: numpy's huge-page advice off (unless the
environment says otherwise), set for the processes it starts too, and at once when numpy is already imported."""

from __future__ import annotations

import os

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
    multiarray._set_madvise_hugepage(True)
    run._small_pages()
    assert os.environ["NUMPY_MADVISE_HUGEPAGE"] == "0" and multiarray._get_madvise_hugepage() is False


def test_the_environment_keeps_its_say(monkeypatch, restore_pages):
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    multiarray._set_madvise_hugepage(True)
    run._small_pages()
    assert multiarray._get_madvise_hugepage() is True


def test_a_command_that_is_the_program_runs_with_small_pages(monkeypatch, restore_pages):
    import argparse

    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    monkeypatch.setattr(run, "_is_the_program", lambda: True)
    multiarray._set_madvise_hugepage(True)
    seen = []
    parser = argparse.ArgumentParser()
    parser.set_defaults(func=lambda args: seen.append(multiarray._get_madvise_hugepage()))
    assert run.run_command(parser, []) == 0 and seen == [False]
