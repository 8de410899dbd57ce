"""The hand-off between the sync driver (event-loop thread) and the engine's thread: prepared steps, in order.

:class:`ReadyQueue` is the only object both threads touch. Its lock is held for a few
list operations, never during I/O, decoding or an apply, so the driver keeps
downloading while the engine holds ``hold()`` or is inside ``apply_pending()``.

Generations: every step is tagged with the generation it was prepared in. When an
apply fails, the engine's side calls ``invalidate()`` at once (the queue is emptied and
the generation bumped) and tells the machine the new generation; a step the driver
still delivers from the old generation is refused by ``push``, so no step prepared
against a state that was rolled back is ever applied.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch

from deltasync.apply import PreparedDelta
from deltasync.manifest import Manifest


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadyStep:
    """A version downloaded and decoded, waiting for the engine."""

    kind: str  # "delta" | "keyframe"
    version: int  # version after applying
    base: int | None  # version it applies to (None: keyframe)
    state_fp: str  # SIGNED state fingerprint of ``version``
    manifest: Manifest
    generation: int
    prepared: PreparedDelta | None = None
    state: dict[str, torch.Tensor] | None = None  # keyframe tensors (host)
    fps: dict[str, int] | None = None  # keyframe fingerprints
    nbytes: int = 0
    squashed: bool = False


class ReadyQueue:
    """Thread-safe FIFO of :class:`ReadyStep` with a generation; ``changed`` is notified on every
    push, pop and invalidation (waiters use it to wake up)."""

    def __init__(self) -> None:
        self.changed = threading.Condition(threading.Lock())
        self._steps: collections.deque[ReadyStep] = collections.deque()
        self.generation = 0

    def push(self, step: ReadyStep) -> bool:
        """Append ``step``; False (dropped) when it belongs to an older generation."""
        with self.changed:
            if step.generation != self.generation:
                return False
            self._steps.append(step)
            self.changed.notify_all()
            return True

    def pop(self, up_to: int | None = None) -> ReadyStep | None:
        """The oldest step (if its version is <= ``up_to``), or None."""
        with self.changed:
            if not self._steps or (up_to is not None and self._steps[0].version > up_to):
                return None
            return self._steps.popleft()

    def invalidate(self) -> int:
        """Drop every step and start a new generation; returns it."""
        with self.changed:
            self.generation += 1
            self._steps.clear()
            self.changed.notify_all()
            return self.generation

    def touch(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def wait(self, timeout: float) -> None:
        """Block until something changes or ``timeout`` passes."""
        with self.changed:
            self.changed.wait(timeout)

    def wait_for_steps(self, timeout: float) -> bool:
        """Block until a step waits (True) or ``timeout`` passes (False)."""
        with self.changed:
            return self.changed.wait_for(lambda: bool(self._steps), timeout)

    def steps(self) -> list[tuple[int | None, int]]:
        with self.changed:
            return [(s.base, s.version) for s in self._steps]

    def __len__(self) -> int:
        with self.changed:
            return len(self._steps)
