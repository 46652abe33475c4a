"""AdamW with blockwise 4-bit moments: :class:`.adamw8bit.AdamW8bit`'s math, its moments in :mod:`.quant4`'s codec.

State per 4-bit parameter: ``step``, ``exp_avg`` (signed codes) and ``exp_avg_sq`` (unsigned codes: its root on 16
linear levels, never decoded as 0), two per byte, each with its ``*_absmax`` (fp32, one per block of 128): 2 * (0.5 +
4 / 128) = 1.06 bytes per parameter. With bf16 weights (2 bytes) and gradients released in backward, weights +
gradients + state measured 3.10 bytes per parameter on a Llama-shaped model (docs/results/memory_release.md). Tensors under ``min_8bit_size`` elements, embeddings (unless
``embedding_state`` says otherwise) and ``fp32_state_params`` keep fp32 moments, as every quantized family.

Everything but the codec is :class:`.adamw8bit.AdamW8bit`'s: its update (:func:`.adamw8bit.adamw_update`), its
coefficients, its fp32-state step, and the quantized machinery of :class:`._blockwise.Blockwise8bit` (the kernel made
from the update, compensated bf16/fp16 writes, FSDP2 rows of whole blocks, canonical state dicts and all-or-nothing
loading), which reads block size, layouts and bytes from the Family's codec. On CPU, contiguous fp32 and bf16 tensors
take the C kernel ``adamw4bit_cpu.c`` (AdamW8bit's update, ``adamw_update.h``, driven by ``blockwise.h`` over
``quant4.h``), and on CUDA the Triton kernel ``blockwise_triton.adamw4bit`` (AdamW8bit's program, written once, over
``quant4_triton``'s codec: one launch per group and dtype pair), each admitted by the probe every kernel passes (the
eager kernel's codes and scales exactly); elsewhere the ``torch.compile``'d kernel (or, without a compiler or with
``compile=False``, the eager one).

Checkpoints: ``state_dict()`` holds :mod:`.quant4`'s canonical codes (a matrix's codes are its shape with the last
dimension halved). Families of AdamW's math convert each other's state (checkpoint.py): 8-bit or fp32 moments load
into 4-bit state, quantized, with a warning that says so; torchao's ``AdamW4bit`` state loads through its layout
(backends.torchao_layout: decoded as torchao decodes it, then quantized in this codec).
"""

from __future__ import annotations

from . import quant4
from .adamw8bit import AdamW8bit
from .facts import KAHAN, STEP, Family, codes

__all__ = ["ADAMW4BIT", "AdamW4bit"]

ADAMW4BIT = Family("adamw4bit", {"step": STEP, "exp_avg": codes(quant4, signed=True),
                                 "exp_avg_sq": codes(quant4, signed=False), "kahan_comp": KAHAN}, "adamw")


class AdamW4bit(AdamW8bit):
    """AdamW with blockwise 4-bit moments (:mod:`.quant4`): ``AdamW8bit``'s arguments, math and state keys.

    Example::

        opt = AdamW4bit(model.parameters(), lr=2e-5, weight_decay=0.01,
                        fp32_state_params=[model.get_input_embeddings().weight])
    """

    FACTS = ADAMW4BIT
    C_KERNEL = True  # adamw4bit_cpu.c: adamw_update.h through blockwise.h over quant4.h
    TRITON_KERNEL = True  # blockwise_triton.adamw4bit: AdamW8bit's program over quant4_triton's codec
