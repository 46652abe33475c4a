"""The blockwise 8-bit codec of :mod:`.quant8` as ``@triton.jit`` functions, for the 8-bit families' Triton kernels.

A program holds ``NB`` whole blocks as a ``(4, NB, 64)`` fp32 tile: element ``64 * k + j`` of block ``b`` at
``[k, b, j]``. Rows outermost: the compiler then gives a thread all 4 rows of its columns (warps split the blocks), so
summing a column's codes into its word and a block's absmax need no exchange between warps. Codes stay in
:mod:`.quant8`'s in-memory layout (byte ``4 * j + k`` of a block holds element ``64 * k + j``), so each 32-bit code
word is loaded and stored once (its byte ``k`` is row ``k``'s code), and state, ``state_dict`` and checkpoints are
the C and torch kernels'. Decoding looks values up in ``quant8.c_tables()`` (on the device: its first 512 floats are
:func:`.quant8.decode` of every code, the rest the encoder's thresholds), so decoded values are the eager kernel's
exactly; encoding gives :func:`.quant8.encode`'s codes exactly: its decade, ``n`` and ``inv_scale`` from a table
indexed by the value's sign and exponent bits (as ``quant8.h``'s vector encoder; :func:`tables` appends it to the
maps), then its arithmetic. Gathers from a small table (it stays in L1) cost fewer instructions than eager's chain
of comparisons and selects: the kernels are compute-bound on a GPU (``scripts/triton_sass.py`` counts them). A
block's scale is :func:`.quant8.block_scale`'s. Imported only where Triton is installed.
"""

import torch
import triton
import triton.language as tl

_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126, fp32's smallest normal (quant8.block_scale)
# tables(): quant8.c_tables()' 528 floats, then each map's binade table (ENTRY int64 a binade, 512 binades: x's sign
# and exponent bits); where each starts, in int64 units
ENTRY = 4
_ENC_SIGNED = tl.constexpr(264)
_ENC_UNSIGNED = tl.constexpr(264 + 512 * ENTRY)
_TABLES: dict = {}


def _binades(cuts: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each binade (exponent bits 0..255) of |x|: the count of thresholds ``cuts`` at or below its bottom, and
    the one threshold inside it (+inf where none). Exponent 255 (NaN, for which eager's comparisons all fail): 0."""
    cuts = torch.tensor([*cuts, float("inf")], dtype=torch.float32)[None, :]  # (+inf: in no binade, none empty)
    low = torch.arange(256, dtype=torch.int64).mul(2**23).to(torch.int32).view(torch.float32)[:, None]
    below = (cuts <= low).sum(1)
    inside = (cuts > low) & (cuts < 2 * low)
    assert int(inside.sum(1).max()) <= 1, "two thresholds in one binade: the encoder's one comparison cannot tell"
    inner = torch.where(inside, cuts, float("inf")).amin(1)
    below[255], inner[255] = 0, float("inf")
    return below, inner


def _encoder_table(signed: bool) -> torch.Tensor:
    """:func:`encode`'s binade table of one map: ``ENTRY`` int64 per binade (x's sign and exponent bits), as fp32
    pairs: ``(inner, n_below)``, ``(inv_scale_below, n_above)``, ``(inv_scale_above, 0)``, ``(0, 0)``.

    The thresholds (the 7 decade midpoints; for positive values the top one too, as the next float above it:
    ``a >= next(top)`` is ``x > top``) are about 10x apart: at most one (``inner``) falls inside a binade, so eager's
    decade (the count of thresholds at or below ``a = |x|``) is the count below the binade, plus one where
    ``a >= inner``; ``n`` and ``inv_scale`` are :func:`.quant8.encode`'s for either count. So the sign is in the
    table, not in a clamp: a negative value above the top keeps decade 6 (the signed map has no -1.0). The unsigned
    map's negative values count 0 (eager's), and its floor is in the table too: a positive value of decade 0 has
    ``n`` 2 (``j`` 2, code ``j - 1`` = 1, as eager's floor), zero ``n`` 1 (binade 0's inner: the smallest
    subnormal), so the kernel's code is ``j - 1`` with no floor."""
    from . import quant8

    mids, top = quant8.THRESHOLDS[signed]
    positive = _binades([*mids, float(torch.nextafter(torch.tensor(top), torch.tensor(float("inf"))))])
    negative = _binades(mids if signed else [])
    below, inner = (torch.cat(halves) for halves in zip(positive, negative))
    above = (below + 1).clamp_max(8)  # (unused where inner is inf)
    first = 1.0 if signed else 2.0
    n = torch.tensor([0.0 if signed else 1.0, *(first * 2**d for d in range(8))])
    inv_scale = torch.tensor([0.0, *(10.0 ** (7 - d) for d in range(7)), 0.0])  # exact in fp32
    n_below, n_above = n[below], n[above]
    inv_below, inv_above = inv_scale[below], inv_scale[above]
    if not signed:  # the floor (positive values below the first midpoint: binades 1..254 of the positive half)
        n_below[1:255] = torch.where(below[1:255] == 0, 2.0, n_below[1:255])
        inner[0], n_above[0], inv_above[0] = 1e-45, 2.0, 0.0  # binade 0: zero, then the positive subnormals
    zero = torch.zeros_like(inner)
    return torch.stack([_pair(inner, n_below), _pair(inv_below, n_above), _pair(inv_above, zero),
                        _pair(zero, zero)], 1).reshape(-1)


def _pair(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """int64 of fp32 ``low``'s bits in the low half and fp32 ``high``'s in the high half (little-endian: the two
    floats in order)."""
    return (low.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (
        high.float().view(torch.int32).to(torch.int64) << 32)


def tables(device: torch.device) -> torch.Tensor:
    """The codec's tables on ``device`` (fp32; copied there once per process, never inside a step after the first):
    ``quant8.c_tables()`` (the decoder reads its first 512 floats), then :func:`_encoder_table` of the signed and
    the unsigned map (int64 entries from float 528: 32-byte aligned, an entry in one sector)."""
    key = torch.device(device)
    if key not in _TABLES:
        from . import quant8

        enc = torch.cat([_encoder_table(True), _encoder_table(False)])
        _TABLES[key] = torch.cat([quant8.c_tables(), enc.view(torch.float32)]).to(key)
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
    """:func:`.quant8.encode` of normalized values ``x`` (fp32): codes as int32. Eager's decade (the count of
    midpoints at or below ``a``, or 8 above the top threshold), its ``n`` and ``inv_scale``, from one entry of the
    binade table (:func:`_encoder_table`: by ``x``'s sign and exponent bits) and one comparison, instead of 8
    comparisons and 16 selects; then eager's arithmetic in its order."""
    bits = x.to(tl.uint32, bitcast=True)
    a = tl.abs(x) if SIGNED else x  # unsigned: a negative x (never stored: second moments are >= 0) counts 0
    entry = table_ptr.to(tl.pointer_type(tl.int64)) + (_ENC_SIGNED if SIGNED else _ENC_UNSIGNED) + (bits >> 23) * 4
    q0 = tl.load(entry)  # an entry is one 32-byte sector: three 8-byte loads at immediate offsets of one address
    q1 = tl.load(entry + 1)
    q2 = tl.load(entry + 2)
    up = a >= q0.to(tl.int32).to(tl.float32, bitcast=True)
    n = tl.where(up, (q1 >> 32).to(tl.int32), (q0 >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
    inv_scale = tl.where(up, q2.to(tl.int32), q1.to(tl.int32)).to(tl.float32, bitcast=True)
    k = tl.floor((a * inv_scale - 1.0) * (n * 0.1111111111111111))
    j = n + tl.maximum(tl.minimum(k, n - 1.0), 0.0)
    if SIGNED:  # 127 + j, or 127 - j below zero: j (>= 0) takes x's sign bit
        code = 127.0 + (j.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    else:
        code = j - 1.0  # the floor is in the table
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
