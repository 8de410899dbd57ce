"""Coverage-guided fuzzing (atheris, libFuzzer) of the parsers that take bytes from the network or disk.

``python tests/fuzz/run_atheris.py [--seconds 60] [--targets blob,deltafile,...]`` runs each target
in its own process for a bounded time, with its address space capped (``RLIMIT_AS``, ``--max-mb``)
so a small input that makes a parser allocate without bound fails as a crash (MemoryError) instead
of taking the machine. A target may raise only the library's own errors (the ``deltasync.errors``
tree); any other exception is a crash: libFuzzer stops and writes the input to ``--artifacts``.
The seeds are real inputs (a blob, a delta file, a manifest, a safetensors shard, an event
stream, answer heads) made fresh at start. Exit status 0 when every target ran its time without a crash.
``make fuzz`` runs this; it needs the ``fuzz`` extra (``pip install -e '.[fuzz]'``).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ("blob", "deltafile", "manifest", "safetensors", "sse", "httphead")


def seeds(target: str) -> list[bytes]:
    """Valid inputs of each kind, for the fuzzer to mutate."""
    import torch

    from deltasync.codec import encode_delta
    from deltasync.deltafile import pack_delta_file
    from deltasync.sse import format_event
    from deltasync.tensorfile import save_shard

    g = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(300, generator=g).to(torch.bfloat16), "b": torch.randn(4, 6, generator=g)}
    new = {k: v.clone() for k, v in old.items()}
    new["a"].view(torch.int16)[[1, 7, 99]] += 1
    new["b"][1] = 0.5
    enc = encode_delta(old, new, model="m", version=2, parent=1)
    man = enc.manifest.sign(bytes(range(32)))
    if target == "blob":
        return list(enc.blobs.values())
    if target == "deltafile":
        return [pack_delta_file(man, enc.blobs)]
    if target == "manifest":
        return [man.to_json()]
    if target == "safetensors":
        return [save_shard(new), save_shard({"x": torch.zeros(3, dtype=torch.complex64)}, {"k": "v"})]
    if target == "httphead":
        # the first byte is the target's own (piece size, framing): see run_target
        return [b"\x00HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 100-130/131\r\nContent-Length: 31\r\n"
                b"Connection: keep-alive\r\n\r\nbody",
                b"\x83HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\nx-a: 2\r\n\r\n",
                b"\x05HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"]
    if target == "sse":
        return [b"".join([format_event("version", {"model": "m", "version": 3}, id="3"),
                          b": keepalive\r\n\r\n", b"data: a\rdata: b\r\n\n"])]
    raise ValueError(target)


def run_target(target: str) -> None:
    """Inside the capped child: instrument deltasync, then fuzz one parser until libFuzzer stops."""
    import atheris

    with atheris.instrument_imports(include=["deltasync"]):
        from deltasync.codec import decode_blob
        from deltasync.deltafile import unpack_delta_file
        from deltasync.errors import DeltaSyncError
        from deltasync.httphead import check_range, read_head
        from deltasync.manifest import parse_manifest
        from deltasync.sse import SSEDecoder
        from deltasync.tensorfile import load_shard

    key = bytes(range(32))

    def sse(data: bytes) -> None:
        dec = SSEDecoder(max_line=4096)
        cut = data[0] % 16 + 1 if data else 1
        for i in range(0, len(data), cut):
            for ev in dec.feed(data[i:i + cut]):
                try:
                    ev.json()
                except DeltaSyncError:
                    pass

    def httphead(data: bytes) -> None:
        # the first byte picks the piece size and whether 200s may be unframed; the rest is the answer, dripped
        # into a receive buffer as the callers do; a head read whole must be the head read in pieces
        cut, framed, data = (data[0] % 16 + 1, data[0] < 128, data[1:]) if data else (1, True, b"")
        buf = bytearray(len(data))
        try:
            whole = read_head(data, framed=framed)
        except DeltaSyncError:
            whole = None
        scanned = 0
        for end in [*range(cut, len(data), cut), len(data)]:
            buf[scanned:end] = data[scanned:end]
            got = read_head(buf, filled=end, scanned=scanned, framed=framed)
            if got is not None:
                assert got == whole, (got, whole)
                if got[0].status in (200, 206) and got[0].content_length is not None:
                    check_range(got[0], 0)
                return
            scanned = end
        assert whole is None

    fns = {
        "blob": decode_blob,
        "deltafile": lambda d: unpack_delta_file(d, verifier=key),
        "manifest": lambda d: parse_manifest(d, verifier=key),
        "safetensors": load_shard,
        "sse": sse,
        "httphead": httphead,
    }
    fn = fns[target]

    def one(data: bytes) -> None:
        try:
            fn(data)
        except DeltaSyncError:
            pass  # the library's own answer to bad bytes

    atheris.Setup(sys.argv, one)
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=60, help="fuzzing time per target (default 60)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--max-mb", type=int, default=6144, help="address-space cap per target process, MiB")
    ap.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()) / "deltasync-fuzz")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.child:
        sys.argv = [sys.argv[0], *rest]
        run_target(args.child)
        return 0
    failed = []
    for target in [t for t in args.targets.split(",") if t]:
        if target not in TARGETS:
            ap.error(f"unknown target {target!r}; one of {', '.join(TARGETS)}")
        corpus = args.artifacts / target / "corpus"
        crashes = args.artifacts / target / "crashes"
        corpus.mkdir(parents=True, exist_ok=True)
        crashes.mkdir(parents=True, exist_ok=True)
        for i, s in enumerate(seeds(target)):
            (corpus / f"seed-{i}").write_bytes(s)
        cap = args.max_mb << 20

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

        cmd = [sys.executable, __file__, "--child", target, str(corpus), f"-max_total_time={args.seconds}",
               "-max_len=65536", "-rss_limit_mb=0", "-timeout=20", f"-artifact_prefix={crashes}/", "-print_final_stats=1"]
        t0 = time.monotonic()
        r = subprocess.run(cmd, preexec_fn=limit, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        took = time.monotonic() - t0
        stats = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.startswith(("stat::number_of_executed_units", "#"))]
        runs = next((ln.split(":")[-1].strip() for ln in stats if ln.startswith("stat::number_of_executed_units")), "?")
        ok = r.returncode == 0
        print(f"{target}: {'ok' if ok else 'CRASH'} after {took:.0f} s, {runs} inputs", flush=True)
        if not ok:
            failed.append(target)
            print((r.stderr + r.stdout)[-4000:])
    if failed:
        print(f"crashes in {', '.join(failed)}; inputs under {args.artifacts}/<target>/crashes/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
