"""Lion on fp32 momenta (:func:`.lion8bit.lion`: Lion8bit's small tensors and embeddings) as a Triton kernel.

All the tensors of one weight and gradient dtype share one launch over a :class:`._triton.PointerTable`
(:func:`._triton.launch`: tensors on the grid's axis 0, their blocks on axes 1 and 2; a tensor of more than
``MAX_PROGRAMS`` blocks alone). The kernel reads the weight, gradient, momentum (and Kahan buffer), writes them
in one pass: 4 + 4 + 4 + 4 + 4 = 20 bytes per fp32 parameter, 2 + 2 + 2 + 4 + 4 = 14 for bf16 weights and
gradients (+4 under Kahan). Steps are counted on the device (:func:`._triton.advance_steps`), the noise key
computed in the kernel (as :mod:`.blockwise_triton`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _triton

__all__ = ["lion", "lion_update", "BLOCK"]

L = _triton.jit_helpers()

BLOCK = 1024  # elements per program


@triton.jit
def lion_update(old, g, m, b1, omb1, b2, omb2, decay, lr):
    """Lion on fp32 values, the one Triton copy of it (this kernel's and :mod:`.blockwise_triton`'s): the new weight
    and momentum from the weight ``old``, the gradient and the momentum, in ``lion8bit._kernel``'s order.
    ``sign(u) * lr`` as a select of ``lr`` (the same bits; sign as torch's: 0 for 0 and NaN, as on CPU)."""
    u = m * b1 + g * omb1
    return old * decay - tl.where(u > 0, lr, tl.where(u < 0, -lr, 0.0)), m * b2 + g * omb2


@triton.jit
def _lion(table, info, count, t, n, start, b1, omb1, b2, omb2, decay, lr, MODE: tl.constexpr, OUT: tl.constexpr,
          GRAD: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr):
    """:func:`lion_kernel`'s program; ``FULL``: all its elements are in the tensor (a constant mask: loads stay
    16-byte vectors, which a mask against ``n``, read from memory and of unknown divisibility, would split)."""
    offs = start + tl.arange(0, BLOCK)
    if FULL:
        mask = tl.full(offs.shape, 1, tl.int1)
    else:
        mask = offs < n
    p_ptr = L.address(table, 0, count, t, OUT, 16 * ALIGNED)
    step = tl.load(L.address(table, 2, count, t, tl.float32, 0)).to(tl.int32)
    m_ptr = L.address(table, 3, count, t, tl.float32, 16 * ALIGNED)
    g = tl.load(L.address(table, 1, count, t, GRAD, 16 * ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
    old = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    new, m = lion_update(old, g, tl.load(m_ptr + offs, mask=mask, other=0.0), b1, omb1, b2, omb2, decay, lr)
    L.write(p_ptr, L.address(table, 4, count, t, tl.bfloat16, 16 * ALIGNED), offs, mask, old, new,
            L.weight_key(tl.load(info + count + t).to(tl.int32), step), offs.to(tl.int32), MODE)
    tl.store(m_ptr + offs, m, mask=mask)


@triton.jit(do_not_specialize=["count"])
def lion_kernel(table, info, flag_ptr, count, b1, omb1, b2, omb2, decay, lr, MODE: tl.constexpr, OUT: tl.constexpr,
                GRAD: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """``lion8bit._torch_path`` on a block of tensor ``program_id(0)``. ``table`` rows: weights, gradients, step
    counts, momenta, Kahan buffers; ``info``: sizes, then positions."""
    if tl.load(flag_ptr) != 0:
        return
    t, n, start = L.tensor_of_program(info, BLOCK)
    if start >= n:
        return
    if start + BLOCK <= n:
        _lion(table, info, count, t, n, start, b1, omb1, b2, omb2, decay, lr, MODE, OUT, GRAD, ALIGNED, BLOCK, True)
    else:
        _lion(table, info, count, t, n, start, b1, omb1, b2, omb2, decay, lr, MODE, OUT, GRAD, ALIGNED, BLOCK, False)


def lion(params, grads, exp_avgs, comps, steps, positions, found_inf, tables: dict, coef: list[float],
         compensation: str) -> None:
    """One Lion step of CUDA tensors (:func:`._triton.applies`; contiguous) with fp32 momenta: their ``steps``
    counted unless ``found_inf`` is set, then one launch per (weight dtype, gradient dtype)
    (:func:`._triton.launch`). ``tables``: the caller's dict of :class:`._triton.PointerTable` (kept between steps:
    rebuilt only when an address changes); ``coef``: ``lion8bit._c_coefficients``."""
    _triton.advance_steps(list(steps), found_inf)
    kahan = compensation == "kahan"
    items = [(positions[i], [p, grads[i], steps[i], exp_avgs[i], comps[i] if kahan and comps[i] is not None else p])
             for i, p in enumerate(params)]
    _triton.launch(lion_kernel, items, tables, found_inf, tuple(coef), compensation, BLOCK, BLOCK=BLOCK)
