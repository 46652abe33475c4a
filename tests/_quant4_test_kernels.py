"""Small Triton kernels over :mod:`hf_efficient.optim.quant4_triton`, for tests/test_quant4.py (jit needs a file)."""

import triton
import triton.language as tl

from hf_efficient.optim import quant4_triton as Q


@triton.jit
def _tile(blk):
    """Element offsets ``(8, NB, 16)`` of blocks ``blk``: element ``16k + j`` of block ``b`` at ``[k, b, j]``."""
    return (tl.arange(0, 8) * 16)[:, None, None] + blk[None, :, None] * 128 + tl.arange(0, 16)[None, None, :]


@triton.jit
def store_kernel(x_ptr, words_ptr, scale_ptr, nblocks, SIGNED: tl.constexpr, NB: tl.constexpr):
    """Blocks of values (whole blocks, zero-padded by the caller) stored as in-memory codes and scales."""
    blk = tl.program_id(0) * NB + tl.arange(0, NB)
    bmask = blk < nblocks
    x = tl.load(x_ptr + _tile(blk), mask=bmask[None, :, None], other=0.0)
    Q.store(x, words_ptr, scale_ptr, blk, bmask, SIGNED)


@triton.jit
def load_kernel(words_ptr, scale_ptr, out_ptr, map_ptr, nblocks, SIGNED: tl.constexpr, NB: tl.constexpr):
    """Blocks' decoded values from in-memory codes and scales."""
    blk = tl.program_id(0) * NB + tl.arange(0, NB)
    bmask = blk < nblocks
    tl.store(out_ptr + _tile(blk), Q.load(words_ptr, scale_ptr, blk, bmask, map_ptr, SIGNED),
             mask=bmask[None, :, None])


@triton.jit
def moments_kernel(wm_ptr, am_ptr, wv_ptr, av_ptr, g_ptr, map_ptr, b1, omb1, b2, omb2, nblocks,
                   NB: tl.constexpr):
    """What a 4-bit AdamW step does with its state, less the weight: both moments decoded, updated with a gradient
    and stored. For counting the codec's instructions (scripts/quant4_sass.py) and for the tests."""
    blk = tl.program_id(0) * NB + tl.arange(0, NB)
    bmask = blk < nblocks
    g = tl.load(g_ptr + _tile(blk), mask=bmask[None, :, None], other=0.0)
    m = Q.load(wm_ptr, am_ptr, blk, bmask, map_ptr, True) * b1 + g * omb1
    v = Q.load(wv_ptr, av_ptr, blk, bmask, map_ptr, False) * b2 + (g * g) * omb2
    Q.store(m, wm_ptr, am_ptr, blk, bmask, True)
    Q.store(v, wv_ptr, av_ptr, blk, bmask, False)


@triton.jit
def step_kernel(p_ptr, wm_ptr, am_ptr, wv_ptr, av_ptr, g_ptr, map_ptr, b1, omb1, b2, omb2, inv_bc2, eps, decay,
                step_size, nblocks, NB: tl.constexpr):
    """:func:`moments_kernel` with AdamW's update of fp32 weights (``torch.optim.AdamW``'s order, the fresh
    moments'): a 4-bit AdamW step's instructions, whose ``sqrt(v)`` the second moment's encoder shares."""
    blk = tl.program_id(0) * NB + tl.arange(0, NB)
    bmask = blk < nblocks
    offs = _tile(blk)
    g = tl.load(g_ptr + offs, mask=bmask[None, :, None], other=0.0)
    m = Q.load(wm_ptr, am_ptr, blk, bmask, map_ptr, True) * b1 + g * omb1
    v = Q.load(wv_ptr, av_ptr, blk, bmask, map_ptr, False) * b2 + (g * g) * omb2
    p = tl.load(p_ptr + offs, mask=bmask[None, :, None], other=0.0)
    tl.store(p_ptr + offs, p * decay - tl.div_rn(m, tl.sqrt_rn(v) * inv_bc2 + eps) * step_size,
             mask=bmask[None, :, None])
    Q.store(m, wm_ptr, am_ptr, blk, bmask, True)
    Q.store(v, wv_ptr, av_ptr, blk, bmask, False)
