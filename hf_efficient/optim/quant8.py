"""The blockwise 8-bit codec shared by every 8-bit family (its C twin is ``quant8.h``).

Format: bitsandbytes' (``bnb.optim.*8bit``, torchao's ``OptimState8bit``): a tensor is cut into blocks of
:data:`BLOCK` elements, each scaled by its absolute maximum (fp32, one per block) and stored as uint8 codes into
one of two dynamic maps (:func:`dynamic_map`): signed for values of either sign (a first moment), unsigned for
non-negative ones (a second moment).

Decoding and encoding follow the structure of the maps (a decade per power of ten, linear codes inside it)
instead of looking codes up in a table: inductor's C++ turns a gather into a scalar loop, slower than this
arithmetic. Decoded values are within 2 ulp of the table's (a relative 2e-7, far below the 8-bit step);
encoding picks the nearest decoded value (ties within an ulp may go either way), and in the unsigned map never
0 for a positive value (a second moment stored as 0 beside a non-zero first moment would make a later zero
gradient move the weight by ``lr * m / eps``). Every code is the nearest one (bitsandbytes' CPU kernel misses the
nearest code for ~0.2% of values, by up to 5 codes, in its binary search; its pure-torch reference takes the
nearest, as here).

Layouts. *Canonical* (checkpoints, :func:`quantize_blockwise`): codes of the tensor's shape, in element order,
as bitsandbytes. *In memory* (the kernels'): padded to whole blocks, and the codes of each block interleaved:
byte ``4 * j + k`` holds element ``64 * k + j``, so a kernel reads 32-bit words whose four bytes belong to four
contiguous runs of elements. Why: inductor's C++ loads 8 bytes at a time through a stack buffer, a
store-forwarding stall that costs as much as a whole fp32 AdamW step; 32-bit words read as float32 are plain
vector loads. :func:`to_canonical` / :func:`from_canonical` convert.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["BLOCK", "BITS", "WORDS", "ZERO_CODE", "canonical_shape", "blocks", "dynamic_map", "decode", "encode", "quantize_blockwise", "dequantize_blockwise",
           "quantize_moments", "to_canonical", "from_canonical", "zero_codes", "unpack", "pack", "block_scale",
           "c_tables"]

BLOCK = 256  # elements per absmax block (bitsandbytes' and torchao's); the one definition in this package
BITS = 8  # per code: a state key stored by this codec costs BITS / 8 bytes per element and 4 per block (its absmax)
_F32_TINY = torch.finfo(torch.float32).tiny  # 2**-126, fp32's smallest normal number
WORDS = BLOCK // 4  # int32 words per block in memory
ZERO_CODE = {True: 127, False: 0}  # code of 0.0 in the signed / unsigned map
_CHUNK = 1024  # blocks per eager chunk: bounds the fp32 temporaries (~1 MiB each)


def dynamic_map(signed: bool) -> Tensor:
    """bitsandbytes' ``create_dynamic_map(signed)`` (its defaults), computed the same way in plain torch.

    Decade ``d`` (0..6) of ``[10**(d-7), 10**(d-6)]`` holds ``2**d`` (signed: and their negatives) or
    ``2**(d+1)`` (unsigned) linearly spaced codes; then 0 and 1.0.
    """
    data = []
    for i in range(7):
        n = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, n, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def _first(signed: bool) -> int:
    return 1 if signed else 2  # codes in decade 0


def decode(c: Tensor, signed: bool) -> Tensor:
    """Map values of codes ``c`` (as float): ``10**(d-7) * (9 * (J + 0.5) / n - 8)`` in decade ``d``.

    ``J`` counts codes away from zero, ``n`` is the number of codes in the decade; the decade is
    ``J >= first * 2**d``.
    """
    first = _first(signed)
    J = (c - 127).abs() if signed else c + 1
    scale = torch.full_like(J, 1e-7)
    n = torch.full_like(J, float(first))
    for d in range(1, 7):
        above = J >= first * 2**d
        scale = torch.where(above, 10.0 ** (d - 7), scale)
        n = torch.where(above, float(first * 2**d), n)
    val = scale * ((J * 9 + 4.5) / n - 8)
    val = torch.where(J == (0 if signed else 1), 0.0, torch.where(J == (128 if signed else 256), 1.0, val))
    return torch.where(c < 127, -val, val) if signed else val


def _encode_thresholds(signed: bool) -> tuple[list[float], float]:
    """Midpoints (fp32) below the first code of each decade, and between the last code and 1.0."""
    codes = decode(torch.arange(256, dtype=torch.float32), signed).double()
    pos = codes[127:] if signed else codes  # 0.0, then the positive codes in order
    mids = (pos[1:] + pos[:-1]) / 2
    first = _first(signed)
    return [mids[first * 2**d - first].float().item() for d in range(7)], mids[-1].float().item()


THRESHOLDS = {s: _encode_thresholds(s) for s in (True, False)}


def encode(x: Tensor, signed: bool) -> Tensor:
    """Code (as float) of the map value nearest to ``x`` (in [-1, 1] signed, [0, 1] unsigned); in the unsigned map,
    at least the smallest positive code for a positive ``x``.

    Picking the decade by the midpoints between decades makes the nearest code inside it the only
    candidate: ``J = n + k`` with ``k`` the linear bin, clamped to the decade. Below the first midpoint
    the code is 0.0's (``n = J0``, scale 0), above the last one it is 1.0's (positive values only).
    """
    first = _first(signed)
    mids, top = THRESHOLDS[signed]
    a = x.abs() if signed else x
    n = torch.full_like(a, 0.0 if signed else 1.0)
    inv_scale = torch.zeros_like(a)
    for d in range(7):
        above = a >= mids[d]
        n = torch.where(above, float(first * 2**d), n)
        inv_scale = torch.where(above, 10.0 ** (7 - d), inv_scale)
    above = x > top
    n = torch.where(above, float(first * 128), n)
    inv_scale = torch.where(above, 0.0, inv_scale)
    k = torch.floor((a * inv_scale - 1) * (n * (1 / 9)))
    J = n + torch.clamp_min(torch.minimum(k, n - 1), 0)
    if signed:
        return torch.where(x < 0, 127 - J, 127 + J)
    return torch.maximum(J - 1, (x > 0).float())  # the floor: a positive value never gets 0.0's code


# ----------------------------------------------------------------------------------------------------
# Blocks in the kernels' form: (nb, 256) fp32 values <-> (nb, 64) int32 words viewed as float32
# ----------------------------------------------------------------------------------------------------


def unpack(words: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """Values ``(nb, 256)`` fp32 of in-memory codes ``(nb, 64)`` (int32 words viewed as float32) and absmaxes."""
    shift = (torch.arange(BLOCK, dtype=torch.int32, device=words.device) // WORDS * 8)[None, :]
    codes = ((words.view(torch.int32).repeat(1, 4) >> shift) & 255).float()
    return decode(codes, signed) * absmax[:, None]


def block_scale(xb: Tensor) -> Tensor:
    """The stored scale ("absmax") of each row of blocks ``xb``: its largest |x|, raised to fp32's smallest normal
    number where it is below it and positive. A smaller one's reciprocal (the normalizer) overflows to inf and every
    value of its block would encode as inf (seen: second moments of ~1e-44 from gradients of ~1e-21). The C kernels
    do the same (``quant8.h``'s ``block_scale``)."""
    a = xb.abs().amax(1, keepdim=True)
    return torch.where((a > 0) & (a < _F32_TINY), _F32_TINY, a)


def _normalized(x: Tensor, a: Tensor) -> Tensor:
    """Blocks ``x`` times the reciprocal of their scales ``a`` (a zero block's scale, 0, counts as 1)."""
    return x * (1.0 / torch.where(a > 0, a, 1.0))


def pack(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """In-memory codes ``(nb, 64)`` (int32 words viewed as float32) and absmaxes ``(nb,)`` of values ``(nb, 256)``.

    Normalized by the reciprocal of the absmax, as bitsandbytes' kernels do: one division per block.
    """
    a = block_scale(x)
    q = encode(_normalized(x, a), signed)
    w = [q[:, k * WORDS:(k + 1) * WORDS].to(torch.int32) for k in range(4)]
    return (w[0] | (w[1] << 8) | (w[2] << 16) | (w[3] << 24)).view(torch.float32), a.flatten()


@lru_cache(maxsize=None)
def c_tables() -> Tensor:
    """What ``quant8.h``'s ``quant8_maps`` reads: both maps' decoded values (so its lookups equal :func:`decode`),
    then each map's 7 decade midpoints and top threshold (fp32, 528 values)."""
    codes = torch.arange(256, dtype=torch.float32)
    return torch.cat([decode(codes, True), decode(codes, False)] + [
        torch.tensor([*THRESHOLDS[s][0], THRESHOLDS[s][1]], dtype=torch.float32) for s in (True, False)])


# ----------------------------------------------------------------------------------------------------
# Layouts: in memory (padded, interleaved words) <-> canonical (the tensor's shape, element order)
# ----------------------------------------------------------------------------------------------------


def blocks(numel: int) -> int:
    """Blocks (absmaxes) of a tensor of ``numel`` elements."""
    return -(-numel // BLOCK)


def zero_codes(numel: int, signed: bool, device=None) -> tuple[Tensor, Tensor]:
    """In-memory codes and absmaxes of zeros for a tensor of ``numel`` elements (zero codes in whole blocks)."""
    nb = blocks(numel)
    return (torch.full((nb * BLOCK,), ZERO_CODE[signed], dtype=torch.uint8, device=device),
            torch.zeros(nb, dtype=torch.float32, device=device))


def canonical_shape(shape) -> tuple[int, ...]:
    """The shape of a tensor's canonical codes: its own (one byte per element)."""
    return tuple(shape)


def to_canonical(codes: Tensor, p: Tensor) -> Tensor:
    """In-memory codes of ``p``'s state -> canonical codes of ``p``'s shape (a copy)."""
    return codes.view(-1, WORDS, 4).transpose(1, 2).reshape(-1)[: p.numel()].view(p.shape).clone()


def from_canonical(codes: Tensor, p: Tensor, signed: bool) -> Tensor:
    """Canonical codes (any shape of ``p.numel()`` elements) -> in-memory codes on ``p``'s device."""
    nb = blocks(p.numel())
    flat = torch.full((nb * BLOCK,), ZERO_CODE[signed], dtype=torch.uint8, device=p.device)
    flat[: p.numel()] = codes.reshape(-1).to(p.device)
    return flat.view(nb, 4, WORDS).transpose(1, 2).reshape(-1).contiguous()


def blocks_of(x: Tensor) -> Tensor:
    """Flat ``x`` zero-padded to whole blocks, as (blocks, 256): the kernels' padding."""
    flat = x.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)


# ----------------------------------------------------------------------------------------------------
# Canonical quantize / dequantize (checkpoint conversions)
# ----------------------------------------------------------------------------------------------------


def quantize_blockwise(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """Canonical uint8 codes (``x``'s shape, element order) and fp32 absmaxes (one per block) of ``x``, exactly as
    a kernel stores a state of these values (same normalization, same encoder, same floor)."""
    xb = blocks_of(x.detach().float())
    absmax = block_scale(xb)
    codes = [encode(_normalized(c, a), signed).to(torch.uint8)  # bounded temporaries
             for c, a in zip(xb.split(_CHUNK), absmax.split(_CHUNK))]
    return torch.cat(codes).reshape(-1)[: x.numel()].view(x.shape), absmax.flatten()


def dequantize_blockwise(codes: Tensor, absmax: Tensor, signed: bool, shape=None) -> Tensor:
    """fp32 values of canonical codes (any shape; the last block may be partial): the kernels' decoded values, of
    ``shape`` (default: the codes', which is the parameter's)."""
    flat = decode(codes.reshape(-1).float(), signed)
    pad = absmax.numel() * BLOCK - flat.numel()
    out = torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK) * absmax.float().view(-1, 1)
    return out.reshape(-1)[: codes.numel()].view(codes.shape if shape is None else shape)


def _describe(t) -> str:
    return f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, Tensor) else f"a {type(t).__name__}"


def checked_moments(exp_avg: Tensor, exp_avg_sq: Tensor | None = None) -> dict:
    """``{"exp_avg": ..., "exp_avg_sq": ...}`` (the second where given) once they are one parameter's AdamW (or Lion)
    moments: what every codec's ``quantize_moments`` checks before it quantizes.

    Raises:
        ValueError: the moments differ in shape, are not floating point, or hold non-finite values or (second
            moment) negative ones.
    """
    moments = {"exp_avg": exp_avg} if exp_avg_sq is None else {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, t in moments.items():
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"quantize_moments: {name} is {_describe(t)}; expected a floating-point tensor")
    if exp_avg_sq is not None and exp_avg.shape != exp_avg_sq.shape:
        raise ValueError(f"quantize_moments: exp_avg has shape {tuple(exp_avg.shape)}, exp_avg_sq "
                         f"{tuple(exp_avg_sq.shape)}: the moments of one parameter have its shape")
    if not all(t.detach().isfinite().all() for t in moments.values()) or (
            exp_avg_sq is not None and (exp_avg_sq.detach() < 0).any()):
        raise ValueError("quantize_moments: the moments hold non-finite values, or exp_avg_sq negative ones: "
                         "they are not AdamW moments")
    return moments


def quantize_moments(exp_avg: Tensor, exp_avg_sq: Tensor | None = None) -> dict:
    """fp32 moments of one parameter as the 8-bit state a step would store for them, in the canonical layout.

    Returns ``exp_avg`` (signed codes) and, where ``exp_avg_sq`` is given (AdamW; Lion has none), ``exp_avg_sq``
    (unsigned codes, with the floor: a positive second moment never becomes 0), each with its ``*_absmax``. For
    converting another optimizer's state (checkpoint loading).

    Raises:
        ValueError: the moments differ in shape, are not floating point, or hold non-finite values or (second
            moment) negative ones.
    """
    moments = checked_moments(exp_avg, exp_avg_sq)
    out = {}
    for key, t in moments.items():
        out[key], out[f"{key}_absmax"] = quantize_blockwise(t, key == "exp_avg")
    return out
