"""verl 0.9.1's checkpoint-engine contract, reproduced for tests/engines/test_verl_engine.py.

verl itself needs Ray (and CUDA for its built-in engines); no CPU install of it runs here. These are the two
pieces of ``verl/checkpoint_engine/base.py`` (verl 0.9.1, Apache-2.0, from ``pip download --no-deps
verl==0.9.1``) that a custom backend touches, copied with their behaviour and trimmed of docstrings:
``CheckpointEngineRegistry`` (``register`` / ``get`` / ``new``) and the ``CheckpointEngine`` ABC. The calls
verl makes on an engine (``CheckpointEngineManager.build_process_group`` and ``update_weights``,
``CheckpointEngineWorker.update_weights``, the actor's ``update_weights`` in ``verl/workers/engine_workers.py``)
are reproduced by the test itself, in the same order with the same arguments."""

from __future__ import annotations

import sys
import types
from abc import ABC, abstractmethod
from typing import Any


class CheckpointEngineRegistry:
    _registry: dict = {}
    _import_errors: dict = {}

    def register(backend: str):
        def wrapper(cls):
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str):
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered, registered backends: {sorted(cls._registry)}")
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args, **kwargs):
        return cls.get(backend)(*args, **kwargs)


class CheckpointEngine(ABC):
    wire_format = "named_tensors"

    @abstractmethod
    def prepare(self) -> dict[str, Any]: ...

    @classmethod
    @abstractmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]): ...

    @abstractmethod
    def init_process_group(self, **kwargs): ...

    @abstractmethod
    def finalize(self): ...

    @abstractmethod
    async def send_weights(self, weights, global_steps: int | None = None): ...

    @abstractmethod
    async def receive_weights(self, global_steps: int | None = None): ...


def install(monkeypatch) -> type:
    """Put ``verl``, ``verl.checkpoint_engine`` and ``verl.checkpoint_engine.base`` (this module's classes) in
    ``sys.modules`` for the test's duration; returns the registry."""
    base = types.ModuleType("verl.checkpoint_engine.base")
    base.CheckpointEngine, base.CheckpointEngineRegistry = CheckpointEngine, CheckpointEngineRegistry
    pkg = types.ModuleType("verl.checkpoint_engine")
    pkg.base = base
    root = types.ModuleType("verl")
    root.checkpoint_engine = pkg
    for name, mod in (("verl", root), ("verl.checkpoint_engine", pkg), ("verl.checkpoint_engine.base", base)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "deltasync.client.verl", raising=False)
    return CheckpointEngineRegistry
