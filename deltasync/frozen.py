"""Frozen dataclasses of values already checked, built without their keyword ``__init__``.

A frozen, slotted dataclass's generated ``__init__`` binds keywords and sets each field through
``object.__setattr__``: a few µs an object. The hot paths that make one object per tensor or per chunk of a
state of 70k tensors (header entries, host tensors, manifest records, decoded chunks) build them here instead,
from values their own parsers already checked (``__post_init__`` does not run)."""

from __future__ import annotations

__all__ = ["build"]

_new, _set = object.__new__, object.__setattr__


def build(cls, **fields):
    """An instance of ``cls`` holding ``fields`` (every field, by name), no ``__init__``/``__post_init__``."""
    obj = _new(cls)
    for name, value in fields.items():
        _set(obj, name, value)
    return obj
