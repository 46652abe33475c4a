"""The 8-bit families' Triton kernels (CUDA; CPU under the interpreter in tests): one launch per tensor and step.

One program steps ``NB`` whole blocks of 256 elements in one pass: it reads the weight, the gradient, the codes and
absmaxes (and the Kahan buffer), computes the moments in fp32 in the order of the family's eager ``_kernel``, and
writes the codes, absmaxes and weight (bf16/fp16 through :func:`._triton_lib.compensated`). The codec is
:mod:`.quant8_triton`'s, so the codes are the eager kernel's exactly. Conventions (the void flag, device step counts
the kernel computes its bias corrections and noise key from) are :mod:`._triton`'s. Bytes per parameter: the
weight read and written, the gradient read, each moment's code read and written, ~4 / 256 of absmax each way (and
the Kahan buffer's 2 + 2): fp32 weights 16 (AdamW) / 14 (Lion), bf16 weights 10 / 8 plus 4 under Kahan.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import _triton
from . import quant8_triton as Q

__all__ = ["adamw8bit", "lion8bit", "NB"]

L = _triton.jit_helpers()
NB = 4  # blocks per program: 1024 elements, 16-byte vector loads of fp32 weights at 4 warps
_F32_MAX = tl.constexpr(3.4028234663852886e38)
_split = lru_cache(maxsize=64)(_triton.split64)  # per tensor and step otherwise: a few torch ops each on the host
_OUT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _blocks(nb, n, NB: tl.constexpr):
    """This program's blocks ``(NB, 1)`` (int64: offsets of tensors over 2**31 bytes), which exist, their element
    offsets ``(NB, 256)`` and which of those are in the tensor (the last block is zero-padded, as eager's)."""
    blk = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)[:, None]
    offs = blk * 256 + tl.arange(0, 256)[None, :]
    return blk, blk < nb, offs, offs < n


@triton.jit
def _write(p_ptr, comp_ptr, old, new, offs, emask, position, step, MODE: tl.constexpr, OUT: tl.constexpr):
    """The new weight stored in ``OUT`` under compensation ``MODE`` (and the Kahan buffer, bf16), noise keyed by the
    parameter's position and step and numbered by element, as ``compensation.write``."""
    kahan: tl.constexpr = MODE == 0 and OUT != tl.float32
    if kahan:
        comp = tl.load(comp_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    else:
        comp = old
    key = L.weight_key(tl.full((), 0, tl.int32) + position, step)  # position 1 arrives as a constexpr
    w, c = L.compensated(old, new, comp, key, offs.to(tl.int32), MODE, OUT)
    tl.store(p_ptr + offs, w, mask=emask)
    if kahan:
        tl.store(comp_ptr + offs, L.to_bf16(c), mask=emask)


@triton.jit
def adamw8bit_kernel(p_ptr, g_ptr, wm_ptr, wv_ptr, am_ptr, av_ptr, comp_ptr, step_ptr, flag_ptr, table_ptr, n, nb,
                     position, b1, omb1, b2, omb2, eps, decay, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo,
                     MODE: tl.constexpr, OUT: tl.constexpr, NB: tl.constexpr):
    """``adamw8bit._kernel`` on ``NB`` blocks; its bias corrections in float64 from the step, as ``_coefficients``."""
    if tl.load(flag_ptr) != 0:
        return
    step = tl.load(step_ptr).to(tl.int32)
    one = tl.full((), 1.0, tl.float64)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    # float64 division and square root are correctly rounded on the GPU (PTX has no approximate fp64 forms)
    step_size = (lr / (one - L.pow_int(beta1_hi, beta1_lo, step))).to(tl.float32)
    inv_bc2 = (one / tl.sqrt(one - L.pow_int(beta2_hi, beta2_lo, step))).to(tl.float32)
    blk, bmask, offs, emask = _blocks(nb, n, NB)
    g = tl.load(g_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    m = Q.load(wm_ptr, am_ptr, blk, bmask, table_ptr, True) * b1 + g * omb1
    v = Q.load(wv_ptr, av_ptr, blk, bmask, table_ptr, False) * b2 + (g * g) * omb2
    v = tl.where(v > _F32_MAX, _F32_MAX, v)  # clamp_max (a NaN stays): see adamw8bit._kernel
    old = tl.load(p_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    new = old * decay - tl.div_rn(m, tl.sqrt_rn(v) * inv_bc2 + eps) * step_size
    _write(p_ptr, comp_ptr, old, new, offs, emask, position, step, MODE, OUT)
    Q.store(m, wm_ptr, am_ptr, blk, bmask, table_ptr, True, NB)
    Q.store(v, wv_ptr, av_ptr, blk, bmask, table_ptr, False, NB)


@triton.jit
def lion8bit_kernel(p_ptr, g_ptr, wm_ptr, am_ptr, comp_ptr, step_ptr, flag_ptr, table_ptr, n, nb, position, b1, omb1,
                    b2, omb2, decay, lr, MODE: tl.constexpr, OUT: tl.constexpr, NB: tl.constexpr):
    """``lion8bit._kernel`` on ``NB`` blocks (the step only keys the rounding noise)."""
    if tl.load(flag_ptr) != 0:
        return
    step = tl.load(step_ptr).to(tl.int32)
    blk, bmask, offs, emask = _blocks(nb, n, NB)
    g = tl.load(g_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    m = Q.load(wm_ptr, am_ptr, blk, bmask, table_ptr, True)
    u = m * b1 + g * omb1
    update = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))  # torch.sign (0 for NaN, as on CPU)
    old = tl.load(p_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    _write(p_ptr, comp_ptr, old, old * decay - update * lr, offs, emask, position, step, MODE, OUT)
    Q.store(m * b2 + g * omb2, wm_ptr, am_ptr, blk, bmask, table_ptr, True, NB)


def _common(p, g, state, flag, position, mode):
    """The arguments every 8-bit launch shares, after its tensors' moment arguments, and its keywords."""
    nb = state["exp_avg_absmax"].numel()
    comp = state.get("kahan_comp", p) if mode == "kahan" else p  # not read unless Kahan on bf16/fp16 weights
    args = (comp, state["step"], flag, Q.tables(p.device), p.numel(), nb, position)
    return args, dict(MODE=_triton.C_MODES[mode], OUT=_OUT[p.dtype], NB=NB, num_warps=4, enable_fp_fusion=False), (
        triton.cdiv(nb, NB),)


def adamw8bit(p, g, state: dict, flag, position: int, group: dict, mode: str) -> None:
    """One AdamW8bit step of ``p`` (contiguous) and its state (step already counted, on ``p``'s device)."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    args, kw, grid = _common(p, g, state, flag, position, mode)
    adamw8bit_kernel[grid](p, g, state["exp_avg"].view(torch.int32), state["exp_avg_sq"].view(torch.int32),
                           state["exp_avg_absmax"], state["exp_avg_sq_absmax"], *args, beta1, 1.0 - beta1, beta2,
                           1.0 - beta2, group["eps"], 1.0 - lr * group["weight_decay"], *_split(lr), *_split(beta1),
                           *_split(beta2), **kw)


def lion8bit(p, g, state: dict, flag, position: int, group: dict, mode: str) -> None:
    """One Lion8bit step of ``p`` (contiguous) and its state (step already counted, on ``p``'s device). Its scalars
    are Lion8bit's (``lion8bit._c_coefficients``), each rounded to fp32 by the launch as there by ``array("f")``."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    args, kw, grid = _common(p, g, state, flag, position, mode)
    lion8bit_kernel[grid](p, g, state["exp_avg"].view(torch.int32), state["exp_avg_absmax"], *args, beta1,
                          1.0 - beta1, beta2, 1.0 - beta2, 1.0 - lr * group["weight_decay"], lr, **kw)
