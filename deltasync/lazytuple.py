"""A tuple whose items are made when first used, a dict whose entries are added when first used, and :func:`once`,
the rule both follow.

A state of 70,000 tensors has as many header entries, manifest records and chunk references; most readers of a
header or a manifest on the hot paths take their columns (arrays) instead and need none of the objects. The
holders of those objects (``tensorfile.TensorHeader.entries``, ``manifest.Manifest.tensors``) keep a
:class:`LazyTuple` there: a tuple in every way a reader can tell (iteration, length, indexing, equality,
hashing), whose items a subclass's :meth:`_build` makes the first time any of that is asked for.
"""

from __future__ import annotations

import threading

__all__ = ["LazyDict", "LazyTuple", "lazy_zip", "once"]

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


class LazyDict(dict):
    """A dict whose entries ``_pending(self)`` adds the first time the whole mapping, or a key :meth:`_for` says
    needs them, is read (then ``_pending`` is None); a change adds them first (:meth:`_edit`). C code that reads a
    dict's storage directly (json's and orjson's encoders) sees only what is there: hand it ``dict(d)``."""

    _pending = None  # set on an instance: what adds the entries

    def _full(self) -> None:
        if self._pending is not None:
            once(self, "_pending", lambda: self._pending(self))

    def _for(self, key) -> None:
        """Before a read of ``key``: all of them, unless a subclass knows ``key`` is not among them."""
        self._full()

    def _edit(self) -> None:
        self._full()

    def __getitem__(self, key):
        self._for(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        self._for(key)
        return dict.get(self, key, default)

    def __contains__(self, key) -> bool:
        self._for(key)
        return dict.__contains__(self, key)

    def __len__(self) -> int:
        self._full()
        return dict.__len__(self)

    def __iter__(self):
        self._full()
        return dict.__iter__(self)

    def __reversed__(self):
        self._full()
        return dict.__reversed__(self)

    def keys(self):
        self._full()
        return dict.keys(self)

    def values(self):
        self._full()
        return dict.values(self)

    def items(self):
        self._full()
        return dict.items(self)

    def copy(self) -> dict:
        self._full()
        return dict(dict.items(self))

    def __eq__(self, other):
        self._full()
        if isinstance(other, LazyDict):
            other._full()
        return dict.__eq__(self, other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._full()
        return dict.__repr__(self)

    def __or__(self, other):
        self._full()
        return dict(dict.items(self)) | other

    def __ror__(self, other):
        self._full()
        return other | dict(dict.items(self))

    def __ior__(self, other):
        self._edit()
        dict.update(self, other)
        return self

    def __setitem__(self, key, value) -> None:
        self._edit()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        self._edit()
        dict.__delitem__(self, key)

    def pop(self, *a):
        self._edit()
        return dict.pop(self, *a)

    def popitem(self):
        self._edit()
        return dict.popitem(self)

    def setdefault(self, key, default=None):
        self._edit()
        return dict.setdefault(self, key, default)

    def update(self, *a, **k) -> None:
        self._edit()
        dict.update(self, *a, **k)

    def clear(self) -> None:
        self._edit()
        dict.clear(self)

    def __reduce__(self):
        self._full()
        return (dict, (dict(dict.items(self)),))


def lazy_zip(keys, values) -> LazyDict:
    """``dict(zip(keys, values))`` made on first use (``values``: a sequence, or a numpy array: its ``tolist()``).
    A compare of 70,000 tensors gives its fingerprints and layout as columns; a publish reads none of these dicts,
    and each made anyway was ~10 ms and ~1,000 fresh pages."""
    out = LazyDict()
    out._pending = lambda d: dict.update(d, zip(keys, values.tolist() if hasattr(values, "tolist") else values))
    return out
