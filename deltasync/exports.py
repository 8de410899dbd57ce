"""Lazy public names for a package's ``__init__``: ``__all__`` without importing everything.

``from deltasync import encode_delta`` works, yet ``import deltasync`` (which every
server process does) loads no torch: each name is imported from its owning module
on first use (PEP 562 module ``__getattr__``)::

    __all__, __getattr__, __dir__ = lazy_exports(__name__, {"Manifest": ".manifest", ...})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package``, where ``names`` maps each public name
    to the module (relative to ``package``, or absolute) that defines it."""
    table = dict(names)

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        return value

    def __dir__() -> list[str]:
        return sorted(table)

    return sorted(table), __getattr__, __dir__
