"""Stream naming: where a model's versions and its side keyframes live.

A model stream ``M`` carries one manifest per version: a keyframe for the first
version (and after a layout change or a failed upload), deltas for every other.
Periodic keyframes go to a *side stream* ``M.kf`` under the same version numbers, so
live subscribers keep receiving only deltas while a new or far-behind subscriber can
start from a recent keyframe (``M.kf`` version v holds exactly the state of ``M``
version v: the same state fingerprint, which the subscriber checks).

Why not keyframes in ``M`` itself: a keyframe version leaves subscribers that are
one step behind no delta to apply, so every K steps the whole fleet would download
the full model (with K at most the servers' retention window, that can cost more than
all deltas together).
"""

from __future__ import annotations

from deltasync.manifest import MODEL_RE

SIDE_SUFFIX = ".kf"


def keyframe_stream(model: str) -> str:
    """The side stream holding ``model``'s periodic keyframes."""
    name = model + SIDE_SUFFIX
    if not MODEL_RE.match(name):
        raise ValueError(f"model name {model!r} is too long for a keyframe side stream ({name!r})")
    return name
