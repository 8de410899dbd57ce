"""numba's on-disk cache, loaded without the registry refresh: the bottom of the kernels package (it imports
nothing of deltasync; numba only when called)."""

from __future__ import annotations

import types

__all__ = ["load_cached_directly"]


def _load_cached(cache, sig, target_context):
    """``FunctionCache.load_overload`` without its ``target_context.refresh()``.

    numba refreshes the CPU target before every cache lookup, and the first refresh of a process fills every
    registry numba has (~70 modules: its typed containers, random, linalg, polynomial, datetime, cffi... and,
    through ``numba.np.arraymath``'s BLAS probe, ``scipy.linalg``): ~0.2 s of a cold command, under the GIL and
    numba's compile lock, that loading a kernel's cached machine code does not use (that needs the runtime (NRT)
    and the code generator only; the modules its environment names are imported by the unpickling itself). A
    lookup that misses falls through to numba's compiler, which refreshes everything first, as before."""
    from numba.core.runtime import rtsys

    rtsys.initialize(target_context)  # idempotent; what the cached code calls into (allocation, refcounts)
    with cache._guard_against_spurious_io_errors():
        return cache._load_overload(sig, target_context)


def load_cached_directly(namespace: dict) -> int:
    """Make the cached njit dispatchers among ``namespace``'s values (a kernel module's ``globals()``) load their
    machine code with :func:`_load_cached`; returns how many. Called by the modules that define kernels
    (:mod:`deltasync.kernels.cpu` when selected, :mod:`deltasync.kernels.rans`); dispatchers of other code are left
    alone. Where numba's cache objects lack the two private methods it calls (another numba), nothing changes."""
    try:
        from numba.core.caching import FunctionCache
        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return 0
    if not all(hasattr(FunctionCache, n) for n in ("_guard_against_spurious_io_errors", "_load_overload")):
        return 0
    n = 0
    for obj in list(namespace.values()):
        cache = getattr(obj, "_cache", None) if isinstance(obj, Dispatcher) else None
        if isinstance(cache, FunctionCache) and "load_overload" not in vars(cache):
            cache.load_overload = types.MethodType(_load_cached, cache)
            n += 1
    return n
