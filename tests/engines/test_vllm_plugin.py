"""The ``vllm.general_plugins`` entry point (deltasync.client.vllm_plugin) never stops vLLM from starting.

vLLM calls every general plugin in each of its processes, and an exception there would abort the engine's start.
Here, without vLLM (the main venv): ``register`` logs that there is nothing to register into and returns. The
engine venv (``make test-engines``, tests/engines/test_vllm_transfer.py) checks the registration itself and a failing
import of our hooks.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest

from deltasync.client import vllm_plugin


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here (the engine venv)")
def test_register_without_vllm_logs_and_returns(caplog):
    with caplog.at_level(logging.WARNING, logger="deltasync.client.vllm_plugin"):
        assert vllm_plugin.register() is None
    assert "not registered" in caplog.text


def test_the_entry_point_names_the_plugin_function():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["vllm.general_plugins"]["deltasync"]
    module, _, func = target.partition(":")
    assert getattr(importlib.import_module(module), func) is vllm_plugin.register
