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

from deltasync.manifest import keyframe_stream

__all__ = ["MAX_LAYOUT_WALK", "keyframe_stream", "stream_layout"]


#: how far back ``stream_layout`` walks a stream's parents looking for a keyframe
MAX_LAYOUT_WALK = 256


async def stream_layout(client, model: str, head, verifier=None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of ``model`` at ``head`` (a parsed, verified manifest): name -> (dtype name, shape).

    A keyframe, or a format-2 delta, lists every tensor; a format-3 delta only those it changes
    (docs/FORMAT.md §5.3), so the layout comes from the side keyframe at the same version (same state
    fingerprint) or, failing that, from the keyframe the delta chain starts at (deltas never change the
    layout), walking back at most ``MAX_LAYOUT_WALK`` parents. ``client``: an HttpClient."""
    from deltasync.errors import DeltaSyncError, NotFoundError
    from deltasync.manifest import parse_manifest

    def whole(m) -> bool:
        return m.kind == "keyframe" or m.format < 3

    if whole(head):
        return {t.name: (t.dtype, tuple(t.shape)) for t in head.tensors}
    try:
        side = parse_manifest(await client.get_manifest(keyframe_stream(model), head.version), verifier=verifier)
        if side.kind == "keyframe" and side.state_fp == head.state_fp:
            return {t.name: (t.dtype, tuple(t.shape)) for t in side.tensors}
    except DeltaSyncError:
        pass
    m = head
    for _ in range(MAX_LAYOUT_WALK):
        if m.parent is None:
            break
        m = parse_manifest(await client.get_manifest(model, m.parent), verifier=verifier)
        if whole(m):
            return {t.name: (t.dtype, tuple(t.shape)) for t in m.tensors}
    raise NotFoundError(f"{model} v{head.version}: no keyframe found within {MAX_LAYOUT_WALK} versions to lay the "
                        "state out from (the servers' retention keeps none: publish a keyframe)")
