"""``subscribe --out`` as a library (client/fileout.py), without the command line: the first-version wait, the
keyframe streamed into a new file, resuming a file this stream wrote, replacing one it did not, a journal left
by a killed apply rolled back first, and the deadline's outcome. A real origin (LocalCluster), a real Publisher,
real safetensors files."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from deltasync.apply import prepare_delta
from deltasync.cli.cluster import LocalCluster
from deltasync.client.fileout import FileOptions, follow_file
from deltasync.client.filetarget import FileTarget, journal_path
from deltasync.client.http import Timeouts
from deltasync.client.publisher import Publisher
from deltasync.codec import encode_delta
from deltasync.fingerprint import tensor_fingerprint
from deltasync.tensorfile import read_state_file
from deltasync.testing.trace import ModelShape, RLTrace
from core_support import same_state

KEY = bytes(range(5, 37))
SHAPE = ModelShape(vocab=128, hidden=32, layers=2, ffn=64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("fileout"), key=KEY)
    try:
        c.start_tree({})
        yield c
    finally:
        c.close()


def _opts(cluster, model, out, said=None, **kw) -> FileOptions:
    kw.setdefault("timeout", 60.0)
    kw.setdefault("deadline", time.monotonic() + kw["timeout"])
    return FileOptions(sources=[cluster.origin], model=model, out=out, timeouts=Timeouts(poll=2.0), verifier=KEY,
                       say=(said.append if said is not None else (lambda text: None)), **kw)


def _run(opts):
    return asyncio.run(follow_file(opts))


def test_a_new_file_waits_for_the_first_version_then_follows_to_until(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=1)
    states = [trace.step() for _ in range(3)]
    out = tmp_path / "w.safetensors"
    said: list[str] = []
    with Publisher(cluster.origin, "first", cluster.token, KEY, keyframe_every=0) as pub:
        def later():  # nothing is published when the file subscriber starts
            time.sleep(1.0)
            for v, s in enumerate(states):
                pub.publish(v, s)
            pub.flush(60)

        t = threading.Thread(target=later)
        t.start()
        try:
            outcome = _run(_opts(cluster, "first", out, said, until=2))
        finally:
            t.join()
    assert (outcome.status, outcome.version, outcome.message) == (0, 2, None)
    got = read_state_file(out)
    assert same_state(got, states[2])
    assert any("(keyframe, streamed)" in line for line in said), said  # v0 went straight into the new file


def test_a_file_this_stream_wrote_resumes_and_once_ends_at_the_newest_head(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=2)
    out = tmp_path / "w.safetensors"
    with Publisher(cluster.origin, "resume", cluster.token, KEY, keyframe_every=0) as pub:
        s0, s1 = trace.step(), trace.step()
        pub.publish(0, s0)
        pub.publish(1, s1)
        pub.flush(60)
        assert _run(_opts(cluster, "resume", out, until=1)).version == 1
        s2, s3 = trace.step(), trace.step()
        pub.publish(2, s2)
        pub.publish(3, s3)
        pub.flush(60)
        said: list[str] = []
        outcome = _run(_opts(cluster, "resume", out, said, once=True))
    assert (outcome.status, outcome.version) == (0, 3)
    assert f"{out}: holds resume v1; resuming" in said
    assert same_state(read_state_file(out), s3)


def test_a_file_of_something_else_is_replaced_and_a_left_journal_is_rolled_back_first(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=3)
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.ones(3)}, str(other))  # not written by deltasync subscribe
    with Publisher(cluster.origin, "repl", cluster.token, KEY, keyframe_every=0) as pub:
        s0, s1 = trace.step(), trace.step()
        pub.publish(0, s0)
        pub.flush(60)
        said: list[str] = []
        assert _run(_opts(cluster, "repl", other, said, until=0)).version == 0
        assert any("resyncing" in line for line in said), said
        assert same_state(read_state_file(other), s0)
        # a run killed mid-apply: the file half-patched towards v1, its undo journal beside it
        pub.publish(1, s1)
        pub.flush(60)
        died = {}

        def die(version):
            died["v"] = version
            raise KeyboardInterrupt  # dies just before writing: nothing written, nothing to roll back yet

        with pytest.raises(KeyboardInterrupt):
            _run(_opts(cluster, "repl", other, until=1, on_applied=die))
        assert died == {"v": 1} and not journal_path(other).exists()
        assert same_state(read_state_file(other), s0)
        # a real half-written step, as a process killed mid-apply leaves it: the words patched towards v1, the
        # undo journal beside the file, no commit
        t = FileTarget(other, "repl")
        enc = encode_delta(s0, s1, model="repl", version=1, parent=0)
        staged = t.stage_delta(prepare_delta(enc.manifest, enc.blobs), {n: tensor_fingerprint(v) for n, v in s0.items()},
                               verify="incremental")
        t.close()
        del staged
        assert journal_path(other).exists()
        said = []
        outcome = _run(_opts(cluster, "repl", other, said, until=1))
        assert any("rolled back the unfinished v1 to v0 (undo journal)" in line for line in said), said
    assert (outcome.status, outcome.version) == (0, 1)
    assert same_state(read_state_file(other), s1) and not journal_path(other).exists()


def test_the_deadline_ends_the_run_with_the_last_error_and_the_version_held(cluster, tmp_path):
    trace = RLTrace(SHAPE, lr=1e-4, seed=4)
    out = tmp_path / "w.safetensors"
    with Publisher(cluster.origin, "late", cluster.token, KEY, keyframe_every=0) as pub:
        pub.publish(0, trace.step())
        pub.flush(60)
        t0 = time.monotonic()
        outcome = _run(_opts(cluster, "late", out, until=5, timeout=3.0))
    assert outcome.status == 1 and outcome.version == 0
    assert "still at v0 after 3s (wanted v5" in outcome.message
    assert time.monotonic() - t0 < 15


def test_a_rollback_after_committed_deltas_restores_the_last_committed_version_in_the_header(cluster, tmp_path):
    """The target's version follows every committed delta: a later delta rolled back leaves the header at the
    version the file holds (and its journal says so), not at the version the file was opened or created at."""
    from deltasync.tensorfile import MappedTensorFile

    trace = RLTrace(SHAPE, lr=1e-4, seed=11)
    out = tmp_path / "rb.safetensors"
    with Publisher(cluster.origin, "rollb", cluster.token, KEY, keyframe_every=0) as pub:
        s0, s1, s2 = trace.step(), trace.step(), trace.step()
        pub.publish(0, s0)
        pub.flush(60)
        assert _run(_opts(cluster, "rollb", out, until=0)).version == 0
    t = FileTarget(out, "rollb")
    try:
        e1 = encode_delta(s0, s1, model="rollb", version=1, parent=0)
        t.stage_delta(prepare_delta(e1.manifest, e1.blobs), {n: tensor_fingerprint(v) for n, v in s0.items()},
                      verify="incremental").commit()
        assert t.version == 1
        e2 = encode_delta(s1, s2, model="rollb", version=2, parent=1)
        staged = t.stage_delta(prepare_delta(e2.manifest, e2.blobs), {n: tensor_fingerprint(v) for n, v in s1.items()},
                               verify="incremental")
        staged.rollback()
        assert t.version == 1
    finally:
        t.close()
    f = MappedTensorFile(out)
    try:
        meta = f.metadata
    finally:
        f.close()
    assert meta["deltasync.version"] == "1" and meta["deltasync.state_fp"] == e1.manifest.state_fp
    assert same_state(read_state_file(out), s1) and not journal_path(out).exists()
