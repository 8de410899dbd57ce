"""vLLM's way in: the ``vllm.general_plugins`` entry point that registers the ``deltasync`` weight-transfer backend.

``pip install deltasync`` is all it takes: vLLM calls :func:`register` in every one of its processes (API
server, engine core, each worker; ``vllm/plugins/__init__.py`` ``load_general_plugins``) before it builds the
engine, and then ``LLM(..., weight_transfer_config={"backend": "deltasync"})`` or ``vllm serve M
--weight-transfer-config '{"backend": "deltasync"}'`` picks :mod:`deltasync.client.vllm_transfer` by name
(``WeightTransferEngineFactory`` / ``WeightTransferTrainerFactory``, registered by module path, so the
backend module is imported only by an engine that uses it).

On vLLM's CPU backend the plugin also installs deltasync's weight-keeping hooks
(:mod:`deltasync.client.vllm`: vLLM repacks linear and MoE weights after loading and drops the plain ones);
they keep copies only while an engine configured for deltasync loads (``vllm_quant.keeps_weights``), so other engines
pay nothing.

This function must never stop vLLM from starting: every failure is logged (with the fix) and swallowed;
``VLLM_PLUGINS`` (a comma-separated allow-list of plugin names) can leave it out altogether.
"""

from __future__ import annotations

import logging

log = logging.getLogger("deltasync.client.vllm_plugin")

BACKEND = "deltasync"
MODULE = "deltasync.client.vllm_transfer"
ENGINE = "DeltaSyncWeightTransferEngine"
TRAINER_ENGINE = "DeltaSyncTrainerEngine"


def register() -> None:
    """Register ``deltasync`` with vLLM's weight-transfer factories (idempotent) and install the CPU hooks."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    except Exception:  # a vLLM without the weight-transfer API (older than 0.32): nothing to register into
        log.warning("deltasync: this vLLM has no vllm.distributed.weight_transfer (0.32 or newer has it); the "
                    "'deltasync' backend is not registered (the worker extension still works)", exc_info=True)
        return
    for factory, cls in ((WeightTransferEngineFactory, ENGINE), (WeightTransferTrainerFactory, TRAINER_ENGINE)):
        try:
            factory.register_engine(BACKEND, MODULE, cls)
        except ValueError:  # already registered (plugins may load twice in one process)
            pass
        except Exception:
            log.exception("deltasync: registering the %r backend with %s failed", BACKEND, factory.__name__)
    try:
        from deltasync.client import vllm as _hooks  # noqa: F401  (importing installs the CPU weight-keeping hooks)
    except Exception:
        log.exception("deltasync: installing the CPU weight-keeping hooks failed; an engine on vLLM's CPU backend "
                      "with backend 'deltasync' will refuse to start its transfer engine")


__all__ = ["BACKEND", "register"]
