"""The blockwise 4-bit codec for AdamW's moments (its C twin is ``quant4.h``, its Triton twin ``quant4_triton.py``).

Design: candidates compared by ``scripts/quant4_design.py`` (its results are not in docs/results yet; what is
measured here: tests/test_adamw4bit.py's tolerances, docs/results/convergence.md's run). A tensor is cut into blocks
of :data:`BLOCK` = 128 elements, each with one fp32 scale, and every element is a 4-bit code:

- signed (the first moment): torchao's ``AdamW4bit`` map (:func:`signed_map`: bitsandbytes' dynamic map with 3
  exponent bits in 4: 0, +-0.0055, +-0.0325, +-0.0775, +-0.2125, +-0.4375, +-0.6625, +-0.8875, 1), the value
  divided by the block's absmax; the code of the nearest map value.
- unsigned (the second moment): its square root on 16 linear levels ``(c + 1) / 16`` of the block's largest root
  (:func:`unsigned_map`), no zero. Li et al. 2023's zero-point problem (a second moment decoded as 0 beside a
  non-zero first moment moves the weight by ``lr * m / eps``) cannot happen: the smallest level is the root's
  1/16, the second moment's 1/256 (bitsandbytes' 8-bit map floors at ~1e-7 of the absmax). Roots and not values:
  what the update divides by is the root, and linear levels of ``v`` itself (torchao) floor every element at 1/16 of
  the block's largest ``v``, a quarter of its largest root, which shrinks the updates of the small ones.

Exact encoding, the same in torch, C and Triton (only comparisons and correctly rounded fp32 operations):

- a block's scale: its largest ``|x|`` (a NaN wins, as ``amax``), raised to 2**-126 where positive and below it
  (:func:`block_scale`, as the 8-bit codec: a smaller one's reciprocal overflows); normalized values are
  ``x * fl(1 / scale)`` (a zero block's scale counts as 1).
- signed: the code is ``7 + n`` for ``x >= 0`` and ``7 - min(n, 7)`` below, ``n`` the count of
  :data:`THRESHOLDS` at or below ``|x|``; each threshold is the smallest fp32 at or above the exact midpoint of two
  neighbouring magnitudes, so this is the nearest map value, an exact tie going to the larger magnitude. The map has
  1.0 but not -1.0: a block whose absmax is negative stores it as -0.8875 of itself. NaN: code 7 (0).
- unsigned: the normalized root ``r = fl(sqrt(v) * fl(1 / sqrt(absmax)))``, then ``c = clamp(rint(16 * r), 1, 16)
  - 1`` (``rint``: nearest, ties to even; ``16 * r`` is exact): the nearest level to the root. Decoding is
  ``(fl((c + 1) / 16 * root_scale))**2`` rounded once more. NaN: code 0. Zero blocks decode to 0.

Layouts (one byte per two elements either way):

- *Canonical* (checkpoints, :func:`quantize_blockwise`): element order, two per byte, element ``2i`` in the high
  nibble of byte ``i`` (torchao's and bitsandbytes' order), an odd count's last low nibble the zero value's code;
  shape :func:`canonical_shape`: ``(rows, row length / 2)`` where the tensor has two dimensions or more and its rows
  an even length (rows stay rows: FSDP2 shards it as the parameter, by dim 0; a matrix's last dimension halved), else
  flat ``(ceil(numel / 2),)``. Scales: ``(blocks,)`` fp32. torchao's ``OptimState4bit`` holds the same bytes for its
  signed map (:func:`torchao_values` decodes its states).
- *In memory* (the kernels'): padded to whole blocks (zero-valued elements), each block 16 little-endian 32-bit
  words in which nibble ``k`` (bits ``4k .. 4k+3``) of word ``j`` holds element ``16 * k + j``: a kernel reads a
  block's codes as one 64-byte vector, and nibble plane ``k`` is 16 contiguous elements (one AVX-512 register, one
  tile row in Triton). :func:`to_canonical` / :func:`from_canonical` convert.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from .quant8 import _describe, checked_moments

__all__ = ["BLOCK", "BITS", "WORDS", "ZERO_CODE", "BYTES_PER_ELEMENT", "signed_map", "unsigned_map", "THRESHOLDS",
           "block_scale", "encode", "decode", "pack", "unpack", "blocks", "blocks_of", "zero_codes",
           "canonical_shape", "to_canonical", "from_canonical", "quantize_blockwise", "dequantize_blockwise",
           "quantize_moments", "torchao_values", "c_tables"]

BLOCK = 128  # elements per scale (torchao's AdamW4bit); the one definition for the 4-bit codec
BITS = 4  # per code (facts.Codec): a moment costs BITS / 8 bytes per element and 4 per block (its scale)
WORDS = BLOCK // 8  # 32-bit words per block in memory (8 codes each)
ZERO_CODE = {True: 7, False: 0}  # the code a zero takes: the signed map's 0.0; the unsigned map's lowest level
BYTES_PER_ELEMENT = 0.5 + 4 / BLOCK  # a code and a share of the fp32 scale: 0.53125 a moment
_F32_TINY = torch.finfo(torch.float32).tiny  # 2**-126
_CHUNK = 2048  # blocks per eager chunk: bounds the temporaries (~1 MiB each)


def signed_map() -> Tensor:
    """torchao's ``create_dynamic_map(True, 3, 4)`` (``OptimState4bit``'s signed ``qmap``), computed as it does it:
    fp32 midpoints of ``linspace(0.1, 1, 2**i + 1)`` times ``10**(i - 2)`` in Python floats, 0 and 1, sorted."""
    data = []
    for i in range(3):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = ((bounds[:-1] + bounds[1:]) / 2.0).tolist()
        data += [10 ** (i - 2) * m for m in means] + [-(10 ** (i - 2)) * m for m in means]
    return torch.tensor(sorted(data + [0.0, 1.0]), dtype=torch.float32)


def unsigned_map() -> Tensor:
    """The normalized roots of the unsigned codes: ``(c + 1) / 16`` (exact in fp32)."""
    return torch.arange(1, 17, dtype=torch.float32) / 16


def _thresholds() -> list[float]:
    """The smallest fp32 at or above the exact midpoint of each two neighbouring magnitudes of the signed map
    (0, 0.0055, ..., 0.8875, 1): ``|x| >= t`` exactly when ``|x|`` is at or past the midpoint."""
    mags = signed_map()[7:].double()
    out = []
    for mid in ((mags[1:] + mags[:-1]) / 2).tolist():  # exact: two fp32 values' sum fits a double
        t = torch.tensor(mid, dtype=torch.float32)
        if t.item() < mid:
            t = torch.nextafter(t, torch.tensor(float("inf")))
        out.append(t.item())
    return out


THRESHOLDS = _thresholds()  # 8 fp32 values; the last lies between 0.8875 and 1.0 (only x >= 0 reaches 1.0)


def block_scale(xb: Tensor) -> Tensor:
    """The stored scale of each row of blocks ``xb`` (``(nb, 1)``): its largest ``|x|`` (NaN wins), raised to fp32's
    smallest normal number where positive and below it (``quant8.block_scale``'s rule, for the same reason)."""
    a = xb.abs().amax(1, keepdim=True)
    return torch.where((a > 0) & (a < _F32_TINY), _F32_TINY, a)


def _sqrt(x: Tensor) -> Tensor:
    """The correctly rounded fp32 square root (C's ``sqrtf``, Triton's ``sqrt_rn``): through float64, whose root
    rounds to the right fp32 (53 >= 2 * 24 + 2 bits). torch 2.13's fp32 ``sqrt`` on CPU is not always (an ulp off
    for ~1 value in 10 here), and a root's ulp can move a code across a level."""
    return x.double().sqrt().float()


def _inverse(a: Tensor) -> Tensor:
    """``fl(1 / a)``, a zero scale counting as 1."""
    return 1.0 / torch.where(a > 0, a, torch.ones_like(a))


def encode(x: Tensor, signed: bool) -> Tensor:
    """Codes (int32) of normalized values: signed, ``x`` in [-1, 1] (the nearest map value, ties away from zero);
    unsigned, ``x`` the normalized roots in [0, 1] (the nearest level ``(c + 1) / 16``, ties to even, never below
    the first)."""
    if signed:
        a = x.abs()
        n = torch.zeros_like(x, dtype=torch.int32)
        for t in THRESHOLDS:
            n += (a >= t).to(torch.int32)
        return torch.where(x < 0, 7 - torch.clamp_max(n, 7), 7 + n)
    q = torch.round(x * 16)  # half to even, as rint
    q = torch.where(q > 1, q, 1.0)  # comparisons, not clamp: a NaN takes level 1, as the C and Triton codecs
    q = torch.where(q < 16, q, 16.0)
    return q.to(torch.int32) - 1


_SIGNED_MAP = signed_map()  # a module constant: torch.compile takes it as one (a cached function it would trace)


def decode(codes: Tensor, signed: bool) -> Tensor:
    """Map values (fp32) of codes: signed, the normalized value (a lookup); unsigned, the normalized root
    ``(c + 1) / 16`` (arithmetic, exact)."""
    if signed:
        return _SIGNED_MAP.to(codes.device)[codes.long()]
    return (codes.float() + 1) * (1 / 16)


def _values(codes: Tensor, scale: Tensor, signed: bool) -> Tensor:
    """Values of codes ``(nb, k)`` with their blocks' scales ``(nb, 1)``: ``map * scale``, or for the unsigned map
    ``(root * sqrt(scale))**2``."""
    if signed:
        return decode(codes, True) * scale
    root = decode(codes, False) * _sqrt(scale)
    return root * root


def _codes_of(xb: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """Codes ``(nb, BLOCK)`` int32 and scales ``(nb, 1)`` of blocks of values ``xb`` (fp32)."""
    a = block_scale(xb)
    if signed:
        return encode(xb * _inverse(a), True), a
    return encode(_sqrt(xb) * _inverse(_sqrt(a)), False), a


# ----------------------------------------------------------------------------------------------------
# Blocks in the kernels' form: (nb, 128) fp32 values <-> (nb, 16) int32 words viewed as float32
# ----------------------------------------------------------------------------------------------------

_SHIFTS = torch.arange(8, dtype=torch.int32) * 4  # nibble k of a word: bits 4k..4k+3


def pack(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """In-memory codes ``(nb, 16)`` (int32 words viewed as float32, as ``quant8.pack``) and scales ``(nb,)`` of values
    ``(nb, 128)`` fp32: element ``16k + j`` of a block into nibble ``k`` of its word ``j``."""
    q, a = _codes_of(x, signed)
    planes = q.view(-1, 8, WORDS) << _SHIFTS.to(x.device)[None, :, None]
    return planes.sum(1, dtype=torch.int32).view(torch.float32), a.flatten()


def unpack(words: Tensor, scale: Tensor, signed: bool) -> Tensor:
    """Values ``(nb, 128)`` fp32 of in-memory codes ``(nb, 16)`` (int32 words, or their float32 view) and scales."""
    w = words.view(torch.int32)[:, None, :]
    codes = (w >> _SHIFTS.to(w.device)[None, :, None]) & 15
    return _values(codes.reshape(-1, BLOCK), scale.view(-1, 1), signed)


@lru_cache(maxsize=None)
def c_tables() -> Tensor:
    """What ``quant4.h`` reads (fp32, 24 values): the signed map (16), then :data:`THRESHOLDS` (8)."""
    return torch.cat([signed_map(), torch.tensor(THRESHOLDS, dtype=torch.float32)])


# ----------------------------------------------------------------------------------------------------
# Layouts: in memory (padded, interleaved nibbles) <-> canonical (element order, two per byte)
# ----------------------------------------------------------------------------------------------------


def blocks(numel: int) -> int:
    """Blocks (scales) of a tensor of ``numel`` elements."""
    return -(-numel // BLOCK)


def blocks_of(x: Tensor) -> Tensor:
    """Flat ``x`` zero-padded to whole blocks, as (blocks, 128): the kernels' padding."""
    flat = x.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)


def zero_codes(numel: int, signed: bool, device=None) -> tuple[Tensor, Tensor]:
    """In-memory codes (uint8, 64 bytes a block) and scales of zeros for a tensor of ``numel`` elements."""
    nb = blocks(numel)
    byte = ZERO_CODE[signed] * 17  # the code in both nibbles
    return (torch.full((nb * BLOCK // 2,), byte, dtype=torch.uint8, device=device),
            torch.zeros(nb, dtype=torch.float32, device=device))


def canonical_shape(shape) -> tuple[int, ...]:
    """The canonical codes' shape for a tensor of ``shape``: ``(rows, row length / 2)`` where there are two
    dimensions or more and a row (``shape[1:]``) has an even length (dim 0 stays: FSDP2 shards the codes by rows, as
    the parameter; a matrix's codes are its shape with the last dimension halved), else ``(ceil(numel / 2),)``."""
    shape = tuple(shape)
    row = math.prod(shape[1:])
    if len(shape) >= 2 and row % 2 == 0:
        return (shape[0], row // 2)
    return (-(-math.prod(shape) // 2),)


def _pair(codes: Tensor) -> Tensor:
    """Element-order codes (flat, even count) -> bytes, element ``2i`` high."""
    c = codes.view(-1, 2).to(torch.uint8)
    return (c[:, 0] << 4) | c[:, 1]


def _split(data: Tensor) -> Tensor:
    """Bytes -> element-order codes (uint8), high nibble first."""
    return torch.stack([data >> 4, data & 15], dim=-1).reshape(-1)


def to_canonical(codes: Tensor, p: Tensor) -> Tensor:
    """In-memory codes (uint8, 64 bytes a block) of ``p``'s state -> canonical codes of :func:`canonical_shape` of
    ``p.shape`` (a new tensor). An odd count's last low nibble is the padding element's code (a zero's)."""
    numel = p.numel()
    b = codes.reshape(-1, WORDS, 4)  # block, word j, byte b: nibble k = 2b (low) or 2b + 1 (high), element 16k + j
    nib = torch.stack([b & 15, b >> 4], dim=-1).reshape(-1, WORDS, 8).transpose(1, 2).reshape(-1)
    return _pair(nib[: numel + numel % 2]).view(canonical_shape(p.shape))


def from_canonical(codes: Tensor, p: Tensor, signed: bool) -> Tensor:
    """Canonical codes (any shape of ``ceil(p.numel() / 2)`` bytes) -> in-memory codes (uint8) on ``p``'s device,
    the padding holding the zero's code."""
    numel, nb = p.numel(), blocks(p.numel())
    flat = torch.full((nb * BLOCK,), ZERO_CODE[signed], dtype=torch.uint8, device=p.device)
    flat[:numel] = _split(codes.reshape(-1).to(p.device))[:numel]
    k = flat.view(nb, 8, WORDS).transpose(1, 2).reshape(nb, WORDS, 4, 2)  # word j, byte b, (nibble 2b, 2b + 1)
    return (k[..., 0] | (k[..., 1] << 4)).reshape(-1).contiguous()


# ----------------------------------------------------------------------------------------------------
# Canonical quantize / dequantize (checkpoint conversions)
# ----------------------------------------------------------------------------------------------------


def quantize_blockwise(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """Canonical codes (uint8, :func:`canonical_shape` of ``x``'s) and fp32 scales (one per block) of ``x``, exactly
    as a kernel stores a state of these values."""
    xb = blocks_of(x.detach().float())
    codes, scales = [], []
    for c in xb.split(_CHUNK):  # bounded temporaries
        q, a = _codes_of(c, signed)
        codes.append(q.to(torch.uint8))
        scales.append(a)
    flat = torch.cat(codes).reshape(-1)[: x.numel()]
    if x.numel() % 2:
        flat = torch.cat([flat, flat.new_full((1,), ZERO_CODE[signed])])
    return _pair(flat).view(canonical_shape(x.shape)), torch.cat(scales).flatten()


def dequantize_blockwise(codes: Tensor, scale: Tensor, signed: bool, shape=None) -> Tensor:
    """fp32 values of canonical codes with their scales, of ``shape`` (default: flat, every code of ``codes``):
    the kernels' decoded values."""
    numel = codes.numel() * 2
    if shape is not None:
        numel = 1
        for s in shape:
            numel *= s
    flat = _split(codes.reshape(-1))[:numel].int()
    pad = scale.numel() * BLOCK - numel
    out = _values(torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK), scale.float().view(-1, 1), signed)
    out = out.reshape(-1)[:numel]
    return out.view(shape) if shape is not None else out


def quantize_moments(exp_avg: Tensor, exp_avg_sq: Tensor | None = None) -> dict:
    """fp32 moments of one parameter as the 4-bit state a step would store for them, in the canonical layout:
    ``exp_avg`` (signed) and, where given, ``exp_avg_sq`` (unsigned), each with its ``*_absmax`` (the scales).
    ``quant8.quantize_moments``' contract, for converting another optimizer's state.

    Raises:
        ValueError: the moments differ in shape, are not floating point, or hold non-finite values or (second
            moment) negative ones.
    """
    moments = checked_moments(exp_avg, exp_avg_sq)
    out = {}
    for key, t in moments.items():
        out[key], out[f"{key}_absmax"] = quantize_blockwise(t, key == "exp_avg")
    return out


def torchao_values(state) -> Tensor:
    """fp32 values of a torchao ``OptimState4bit`` (``AdamW4bit``'s moments), decoded from its documented fields as
    torchao decodes them: ``codes`` (uint8, two per byte, element ``2i`` high), ``scale`` (one per block of
    ``numel / scale.numel()``), ``qmap`` (its 16 values), ``shape``. Read from the fields only: no torchao needed.

    Its first moment is on this codec's signed map in blocks of 128, so quantizing these values gives its codes back
    (tests/test_quant4.py); its second moment is on a linear map of values, not roots: quantizing it is lossy.

    Raises:
        ValueError: the fields do not describe a 4-bit tensor of its shape.
    """
    codes, scale, qmap = state.codes, state.scale.float(), state.qmap.float()
    shape = tuple(state.shape)
    numel = math.prod(shape)
    if codes.dtype != torch.uint8 or codes.numel() * 2 != numel or qmap.numel() != 16 or \
            scale.numel() == 0 or numel % scale.numel():
        raise ValueError(f"torchao state: codes {_describe(codes)}, scale {_describe(scale)}, qmap {_describe(qmap)} "
                         f"do not describe a 4-bit tensor of shape {shape}")
    return (qmap[_split(codes.reshape(-1)).long()].view(scale.numel(), -1) * scale.view(-1, 1)).view(shape)
