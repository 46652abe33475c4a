"""Lion on fp32 momenta (:func:`.lion8bit.lion`: Lion8bit's small tensors and embeddings) as a Triton kernel.

Tensors of up to :data:`SMALL` elements share one launch over a :class:`._triton.PointerTable` (a 2-D grid: blocks x
tensors), each larger one gets a launch of its own (a table of one), per weight and gradient dtype. The kernel
reads the weight, gradient, momentum (and Kahan buffer), writes them in one pass: 4 + 4 + 4 + 4 + 4 = 20 bytes per
fp32 parameter, 2 + 2 + 2 + 4 + 4 = 14 for bf16 weights and gradients (+4 under Kahan). Steps are counted on the
device (:func:`._triton.advance_steps`), the noise key computed in the kernel (as :mod:`.blockwise_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton
from .blockwise_triton import _OUT, _write

__all__ = ["lion", "SMALL", "BLOCK"]

BLOCK = 1024  # elements per program
SMALL = 1 << 16  # elements up to which tensors share one launch (the grid's first axis covers the largest)
_MAX_TENSORS = 65535  # per launch: CUDA's limit on a grid's second axis


@triton.jit
def lion_kernel(table, info, flag_ptr, count, b1, omb1, b2, omb2, decay, lr, MODE: tl.constexpr, OUT: tl.constexpr,
                GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """``lion8bit._torch_path`` on block ``program_id(0)`` of tensor ``program_id(1)``. ``table``: addresses of
    the weights, gradients, momenta, Kahan buffers and step counts (``count`` each); ``info``: sizes then
    positions."""
    if tl.load(flag_ptr) != 0:
        return
    t = tl.program_id(1)
    n = tl.load(info + t)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start >= n:
        return
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    p_ptr = tl.load(table + t).to(tl.pointer_type(OUT))
    g_ptr = tl.load(table + count + t).to(tl.pointer_type(GRAD))
    m_ptr = tl.load(table + 2 * count + t).to(tl.pointer_type(tl.float32))
    c_ptr = tl.load(table + 3 * count + t).to(tl.pointer_type(tl.bfloat16))
    step = tl.load(tl.load(table + 4 * count + t).to(tl.pointer_type(tl.float32))).to(tl.int32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    u = m * b1 + g * omb1
    update = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))  # torch.sign (0 for NaN, as on CPU)
    old = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _write(p_ptr, c_ptr, old, old * decay - update * lr, offs, mask, tl.load(info + count + t).to(tl.int32), step,
           MODE, OUT)
    tl.store(m_ptr + offs, m * b2 + g * omb2, mask=mask)


def lion(params, grads, exp_avgs, comps, steps, positions, found_inf, tables: dict, coef: list[float],
         compensation: str) -> None:
    """One Lion step of CUDA tensors (:func:`._triton.applies`; contiguous) with fp32 momenta: their ``steps``
    counted unless ``found_inf`` is set, then one launch per group of small tensors of one dtype pair and one per
    large tensor. ``tables``: the caller's dict of :class:`._triton.PointerTable` (kept between steps: rebuilt only
    when an address changes); ``coef``: ``lion8bit._c_coefficients``."""
    _triton.advance_steps(list(steps), found_inf)
    batches = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        kind = (p.dtype, g.dtype, p.device)
        batches.setdefault(kind + ((i,) if p.numel() > SMALL else ()), []).append(i)
    for kind, idx in [(k, ids[a:a + _MAX_TENSORS]) for k, ids in batches.items()
                      for a in range(0, len(ids), _MAX_TENSORS)]:
        p0, g0 = params[idx[0]], grads[idx[0]]
        kahan = compensation == "kahan" and p0.dtype != torch.float32
        lists = [[params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                 [comps[i] if kahan else params[i] for i in idx], [steps[i] for i in idx]]
        sizes = [params[i].numel() for i in idx]
        # a table per set of tensors: gradient release steps a different bucket each call, the same ones each step
        table, info = tables.setdefault(kind + tuple(positions[i] for i in idx), _triton.PointerTable()).get(
            lists, sizes + [positions[i] for i in idx], p0.device)
        grid = (triton.cdiv(max(sizes), BLOCK), len(idx))
        lion_kernel[grid](table, info, found_inf, len(idx), *coef, MODE=_triton.C_MODES[compensation],
                          OUT=_OUT[p0.dtype], GRAD=_OUT[g0.dtype], BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
