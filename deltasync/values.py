"""Coding what each changed word became.

A change is either a **step** ``d`` (the new word is ``old + d`` modulo
``2**bits``) or a **raw** new word. For IEEE-like floats with an unchanged sign,
``d`` is exactly the change in ULPs of the magnitude, so Adam's typical ±1 ULP
updates become ``d = ±1``. Steps compose without the base (``d1 + d2``), raw words
compose with anything that follows, so chains squash without the model.

Each change first gets a 2-bit symbol, four to a byte (stream ``sym``): ``0`` a
step of +1, ``1`` a step of -1, ``2`` anything else, which then takes one token byte
(stream ``tok``; docs/FORMAT.md, "values"). Adam moves ~90% of changed bf16 values by
one ULP, so most changes cost the ~1.4 bits of their symbol; a byte-wise entropy coder
(zstd's Huffman) cannot go below one bit per byte, which packing four symbols avoids.
Tokens:

* ``0..251``: a step with ``m = |d| - 1 < 126``: token ``2*m + (d < 0)``;
* ``252``/``253``: a positive/negative step with ``m >= 126``; ``m - 126`` goes to
  the ``ext`` stream as a varint;
* ``254``: a raw word, taken in order from the ``raw`` stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import numpy_word_dtype
from .errors import FormatError
from .varint import decode_varints, encode_varints

RAW = 254
BIG_POS = 252
BIG_NEG = 253
_SMALL = 126


@dataclass(frozen=True, slots=True, kw_only=True)
class Changes:
    """Changes of one chunk, in word positions relative to the tensor start.

    ``values`` holds unsigned words: the step ``d`` modulo ``2**bits`` where
    ``raw`` is False, the new word where it is True.
    """

    positions: np.ndarray  # int64, sorted, unique
    raw: np.ndarray  # bool
    values: np.ndarray  # uint{8,16,32,64}

    def __len__(self) -> int:
        return int(self.positions.size)


def changes_from_words(positions: np.ndarray, old: np.ndarray, new: np.ndarray, *, is_float: bool) -> Changes:
    """Pick step or raw for each change from the old and new unsigned words."""
    bits = old.dtype.itemsize * 8
    with np.errstate(over="ignore"):
        d = new - old  # wraps: the modular step
    _, mag = _magnitude(d)
    raw = mag > _raw_limit(bits)
    if is_float:
        raw |= ((old ^ new) >> np.array(bits - 1, dtype=old.dtype)).astype(np.bool_)
    values = np.where(raw, new, d)
    return Changes(positions=positions, raw=raw, values=values)


def _raw_limit(bits: int) -> int:
    # A step whose varint would be no shorter than the raw word is sent raw.
    return _SMALL + (1 << (7 * max(bits // 8 - 1, 0)))


def _magnitude(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned modular steps -> (negative?, |d|). |d| is int32/int64 for words up to 4 bytes
    (fast path), uint64 for 8-byte words."""
    w = d.dtype.itemsize
    signed = d.view(np.dtype(f"i{w}"))
    if w <= 4:
        s = signed.astype(np.int32 if w <= 2 else np.int64)
        return s < 0, np.abs(s)
    neg = signed < 0
    with np.errstate(over="ignore"):
        mag = np.where(neg, ~d + np.uint64(1), d)
    return neg, mag


def tokenize(changes: Changes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changes -> (tokens uint8, ext varint bytes uint8, raw words)."""
    if changes.raw.any():
        tokens = np.full(changes.values.size, RAW, dtype=np.uint8)
        step = ~changes.raw
        neg, mag = _magnitude(changes.values[step])
    else:
        tokens = None
        neg, mag = _magnitude(changes.values)
    if mag.size and not mag.all():
        raise ValueError("a zero step is not a change")
    m = mag - mag.dtype.type(1)
    small = m < _SMALL
    t = np.where(small, m * 2 + neg, np.where(neg, BIG_NEG, BIG_POS)).astype(np.uint8)
    if tokens is None:
        tokens = t
    else:
        tokens[step] = t
    big = m[~small]
    ext = encode_varints(big.astype(np.uint64) - np.uint64(_SMALL)) if big.size else np.empty(0, np.uint8)
    raw_words = changes.values[changes.raw]
    return tokens, ext, raw_words


def detokenize(positions: np.ndarray, tokens: np.ndarray, ext: np.ndarray, raw_words: np.ndarray, word_size: int) -> Changes:
    """Inverse of :func:`tokenize`; malformed input raises FormatError."""
    wdt = numpy_word_dtype(word_size)
    bits = word_size * 8
    if tokens.size != positions.size:
        raise FormatError(f"values: {positions.size} positions but {tokens.size} tokens")
    if tokens.size and tokens.max() > RAW:
        raise FormatError(f"values: token {int(tokens.max())} is reserved")
    raw = tokens == RAW
    if int(raw.sum()) != raw_words.size:
        raise FormatError(f"values: {int(raw.sum())} raw tokens but {raw_words.size} raw words")
    big = tokens >= BIG_POS
    big[raw] = False
    n_big = int(big.sum())
    if word_size <= 4:
        wide = np.int32 if word_size <= 2 else np.int64
        m = (tokens >> 1).astype(wide)
        if n_big:
            ext_m = decode_varints(ext, n_big)
            if ext_m.max() >= np.uint64(1 << (bits - 1)):
                raise FormatError(f"values: a step larger than a {bits}-bit word")
            m[big] = ext_m.astype(wide) + _SMALL
            neg = np.where(big, tokens == BIG_NEG, (tokens & 1).astype(np.bool_))
        else:
            decode_varints(ext, 0)
            neg = (tokens & 1).astype(np.bool_)
        m += 1
        values = np.where(neg, -m, m).astype(wdt)
    else:
        m = (tokens >> 1).astype(np.uint64)
        ext_m = decode_varints(ext, n_big)
        if n_big and ext_m.max() > np.uint64((1 << 63) - 1 - _SMALL):
            raise FormatError("values: a step larger than a 64-bit word")
        m[big] = ext_m + np.uint64(_SMALL)
        neg = np.where(big, tokens == BIG_NEG, (tokens & 1).astype(np.bool_))
        with np.errstate(over="ignore"):
            mag = m + np.uint64(1)
            values = np.where(neg, ~mag + np.uint64(1), mag)
    values[raw] = raw_words
    return Changes(positions=positions, raw=raw, values=values)


SYM_PLUS, SYM_MINUS, SYM_TOKEN = 0, 1, 2


def encode_values(changes: Changes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Changes -> (packed 2-bit symbols, tokens of the other changes, ext bytes, raw words)."""
    v = changes.values
    with np.errstate(over="ignore"):
        t = v + v.dtype.type(1)  # +1 -> 2, -1 -> 0
    sym = (t != 2).astype(np.uint8)
    sym += t > 2  # 0: +1, 1: -1, 2: other (t == 1 would be a zero step, which is no change)
    if changes.raw.any():
        sym[changes.raw] = SYM_TOKEN
    other = sym == SYM_TOKEN
    if other.all():
        tokens, ext, raw = tokenize(changes)
    else:
        empty = np.empty(0, np.int64)
        tokens, ext, raw = tokenize(Changes(positions=empty, raw=changes.raw[other], values=v[other]))
    return pack_symbols(sym), tokens, ext, raw


def decode_values(positions: np.ndarray, packed: np.ndarray, tokens: np.ndarray, ext: np.ndarray,
                  raw_words: np.ndarray, word_size: int) -> Changes:
    """Inverse of :func:`encode_values`; malformed input raises FormatError."""
    count = positions.size
    sym = unpack_symbols(packed, count)
    other = sym == SYM_TOKEN
    n_other = int(np.count_nonzero(other))
    if tokens.size != n_other:
        raise FormatError(f"values: {n_other} changes need a token, found {tokens.size} tokens")
    wdt = numpy_word_dtype(word_size)
    if n_other == count:
        return detokenize(positions, tokens, ext, raw_words, word_size)
    values = np.array([1, np.iinfo(wdt).max, 0, 0], dtype=wdt).take(sym)
    raw = np.zeros(count, dtype=np.bool_)
    if n_other:
        sub = detokenize(positions[:n_other], tokens, ext, raw_words, word_size)
        values[other] = sub.values
        raw[other] = sub.raw
    else:
        detokenize(positions[:0], tokens, ext, raw_words, word_size)  # validates ext/raw are empty
    return Changes(positions=positions, raw=raw, values=values)


def pack_symbols(sym: np.ndarray) -> np.ndarray:
    """2-bit symbols, four per byte, first symbol in the lowest bits; padding symbols are 0."""
    n = sym.size
    if n % 4:
        sym = np.concatenate([sym, np.zeros(4 - n % 4, dtype=np.uint8)])
    q = sym.reshape(-1, 4)
    out = q[:, 3] << 6
    out |= q[:, 2] << 4
    out |= q[:, 1] << 2
    out |= q[:, 0]
    return out


_UNPACK = np.array([[(b >> (2 * k)) & 3 for k in range(4)] for b in range(256)], dtype=np.uint8)


def unpack_symbols(packed: np.ndarray, count: int) -> np.ndarray:
    if packed.size != (count + 3) // 4:
        raise FormatError(f"values: {count} symbols need {(count + 3) // 4} bytes, found {packed.size}")
    sym = _UNPACK.take(packed, axis=0).reshape(-1)
    if sym[count:].any():
        raise FormatError("values: padding symbols must be 0")
    sym = sym[:count]
    if count and sym.max() == 3:
        raise FormatError("values: symbol 3 is reserved")
    return sym


def apply_changes_np(words: np.ndarray, changes: Changes) -> None:
    """Patch an unsigned numpy word array in place (host-side; used by squash and tools)."""
    p = changes.positions
    with np.errstate(over="ignore"):
        words[p] = np.where(changes.raw, changes.values, words[p] + changes.values)


# -- format v2: value symbols of the ``ans`` chunk mode (docs/FORMAT.md §4.3) ----------------------

def step_symbols(changes: Changes, small: int, big: int, raw_sym: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Changes -> (value symbols uint8, BIG signs bool, BIG magnitudes ``|d| - 1 - small`` uint64, raw words).

    Symbol ``2*(|d|-1) + (d<0)`` for ``|d| <= small``, ``big`` for larger steps, ``raw_sym`` for raw words."""
    v = changes.values
    sym = np.full(v.size, raw_sym, dtype=np.uint8)
    step = ~changes.raw
    neg, mag = _magnitude(v[step])
    if mag.size and not mag.all():
        raise ValueError("a zero step is not a change")
    is_small = mag <= small
    s = np.where(is_small, (mag - mag.dtype.type(1)) * 2 + neg, big).astype(np.uint8)
    sym[step] = s
    bigmag = (mag[~is_small].astype(np.uint64) - np.uint64(1 + small))
    return sym, neg[~is_small], bigmag, v[changes.raw]


def changes_from_symbols(positions: np.ndarray, sym: np.ndarray, bigneg: np.ndarray, bigmag: np.ndarray,
                         raw_words: np.ndarray, word_size: int, small: int, big: int, raw_sym: int) -> Changes:
    """Inverse of :func:`step_symbols`; malformed input raises FormatError."""
    wdt = numpy_word_dtype(word_size)
    bits = word_size * 8
    if sym.size and sym.max() > raw_sym:
        raise FormatError(f"values: symbol {int(sym.max())} is reserved")
    raw = sym == raw_sym
    if int(np.count_nonzero(raw)) != raw_words.size:
        raise FormatError(f"values: {int(np.count_nonzero(raw))} raw symbols but {raw_words.size} raw words")
    is_big = sym == big
    if bigmag.size and bigmag.max() > np.uint64((1 << (bits - 1)) - 1 - small):
        raise FormatError(f"values: a step larger than half a {bits}-bit word")
    mag = ((sym >> 1).astype(np.uint64) + np.uint64(1))
    mag[is_big] = bigmag + np.uint64(1 + small)
    neg = (sym & 1).astype(np.bool_)
    neg[is_big] = bigneg
    with np.errstate(over="ignore"):
        values = np.where(neg, ~mag + np.uint64(1), mag).astype(wdt)
    values[raw] = raw_words
    return Changes(positions=positions, raw=raw, values=values)
