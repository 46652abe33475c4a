"""Blockwise 8-bit AdamW in plain PyTorch, with a C kernel for fp32 and bf16 weights on CPU.

Math: ``torch.optim.AdamW`` (decoupled weight decay, bias correction), fp32 arithmetic inside the step, and
bitsandbytes' 8-bit state (``bnb.optim.AdamW8bit``): after each step the moments are stored through the
8-bit codec of :mod:`.quant8`, ``exp_avg`` signed and ``exp_avg_sq`` unsigned.

State per 8-bit parameter: ``step``, ``exp_avg`` / ``exp_avg_sq`` (uint8, one byte per element) and
``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32, one per block): 2 bytes per element + 8 per 256 = 2.03.
The two maps are module constants (:func:`dynamic_map`), not state: they never change, so storing them
per tensor would only cost bytes. Tensors under ``min_8bit_size`` elements and ``fp32_state_params`` (the
registry passes the embeddings) keep fp32 moments and get ``torch.optim.AdamW``'s own kernel
(:func:`.adamw.adamw_fp32_state`: bf16 weights on CPU through ``adamw_cpu.c``, the same bits).

Layout. ``state_dict()`` writes :mod:`.quant8`'s canonical layout (codes of the parameter's shape, in element
order, as bitsandbytes), so a checkpoint moves to and from bnb and torchao; in memory the codes are in the
kernels' interleaved layout (see :mod:`.quant8` for why).

Kernels, chosen per tensor by :meth:`._blockwise.Blockwise8bit.choose` (shared by the 8-bit families). On CPU, contiguous fp32 or bf16 weights and gradients go through a C
kernel (``adamw8bit_cpu.c``, the op ``hf_efficient::adamw8bit_step``, built once per machine with the system C compiler, see :mod:`._native`): the
same operations per block, all 8-bit tensors of a group in one call on torch's threads. It gives the compiled
kernel's codes and absmaxes exactly and weights within an ulp of the update (sqrt: see the tests' docstring),
and must give the eager kernel's codes on a probe before it is used. It decodes by table lookup (AVX-512 VBMI
byte tables where the CPU has them) and finds the decade from the float's exponent, which inductor cannot
express: that is why it beats the compiled kernel and bitsandbytes' CPU kernel, and why the registry prefers it on
CPU (step times against torch's fused fp32 AdamW: docs/results/bench_step.md).
On CUDA, contiguous fp32, bf16 and fp16 weights go through a Triton kernel (:mod:`.blockwise_triton`: one pass
per tensor, ~16 bytes per fp32 parameter, no host synchronisation), with the eager kernel's codes.
Everything else (fp16 weights on CPU, other layouts, ``compile=True``) gets one
``torch.compile``'d kernel per tensor and step. What bounds that one: decoding and encoding make the generated
loop ~200 vector operations per 8 elements, against ~25 for fp32 AdamW. Large tensors go through it 4096 blocks
at a time, which bounds its temporaries. Without a C++ compiler (or Triton on CUDA) the same kernel runs eagerly, in
bounded chunks: same numbers, many times slower (the registry then prefers bitsandbytes: backends.compiler_missing).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _triton, quant8
from ._blockwise import Blockwise8bit
from .adamw import adamw_fp32_state
from .facts import KAHAN, STEP, Family, codes
from .quant8 import BLOCK, dynamic_map, quantize_moments

__all__ = ["ADAMW8BIT", "AdamW8bit", "adamw_update", "dynamic_map", "quantize_moments", "BLOCK"]

ADAMW8BIT = Family("adamw8bit", {"step": STEP, "exp_avg": codes(quant8, signed=True),
                                 "exp_avg_sq": codes(quant8, signed=False), "kahan_comp": KAHAN}, "adamw")

_F32_MAX = torch.finfo(torch.float32).max


# ----------------------------------------------------------------------------------------------------
# The math: Blockwise8bit.kernel decodes the moments, applies it to whole blocks and encodes them (compiled by
# inductor or run as is; same operations either way); the C and Triton kernels do the same operations.
# coef = [beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2**t), eps, 1 - lr * wd, lr / (1 - beta1**t)]
# ----------------------------------------------------------------------------------------------------


def adamw_update(p: Tensor, g: Tensor, moments: list[Tensor], coef) -> tuple[Tensor, list[Tensor]]:
    """AdamW on fp32 values (``torch.optim.AdamW``'s order): the new weight and ``[m, v]`` from the decoded
    ``moments``. Every blockwise AdamW family's math (:class:`AdamW8bit`, :class:`.adamw4bit.AdamW4bit`)."""
    # v clamped to fp32's range: a finite gradient whose square overflows would make the block's absmax inf, and
    # every code of the block NaN at the next step. m, a convex combination of m and g, stays in range (no clamp:
    # it would cost the C kernel a pass it does not need).
    m = moments[0] * coef[0] + g * coef[1]
    v = (moments[1] * coef[2] + (g * g) * coef[3]).clamp(max=_F32_MAX)
    denom = v.sqrt() * coef[4] + coef[5]
    return p * coef[6] - (m / denom) * coef[7], [m, v]


def _coefficients(group: dict, step: int) -> list[float]:
    """The kernels' scalars, in the order of ``adamw8bit_cpu.c``'s ``adamw8bit_coef_t`` (decay: ``1 - lr * wd``)."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    return [beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 / math.sqrt(1.0 - beta2**step), group["eps"],
            1.0 - lr * group["weight_decay"], lr / (1.0 - beta1**step)]


class AdamW8bit(Blockwise8bit):
    """AdamW with blockwise 8-bit moments (bitsandbytes' format), in plain PyTorch.

    A standard ``torch.optim.Optimizer``: param groups carry every hyperparameter (any LR scheduler works),
    state keys follow torch plus ``exp_avg_absmax`` / ``exp_avg_sq_absmax``, and ``state_dict()`` (canonical
    layout, see :mod:`.quant8`) loads with ``torch.load(weights_only=True)``.

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        min_8bit_size: tensors with fewer elements keep fp32 moments (bitsandbytes' default: 4096).
        fp32_state_params: parameters (or their ``id()``) that keep fp32 moments, e.g. embeddings.
        compile: None (automatic): the Triton kernel for contiguous tensors on CUDA, the C kernel for contiguous
            fp32/bf16 tensors on CPU, else the torch.compile'd kernel (inductor: C++ on CPU, Triton on CUDA); True:
            the compiled kernel; False: always eager. A compiled kernel that fails to compile falls back to the eager
            kernel with a warning.
        compensation: how updates reach bf16 / fp16 weights: ``"stochastic"`` / ``"kahan"`` / ``"none"`` (see
            :mod:`.compensation`); default: the family's (``ADAMW8BIT.compensation``); fp32 weights ignore it.

    Example::

        opt = AdamW8bit(model.parameters(), lr=2e-5, weight_decay=0.01,
                        fp32_state_params=[model.get_input_embeddings().weight])

    After a reload the dtype of the saved state decides which parameters are 8-bit, so
    ``fp32_state_params`` need not be passed again for the state to resume as it was.
    """

    FACTS = ADAMW8BIT
    C_KERNEL = TRITON_KERNEL = True
    TRITON_FP32 = True  # step_32bit's CUDA tensors take adamw_fp32_state's Triton kernel (device step counts)
    update = staticmethod(adamw_update)
    coefficients = staticmethod(_coefficients)

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = 4096, fp32_state_params=None,
                 compile: bool | None = None, compensation: str = ADAMW8BIT.compensation):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, min_8bit_size=min_8bit_size,
                        compile=compile, compensation=compensation)
        super().__init__(params, defaults, fp32_state_params)

    def step_32bit(self, group: dict, items, offsets=None) -> None:
        """fp32-state tensors through :func:`.adamw.adamw_fp32_state`: on CUDA its Triton kernel (their step counts
        live on the device, :attr:`TRITON_FP32`; keys from positions, the void flag read in the kernel), elsewhere the
        C kernel or torch's (keys from the steps, read on the host there). ``offsets``: FSDP2 shards' (see
        :meth:`._blockwise.Blockwise8bit.step_32bit`)."""
        beta1, beta2 = group["betas"]
        states = [it[2] for it in items]
        adamw_fp32_state([p for p, *_ in items], [g for _, g, *_ in items], [st["exp_avg"] for st in states],
                         [st["exp_avg_sq"] for st in states], None, [st["step"] for st in states], lr=group["lr"],
                         beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                         compensation=group["compensation"], comps=[st.get("kahan_comp") for st in states],
                         positions=[it[3] for it in items], found_inf=_triton.flag(self, items[0][0].device),
                         c_kernel=group["compile"] is None, offsets=offsets)
