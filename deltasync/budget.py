"""Budgeted deltas: at most B wire bytes a step, a served view every subscriber holds bit-exactly.

A budgeted stream does not ship the trainer's state; it ships steps toward it. The
publisher keeps the **served view** (the state every subscriber holds) and each step
diffs it against the trainer's state: the *residual* ``trainer - served``. This module
decides, with no I/O, which part of that residual the next delta carries:

1. **Rank** every owed word (a word where served and trainer differ). Its *distance*
   is how far apart the two are in ULPs of the served value (for floats the distance
   between the two in the ordered integer line of the dtype, so it is also defined
   across zero; for integers the size of the step). Words owed for
   ``max_owed_steps`` versions in a row are **due** and go first, whatever their
   distance; then the rest, largest distance first, the oldest first among equals.
2. **Fit** the longest prefix of that order whose encoded delta (canonical manifest,
   counted as if signed, plus blobs) fits ``BudgetPolicy.bytes``. The size is measured
   by encoding, not guessed: the first try is the whole residual (when it fits the
   delta is byte-for-byte the lossless one), then a few interpolation steps.
3. **Quantize** (``step_bits=k``, only when the budget binds): a selected, not-due float step of ``d`` ULPs with
   the same sign on both sides is rounded toward zero to ``k`` significant bits (e.g.
   ``k=2``: 1, 2, 3, 4, 6, 8, 12, ...), which makes step tokens cheaper to code. The
   served word becomes ``old + q`` exactly, always between the old served value and
   the trainer's, so the residual only shrinks. Due words and sign changes are sent
   exactly (raw).
4. **Carry the rest forward** (error feedback): whatever a delta leaves is still
   owed and is diffed again next step, with its age.

The sent part is a :class:`~deltasync.codec.StateDiff` from the served view to the
next served view, with that view's fingerprints: every manifest describes exactly
what subscribers will hold, so they verify bit-exactly and need no change.

Guarantees (tested in tests/core/test_core_budget.py):

- every delta's wire bytes are at most ``bytes`` (unless even a delta with no change
  does not fit: then that empty delta is sent and ``over_budget`` is reported);
- no word stays owed more than ``max_owed_steps`` versions in a row while the due
  words fit the budget (``late`` counts the due words a too-small budget left behind;
  they stay first in line);
- once the trainer stops changing, the served view equals the trainer's state bit for
  bit: each version ships at least one owed word (at least ``bytes`` minus the manifest
  of residual), in practice within ``max_owed_steps + 3 * owed_bytes / (bytes -
  manifest) + 2`` versions (a scattered part of the residual costs up to ~3x per word
  what the whole costs: positions).

The fixed cost of a delta is its manifest (one record per tensor) and, per touched
chunk, a blob-header record and a chunk reference (~200 bytes): a budget near that size
ships few words ("within one blob's framing").

A budgeted stream's manifests carry ``meta["deltasync.budget"]`` (the budget) and
``meta["deltasync.residual"]`` (a JSON summary, :class:`ResidualReport.meta`); the
format is otherwise unchanged (docs/FORMAT.md §9). Budget ``None`` is the lossless
stream and adds nothing.

Not thread-safe: one :class:`Budgeter` per stream, called in version order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .codec import ChunkDiff, EncodeOptions, Encoded, StateDiff, encode_diff
from .dtypes import dtype_info
from .fingerprint import fingerprint_delta, update_fingerprint
from .manifest import Manifest

META_BUDGET = "deltasync.budget"
META_RESIDUAL = "deltasync.residual"
# counted as if signed (manifest format 2): '"signature":"ed25519:<128 hex>"' is 134 bytes longer than
# '"signature":null', and '"key_id":"ed25519:<16 hex>"' 22 longer than '"key_id":null' (HMAC: less)
SIGNATURE_RESERVE = 160
DIGEST_RESERVE = 72  # per blob: '"digest":"blake3:<64 hex>"' is 69 bytes longer than '"digest":null'
META_RESERVE = 16  # room for a final max_rel written longer than the probe's (e.g. 1.234e-05)
MAX_FIT_ROUNDS = 12
_DIST_CAP = (1 << 45) - 1
_AGE_CAP = 65535


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetPolicy:
    """How a budgeted stream chooses what to ship (see the module docstring)."""

    bytes: int  # cap on each delta's wire bytes: canonical manifest (as if signed) + blobs
    max_owed_steps: int = 8  # a word owed this many versions in a row is due: sent next, exactly, first
    step_bits: int = 0  # 0: steps exact; k > 0: a selected float step rounded toward zero to k significant bits
    measure_owed: bool = True  # encode the remaining residual each step to report its exact bytes

    def __post_init__(self) -> None:
        if not isinstance(self.bytes, int) or self.bytes < 1:
            raise ValueError(f"budget must be a positive number of bytes, got {self.bytes!r}")
        if not 1 <= self.max_owed_steps <= 10_000:
            raise ValueError(f"max_owed_steps must be in [1, 10000], got {self.max_owed_steps}")
        if not 0 <= self.step_bits <= 16:
            raise ValueError(f"step_bits must be in [0, 16] (0: exact), got {self.step_bits}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorResidual:
    """What one tensor still owes after a version."""

    words: int
    owed: int  # words where served != trainer
    max_ulps: int  # largest distance in ULPs (0 when nothing is owed)
    max_rel: float  # largest |trainer - served| / |trainer| over owed float words (0.0 if none)
    max_age: int  # longest run of versions an owed word has been owed, this one included


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidualReport:
    """One budgeted version: what it cost, what it sent, what is still owed."""

    budget: int
    wire_bytes: int  # this delta: canonical manifest (as if signed) + blobs
    full_bytes: int  # what shipping the whole residual at once would have cost (wire bytes)
    sent: int  # words written by this delta
    quantized: int  # of which rounded (still owed, closer)
    owed: int  # words still owed after it
    words: int
    owed_bytes: int  # blob bytes of a delta that would ship all that is still owed (-1: not measured)
    max_ulps: int
    max_rel: float
    max_age: int
    due: int  # words owed max_owed_steps versions in a row, sent ahead of any rank (or late)
    late: int  # due words the budget could not fit (the max-owed rule breached for them)
    over_budget: bool  # even an empty delta did not fit the budget
    tensors: dict[str, TensorResidual] = field(default_factory=dict)

    @property
    def owed_fraction(self) -> float:
        return self.owed / max(self.words, 1)

    def meta(self, max_owed_steps: int) -> dict[str, str]:
        """The manifest meta entries of a budgeted version (docs/FORMAT.md §9)."""
        summary = {"full_bytes": self.full_bytes, "sent": self.sent,
                   "quantized": self.quantized, "owed": self.owed, "words": self.words, "owed_bytes": self.owed_bytes,
                   "max_ulps": self.max_ulps, "max_rel": float(f"{self.max_rel:.4g}"), "max_age": self.max_age,
                   "max_owed_steps": max_owed_steps, "due": self.due, "late": self.late}
        return {META_BUDGET: str(self.budget), META_RESIDUAL: json.dumps(summary, sort_keys=True, separators=(",", ":"))}


def budget_of(manifest: Manifest) -> int | None:
    """The budget a manifest was published under (None: a lossless stream)."""
    v = manifest.meta.get(META_BUDGET)
    return int(v) if v is not None and v.isdigit() else None


def residual_of(manifest: Manifest) -> dict | None:
    """The residual summary a budgeted manifest carries (None if none or unreadable)."""
    v = manifest.meta.get(META_RESIDUAL)
    if v is None:
        return None
    try:
        obj = json.loads(v)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def wire_bytes(manifest: Manifest) -> int:
    """Bytes a version costs on the wire: its canonical manifest (counted as if signed) and blobs."""
    extra = SIGNATURE_RESERVE if manifest.signature is None else 0
    extra += DIGEST_RESERVE * sum(1 for b in manifest.blobs if b.digest is None)
    return len(manifest.compact().to_json()) + extra + manifest.total_bytes  # as sent: format 3


# -- per-word arithmetic --------------------------------------------------------------------------------

def _signed(words: np.ndarray) -> np.ndarray:
    return words.view(np.dtype(f"i{words.dtype.itemsize}"))


def _ordered(words: np.ndarray) -> np.ndarray:
    """Float words on the ordered integer line (int64; -0 and +0 both 0): ULPs apart = difference."""
    bits = words.dtype.itemsize * 8
    w = words.astype(np.uint64)
    sign = (w >> np.uint64(bits - 1)).astype(np.bool_)
    mag = (w & np.uint64((1 << (bits - 1)) - 1)).astype(np.int64)
    return np.where(sign, -mag, mag)


def _distance(old: np.ndarray, new: np.ndarray, is_float: bool) -> np.ndarray:
    """How far apart served and trainer words are, in ULPs (floats) or steps (integers); int64, capped."""
    if is_float:
        if old.dtype.itemsize < 8:
            d = np.abs(_ordered(new) - _ordered(old))
        else:  # 63-bit magnitudes: difference in float64, then capped
            d = np.abs(_ordered(new).astype(np.float64) - _ordered(old).astype(np.float64))
            d = np.minimum(d, float(_DIST_CAP)).astype(np.int64)
    else:
        with np.errstate(over="ignore"):
            step = _signed(new - old)
        d = np.abs(step.astype(np.float64)) if old.dtype.itemsize == 8 else np.abs(step.astype(np.int64))
        if d.dtype != np.int64:
            d = np.minimum(d, float(_DIST_CAP)).astype(np.int64)
    return np.minimum(d, _DIST_CAP)


def _quantize(old: np.ndarray, new: np.ndarray, bits: int, exact: np.ndarray) -> np.ndarray:
    """The served words after sending steps rounded toward zero to ``bits`` significant bits
    (where ``exact`` is False; same-sign float words only); other words go to ``new``."""
    with np.errstate(over="ignore"):
        step = _signed(new - old).astype(np.int64)
    mag = np.abs(step)
    shift = np.maximum(np.frexp(mag.astype(np.float64))[1].astype(np.int64) - bits, 0)
    q = (mag >> shift) << shift
    q = np.where(step < 0, -q, q)
    out = (old.astype(np.int64) + q).astype(old.dtype)
    return np.where(exact, new, out)


_FLOAT_VIEW = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
               "float64": torch.float64, "complex32": torch.float16, "complex64": torch.float32,
               "complex128": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _as_float(words: np.ndarray, dtype: str) -> np.ndarray | None:
    tdt = _FLOAT_VIEW.get(dtype)
    if tdt is None or words.size == 0:
        return None
    t = torch.from_numpy(np.ascontiguousarray(_signed(words)))
    return t.view(tdt).to(torch.float64).numpy()


def _max_rel(served: np.ndarray, trainer: np.ndarray, dtype: str) -> float:
    s, t = _as_float(served, dtype), _as_float(trainer, dtype)
    if s is None or t is None:
        return 0.0
    ok = np.isfinite(s) & np.isfinite(t) & (t != 0)
    if not ok.any():
        return 0.0
    return float(np.max(np.abs(t[ok] - s[ok]) / np.abs(t[ok])))


def _chunk_fp_delta(positions: np.ndarray, old: np.ndarray, new: np.ndarray, word_size: int) -> int:
    if positions.size == 0:
        return 0
    return fingerprint_delta(torch.from_numpy(positions), torch.from_numpy(np.ascontiguousarray(_signed(old))),
                             torch.from_numpy(np.ascontiguousarray(_signed(new))), word_size)


# -- the plan ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetPlan:
    """One budgeted delta, not yet committed: ``encoded`` (unsigned), the part of the residual
    it sends (``sent``: served words before/after, fingerprints of the next served view), and
    the residual report. :meth:`Budgeter.commit` takes it once the version is published."""

    encoded: Encoded
    sent: StateDiff
    report: ResidualReport
    ledger: dict[str, tuple[np.ndarray, np.ndarray]]  # tensor -> (owed positions, ages) after this version


@dataclass(slots=True)
class _Flat:
    """The residual of a whole state, flattened across chunks for one global ranking."""

    names: list[str]
    chunk_of: list[tuple[str, ChunkDiff]]
    offsets: np.ndarray  # start of each chunk in the flat arrays
    dist: np.ndarray  # int64
    age: np.ndarray  # int64: versions owed so far (0: newly owed)
    due: np.ndarray  # bool
    order: np.ndarray  # flat indices, best first


class Budgeter:
    """Owed ledger and selection rule of one budgeted stream (see the module docstring)."""

    def __init__(self, policy: BudgetPolicy) -> None:
        self.policy = policy
        self._ledger: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._fraction = 0.0  # share of its residual the last binding version shipped (first guess)

    def reset(self) -> None:
        """A keyframe made the served view equal to the trainer's state: nothing is owed."""
        self._ledger = {}

    def keyframe_meta(self, words: int) -> dict[str, str]:
        """Meta of a keyframe in a budgeted stream (it ships everything: nothing owed)."""
        r = ResidualReport(budget=self.policy.bytes, wire_bytes=0, full_bytes=0, sent=words, quantized=0, owed=0,
                           words=words, owed_bytes=0, max_ulps=0, max_rel=0.0, max_age=0, due=0, late=0,
                           over_budget=False)
        return r.meta(self.policy.max_owed_steps)

    def commit(self, plan: BudgetPlan) -> None:
        """The plan's version was published: its leftovers are what is owed now."""
        self._ledger = plan.ledger

    def ledger_state(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The owed ledger, to save beside a served view: tensor -> (positions, ages)."""
        return dict(self._ledger)

    def load_ledger(self, ledger: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Restore a ledger saved with :meth:`ledger_state` (for the same served view)."""
        self._ledger = {n: (np.asarray(p, np.int64), np.asarray(a, np.int64)) for n, (p, a) in ledger.items()}

    def owed_ages(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(positions, ages) of the words ``name`` owes after the last committed version."""
        empty = (np.empty(0, np.int64), np.empty(0, np.int64))
        return self._ledger.get(name, empty)

    # -- planning -------------------------------------------------------------------------
    def plan(self, diff: StateDiff, *, model: str, version: int, parent: int, options: EncodeOptions | None = None,
             meta: Mapping[str, str] | None = None) -> BudgetPlan:
        """Choose and encode the next delta from ``diff`` (served view → trainer's state)."""
        options = options or EncodeOptions()
        pol = self.policy
        base_meta = dict(meta or {})
        flat = self._flatten(diff)
        total = int(flat.dist.size)
        words = sum(math.prod(shape) * dtype_info(dt).words_per_element for dt, shape in diff.layout.values())

        tries: dict[tuple[int, bool, bool], tuple[int, Encoded, StateDiff, list[np.ndarray]]] = {}

        def attempt(n: int, quantize: bool, fingerprints: bool = False) -> tuple[int, Encoded, StateDiff, list[np.ndarray]]:
            # candidates are sized without fingerprints (fixed-width hex: the size is the same)
            if (n, quantize, fingerprints) not in tries:
                sel = np.zeros(total, dtype=np.bool_)
                sel[flat.order[:n]] = True
                sent, served_new = self._sent_diff(diff, flat, sel, quantize=quantize, fingerprints=fingerprints)
                probe = {**base_meta, **_probe_meta(pol, words, 8 * diff.host_bytes + (1 << 20))}
                enc = encode_diff(sent, model=model, version=version, parent=parent, options=options, meta=probe)
                tries[n, quantize, fingerprints] = (wire_bytes(enc.manifest), enc, sent, served_new)
            return tries[n, quantize, fingerprints]

        budget = pol.bytes - META_RESERVE
        full = attempt(total, False)[0]  # the whole residual, exact: when it fits, this is the lossless delta
        over = False
        quantize = False
        if full <= budget:
            n = total
        elif attempt(0, False)[0] > budget:
            n, over = 0, True
        else:
            quantize = pol.step_bits > 0
            n = self._fit(total, budget, lambda k: attempt(k, quantize)[0], guess=int(total * self._fraction))
        if 0 < n < total:
            self._fraction = n / total
        _, enc, sent, served_new = attempt(n, quantize, True)
        ledger, report = self._leftovers(diff, flat, served_new, sent, n, full, options)
        m = replace(enc.manifest, meta={**base_meta, **report.meta(pol.max_owed_steps)})
        enc = Encoded(manifest=m, blobs=enc.blobs, fps=dict(sent.fps_after))
        report = replace(report, wire_bytes=wire_bytes(m), over_budget=over)
        return BudgetPlan(encoded=enc, sent=sent, report=report, ledger=ledger)

    @staticmethod
    def _fit(total: int, budget: int, size, guess: int = 0) -> int:
        """Largest prefix length found whose delta fits ``budget``: interpolation between the best
        fitting and the smallest failing length, falling back to bisection when one side stalls
        (the cost of a prefix is concave: the first-ranked words are the most expensive)."""
        lo, hi = 0, total
        w_lo, w_hi = size(0), size(total)
        if 0 < guess < total:  # last version's share of its residual: usually close
            w = size(guess)
            if w <= budget:
                lo, w_lo = guess, w
                if w >= budget * 0.98:
                    return lo
            else:
                hi, w_hi = guess, w
        last = None
        for _ in range(MAX_FIT_ROUNDS):
            if hi - lo <= max(1, hi // 100):
                break
            frac = (budget - w_lo) / max(w_hi - w_lo, 1)
            n = lo + int((hi - lo) * frac * 0.995)
            if last is not None and last[0] == last[1]:  # the same side moved twice: bisect instead
                n = (lo + hi) // 2
            n = min(max(n, lo + 1), hi - 1)
            w = size(n)
            side = w <= budget
            last = (side, last[0] if last else None)
            if side:
                lo, w_lo = n, w
                if w >= budget * 0.98:
                    break
            else:
                hi, w_hi = n, w
        return lo

    def _flatten(self, diff: StateDiff) -> _Flat:
        names = sorted(diff.chunks)
        chunk_of: list[tuple[str, ChunkDiff]] = []
        dists, ages = [], []
        for name in names:
            info = dtype_info(diff.layout[name][0])
            prev_pos, prev_age = self.owed_ages(name)
            for c in diff.chunks[name]:
                chunk_of.append((name, c))
                dists.append(_distance(c.old, c.new, info.is_float))
                if prev_pos.size:
                    i = np.searchsorted(prev_pos, c.positions)
                    i = np.minimum(i, prev_pos.size - 1)
                    hit = prev_pos[i] == c.positions
                    ages.append(np.where(hit, prev_age[i], 0))
                else:
                    ages.append(np.zeros(c.positions.size, np.int64))
        sizes = [c.positions.size for _, c in chunk_of]
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]) if sizes else np.zeros(1, np.int64)
        dist = np.concatenate(dists) if dists else np.empty(0, np.int64)
        age = np.concatenate(ages).astype(np.int64) if ages else np.empty(0, np.int64)
        due = age >= self.policy.max_owed_steps
        # due words first, oldest first; then the rest by distance, oldest first among equals
        capped_age = np.minimum(age, _AGE_CAP)
        key = np.where(due, (1 << 61) | (np.minimum(age, (1 << 15) - 1) << 45) | np.minimum(dist, (1 << 45) - 1),
                       (dist << 16) | capped_age)
        order = np.argsort(-key, kind="stable")
        return _Flat(names=names, chunk_of=chunk_of, offsets=offsets, dist=dist, age=age, due=due, order=order)

    def _sent_diff(self, diff: StateDiff, flat: _Flat, sel: np.ndarray, *, quantize: bool,
                   fingerprints: bool) -> tuple[StateDiff, list[np.ndarray]]:
        """The selected words as a served→served' StateDiff (fingerprints of served'), and the
        served' word of every residual word (flat, as uint64) for the leftovers."""
        pol = self.policy
        chunks: dict[str, list[ChunkDiff]] = {}
        fps_after = dict(diff.fps_before)
        served_new = []
        for k, (name, c) in enumerate(flat.chunk_of):
            a, b = int(flat.offsets[k]), int(flat.offsets[k + 1])
            s = sel[a:b]
            info = dtype_info(diff.layout[name][0])
            if quantize and info.is_float:
                same_sign = ((c.old ^ c.new) >> np.array(c.old.dtype.itemsize * 8 - 1, dtype=c.old.dtype)) == 0
                exact = flat.due[a:b] | ~same_sign
                target = _quantize(c.old, c.new, pol.step_bits, exact)
            else:
                target = c.new
            after = np.where(s, target, c.old)
            served_new.append(after)
            moved = s & (after != c.old)
            if not moved.any():
                continue
            pos, old, new = c.positions[moved], c.old[moved], after[moved]
            chunks.setdefault(name, []).append(ChunkDiff(start=c.start, stop=c.stop, positions=pos, old=old, new=new))
            if fingerprints:
                fps_after[name] = update_fingerprint(fps_after[name], _chunk_fp_delta(pos, old, new, info.word_size))
        sent = StateDiff(layout=diff.layout, chunks=chunks, fps_before=dict(diff.fps_before), fps_after=fps_after)
        return sent, served_new

    def _leftovers(self, diff: StateDiff, flat: _Flat, served_new: list[np.ndarray], sent: StateDiff, n: int,
                   full_bytes: int, options: EncodeOptions) -> tuple[dict, ResidualReport]:
        pol = self.policy
        ledger: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        per: dict[str, dict] = {}
        rest: dict[str, list[ChunkDiff]] = {}
        sel = np.zeros(flat.dist.size, dtype=np.bool_)
        sel[flat.order[:n]] = True
        late = int((flat.due & ~sel).sum())
        quantized = 0
        for k, (name, c) in enumerate(flat.chunk_of):
            a, b = int(flat.offsets[k]), int(flat.offsets[k + 1])
            after = served_new[k]
            owed = after != c.new
            quantized += int((owed & sel[a:b]).sum())
            if not owed.any():
                continue
            info = dtype_info(diff.layout[name][0])
            pos, s_w, t_w = c.positions[owed], after[owed], c.new[owed]
            age = flat.age[a:b][owed] + 1
            p = per.setdefault(name, {"owed": 0, "max_ulps": 0, "max_rel": 0.0, "max_age": 0, "pos": [], "age": []})
            p["owed"] += int(pos.size)
            p["max_ulps"] = max(p["max_ulps"], int(_distance(s_w, t_w, info.is_float).max()))
            p["max_rel"] = max(p["max_rel"], _max_rel(s_w, t_w, info.name) if info.is_float else 0.0)
            p["max_age"] = max(p["max_age"], int(age.max()))
            p["pos"].append(pos)
            p["age"].append(age)
            rest.setdefault(name, []).append(ChunkDiff(start=c.start, stop=c.stop, positions=pos, old=s_w, new=t_w))
        tensors = {}
        for name, (dtype, shape) in sorted(diff.layout.items()):
            words = math.prod(shape) * dtype_info(dtype).words_per_element
            p = per.get(name)
            if p is None:
                tensors[name] = TensorResidual(words=words, owed=0, max_ulps=0, max_rel=0.0, max_age=0)
                continue
            ledger[name] = (np.concatenate(p["pos"]), np.concatenate(p["age"]))
            tensors[name] = TensorResidual(words=words, owed=p["owed"], max_ulps=p["max_ulps"], max_rel=p["max_rel"],
                                           max_age=p["max_age"])
        owed_bytes = -1
        if pol.measure_owed:
            if rest:
                rdiff = StateDiff(layout=diff.layout, chunks=rest, fps_before=sent.fps_after, fps_after=sent.fps_after)
                owed_bytes = encode_diff(rdiff, model="owed", version=1, parent=0, options=options).manifest.total_bytes
            else:
                owed_bytes = 0
        report = ResidualReport(
            budget=pol.bytes, wire_bytes=0, full_bytes=full_bytes, sent=sent.changed, quantized=quantized,
            owed=sum(t.owed for t in tensors.values()), words=sum(t.words for t in tensors.values()),
            owed_bytes=owed_bytes, max_ulps=max((t.max_ulps for t in tensors.values()), default=0),
            max_rel=max((t.max_rel for t in tensors.values()), default=0.0),
            max_age=max((t.max_age for t in tensors.values()), default=0), due=int(flat.due.sum()), late=late,
            over_budget=False,
            tensors=tensors)
        return ledger, report


def _probe_meta(pol: BudgetPolicy, words: int, nbytes: int) -> dict[str, str]:
    """A stand-in for the final residual summary while sizing candidates: same keys, as many
    digits as the final values can have (counts up to ``words``, bytes up to ``nbytes``)."""
    w = 10 ** len(str(words)) - 1
    b = 10 ** len(str(max(nbytes, 1))) - 1
    r = ResidualReport(budget=pol.bytes, wire_bytes=b, full_bytes=b, sent=w, quantized=w, owed=w, words=w,
                       owed_bytes=b, max_ulps=_DIST_CAP, max_rel=0.1234, max_age=pol.max_owed_steps + 1, due=w, late=w,
                       over_budget=False)
    return r.meta(pol.max_owed_steps)
