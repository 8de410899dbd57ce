"""The interleaved-rANS prototype (benchmarks/proto_rans_interleaved.py, helper C, issue 10) stays exact.

It is a measurement tool, not a format: these checks keep its figures meaningful. N = 1 must write today's
``ans`` message byte for byte; N = 2 must decode (with its own kernel) to exactly the positions, raw flags
and values today's decoder gives for today's message, and refuse a message with a word missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from deltasync.kernels import rans

pytest.importorskip("numba")
pytestmark = pytest.mark.long  # compiles four prototype kernels (~40 s): `make test-long`, not `make test`

from deltasync.kernels import cpu as _cpu  # noqa: E402

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "proto_rans_interleaved.py"


@pytest.fixture(scope="module")
def gk(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("proto_rans_interleaved", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.kernels_module(tmp_path_factory.mktemp("proto-rans"))


def _chunk(seed: int, length: int, density: float):
    rng = np.random.default_rng(seed)
    rel = np.flatnonzero(rng.random(length) < density).astype(np.int64)
    if rel.size == 0:
        rel = np.array([0], np.int64)
    old = rng.integers(0, 1 << 16, rel.size, dtype=np.uint16)
    kind = rng.random(rel.size)
    step = np.where(kind < 0.8, 1, np.where(kind < 0.95, rng.integers(2, 9, rel.size), rng.integers(9, 400, rel.size)))
    new = (old.astype(np.int64) + np.where(rng.random(rel.size) < 0.5, step, -step)) % (1 << 16)
    new = new.astype(np.uint16)
    new = np.where(new == old, old ^ np.uint16(1), new)
    gcount = np.zeros(rans.N_GAP, np.int64)
    vcount = np.zeros(rans.N_VAL, np.int64)
    sym, bn, bm, raw, zero = rans.word_symbols(rel, 0, old, new, 200, True, gcount, vcount)
    assert not zero
    return rel, sym, bn, bm, raw, rans.tables(rans.normalize(gcount)), rans.tables(rans.normalize(vcount))


@pytest.mark.parametrize("seed,length,density", [(1, 1, 1.0), (2, 5, 0.9), (3, 20_000, 0.01), (4, 6000, 0.3)])
def test_prototype_matches_todays_coder(gk, seed, length, density):
    rel, sym, bn, bm, raw, (gf, gc, gl), (vf, vc, vl) = _chunk(seed, length, density)
    today = rans.encode_chunk_pos(rel, 0, sym, bn, bm, gf, gc, vf, vc)
    assert np.array_equal(gk.enc_r1(rel, 0, sym, bn, bm, gf, gc, vf, vc), today)
    gtab, vtab = _cpu.ans_slot_table(gf, gc, gl), _cpu.ans_slot_table(vf, vc, vl)
    n = rel.size
    want = [np.empty(n, np.int64), np.empty(n, np.bool_), np.empty(n, np.uint16)]
    jobs = np.array([(0, today.size, n, length, 0, 0, raw.size, 0)], np.int64)
    assert _cpu.ans_decode_chunks(today, jobs, gtab, vtab, raw, *want, 16)[0] == 0
    msg = gk.enc_r2(rel, 0, sym, bn, bm, gf, gc, vf, vc)
    got = [np.zeros(n, np.int64), np.zeros(n, np.bool_), np.zeros(n, np.uint16)]
    assert gk.dec_r2(msg, 0, msg.size, n, length, 0, gtab, vtab, raw, 0, raw.size, *got, 0, 16) == 0
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert gk.dec_r2(msg[:-1], 0, msg.size - 1, n, length, 0, gtab, vtab, raw, 0, raw.size, *got, 0, 16) != 0
