"""Prototype (helper C, issue 10): does interleaving rANS states pay? Not part of the format.

Today's ``ans`` chunk (docs/FORMAT.md §4.3) is one rANS message with ONE state: every coded symbol of the
chunk depends on the one before (a serial chain). This measures the classic interleaved rANS (Giesen's
ryg_rans): N states per chunk, change ``i`` coded on state ``i % N`` (all its symbols), encoded in reverse,
decoded forward. Each state has its own word stream, so the N chains share nothing but the change counter
(a shared stream couples them: the next state's refill must wait for the previous state's whole change).
Message layout of the prototype: N states (2 words each), N-1 stream lengths (2 words each), the N
streams. N = 1 is byte for byte today's message.

The kernels are written once as templates and generated for N = 1..4 into a scratch module (the N states
are rotated through locals, so the per-change body appears once); they are checked here against today's
``rans.encode_chunk_pos`` / ``kernels.cpu.ans_decode_chunks`` outputs. The prototype encoder renormalises
without a branch (as today's decoder does). Timing: every chunk coded/decoded by every variant in turn,
``--reps`` times, the minimum per chunk summed (so a load spike hits one sample, not one variant).

    .venv/bin/python benchmarks/proto_rans_interleaved.py [--params 20000000] [--reps 15]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ENC = '''
@numba.njit(cache=True, nogil=True)
def enc_rN(positions, start, vsym, bigneg, bigmag, gf, gc, vf, vc):
    n = positions.size
    per = (n + NST - 1) // NST
    cap = 14 * per + 16
    out = np.empty(NST * cap, dtype=np.uint16)
    gcm, grc = _recips(gf)
    vcm, vrc = _recips(vf)
    nb = bigmag.size
    # state k writes backward from (k + 1) * cap; change i uses state i % NST; x0/at0 = change i's state
    INIT
    for i in range(n - 1, -1, -1):
        x = x0
        at = at0
        s = vsym[i]
        if s == BIG:
            nb -= 1
            m = bigmag[nb]
            q = _bits(m)
            r = q - 1
            if r > 0:
                for j in range((r + PREC - 1) // PREC - 1, -1, -1):
                    kk = min(PREC, r - j * PREC)
                    piece = (m >> _U(j * PREC)) & ((_U(1) << _U(kk)) - _U(1))
                    em = x >= (_U(1) << _U(32 - kk))
                    out[at - 1] = np.uint16(x & _U(0xFFFF))
                    at -= 1 if em else 0
                    x = (x >> _U(16)) if em else x
                    x = (x << _U(kk)) + piece
            em = x >= (_U(1) << _U(24))
            out[at - 1] = np.uint16(x & _U(0xFFFF))
            at -= 1 if em else 0
            x = (x >> _U(16)) if em else x
            x = (x << _U(8)) + _U((q << 1) | (1 if bigneg[nb] else 0))
        f = _U(vf[s])
        em = x >= (f << _U(20))
        out[at - 1] = np.uint16(x & _U(0xFFFF))
        at -= 1 if em else 0
        x = (x >> _U(16)) if em else x
        if f == _U(1):
            x = (x << _U(PREC)) + _U(vc[s])
        else:
            x = x + _U(vc[s]) + _mulhi(x, vrc[s]) * vcm[s]
        g = positions[i] - (positions[i - 1] if i > 0 else start - 1) - 1
        ug = _U(g)
        b = _bits(ug)
        r = b - 1
        if r > 0:
            for j in range((r + PREC - 1) // PREC - 1, -1, -1):
                kk = min(PREC, r - j * PREC)
                piece = (ug >> _U(j * PREC)) & ((_U(1) << _U(kk)) - _U(1))
                em = x >= (_U(1) << _U(32 - kk))
                out[at - 1] = np.uint16(x & _U(0xFFFF))
                at -= 1 if em else 0
                x = (x >> _U(16)) if em else x
                x = (x << _U(kk)) + piece
        f = _U(gf[b])
        em = x >= (f << _U(20))
        out[at - 1] = np.uint16(x & _U(0xFFFF))
        at -= 1 if em else 0
        x = (x >> _U(16)) if em else x
        if f == _U(1):
            x = (x << _U(PREC)) + _U(gc[b])
        else:
            x = x + _U(gc[b]) + _mulhi(x, grc[b]) * gcm[b]
        ROTE
    xs = np.empty(NST, np.uint64)
    ats = np.empty(NST, np.int64)
    FINAL
    total = 2 * NST + 2 * (NST - 1)
    for k in range(NST):
        total += (k + 1) * cap - ats[k]
    msg = np.empty(total, np.uint16)
    for k in range(NST):
        msg[2 * k] = np.uint16(xs[k] & _U(0xFFFF))
        msg[2 * k + 1] = np.uint16(xs[k] >> _U(16))
    w = 2 * NST
    for k in range(NST - 1):
        ln = (k + 1) * cap - ats[k]
        msg[w] = ln & 0xFFFF
        msg[w + 1] = ln >> 16
        w += 2
    for k in range(NST):
        ln = (k + 1) * cap - ats[k]
        msg[w:w + ln] = out[ats[k]:(k + 1) * cap]
        w += ln
    return msg
'''
DEC = '''
@numba.njit(cache=True, nogil=True)
def dec_rN(ans, w0, nw, count, length, start, gtab, vtab, raws, r0, nr, pos, rawf, vals, o, bits):
    mask_w = ~np.uint64(0) if bits == 64 else (np.uint64(1) << np.uint64(bits)) - _U1
    bigmax = (np.uint64(1) << np.uint64(bits - 1)) - np.uint64(1 + SMALL)
    hdr = 2 * NST + 2 * (NST - 1)
    if nw < hdr:
        return 1
    DINIT
    p = np.int64(-1)
    ir = 0
    too_big = False
    for i in range(count):
        x = x0
        at = at0
        e = np.int64(gtab[x & _A_SLOTS])
        b = e & 63
        x = ((e >> 6) & 0x1FFF) * (x >> PREC) + (e >> 19)
        nx = (x << 16) | (np.int64(ans[min(at, lastall)]))
        lo = x < L
        x = nx if lo else x
        at += 1 if lo else 0
        k = b - 1 if b >= 1 else 0
        kk = k if k < PREC else PREC
        g = x & ((np.int64(1) << kk) - 1)
        x >>= kk
        nx = (x << 16) | (np.int64(ans[min(at, lastall)]))
        lo = x < L
        x = nx if lo else x
        at += 1 if lo else 0
        k -= kk
        sh = kk
        while k > 0:
            kk = k if k < PREC else PREC
            g |= (x & ((np.int64(1) << kk) - 1)) << sh
            x >>= kk
            if x < L:
                x <<= 16
                x |= np.int64(ans[min(at, lastall)])
                at += 1
            sh += kk
            k -= kk
        if b >= 1:
            g |= np.int64(1) << (b - 1)
        p += g + 1
        if p >= length or b > 48:
            return 4
        pos[o + i] = start + p
        e = np.int64(vtab[x & _A_SLOTS])
        s = e & 63
        x = ((e >> 6) & 0x1FFF) * (x >> PREC) + (e >> 19)
        nx = (x << 16) | (np.int64(ans[min(at, lastall)]))
        lo = x < L
        x = nx if lo else x
        at += 1 if lo else 0
        if s < BIG:
            rawf[o + i] = False
            mag = np.uint64(s >> 1) + _U1
            vals[o + i] = ((~mag + _U1) & mask_w) if (s & 1) == 1 else mag
        elif s == RAW:
            rawf[o + i] = True
            if ir < nr:
                vals[o + i] = raws[r0 + ir]
            ir += 1
        else:
            rawf[o + i] = False
            v8 = x & 0xFF
            x >>= 8
            if x < L:
                x <<= 16
                x |= np.int64(ans[min(at, lastall)])
                at += 1
            q = v8 >> 1
            if q > 64:
                return 2
            m = np.uint64(0)
            if q >= 1:
                k = q - 1
                sh = 0
                while k > 0:
                    kk = k if k < PREC else PREC
                    m |= np.uint64(x & ((np.int64(1) << kk) - 1)) << np.uint64(sh)
                    x >>= kk
                    if x < L:
                        x <<= 16
                        x |= np.int64(ans[min(at, lastall)])
                        at += 1
                    sh += kk
                    k -= kk
                m |= np.uint64(1) << np.uint64(q - 1)
            if m > bigmax:
                too_big = True
            mag = m + np.uint64(1 + SMALL)
            vals[o + i] = ((~mag + _U1) & mask_w) if (v8 & 1) == 1 else (mag & mask_w)
        ROTD
    DFINAL
    if ir != nr or too_big:
        return 40
    return 0
'''



HEAD = '''"""Generated by benchmarks/proto_rans_interleaved.py (do not edit)."""
import numpy as np
import numba
from deltasync.kernels.rans import bit_length as _bits, _mulhi, _recips, PREC, L, BIG, RAW, SMALL
_U = np.uint64
_U1 = np.uint64(1)
_A_SLOTS = (1 << PREC) - 1
'''


def gen(n):
    xs = ", ".join(f"x{k}" for k in range(n))
    ats = ", ".join(f"at{k}" for k in range(n))
    # INIT: the variable slot j holds the state of change i - j (mod n) at loop top, for i = n_changes - 1
    init = ["st = (n - 1) % NST"]
    for j in range(n):
        init.append(f"k{j} = (st - {j}) % NST")
        init.append(f"x{j} = _U(L)")
        init.append(f"at{j} = (k{j} + 1) * cap")
    init = "\n    ".join(init)
    # after processing change i with slot 0 (x, at): slots shift: new slot j = old slot j+1, new last = (x, at)
    rot_x = ", ".join([f"x{k}" for k in range(1, n)] + ["x"])
    rot_a = ", ".join([f"at{k}" for k in range(1, n)] + ["at"])
    rote = f"{xs}{',' if n == 1 else ''} = {rot_x}{',' if n == 1 else ''}\n        {ats}{',' if n == 1 else ''} = {rot_a}{',' if n == 1 else ''}"
    # FINAL: after change 0, slot j holds the state of change -1 - j, i.e. state (-1 - j) % NST
    fin = []
    for j in range(n):
        fin.append(f"xs[({n - 1} - {j}) % NST] = x{j}")
        fin.append(f"ats[({n - 1} - {j}) % NST] = at{j}")
    fin = "\n    ".join(fin)
    # decoder: slot j = state j at start (change 0 uses state 0)
    dinit = ["at = w0 + hdr", "lastall = w0 + nw - 1"]
    for k in range(n):
        dinit.append(f"x{k} = np.int64(ans[w0 + {2 * k}]) | (np.int64(ans[w0 + {2 * k + 1}]) << 16)")
    for k in range(n):
        if k < n - 1:
            dinit.append(f"ln = np.int64(ans[w0 + {2 * n + 2 * k}]) | (np.int64(ans[w0 + {2 * n + 2 * k + 1}]) << 16)")
        else:
            dinit.append("ln = w0 + nw - at")
        dinit.append(f"at{k} = at")
        dinit.append(f"last{k} = at + ln - 1")
        dinit.append("at += ln")
    dinit.append("if at != w0 + nw or ln < 0:\n        return 1")
    dinit = "\n    ".join(dinit)
    lasts = ", ".join(f"last{k}" for k in range(n))
    c = ',' if n == 1 else ''
    rotd = f"{xs}{c} = {rot_x}{c}\n        {ats}{c} = {rot_a}{c}"
    dfin = " or ".join(f"x{k} != L or at{k} != last{k} + 1" for k in range(n))
    back_x = ", ".join(["x"] if False else [f"x{n - 1}"] + [f"x{k}" for k in range(n - 1)])
    back_a = ", ".join([f"at{n - 1}"] + [f"at{k}" for k in range(n - 1)])
    dfin = (f"for _ in range(count % {n}):\n        {xs}{c} = {back_x}{c}\n        {ats}{c} = {back_a}{c}\n    "
            f"if {dfin}:\n        return 3")
    e = ENC.replace("enc_rN", f"enc_r{n}").replace("INIT", init).replace("ROTE", rote).replace("FINAL", fin).replace("NST", str(n))
    d = DEC.replace("dec_rN", f"dec_r{n}").replace("DINIT", dinit).replace("ROTD", rotd).replace("DFINAL", dfin).replace("NST", str(n))
    return e + d


def kernels_module(where: Path):
    """The generated kernels (N = 1..4) as an importable module in ``where`` (numba caches next to it)."""
    src = HEAD + "".join(gen(n) for n in (1, 2, 3, 4))
    path = where / "rans_interleaved_gen.py"
    if not path.exists() or path.read_text() != src:
        path.write_text(src)
    sys.path.insert(0, str(where))
    return importlib.import_module("rans_interleaved_gen")


def trace_chunks(params: int, target: float):
    """bench_codec's trace (RLTrace, bf16, Adam) at ``target`` unchanged: per 4 Mi-word chunk the symbols
    of today's coder, and the blob's tables."""
    import torch

    from deltasync.kernels import rans
    from deltasync.testing.trace import RLTrace, lr_for_unchanged, shape_for_params

    shape = shape_for_params(params)
    tr = RLTrace(shape, lr=lr_for_unchanged(target, shape), seed=7)
    tr.step()
    a, b = tr.step(), tr.step()
    chunks = []
    gcount = np.zeros(rans.N_GAP, np.int64)
    vcount = np.zeros(rans.N_VAL, np.int64)
    for k in a:
        ow = a[k].reshape(-1).view(torch.int16).numpy().view(np.uint16)
        nw = b[k].reshape(-1).view(torch.int16).numpy().view(np.uint16)
        for s0 in range(0, ow.size, 4 << 20):
            o, n = ow[s0:s0 + (4 << 20)], nw[s0:s0 + (4 << 20)]
            rel = np.flatnonzero(o != n).astype(np.int64)
            if rel.size:
                sym, bn, bm, raw, _ = rans.word_symbols(rel, 0, o[rel], n[rel], 200, True, gcount, vcount)
                chunks.append((rel, o.size, sym, bn, bm, raw))
    return chunks, rans.tables(rans.normalize(gcount)), rans.tables(rans.normalize(vcount))


def per_chunk_minima(fns: dict, n: int, reps: int) -> dict:
    tot = {k: 0.0 for k in fns}
    for j in range(n):
        best = {k: float("inf") for k in fns}
        for _ in range(reps):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f(j)
                best[k] = min(best[k], time.perf_counter() - t0)
        for k in fns:
            tot[k] += best[k]
    return tot


def run(params: int = 20_000_000, reps: int = 15, where: Path | None = None) -> str:
    import os

    import torch

    from deltasync.kernels import rans
    from deltasync.kernels import cpu as _cpu

    torch.set_num_threads(1)
    where = where or Path(tempfile.gettempdir()) / "deltasync-proto-rans"
    where.mkdir(exist_ok=True)
    gk = kernels_module(where)
    out = [f"Interleaved rANS prototype: {params / 1e6:.0f}M-parameter bf16 trace, 1 thread, ns per change "
           f"(sum of per-chunk minima of {reps}, variants interleaved), load average {os.getloadavg()[0]:.1f} at start", "",
           "| unchanged | changes | coder | today (1 state) | N=1 | N=2 | N=3 | N=4 | best N vs today | words N=2 vs today |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for target in (0.99, 0.95):
        chunks, (gf, gc, gl), (vf, vc, vl) = trace_chunks(params, target)
        gtab, vtab = _cpu.ans_slot_table(gf, gc, gl), _cpu.ans_slot_table(vf, vc, vl)
        nch = sum(c[0].size for c in chunks)
        enc = {"today": lambda c: rans.encode_chunk_pos(c[0], 0, c[2], c[3], c[4], gf, gc, vf, vc)}
        for n in (1, 2, 3, 4):
            enc[n] = (lambda fn: lambda c: fn(c[0], 0, c[2], c[3], c[4], gf, gc, vf, vc))(getattr(gk, f"enc_r{n}"))
        msgs = {k: [f(c) for c in chunks] for k, f in enc.items()}
        if not all(np.array_equal(x, y) for x, y in zip(msgs[1], msgs["today"])):
            raise AssertionError("the N=1 prototype is not today's message")
        t_enc = per_chunk_minima({k: (lambda f: lambda j: f(chunks[j]))(f) for k, f in enc.items()}, len(chunks), reps)
        # decode: today's kernel one job row at a time, the prototype one chunk at a time, same outputs
        pos = np.empty(nch, np.int64)
        rawf = np.empty(nch, np.bool_)
        vals = np.empty(nch, np.uint16)
        allraw = np.concatenate([c[5] for c in chunks])
        ro = np.cumsum([0] + [c[5].size for c in chunks])
        oo = np.cumsum([0] + [c[0].size for c in chunks])
        ans1 = np.concatenate(msgs["today"])
        w1 = np.cumsum([0] + [m.size for m in msgs["today"]])
        jobs = np.array([(w1[j], msgs["today"][j].size, c[0].size, c[1], 0, ro[j], c[5].size, oo[j])
                         for j, c in enumerate(chunks)], np.int64)
        dec = {"today": lambda j: _cpu.ans_decode_chunks(ans1, jobs[j:j + 1], gtab, vtab, allraw, pos, rawf, vals, 16)[0]}
        for n in (1, 2, 3, 4):
            ansn = np.concatenate(msgs[n])
            wn = np.cumsum([0] + [m.size for m in msgs[n]])
            dec[n] = (lambda fn, ansn, wn, n: lambda j: fn(ansn, wn[j], msgs[n][j].size, chunks[j][0].size, chunks[j][1], 0,
                                                          gtab, vtab, allraw, ro[j], chunks[j][5].size, pos, rawf, vals,
                                                          oo[j], 16))(getattr(gk, f"dec_r{n}"), ansn, wn, n)
        ref = None
        for k, f in dec.items():
            pos[:] = 0
            errs = [f(j) for j in range(len(chunks))]
            got = (pos.copy(), rawf.copy(), vals.copy())
            if any(errs) or (ref is not None and not all(np.array_equal(x, y) for x, y in zip(ref, got))):
                raise AssertionError(f"decoder {k} differs from today's")
            ref = ref or got
        t_dec = per_chunk_minima(dec, len(chunks), reps)
        words = {k: sum(m.size for m in v) for k, v in msgs.items()}
        for name, t in (("encode", t_enc), ("decode", t_dec)):
            ns = {k: v / nch * 1e9 for k, v in t.items()}
            bestn = min((1, 2, 3, 4), key=lambda k: ns[k])
            out.append(f"| {target:.0%} | {nch:,} | {name} | {ns['today']:.1f} | {ns[1]:.1f} | {ns[2]:.1f} | {ns[3]:.1f} | "
                       f"{ns[4]:.1f} | {ns['today'] / ns[bestn]:.2f}x (N={bestn}) | "
                       f"+{(words[2] / words['today'] - 1) * 100:.2f}% |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=20_000_000)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    print(run(args.params, args.reps))
