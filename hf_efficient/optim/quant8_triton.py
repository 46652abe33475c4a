"""The blockwise 8-bit codec of :mod:`.quant8` as ``@triton.jit`` functions, for the 8-bit families' Triton kernels.

A program holds ``NB`` whole blocks as a ``(4, NB, 64)`` fp32 tile: element ``64 * k + j`` of block ``b`` at
``[k, b, j]``. Rows outermost: the compiler then gives a thread all 4 rows of its columns (warps split the blocks), so
summing a column's codes into its word and a block's absmax need no exchange between warps. Codes stay in
:mod:`.quant8`'s in-memory layout (byte ``4 * j + k`` of a block holds element ``64 * k + j``), so each 32-bit code
word is loaded and stored once (its byte ``k`` is row ``k``'s code), and state, ``state_dict`` and checkpoints are
the C and torch kernels'. Decoding looks values up in ``quant8.c_tables()`` (on the device: its first 512 floats are
:func:`.quant8.decode` of every code, the rest the encoder's thresholds), so decoded values are the eager kernel's
exactly; encoding gives :func:`.quant8.encode`'s codes exactly: its decade from a word per binade (the count of
thresholds below it and the one inside it) and ``n`` and ``inv_scale`` from a pair per decade count, then its
arithmetic. The tables are laid out so that a warp's lookups touch one or two 128-byte lines each (a lookup costs the
L1 a pass per distinct line: a table spread over many lines would cost several per warp). A
block's scale is :func:`.quant8.block_scale`'s. Imported only where Triton is installed.
"""

import torch
import triton
import triton.language as tl

_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126, fp32's smallest normal (quant8.block_scale)
# tables(): quant8.c_tables()' 528 floats, padding, then each map's binade words (512 int32: x's sign and exponent
# bits) and its (n, inv_scale) pairs (9 int64: by decade count). Where each starts, in units of its own type; every
# one starts on a 128-byte line, so that the binades a normalized value can fall in (2**-31 .. 1: exponents 96..127,
# 32 words) are one line of each sign, and the pairs one line: a warp's lookups touch one or two lines, not several.
_WORDS = {True: 544, False: 1056}
_PAIRS = {True: 1568 // 2, False: 1600 // 2}
_SIZE = 2 * _PAIRS[False] + 18  # floats, through the last pair table (9 int64)
_W_SIGNED, _W_UNSIGNED = tl.constexpr(_WORDS[True]), tl.constexpr(_WORDS[False])
_P_SIGNED, _P_UNSIGNED = tl.constexpr(_PAIRS[True]), tl.constexpr(_PAIRS[False])
_NONE = 1 << 23  # a threshold mantissa no value reaches: no threshold in this binade
_TABLES: dict = {}


def _cuts(signed: bool, negative: bool) -> list[int]:
    """The bits (of positive floats) of the thresholds :func:`encode` counts for values of this map and sign: eager's
    7 decade midpoints, and for positive values the top one as the next float above it (``a >= next(top)`` is
    ``x > top``; the signed map has no -1.0, so a negative value counts 7 at most). The unsigned map's negative
    values count none (eager's code 0); its first midpoint is replaced by the smallest positive float: eager gives a
    positive value below that midpoint code 1 (its floor), and decade 0's arithmetic gives it code 1 too."""
    from . import quant8

    mids, top = quant8.THRESHOLDS[signed]
    if not signed:
        if negative:
            return []
        mids = [1e-45, *mids[1:]]
    cuts = list(mids) if negative else [*mids, float(torch.nextafter(torch.tensor(top), torch.tensor(float("inf"))))]
    return torch.tensor(cuts, dtype=torch.float32).view(torch.int32).tolist()


def _binade_words(signed: bool) -> torch.Tensor:
    """:func:`encode`'s word of each binade (x's sign and exponent bits, 512): the count of thresholds below the
    binade in bits 24..31, the mantissa of the one threshold inside it in bits 0..23 (:data:`_NONE` where none). The
    thresholds are ~10x apart, so a binade holds one at most, and ``x >= it`` is ``mantissa(x) >= its mantissa``.
    Exponent 255 (NaN; a normalized value is never inf) counts none: NaN takes the zero's code."""
    words = []
    for cell in range(512):
        e = cell & 255
        cuts = _cuts(signed, negative=cell >= 256)
        below = sum(c < (e << 23) for c in cuts)
        inside = [c & 0x7FFFFF for c in cuts if e << 23 <= c < (e + 1) << 23]
        assert len(inside) <= 1, "two thresholds in one binade: one comparison cannot tell"
        if e == 255:
            below, inside = 0, []
        words.append(below << 24 | (inside[0] if inside else _NONE))
    return torch.tensor(words, dtype=torch.int64).to(torch.int32)


def _pairs(signed: bool) -> torch.Tensor:
    """:func:`.quant8.encode`'s ``(n, inv_scale)`` for each count ``c`` of thresholds at or below a value (0..8), as
    fp32 pairs in int64: decade ``c - 1`` (``n = first * 2**(c-1)``, ``inv_scale = 10**(8-c)``, exact in fp32);
    none below the first (``n`` 0 signed, 1 unsigned; scale 0), and the top (1.0's code: ``n = first * 128``)."""
    first = 1.0 if signed else 2.0
    n = torch.tensor([0.0 if signed else 1.0, *(first * 2**d for d in range(8))])
    inv_scale = torch.tensor([0.0, *(10.0 ** (7 - d) for d in range(7)), 0.0])
    return (n.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (inv_scale.view(torch.int32).to(torch.int64) << 32)


def tables(device: torch.device) -> torch.Tensor:
    """The codec's tables on ``device`` (fp32; copied there once per process, never inside a step after the first):
    ``quant8.c_tables()`` (the decoder reads its first 512 floats), then :func:`_binade_words` and :func:`_pairs` of
    each map at the offsets above."""
    key = torch.device(device)
    if key not in _TABLES:
        from . import quant8

        out = torch.zeros(_SIZE, dtype=torch.float32)
        c = quant8.c_tables()
        out[:c.numel()] = c
        for signed in (True, False):
            out[_WORDS[signed]:_WORDS[signed] + 512] = _binade_words(signed).view(torch.float32)
            out[2 * _PAIRS[signed]:2 * _PAIRS[signed] + 18] = _pairs(signed).view(torch.float32)
        _TABLES[key] = out.to(key)
    return _TABLES[key]


@triton.jit
def _words(words_ptr, blk):
    """Addresses ``(1, NB, 64)`` of the code words of blocks ``blk``: rank 3 as the tiles, so that broadcasting a
    word to its four rows and summing them back keep one layout (no exchange through shared memory)."""
    return words_ptr + blk[None, :, None] * 64 + tl.arange(0, 64)[None, None, :]


@triton.jit
def load(words_ptr, absmax_ptr, blk, bmask, table_ptr, SIGNED: tl.constexpr):
    """Decoded values ``(4, NB, 64)`` fp32 of blocks ``blk`` (``(NB,)`` int64; ``bmask``: those that exist), element
    ``64 * k + j`` of block ``b`` at ``[k, b, j]``: each 32-bit word loaded once, its byte ``k`` looked up in the map
    (codes are 0..255 whatever was masked: the lookup needs no mask), times its block's absmax."""
    word = tl.load(_words(words_ptr, blk), mask=bmask[None, :, None], other=0)  # (1, NB, 64)
    code = (word >> (tl.arange(0, 4) * 8)[:, None, None]) & 255
    value = tl.load(table_ptr + code + (0 if SIGNED else 256))
    return value * tl.load(absmax_ptr + blk, mask=bmask, other=0.0)[None, :, None]


@triton.jit
def encode(x, table_ptr, SIGNED: tl.constexpr):
    """:func:`.quant8.encode` of normalized values ``x`` (fp32): codes as int32. Eager's decade (the count of its
    thresholds at or below ``|x|``) from the word of ``x``'s binade (:func:`_binade_words`: the count below it, and
    one integer comparison of mantissas with the threshold inside it), its ``n`` and ``inv_scale`` from the pair of
    that count (:func:`_pairs`), instead of 8 comparisons and 16 selects; then eager's arithmetic in its order."""
    bits = x.to(tl.uint32, bitcast=True)
    word = tl.load(table_ptr.to(tl.pointer_type(tl.int32)) + (_W_SIGNED if SIGNED else _W_UNSIGNED) + (bits >> 23))
    count = (word >> 24) + ((bits & 0x7FFFFF).to(tl.int32) >= (word & 0xFFFFFF)).to(tl.int32)
    pair = tl.load(table_ptr.to(tl.pointer_type(tl.int64)) + (_P_SIGNED if SIGNED else _P_UNSIGNED) + count)
    n = pair.to(tl.int32).to(tl.float32, bitcast=True)
    inv_scale = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    a = tl.abs(x) if SIGNED else x  # unsigned: a negative x (never stored: second moments are >= 0) counts 0: code 0
    k = tl.floor((a * inv_scale - 1.0) * (n * 0.1111111111111111))
    j = n + tl.maximum(tl.minimum(k, n - 1.0), 0.0)
    if SIGNED:  # 127 + j, or 127 - j below zero: j (>= 0) takes x's sign bit
        code = 127.0 + (j.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    else:
        code = j - 1.0  # a positive value counts 1 at least (the smallest positive float is a threshold): code 1
    return code.to(tl.int32)


@triton.jit
def store(x, words_ptr, absmax_ptr, blk, bmask, table_ptr, SIGNED: tl.constexpr):
    """Blocks ``x`` (``(4, NB, 64)`` fp32, as :func:`load` gives them) stored as codes and absmaxes, as
    :func:`.quant8.pack`: each block's scale (largest |x|, by the bits of |x| so that a NaN wins as in ``amax``;
    raised to 2**-126 where below it), the values times its fp32 reciprocal, encoded, the four codes of column ``j``
    summed into word ``j`` (their bytes do not overlap)."""
    top = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), axis=0)
    a = top.to(tl.float32, bitcast=True)
    a = tl.where((a > 0) & (a < _TINY), _TINY, a)
    one = tl.full(a.shape, 1.0, tl.float32)
    inv = tl.div_rn(one, tl.where(a > 0, a, one))  # a zero block's scale counts as 1
    code = encode(x * inv[None, :, None], table_ptr, SIGNED)
    word = tl.sum(code << (tl.arange(0, 4) * 8)[:, None, None], axis=0, keep_dims=True)
    tl.store(_words(words_ptr, blk), word, mask=bmask[None, :, None])
    tl.store(absmax_ptr + blk, a, mask=bmask)
