"""Stopping an apply between pieces of its work: a signal or a deadline, seen by a check the core calls.

An apply runs on the thread that calls ``apply_pending`` (for ``subscribe`` the event loop's thread) and can
be long (a state of very many small tensors); while it runs the loop sees neither a signal nor a deadline.
:class:`Interrupt` is a flag set from a signal handler (Python runs it on the main thread between two
bytecodes, so it is set while the apply is running) plus an optional deadline; the core calls
:meth:`Interrupt.check` between pieces of the work (``deltasync.apply.stage_prepared(check=)``, every
``CHECK_EVERY`` tensors), which raises :class:`~deltasync.errors.ApplyInterrupted`: the apply rolls back
(every word restored, the file's undo journal dropped) and the caller stops. A check costs a flag test and a
clock read: nothing next to a tensor's patch.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from deltasync.errors import ApplyInterrupted

__all__ = ["Interrupt"]


class Interrupt:
    """Set by :meth:`set` (or past ``deadline``, a ``time.monotonic()`` value); :meth:`check` raises then."""

    def __init__(self, *, deadline: float | None = None, what_deadline: str = "--timeout") -> None:
        self.deadline = deadline
        self.what_deadline = what_deadline
        self.why: str | None = None  # "SIGTERM", "SIGINT" once a signal came

    def set(self, signum: int) -> None:
        self.why = signal.Signals(signum).name

    @property
    def signalled(self) -> bool:
        return self.why is not None

    def check(self) -> None:
        if self.why is not None:
            raise ApplyInterrupted(f"{self.why} received")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ApplyInterrupted(f"{self.what_deadline} passed")

    def install(self, on_signal: Callable[[], None], signals=(signal.SIGTERM, signal.SIGINT)) -> None:
        """Handle ``signals`` (main thread only): set the flag, then ``on_signal()`` (which must be safe to call
        from a signal handler, e.g. ``loop.call_soon_threadsafe(event.set)``, which also wakes the loop)."""
        def handler(signum, frame) -> None:
            self.set(signum)
            on_signal()

        for sig in signals:
            signal.signal(sig, handler)
