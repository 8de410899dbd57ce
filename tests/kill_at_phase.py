"""Test launcher: ``deltasync subscribe`` SIGKILLed at a chosen instant of an in-place apply.

``python tests/kill_at_phase.py PHASE subscribe ARGS...`` runs the real command and kills the process
(SIGKILL, no clean-up of any kind) the first time a delta's apply reaches PHASE:

* ``journal-torn``: half of the undo journal written (and flushed), the rest never;
* ``mid-patch``: the journal complete, some tensors of the delta patched in the map, others not;
* ``patched``: every word written and verified, the header not yet rewritten;
* ``header-torn``: the first half of the new header written into the map;
* ``header``: the new header written, the journal not yet removed;
* ``keyframe``: a keyframe (streamed, or copied by the subscriber) partly written into the new file
  beside F, not yet renamed.

Fault injection lives here, not in the library (nothing reads an environment variable for it).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from deltasync import apply as core_apply
from deltasync import kernels
from deltasync import tensorfile
from deltasync.client import cli, filetarget


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    phase = argv[0]
    args = cli.build_parser().parse_args(argv[1:])
    if args.command != "subscribe":
        raise SystemExit(f"kill_at_phase: only 'subscribe' is instrumented, not {args.command!r}")
    if phase == "journal-torn":
        real = filetarget._write_journal

        def torn(path, info, regions, payload):
            real(path, info, regions, payload)
            data = path.read_bytes()
            with open(path, "r+b") as f:
                f.truncate(len(data) // 2)
                os.fsync(f.fileno())
            die()
        filetarget._write_journal = torn
    elif phase == "mid-patch":
        real_patch = core_apply._patch_tensor

        def patch(*a, **k):
            fp = real_patch(*a, **k)  # this tensor's words are in the map; the others are not
            die()
            return fp
        core_apply._patch_tensor = patch
        real_jobs = kernels.patch_jobs

        def jobs(rows, like, old, fpds, w):  # the batched path: its first chunk's words in the map, no others
            real_jobs(rows[:1], like, old, fpds[:1], w)
            die()
        kernels.patch_jobs = jobs
    elif phase == "patched":
        real_commit = filetarget._JournaledPatch.commit

        def commit(self):  # every word written and verified; the header not yet rewritten
            die()
            real_commit(self)
        filetarget._JournaledPatch.commit = commit
    elif phase in ("header-torn", "header"):
        real_header = tensorfile.MappedTensorFile.write_header

        def header(self, data):
            if b'"patching"' in data[:512]:  # the mid-apply marker written before the patch: not this phase
                return real_header(self, data)
            if phase == "header-torn":
                self._mm[: len(data) // 2] = data[: len(data) // 2]
                die()
            real_header(self, data)
            die()
        tensorfile.MappedTensorFile.write_header = header
        real_meta = tensorfile.MappedTensorFile.write_metadata

        def metadata(self, meta):  # the header rewritten in place: only its metadata (FileTarget._write_meta)
            if meta.get("deltasync.state_fp") == "patching":  # the mid-apply marker: not this phase
                return real_meta(self, meta)
            if phase == "header-torn":
                new = json.dumps(dict(meta), separators=(",", ":")).encode()
                at = 8 + len(tensorfile._META_PREFIX)
                self._mm[at : at + len(new) // 2] = new[: len(new) // 2]
                die()
            done = real_meta(self, meta)
            if done:
                die()
            return done
        tensorfile.MappedTensorFile.write_metadata = metadata
    elif phase == "keyframe":
        real_add = filetarget.KeyframeWriter.add_received

        def add_received(self, sink):  # the streamed first version: a shard written, not renamed into place
            real_add(self, sink)
            die()
        filetarget.KeyframeWriter.add_received = add_received
        def copy(tensors, state, fps, **k):
            names = sorted(state)
            for n in names[: len(names) // 2]:
                tensors[n].copy_(state[n])
            die()
        filetarget.copy_state = copy
    else:
        raise SystemExit(f"kill_at_phase: unknown phase {phase!r}")

    return cli.cmd_subscribe(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
