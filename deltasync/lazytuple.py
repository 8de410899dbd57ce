"""A tuple whose items are made when first used; and :func:`once`, the same rule for other lazy holders.

A state of 70,000 tensors has as many header entries, manifest records and chunk references; most readers of a
header or a manifest on the hot paths take their columns (arrays) instead and need none of the objects. The
holders of those objects (``tensorfile.TensorHeader.entries``, ``manifest.Manifest.tensors``) keep a
:class:`LazyTuple` there: a tuple in every way a reader can tell (iteration, length, indexing, equality,
hashing), whose items a subclass's :meth:`_build` makes the first time any of that is asked for.
"""

from __future__ import annotations

import threading

__all__ = ["LazyTuple", "once"]

#: held while a lazy holder makes what it stands for: a second thread that asks meanwhile waits, then finds it made
#: (one lock for all: making is rare, once per holder)
_MAKING = threading.RLock()


def once(holder, pending: str, make) -> None:
    """Run ``make()`` once for ``holder`` while ``getattr(holder, pending)`` is set, then clear that attribute;
    threads asking meanwhile wait for it (the attribute is cleared only once ``make`` has returned)."""
    if getattr(holder, pending) is None:
        return
    with _MAKING:
        if getattr(holder, pending) is not None:
            make()
            setattr(holder, pending, None)


class LazyTuple(tuple):
    """An (empty) tuple standing for ``_build()``'s, made on first use and kept (``made``)."""

    def _build(self) -> tuple:
        raise NotImplementedError

    def _made(self) -> tuple:
        made = self.__dict__.get("made")
        if made is None:
            with _MAKING:  # one thread makes it; another asking meanwhile waits for that
                made = self.__dict__.get("made")
                if made is None:
                    made = self.made = tuple(self._build())
        return made

    def __iter__(self):
        return iter(self._made())

    def __reversed__(self):
        return reversed(self._made())

    def __len__(self) -> int:
        return len(self._made())

    def __getitem__(self, i):
        return self._made()[i]

    def __contains__(self, x) -> bool:
        return x in self._made()

    def __eq__(self, other) -> bool:
        return self._made() == (tuple(other) if isinstance(other, tuple) else other)

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self._made())

    def __repr__(self) -> str:
        return repr(self._made())
