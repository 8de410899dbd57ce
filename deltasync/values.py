"""Coding what each changed word became.

A change is either a **step** ``d`` (the new word is ``old + d`` modulo
``2**bits``) or a **raw** new word. For IEEE-like floats with an unchanged sign,
``d`` is exactly the change in ULPs of the magnitude, so Adam's typical ±1 ULP
updates become ``d = ±1``. Steps compose without the base (``d1 + d2``), raw words
compose with anything that follows, so chains squash without the model.

Each change is one token byte (docs/FORMAT.md, "values"):

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
    raw = _too_big(d, bits)
    if is_float:
        raw |= ((old ^ new) >> np.array(bits - 1, dtype=old.dtype)).astype(np.bool_)
    values = np.where(raw, new, d)
    return Changes(positions=positions, raw=raw, values=values)


def _magnitude(d: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned modular steps -> (negative?, |d| as uint64)."""
    signed = d.view(np.dtype(f"i{d.dtype.itemsize}"))
    neg = signed < 0
    with np.errstate(over="ignore"):
        mag = np.where(neg, (~d.astype(np.uint64) + np.uint64(1)) & np.uint64((1 << bits) - 1 if bits < 64 else (1 << 64) - 1), d.astype(np.uint64))
    return neg, mag


def _too_big(d: np.ndarray, bits: int) -> np.ndarray:
    # A step whose varint would be no shorter than the raw word is sent raw.
    _, mag = _magnitude(d, bits)
    limit = _SMALL + (1 << (7 * max(bits // 8 - 1, 0)))
    return mag > np.uint64(limit)


def tokenize(changes: Changes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changes -> (tokens uint8, ext varint bytes uint8, raw words)."""
    bits = changes.values.dtype.itemsize * 8
    tokens = np.full(changes.values.size, RAW, dtype=np.uint8)
    step = ~changes.raw
    neg, mag = _magnitude(changes.values[step], bits)
    if (mag == 0).any():
        raise ValueError("a zero step is not a change")
    m = mag - np.uint64(1)
    small = m < np.uint64(_SMALL)
    t = np.where(small, (np.minimum(m, np.uint64(_SMALL)) * np.uint64(2)).astype(np.uint8) + neg, np.where(neg, BIG_NEG, BIG_POS))
    tokens[step] = t.astype(np.uint8)
    ext = encode_varints(m[~small] - np.uint64(_SMALL))
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
    big = (tokens == BIG_POS) | (tokens == BIG_NEG)
    m = (tokens >> 1).astype(np.uint64)
    m[big] = decode_varints(ext, int(big.sum())) + np.uint64(_SMALL)
    neg = np.where(big, tokens == BIG_NEG, (tokens & 1).astype(np.bool_))
    with np.errstate(over="ignore"):
        mag = m + np.uint64(1)
        d = np.where(neg, ~mag + np.uint64(1), mag)
        if bits < 64:
            d &= np.uint64((1 << bits) - 1)
    values = d.astype(wdt)
    values[raw] = raw_words
    return Changes(positions=positions, raw=raw, values=values)


def apply_changes_np(words: np.ndarray, changes: Changes) -> None:
    """Patch an unsigned numpy word array in place (host-side; used by squash and tools)."""
    p = changes.positions
    with np.errstate(over="ignore"):
        words[p] = np.where(changes.raw, changes.values, words[p] + changes.values)
